"""lossscale.integrations.megatron against the real megatron-core, on CPU.

Megatron-core puts its scaler's and optimizer's tensors on ``device='cuda'`` and checks that the
parameters it wraps are ``torch.cuda.*Tensor``. On this CPU-only bench, :class:`OnCpu` (a torch
function mode, test-only) runs Megatron's own classes unchanged with those tensors on the CPU.
"""

import random
import socket
import subprocess
import sys
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode

pytest.importorskip("megatron.core")

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
from megatron.core.optimizer.grad_scaler import DynamicGradScaler, MegatronGradScaler  # noqa: E402

import lossscale  # noqa: E402
from lossscale.integrations import megatron as ls_megatron  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


class OnCpu(TorchFunctionMode):
    """Megatron-core on a CPU: tensors it asks for on 'cuda' are made on the CPU, ``.cuda()`` is the
    tensor itself, and ``tensor.type()`` names the CUDA type it checks for (optimizer.py:690-699)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def _megatron(**kw):
    with OnCpu():
        return DynamicGradScaler(**kw)


def test_it_is_a_megatron_grad_scaler_and_importing_imports_no_megatron():
    assert issubclass(ls_megatron.GradScaler, MegatronGradScaler)
    code = "import sys, lossscale.integrations.megatron\nprint('megatron' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_bitwise_megatrons_dynamic_grad_scaler_over_random_fault_sequences():
    for seed in range(80):
        rng = random.Random(seed)
        init = 2.0 ** rng.randint(0, 24)
        kw = dict(
            initial_scale=init,
            min_scale=min(init, 2.0 ** rng.randint(-3, 3)),
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=rng.randint(2, 6),
            hysteresis=rng.randint(1, 4),
        )
        ref, mine = _megatron(**kw), ls_megatron.GradScaler(**kw, device="cpu", on_stuck="ignore")
        rate = rng.choice([0.05, 0.3, 0.7])
        for i in range(150):
            found_inf = rng.random() < rate
            ref.update(found_inf)
            mine.update(found_inf)
            assert torch.equal(mine.scale, ref.scale) and torch.equal(mine.inv_scale, ref.inv_scale), (seed, i, kw)
            if i == 75:  # a Megatron checkpoint continues exactly
                mine.load_state_dict(ref.state_dict())


def test_growth_past_float32_is_refused_where_megatron_reaches_inf():
    ref, mine = (
        _megatron(
            initial_scale=2.0**126,
            min_scale=1.0,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=1,
            hysteresis=1,
        ),
        ls_megatron.GradScaler(2.0**126, 1.0, 2.0, 0.5, 1, 1, device="cpu"),
    )
    for _ in range(2):
        ref.update(False)
        mine.update(False)
    assert ref.scale.item() == float("inf") and mine.get_scale() == 2.0**127


def _fp16_optimizer(scaler_factory, seed=0):
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    torch.manual_seed(seed)
    with OnCpu():
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).half()
        inner = torch.optim.Adam(model.parameters(), lr=1e-2)
        opt = Float16OptimizerWithFloat16Params(
            inner, OptimizerConfig(fp16=True, lr=1e-2, clip_grad=0.0), scaler_factory(), lambda o, c=None: None
        )
    return model, opt


@pytest.fixture(scope="module")
def gloo():
    """One rank on gloo and Megatron's model-parallel groups (of one), as its optimizer all-reduces
    found_inf over them (optimizer.py:511-516)."""
    from megatron.core import parallel_state

    owned = not torch.distributed.is_initialized()
    if owned:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    with OnCpu():
        parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    if owned:
        torch.distributed.destroy_process_group()


def _train(model, opt, faults, steps=8):
    """Megatron's fp16 loop (loss scaled by the optimizer, its step() decides); per step: stepped,
    scale, weights after."""
    out = []
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(4, 4, generator=g).half()
        with OnCpu():
            loss = model(x).float().pow(2).mean()
            opt.scale_loss(loss).backward()
            if i in faults:
                model[0].weight.grad[0, 0] = faults[i]
            stepped, _, _ = opt.step()
            opt.zero_grad()
        out.append((stepped, opt.get_loss_scale().item(), [p.detach().clone() for p in model.parameters()]))
    return out


def test_a_real_megatron_fp16_optimizer_steps_as_with_megatrons_scaler(gloo):
    kw = dict(
        initial_scale=2.0**10, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=2
    )
    faults = {1: float("nan"), 2: float("inf"), 5: float("inf")}
    ref = _train(*_fp16_optimizer(lambda: DynamicGradScaler(**kw)), faults)
    model, opt = _fp16_optimizer(lambda: DynamicGradScaler(**kw))
    scaler = ls_megatron.attach(opt)
    assert opt.grad_scaler is scaler and scaler.get_scale() == 2.0**10
    mine = _train(model, opt, faults)
    assert [r[0] for r in mine] == [r[0] for r in ref] == [True, False, False, True, True, False, True, True]
    assert [r[1] for r in mine] == [r[1] for r in ref]
    assert all(torch.equal(a, b) for r, q in zip(mine, ref) for a, b in zip(r[2], q[2]))  # weights bitwise
    assert torch.equal(mine[2][2][0], mine[0][2][0])  # skipped steps left the weights as they were
    # Megatron only says found_inf; the scaler looked at the main gradients: one NaN, two inf
    assert scaler.counters() == {
        "steps": 8,
        "skipped_steps": 3,
        "inf_steps": 2,
        "nan_steps": 1,
        "bad_loss_steps": 0,
        "overflow_streak": 0,
    }
    report = ls_megatron.log_health(opt)
    assert report.steps == 8 and report.skipped == 3
    saved = opt.state_dict()["grad_scaler"]
    assert set(saved) == {"scale", "growth_tracker", "hysteresis_tracker", "lossscale"}


def test_state_dict_round_trip_keeps_everything_and_loads_a_gradscalers():
    mine = ls_megatron.GradScaler(2.0**12, 1.0, 2.0, 0.5, 3, 2, device="cpu")
    for found in (True, False, True, True, False, False, False, False):
        mine.update(found, found_nan=False)
    sd = mine.state_dict()
    other = ls_megatron.GradScaler(device="cpu")
    other.load_state_dict(sd)
    assert other.state() == mine.state() and torch.equal(other.scale, mine.scale)
    scaler = lossscale.GradScaler("cpu", init_scale=2.0**5)
    other.load_state_dict(scaler.state_dict())
    assert other.get_scale() == 32.0
    with pytest.raises(ValueError, match="growth_tracker"):
        other.load_state_dict({"scale": torch.tensor([8.0])})


def test_a_bad_loss_through_scale_loss_skips_without_backing_off():
    mine = ls_megatron.GradScaler(2.0**12, 1.0, 2.0, 0.5, 1000, 1, device="cpu")
    scaled = mine.scale_loss(torch.tensor(float("nan")))
    assert scaled.isnan()
    mine.update(True)
    assert mine.get_scale() == 2.0**12 and mine.counters()["bad_loss_steps"] == 1
    mine.scale_loss(torch.tensor(3.0))
    mine.update(True)  # a finite loss: the scale's overflow
    assert mine.get_scale() == 2.0**11


def test_an_overflow_at_min_scale_is_diagnosed():
    mine = ls_megatron.GradScaler(2.0, 1.0, 2.0, 0.5, 1000, 1, device="cpu")
    mine.update(True, found_nan=False)
    with pytest.warns(RuntimeWarning, match="smallest scale allowed"):
        mine.update(True, found_nan=False)
    raising = ls_megatron.GradScaler(1.0, 1.0, 2.0, 0.5, 1000, 1, device="cpu", on_stuck="raise")
    with pytest.raises(RuntimeError, match="scaler.health"):
        raising.update(True, found_nan=False)


def test_validation_names_the_argument():
    with pytest.raises(ValueError, match="min_scale"):
        ls_megatron.GradScaler(1.0, 4.0, device="cpu")
    with pytest.raises(ValueError, match="policy= was given"):
        ls_megatron.GradScaler(2.0**8, policy=lossscale.DynamicPolicy(), device="cpu")
    with pytest.raises(ValueError, match="no grad scaler"):
        ls_megatron.attach(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0))
    with pytest.raises(ValueError, match="has no lossscale scaler"):
        ls_megatron.log_health(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0))


def test_public_names_have_docstrings():
    assert ls_megatron.__doc__
    for name in ls_megatron.__all__:
        obj = getattr(ls_megatron, name)
        assert obj.__doc__, name
        for attr, member in vars(obj).items() if isinstance(obj, type) else ():
            if not attr.startswith("_") and (callable(member) or isinstance(member, property)):
                assert member.__doc__, f"{name}.{attr}"
