"""LogMax (OpenSeq2Seq's automatic loss scaler), added through the policy protocol alone: its pure
and tensor rules agree bitwise, its checkpoint round-trips, and it trains inside the scaler."""

import math
import pickle

import pytest
import torch
from _rules import TensorForm, powers_of_two
from hypothesis import given, settings
from hypothesis import strategies as st

import lossscale
from lossscale import LogMaxPolicy, is_power_of_two

pow2 = powers_of_two(-10, 30)


def logmax_configs(lowest):
    """LogMax configs starting at their ``min_scale``, drawn from ``lowest``, with a span of 0 to 40 binades."""
    return st.builds(
        lambda lo, span, b1, b2, k: LogMaxPolicy(
            init_scale=lo, min_scale=lo, max_scale=lo * 2.0**span, beta1=b1, beta2=b2, overflow_std_dev=k
        ),
        lowest,
        st.integers(0, 40),
        st.sampled_from([0.9, 0.99, 0.5]),
        st.sampled_from([0.999, 0.99, 0.7]),
        st.sampled_from([0.0, 1.0, 3.09]),
    )


configs = logmax_configs(pow2)
# Scaled amax values: ordinary float32 values, exact powers of two (log2 exact), zero, and non-finite.
amaxes = st.one_of(st.floats(2.0**-100, 2.0**100, width=32), pow2, st.just(0.0), st.sampled_from([math.inf, math.nan]))
events = st.lists(
    st.one_of(
        st.tuples(st.just(False), st.just(False), amaxes),
        st.tuples(st.just(True), st.booleans(), st.sampled_from([None, math.inf, 1.0])),
    ),
    max_size=60,
)


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


@pytest.mark.parametrize("k", [-30, -10, 4, 10, 15])
def test_log2_is_taken_in_float64_on_device_too(k):
    # The largest float32 below 2**k: its float64 log2 is k - 9e-8, one grid step (2**-16) below k;
    # a float32 log2 rounds it to k itself. A device rule taking log2 in float32 lands a grid step off
    # (the mutant `amax.to(None)` that docs/testing.md once listed as equivalent).
    amax = torch.nextafter(torch.tensor(2.0**k), torch.tensor(0.0)).item()
    assert math.floor(math.log2(amax) * 2**16) != math.floor(torch.tensor(amax).log2().item() * 2**16)
    policy = LogMaxPolicy()
    s, dev = policy.init_state(), TensorForm(policy)
    for _ in range(3):
        s = policy.update(s, found_inf=False, amax=amax)
        dev.step(False, False, amax)
        assert dev.to_state() == s.replace(streak_start_scale=dev.to_state().streak_start_scale)


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


# ------------------------------------------------- the cases a deliberate bug showed to be unguarded
# Mutation-killing tests (issue 15; "Kills: ..." names the change each was seen to fail on, docs/testing.md).
def test_logmax_scale_floors_at_min_scale_exactly():
    """Kills: ``_exponent_range`` off by one or two binades at the bottom."""
    p = LogMaxPolicy(init_scale=2.0**-3, min_scale=2.0**-3, max_scale=2.0**20)
    s, dev = p.init_state(), TensorForm(p)
    for _ in range(5):
        s = p.update(s, found_inf=True)
        dev.step(True)
    assert s.scale == dev.to_state().scale == 2.0**-3


def test_logmax_constant_amax_has_zero_spread_on_device_too():
    """Kills: the device rule's variance clamped at 1 instead of 0 (a constant amax has none)."""
    p = LogMaxPolicy(overflow_std_dev=3.09)
    s, dev = p.init_state(), TensorForm(p)
    for _ in range(8):
        amax = 4.0 * s.scale  # the same unscaled amax every step, 14 binades under the line: no clamp
        s = p.update(s, found_inf=False, amax=amax)
        dev.step(False, False, amax)
        assert dev.to_state() == s


def test_logmax_constant_amax_sets_the_scale_at_the_mean():
    """With no spread the scale sits exactly ``LIMIT - mean`` binades up: 16 - 2 = 14."""
    p = LogMaxPolicy(overflow_std_dev=3.09)
    s = p.init_state()
    for _ in range(8):
        s = p.update(s, found_inf=False, amax=4.0 * s.scale)
    assert s.scale == 2.0**14


@pytest.mark.parametrize(
    "changes, name",
    [
        (dict(x_hat=1024.0, slow_x_hat=-1024.0, xsquared_hat=1024.0**2), None),
        (dict(xsquared_hat=0.0), None),
        (dict(x_hat=1024.5), "x_hat"),
        (dict(slow_x_hat=-1024.5), "slow_x_hat"),
        (dict(xsquared_hat=1024.0**2 + 1), "xsquared_hat"),
        (dict(xsquared_hat=-1.0), "xsquared_hat"),
        (dict(b1_correction=1.5), "b1_correction"),
        (dict(x_hat=None), "x_hat"),  # a corrupted checkpoint (found by test_checkpoint's hypothesis run)
        (dict(slow_x_hat="-1.0"), "slow_x_hat"),
    ],
)
def test_logmax_state_bounds(changes, name):
    """Kills: LogMax's bounds on its averages moved or swapped (x*x is bounded by the square)."""
    p = LogMaxPolicy()
    s = p.init_state().replace(**changes)
    if name is None:
        p.check_state(s)
    else:
        with pytest.raises(ValueError, match=name):
            p.check_state(s)


# ------------------------------------------ against a plain re-statement of OpenSeq2Seq's rule
class LogMaxReference:
    """OpenSeq2Seq's LogMaxScaler as lossscale documents it (logmax.py's pseudocode), in plain Python:
    the averages are written here, not shared with the library, whose pure and tensor forms share one
    ``_averages`` (so their agreement cannot see a slip in it)."""

    def __init__(self, p):
        self.p, self.scale = p, p.init_scale
        self.x_hat = self.slow = self.xsq = 0.0
        self.b1c = self.b2c = 1.0

    def step(self, overflow, amax):
        p = self.p
        if amax is not None and not math.isfinite(amax):
            overflow = True
        if amax is None and not overflow:
            return
        log2_scale = round(math.log2(self.scale))
        if overflow:
            x = float(p.limit_exp - log2_scale)
        elif amax == 0:
            x = float(p.flush_exp - log2_scale)
        else:
            x = math.floor(math.log2(amax) * 2.0**16) / 2.0**16 - log2_scale
        self.x_hat = p.beta1 * self.x_hat + (1 - p.beta1) * x
        self.b1c *= p.beta1
        self.slow = p.beta2 * self.slow + (1 - p.beta2) * x
        self.xsq = p.beta2 * self.xsq + (1 - p.beta2) * (x * x)
        self.b2c *= p.beta2
        mu = self.x_hat / (1 - self.b1c)
        mean = self.slow / (1 - self.b2c)
        sigma = math.sqrt(max(self.xsq / (1 - self.b2c) - mean * mean, 0.0))
        k = math.floor(p.limit_exp - (mu + p.overflow_std_dev * sigma))
        self.scale = 2.0 ** min(max(k, round(math.log2(p.min_scale))), round(math.log2(p.max_scale)))


logmax_events = st.lists(
    st.one_of(
        st.tuples(st.just(False), st.one_of(st.floats(2.0**-60, 2.0**60, width=32), st.just(0.0), st.none())),
        st.tuples(st.just(True), st.sampled_from([None, math.inf])),
    ),
    max_size=40,
)


@settings(max_examples=100, deadline=None)
@given(logmax_configs(powers_of_two(-10, 10)), logmax_events)
def test_logmax_matches_a_plain_restatement_of_the_rule(policy, seq):
    """Kills any slip in the shared moving averages (``(1 + b2)``, ``xsq * (1 - b2c)``, ...), which the
    pure-versus-tensor agreement cannot see. The same float64 operations in the same order: bitwise."""
    s, ref = policy.init_state(), LogMaxReference(policy)
    for overflow, amax in seq:
        s = policy.update(s, found_inf=overflow, amax=amax)
        ref.step(overflow, amax)
        assert (s.x_hat, s.slow_x_hat, s.xsquared_hat) == (ref.x_hat, ref.slow, ref.xsq)
        assert (s.b1_correction, s.b2_correction) == (ref.b1c, ref.b2c)
        assert s.scale == ref.scale


def _logmax_step(scaled_amax: float):
    """One step of GradScaler(policy="logmax") at its defaults whose scaled gradients' max |g| is
    ``scaled_amax`` exactly (0: every gradient zero, as when everything flushed); its state after."""
    scaler = lossscale.GradScaler("cpu", policy="logmax")
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.01)
    c = scaled_amax / scaler.get_scale()  # a power of two over a power of two: exact
    scaler.scale((p * c).sum()).backward()
    assert p.grad.abs().max().item() == scaled_amax  # what the check measures
    scaler.step(opt)
    scaler.update()
    return scaler.state()


def test_all_zero_gradients_count_as_fp16s_smallest_subnormal():
    # Gradients that are all zero (everything flushed) are fed as the flush threshold at this scale:
    # the largest value FP16 flushes is below its smallest subnormal, 2**-24, so the step counts as an
    # amax of 2**-24 (scaled), no more and no less. In the pure rule and on the device alike.
    p = LogMaxPolicy()
    mid = p.update(p.update(p.init_state(), found_inf=False, amax=2.0**-3), found_inf=False, amax=2.0**-12)
    zero = p.update(mid, found_inf=False, amax=0.0)
    assert zero == p.update(mid, found_inf=False, amax=2.0**-24)
    assert zero != p.update(mid, found_inf=False, amax=2.0**-23)
    assert zero != p.update(mid, found_inf=False, amax=2.0**-25)
    on_device = _logmax_step(0.0)
    assert on_device == _logmax_step(2.0**-24)
    assert on_device != _logmax_step(2.0**-23) and on_device != _logmax_step(2.0**-25)
