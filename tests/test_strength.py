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
from _rules import TensorForm
from lossscale import AdaptivePolicy, DynamicPolicy, LogMaxPolicy, StaticPolicy, formats
from lossscale.adaptive import NO_AMAX, AdaptiveState
from lossscale.checkpoint import to_dict
from lossscale.dynamic import DynamicState
from lossscale.logmax import LogMaxState
from lossscale.policy import f32
from lossscale.static import StaticState
from lossscale.stats import grad_stats, recommend_scale

TORCH_LIKE = dict(hysteresis=1, min_scale=None, max_scale=None)


def quiet(make):
    """Build a config whose non-power-of-two values warn by design."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make()


# ------------------------------------------------------------------------------------ strategies
pow2 = st.integers(-10, 30).map(lambda k: 2.0**k)
# Scales and factors off the powers of two: every product rounds to float32.
any_scale = st.one_of(pow2, st.floats(1.0, 2.0**24).map(f32), st.sampled_from([844422.0, 1000.0, 3.0]))
backoffs = st.one_of(st.sampled_from([0.5, 0.25, 0.9, 0.7, 0.1]), st.floats(0.01, 0.99))
growths = st.one_of(st.sampled_from([2.0, 4.0, 1.5, 1.1, 3.0]), st.floats(1.001, 8.0))


def _chain(x, factor, n):
    """``x`` multiplied ``n`` times by ``factor``, rounded to float32 each time, as the rules do."""
    for _ in range(n):
        x = f32(x * factor)
    return x


@st.composite
def dynamic_configs(draw):
    """A DynamicPolicy; bounds None, anywhere, or exactly where a chain of backoffs/growths lands (a tie)."""
    init, bf, gf = draw(any_scale), draw(backoffs), draw(growths)
    lo = draw(st.one_of(st.none(), any_scale.map(lambda v: min(v, init)),
                        st.integers(1, 4).map(lambda n: _chain(f32(init), bf, n))))
    hi = draw(st.one_of(st.none(), any_scale.map(lambda v: max(v, init)),
                        st.integers(1, 4).map(lambda n: _chain(f32(init), gf, n))))
    if hi is not None and not math.isfinite(hi):
        hi = None
    return quiet(lambda: DynamicPolicy(
        init_scale=init, growth_factor=gf, backoff_factor=bf, growth_interval=draw(st.integers(1, 4)),
        hysteresis=draw(st.integers(1, 4)), consecutive_hysteresis=draw(st.booleans()),
        min_scale=lo, max_scale=hi))


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
    assert s.streak_start_scale == 2.0**16 and s.scale == 2.0**15


# --------------------------------------------------------------- 2. state_dict() keeps every field
def _every_field_set():
    """A policy of each kind and a state in which every field differs from its default."""
    shared = dict(scale=2.0**10, steps=9, skipped_steps=5, inf_steps=3, nan_steps=2, bad_loss_steps=2,
                  overflow_streak=2, streak_nan_steps=1, streak_bad_loss_steps=1, streak_start_scale=2.0**12)
    return [
        (DynamicPolicy(init_scale=2.0**14, growth_interval=10, hysteresis=3, max_consecutive_skips=9),
         DynamicState(**shared, growth_tracker=4, hysteresis_tracker=2)),
        (StaticPolicy(scale=2.0**10, max_consecutive_skips=9), StaticState(**shared, growth_tracker=7)),
        (AdaptivePolicy(growth_interval=10, hysteresis=3, max_scale=None),
         AdaptiveState(**shared, growth_tracker=3, hysteresis_tracker=2, calibrated=True, window_exp=-7)),
        (LogMaxPolicy(init_scale=2.0**3, min_scale=1.0, max_scale=2.0**20),
         LogMaxState(**shared, x_hat=-3.25, slow_x_hat=-1.5, xsquared_hat=4.75, b1_correction=0.9801,
                     b2_correction=0.998001)),
    ]


def _fields(state):
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}


@pytest.mark.parametrize("policy, state", _every_field_set(), ids=lambda v: type(v).__name__)
def test_state_dict_round_trip_keeps_every_field_of_the_state(policy, state):
    """Kills: state_dict() (checkpoint.to_dict) or the loader dropping or resetting any one field,
    e.g. the overflow streak (then a reload delays the max_consecutive_skips check); also a
    TensorState that mixes up two fields of one vector."""
    init = policy.init_state()
    for f in dataclasses.fields(state):  # the test only means something if every field is off its default
        if f.name == "scale" and isinstance(policy, StaticPolicy):
            continue  # a static scale is its config
        default = f.default if f.default is not dataclasses.MISSING else None
        assert getattr(state, f.name) not in (default, getattr(init, f.name)), f.name
    scaler = lossscale.GradScaler("cpu")
    scaler.init_device("cpu")
    quiet(lambda: scaler.load_state_dict(to_dict(policy, state)))
    assert _fields(scaler.state()) == _fields(state)  # the device state holds it all
    for copy in (lossscale.GradScaler("cpu"), lossscale.GradScaler()):  # on device and before the first scale()
        quiet(lambda: copy.load_state_dict(scaler.state_dict()))
        assert type(copy.state()) is type(state) and _fields(copy.state()) == _fields(state)
        assert copy.policy == policy
    assert _fields(pickle.loads(pickle.dumps(scaler)).state()) == _fields(state)


# ------------------------------------------------ 3. a torch checkpoint taken mid-run (tracker > 0)
def _clean_steps(scaler, p, opt, n):
    scales = []
    for _ in range(n):
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def test_torch_checkpoint_taken_mid_run_grows_at_the_same_step_as_torch():
    """Kills: the torch-format loader ignoring ``_growth_tracker`` (the state starting with
    growth_tracker=0): torch grows 2 steps after the save, a reset tracker 5."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=5)
    _clean_steps(ref, p, opt, 3)
    assert ref._get_growth_tracker() == 3  # taken mid-run
    ours = lossscale.GradScaler("cpu", **TORCH_LIKE)
    quiet(lambda: ours.load_state_dict(ref.state_dict()))
    assert ours._get_growth_tracker() == 3 and ours.state().growth_tracker == 3
    q = torch.nn.Parameter(torch.ones(2))
    theirs = _clean_steps(ref, p, opt, 7)
    mine = _clean_steps(ours, q, torch.optim.SGD([q], lr=0.1), 7)
    assert mine == theirs == [2.0**10, 2.0**11, 2.0**11, 2.0**11, 2.0**11, 2.0**11, 2.0**12]


def test_our_checkpoint_taken_mid_run_continues_in_torch_at_the_same_step():
    """Kills: ``torch_state`` writing ``_growth_tracker`` as 0 (or dropping it): torch then grows
    late after loading our checkpoint."""
    ours = lossscale.GradScaler("cpu", init_scale=2.0**10, growth_interval=5, **TORCH_LIKE)
    p = torch.nn.Parameter(torch.ones(2))
    _clean_steps(ours, p, torch.optim.SGD([p], lr=0.1), 3)
    ref = torch.amp.GradScaler("cpu")
    ref.load_state_dict(ours.state_dict())
    assert ref._get_growth_tracker() == 3
    q = torch.nn.Parameter(torch.ones(2))
    assert _clean_steps(ref, q, torch.optim.SGD([q], lr=0.1), 3)[1] == 2.0**11


# ------------------------------------------ 4, 5. float32 rounding of a non-power-of-two backoff
def test_pure_dynamic_rule_rounds_a_non_power_of_two_backoff_to_float32():
    """Kills: the pure rule's backoff without ``f32`` (``scale = scale * self.backoff_factor``):
    683981.82 instead of the device scale 683981.8125."""
    p = quiet(lambda: DynamicPolicy(init_scale=844422.0, backoff_factor=0.9, hysteresis=2, min_scale=None))
    s = p.init_state()
    scales = []
    for _ in range(3):
        s = p.update(s, found_inf=True)
        scales.append(s.scale)
    assert scales == [844422.0, 759979.8125, 683981.8125]


def test_tensor_dynamic_rule_multiplies_in_float64_then_rounds_with_hysteresis():
    """Kills: the device rule's backoff multiplied in float32 (``t.scale * self.backoff_factor``
    without ``.double()``): 759979.75 instead of 759979.8125 once hysteresis is spent. torch's own
    kernel covers only hysteresis 1, so this path is ours alone."""
    p = quiet(lambda: DynamicPolicy(init_scale=844422.0, backoff_factor=0.9, hysteresis=2, min_scale=None))
    dev = TensorForm(p)
    scales = []
    for _ in range(3):
        dev.step(True)
        scales.append(dev.t.scale.item())
    assert scales == [844422.0, 759979.8125, 683981.8125]


def test_tensor_dynamic_rule_rounds_a_non_power_of_two_growth_like_the_pure_rule():
    """The growth side of the same rounding (``(t.scale.double() * growth_factor).float()``)."""
    p = quiet(lambda: DynamicPolicy(init_scale=844422.0, growth_factor=1.1, growth_interval=1, hysteresis=2,
                                    max_scale=None))
    s, dev = p.init_state(), TensorForm(p)
    for _ in range(4):
        s = p.update(s, found_inf=False)
        dev.step(False)
        assert dev.t.scale.item() == s.scale == _chain(844422.0, 1.1, s.steps)


@settings(max_examples=150, deadline=None)
@given(dynamic_configs(), flags)
def test_dynamic_pure_and_device_rules_agree_for_any_factor_and_bound(policy, seq):
    """Widens test_policy's configs: non-power-of-two scales and factors, bounds on a tie. Kills the
    two rounding changes above and any min/max clamp that is off by one comparison."""
    s, dev = policy.init_state(), TensorForm(policy)
    lo = policy.lowest()  # min_scale, or float32's smallest normal when None
    hi = None if policy.max_scale is None else f32(policy.max_scale)
    for overflow, nan in seq:
        before = s
        s = policy.update(s, found_inf=overflow, found_nan=nan)
        dev.step(overflow, nan)
        assert dev.to_state() == s
        # the rule itself, with float32 rounding and the bounds, from the previous state
        if overflow and before.hysteresis_tracker <= 1:
            want = f32(before.scale * policy.backoff_factor)
            assert s.scale == max(want, lo)
        elif not overflow and s.growth_tracker == 0:
            grown = f32(before.scale * policy.growth_factor)
            want = before.scale if not math.isfinite(grown) else grown if hi is None else min(grown, hi)
            assert s.scale == want
        else:
            assert s.scale == before.scale
        assert s.scale >= lo and (hi is None or s.scale <= hi)


@settings(max_examples=100, deadline=None)
@given(any_scale, backoffs, growths, st.integers(1, 4), st.lists(st.booleans(), max_size=60))
def test_hysteresis_one_is_torchs_kernel_for_any_factor(init, bf, gf, interval, seq):
    """The pure rule against torch's own ``_amp_update_scale_`` with non-power-of-two factors."""
    p = quiet(lambda: DynamicPolicy(init_scale=init, growth_factor=gf, backoff_factor=bf, growth_interval=interval,
                                    **TORCH_LIKE))
    s = p.init_state()
    scale, tracker = torch.tensor(f32(init)), torch.zeros((), dtype=torch.int32)
    for overflow in seq:
        s = p.update(s, found_inf=overflow)
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(overflow)), gf, bf, interval)
        assert (s.scale, s.growth_tracker) == (scale.item(), tracker.item())


# --------------------------------------- the adaptive rule: ties at powers of two, rounding backoffs
def _adaptive(init, margin, interval, bf, h, ch, lo, hi):
    return quiet(lambda: AdaptivePolicy(init_scale=init, margin_bits=margin, growth_interval=interval,
                                        backoff_factor=bf, hysteresis=h, consecutive_hysteresis=ch,
                                        min_scale=None if lo is None else min(lo, init),
                                        max_scale=None if hi is None else max(hi, init)))


adaptive_configs = st.builds(
    _adaptive, st.one_of(pow2, st.sampled_from([844422.0, 1000.0])), st.integers(1, 8), st.integers(1, 4), backoffs,
    st.integers(1, 3), st.booleans(), st.one_of(st.none(), pow2), st.one_of(st.none(), pow2))
# amax exactly at a power of two (the binade boundary), one float32 step either side, and fp16's max.
tie_amaxes = st.builds(lambda k, d: float(np.nextafter(np.float32(2.0**k), np.float32(d * math.inf)))
                       if d else 2.0**k, st.integers(-40, 30), st.sampled_from([0, 1, -1]))
adaptive_events = st.lists(
    st.one_of(st.tuples(st.just(False), st.just(False),
                        st.one_of(tie_amaxes, st.just(0.0), st.none(), st.sampled_from([65504.0, 65536.0]))),
              st.tuples(st.just(True), st.booleans(), st.sampled_from([None, math.inf, math.nan]))),
    max_size=60)


@settings(max_examples=100, deadline=None)
@given(adaptive_configs, adaptive_events)
def test_adaptive_pure_and_device_rules_agree_at_binade_ties_and_rounding_backoffs(policy, seq):
    s, dev = policy.init_state(), TensorForm(policy)
    for found_inf, found_nan, amax in seq:
        before = s
        s = policy.update(s, found_inf=found_inf, found_nan=found_nan, amax=amax)
        dev.step(found_inf, found_nan, amax)
        assert dev.to_state() == s
        if not before.calibrated and not found_inf and amax is not None and amax > 0:
            # calibration: the measured amax lands at least margin_bits binades under the format's max
            lo, hi = policy.bounds()
            if lo < s.scale < hi:
                assert amax / before.scale * s.scale < 2.0 ** (policy.limit_exp - policy.margin_bits)
                assert amax / before.scale * s.scale >= 2.0 ** (policy.limit_exp - policy.margin_bits - 1)


def test_adaptive_binade_of_an_exact_power_of_two():
    """amax = 2**e lies in binade e + 1 (amax < 2**(e+1)); one float32 step below it, in binade e."""
    p = AdaptivePolicy(margin_bits=4, max_scale=None)
    at = p.update(p.init_state(), found_inf=False, amax=2.0**-10)
    below = p.update(p.init_state(), found_inf=False, amax=float(np.nextafter(np.float32(2.0**-10), np.float32(0))))
    assert at.scale == 2.0**16 * 2.0**(16 - 4 + 9) and below.scale == 2.0 * at.scale


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
