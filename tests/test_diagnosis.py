"""When training is stuck, and what to say (``lossscale.diagnosis``): the policies' ``is_stuck`` (at the
lower bound, or after a streak; a streak of non-finite losses after its own limit) and the text of the
diagnosis. (Each policy's file tests its own stuck cases; test_stuck.py the scaler's stuck messages.)

Mutation-killing tests (issue 15): "Kills: ..." names the one-line change each was seen to fail on
(docs/testing.md).
"""

from lossscale import AdaptivePolicy, DynamicPolicy, LogMaxPolicy, StaticPolicy


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

    p = DynamicPolicy()
    once = p.init_state().replace(
        scale=1.0, streak_start_scale=2.0, skipped_steps=1, nan_steps=1, overflow_streak=1, streak_nan_steps=1, steps=1
    )
    text = diagnose(p, once)
    lines = text.split("\n")
    assert lines[0].startswith("lossscale: 1 consecutive") and "(min_scale=1)." in lines[0]
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


def test_a_bad_loss_diagnosis_suggests_tracing_unless_it_is_on():
    """Kills: ``tracing`` defaulting to True (the suggestion to trace is then never made)."""
    from lossscale.diagnosis import diagnose

    p = DynamicPolicy()
    state = p.update(p.init_state(), True, bad_loss=True)
    assert "trace=True" in diagnose(p, state)
    assert "trace=True" not in diagnose(p, state, tracing=True)
