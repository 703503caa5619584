"""The protocol every opt-in feature of the scaler implements, and what they share.

An opt-in feature is an object the scaler holds, None when off: :class:`~lossscale.telemetry.Telemetry`
(``telemetry=``), :class:`~lossscale.trace.Tracer` (``trace=True``), :class:`Fp16Flushed`
(``allow_fp16=True``), :class:`~lossscale.spikes.SpikeSkipper` (``skip_if=``),
:class:`~lossscale.microbatches.MicroBatches` (``bad_microbatch=``) and :class:`~lossscale.upcast.Upcast`
(``on_forward_overflow="upcast"``). Beside its own calls on the iteration's path, each answers the
four calls of :class:`Feature`, which the scaler makes for all of them in one loop, so a feature adds
nothing to ``counters()``, ``metrics()``, ``health()``, ``state_dict()`` or ``load_state_dict()`` but
itself. A feature with nothing to count or keep subclasses :class:`Feature` and takes its defaults.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Protocol, runtime_checkable

import torch

from ._validate import plain_number

__all__ = ["Feature", "saved_count", "Fp16Flushed"]


@runtime_checkable
class Feature(Protocol):
    """What the scaler asks of an opt-in feature (each method's body is the default a subclass takes)."""

    def counts(self) -> Dict[str, int]:
        """Its counters, for ``counters()``, ``metrics()`` and ``health()`` (at most a sync each)."""
        return {}

    def entries(self) -> Dict[str, Any]:
        """Its entries in the scaler's checkpoint (``state_dict()``), as plain values."""
        return {}

    def loadable(self, state_dict: Dict[str, Any]) -> Any:
        """Its entries of ``state_dict`` validated (ValueError naming the key); changes nothing. None:
        the checkpoint holds none."""
        return None

    def load(self, value: Any) -> None:
        """Take what :meth:`loadable` returned; called only once every feature has validated its own."""


def saved_count(state_dict: Dict[str, Any], key: str) -> Optional[int]:
    """The int >= 0 a state dict holds under ``key`` (None when absent), validated."""
    value = state_dict.get(key)
    if value is None:
        return None
    value = plain_number(key, value, integral=True)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"state dict '{key}'={state_dict[key]!r} must be an int >= 0.")
    return value


class Fp16Flushed(Feature):
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

    def entries(self) -> Dict[str, Any]:
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
