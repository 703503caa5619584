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
import itertools
from typing import Any, Dict, List, Tuple

import torch

from .policy import COUNTERS, STREAKS, ScaleState, field_kind, host_type

__all__ = ["TensorState", "Snapshot", "DTYPES"]

DTYPES = {"f32": torch.float32, "f64": torch.float64, "i64": torch.int64, "i32": torch.int32, "bool": torch.int64}


class TensorState:
    """A :class:`~lossscale.policy.ScaleState` (any subclass) held on ``device``, one 0-dim tensor per
    field (``t.scale``, ``t.steps``, ``t.growth_tracker``, ...), plus ``t.scale_before``: the scale the
    last update ran with (float32, as the scale; written by :func:`lossscale.policy.count_tensor`; not a
    state field).

    The fields of one dtype live side by side in one vector (``t.scale`` is element 0 of the float32
    one, and so on), each field a 0-dim view of its element: so the host reads the whole state with one
    ``cat`` of the vectors' bytes (:meth:`values`), and :attr:`counters`, the eight counters every state
    begins with, move in one operation (:func:`lossscale.policy.count_tensor`).
    """

    def __init__(self, state: ScaleState, device: torch.device):
        self.state_type = type(state)
        self.device = torch.device(device)
        self._fields = dataclasses.fields(state)
        by_dtype: Dict[torch.dtype, List[str]] = {}
        for f in self._fields:
            by_dtype.setdefault(DTYPES[field_kind(f)], []).append(f.name)
        by_dtype.setdefault(torch.float32, []).append("scale_before")
        # torch.empty, then load_'s fills: on the device, no copy from host memory (no sync).
        vectors = {dtype: torch.empty(len(names), dtype=dtype, device=self.device) for dtype, names in by_dtype.items()}
        order = []
        for dtype, names in by_dtype.items():
            for i, name in enumerate(names):
                setattr(self, name, vectors[dtype][i])
                order.append(name)
        self._vectors = list(vectors.values())
        self._byte_ends = list(itertools.accumulate(v.numel() * v.element_size() for v in self._vectors))
        # Where each field sits in values(): the vectors' elements, one vector after the other.
        self._position = {name: i for i, name in enumerate(order)}
        self._host_types = [(f.name, host_type(f), self._position[f.name]) for f in self._fields]
        #: The counters every state begins with (ScaleState's, ``steps`` to ``streak_bad_loss_steps``), one
        #: int64 vector: a subclass's fields come after its base's, so they lead the int64 fields.
        self.counters = vectors[torch.int64][: len(COUNTERS)]
        self.streaks = self.counters[STREAKS]  # the streak counters: a view, they end at a clean step
        # Constants (never written): the +1 of count_tensor, and a reason not (yet) found.
        self.true = torch.ones((), dtype=torch.bool, device=self.device)
        self.false = torch.zeros((), dtype=torch.bool, device=self.device)
        if by_dtype[torch.int64][: len(COUNTERS)] != list(COUNTERS):
            raise TypeError(f"{self.state_type.__name__} must begin with ScaleState's counters, in order: {COUNTERS}.")
        self.load_(state)

    def load_(self, state: ScaleState) -> None:
        """Write ``state`` into the tensors in place (no sync: a fill per field)."""
        if type(state) is not self.state_type:
            raise ValueError(f"state is a {type(state).__name__}, this device state holds {self.state_type.__name__}.")
        for f in self._fields:
            getattr(self, f.name).fill_(getattr(state, f.name))
        self.scale_before.fill_(state.scale)

    def values(self) -> torch.Tensor:
        """Every field and ``scale_before`` as the bytes of the per-dtype vectors, one ``uint8`` vector on
        the device: one ``cat`` of byte views, no sync, and no value converted (each dtype's bits as they
        are, so every field reads back exactly, and no float64 is made). :meth:`unpack` reads it."""
        return torch.cat([v.view(torch.uint8) for v in self._vectors])

    def unpack(self, host_bytes) -> list:
        """:meth:`values` copied to host memory (a uint8 tensor, or its bytes as a list of numbers, as a
        transfer that carries other figures gives them back), as numbers in :meth:`host_values`' order."""
        if not isinstance(host_bytes, torch.Tensor):
            host_bytes = torch.tensor(host_bytes, dtype=torch.uint8)  # each byte 0..255: exact as any number
        out, start = [], 0
        for vector, end in zip(self._vectors, self._byte_ends):
            # clone: a fresh buffer, aligned for the dtype (a slice's offset may not be); host memory only
            out += host_bytes[start:end].clone().view(vector.dtype).tolist()
            start = end
        return out

    def host_values(self) -> list:
        """:meth:`values` as numbers, for a state that lives in host memory (the CPU): read where it lies,
        no copy and no kernel."""
        return [value for vector in self._vectors for value in vector.tolist()]

    def decode(self, values) -> Tuple[ScaleState, float]:
        """``(state, scale_before)`` from :meth:`values` read on the host (a list of floats)."""
        fields = {name: kind(values[i]) for name, kind, i in self._host_types}
        return self.state_type(**fields), float(values[self._position["scale_before"]])

    def read(self) -> Tuple[ScaleState, float]:
        """``(state, scale_before)`` now: one copy to the host, which waits for it (a sync). The copy is
        made even on the CPU, where it is a memcpy, so a sync counter sees the read there too."""
        return self.decode(self.unpack(self.values().to("cpu", copy=True)))

    def __getstate__(self) -> Any:
        raise TypeError("a TensorState is not pickled: pickle the GradScaler, which stores its state as numbers.")


class Snapshot:
    """The state after one update, copied to the host without waiting; read once :meth:`landed`.

    ``evidence`` travels with it (what that update's first-cause report needs, kept as device tensors).
    On an accelerator the copy goes to pinned memory and an event (``torch.Event``) says when it is
    there. On the CPU the state already is in host memory: the snapshot reads its values at once (a
    list of numbers, no kernel), so it has landed when made.
    """

    __slots__ = ("_t", "_host", "_event", "evidence")

    def __init__(self, t: TensorState, evidence: Any = None):
        self._t, self.evidence, self._event = t, evidence, None
        if t.device.type == "cpu":
            self._host = t.host_values()
            return
        values = t.values()
        self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        self._host.copy_(values, non_blocking=True)
        self._event = torch.Event(device=t.device)
        self._event.record(torch.accelerator.current_stream(t.device))  # the stream the copy went to

    def landed(self) -> bool:
        """Whether the copy has reached the host (never waits)."""
        return self._event is None or self._event.query()

    def read(self) -> Tuple[ScaleState, float]:
        """``(state, scale_before)`` of the update this snapshot followed. Call once :meth:`landed`."""
        return self._t.decode(self._host if self._event is None else self._t.unpack(self._host))
