"""Plain numbers at the boundary: what users, checkpoints and numpy hand in, stored as Python numbers.

Why: a numpy float stored in a policy lands in ``state_dict()``, and ``torch.load(weights_only=True)``
(how transformers reloads ``scaler.pt``) refuses numpy objects. An int beyond float range (10**400)
raises ``OverflowError`` at the first ``float()``; here it becomes a ``ValueError`` naming the argument.

Pure Python: no torch.
"""

from __future__ import annotations

import numbers
from typing import Any

__all__ = ["plain_number", "plain_bool"]


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
