"""Drive a policy's tensor rule on CPU tensors, beside its pure rule (the tests compare the two)."""

from __future__ import annotations

import math
import struct

import torch
from hypothesis import strategies as st

from lossscale import AdaptivePolicy, DynamicPolicy, LogMaxPolicy, StaticPolicy
from lossscale._state import TensorState

#: Every policy the library ships.
ALL_POLICIES = [DynamicPolicy, StaticPolicy, AdaptivePolicy, LogMaxPolicy]


def f32(x: float) -> float:
    """``x`` rounded to float32, as the device holds it; written here, not taken from the library, so a
    slip in the library's own rounding shows up against it."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # not raised by Python 3.10 to 3.13 (they pack inf), kept in case one does
        return math.copysign(math.inf, x)


# ------------------------------------------------------------- hypothesis strategies the policies share
def powers_of_two(lo: int, hi: int):
    """``2.0**k`` for ``lo <= k <= hi``."""
    return st.integers(lo, hi).map(lambda k: 2.0**k)


def flag_lists(max_size: int):
    """Iterations as (overflow, nan) pairs, each clean, inf or NaN."""
    return st.lists(st.sampled_from([(False, False), (True, False), (True, True)]), max_size=max_size)


#: Backoff factors, off the powers of two too (every product then rounds to float32).
backoffs = st.one_of(st.sampled_from([0.5, 0.25, 0.9, 0.7, 0.1]), st.floats(0.01, 0.99))


class TensorForm:
    """A policy's ``tensor_update`` run on CPU tensors, one iteration per :meth:`step`, with the flags
    as the scaler's check builds them: bool 0-dim tensors, ``found_inf`` including a non-finite loss and a
    non-finite amax, ``found_nan`` a NaN amax (the check derives the flags and the amax from the same
    read). The scaler runs this form on every path; the pure rule is the specification beside it.
    """

    def __init__(self, policy, state=None):
        self.policy = policy
        self.t = TensorState(policy.init_state() if state is None else state, torch.device("cpu"))

    def step(self, found_inf, found_nan=False, amax=None, bad_loss=None) -> None:
        """One iteration with host flags, an amax (or None), and the non-finite-loss flag (None: the
        scaler does not check the loss)."""
        overflow, nan = bool(found_inf) or bool(bad_loss), bool(found_nan)
        if amax is not None and not math.isfinite(amax):
            overflow, nan = True, nan or math.isnan(amax)
        flag = lambda b: torch.tensor(bool(b))  # noqa: E731
        amax_t = None if amax is None else torch.tensor(amax, dtype=torch.float32)
        self.policy.tensor_update(self.t, flag(overflow), flag(nan and overflow), flag(bad_loss), amax_t)

    def to_state(self):
        """The pure state the tensors hold."""
        return self.t.read()[0]
