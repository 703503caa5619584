"""LogMax (OpenSeq2Seq's automatic loss scaler), added through the policy protocol alone: its pure
and tensor rules agree bitwise, its checkpoint round-trips, and it trains inside the scaler."""

import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lossscale
from _rules import TensorForm
from lossscale import LogMaxPolicy, is_power_of_two

pow2 = st.integers(-10, 30).map(lambda k: 2.0**k)
configs = st.builds(
    lambda lo, span, b1, b2, k: LogMaxPolicy(init_scale=lo, min_scale=lo, max_scale=lo * 2.0**span, beta1=b1,
                                             beta2=b2, overflow_std_dev=k),
    pow2, st.integers(0, 40), st.sampled_from([0.9, 0.99, 0.5]), st.sampled_from([0.999, 0.99, 0.7]),
    st.sampled_from([0.0, 1.0, 3.09]))
# Scaled amax values: ordinary float32 values, exact powers of two (log2 exact), zero, and non-finite.
amaxes = st.one_of(st.floats(2.0**-100, 2.0**100, width=32), pow2, st.just(0.0), st.sampled_from([math.inf, math.nan]))
events = st.lists(st.one_of(st.tuples(st.just(False), st.just(False), amaxes),
                            st.tuples(st.just(True), st.booleans(), st.sampled_from([None, math.inf, 1.0]))),
                  max_size=60)


@settings(max_examples=150, deadline=None)
@given(configs, events)
def test_tensor_rule_agrees_with_pure_rule_bitwise(policy, seq):
    s, dev = policy.init_state(), TensorForm(policy)
    lo, hi = policy.min_scale, policy.max_scale
    for found_inf, found_nan, amax in seq:
        s = policy.update(s, found_inf=found_inf, found_nan=found_nan, amax=amax)
        dev.step(found_inf, found_nan, amax)
        got = dev.to_state()
        assert got == s.replace(streak_start_scale=got.streak_start_scale)
        assert s.overflow_streak == 0 or got.streak_start_scale == s.streak_start_scale
        assert is_power_of_two(s.scale) and lo <= s.scale <= hi


def test_the_rule_by_hand():
    p = LogMaxPolicy()
    s = p.update(p.init_state(), found_inf=False, amax=2.0**-10)
    assert s.scale == 2.0**24  # mu = -10 at scale 1: 26 binades of room, clamped to max_scale
    # One step with x = -10 exactly: mu = -10, sigma = 0 (bias-corrected averages of one sample).
    q = LogMaxPolicy(max_scale=2.0**40)
    s = q.update(q.init_state(), found_inf=False, amax=2.0**-10)
    assert s.scale == 2.0**26
    # An overflow feeds the overflow line (x = 16 - log2(scale)): the scale drops, the step is skipped.
    s2 = q.update(s, found_inf=True)
    assert s2.scale < s.scale and s2.skipped_steps == 1


def test_registered_and_checkpointed_like_every_policy():
    assert lossscale.policy.policy_class("logmax") is LogMaxPolicy
    scaler = lossscale.GradScaler(policy="logmax", max_scale=2.0**30)
    assert scaler.policy == LogMaxPolicy(max_scale=2.0**30)
    p = torch.nn.Parameter(torch.full((8,), 0.5))
    opt = torch.optim.SGD([p], lr=0.01)
    for step in range(6):
        opt.zero_grad()
        scaler.scale((p * p).sum() * 1e-3).backward()
        if step == 3:
            p.grad[0] = math.inf
        scaler.step(opt)
        scaler.update()
    s = scaler.state()
    assert s.skipped_steps == 1 and s.steps == 6 and s.x_hat != 0.0 and s.b2_correction < 1.0
    assert torch.isfinite(p).all()
    sd = scaler.state_dict()
    other = lossscale.GradScaler(policy="logmax", max_scale=2.0**30)
    other.load_state_dict(sd)
    assert other.state() == s and other.state_dict() == sd
    assert pickle.loads(pickle.dumps(scaler)).state() == s
    # torch's keys hold what a torch scaler can use (its defaults: LogMax has no growth rule of its own)
    assert (sd["growth_factor"], sd["backoff_factor"], sd["growth_interval"]) == (2.0, 0.5, 2000)


@pytest.mark.parametrize("bad", [dict(init_scale=3.0), dict(min_scale=0.0), dict(beta1=1.0), dict(fmt="fp17")])
def test_bad_configurations_name_the_argument(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        LogMaxPolicy(**bad)
