"""One-time hints for set-ups that run but are probably not what the user meant.

Kept outside the scaler: each hint is a check the scaler calls in one line, and costs nothing once it
has spoken.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

__all__ = ["warn_if_bf16"]

_warned_bf16 = False  # once per process: after the first warning the check is skipped too

#: The ``scale()`` calls of a scaler that look for bf16: a bf16 set-up shows in the first ones, and
#: asking torch for the autocast state costs ~10 us per call, a tenth of a small iteration.
CALLS_CHECKED = 8


def _first_tensor(outputs: Any) -> Optional[torch.Tensor]:
    """The first tensor of what ``scale()`` was given (a tensor, or lists, tuples and dicts of them)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    values = outputs.values() if isinstance(outputs, dict) else outputs if isinstance(outputs, (list, tuple)) else ()
    for value in values:  # other iterables are left alone: scale() consumes them lazily
        found = _first_tensor(value)
        if found is not None:
            return found
    return None


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast casts to on ``device_type`` right now, None when it is off."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError):  # torch < 2.4 has no per-device query: no hint
        pass
    return None


def warn_if_bf16(outputs: Any, passthrough: bool) -> None:
    """Warn once when a scaling ``GradScaler`` scales a bf16 loss, or scales under bf16 autocast.

    bf16 has fp32's exponent range, so nothing underflows that a loss scale would save, while a
    default ``GradScaler()`` still multiplies the loss by 2^16 and unscales every gradient.
    ``passthrough``: the scaler is ``GradScaler.passthrough()`` (scale fixed at 1), which is what bf16
    wants, so it is not warned about. A float32 loss scaled after the bf16 autocast block has closed
    (the usual loop) shows neither sign and is not detected.
    """
    global _warned_bf16
    if _warned_bf16 or passthrough:
        return
    t = _first_tensor(outputs)
    if t is None:
        return
    why = ("the loss is bf16" if t.dtype == torch.bfloat16
           else "bf16 autocast is active" if _autocast_dtype(t.device.type) == torch.bfloat16 else None)
    if why is None:
        return
    _warned_bf16 = True
    warnings.warn(
        f"lossscale.GradScaler.scale(): {why}. bf16 has fp32's exponent range, so nothing underflows that "
        "loss scaling would save, and this scaler multiplies the loss by its scale (2^16 by default) and "
        "unscales every gradient for nothing. For bf16 use lossscale.GradScaler.passthrough() (scale fixed "
        "at 1, no unscale pass, non-finite steps still skipped); for FP16 autocast with dtype=torch.float16. "
        "(Warned once.)",
        stacklevel=3,  # the caller of scale()
    )
