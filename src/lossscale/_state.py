"""A policy's state where torch keeps its scale: on the device, one 0-dim tensor per field.

The state has one home, the device. :class:`TensorState` holds each field of a policy's state dataclass
as a 0-dim tensor of the dtype the field declares (:func:`lossscale.policy.field_kind`), so ``t.scale``
and ``t.growth_tracker`` are what torch's ``GradScaler`` calls ``_scale`` and ``_growth_tracker``, and
torch's update kernel writes them in place. The tensor rules read and write the fields in place too;
their identities never change, so a CUDA graph captured over ``scale()`` or ``update()`` keeps reading
the live values, also across :meth:`TensorState.load_`.

The host reads the state in two ways:

* :meth:`TensorState.read`: now, in one copy (a sync), when someone asks (``get_scale()``,
  ``state()``, ``counters()``, ``health()``, ``state_dict()``);
* :class:`Snapshot`: a copy started after an ``update()`` without waiting (on CUDA into pinned
  memory, with an event), read by a later ``update()`` once it has landed. The health account and
  the stuck check learn every state this way, with no sync. On CPU the copy is done when it starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Tuple

import torch

from .policy import ScaleState, field_kind, host_type

__all__ = ["TensorState", "Snapshot", "DTYPES"]

DTYPES = {"f32": torch.float32, "f64": torch.float64, "i64": torch.int64, "i32": torch.int32, "bool": torch.int64}


class TensorState:
    """A :class:`~lossscale.policy.ScaleState` (any subclass) held on ``device``, one 0-dim tensor per
    field (``t.scale``, ``t.steps``, ``t.growth_tracker``, ...), plus ``t.scale_before``: the scale the
    last update ran with (float64; written by :func:`lossscale.policy.count_tensor`; not a state field)."""

    def __init__(self, state: ScaleState, device: torch.device):
        self.state_type = type(state)
        self.device = torch.device(device)
        self._fields = dataclasses.fields(state)
        for f in self._fields:  # torch.full: a fill on the device, no copy from host memory
            setattr(
                self, f.name, torch.full((), getattr(state, f.name), dtype=DTYPES[field_kind(f)], device=self.device)
            )
        # float64: the scale it holds is a float32 value (exact), and it makes values() one float64 cat.
        self.scale_before = torch.full((), state.scale, dtype=torch.float64, device=self.device)
        self._pieces = [getattr(self, f.name).view(1) for f in self._fields] + [self.scale_before.view(1)]

    def load_(self, state: ScaleState) -> None:
        """Write ``state`` into the tensors in place (no sync: a fill per field)."""
        if type(state) is not self.state_type:
            raise ValueError(f"state is a {type(state).__name__}, this device state holds {self.state_type.__name__}.")
        for f in self._fields:
            getattr(self, f.name).fill_(getattr(state, f.name))
        self.scale_before.fill_(state.scale)

    def values(self) -> torch.Tensor:
        """Every field, then ``scale_before``, as one float64 vector on the device: one ``cat`` (it
        promotes every dtype to float64, which ``scale_before`` is), no sync. float64 holds each
        exactly: float32 values, int32 trackers, and counters up to 2**53."""
        return torch.cat(self._pieces)

    def decode(self, values) -> Tuple[ScaleState, float]:
        """``(state, scale_before)`` from :meth:`values` read on the host (a list of floats)."""
        fields = {f.name: host_type(f)(v) for f, v in zip(self._fields, values)}
        return self.state_type(**fields), float(values[-1])

    def read(self) -> Tuple[ScaleState, float]:
        """``(state, scale_before)`` now: one copy to the host, which waits for it (a sync). The copy is
        made even on the CPU, where it is a memcpy, so a sync counter sees the read there too."""
        return self.decode(self.values().to("cpu", copy=True).tolist())

    def __getstate__(self) -> Any:
        raise TypeError("a TensorState is not pickled: pickle the GradScaler, which stores its state as numbers.")


class Snapshot:
    """The state after one update, copied to the host without waiting; read once :meth:`landed`.

    ``evidence`` travels with it (what that update's first-cause report needs, kept as device tensors).
    On an accelerator the copy goes to pinned memory and an event (``torch.Event``) says when it is
    there; on the CPU it is there when made.
    """

    __slots__ = ("_t", "_host", "_event", "evidence")

    def __init__(self, t: TensorState, evidence: Any = None):
        self._t, self.evidence, self._event = t, evidence, None
        values = t.values()
        if t.device.type == "cpu":
            self._host = values
        else:
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.Event(device=t.device)
            self._event.record(torch.accelerator.current_stream(t.device))  # the stream the copy went to

    def landed(self) -> bool:
        """Whether the copy has reached the host (never waits)."""
        return self._event is None or self._event.query()

    def read(self) -> Tuple[ScaleState, float]:
        """``(state, scale_before)`` of the update this snapshot followed. Call once :meth:`landed`."""
        return self._t.decode(self._host.tolist())
