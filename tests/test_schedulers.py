"""Skip-aware scheduling reads the decision of the step it follows, in either order of the calls.

torch's documented order is ``scaler.step(o); scaler.update(); scheduler.step()``, but many loops write
``scaler.step(o); scheduler.step(); scaler.update()``. In the second order the scaler's last *update*
is the previous iteration's: reading it moved the LR on the skipped step and held it on the next clean
one (measured before the fix: 0.05, 0.025, 0.0125 on the skipped step, 0.0125).
"""

from __future__ import annotations

import math

import pytest
import torch
from _sync import count_host_syncs

import lossscale
from lossscale.schedulers import skip_aware

SKIP_AT = 2


def _loop(order: str, optimizer: str, how: str, steps: int = 4):
    """LRs after each iteration; the iteration ``SKIP_AT`` has an inf gradient."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.1)
        if optimizer == "sgd"
        else torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = lossscale.GradScaler()
    if how == "wrapper":
        skip_aware(sched, scaler)
    lrs, skipped = [], []
    for step in range(steps):
        opt.zero_grad()
        scaler.scale(model(torch.ones(1, 3)).sum()).backward()
        if step == SKIP_AT:
            model.weight.grad[0, 0] = math.inf
        scaler.step(opt)

        def advance():
            if how == "wrapper":
                sched.step()
            else:
                scaler.step_scheduler(sched)

        if order == "natural":
            advance()
            scaler.update()
        else:
            scaler.update()
            advance()
        lrs.append(opt.param_groups[0]["lr"])
        skipped.append(scaler.last_step_skipped)
    return lrs, skipped


@pytest.mark.parametrize("how", ["step_scheduler", "wrapper"])
@pytest.mark.parametrize("optimizer", ["sgd", "fused_adam"])
@pytest.mark.parametrize("order", ["natural", "after_update"])
def test_the_lr_holds_on_the_skipped_step_in_either_order(order, optimizer, how):
    lrs, skipped = _loop(order, optimizer, how)
    assert skipped == [False, False, True, False]
    assert lrs == [0.05, 0.025, 0.025, 0.0125]


def _three_steps(optimizer):
    """A linear model, its optimizer and a scaler; yields after each step() of three iterations whose
    second has a NaN gradient (with whether it is bad): the caller checks, then calls update()."""
    model = torch.nn.Linear(3, 2)
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.1)
        if optimizer == "sgd"
        else torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    )
    scaler = lossscale.GradScaler()
    for bad in (False, True, False):
        scaler.scale(model(torch.ones(1, 3)).sum()).backward()
        if bad:
            model.weight.grad[0, 0] = math.nan
        scaler.step(opt)
        yield scaler, opt, bad
        opt.zero_grad()


@pytest.mark.parametrize("optimizer", ["sgd", "fused_adam"])
def test_last_step_skipped_between_step_and_update_is_this_steps_decision(optimizer):
    for scaler, opt, bad in _three_steps(optimizer):
        assert scaler.last_step_skipped is bad
        assert scaler.step_was_skipped(opt) is bad
        scaler.update()
        assert scaler.last_step_skipped is bad


def test_a_scheduler_stepped_before_the_optimizer_is_refused_with_what_to_do():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = lossscale.GradScaler()
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"after scaler\.step\(optimizer\)"):
        scaler.step_scheduler(sched)
    assert opt.param_groups[0]["lr"] == 0.1  # nothing moved
    skip_aware(sched, scaler)
    with pytest.raises(RuntimeError, match=r"after scaler\.step\(optimizer\)"):
        sched.step()
    scaler.step(opt)
    assert scaler.step_scheduler(sched) is True  # now in order
    scaler.update()


def test_two_optimizers_each_scheduler_follows_its_own_optimizer():
    """Each optimizer skips on its own gradients (as torch): its scheduler follows it."""
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=1, gamma=0.5)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, step_size=1, gamma=0.5)
    scaler = lossscale.GradScaler()
    scaler.scale((a(torch.ones(1, 3)) + b(torch.ones(1, 3))).sum()).backward()
    b.weight.grad[0, 0] = math.inf
    scaler.step(opt_a)
    scaler.step(opt_b)
    assert scaler.step_scheduler(sched_a) is True
    assert scaler.step_scheduler(sched_b) is False
    assert scaler.last_step_skipped is True  # the iteration as a whole was skipped (the scale backs off)
    scaler.update()
    assert opt_a.param_groups[0]["lr"] == 0.05 and opt_b.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize("optimizer", ["sgd", "fused_adam"])
def test_skip_flag_is_a_host_bool_where_the_host_decided_and_a_device_flag_otherwise(optimizer):
    fused = optimizer == "fused_adam"
    for scaler, opt, bad in _three_steps(optimizer):
        for when in ("before update", "after update"):
            with count_host_syncs() as syncs:
                flag = scaler.skip_flag(opt)
            assert syncs.count == 0, (when, syncs.ops)
            if fused:
                assert isinstance(flag, torch.Tensor) and flag.dtype == torch.bool and flag.dim() == 0, when
                assert bool(flag) is bad, when
            else:
                assert flag is bad, when
            if when == "before update":
                scaler.update()


@pytest.mark.parametrize("enabled", [True, False])
def test_an_optimizer_or_a_non_scheduler_is_refused_and_nothing_steps(enabled):
    # Both have step(): step_scheduler(optimizer) would move the weights a second time, unguarded.
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = lossscale.GradScaler(enabled=enabled)
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    scaler.step(opt)
    after_step = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=r"got an optimizer \(SGD\).*pass the LR scheduler.*scaler\.step\(optimizer\)"):
        scaler.step_scheduler(opt)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), after_step))  # the weights did not move
    with pytest.raises(TypeError, match=r"takes an LR scheduler \(an object with a step\(\) method.*got str"):
        scaler.step_scheduler("x")
    scaler.update()
    assert scaler.counters()["steps"] == (1 if enabled else 0)


def test_schedulers_of_every_kind_still_step():
    # torch's LRScheduler, ReduceLROnPlateau (with its metric), and a duck-typed one with no optimizer.
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    class Duck:  # the shape of DeepSpeed's WarmupLR or a hand-written schedule: step() and nothing more
        calls = 0

        def step(self):
            self.calls += 1

    duck = Duck()
    scaler = lossscale.GradScaler()
    for loss_value in (1.0, 2.0):
        scaler.scale(model(torch.ones(1, 3)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        assert scaler.step_scheduler(plateau, loss_value) is True
        assert scaler.step_scheduler(step_lr) is True
        assert scaler.step_scheduler(duck) is True
    assert duck.calls == 2 and plateau.num_bad_epochs == 0  # the second loss was worse: the plateau acted
