"""One-time hints for set-ups that run but are probably not what the user meant.

Kept outside the scaler: each hint is a check the scaler calls in one line, and costs nothing once it
has spoken.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ._warnings import warn

__all__ = ["warn_if_bf16"]

_warned_bf16 = False  # once per process: after the first warning the check is skipped too

#: The ``scale()`` calls of a scaler that look for bf16: a bf16 set-up shows in the first ones, and
#: asking torch for the autocast state costs ~10 us per call, a tenth of a small iteration.
CALLS_CHECKED = 8


def warn_if_bf16(outputs: Any, passthrough: bool) -> None:
    """Warn once when a scaling ``GradScaler`` scales a bf16 loss, or scales under bf16 autocast.

    bf16 has fp32's exponent range, so nothing underflows that a loss scale would save, while a
    default ``GradScaler()`` still multiplies the loss by 2^16 and unscales every gradient.
    ``passthrough``: the scaler is ``GradScaler.passthrough()`` (scale fixed at 1), which is what bf16
    wants. The first tensor of the outputs is looked at; a float32 loss scaled after the bf16 autocast
    block has closed (the usual loop) shows neither sign and is not detected.
    """
    global _warned_bf16
    if _warned_bf16 or passthrough:
        return
    outputs = next((x for x in tree_leaves(outputs) if isinstance(x, torch.Tensor)), None)
    if outputs is None:
        return
    device_type = outputs.device.type
    try:
        autocast_bf16 = (
            torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.bfloat16
        )
    except (TypeError, AttributeError):  # torch < 2.4 has no per-device query: no hint
        autocast_bf16 = False
    why = (
        "the loss is bf16" if outputs.dtype == torch.bfloat16 else "bf16 autocast is active" if autocast_bf16 else None
    )
    if why is None:
        return
    _warned_bf16 = True
    warn(
        f"lossscale.GradScaler.scale(): {why}. bf16 has fp32's exponent range, so nothing underflows that "
        "loss scaling would save, and this scaler multiplies the loss by its scale (2^16 by default) and "
        "unscales every gradient for nothing. For bf16 use lossscale.GradScaler.passthrough() (scale fixed "
        "at 1, no unscale pass, non-finite steps still skipped); for FP16 autocast with dtype=torch.float16. "
        "(Warned once.)"
    )
