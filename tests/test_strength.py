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


# --------------------------------------------------------------------------- check_state's edges


# ---------------------------------------------------------------- checkpoint: the loader's edges


# ------------------------------------------ LogMax against a plain re-statement of OpenSeq2Seq's rule


# --------------------------------------------------------------------- non-finite losses (issue 13)


