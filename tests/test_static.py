"""The static policy: a fixed scale that never moves, whose steps are still counted and skipped, and
which is stuck on any overflow (there is no smaller scale to try) unless a streak length is set."""

import pytest
from _rules import TensorForm, flag_lists
from hypothesis import given, settings
from hypothesis import strategies as st

from lossscale import StaticPolicy


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([1.0, 2.0**10, 2.0**16]), flag_lists(120))
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


def test_static_is_stuck_on_every_overflow_unless_a_streak_is_set():
    """Kills every change to StaticPolicy.is_stuck (no selected test called it)."""
    p, q = StaticPolicy(), StaticPolicy(max_consecutive_skips=3)
    s = p.init_state()
    assert not p.is_stuck(p.update(s, False), s.scale)
    assert p.is_stuck(p.update(s, True), s.scale)
    streak = s
    for n in range(1, 5):
        streak = q.update(streak, True)
        assert q.is_stuck(streak, s.scale) == (n >= 3)
    assert not q.is_stuck(q.update(streak, False), s.scale)


def test_a_scale_that_is_not_a_power_of_two_is_warned_about():
    """Kills: the warning asked of another object than the policy (then no warning)."""
    with pytest.warns(UserWarning, match=r"scale=3\.0 is not a power of two"):
        StaticPolicy(scale=3.0)
