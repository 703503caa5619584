"""``scaler.on_step(fn)``: whether the step was taken, after every update (issue 32), and
``record_overflow()``: an overflow a framework found itself (DeepSpeed's ZeRO)."""

import copy
import math
import pickle

import pytest
import torch
from _sync import count_host_syncs

import lossscale


def _loop(scaler, opt, p, steps, bad=()):
    for step in range(steps):
        opt.zero_grad()
        scaler.scale((p * p).sum()).backward()
        if step in bad:
            p.grad[0] = math.inf
        scaler.step(opt)
        scaler.update()


@pytest.mark.parametrize("fused", [False, True], ids=["synced", "fused"])
def test_on_step_says_whether_each_step_was_taken_without_a_sync(fused):
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([p], lr=0.1, fused=True) if fused else torch.optim.SGD([p], lr=0.1)
    scaler = lossscale.GradScaler()
    seen = []
    scaler.on_step(seen.append)
    _loop(scaler, opt, p, 1)  # warm: first-call work
    with count_host_syncs() as syncs:
        _loop(scaler, opt, p, 5, bad={2})
    assert syncs.count == (0 if fused else 5)  # the synced path's own decision, none added
    taken = [bool(t) for t in seen]
    assert taken == [True, True, True, False, True, True]
    kinds = {type(t) for t in seen}
    assert kinds == ({torch.Tensor} if fused else {bool})  # a device flag on the fused path, documented
    if fused:
        assert all(t.dtype == torch.bool and t.dim() == 0 for t in seen)


def test_a_correction_that_must_run_on_taken_steps_only():
    # NVFlare #4838 took "before the optimizer step" as proof of a step; a SCAFFOLD correction then
    # ran on skipped ones. Counted through on_step, the taken steps are exactly the steps not skipped.
    p = torch.nn.Parameter(torch.ones(3))
    scaler = lossscale.GradScaler()
    corrections = []
    scaler.on_step(lambda taken: corrections.append(1) if taken else None)
    _loop(scaler, torch.optim.SGD([p], lr=0.1), p, 10, bad={1, 4, 5})
    assert len(corrections) == scaler.counters()["steps"] - scaler.counters()["skipped_steps"] == 7


def test_a_removed_callback_is_not_called_and_copies_keep_none():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = lossscale.GradScaler()
    seen = []
    handle = scaler.on_step(seen.append)
    _loop(scaler, opt, p, 2)
    twin, thawed = copy.deepcopy(scaler), pickle.loads(pickle.dumps(scaler))
    handle.remove()
    _loop(scaler, opt, p, 2)
    for other in (twin, thawed):
        _loop(other, opt, p, 1)
    assert seen == [True, True]


@pytest.mark.parametrize("nan", [False, True])
def test_record_overflow_is_an_overflow_of_the_scalers_own(nan):
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    ours, reference = lossscale.GradScaler(init_scale=2.0**10), lossscale.GradScaler(init_scale=2.0**10)
    _loop(ours, opt, p, 1)
    _loop(reference, opt, p, 1)
    seen = []
    ours.on_step(seen.append)
    before = p.detach().clone()
    ours.scale((p * p).sum()).backward()
    ours.record_overflow(nan=nan)  # the framework skipped its step and says so
    p.grad.fill_(math.nan if nan else math.inf)
    reference.scale((p * p).sum())
    reference.step(opt)
    reference.update()
    assert torch.equal(p, before) and seen == [False] and ours.last_step_skipped
    assert ours.state() == reference.state()  # counters, streak, scale: as its own check's
    assert ours.state().nan_steps == int(nan)
