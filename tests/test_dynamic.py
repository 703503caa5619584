"""The dynamic policy (torch's rule, with Megatron's and DeepSpeed's hysteresis and bounds): a plain
reference, hypothesis properties, the device form against the pure form, torch's own kernel, and the
cases that only a deliberate bug showed to be unguarded.

The mutation-killing tests (issue 15) name, in their docstrings, the one-line change to the library
they were seen to fail on ("Kills: ..."); the score that keeps them honest is in docs/testing.md. Their
strategies draw what the plain ones do not: factors and scales that are not powers of two (so every
product rounds to float32 and the two forms of the rule can disagree), and bounds exactly where a chain
of backoffs or growths lands.
"""

import math
import struct

import pytest
import torch
from _models import TORCH_RULE, quiet
from _rules import TensorForm, backoffs, f32, flag_lists, powers_of_two
from hypothesis import given, settings
from hypothesis import strategies as st

import lossscale
from lossscale import DynamicPolicy, is_power_of_two


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


pow2 = powers_of_two(-10, 30)
configs = st.builds(
    lambda init, gf, bf, gi, h, ch, lo, hi: DynamicPolicy(
        init_scale=init,
        growth_factor=gf,
        backoff_factor=bf,
        growth_interval=gi,
        hysteresis=h,
        consecutive_hysteresis=ch,
        min_scale=None if lo is None else min(lo, init),
        max_scale=None if hi is None else max(hi, init),
    ),
    pow2,
    st.sampled_from([2.0, 4.0]),
    st.sampled_from([0.5, 0.25]),
    st.integers(1, 5),
    st.integers(1, 4),
    st.booleans(),
    st.one_of(st.none(), pow2),
    st.one_of(st.none(), pow2),
)

flags = flag_lists(120)


@settings(max_examples=300, deadline=None)
@given(configs, flags)
def test_matches_reference_and_invariants(policy, seq):
    ref, s = Reference(policy), policy.init_state()
    for overflow, nan in seq:
        s = policy.update(s, found_inf=overflow, found_nan=nan)
        ref.step(overflow, nan)
        assert (s.scale, s.growth_tracker, s.hysteresis_tracker) == (ref.scale, ref.good, ref.hyst)
        assert (s.steps, s.skipped_steps, s.inf_steps, s.nan_steps, s.overflow_streak) == (
            ref.steps,
            ref.skipped,
            ref.infs,
            ref.nans,
            ref.streak,
        )
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
            s.overflow_streak == 0 or got.streak_start_scale == s.streak_start_scale
        )


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


@pytest.mark.parametrize(
    "kwargs, match",
    [
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
        (dict(init_scale=0.5, min_scale=1.0), "min_scale"),
        (dict(on_stuck="panic"), "on_stuck"),
        (dict(max_consecutive_skips=0), "max_consecutive_skips"),
    ],
)
def test_bad_config_raises_value_error_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicPolicy(**kwargs)


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


# ------------------------------------------------------- float32 rounding of a non-power-of-two factor
# Scales and factors off the powers of two: every product rounds to float32.
any_scale = st.one_of(pow2, st.floats(1.0, 2.0**24).map(f32), st.sampled_from([844422.0, 1000.0, 3.0]))
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
    lo = draw(
        st.one_of(
            st.none(), any_scale.map(lambda v: min(v, init)), st.integers(1, 4).map(lambda n: _chain(f32(init), bf, n))
        )
    )
    hi = draw(
        st.one_of(
            st.none(), any_scale.map(lambda v: max(v, init)), st.integers(1, 4).map(lambda n: _chain(f32(init), gf, n))
        )
    )
    if hi is not None and not math.isfinite(hi):
        hi = None
    return quiet(
        lambda: DynamicPolicy(
            init_scale=init,
            growth_factor=gf,
            backoff_factor=bf,
            growth_interval=draw(st.integers(1, 4)),
            hysteresis=draw(st.integers(1, 4)),
            consecutive_hysteresis=draw(st.booleans()),
            min_scale=lo,
            max_scale=hi,
        )
    )


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
    without ``.double()``): 759979.75 instead of 759979.8125 once hysteresis is spent, and a spared
    overflow that does not hold the scale where it was."""
    p = quiet(lambda: DynamicPolicy(init_scale=844422.0, backoff_factor=0.9, hysteresis=2, min_scale=None))
    dev = TensorForm(p)
    scales = []
    for _ in range(3):
        dev.step(True)
        scales.append(dev.t.scale.item())
    assert scales == [844422.0, 759979.8125, 683981.8125]


def test_tensor_dynamic_rule_rounds_a_non_power_of_two_growth_like_the_pure_rule():
    """The growth side of the same rounding (``(t.scale.double() * growth_factor).float()``)."""
    p = quiet(
        lambda: DynamicPolicy(init_scale=844422.0, growth_factor=1.1, growth_interval=1, hysteresis=2, max_scale=None)
    )
    s, dev = p.init_state(), TensorForm(p)
    for _ in range(4):
        s = p.update(s, found_inf=False)
        dev.step(False)
        assert dev.t.scale.item() == s.scale == _chain(844422.0, 1.1, s.steps)


@settings(max_examples=150, deadline=None)
@given(dynamic_configs(), flag_lists(60))
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


#: One iteration: (overflow, nan, bad loss); a bad loss comes with or without NaN gradients.
_WITH_BAD_LOSSES = st.lists(
    st.sampled_from(
        [(False, False, False), (True, False, False), (True, True, False), (False, False, True), (True, True, True)]
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(dynamic_configs(), _WITH_BAD_LOSSES)
def test_a_bad_loss_moves_nothing_in_either_form_whatever_the_hysteresis(policy, seq):
    """The device rule hands torch's kernel "no overflow" on a bad loss and steps the growth tracker
    back first; the hysteresis tracker and the scale must not move either, at any point of a growth
    interval or a spent tolerance. Kills: the step back dropped (a growth one step early), a bad
    loss spending the tolerance, the clamp's floor taken from the wrong scale."""
    s, dev = policy.init_state(), TensorForm(policy)
    for overflow, nan, bad in seq:
        before = s
        s = policy.update(s, found_inf=overflow or bad, found_nan=nan, bad_loss=bad)
        dev.step(overflow, nan, bad_loss=bad)
        assert dev.to_state() == s
        if bad:
            assert (s.scale, s.growth_tracker, s.hysteresis_tracker) == (
                before.scale,
                before.growth_tracker,
                before.hysteresis_tracker,
            )


@settings(max_examples=100, deadline=None)
@given(any_scale, backoffs, growths, st.integers(1, 4), st.lists(st.booleans(), max_size=60))
def test_hysteresis_one_is_torchs_kernel_for_any_factor(init, bf, gf, interval, seq):
    """The pure rule against torch's own ``_amp_update_scale_`` with non-power-of-two factors."""
    p = quiet(
        lambda: DynamicPolicy(
            init_scale=init, growth_factor=gf, backoff_factor=bf, growth_interval=interval, **TORCH_RULE
        )
    )
    s = p.init_state()
    scale, tracker = torch.tensor(f32(init)), torch.zeros((), dtype=torch.int32)
    for overflow in seq:
        s = p.update(s, found_inf=overflow)
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(overflow)), gf, bf, interval)
        assert (s.scale, s.growth_tracker) == (scale.item(), tracker.item())  # below 2**-126 too, down to 0


# ----------------------------------------------------------------- torch's kernel path (hysteresis 1)
@pytest.mark.parametrize(
    "max_scale, scale, interval",
    [(2.0**127, 2.0**127, 1), (2.0**24, 2.0**24, 1), (2.0**24, 2.0**23, 1), (2.0**24, 2.0**24, 3)],
)
def test_torchs_kernel_path_holds_the_scale_at_max_scale_like_the_pure_rule(max_scale, scale, interval):
    """Kills: the cap of the hysteresis-1 path (torch's kernel plus one clamp) dropped, moved to the
    backoff, or applied before the kernel: a growth from max_scale stays there (refused as inf at
    2**127, capped below), one to max_scale lands on it, a non-growing step keeps it."""
    p = DynamicPolicy(init_scale=scale, growth_interval=interval, min_scale=None, max_scale=max_scale)
    s, dev = p.init_state(), TensorForm(p)
    for overflow in (False, False, True, False):
        s = p.update(s, found_inf=overflow)
        dev.step(overflow)
        assert dev.to_state() == s and s.scale <= max_scale


def test_the_tensor_rules_domain_is_every_scale_a_policy_accepts():
    """The dynamic tensor rule assumes ``lowest() <= scale <= max_scale`` (one clamp then serves as
    the floor after a backoff and the cap after a growth). Every way in refuses a scale outside it:
    the config, ``update(new_scale)`` (a float raises, a tensor is clamped or ignored) and a checkpoint."""
    p = DynamicPolicy(min_scale=2.0**4, max_scale=2.0**24)
    for bad in (2.0**3, 2.0**25, math.inf):
        with pytest.raises(ValueError):
            DynamicPolicy(init_scale=bad, min_scale=2.0**4, max_scale=2.0**24)
        with pytest.raises(ValueError):
            p.check_state(p.init_state().replace(scale=bad))
    unbounded = DynamicPolicy(min_scale=None, max_scale=None)
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            unbounded.check_state(unbounded.init_state().replace(scale=bad))
    for reached in (0.0, 2.0**-149, 2.0**-127):  # torch's backoff, unbounded, reaches them: so does this one's
        unbounded.check_state(unbounded.init_state().replace(scale=reached))
    scaler = lossscale.GradScaler("cpu", min_scale=2.0**4, max_scale=2.0**24)
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match="outside"):
        scaler.update(2.0**25)
    for value, kept in ((2.0**30, 2.0**24), (1.0, 2.0**4), (math.inf, 2.0**24), (0.0, 2.0**24)):
        scaler.discard_iteration()
        scaler.update(2.0**24)
        scaler.update(torch.tensor(value))
        assert scaler.get_scale() == kept


def test_the_dynamic_growth_interval_fits_torchs_int32_tracker():
    """Kills: the int32 bound of ``growth_interval`` dropped or moved."""
    assert DynamicPolicy(growth_interval=2**31 - 1).growth_interval == 2**31 - 1
    with pytest.raises(ValueError, match="^growth_interval="):
        DynamicPolicy(growth_interval=2**31)


@pytest.mark.parametrize("growth_factor", [2.0, 3.0, 1.1, 1.0000001, 1e30])
def test_a_growth_at_the_edge_of_float32_is_refused_alike_in_both_forms(growth_factor):
    """With no ``max_scale`` a growth may leave float32; the tensor rule (torch's kernel, here with
    hysteresis > 1 and its clamp to the scale before) refuses it where ``f32(scale * growth_factor)`` is
    inf, as the pure rule does. Tried on the largest float32 scale that still grows and the next one.
    Kills: the edge off by one float32 in either form."""

    def step(x, k):  # the k-th float32 after x (x > 0)
        return struct.unpack("f", struct.pack("I", struct.unpack("I", struct.pack("f", x))[0] + k))[0]

    edge = f32(3.4028234663852886e38 / growth_factor)  # float32's largest finite value, divided
    while math.isinf(f32(edge * growth_factor)):
        edge = step(edge, -1)
    while not math.isinf(f32(step(edge, 1) * growth_factor)):
        edge = step(edge, 1)
    above = step(edge, 1)
    assert math.isfinite(f32(edge * growth_factor)) and math.isinf(f32(above * growth_factor))
    for scale in (edge, above):
        p = quiet(
            lambda scale=scale: DynamicPolicy(
                init_scale=scale,
                growth_factor=growth_factor,
                growth_interval=1,
                hysteresis=2,
                min_scale=None,
                max_scale=None,
            )
        )
        s, dev = p.init_state(), TensorForm(p)
        s = p.update(s, found_inf=False)
        dev.step(False)
        assert dev.to_state() == s and s.scale == (f32(edge * growth_factor) if scale == edge else above)


def test_a_growth_past_float32_is_refused_under_a_max_scale_it_could_reach():
    """A ``max_scale`` so high that ``max_scale * growth_factor`` leaves float32 (here 1.5 * 2**127):
    a growth from 2**127 is refused (inf), not clamped to ``max_scale``, in both forms. Kills: the
    rule's test for such a growth skipped for a bounded policy."""
    p = quiet(
        lambda: DynamicPolicy(
            init_scale=2.0**127, growth_interval=1, hysteresis=2, min_scale=None, max_scale=1.5 * 2.0**127
        )
    )
    s, dev = p.init_state(), TensorForm(p)
    s = p.update(s, found_inf=False)
    dev.step(False)
    assert dev.to_state() == s and s.scale == 2.0**127
