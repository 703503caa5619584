"""When training is stuck, and what to say (``lossscale.diagnosis``): the policies' ``is_stuck`` (at the
lower bound, or after a streak; a streak of non-finite losses after its own limit) and the text of the
diagnosis. (Each policy's file tests its own stuck cases; test_stuck.py the scaler's stuck messages.)

Mutation-killing tests (issue 15): "Kills: ..." names the one-line change each was seen to fail on
(docs/testing.md).
"""

import pytest

from lossscale import AdaptivePolicy, DynamicPolicy, LogMaxPolicy, StaticPolicy
from lossscale.diagnosis import backward_fixes
from lossscale.policy import MIN_SCALE


def test_is_stuck_at_the_lower_bound_for_the_measuring_policies():
    """Kills: logmax's and adaptive's stuck check looking at no bound, or at the upper one."""
    lm = LogMaxPolicy(init_scale=2.0**3, min_scale=2.0**3, max_scale=2.0**20)
    s = lm.init_state()
    assert lm.is_stuck(lm.update(s, True), scale_before=2.0**3)
    ad = AdaptivePolicy(init_scale=2.0, min_scale=2.0, max_scale=2.0**20)
    s = ad.init_state()
    assert ad.is_stuck(ad.update(s, True), scale_before=2.0)
    assert not ad.is_stuck(ad.update(s.replace(scale=2.0**20), True), scale_before=2.0**20)


def _bad_streak(p, n, **changes):
    """A state ending a streak of ``n`` skipped steps, all of them non-finite losses."""
    return p.init_state().replace(
        steps=n, skipped_steps=n, inf_steps=n, bad_loss_steps=n, overflow_streak=n, streak_bad_loss_steps=n, **changes
    )


def test_a_streak_of_bad_losses_is_stuck_at_its_own_limit():
    """Kills: the bad-loss streak's limit lost (None, or ``max_consecutive_skips and BAD_LOSS_STREAK``)
    or compared with ``>``."""
    from lossscale.policy import BAD_LOSS_STREAK

    p, q = DynamicPolicy(), DynamicPolicy(max_consecutive_skips=3)
    assert p.is_stuck(_bad_streak(p, BAD_LOSS_STREAK), 2.0**16)
    assert not p.is_stuck(_bad_streak(p, BAD_LOSS_STREAK - 1), 2.0**16)
    assert q.is_stuck(_bad_streak(q, 3), 2.0**16) and not q.is_stuck(_bad_streak(q, 2), 2.0**16)


def test_diagnose_tells_nan_at_the_floor_from_nan_that_persisted():
    """Kills: the diagnosis's bound (min_scale, not max_scale), its streak test moved by one, and its
    closing pointer to overflow_report()."""
    from lossscale.diagnosis import diagnose

    p = DynamicPolicy(min_scale=1.0)
    once = p.init_state().replace(
        scale=1.0, streak_start_scale=2.0, skipped_steps=1, nan_steps=1, overflow_streak=1, streak_nan_steps=1, steps=1
    )
    text = diagnose(p, once)
    lines = text.split("\n")
    assert lines[0].startswith("lossscale: 1 consecutive") and "(min_scale=2^0)." in lines[0]
    assert lines[1].startswith("NaN at the smallest scale")
    assert lines[-1].startswith("scaler.overflow_report() names the parameters that held inf and NaN")
    twice = once.replace(
        skipped_steps=2, nan_steps=2, overflow_streak=2, streak_nan_steps=2, steps=2, streak_start_scale=4.0
    )
    assert diagnose(p, twice).split("\n")[1].startswith("NaN persisted")
    assert (
        diagnose(StaticPolicy(), StaticPolicy().update(StaticPolicy().init_state(), True))
        .split("\n")[0]
        .endswith("to 65536.")
    )


def _stuck_at(p, scale, nan: bool, n: int = 17):
    """A state ending a streak of ``n`` skipped steps with a finite loss, from 2**16 down to ``scale``."""
    k = n if nan else 0
    return p.init_state().replace(
        scale=scale,
        streak_start_scale=2.0**16,
        steps=n,
        skipped_steps=n,
        inf_steps=n - k,
        nan_steps=k,
        overflow_streak=n,
        streak_nan_steps=k,
    )


def test_a_backward_overflow_at_a_floor_of_1_is_the_floor_not_the_model():
    """The block of benchmarks/bench_backward_overflow.py at min_scale=1: its backward overflows FP16 at
    every scale >= 1 and shows as NaN. The text must not blame the model or data alone, and must say
    what fixes it: the module in FP32 (by the scaler or by hand) or a lower floor."""
    from lossscale.diagnosis import diagnose

    p = DynamicPolicy(min_scale=1.0)
    stuck = _stuck_at(p, 1.0, nan=True)
    # The trace named the module: the text names it, and every fix with it.
    named = diagnose(p, stuck, tracing=True, backward="block.up").split("\n")[1]
    assert named.startswith("The backward of `block.up` overflows FP16 (a gradient above 65504) at every scale")
    assert "the NaN is the overflow's" in named
    assert 'on_backward_overflow="upcast"' in named and 'lossscale.keep_fp32(model, ["block.up"])' in named
    assert "lower min_scale (the default 2^-24" in named and "not the cause" not in named
    # Not traced: either such an overflow or a NaN of the model's; the text says how to tell them apart.
    untraced = diagnose(p, stuck).split("\n")[1]
    assert untraced.startswith("NaN persisted while the scale fell 65536x, to 2^0. It may be a backward")
    assert "GradScaler(model=model, trace=True) names the first module whose backward overflowed" in untraced
    assert "lower min_scale" in untraced and "Otherwise the scale is not the cause" in untraced
    # inf only: the backward overflows, and the same fixes.
    inf = diagnose(p, _stuck_at(p, 1.0, nan=False)).split("\n")[1]
    assert "the backward overflows FP16 (a gradient above 65504) at every scale the floor allows" in inf
    assert 'on_backward_overflow="upcast"' in inf and "lower min_scale" in inf


def test_at_the_default_floor_no_lower_scale_is_suggested():
    """At 2**-24 (the default floor, FP16's smallest subnormal) a lower scale carries nothing: the text
    says so, and a NaN that persisted down there is not the scale's."""
    from lossscale.diagnosis import diagnose

    p = DynamicPolicy()
    named = diagnose(p, _stuck_at(p, 2.0**-24, nan=False, n=41), tracing=True, backward="block.up")
    assert "(min_scale=2^-24)." in named.split("\n")[0]
    assert "no lower scale helps: below 2^-24" in named and "lower min_scale" not in named
    nan = diagnose(p, _stuck_at(p, 2.0**-24, nan=True, n=41)).split("\n")[1]
    assert nan.startswith("NaN persisted while the scale fell 1.09951e+12x, to 2^-24. The scale is not the cause")
    assert "past a gradient of 1.1e+12" in nan and "set_detect_anomaly" in nan


def test_above_its_floor_the_text_suggests_a_lower_scale_not_a_lower_floor():
    """A static scale (no floor) stuck at 2**16: a lower scale may fit, and min_scale is not the cause."""
    from lossscale.diagnosis import diagnose

    p = StaticPolicy()
    text = diagnose(p, p.update(p.init_state(), True))
    assert "or a scale below 2^16, which may shrink the gradient" in text and "lower min_scale" not in text


def test_a_bad_loss_diagnosis_suggests_tracing_unless_it_is_on():
    """Kills: ``tracing`` defaulting to True (the suggestion to trace is then never made)."""
    from lossscale.diagnosis import diagnose

    p = DynamicPolicy()
    state = p.update(p.init_state(), True, bad_loss=True)
    assert "trace=True" in diagnose(p, state)
    assert "trace=True" not in diagnose(p, state, tracing=True)


@pytest.mark.parametrize(
    "lo, scale, name, module, by_hand, lower",
    [
        (None, MIN_SCALE, None, "the module the trace names", "[name]", "; no lower scale helps: below 2^-24"),
        (1.0, 1.0, "block.up", "`block.up`", '["block.up"]', "; or lower min_scale (the default 2^-24"),
        (None, 4.0, "block", "`block`", '["block"]', "; or a scale below 2^2, which may shrink"),
    ],
)
def test_the_fixes_for_a_backward_overflow_name_the_module_and_what_a_lower_scale_can_do(
    lo, scale, name, module, by_hand, lower
):
    """Three answers, one per place the scale stopped: at FP16's smallest subnormal, at the policy's
    floor, or above both; each names the module (or says the trace names it) and how to keep it in FP32."""
    text = backward_fixes(lo, scale, name)
    assert text.startswith(
        f'keep {module} in FP32: GradScaler(model=model, trace=True, on_backward_overflow="upcast") does it '
        f"when this happens, or lossscale.keep_fp32(model, {by_hand}) before training{lower}"
    )
    assert text.endswith(".")
    assert text.count(";") == 1
