"""Warnings that point at the user's line: the first frame outside the lossscale package.

A warning raised deep inside the package (a checkpoint's policy replacing the constructor's, a stuck
run found by ``update()``) is attributed by Python to the frame ``stacklevel`` levels up. Counting
those levels by hand breaks whenever a call is added between the user and the warning; :func:`warn`
walks the stack instead and names the first frame that is not lossscale's: the user's call, or the
framework's that called into lossscale. Pure Python.
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["warn", "outside_level"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn(message: str, category: type = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first frame outside lossscale."""
    warnings.warn(message, category, stacklevel=outside_level())


def outside_level() -> int:
    """The ``stacklevel`` that names the first frame outside lossscale, for a ``warnings.warn`` called
    by the caller of this function (what :func:`warn` passes)."""
    frame, level = sys._getframe(2), 2  # the frame that called warn(): stacklevel 2 from warn's warnings.warn
    while frame is not None and _inside(frame):
        frame, level = frame.f_back, level + 1
    return level


def _inside(frame) -> bool:
    if frame.f_code.co_filename.startswith(_PACKAGE):
        return True
    # A dataclass's generated __init__ (its code is made by exec, so it has no file) of a lossscale class.
    owner = frame.f_locals.get("self") if frame.f_code.co_name == "__init__" else None
    return owner is not None and type(owner).__module__.startswith("lossscale.")
