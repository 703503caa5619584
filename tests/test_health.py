"""The run-health account (issue 21 item 1): scripted runs through the pure policies, then the same
through a real GradScaler on the synced (SGD) and the device (fused Adam) path, then the integrations.

Every scripted run asserts the counts of each kind of skip and the verdict: a clean run, a
calibration-only run, bad batches, persistent NaN and a run stuck at min_scale (the issue's "done when").
"""

from __future__ import annotations

import copy
import logging
import math
import pickle
import warnings

import pytest
import torch
from _integration_models import fresh_accelerate_state  # noqa: F401  (fixture)
from hypothesis import given, settings
from hypothesis import strategies as st
from test_stuck import _model  # Linear, Tanh, Blowup (factor=inf: a non-finite forward), Linear

import lossscale
from lossscale import AdaptivePolicy, DynamicPolicy, LogMaxPolicy, StaticPolicy
from lossscale.health import HELD, SETTLE, Health, HealthReport

KINDS = ("calibration", "overflow", "bad_batch", "persistent_nan", "earlier")


# --------------------------------------------------------------------------------- scripted runs
def clean(step, scale):
    return {}


def above(limit):
    """Overflow whenever the scale is above ``limit`` (gradients that fit FP16 only below it)."""
    return lambda step, scale: {"found_inf": scale > limit}


def at(steps, **flags):
    """``flags`` (default found_inf) at the given steps, clean elsewhere."""
    steps = steps if isinstance(steps, range) else set(steps)
    flags = flags or {"found_inf": True}
    return lambda step, scale: flags if step in steps else {}


def both(*rules):
    """The first rule that flags something."""

    def rule(step, scale):
        for r in rules:
            flags = r(step, scale)
            if flags.get("found_inf") or flags.get("bad_loss"):
                return flags
        return {}

    return rule


NAN = {"found_inf": True, "found_nan": True}
BAD = {"found_inf": True, "found_nan": True, "bad_loss": True}


def script(policy, rule, n, *, record=lambda i: True, amax=None, state=None):
    """Run ``policy.update`` for ``n`` steps with the flags ``rule(step, scale)`` gives, recording the
    steps ``record(step)`` selects; returns (final state, report, health)."""
    s = policy.init_state() if state is None else state
    h = Health(s)
    for i in range(n):
        before = s.scale
        flags = {"found_inf": False, **rule(i, before)}
        if amax is not None and "amax" not in flags:
            flags["amax"] = None if flags["found_inf"] else amax(before)
        s = policy.update(s, **flags)
        if record(i):
            h.record(policy, s, before)
    return s, h.report(policy, s), h


def kinds(r: HealthReport):
    return {k: getattr(r, k) for k in KINDS if getattr(r, k)}


def assert_adds_up(r: HealthReport):
    assert sum(getattr(r, k) for k in KINDS) == r.skipped
    assert r.overflow_after_growth <= r.overflow


def test_a_clean_run_is_healthy_under_every_policy():
    for policy, amax in [
        (DynamicPolicy(), None),
        (StaticPolicy(), None),
        (AdaptivePolicy(), lambda s: s * 2.0**-20),
        (LogMaxPolicy(), lambda s: s * 2.0**-20),
    ]:
        s, r, _ = script(policy, clean, 120, amax=amax)
        assert (r.verdict, r.steps, r.skipped, kinds(r), r.streak) == ("healthy", 120, 0, {}, 0), policy.name
        assert r.steps_since_overflow is None and not r.calibrating
        assert r.text.startswith("lossscale health: healthy. 120 steps, none skipped.")
    _, r, _ = script(DynamicPolicy(), clean, 120)
    assert r.scale == 2.0**16 and r.scale_held == 120


def test_a_calibration_only_run_says_the_skips_were_the_scale_calibrating():
    # The gradients fit FP16 only at 2**10 or below: torch's start at 2**16 skips 6 steps, then trains.
    s, r, _ = script(DynamicPolicy(), above(2.0**10), 300)
    assert r.verdict == "healthy"
    assert kinds(r) == {"calibration": 6} and r.skipped == 6 and r.streak == 0
    assert r.steps_since_overflow == 294 and r.scale == 2.0**10 and r.scale_held == 294
    assert "6 while the scale calibrated" in r.text and "What to do: nothing." in r.text
    # Mid-calibration the scale is still searching: recovering, every skip so far calibration.
    _, r, _ = script(DynamicPolicy(), above(2.0**10), 3)
    assert (r.verdict, kinds(r), r.streak, r.calibrating) == ("recovering", {"calibration": 3}, 3, True)
    assert "still calibrating" in r.text


def test_calibration_ends_after_a_clean_stretch_and_later_overflows_are_steady():
    # growth_interval=10: the stretch is 10 clean steps. Grown to 2**11 the scale overflows right away:
    # the dynamic policy probing upward, one overflow per growth, each right after it.
    policy = DynamicPolicy(growth_interval=10)
    assert policy.settle_steps() == 10
    s, r, _ = script(policy, above(2.0**10), 100)
    assert r.calibration == 6  # 2**16 .. 2**11
    assert r.overflow == r.overflow_after_growth > 0
    assert r.verdict == "healthy" and not r.calibrating
    assert "right after the scale grew" in r.text
    # Torch's interval: the stretch is SETTLE steps; an overflow a few steps after the descent is still it,
    # one at a scale that had held HELD steps is not: the gradients or the data outgrew a scale that fit.
    _, r, _ = script(DynamicPolicy(), both(above(2.0**10), at([6 + HELD - 1])), 100)
    assert kinds(r) == {"calibration": 7}
    _, r, _ = script(DynamicPolicy(), both(above(2.0**10), at([6 + HELD])), 100)
    assert kinds(r) == {"calibration": 6, "overflow": 1} and not r.calibrating
    _, r, _ = script(DynamicPolicy(), both(above(2.0**10), at([6 + SETTLE + 5])), 100)
    assert kinds(r) == {"calibration": 6, "overflow": 1} and r.overflow_after_growth == 0
    assert r.verdict == "healthy"  # one overflow in steady training: the scale answered it


def test_an_overflow_at_a_scale_that_had_held_is_not_calibration():
    # At the initial scale: an overflow on step HELD (after HELD - 1 clean steps) is still the search's;
    # one on step HELD + 1 or later, at a scale that had held, is the gradients' or the data's.
    _, r, _ = script(DynamicPolicy(), at([HELD - 1]), 100)
    assert kinds(r) == {"calibration": 1}
    _, r, _ = script(DynamicPolicy(), at([HELD]), 100)
    assert kinds(r) == {"overflow": 1} and not r.calibrating and r.verdict == "healthy"
    assert "1 overflow in steady training (not calibration: the scale had held) or while stuck." in r.text
    assert "calibrated" not in r.text


def _loss_jump_run(trace, steps=40, jump_at=20):
    """A clean FP16 run on CPU whose loss is multiplied by 1e6 at step ``jump_at`` (counting from 1)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = lossscale.GradScaler(model=model, trace=trace)
    for step in range(1, steps + 1):
        x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss * 1e6 if step == jump_at else loss).backward()
        scaler.step(opt)
        scaler.update()
    return scaler


def test_a_loss_jump_in_a_clean_run_is_an_overflow_with_its_cause_not_calibration():
    """The loss times 1e6 at step 20 of a clean run was reported as "while the scale calibrated", without
    its cause, and the step numbers' origin was not said."""
    scaler = _loss_jump_run(trace=True)
    r = scaler.health()
    assert (r.verdict, kinds(r), r.steps, r.scale) == ("healthy", {"overflow": 1}, 40, 2.0**15)
    assert "calibrated" not in r.text
    step, cause = r.overflow_cause
    assert step == 20 and cause == "the backward of `2` overflowed fp16 at scale 2^16: the loss scale (backed off)."
    assert (
        "First cause of the last overflow in steady training, at step 20: the backward of `2` overflowed fp16 "
        "at scale 2^16: the loss scale (backed off)." in r.text
    )
    assert r.text.count("Steps count from 1") == 1
    assert r.text.endswith("(Steps count from 1: step 1 is the first update.)")
    assert r.causes == () and "overflow_cause" not in "".join(r.metrics())
    # Without the trace the kind is the same; no cause is kept, and no step is named.
    r = _loss_jump_run(trace=False).health()
    assert kinds(r) == {"overflow": 1} and r.overflow_cause is None and "Steps count" not in r.text


def test_bad_batches_are_counted_apart_and_training_stays_healthy():
    s, r, h = script(DynamicPolicy(), at([40, 90, 91], **BAD), 150)
    assert kinds(r) == {"bad_batch": 3} and r.scale == 2.0**16  # the scale was kept
    assert r.verdict == "healthy" and r.steps_since_overflow is None
    assert "3 bad batches" in r.text and "not the scale" in r.text and "Look at the data" in r.text
    # Mixed with calibration: each skip its own kind.
    _, r, _ = script(DynamicPolicy(), both(at([2, 60], **BAD), above(2.0**12)), 100)
    assert kinds(r) == {"calibration": 4, "bad_batch": 2}
    # Bad losses in a row: recovering, then stuck at BAD_LOSS_STREAK (10).
    _, r, _ = script(DynamicPolicy(), at(range(50, 55), **BAD), 55)
    assert (r.verdict, r.streak) == ("recovering", 5) and "check the data" in r.text
    _, r, _ = script(DynamicPolicy(), at(range(50, 60), **BAD), 60)
    assert (r.verdict, kinds(r)) == ("stuck", {"bad_batch": 10})
    assert "before scaling in every one of them" in r.text


def test_bad_batch_causes_keep_the_last_few_and_are_described_lazily():
    policy = DynamicPolicy()
    s, h = policy.init_state(), Health(policy.init_state())
    for i in range(10):
        before = s.scale
        s = policy.update(s, **(BAD if i % 2 else {"found_inf": False}))
        h.record(policy, s, before, cause=f"evidence {i}")
    r = h.report(policy, s, describe=lambda cause, scale: f"{cause} at {scale:g}")
    assert r.causes == ((6, "evidence 5 at 65536"), (8, "evidence 7 at 65536"), (10, "evidence 9 at 65536"))
    assert "First causes of the last bad batches: step 6: evidence 5 at 65536" in r.text
    assert h.report(policy, s).causes[0] == (6, "evidence 5")
    assert pickle.loads(pickle.dumps(h)).report(policy, s).causes == ()  # device evidence stays home


def test_persistent_nan_is_stuck_once_the_scale_cannot_answer():
    # NaN from step 100 on: the scale halves 16 times to min_scale=1, then the policy calls it stuck;
    # every NaN skip of the streak was the same NaN. Above FP16's smallest subnormal it may still be a
    # backward overflow that a lower scale fits: the advice says both.
    floor_1 = DynamicPolicy(min_scale=1.0)
    s, r, _ = script(floor_1, at(range(100, 2**62), **NAN), 130)
    assert (r.verdict, kinds(r), r.streak) == ("stuck", {"persistent_nan": 30}, 30)
    assert r.scale == 1.0 and "NaN kept coming while the scale went from 2^16 to 2^0. It may be a backward" in r.text
    assert "lower min_scale" in r.text and "Otherwise the scale is not the cause" in r.text
    # With the default floor, 2**-24, the scale halves 40 times: a NaN still there is not the scale's.
    s, r, _ = script(DynamicPolicy(), at(range(100, 2**62), **NAN), 150)
    assert (r.verdict, kinds(r), r.scale) == ("stuck", {"persistent_nan": 50}, 2.0**-24)
    assert "from 2^16 to 2^-24: a smaller scale cures an overflow, not this NaN" in r.text
    # Before the floor it could still be an overflow (inf - inf is NaN): recovering, counted as such.
    _, r, _ = script(floor_1, at(range(100, 2**62), **NAN), 105)
    assert (r.verdict, kinds(r)) == ("recovering", {"overflow": 5})
    assert "backing off after 5 skipped steps" in r.text
    # A NaN streak that ends once the scale is lower was the scale's: never persistent.
    _, r, _ = script(floor_1, both(above(2.0**12), at(range(100, 103), **NAN)), 200)
    assert kinds(r) == {"calibration": 4, "overflow": 3}
    # One NaN at the floor is stuck for that update, but not persistent.
    s, r, _ = script(DynamicPolicy(init_scale=1.0, min_scale=1.0), at([100], **NAN), 101)
    assert (r.verdict, kinds(r)) == ("stuck", {"overflow": 1})


def test_a_run_stuck_at_min_scale_then_recovering_then_healthy():
    # inf from step 100: 16 backoffs to min_scale=1, then overflows at the floor: stuck.
    rule, floor_1 = at(range(100, 130)), DynamicPolicy(min_scale=1.0)
    s, r, _ = script(floor_1, rule, 130)
    assert (r.verdict, kinds(r), r.streak, r.scale) == ("stuck", {"overflow": 30}, 30, 1.0)
    assert "lowest scale allowed (2^0) with the loss finite: the backward overflows FP16" in r.text
    assert 'on_backward_overflow="upcast"' in r.text and "lower min_scale" in r.text and "overflow_report()" in r.text
    # It steps again: recovering for SETTLE steps, then healthy.
    _, r, _ = script(floor_1, rule, 130 + SETTLE - 1)
    assert (r.verdict, kinds(r), r.streak) == ("recovering", {"overflow": 30}, 0)
    assert "after being stuck until step 130" in r.text
    _, r, _ = script(floor_1, rule, 130 + SETTLE)
    assert r.verdict == "healthy" and r.steps_since_overflow == SETTLE
    # A streak stuck from the start is not calibration.
    _, r, _ = script(DynamicPolicy(init_scale=4.0, min_scale=4.0), at(range(0, 10)), 10)
    assert (r.verdict, kinds(r)) == ("stuck", {"overflow": 10})
    # max_consecutive_skips makes a shorter streak stuck, above the floor.
    _, r, _ = script(DynamicPolicy(max_consecutive_skips=3), at(range(100, 103)), 103)
    assert (r.verdict, r.scale) == ("stuck", 2.0**13)


def test_a_static_scale_never_calibrates():
    s, r, _ = script(StaticPolicy(), at([0, 1]), 20)
    assert kinds(r) == {"overflow": 2} and not r.calibrating
    assert r.verdict == "recovering"  # every overflow of a static scale is stuck (it cannot back off)
    assert "after being stuck until step 2" in r.text
    _, r, _ = script(StaticPolicy(), at([5, 6], **NAN), 7)
    assert (r.verdict, kinds(r)) == ("stuck", {"persistent_nan": 2})
    _, r, _ = script(StaticPolicy(), at([5]), 6)
    assert r.verdict == "stuck" and "static scale cannot back off" in r.text


def test_adaptive_calibration_is_the_search_then_a_clean_stretch():
    # Gradients of amax 2**-2: at 2**20 the first step overflows, the policy searches down 16 binades
    # at once, measures the amax, jumps to its target (2**12), and trains.
    policy = AdaptivePolicy(init_scale=2.0**20, growth_interval=20)
    assert policy.settle_steps() == 20
    rule, amax = above(2.0**17), lambda scale: scale * 2.0**-2
    s, r, _ = script(policy, rule, 100, amax=amax)
    assert s.calibrated and s.scale == 2.0**12
    assert kinds(r) == {"calibration": 1} and r.verdict == "healthy"
    # An overflow soon after the jump is still calibration; one after the stretch is steady.
    _, r, _ = script(policy, both(at([5]), rule), 100, amax=amax)
    assert kinds(r) == {"calibration": 2}
    _, r, _ = script(policy, both(at([50]), rule), 100, amax=amax)
    assert kinds(r) == {"calibration": 1, "overflow": 1}
    # All-zero gradients measure nothing: the policy never calibrates, nor does the account.
    _, r, _ = script(policy, clean, 100, amax=lambda scale: 0.0)
    assert r.calibrating


def test_logmax_settles_after_SETTLE_steps():
    policy = LogMaxPolicy()
    assert policy.settle_steps() == SETTLE
    _, r, _ = script(policy, at([3, SETTLE + 30]), SETTLE + 40, amax=lambda scale: scale * 2.0**-20)
    assert kinds(r) == {"calibration": 1, "overflow": 1}


def test_a_checkpoint_load_restarts_calibration_and_keeps_the_loaded_counts():
    policy = DynamicPolicy()
    loaded, r0, _ = script(policy, both(above(2.0**10), at([200], **BAD)), 300)
    h = Health(loaded)  # what the scaler does at a load: reset to the loaded state
    s = loaded
    for _ in range(100):  # the resumed run's data overflow at 2**10: the scale searches again
        before = s.scale
        s = policy.update(s, found_inf=before > 2.0**8)
        h.record(policy, s, before)
    r = h.report(policy, s)
    assert kinds(r) == {"calibration": 2, "bad_batch": 1, "earlier": 6} and r.skipped == 9
    assert "6 before the last checkpoint load" in r.text


def test_update_with_new_scale_and_no_check_moves_only_the_scale():
    policy = DynamicPolicy()
    s, h = policy.init_state(), Health(policy.init_state())
    for _ in range(5):
        before, s = s.scale, policy.update(s, False)
        h.record(policy, s, before)
    s = s.replace(scale=2.0**8)  # update(new_scale=...) without a step: counters unchanged
    h.record(policy, s, 2.0**16)
    r = h.report(policy, s)
    assert (r.steps, r.scale, r.scale_held, r.skipped) == (5, 2.0**8, 0, 0)


def test_report_validates_and_gives_plain_numbers():
    policy = DynamicPolicy()
    s, r, h = script(policy, above(2.0**12), 20)
    with pytest.raises(ValueError, match="older than the last state recorded"):
        h.report(policy, policy.init_state())
    m = r.metrics()
    assert m["health/verdict"] == 0 and m["health/calibration"] == 4 and "health/flushed" not in m
    assert all(isinstance(v, (int, float, bool)) for v in m.values())
    assert set(r.metrics(prefix="x/")) == {"x/" + k[len("health/") :] for k in m}
    assert str(r) == r.text
    r = h.report(policy, s, flushed=0.25, flushed_step=7)
    assert r.metrics()["health/flushed"] == 0.25 and "25.00% of the gradients sampled at step 8" in r.text
    assert "a larger scale keeps them" in r.text
    assert "flush:" not in h.report(policy, s, flushed=0.001, flushed_step=7).text
    assert lossscale.health.disabled().metrics() == {
        "health/verdict": -1,
        **{f"health/{k}": v for k, v in HealthReport("x", "").metrics(prefix="").items() if k != "verdict"},
    }


def _flags_sequence(draw_list, policy):
    """A policy run from a list of flag kinds ('c' clean, 'i' inf, 'n' NaN, 'b' bad loss)."""
    table = {"c": {"found_inf": False}, "i": {"found_inf": True}, "n": NAN, "b": BAD}
    s, states = policy.init_state(), []
    for kind in draw_list:
        before = s.scale
        s = policy.update(s, **table[kind])
        states.append((s, before))
    return states


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.sampled_from("ccccccinb"), min_size=1, max_size=120),
    st.integers(1, 4),
    st.sampled_from(["dynamic", "static", "small"]),
)
def test_gaps_count_every_skip_exactly(kinds_drawn, every, name):
    """Recording every `every`-th state (snapshots dropped) still counts every skip exactly: the kinds
    add up to the skips, bad batches are exact, and a sparse account that says stuck agrees with the
    full one (it judged the same states)."""
    policy = {
        "dynamic": DynamicPolicy(growth_interval=5),
        "static": StaticPolicy(),
        "small": DynamicPolicy(init_scale=4.0, growth_interval=3),
    }[name]
    states = _flags_sequence(kinds_drawn, policy)
    full, sparse = Health(policy.init_state()), Health(policy.init_state())
    for i, (s, before) in enumerate(states):
        full.record(policy, s, before)
        if i % every == every - 1:
            sparse.record(policy, s, before)
    last, before = states[-1]
    a, b = full.report(policy, last, before), sparse.report(policy, last, before)
    for r in (a, b):
        assert_adds_up(r)
        assert (r.skipped, r.bad_batch, r.streak) == (last.skipped_steps, last.bad_loss_steps, last.overflow_streak)
        assert r.verdict != "stuck" or last.overflow_streak > 0
    if b.verdict == "stuck":
        assert a.verdict == "stuck"
    if every == 1:
        assert a == b


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.sampled_from("ccccccinb"), min_size=1, max_size=120),
    st.sampled_from(["dynamic", "static", "small", "adaptive"]),
)
def test_the_clean_step_shortcut_keeps_the_account_of_the_general_path(kinds_drawn, name):
    """``record`` takes a shortcut for a clean step after clean ones past calibration; an account that
    never takes it ends in the same state and says the same. Kills: a shortcut that skips a scale
    move (the growth probe's), a late NaN, or the end of calibration."""
    policy = {
        "dynamic": DynamicPolicy(growth_interval=5),
        "static": StaticPolicy(),
        "small": DynamicPolicy(init_scale=4.0, growth_interval=3),
        "adaptive": AdaptivePolicy(growth_interval=4),
    }[name]
    states = _flags_sequence(kinds_drawn, policy)
    short, general = Health(policy.init_state()), Health(policy.init_state())
    general._one_clean_step = lambda state: False
    for s, before in states:
        short.record(policy, s, before)
        general.record(policy, s, before)
    del general._one_clean_step

    def plain(h):  # the open streak has __slots__ and no __eq__: compare its values
        return {k: [getattr(v, n) for n in v.__slots__] if k == "_open" else v for k, v in vars(h).items()}

    assert plain(short) == plain(general)
    last, before = states[-1]
    assert short.report(policy, last, before) == general.report(policy, last, before)


def test_a_nan_learned_after_the_step_joins_its_streak():
    # The host may count an overflow as inf and learn its NaN at the next sync (the same step's state,
    # one more NaN): the account takes the news into the streak it belongs to.
    policy = DynamicPolicy(init_scale=2.0, min_scale=1.0)
    s, h = policy.init_state(), Health(policy.init_state())
    for i in range(6):
        before, s = s.scale, policy.update(s, found_inf=True)  # counted as inf
        h.record(policy, s, before)
        s = s.replace(nan_steps=s.nan_steps + 1, inf_steps=s.inf_steps - 1, streak_nan_steps=s.streak_nan_steps + 1)
        if i % 2:
            h.record(policy, s, before)  # the news alone (k == 0) ...
    r = h.report(policy, s)  # ... or with the next state
    assert (r.verdict, kinds(r)) == ("stuck", {"persistent_nan": 6})
    before, s = s.scale, policy.update(s, found_inf=False)
    h.record(policy, s, before)
    assert kinds(h.report(policy, s)) == {"persistent_nan": 6}


# --------------------------------------------------------------------------------- the scaler
def _optimizer(model, fused):
    if fused:
        return torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    return torch.optim.SGD(model.parameters(), lr=1e-3)


def _train(scaler, model, fused, n, inf=(), nan=(), bad=(), opt=None):
    """``n`` iterations; an inf / NaN written into a gradient at the steps in ``inf`` / ``nan`` (a finite
    loss), a non-finite forward at the steps in ``bad`` (a bad batch). Returns the optimizer."""
    opt = opt or _optimizer(model, fused)
    for step in range(n):
        model[2].factor = math.inf if step in bad else 1.0
        opt.zero_grad()
        scaler.scale(model(torch.ones(3, 4)).pow(2).mean()).backward()
        if step in inf or step in nan:
            model[0].weight.grad[0, 0] = math.inf if step in inf else math.nan
        scaler.step(opt)
        scaler.update()
    return opt


FUSED = pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused_adam"])


@FUSED
def test_the_scaler_counts_each_kind_on_both_paths(fused):
    # Calibration (3 overflows at the start), two bad batches, a clean end: healthy.
    model = _model()
    scaler = lossscale.GradScaler(model=model, trace=True)
    _train(scaler, model, fused, 40, inf=(0, 1, 2), bad=(10, 30))
    r = scaler.health()
    assert (r.verdict, kinds(r), r.steps, r.streak) == ("healthy", {"calibration": 3, "bad_batch": 2}, 40, 0)
    assert r.scale == 2.0**13 and r.steps_since_overflow == 37
    # With trace=True each bad batch's first cause, read only now.
    assert [s for s, _ in r.causes] == [11, 31]
    assert all("forward output of `2`" in cause for _, cause in r.causes)
    assert "First causes of the last bad batches: step 11: inf/NaN first appeared in the forward output" in r.text


@FUSED
def test_the_scaler_reports_persistent_nan_and_a_run_stuck_at_min_scale(fused):
    for kind in ("nan", "inf"):
        model = _model()
        scaler = lossscale.GradScaler(model=model, init_scale=2.0**4, min_scale=1.0, on_stuck="ignore")
        steps = range(5, 15)
        _train(scaler, model, fused, 15, **{kind: steps})
        r = scaler.health()
        expected = {"persistent_nan": 10} if kind == "nan" else {"overflow": 10}
        assert (r.verdict, kinds(r), r.streak, r.scale) == ("stuck", expected, 10, 1.0), kind
        # It steps again: recovering, then healthy once SETTLE clean steps have passed.
        _train(scaler, model, fused, SETTLE - 1)
        assert scaler.health().verdict == "recovering"
        _train(scaler, model, fused, 1)
        assert scaler.health().verdict == "healthy"


@FUSED
def test_a_clean_run_and_a_stuck_warning_that_points_to_health(fused):
    model = _model()
    scaler = lossscale.GradScaler(model=model)
    _train(scaler, model, fused, 10)
    r = scaler.health()
    assert (r.verdict, r.steps, r.skipped, r.scale_held) == ("healthy", 10, 0, 10)
    scaler = lossscale.GradScaler(model=model, init_scale=1.0, min_scale=1.0)
    with pytest.warns(RuntimeWarning, match=r"scaler\.health\(\) tells the run's skips apart"):
        _train(scaler, model, fused, 3, inf=(1, 2))


def test_telemetry_gives_the_flushed_share_and_a_load_restarts_the_account():
    model = _model()
    scaler = lossscale.GradScaler(model=model, telemetry=2)
    _train(scaler, model, False, 5, inf=(0,))
    r = scaler.health()
    assert r.flushed == scaler.metrics()["grad/flushed_frac"] and r.flushed_step == 4
    assert "of the gradients sampled at step 5 flush to zero" in r.text
    saved = scaler.state_dict()
    scaler.load_state_dict(saved)
    _train(scaler, model, False, 3, inf=(1,))
    r = scaler.health()
    assert kinds(r) == {"earlier": 1, "calibration": 1} and r.steps == 8 and r.calibrating


def test_health_adds_no_sync_to_an_iteration_and_syncs_once_itself():
    from _sync import count_host_syncs

    model = _model()
    scaler = lossscale.GradScaler(model=model)
    opt = _train(scaler, model, True, 2)
    with count_host_syncs() as syncs:
        _train(scaler, model, True, 6, inf=(2,), bad=(4,), opt=opt)
    assert syncs.count == 0  # fused Adam: the account reads the stuck check's snapshots, nothing else
    with count_host_syncs() as syncs:
        r = scaler.health()
    assert syncs.count <= 1 and kinds(r) == {"calibration": 1, "bad_batch": 1}  # (a CPU read counts 0)


def test_a_disabled_scaler_and_copies():
    assert lossscale.GradScaler(enabled=False).health().verdict == "disabled"
    assert lossscale.GradScaler().health().text.startswith("lossscale health: healthy. No step yet.")
    model = _model()
    scaler = lossscale.GradScaler(model=model, trace=True)
    _train(scaler, model, False, 4, bad=(1,))
    twin = copy.deepcopy(scaler)  # the kept evidence stays with the original
    assert len(scaler.health().causes) == 1 and twin.health().causes == ()
    assert kinds(twin.health()) == kinds(pickle.loads(pickle.dumps(scaler)).health()) == {"bad_batch": 1}


# --------------------------------------------------------------------------------- integrations
INTEGRATION_STEPS, INTEGRATION_K = 6, 2  # an inf injected into step 2's gradient: a calibration skip


def test_transformers_trainer_logs_health_at_the_end_of_training(tmp_path, one_thread, fresh_accelerate_state):  # noqa: F811  the pytest fixture imported from _integration_models
    pytest.importorskip("transformers")
    import logging

    from _integration_models import INIT_SCALE, InfAt, TokenData, tiny_gpt2
    from transformers import Trainer, TrainingArguments

    from lossscale.integrations import transformers as ls_transformers

    model = tiny_gpt2()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        fp16=True,
        use_cpu=True,
        per_device_train_batch_size=2,
        max_steps=INTEGRATION_STEPS,
        logging_steps=3,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=TokenData(2 * INTEGRATION_STEPS, length=8))
    scaler = ls_transformers.attach(trainer, init_scale=INIT_SCALE)
    InfAt(model.transformer.h[0].mlp.c_fc.weight, [INTEGRATION_K])
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers.trainer")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        out = trainer.train()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    # The numbers: in train()'s metrics and the final log_history entry (so in every report_to logger).
    expected = scaler.health().metrics(prefix="scaler/health/")
    assert expected["scaler/health/calibration"] == expected["scaler/health/skipped"] == 1
    assert {k: out.metrics[k] for k in expected} == expected
    final = trainer.state.log_history[-1]
    assert "train_runtime" in final and {k: final[k] for k in expected} == expected
    assert not any(k.startswith("scaler/health/") for h in trainer.state.log_history[:-1] for k in h)
    # The paragraph: in the Trainer's own logger, at INFO (healthy).
    texts = [r.getMessage() for r in records if r.getMessage().startswith("lossscale health:")]
    assert texts == [scaler.health().text] and records[-1].levelno == logging.INFO
    assert "1 while the scale calibrated" in texts[0]


# Lightning 2.6.6's own use of a torch API it deprecated (lightning/pytorch/utilities/_pytree.py:21).
@pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated")
def test_lightning_logs_health_at_the_end_of_fit(tmp_path, one_thread, monkeypatch):
    L = pytest.importorskip("lightning")
    from _integration_models import INIT_SCALE, InfAt, dataset, mlp, read_tensorboard
    from lightning.pytorch.loggers import TensorBoardLogger

    from lossscale.integrations.lightning import MixedPrecision

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x).float(), y)

        def test_step(self, batch, batch_idx):
            return self.training_step(batch, batch_idx)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)

    # What a user sees: records in Lightning's console log ("lightning.pytorch", which holds Lightning's
    # own handler), and warnings. Caught there, not by patching the function Lightning prints with.
    said = []

    class Said(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("lossscale health:"):
                said.append((record.levelname.lower(), record.getMessage()))

    handler = Said(level=logging.INFO)
    console = logging.getLogger("lightning.pytorch")
    console.addHandler(handler)
    monkeypatch.setattr(console, "level", logging.INFO)
    module, plugin = Module(), MixedPrecision(init_scale=INIT_SCALE)
    InfAt(module.net[2].weight, [INTEGRATION_K])
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=INTEGRATION_STEPS,
        plugins=[plugin],
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=INTEGRATION_STEPS,
    )
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        try:
            trainer.fit(module, torch.utils.data.DataLoader(dataset(INTEGRATION_STEPS), batch_size=8))
        finally:
            console.removeHandler(handler)
    report = plugin.scaler.health()
    assert said == [("info", report.text)] and kinds(report) == {"calibration": 1}
    assert not [w for w in warned if "lossscale health" in str(w.message)]  # healthy: info, not a warning
    tb = read_tensorboard(logger.log_dir)
    assert tb["scaler/health/calibration"] == [(INTEGRATION_STEPS, 1.0)]
    assert tb["scaler/health/verdict"] == [(INTEGRATION_STEPS, 0.0)]
    console.addHandler(handler)
    try:
        trainer.test(module, torch.utils.data.DataLoader(dataset(2), batch_size=8), verbose=False)
    finally:
        console.removeHandler(handler)
    assert len(said) == 1  # only the end of a fit


def test_accelerate_log_health_prints_and_logs(capsys, one_thread, fresh_accelerate_state):  # noqa: F811  the pytest fixture imported from _integration_models
    from _integration_models import INIT_SCALE, InfAt, batch, mlp
    from accelerate import Accelerator

    from lossscale.integrations import accelerate as ls_accelerate

    with pytest.raises(ValueError, match="attach"):
        ls_accelerate.log_health(Accelerator(mixed_precision="fp16"))
    accelerator = Accelerator(mixed_precision="fp16")
    ls_accelerate.attach(accelerator, init_scale=INIT_SCALE)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model, opt = accelerator.prepare(model, opt)
    InfAt(model[2].weight, [INTEGRATION_K])
    for step in range(INTEGRATION_STEPS):
        x, y = batch(step)
        accelerator.backward(torch.nn.functional.cross_entropy(model(x).float(), y))
        opt.step()
        opt.zero_grad()
    report = ls_accelerate.log_health(accelerator, step=INTEGRATION_STEPS)
    assert (report.verdict, kinds(report), report.steps) == ("healthy", {"calibration": 1}, INTEGRATION_STEPS)
    assert capsys.readouterr().out.strip() == report.text


def test_a_lagging_device_drops_snapshots_and_the_account_still_adds_up(monkeypatch):
    # Snapshots that land 6 updates late: at most 4 are kept in flight, so some are dropped, and
    # those read come late. The counters' deltas still count every skip; health() reads the state now.
    from test_architecture import _lagging

    _lagging(monkeypatch, lag=6)
    model = _model()
    scaler = lossscale.GradScaler(model=model, init_scale=2.0**4, min_scale=1.0, on_stuck="ignore")
    opt = _train(scaler, model, True, 30, inf=(0, 1), bad=(12,))
    r = scaler.health()
    assert (r.verdict, kinds(r), r.steps) == ("healthy", {"calibration": 2, "bad_batch": 1}, 30)
    _train(scaler, model, True, 10, nan=range(10), opt=opt)
    r = scaler.health()
    assert (r.verdict, kinds(r), r.streak) == ("stuck", {"calibration": 2, "bad_batch": 1, "persistent_nan": 10}, 10)


def test_the_health_page_prints_what_it_quotes(tmp_path):
    """docs/how-to/health.md: each ```text block is, unwrapped, a line that the page's examples print."""
    import os
    import re

    from test_doc_examples import ROOT, run_page

    page = "docs/how-to/health.md"
    stdout, _ = run_page(page, tmp_path)
    printed = stdout.splitlines()
    with open(os.path.join(ROOT, page), encoding="utf-8") as fh:
        quoted = re.findall(r"^```text\n(.*?)^```", fh.read(), re.MULTILINE | re.DOTALL)
    assert len(quoted) == 3
    for text in quoted:
        assert " ".join(text.split("\n")).strip() in printed
