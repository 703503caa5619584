"""The overflow rule the dynamic and adaptive policies share: tolerate, then back off (pure and tensor forms).

The rule, for one overflow (Megatron-core's and DeepSpeed's hysteresis; ``hysteresis=1`` is torch's
"back off on every overflow")::

    if hysteresis_tracker > 1:                       # tolerance left: spend one, keep the scale
        hysteresis_tracker -= 1
    else:                                            # spent (the tracker stays at 1): back off
        scale = max(f32(scale * backoff_factor), lowest)

and for one clean step: ``hysteresis_tracker = hysteresis`` when ``consecutive_hysteresis`` (only
*consecutive* overflows count, DeepSpeed), else it is refilled only at the caller's growth check
(Megatron-core; dynamic: a growth, a refused one included; adaptive: a window's end).

The tracker never goes below 1 (DeepSpeed's ``cur_hysteresis``), so with ``hysteresis=1`` it never
moves. Pure Python; the tensor form works on the tensors it is given: :func:`backs_off_tensor` is
:func:`on_overflow`'s decision (the caller moves the scale with it), :func:`track_tensor_` the
tracker after an overflow (:func:`on_overflow`) or a refill (:func:`on_clean`, or the growth check).
"""

from __future__ import annotations

from typing import Tuple

from .formats import f32

__all__ = ["on_overflow", "on_clean", "backs_off_tensor", "track_tensor_"]


def on_overflow(scale: float, hysteresis_tracker: int, backoff_factor: float, lowest: float) -> Tuple[float, int]:
    """``(scale, hysteresis_tracker)`` after an overflow."""
    if hysteresis_tracker > 1:
        return scale, hysteresis_tracker - 1
    return max(f32(scale * backoff_factor), lowest), 1


def on_clean(hysteresis_tracker, hysteresis: int, consecutive: bool):
    """The tracker after a clean step, before the caller's growth check (which refills it anyway)."""
    return hysteresis if consecutive else hysteresis_tracker


def backs_off_tensor(hysteresis_tracker, overflow):
    """The tensor form's "an overflow, and the tolerance spent" (bool 0-dim; ``overflow`` bool 0-dim):
    ``tracker <= overflow``, since the tracker is at least 1: only an overflow (1) at 1 passes."""
    return hysteresis_tracker <= overflow


def track_tensor_(hysteresis_tracker, overflow, refill, hysteresis: int) -> None:
    """The tracker after the iteration, in place: one spent per ``overflow`` (never below 1; at 1 the
    scale backs off instead), set back to ``hysteresis`` where ``refill`` (bool 0-dim tensors)."""
    # add_(alpha=-1): torch refuses to subtract a bool tensor, not to add one with a negative weight.
    hysteresis_tracker.add_(overflow, alpha=-1).clamp_min_(1).masked_fill_(refill, hysteresis)
