"""The pure policy: validation, a tiny reference model, hypothesis properties, device-form agreement."""

import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lossscale import DynamicPolicy, ScaleState, StaticPolicy, is_power_of_two
from _rules import TensorForm


def f32(x):
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.inf


class Reference:
    """A deliberately plain, mutable re-statement of the dynamic rule (DeepSpeed's ``cur_hysteresis``
    shape; Megatron's and torch's scales)."""

    def __init__(self, p: DynamicPolicy):
        self.p, self.scale, self.good, self.hyst = p, f32(p.init_scale), 0, p.hysteresis
        self.steps = self.skipped = self.infs = self.nans = self.streak = 0

    def step(self, overflow, nan):
        self.steps += 1
        if overflow:
            self.skipped += 1
            self.streak += 1
            if nan:
                self.nans += 1
            else:
                self.infs += 1
            self.good = 0
            if self.hyst > 1:
                self.hyst -= 1
            else:
                new = f32(self.scale * self.p.backoff_factor)
                self.scale = new if self.p.min_scale is None else max(new, self.p.min_scale)
            return
        self.streak = 0
        self.good += 1
        if self.p.consecutive_hysteresis:
            self.hyst = self.p.hysteresis
        if self.good == self.p.growth_interval:
            new = f32(self.scale * self.p.growth_factor)
            if new != math.inf:
                self.scale = new if self.p.max_scale is None else min(new, self.p.max_scale)
            self.good = 0
            self.hyst = self.p.hysteresis


pow2 = st.integers(-10, 30).map(lambda k: 2.0**k)
configs = st.builds(
    lambda init, gf, bf, gi, h, ch, lo, hi: DynamicPolicy(
        init_scale=init, growth_factor=gf, backoff_factor=bf, growth_interval=gi, hysteresis=h,
        consecutive_hysteresis=ch, min_scale=None if lo is None else min(lo, init),
        max_scale=None if hi is None else max(hi, init)),
    pow2, st.sampled_from([2.0, 4.0]), st.sampled_from([0.5, 0.25]), st.integers(1, 5), st.integers(1, 4),
    st.booleans(), st.one_of(st.none(), pow2), st.one_of(st.none(), pow2),
)
flags = st.lists(st.sampled_from([(False, False), (True, False), (True, True)]), max_size=120)


@settings(max_examples=300, deadline=None)
@given(configs, flags)
def test_matches_reference_and_invariants(policy, seq):
    ref, s = Reference(policy), policy.init_state()
    for overflow, nan in seq:
        s = policy.update(s, found_inf=overflow, found_nan=nan)
        ref.step(overflow, nan)
        assert (s.scale, s.growth_tracker, s.hysteresis_tracker) == (ref.scale, ref.good, ref.hyst)
        assert (s.steps, s.skipped_steps, s.inf_steps, s.nan_steps, s.overflow_streak) == (
            ref.steps, ref.skipped, ref.infs, ref.nans, ref.streak)
        assert math.isfinite(s.scale) and s.scale > 0
        assert is_power_of_two(s.scale)  # power-of-two config stays on the powers of two
        if policy.min_scale is not None:
            assert s.scale >= policy.min_scale
        if policy.max_scale is not None:
            assert s.scale <= policy.max_scale
        assert s.skipped_steps == s.inf_steps + s.nan_steps <= s.steps
        assert 1 <= s.hysteresis_tracker <= policy.hysteresis  # never below 1: hysteresis=1 never moves it


@settings(max_examples=200, deadline=None)
@given(configs, flags)
def test_device_form_agrees_with_pure_form(policy, seq):
    s = policy.init_state()
    dev = TensorForm(policy, s)
    for overflow, nan in seq:
        s = policy.update(s, found_inf=overflow, found_nan=nan)
        dev.step(overflow, nan)
        got = dev.to_state()
        assert got == s.replace(streak_start_scale=got.streak_start_scale) and (
            s.overflow_streak == 0 or got.streak_start_scale == s.streak_start_scale)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([1.0, 2.0**10, 2.0**16]), flags)
def test_static_policy_never_changes_scale_and_agrees_on_device(scale, seq):
    policy = StaticPolicy(scale=scale)
    s = policy.init_state()
    dev = TensorForm(policy, s)
    for overflow, nan in seq:
        s = policy.update(s, found_inf=overflow, found_nan=nan)
        dev.step(overflow, nan)
        assert s.scale == scale
        assert dev.to_state().replace(streak_start_scale=0.0) == s.replace(streak_start_scale=0.0)
    assert s.skipped_steps == sum(o for o, _ in seq)


def test_torch_rule_growth_refused_when_not_finite():
    p = DynamicPolicy(init_scale=2.0**127, growth_interval=1, min_scale=None, max_scale=None)
    s = p.update(p.init_state(), found_inf=False)
    assert s.scale == 2.0**127 and s.growth_tracker == 0


def test_cap_clamps_growth_to_max_scale():
    with pytest.warns(UserWarning, match="power of two"):
        p = DynamicPolicy(init_scale=2.0**10, growth_factor=4.0, growth_interval=1, max_scale=3000.0)
    s = p.update(p.init_state(), found_inf=False)
    assert s.scale == 3000.0
    assert p.update(s, found_inf=False).scale == 3000.0


def test_megatron_hysteresis_backs_off_every_overflow_once_spent():
    p = DynamicPolicy(init_scale=2.0**10, hysteresis=2, growth_interval=100)
    s = p.init_state()
    s = p.update(s, True)  # absorbed
    assert s.scale == 2.0**10 and s.hysteresis_tracker == 1
    s = p.update(s, False)  # not consecutive-refilling: tracker stays spent-ish
    s = p.update(s, True)
    assert s.scale == 2.0**9
    s = p.update(s, True)
    assert s.scale == 2.0**8  # every further overflow backs off


def test_deepspeed_consecutive_hysteresis_refills_on_clean_steps():
    p = DynamicPolicy(init_scale=2.0**10, hysteresis=2, consecutive_hysteresis=True, growth_interval=100)
    s = p.init_state()
    for _ in range(5):  # isolated overflows never back off
        s = p.update(p.update(s, True), False)
    assert s.scale == 2.0**10
    s = p.update(p.update(s, True), True)
    assert s.scale == 2.0**9


def test_counters_never_wrap():
    p = DynamicPolicy()
    s = p.init_state().replace(steps=2**63 - 1, skipped_steps=2**63 - 1, inf_steps=2**63 - 1)
    s = p.update(s, True)
    assert s.steps == 2**63 and s.skipped_steps == 2**63


@pytest.mark.parametrize("kwargs, match", [
    (dict(growth_factor=1.0), "growth_factor"),
    (dict(growth_factor=float("inf")), "growth_factor"),
    (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(backoff_factor=0.0), "backoff_factor"),
    (dict(growth_interval=0), "growth_interval"),
    (dict(growth_interval=2.5), "growth_interval"),
    (dict(hysteresis=0), "hysteresis"),
    (dict(init_scale=0.0), "init_scale"),
    (dict(init_scale=float("nan")), "init_scale"),
    (dict(min_scale=-1.0), "min_scale"),
    (dict(min_scale=4.0, max_scale=2.0, init_scale=4.0), "min_scale"),
    (dict(init_scale=2.0**30), "max_scale"),
    (dict(init_scale=0.5), "min_scale"),
    (dict(on_stuck="panic"), "on_stuck"),
    (dict(max_consecutive_skips=0), "max_consecutive_skips"),
])
def test_bad_config_raises_value_error_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicPolicy(**kwargs)


def test_found_nan_without_found_inf_is_rejected():
    with pytest.raises(ValueError, match="found_inf"):
        DynamicPolicy().update(DynamicPolicy().init_state(), found_inf=False, found_nan=True)


def test_non_power_of_two_warns_once_per_config_and_why():
    with pytest.warns(UserWarning, match="exact") as record:
        DynamicPolicy(init_scale=1000.0, min_scale=None)
    assert len(record) == 1


def test_stuck_detection():
    p = DynamicPolicy(init_scale=2.0, min_scale=1.0, max_consecutive_skips=None)
    s = p.update(p.init_state(), True)  # 2 -> 1: reached the floor, not yet stuck
    assert not p.is_stuck(s, scale_before=2.0)
    s2 = p.update(s, True)  # overflow at the floor
    assert p.is_stuck(s2, scale_before=s.scale)
    q = DynamicPolicy(max_consecutive_skips=3)
    s = q.init_state()
    for _ in range(3):
        before, s = s.scale, q.update(s, True)
    assert q.is_stuck(s, before)


def test_policy_state_is_a_plain_value():
    s = ScaleState(scale=1.0)
    with pytest.raises(Exception):
        s.scale = 2.0  # frozen
