"""What the scaler's opt-in features share: their account in counters, health and the checkpoint.

An opt-in feature (``telemetry=``, ``allow_fp16=True``, ``skip_if=``, ``bad_microbatch=``,
``on_forward_overflow="upcast"``) is an object the scaler holds, None when off, whose module loads only
when the feature is asked for. Beside its own calls on the iteration's path, each answers four calls the
scaler makes in one loop, so it adds nothing to ``counters()``, ``metrics()``, ``health()``,
``state_dict()`` or ``load_state_dict()`` but itself::

    counts()               -> {name: int}     counters(), metrics() and health() (health.HealthReport's field)
    state()                -> {key: value}    the checkpoint's entries
    loadable(state_dict)   -> value           its entries validated (ValueError naming the key); no change
    load(value)            -> None            take them: called only once every feature validated

This module holds the shared pieces: :func:`saved_count` and the ``allow_fp16`` count.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ._validate import plain_number

__all__ = ["saved_count", "Fp16Flushed"]


def saved_count(state_dict: Dict[str, Any], key: str) -> Optional[int]:
    """The int >= 0 a state dict holds under ``key`` (None when absent), validated."""
    value = state_dict.get(key)
    if value is None:
        return None
    value = plain_number(key, value, integral=True)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"state dict '{key}'={state_dict[key]!r} must be an int >= 0.")
    return value


class Fp16Flushed:
    """``allow_fp16=True``: the gradient values the unscale of FP16 (and bf16) gradients flushed to zero,
    an int64 counter on the state's device that the unscale adds to (no sync); checkpointed."""

    KEY = "fp16_flushed"

    def __init__(self):
        self.start = 0  # before the counter has a device (a loaded checkpoint's count)
        self.tensor: Optional[torch.Tensor] = None

    def counter(self, device: torch.device) -> torch.Tensor:
        """The device counter (made on first use)."""
        if self.tensor is None:
            self.tensor = torch.full((), self.start, dtype=torch.int64, device=device)
        return self.tensor

    def counts(self) -> Dict[str, int]:
        """The count so far (one sync)."""
        return {self.KEY: self.start if self.tensor is None else int(self.tensor.item())}

    def state(self) -> Dict[str, Any]:
        """The checkpoint's entry."""
        return self.counts()

    def loadable(self, state_dict: Dict[str, Any]) -> Optional[int]:
        """The checkpoint's count, validated (None when absent)."""
        return saved_count(state_dict, self.KEY)

    def load(self, value: Optional[int]) -> None:
        """Take what :meth:`loadable` returned."""
        if value is not None:
            self.start = value
            if self.tensor is not None:
                self.tensor.fill_(value)

    def __getstate__(self):  # a copy starts its counter afresh on its first unscale, from the count
        return {"start": self.counts()[self.KEY], "tensor": None}
