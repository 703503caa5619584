"""Validation of what users, checkpoints and numpy hand in: each error names the argument and the fix.

Plain numbers at the boundary: a numpy float stored in a policy lands in ``state_dict()``, and
``torch.load(weights_only=True)`` (how transformers reloads ``scaler.pt``) refuses numpy objects; an
int beyond float range (10**400) raises ``OverflowError`` at the first ``float()``. Both become Python
numbers or a ``ValueError`` naming the argument here. Then the shared checks of the policies' fields.

Pure Python: no torch.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

from ._warnings import warn
from .formats import f32, is_power_of_two

__all__ = [
    "plain_number",
    "plain_bool",
    "validate_stuck",
    "validate_backoff",
    "validate_int",
    "positive_finite",
    "validate_bounds",
    "warn_not_powers_of_two",
    "MAX_INT",
    "STUCK_REACTIONS",
    "SMALLEST_SCALE",
]

STUCK_REACTIONS = ("raise", "warn", "ignore")

#: The smallest scale lossscale keeps: float32's smallest normal. Below it, the unscale's 1/scale
#: (computed in float64, applied in float32, as torch does) leaves float32's range near 2**-128, and the
#: unscaled gradients become inf and NaN that the check, which reads the *scaled* ones, cannot see.
SMALLEST_SCALE = 2.0**-126


def plain_number(name: str, value: Any, integral: bool = False) -> Any:
    """``value`` as a Python ``float`` (``int`` when ``integral``) if it is a real number, numpy's
    included; anything else (None, a string, a bool, a non-integral value for an int) is returned as
    it is, for the caller's own validation to name. Raises ValueError for a number beyond float range.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    if integral:
        return int(value) if isinstance(value, numbers.Integral) else value
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name}={value!r} is beyond the range of a float (about 1.8e308).") from None


def plain_bool(name: str, value: Any) -> bool:
    """A Python bool from a bool or a numpy bool; ValueError otherwise (a string "false" is truthy)."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    raise ValueError(f"{name}={value!r} must be True or False.")


def validate_stuck(on_stuck: str, max_consecutive_skips: Optional[int]) -> None:
    """Validate the two stuck-reaction fields every policy has."""
    if on_stuck not in STUCK_REACTIONS:
        raise ValueError(f"on_stuck={on_stuck!r} is not one of {STUCK_REACTIONS}.")
    if max_consecutive_skips is not None and (
        isinstance(max_consecutive_skips, bool)
        or not isinstance(max_consecutive_skips, int)
        or max_consecutive_skips < 1
    ):
        raise ValueError(
            f"max_consecutive_skips={max_consecutive_skips!r} must be a positive int, or None to "
            "react only at the minimum scale."
        )


def validate_backoff(value) -> None:
    """``backoff_factor`` must lie in (0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 < value < 1.0):
        raise ValueError(f"backoff_factor={value!r} must be in (0, 1) (e.g. 0.5).")


#: The largest int a config field may hold: the tensor rules compare it with int64 device counters.
MAX_INT = 2**62


def validate_int(name: str, value, lo: int, hi: Optional[int] = None) -> None:
    """An int field in [lo, hi] (bools refused); hi=None: up to :data:`MAX_INT`."""
    hi = MAX_INT if hi is None else hi
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or value > hi:
        raise ValueError(f"{name}={value!r} must be an int in [{lo}, {'2**62' if hi == MAX_INT else hi}].")


def positive_finite(name: str, value) -> None:
    """A scale: a number > 0 in float32's normal range (bools refused). The device keeps scales in
    float32, where 1e39 is inf, and unscales by 1/scale, which is inf below :data:`SMALLEST_SCALE`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite number > 0.")
    if not SMALLEST_SCALE <= f32(value) < math.inf:
        raise ValueError(
            f"{name}={value!r} is outside float32's normal range [2**-126, 3.4e38], where the device keeps the scale."
        )


def validate_bounds(policy) -> None:
    """min_scale/max_scale finite and > 0 (or None), ordered, and init_scale between them."""
    for name in ("min_scale", "max_scale"):
        v = getattr(policy, name)
        if v is not None:
            positive_finite(name, v)
    lo, hi, init = policy.min_scale, policy.max_scale, policy.init_scale
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"min_scale={lo!r} is above max_scale={hi!r}; swap them.")
    if lo is not None and init < lo:
        raise ValueError(f"init_scale={init!r} is below min_scale={lo!r}.")
    if hi is not None and init > hi:
        raise ValueError(f"init_scale={init!r} is above max_scale={hi!r}; raise max_scale or pass max_scale=None.")


def off_powers_of_two(policy, names) -> list:
    """The ``names`` of ``policy`` set to something other than a power of two (a field it lacks, or
    None, is not)."""
    return [n for n in names if getattr(policy, n, None) is not None and not is_power_of_two(getattr(policy, n))]


def warn_not_powers_of_two(policy, names) -> None:
    """Warn (once per config) about the ``names`` of ``policy`` that are not powers of two, and why."""
    bad = [f"{n}={getattr(policy, n)!r}" for n in off_powers_of_two(policy, names)]
    if bad:
        warn(
            "lossscale: " + ", ".join(bad) + " is not a power of two, so the loss scale can leave the "
            "powers of two. Multiplying by a power of two only shifts the exponent and is exact; any "
            "other scale rounds every gradient when it is scaled and again when unscaled."
        )
