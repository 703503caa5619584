"""The overflow rule the dynamic and adaptive policies share: tolerate, then back off (pure and tensor forms).

The rule, for one overflow (Megatron-core's and DeepSpeed's hysteresis; ``hysteresis=1`` is torch's
"back off on every overflow")::

    if hysteresis_tracker > 1:                       # tolerance left: spend one, keep the scale
        hysteresis_tracker -= 1
    else:                                            # spent (the tracker stays at 1): back off
        scale = max(f32(scale * backoff_factor), lowest)

and for one clean step: ``hysteresis_tracker = hysteresis`` when ``consecutive_hysteresis`` (only
*consecutive* overflows count, DeepSpeed), else it is refilled only by a growth (Megatron-core).

The tracker never goes below 1 (DeepSpeed's ``cur_hysteresis``), so with ``hysteresis=1`` it never
moves. Pure Python at import; the tensor form imports torch when it runs.
"""

from __future__ import annotations

from typing import Tuple

from .formats import f32

__all__ = ["on_overflow", "on_overflow_tensor", "on_clean"]


def on_overflow(scale: float, hysteresis_tracker: int, backoff_factor: float, lowest: float) -> Tuple[float, int]:
    """``(scale, hysteresis_tracker)`` after an overflow."""
    if hysteresis_tracker > 1:
        return scale, hysteresis_tracker - 1
    return max(f32(scale * backoff_factor), lowest), 1


def on_overflow_tensor(scale, hysteresis_tracker, backoff_factor: float, lowest: float):
    """:func:`on_overflow` on 0-dim tensors (float32 scale, int tracker): returns the new two, no writes.

    The product is taken in float64 and rounded once to float32, as torch's kernel does
    (``static_cast<float>(scale * factor)``), so it is bitwise :func:`on_overflow`'s ``f32``.
    """
    import torch

    spent = hysteresis_tracker <= 1
    down = (scale.double() * backoff_factor).float().clamp_min(lowest)
    return torch.where(spent, down, scale), (hysteresis_tracker - 1).clamp_min(1)


def on_clean(hysteresis_tracker, hysteresis: int, consecutive: bool):
    """The tracker after a clean step that did not grow the scale (a growth refills it anyway)."""
    return hysteresis if consecutive else hysteresis_tracker
