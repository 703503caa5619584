"""The adaptive policy: its rule, a plain reference, hypothesis properties shared with the other
policies, device-form agreement, the scaler's amax plumbing, checkpoints, and the direction on digits."""

import math
import pickle

import numpy as np
import pytest
import torch
from _models import drive, quiet
from _rules import TensorForm, backoffs, f32, powers_of_two
from hypothesis import given, settings
from hypothesis import strategies as st

import lossscale
from lossscale import DynamicPolicy, StaticPolicy, is_power_of_two
from lossscale.adaptive import HIGHEST_SCALE, NO_AMAX, AdaptivePolicy, AdaptiveState
from lossscale.policy import SMALLEST_SCALE as LOWEST_SCALE


class Reference:
    """A deliberately plain, mutable re-statement of the adaptive rule (log2 instead of frexp)."""

    def __init__(self, p: AdaptivePolicy):
        self.p, self.scale, self.hyst, self.good = p, f32(p.init_scale), p.hysteresis, 0
        self.calibrated, self.window = False, None  # window: largest binade seen, None = nothing yet
        self.steps = self.skipped = 0
        self.lo = p.min_scale if p.min_scale is not None else 2.0**-126
        self.hi = p.max_scale if p.max_scale is not None else 2.0**127

    @staticmethod
    def binade(a):
        return math.floor(math.log2(a)) + 1  # exact for float32 values: log2 never rounds onto an integer

    def move(self, k):
        self.scale = f32(min(max(self.scale * 2.0**k, self.lo), self.hi))

    def step(self, overflow, amax):
        if amax is not None and not math.isfinite(amax):
            overflow = True
        self.steps += 1
        self.skipped += overflow
        top = self.p.limit_exp - self.p.margin_bits
        if not self.calibrated:
            self.good = 0
            if overflow:
                self.move(-self.p.search_bits)
            elif amax is not None and amax > 0:
                self.move(top - self.binade(amax))
                self.calibrated, self.window = True, None
            elif amax == 0:
                self.move(self.p.search_bits)
            return
        if overflow:
            self.good, self.window = 0, None
            if self.hyst > 1:
                self.hyst -= 1
            else:
                self.scale = max(f32(self.scale * self.p.backoff_factor), self.lo)
            return
        if amax is not None and amax > 0:
            e = self.binade(amax)
            self.window = e if self.window is None else max(self.window, e)
        self.good += 1
        if self.p.consecutive_hysteresis:
            self.hyst = self.p.hysteresis
        if self.good == self.p.growth_interval:
            if self.window is not None and top - self.window > 0:
                self.move(top - self.window)
            self.good, self.window, self.hyst = 0, None, self.p.hysteresis


pow2 = powers_of_two(-10, 40)


def _adaptive(init, margin, interval, search, bf, h, ch, lo, hi):
    """An AdaptivePolicy with its bounds around ``init`` (a non-power-of-two config warns by design)."""
    return quiet(
        lambda: AdaptivePolicy(
            init_scale=init,
            margin_bits=margin,
            growth_interval=interval,
            search_bits=search,
            backoff_factor=bf,
            hysteresis=h,
            consecutive_hysteresis=ch,
            min_scale=None if lo is None else min(lo, init),
            max_scale=None if hi is None else max(hi, init),
        )
    )


adaptive_configs = st.builds(
    _adaptive,
    pow2,
    st.integers(1, 8),
    st.integers(1, 5),
    st.sampled_from([1, 4, 16, 30]),
    st.sampled_from([0.5, 0.25]),
    st.integers(1, 3),
    st.booleans(),
    st.one_of(st.none(), pow2),
    st.one_of(st.none(), pow2),
)
# float32 amax values across the whole range (subnormals included), plus the special ones.
f32_values = st.builds(
    lambda m, k: f32(math.ldexp(m, k)), st.floats(0.5, 1.0, exclude_max=True), st.integers(-148, 128)
)
amaxes = st.one_of(st.none(), st.just(0.0), f32_values, st.sampled_from([math.inf, math.nan, 2.0**-149, 65504.0]))
# (found_inf, found_nan, amax); an overflow usually comes with a non-finite amax, but any mix must work.
events = st.lists(
    st.one_of(
        st.tuples(st.just(False), st.just(False), amaxes),
        st.tuples(st.just(True), st.booleans(), st.sampled_from([None, math.inf, math.nan, 1.0])),
    ),
    max_size=80,
)


@settings(max_examples=250, deadline=None)
@given(adaptive_configs, events)
def test_matches_reference_and_invariants(policy, seq):
    ref, s = Reference(policy), policy.init_state()
    lo, hi = policy.bounds()
    calibrated = False
    for found_inf, found_nan, amax in seq:
        before = s
        s = policy.update(s, found_inf=found_inf, found_nan=found_nan, amax=amax)
        ref.step(found_inf, amax)
        overflow = found_inf or (amax is not None and not math.isfinite(amax))
        assert s.scale == ref.scale and s.steps == ref.steps and s.skipped_steps == ref.skipped
        assert (s.growth_tracker, s.hysteresis_tracker) == (ref.good, ref.hyst)
        assert s.calibrated == ref.calibrated
        if ref.calibrated:
            assert s.window_exp == (NO_AMAX if ref.window is None else ref.window)
        assert math.isfinite(s.scale) and lo <= s.scale <= hi and is_power_of_two(s.scale)
        assert s.skipped_steps == s.inf_steps + s.nan_steps <= s.steps
        if calibrated:
            assert s.calibrated  # calibration happens once
            if overflow:
                assert s.scale <= before.scale  # an overflow never raises the scale
            elif s.scale > before.scale:  # a growth: only at a check, and within the margin
                assert s.growth_tracker == 0
                window = max(before.window_exp, math.frexp(amax)[1]) if amax else before.window_exp
                grown_by = round(math.log2(s.scale / before.scale))
                assert window + grown_by <= policy.limit_exp - policy.margin_bits
        calibrated = s.calibrated


@settings(max_examples=150, deadline=None)
@given(adaptive_configs, events)
def test_device_form_agrees_with_pure_form(policy, seq):
    s = policy.init_state()
    dev = TensorForm(policy, s)
    for found_inf, found_nan, amax in seq:
        s = policy.update(s, found_inf=found_inf, found_nan=found_nan, amax=amax)
        dev.step(found_inf, found_nan, amax)
        got = dev.to_state()
        assert got == s.replace(streak_start_scale=got.streak_start_scale) and (
            s.overflow_streak == 0 or got.streak_start_scale == s.streak_start_scale
        )


# ------------------------------------------------------------------ properties every policy shares
dynamic_configs = st.builds(
    lambda init, gi, h, lo, hi: DynamicPolicy(
        init_scale=init,
        growth_interval=gi,
        hysteresis=h,
        min_scale=None if lo is None else min(lo, init),
        max_scale=None if hi is None else max(hi, init),
    ),
    pow2,
    st.integers(1, 5),
    st.integers(1, 3),
    st.one_of(st.none(), pow2),
    st.one_of(st.none(), pow2),
)
static_configs = st.builds(StaticPolicy, pow2)
any_policy = st.one_of(adaptive_configs, dynamic_configs, static_configs)


@settings(max_examples=200, deadline=None)
@given(any_policy, events)
def test_properties_shared_by_every_policy(policy, seq):
    """Finite positive power-of-two scale within bounds, consistent counters, an overflow never raises
    the scale, a skipped step is exactly an overflow, and the device form agrees, for every policy."""
    needs_amax = getattr(policy, "needs_amax", False)
    s = policy.init_state()
    dev = TensorForm(policy, s)
    lo = getattr(policy, "min_scale", None)
    hi = getattr(policy, "max_scale", None)
    for found_inf, found_nan, amax in seq:
        if not needs_amax:
            amax = None  # the others neither take nor need it
        kw = {"amax": amax} if needs_amax else {}
        before = s
        s = policy.update(s, found_inf=found_inf, found_nan=found_nan, **kw)
        dev.step(found_inf, found_nan, amax)
        overflow = found_inf or (amax is not None and not math.isfinite(amax))
        assert math.isfinite(s.scale) and s.scale > 0 and is_power_of_two(s.scale)
        assert (lo is None or s.scale >= lo) and (hi is None or s.scale <= hi)
        assert s.steps == before.steps + 1
        assert s.skipped_steps == before.skipped_steps + overflow
        assert s.skipped_steps == s.inf_steps + s.nan_steps <= s.steps
        assert s.overflow_streak == (before.overflow_streak + 1 if overflow else 0)
        if overflow:
            assert s.scale <= before.scale
        assert dev.to_state().replace(streak_start_scale=0.0) == s.replace(streak_start_scale=0.0)


# ------------------------------------------------------------------ the rule, case by case
def test_calibrates_from_the_first_step_up_or_down_without_skipping():
    p = AdaptivePolicy(margin_bits=5, max_scale=None)
    s = p.update(p.init_state(), found_inf=False, amax=2.0**-11 * 1.5)  # 2**-11 <= amax < 2**-10: binade -10
    assert (
        s.scale == 2.0**16 * 2.0 ** (16 - 5 + 10) and s.skipped_steps == 0 and s.window_exp == NO_AMAX and s.calibrated
    )
    s = p.update(p.init_state(), found_inf=False, amax=40000.0)  # only 0.7 binade of headroom at 2**16
    assert s.scale == 2.0**16 * 2.0 ** (16 - 5 - 16)  # calibration may lower the scale, no overflow needed
    assert 40000.0 * s.scale / 2.0**16 < 2.0 ** (16 - 5)


def test_overflow_before_calibration_searches_down_then_calibrates():
    p = AdaptivePolicy()
    s = p.update(p.init_state(), found_inf=True, amax=math.inf)
    assert s.scale == 1.0 and s.skipped_steps == 1 and not s.calibrated  # 2**16 / 2**16
    s = p.update(s, found_inf=False, amax=300.0)  # binade 9
    assert s.scale == 2.0 ** (16 - 5 - 9) and s.skipped_steps == 1


def test_zero_gradients_search_up_before_calibration_and_hold_after():
    p = AdaptivePolicy(max_scale=2.0**40)
    s = p.update(p.init_state(), found_inf=False, amax=0.0)
    assert s.scale == 2.0**32 and not s.calibrated
    for _ in range(5):
        s = p.update(s, found_inf=False, amax=0.0)
        assert s.scale <= 2.0**40  # bounded: never past max_scale
    s = p.update(s, found_inf=False, amax=2.0**20)  # calibrates (down) at 2**40
    calibrated = s.scale
    for _ in range(3 * p.growth_interval):  # all-zero windows carry no information: hold
        s = p.update(s, found_inf=False, amax=0.0)
    assert s.scale == calibrated


def test_nonfinite_amax_is_an_overflow_told_inf_from_nan():
    p = AdaptivePolicy()
    s = p.update(p.update(p.init_state(), False, amax=1.0), False, amax=math.nan)
    assert s.skipped_steps == 1 and s.nan_steps == 1
    s = p.update(s, False, amax=math.inf)
    assert s.skipped_steps == 2 and s.inf_steps == 1


def test_grows_only_at_the_end_of_a_window_by_the_windows_largest_amax():
    p = AdaptivePolicy(margin_bits=4, growth_interval=3, max_scale=None)
    s = p.update(p.init_state(), False, amax=2.0**11)  # binade 12 -> calibrated at 2**16 (k=0)
    assert s.scale == 2.0**16
    s = p.update(s, False, amax=2.0**3)  # binade 4: room for 8 binades...
    s = p.update(s, False, amax=2.0**5)  # ...binade 6: room for 6
    assert s.scale == 2.0**16 and s.window_exp == 6  # not before the window ends
    s = p.update(s, False, amax=2.0**4)
    assert s.scale == 2.0**22 and s.growth_tracker == 0 and s.window_exp == NO_AMAX and s.calibrated
    for _ in range(3):  # a window at the margin: hold (no decrease on clean steps either)
        s = p.update(s, False, amax=2.0**14)
    assert s.scale == 2.0**22


def test_backs_off_on_overflow_after_calibration_with_hysteresis():
    p = AdaptivePolicy(hysteresis=2, consecutive_hysteresis=True)
    s = p.update(p.init_state(), False, amax=2.0**6)  # calibrated at 2**16 (16 - 5 - 7 = 4 -> 2**20)
    start = s.scale
    s = p.update(s, True)
    assert s.scale == start and s.hysteresis_tracker == 1  # tolerated
    s = p.update(p.update(s, False, amax=1.0), True)
    assert s.scale == start  # not consecutive: refilled in between
    s = p.update(s, True)
    assert s.scale == start / 2


def test_stuck_at_the_floor():
    p = AdaptivePolicy(init_scale=1.0, min_scale=1.0)
    s = p.update(p.init_state(), True)
    assert s.scale == 1.0 and p.is_stuck(s, scale_before=1.0)
    assert not p.is_stuck(p.update(s, False, amax=1.0), scale_before=1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(margin_bits=0), "margin_bits"),
        (dict(margin_bits=2.5), "margin_bits"),
        (dict(growth_interval=0), "growth_interval"),
        (dict(search_bits=0), "search_bits"),
        (dict(search_bits=100), "search_bits"),
        (dict(backoff_factor=1.0), "backoff_factor"),
        (dict(hysteresis=0), "hysteresis"),
        (dict(init_scale=float("nan")), "init_scale"),
        (dict(init_scale=2.0**30), "init_scale"),
        (dict(min_scale=4.0, max_scale=2.0, init_scale=4.0), "min_scale"),
        (dict(max_scale=2.0**200), "max_scale"),
        (dict(on_stuck="panic"), "on_stuck"),
    ],
)
def test_bad_config_raises_value_error_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptivePolicy(**kwargs)


def test_non_power_of_two_config_warns():
    with pytest.warns(UserWarning, match="power of two"):
        AdaptivePolicy(backoff_factor=0.7)


def test_defaults_bounds_when_none():
    assert AdaptivePolicy(min_scale=None, max_scale=None).bounds() == (LOWEST_SCALE, HIGHEST_SCALE)


# ------------------------------------- ties at powers of two, rounding backoffs, states from a checkpoint
# Mutation-killing tests (issue 15; "Kills: ..." names the change each was seen to fail on, docs/testing.md).
# Their strategies draw what the ones above do not: non-power-of-two scales and backoffs (every product
# rounds to float32), and amax exactly at a binade boundary.
rounding_configs = st.builds(
    _adaptive,
    st.one_of(powers_of_two(-10, 30), st.sampled_from([844422.0, 1000.0])),
    st.integers(1, 8),
    st.integers(1, 4),
    st.just(AdaptivePolicy.search_bits),
    backoffs,
    st.integers(1, 3),
    st.booleans(),
    st.one_of(st.none(), powers_of_two(-10, 30)),
    st.one_of(st.none(), powers_of_two(-10, 30)),
)
# amax exactly at a power of two (the binade boundary), one float32 step either side, and fp16's max.
tie_amaxes = st.builds(
    lambda k, d: float(np.nextafter(np.float32(2.0**k), np.float32(d * math.inf))) if d else 2.0**k,
    st.integers(-40, 30),
    st.sampled_from([0, 1, -1]),
)
tie_events = st.lists(
    st.one_of(
        st.tuples(
            st.just(False),
            st.just(False),
            st.one_of(tie_amaxes, st.just(0.0), st.none(), st.sampled_from([65504.0, 65536.0])),
        ),
        st.tuples(st.just(True), st.booleans(), st.sampled_from([None, math.inf, math.nan])),
    ),
    max_size=60,
)


@settings(max_examples=100, deadline=None)
@given(rounding_configs, tie_events)
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
    assert at.scale == 2.0**16 * 2.0 ** (16 - 4 + 9) and below.scale == 2.0 * at.scale


def test_adaptive_grows_by_a_single_binade_of_headroom():
    """Kills: growth only for ``k > 1`` binades of room (pure and device rules)."""
    p = AdaptivePolicy(margin_bits=4, growth_interval=2, max_scale=None)  # the target binade: 16 - 4 = 12
    s, dev = p.init_state().replace(calibrated=True), TensorForm(p, p.init_state().replace(calibrated=True))
    for _ in range(2):
        s = p.update(s, found_inf=False, amax=1500.0)  # binade 11: one binade of room
        dev.step(False, False, 1500.0)
    assert s.scale == dev.to_state().scale == 2.0**17


@st.composite
def adaptive_states(draw, policy):
    """Any state an AdaptivePolicy could load from a checkpoint (not only the ones its updates reach)."""
    calibrated = draw(st.booleans())
    return policy.init_state().replace(
        scale=2.0 ** draw(st.integers(0, 24)),
        calibrated=calibrated,
        growth_tracker=draw(st.integers(0, policy.growth_interval - 1)) if calibrated else 0,
        hysteresis_tracker=draw(st.integers(1, policy.hysteresis)),
        window_exp=draw(st.one_of(st.just(NO_AMAX), st.integers(-140, 130))) if calibrated else NO_AMAX,
    )


@settings(max_examples=60, deadline=None)
@given(rounding_configs.flatmap(lambda p: st.tuples(st.just(p), adaptive_states(p))), tie_events)
def test_adaptive_rules_agree_from_any_loadable_state(policy_state, seq):
    """Kills: a window's end, the tolerance or the search missing a state the updates never pass
    through but a checkpoint may hold (any trackers, any window, calibrated or not)."""
    policy, s = policy_state
    lo, hi = policy.bounds()
    s = s.replace(scale=min(max(s.scale, lo), hi))
    policy.check_state(s)
    dev = TensorForm(policy, s)
    for found_inf, found_nan, amax in seq[:20]:
        s = policy.update(s, found_inf=found_inf, found_nan=found_nan, amax=amax)
        dev.step(found_inf, found_nan, amax)
        assert dev.to_state() == s


@pytest.mark.parametrize("amax", [0.0, 2.0**-7, None])
def test_a_bad_loss_before_calibration_moves_nothing_in_either_form(amax):
    """All-zero gradients search up, but not with a bad loss (a NaN loss may leave zero gradients):
    the step is skipped and the scale, the calibration and the trackers stay. Kills: "all zero" taken
    without "clean" in the tensor rule."""
    p = AdaptivePolicy()
    s, dev = p.init_state(), TensorForm(p)
    s = p.update(s, found_inf=True, amax=amax, bad_loss=True)
    dev.step(True, False, amax, True)
    assert dev.to_state() == s and s.scale == p.init_state().scale and not s.calibrated


def test_an_uncalibrated_state_with_a_growth_tracker_is_refused():
    """Every uncalibrated step resets the tracker, so no update makes one; a checkpoint that holds one
    is refused naming the field (the tensor rule relies on it: it counts clean steps only after
    calibration)."""
    p = AdaptivePolicy()
    with pytest.raises(ValueError, match="growth_tracker=3 must be 0 before calibration"):
        p.check_state(p.init_state().replace(growth_tracker=3))
    p.check_state(p.init_state().replace(growth_tracker=3, calibrated=True))
    with pytest.raises(ValueError, match="growth_tracker=100 must be below growth_interval=100"):
        p.check_state(p.init_state().replace(growth_tracker=100, calibrated=True))  # a window already over
    p.check_state(p.init_state().replace(growth_tracker=99, calibrated=True))


# ------------------------------------------------------------------ through the scaler
def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _iteration(model, opt, scaler, step, mult=1.0, clip=False):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y) * mult
    scale = scaler.get_scale()
    scaler.scale(loss).backward()
    scaled_amax = max(float(p.grad.abs().max()) for p in model.parameters())  # what the scaler must see
    if clip:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    return scale, scaled_amax


@pytest.mark.parametrize("kind", ["sgd", "sgd_clip", "fused_adam"])
def test_scaler_feeds_the_policy_the_scaled_amax(kind):
    model = _mlp()
    opt = (
        torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
        if kind == "fused_adam"
        else torch.optim.SGD(model.parameters(), lr=0.1)
    )
    policy = AdaptivePolicy(growth_interval=2, max_scale=None)
    scaler = lossscale.GradScaler(policy=policy)
    expected = policy.init_state()
    for step in range(7):
        _, amax = _iteration(model, opt, scaler, step, mult=2.0**-20, clip=kind == "sgd_clip")
        expected = policy.update(expected, found_inf=not math.isfinite(amax), amax=amax)
        assert scaler.state() == expected, step
    assert scaler.get_scale() > 2.0**30  # calibrated far above torch's 2**16 for these tiny gradients


def test_scaler_takes_the_max_amax_over_optimizers():
    a, b = _mlp(0), _mlp(1)
    with torch.no_grad():
        for p in b.parameters():
            p.mul_(8.0)  # b's gradients are larger
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    policy = AdaptivePolicy(init_scale=2.0**4)
    scaler = lossscale.GradScaler(policy=policy)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(a(x), y) + torch.nn.functional.cross_entropy(b(x), y)
    scaler.scale(loss).backward()
    amax_a = max(float(p.grad.abs().max()) for p in a.parameters())  # scaled: step() has not unscaled yet
    amax = max(float(p.grad.abs().max()) for p in [*a.parameters(), *b.parameters()])
    scaler.step(oa)
    scaler.step(ob)
    scaler.update()
    assert math.isfinite(amax) and amax > amax_a  # b's amax decides
    assert scaler.state() == policy.update(policy.init_state(), False, amax=amax)


def test_large_gradients_cost_one_skip_not_one_per_halving():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    ours, ref = lossscale.GradScaler(policy="adaptive"), torch.amp.GradScaler("cpu")
    ref_model, ref_opt = _mlp(), None
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=1e-6)
    for step in range(12):
        _iteration(model, opt, ours, step, mult=2.0**12)
        _iteration(ref_model, ref_opt, ref, step, mult=2.0**12)
    assert ours.skipped_steps == 1
    assert ref.get_scale() < 2.0**16 / 2**8  # torch halved its way down, one skipped step each


def test_gradscaler_policy_name_maps_the_keywords():
    s = lossscale.GradScaler(policy="adaptive")
    assert s.policy == AdaptivePolicy()
    s = lossscale.GradScaler(
        policy="adaptive", growth_interval=7, init_scale=2.0**10, min_scale=None, max_scale=None, hysteresis=2
    )
    assert s.policy == AdaptivePolicy(
        growth_interval=7, init_scale=2.0**10, min_scale=None, max_scale=None, hysteresis=2
    )
    # growth_factor is not the adaptive policy's (it grows by measured headroom): validated, warned about.
    with pytest.warns(UserWarning, match="growth_factor=4.0 do\\(es\\) not apply"):
        s = lossscale.GradScaler(policy="adaptive", growth_factor=4.0)
    assert s.policy == AdaptivePolicy()
    with pytest.raises(ValueError, match="growth_factor"):
        lossscale.GradScaler(policy="adaptive", growth_factor=0.5)
    assert "adaptive" in lossscale.policy.policy_names()


@pytest.mark.filterwarnings("ignore:lossscale. the checkpoint.s policy replaces:UserWarning")  # by design here
def test_state_dict_round_trip_covers_every_field():
    policy = AdaptivePolicy(
        init_scale=2.0**5,
        margin_bits=3,
        growth_interval=4,
        search_bits=7,
        backoff_factor=0.25,
        hysteresis=3,
        consecutive_hysteresis=True,
        min_scale=2.0**-3,
        max_scale=2.0**40,
        on_stuck="ignore",
        max_consecutive_skips=7,
    )
    scaler = lossscale.GradScaler(policy=policy)
    drive(scaler, (False, True, False, True, True, False))
    sd = scaler.state_dict()
    defaults = AdaptiveState(scale=1.0)
    assert all(
        sd["state"][k] != getattr(defaults, k)
        for k in ("window_exp", "growth_tracker", "hysteresis_tracker", "nan_steps", "streak_start_scale")
    )
    other = lossscale.GradScaler()
    other.load_state_dict(sd)
    assert other.state_dict() == sd and other.policy == policy
    assert pickle.loads(pickle.dumps(scaler)).state_dict() == sd
    # and the restored scaler continues exactly as the original
    for s in (scaler, other):
        drive(s, (False,))
    assert other.state_dict() == scaler.state_dict()


# ------------------------------------------------------------------ the direction, on one tiny case
def _flushed_frac(model, x, y, c, scale):
    """Share of the nonzero exact activation gradients (Linear outputs) FP16 flushes at ``scale``."""
    grads = []
    hooks = [
        m.register_full_backward_hook(lambda mod, gi, go: grads.append(go[0].detach()))
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    x = x.clone().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(model(x), y) * c
    torch.autograd.grad(loss, [x, *model.parameters()])
    for h in hooks:
        h.remove()
    g = torch.cat([t.flatten() for t in grads])
    nonzero = g != 0
    return float((((g.double() * scale).float().half() == 0) & nonzero).sum() / nonzero.sum())


def test_direction_on_digits_adaptive_skips_no_more_and_flushes_less_than_torch():
    sklearn = pytest.importorskip("sklearn.datasets")
    digits = sklearn.load_digits()
    x = torch.tensor(digits.data[:512], dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target[:512])
    c = 2.0**-20
    results = {}
    for name, make in (
        ("torch", lambda: torch.amp.GradScaler("cpu")),
        ("adaptive", lambda: lossscale.GradScaler(policy="adaptive")),
    ):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.2 / c, momentum=0.9)
        scaler, skipped, flushed = make(), 0, []
        g = torch.Generator().manual_seed(0)
        for step in range(60):  # by then most examples are learnt: their gradients are the tiny ones
            idx = torch.randint(0, len(x), (32,), generator=g)
            scale = scaler.get_scale()
            if step % 5 == 4:
                flushed.append(_flushed_frac(model, x[idx], y[idx], c, scale))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx]) * c
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < scale
        with torch.no_grad():
            acc = float((model(x).argmax(1) == y).float().mean())
        results[name] = (skipped, sum(flushed) / len(flushed), acc)
    (t_skip, t_flush, _), (a_skip, a_flush, a_acc) = results["torch"], results["adaptive"]
    assert a_skip <= t_skip
    assert t_flush > 0.01 and a_flush <= 0.5 * t_flush, results
    assert a_acc > 0.9, results
