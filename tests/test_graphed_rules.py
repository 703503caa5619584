"""The tensor rule replayed from a CUDA graph (``_device.GraphedCall``, ``TensorState.run_rule``).

Off unless ``LOSSSCALE_GRAPHED_RULES=1``, and only on CUDA: no GPU has verified it yet
(``benchmarks/graph_rule.py``, a ``benchmarks/gpu_check.py`` step, measures it on the first one).
Here a twin stands for the graph (``tests/_fake_cuda.TwinGraphedCall``): it keeps the same static buffers and runs the same warm-up and
restore, and its "replay" calls the rule on the static buffers, which is what a replay computes. It
checks everything around the graph (the cache and its key, the static inputs, the state left as it
was by the warm-up), not capture itself.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import lossscale
from lossscale import _device
from lossscale._state import TensorState
from _fake_cuda import twin_graphed_rules
from _iterations import make_iteration


@pytest.fixture
def twin():
    """Graph replay switched on for CPU tensors, with the twin standing for the graph."""
    with twin_graphed_rules() as twin:
        yield twin


def _run(kwargs, steps=12, bad_at=(3, 4, 9)):
    it = make_iteration("lossscale", "fused_sgd", device="cpu", **kwargs)
    for step in range(steps):
        it.run(bad="nan" if step in bad_at else "inf" if step == 6 else None)
    return it


@pytest.mark.parametrize("kwargs", [{}, {"hysteresis": 2, "growth_interval": 2}, {"policy": "adaptive"},
                                    {"policy": "logmax"}, {"clip": 1.0, "growth_interval": 3}])
def test_a_replayed_rule_leaves_what_the_eager_rule_leaves(twin, kwargs):
    replayed = _run(kwargs)
    assert twin.built == 1 and twin.replays == 12  # one capture, then a replay per update
    with pytest.MonkeyPatch.context() as off:
        off.setattr(_device, "replays_rules", lambda device: False)
        eager = _run(kwargs)
    assert eager.scaler._s.t._replay is None
    assert replayed.scaler.state() == eager.scaler.state() and replayed.scaler.state().skipped_steps >= 4
    assert all(torch.equal(a, b) for a, b in zip(replayed.model.parameters(), eager.model.parameters()))


def test_building_the_replay_leaves_the_state_as_it_was(twin):
    policy = lossscale.DynamicPolicy(growth_interval=1)  # every warm-up run would grow the scale
    t = TensorState(policy.init_state(), torch.device("cpu"))
    before = t.buffer.clone()
    flags = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1])  # clean (FLAG_LAYOUT)
    twin(lambda f, a: policy.tensor_update(t, f, a), (flags, None), t.buffer)
    assert torch.equal(t.buffer, before)


def test_a_new_configuration_is_captured_again_and_the_old_graph_let_go(twin):
    it = _run({}, steps=3, bad_at=())
    t = it.scaler._s.t
    first = t._replay
    it.scaler.set_growth_factor(4.0)  # a new policy object: the old graph computed with growth 2
    _run_on(it, 2)
    assert twin.built == 2 and t._replay is not first and t._replay[0][0] == it.scaler.policy
    _run_on(it, 2)
    assert twin.built == 2  # the same configuration again: replayed


def _run_on(it, steps):
    for _ in range(steps):
        it.run()


def make_iteration_like(it, scaler):
    """``it`` driven by another scaler."""
    return type(it)(it.model, it.optimizer, scaler, it.device)


def test_a_scaler_with_a_replay_pickles_and_copies_and_captures_again(twin):
    it = _run({}, steps=3, bad_at=())
    t = it.scaler._s.t
    for clone in (copy.deepcopy(t), pickle.loads(pickle.dumps(t))):
        assert clone._replay is None and torch.equal(clone.buffer, t.buffer)
    for clone in (copy.deepcopy(it.scaler), pickle.loads(pickle.dumps(it.scaler))):
        assert clone.state() == it.scaler.state()
        _run_on(make_iteration_like(it, clone), 2)
    assert it.scaler._s.t._replay is not None  # the original keeps its own
    assert twin.built == 3  # and each clone captured its own at its first update


def test_graphed_rules_are_off_by_default_and_never_off_cuda(monkeypatch):
    monkeypatch.delenv("LOSSSCALE_GRAPHED_RULES", raising=False)
    assert not _device.replays_rules(torch.device("cpu"))
    monkeypatch.setenv("LOSSSCALE_GRAPHED_RULES", "1")
    assert not _device.replays_rules(torch.device("cpu"))  # CUDA graphs only: a CPU rule is called
    it = _run({}, steps=3, bad_at=())
    assert it.scaler._s.t._replay is None
