"""The integration examples run (shortened) and do what their docstrings say: FP16 steps skipped at
the start, the LR schedule advanced only on taken steps, TensorBoard logs written."""

import importlib.util
from pathlib import Path

import pytest
from _integration_models import fresh_accelerate_state  # noqa: F401  (fixture)

pytestmark = [
    pytest.mark.usefixtures("one_thread"),  # conftest: tiny ops, one thread
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated"),
]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _fresh(fresh_accelerate_state):  # noqa: F811  the pytest fixture imported from _integration_models
    """accelerate's process-wide state, reset around every test (see _integration_models)."""


def test_accelerate_example(tmp_path):
    result = _load("accelerate_fp16").main(steps=40, logdir=str(tmp_path))
    assert result["skipped"] > 0  # init_scale=2**24 overflows FP16 at first
    assert result["scheduler_steps"] == 40 - result["skipped"]
    assert any(tmp_path.glob("events.out.tfevents*"))


def test_transformers_example(tmp_path):
    last = _load("transformers_trainer_fp16").main(steps=12, output_dir=str(tmp_path))
    assert last["scaler/skipped_steps"] > 0
    assert last["step"] == 12
    assert any(tmp_path.rglob("events.out.tfevents*"))


@pytest.mark.parametrize("fabric", [False, True])
def test_lightning_example(tmp_path, fabric):
    result = _load("lightning_fp16").main(steps=40, fabric=fabric, logdir=str(tmp_path))
    assert result["skipped"] > 0
    assert result["scheduler_steps"] == 40 - result["skipped"]
    assert any(Path(result["logdir"]).glob("events.out.tfevents*"))
