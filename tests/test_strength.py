"""Behaviours that only a deliberate bug showed to be unguarded (issue 15), and wider hypothesis strategies.

Each test names, in its docstring, the one-line change to the library that it was seen to fail on
(made by hand in a copy of the repository, the test run, the change reverted). The mutation score that
keeps these honest is in docs/testing.md (``bash benchmarks/mutation.sh``).

The strategies here draw what the older ones in test_policy.py and test_adaptive.py do not: factors and
scales that are not powers of two (so every product rounds to float32 and the two forms of a rule can
disagree), and values that sit exactly on a boundary (a backoff landing on ``min_scale``, a growth on
``max_scale``, an amax exactly at a power of two or at ``fmt.max / 2**margin``).
"""

import dataclasses
import inspect
import math
import pickle
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import lossscale
from _rules import TensorForm, backoffs
from lossscale import AdaptivePolicy, DynamicPolicy, LogMaxPolicy, ScaleState, StaticPolicy, formats
from lossscale.adaptive import NO_AMAX, AdaptiveState
from lossscale.checkpoint import to_dict
from lossscale.dynamic import DynamicState
from lossscale.logmax import LogMaxState
from lossscale.policy import f32
from lossscale.static import StaticState
from lossscale.stats import grad_stats, recommend_scale

TORCH_RULE = dict(hysteresis=1, min_scale=None, max_scale=None)  # the dynamic rule as torch runs it
# A scaler configured like torch: the rule, and no look at the loss before scaling (a check torch does
# not make), where this lossscale has that check.
TORCH_LIKE = {**TORCH_RULE, **({"loss_check": False} if "loss_check" in inspect.signature(lossscale.GradScaler).parameters
                               else {})}


def quiet(make):
    """Build a config whose non-power-of-two values warn by design."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make()


# ------------------------------------------------------------------------------------ strategies
pow2 = st.integers(-10, 30).map(lambda k: 2.0**k)
# Scales and factors off the powers of two: every product rounds to float32.


flags = st.lists(st.sampled_from([(False, False), (True, False), (True, True)]), max_size=60)


# ------------------------------------------------------------ 1. several optimizers, inf in the first
def _two_optimizer_run(scaler, bad_steps, kind, unscale_first):
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.full((2,), 2.0))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.1, momentum=0.9), torch.optim.SGD([b], lr=0.1, momentum=0.9)
    scales = []
    for step in range(6):
        opt_a.zero_grad()
        opt_b.zero_grad()
        scaler.scale(a.sum() * 2 + b.sum() * 3).backward()
        if step in bad_steps:
            a.grad[1] = float(kind)  # the FIRST optimizer's gradient only
        if unscale_first:
            scaler.unscale_(opt_a)
        scaler.step(opt_a)
        scaler.step(opt_b)
        scaler.update()
        scales.append(scaler.get_scale())
    return a, b, scales


@pytest.mark.parametrize("kind", ["inf", "nan"])
@pytest.mark.parametrize("unscale_first", [False, True])
def test_two_optimizers_overflow_in_the_first_backs_off_like_torch(kind, unscale_first):
    """Kills: ``update()`` combining only the last stepped optimizer's found_inf
    (``sum_flags([f.found_inf for f in flags][-1:], ...)`` in scaler.update): the first optimizer's
    step is still skipped, but the scale stays at 65536 where torch backs off to 32768."""
    bad = {1, 2, 4}
    ref = _two_optimizer_run(torch.amp.GradScaler("cpu", growth_interval=2), bad, kind, unscale_first)
    ours = _two_optimizer_run(lossscale.GradScaler("cpu", growth_interval=2, **TORCH_LIKE), bad, kind, unscale_first)
    assert ours[2] == ref[2]
    assert ref[2][1] == 2.0**15  # the overflow in the first optimizer backed off
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


def test_two_optimizers_overflow_in_the_first_is_counted_and_skips_both():
    """Kills the same change seen through the counters: the iteration must count as skipped."""
    scaler = lossscale.GradScaler("cpu", growth_interval=100, **TORCH_LIKE)
    a, b, _ = _two_optimizer_run(scaler, {0}, "inf", False)
    s = scaler.state()
    assert (s.steps, s.skipped_steps, s.inf_steps, s.nan_steps) == (6, 1, 1, 0)
    # No streak runs now: streak_start_scale is the last step's scale, where a next streak would begin.
    assert s.streak_start_scale == 2.0**15 and s.scale == 2.0**15


# --------------------------------------------------------------- 2. state_dict() keeps every field
#: A value off its default for every shared field (a consistent state: check_state accepts it).


# ------------------------------------------------ 3. a torch checkpoint taken mid-run (tracker > 0)


# ------------------------------------------ 4, 5. float32 rounding of a non-power-of-two backoff


# --------------------------------------- the adaptive rule: ties at powers of two, rounding backoffs


# amax exactly at a power of two (the binade boundary), one float32 step either side, and fp16's max.


# -------------------------------------------------------------- 6. recommend_scale at the exact tie
def test_recommend_scale_at_the_exact_tie():
    """Kills an off-by-one in the floor of log2(fmt.max / amax) (e.g. ``m_max <= m_a`` for
    ``m_max < m_a`` in stats.recommend_scale): at amax * S == fmt.max / 2**margin the answer is S."""
    amax = 65504.0 * 2.0**-10
    assert recommend_scale(grad_stats(torch.tensor([amax, -1e-3]), fmt="fp16"), margin_bits=0).scale == 2.0**10
    assert recommend_scale(grad_stats(torch.tensor([amax]), fmt="fp16"), margin_bits=2).scale == 2.0**8
    above = float(np.nextafter(np.float32(amax), np.float32(math.inf)))
    assert recommend_scale(grad_stats(torch.tensor([above]), fmt="fp16"), margin_bits=0).scale == 2.0**9


def _largest_power_of_two_scale(amax, fmt_max, margin):
    """Exact: the largest k with amax * 2**k * 2**margin <= fmt_max (fractions, no rounding)."""
    ratio = Fraction(fmt_max) / (Fraction(amax) * 2**margin)
    k = ratio.numerator.bit_length() - ratio.denominator.bit_length()
    while Fraction(2) ** k > ratio:
        k -= 1
    while Fraction(2) ** (k + 1) <= ratio:
        k += 1
    return k


fmts = st.sampled_from([formats.FP16, formats.BF16, formats.FP8_E4M3, formats.FP8_E5M2])


@st.composite
def amax_near_a_tie(draw, fmt):
    """A float32 amax at ``fmt.max * 2**-k`` exactly, one float32 step either side, or anywhere."""
    tie = fmt.max * 2.0 ** -draw(st.integers(0, 60))
    step = draw(st.sampled_from([0, 1, -1, None]))
    if step is None:
        return f32(draw(st.floats(2.0**-100, 2.0**60)))
    return float(np.nextafter(np.float32(tie), np.float32(step * math.inf))) if step else f32(tie)


@settings(max_examples=150, deadline=None)
@example(fmt=formats.FP16, margin=0, data=None)
@given(fmts, st.integers(0, 3), st.data())
def test_recommend_scale_is_the_largest_power_of_two_that_fits_ties_included(fmt, margin, data):
    amax = 65504.0 * 2.0**-10 if data is None else data.draw(amax_near_a_tie(fmt))
    if amax == 0 or not math.isfinite(amax):
        return
    rec = recommend_scale(grad_stats(torch.tensor([amax]), fmt=fmt), margin_bits=margin)
    assert rec.scale == 2.0 ** _largest_power_of_two_scale(amax, fmt.max, margin)


# =====================================================================================================
# What the mutation run found (docs/testing.md): each test below kills mutants that survived the older
# tests; the docstring names them by what they change.
# =====================================================================================================
ALL_POLICIES = [DynamicPolicy, StaticPolicy, AdaptivePolicy, LogMaxPolicy]


@pytest.mark.parametrize("cls", ALL_POLICIES)
def test_update_counts_an_overflow_as_inf_unless_told_nan(cls):
    """Kills: the default ``found_nan=False`` of ``update`` turned True."""
    p = cls()
    s = p.update(p.init_state(), True, amax=None) if p.needs_amax else p.update(p.init_state(), True)
    assert (s.inf_steps, s.nan_steps) == (1, 0)


@pytest.mark.parametrize("policy, want", [
    (DynamicPolicy(growth_factor=4.0, backoff_factor=0.25, growth_interval=7), (4.0, 0.25, 7)),
    (StaticPolicy(scale=2.0**10), (1.0, 1.0, 2**31 - 1)),
    (AdaptivePolicy(backoff_factor=0.25, growth_interval=9), (2.0, 0.25, 9)),
    (LogMaxPolicy(), (2.0, 0.5, 2000)),
])
def test_torch_state_gives_torch_a_scaler_it_can_run(policy, want):
    """Kills: any of torch's five keys renamed, or given another value (growth_factor 3.0, tracker 1)."""
    state = policy.init_state()
    if hasattr(state, "growth_tracker") and not isinstance(policy, StaticPolicy):
        state = state.replace(growth_tracker=3)
    got = policy.torch_state(state)
    tracker = 3 if hasattr(state, "growth_tracker") and not isinstance(policy, StaticPolicy) else 0
    assert got == {"scale": state.scale, "growth_factor": want[0], "backoff_factor": want[1],
                   "growth_interval": want[2], "_growth_tracker": tracker}
    assert all(type(got[k]) is float for k in ("scale", "growth_factor", "backoff_factor"))


def test_scale_bounds_of_every_policy():
    """Kills: ``scale_bounds`` reading another attribute, or losing getattr's default (static has none)."""
    assert DynamicPolicy(min_scale=2.0, max_scale=2.0**20).scale_bounds() == (2.0, 2.0**20)
    assert StaticPolicy().scale_bounds() == (None, None)
    assert LogMaxPolicy(init_scale=2.0, min_scale=2.0, max_scale=2.0**20).scale_bounds() == (2.0, 2.0**20)
    assert AdaptivePolicy(min_scale=None, max_scale=None).scale_bounds() == (2.0**-126, 2.0**127)


def test_is_stuck_at_the_lower_bound_for_the_measuring_policies():
    """Kills: logmax's and adaptive's stuck check looking at no bound, or at the upper one."""
    lm = LogMaxPolicy(init_scale=2.0**3, min_scale=2.0**3, max_scale=2.0**20)
    s = lm.init_state()
    assert lm.is_stuck(lm.update(s, True), scale_before=2.0**3)
    ad = AdaptivePolicy(init_scale=2.0, min_scale=2.0, max_scale=2.0**20)
    s = ad.init_state()
    assert ad.is_stuck(ad.update(s, True), scale_before=2.0)
    assert not ad.is_stuck(ad.update(s.replace(scale=2.0**20), True), scale_before=2.0**20)


def test_a_counter_at_its_device_limit_reaches_the_device_exactly():
    """Kills: a shared counter's limit off by one (float64 on device: exact below 2**53), and an int
    tracker filled through float (2**62 - 1 is not a float64)."""
    p = DynamicPolicy()
    s = p.init_state().replace(steps=2**53 - 1)
    p.check_state(s)
    assert TensorForm(p, s).to_state().steps == 2**53 - 1
    with pytest.raises(ValueError, match="steps"):
        p.check_state(s.replace(steps=2**53))
    a = AdaptivePolicy(max_scale=None)
    s = a.init_state().replace(calibrated=True, window_exp=-7)
    t = TensorForm(a, s)
    t.t.growth_tracker.fill_(2**62 - 1)  # an int64 field written and read back through the buffer
    assert t.to_state().growth_tracker == 2**62 - 1


# --------------------------------------------------------------------------- check_state's edges
def _dyn():
    return DynamicPolicy(init_scale=2.0**4, growth_interval=5, hysteresis=3, min_scale=2.0, max_scale=2.0**20)


def _ad():
    return AdaptivePolicy(growth_interval=5, hysteresis=3, max_scale=None)


_COUNTS = dict(steps=5, skipped_steps=3, inf_steps=2, nan_steps=1, overflow_streak=2, streak_nan_steps=1)


@pytest.mark.parametrize("policy, changes", [
    (_dyn(), dict(growth_tracker=4, hysteresis_tracker=3)),
    (_dyn(), dict(scale=2.0)),                       # on min_scale
    (_dyn(), dict(scale=2.0**20)),                   # on max_scale
    (_dyn(), dict(steps=2**53 - 1)),
    (_dyn(), _COUNTS),
    (StaticPolicy(scale=1.0), dict(scale=1.0)),
    (_ad(), dict(calibrated=True, window_exp=-160)),
    (_ad(), dict(calibrated=True, window_exp=140)),
    (_ad(), dict(calibrated=True, window_exp=-5, growth_tracker=4)),
    (LogMaxPolicy(), dict(b1_correction=1.0, b2_correction=1e-300)),
])
def test_check_state_accepts_states_on_the_edge(policy, changes):
    """Kills every bound of check_state moved inward (``>=`` for ``>``, 140 to 139, ``<= 1``)."""
    policy.check_state(policy.init_state().replace(**changes))


@pytest.mark.parametrize("policy, changes, name", [
    (_dyn(), dict(growth_tracker=5), "growth_tracker"),
    (_dyn(), dict(hysteresis_tracker=4), "hysteresis_tracker"),
    (_dyn(), dict(growth_tracker=-1), "growth_tracker"),
    (_dyn(), dict(steps=2**53), "steps"),
    (_dyn(), dict(steps=True), "steps"),
    (_dyn(), dict(steps=1.0), "steps"),
    (_dyn(), dict(streak_start_scale=True), "streak_start_scale"),
    (_dyn(), dict(streak_start_scale="1.0"), "streak_start_scale"),
    (_dyn(), dict(streak_start_scale=math.inf), "streak_start_scale"),
    (_dyn(), dict(scale=f32(2.0 * (1 - 2**-23))), "scale"),          # one float32 step under min_scale
    (_dyn(), dict(scale=2.0**20 * (1 + 2**-23)), "scale"),           # one step over max_scale
    (StaticPolicy(scale=1.0), dict(scale=0.0), "scale"),
    (_dyn(), dict(steps=2, skipped_steps=3, inf_steps=3), "counters"),
    (_dyn(), dict(steps=5, skipped_steps=3, inf_steps=1), "counters"),
    (_dyn(), dict(steps=5, skipped_steps=1, inf_steps=1, overflow_streak=2), "overflow_streak"),
    (_dyn(), dict(steps=5, skipped_steps=2, inf_steps=2, overflow_streak=1, streak_nan_steps=2), "overflow_streak"),
    (_ad(), dict(growth_tracker=5), "growth_tracker"),
    (_ad(), dict(calibrated=True, window_exp=-161), "window_exp"),
    (_ad(), dict(calibrated=True, window_exp=141), "window_exp"),
    (_ad(), dict(calibrated=False, window_exp=-5), "window_exp"),
    (LogMaxPolicy(), dict(b1_correction=0.0), "b1_correction"),
    (LogMaxPolicy(), dict(b2_correction=1.5), "b2_correction"),
])
def test_check_state_refuses_naming_the_field(policy, changes, name):
    """Kills: a check of check_state weakened (``and`` for ``or``, a bound moved outward, a type test
    that lets a bool or a string through to a comparison)."""
    with pytest.raises(ValueError, match=name):
        policy.check_state(policy.init_state().replace(**changes))


def test_field_kind_for_a_new_state_type():
    """Kills: ``Optional[float]`` and the other field types mapped to the wrong device vector."""
    from lossscale.policy import field_kind
    fields = dataclasses.fields(dataclasses.make_dataclass(
        "S", [("a", "float"), ("b", "Optional[float]"), ("c", "int"), ("d", "bool"),
              ("e", "float", dataclasses.field(default=0.0, metadata={"dtype": "f64"}))]))
    assert [field_kind(f) for f in fields] == ["f32", "f32", "i64", "i64", "f64"]
    with pytest.raises(TypeError, match="no device form"):
        field_kind(dataclasses.fields(dataclasses.make_dataclass("T", [("x", "str")]))[0])


def test_f32_of_a_value_beyond_float32_is_a_signed_inf():
    """A finite value beyond float32 rounds to a signed inf, as the device cast does. (f32's
    ``except OverflowError`` branch is dead: Python 3.10 to 3.13 pack such a value as inf themselves.)"""
    assert f32(1e39) == math.inf and f32(-1e39) == -math.inf


def test_register_refuses_a_nameless_policy_and_registers_the_class():
    """Kills: register's name check inverted, or the registry holding None."""
    from lossscale.policy import policy_class, register
    for name, cls in (("dynamic", DynamicPolicy), ("static", StaticPolicy), ("adaptive", AdaptivePolicy),
                      ("logmax", LogMaxPolicy)):
        assert policy_class(name) is cls
    assert register(DynamicPolicy) is DynamicPolicy and policy_class("dynamic") is DynamicPolicy  # idempotent
    nameless = type("Nameless", (), {"name": ""})
    with pytest.raises(ValueError, match="name"):
        register(nameless)


def test_diagnose_tells_nan_at_the_floor_from_nan_that_persisted():
    """Kills: the diagnosis's bound (min_scale, not max_scale), its streak test moved by one, and its
    closing pointer to overflow_report()."""
    from lossscale.diagnosis import diagnose
    p = DynamicPolicy()
    once = p.init_state().replace(scale=1.0, streak_start_scale=2.0, skipped_steps=1, nan_steps=1,
                                  overflow_streak=1, streak_nan_steps=1, steps=1)
    text = diagnose(p, once)
    lines = text.split("\n")
    assert lines[0].startswith("lossscale: 1 consecutive") and "(min_scale=1)." in lines[0]
    assert lines[1].startswith("NaN at the smallest scale")
    assert lines[-1].startswith("scaler.overflow_report() names the parameters that held inf and NaN")
    twice = once.replace(skipped_steps=2, nan_steps=2, overflow_streak=2, streak_nan_steps=2, steps=2,
                         streak_start_scale=4.0)
    assert diagnose(p, twice).split("\n")[1].startswith("NaN persisted")
    assert diagnose(StaticPolicy(), StaticPolicy().update(StaticPolicy().init_state(), True)).split("\n")[0].endswith(
        "to 65536.")


# ---------------------------------------------------------------- checkpoint: the loader's edges


def test_check_state_keeps_the_scale_within_float32s_normal_range():
    """Kills: the smallest normal refused (``<`` for ``<=``)."""
    p = DynamicPolicy(init_scale=1.0, min_scale=None)
    p.check_state(p.init_state().replace(scale=2.0**-126))
    with pytest.raises(ValueError, match="scale"):
        p.check_state(p.init_state().replace(scale=2.0**-127))


# ------------------------------------------ LogMax against a plain re-statement of OpenSeq2Seq's rule


# --------------------------------------------------------------------- non-finite losses (issue 13)
def _bad_streak(p, n, **changes):
    """A state ending a streak of ``n`` skipped steps, all of them non-finite losses."""
    return p.init_state().replace(steps=n, skipped_steps=n, inf_steps=n, bad_loss_steps=n, overflow_streak=n,
                                  streak_bad_loss_steps=n, **changes)


def test_a_streak_of_bad_losses_is_stuck_at_its_own_limit():
    """Kills: the bad-loss streak's limit lost (None, or ``max_consecutive_skips and BAD_LOSS_STREAK``)
    or compared with ``>``."""
    from lossscale.policy import BAD_LOSS_STREAK
    p, q = DynamicPolicy(), DynamicPolicy(max_consecutive_skips=3)
    assert p.is_stuck(_bad_streak(p, BAD_LOSS_STREAK), 2.0**16)
    assert not p.is_stuck(_bad_streak(p, BAD_LOSS_STREAK - 1), 2.0**16)
    assert q.is_stuck(_bad_streak(q, 3), 2.0**16) and not q.is_stuck(_bad_streak(q, 2), 2.0**16)


@pytest.mark.parametrize("changes", [
    dict(bad_loss_steps=4, streak_bad_loss_steps=1),   # more bad losses than skipped steps
    dict(bad_loss_steps=3, streak_bad_loss_steps=3),   # a streak of them longer than the streak
    dict(bad_loss_steps=1, streak_bad_loss_steps=2),   # more in the streak than in all
])
def test_check_state_refuses_bad_loss_counters_that_disagree(changes):
    """Kills: ``or`` turned ``and`` between the three bad-loss invariants."""
    p = _dyn()
    with pytest.raises(ValueError):
        p.check_state(p.init_state().replace(**{**_COUNTS, **changes}))
    p.check_state(p.init_state().replace(**{**_COUNTS, "bad_loss_steps": 1, "streak_bad_loss_steps": 1}))


def test_the_int32_tracker_holds_up_to_its_range():
    """Kills: the int32 bound of check_state moved (``2**31 - 2``, ``2 * 31 - 1``) or its kind renamed
    (then a float passes as the int32 tracker)."""
    p = DynamicPolicy(growth_interval=2**31 - 1)
    p.check_state(p.init_state().replace(growth_tracker=2**31 - 2))
    with pytest.raises(ValueError, match="growth_tracker"):
        p.check_state(p.init_state().replace(growth_tracker=1.0))


@pytest.mark.parametrize("cls", ALL_POLICIES)
def test_a_bad_loss_with_nan_gradients_counts_the_nan(cls):
    """Kills: a policy's bad-loss branch passing ``found_inf``/``found_nan`` to ``count`` as None or
    False (then a NaN step raises, or counts as inf)."""
    p = cls()
    s = p.update(p.init_state(), found_inf=True, found_nan=True, bad_loss=True)
    assert (s.skipped_steps, s.inf_steps, s.nan_steps, s.bad_loss_steps) == (1, 0, 1, 1)
    assert s.scale == p.init_state().scale


