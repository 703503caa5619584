"""A policy's state as device tensors: the scaler's source of truth once training starts.

Any :class:`~lossscale.policy.ScaleState` subclass maps onto three vectors by its field types
(:func:`lossscale.policy.field_kind`), so a new policy needs no code here:

* ``f32``: ``[scale, streak_start_scale, scale_before, <the policy's float fields>]``. The scale is a
  float32, as torch's GradScaler keeps it, so ``loss * scale`` is bitwise torch's.
* ``i64``: ``[steps, skipped, inf, nan, bad_loss, streak, streak_nan, streak_bad_loss, <the policy's int and bool fields>]``; the
  eight shared counters are contiguous (``counts``), so the bookkeeping is two kernels.
* ``f64``: the fields a policy marks ``F64`` (LogMax's moving averages).
* ``i32``: the fields a policy marks ``I32`` (the dynamic policy's growth tracker, which torch's
  ``_amp_update_scale_`` takes as int32).

Every field is also a 0-dim *view* attribute (``t.scale``, ``t.growth_tracker``, ...), which the
tensor rules read and write in place: the tensors never change identity, so a CUDA graph captured
over ``scale()`` or ``update()`` keeps reading the live values, also across ``load_``.
``scale_before`` is not a state field: :func:`lossscale.policy.count_tensor` writes the scale each
update ran with, which the stuck check needs.

Beside the state, a few device constants the tensor rules use instead of creating tensors per step
(creating one would be a kernel, or a host-to-device copy): ``true``/``false`` (bool), ``zero``/``one``
(float32), the counters' table ``count_table`` and its rows for flags the host knows
(``known_counts``, see :func:`lossscale.policy.count_tensor`).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Tuple

import torch

from .policy import COUNT_ADD, COUNT_KEEP, ScaleState, count_rows, field_kind

_DTYPES = {"f32": torch.float32, "i64": torch.int64, "f64": torch.float64, "i32": torch.int32}
_INT_KINDS = ("i64", "i32")
_SHARED_F32 = ("scale", "streak_start_scale", "scale_before")
_N_COUNTS = 8  # steps, skipped, inf, nan, bad_loss, streak, streak_nan, streak_bad_loss


def layout(state_type: type) -> Dict[str, Tuple[str, ...]]:
    """Field names per device vector, in order (``scale_before`` included)."""
    names: Dict[str, List[str]] = {"f32": list(_SHARED_F32), "i64": [], "f64": [], "i32": []}
    for f in dataclasses.fields(state_type):
        if f.name in _SHARED_F32:
            continue
        names[field_kind(f)].append(f.name)
    return {k: tuple(v) for k, v in names.items()}


def _fill_(vec: torch.Tensor, values: Sequence) -> None:
    """Write host values into a device vector without a host-to-device copy: one ``fill_`` per
    element (a kernel taking a scalar argument). A copy from pageable host memory would wait for the
    stream, and inside CUDA-graph capture it would fail."""
    for i, v in enumerate(values):
        vec[i].fill_(v)


class TensorState:
    """A :class:`~lossscale.policy.ScaleState` (any subclass) held as device tensors.

    Args:
        state: the pure state to start from.
        device: where the tensors live.
    """

    def __init__(self, state: ScaleState, device: torch.device):
        self.state_type = type(state)
        self.names = layout(self.state_type)
        for kind, names in self.names.items():
            vec = torch.zeros(len(names), dtype=_DTYPES[kind], device=device)
            setattr(self, kind, vec)
            for i, name in enumerate(names):
                setattr(self, name, vec[i])
        self.counts = self.i64[:_N_COUNTS]
        self._constants(device)
        self.load_(state)

    def _constants(self, device: torch.device) -> None:
        self.true = torch.ones((), dtype=torch.bool, device=device)
        self.false = torch.zeros((), dtype=torch.bool, device=device)
        self.zero = torch.zeros((), dtype=torch.float32, device=device)
        self.one = torch.ones((), dtype=torch.float32, device=device)
        self.count_table = torch.empty(2, _N_COUNTS, 4, dtype=torch.int64, device=device)
        _fill_(self.count_table.view(-1), [x for table in (COUNT_KEEP, COUNT_ADD) for row in table for x in row])
        # The five consistent known cases: clean, inf, NaN, bad loss, bad loss with NaN.
        self.known_counts = {}
        for flags in ((False, False, False), (True, False, False), (True, True, False), (True, False, True),
                      (True, True, True)):
            rows = torch.empty(2, _N_COUNTS, dtype=torch.int64, device=device)
            _fill_(rows.view(-1), [x for row in count_rows(*flags) for x in row])
            self.known_counts[flags] = tuple(rows)

    @property
    def device(self) -> torch.device:
        """Where the state lives."""
        return self.f32.device

    def _values(self, state: ScaleState, kind: str) -> List:
        values = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
        values["scale_before"] = state.scale
        return [int(values[n]) if kind in _INT_KINDS else float(values[n]) for n in self.names[kind]]

    def load_(self, state: ScaleState) -> None:
        """Overwrite the values in place (the tensors keep their identity). No host sync."""
        if type(state) is not self.state_type:
            raise ValueError(f"a {self.state_type.__name__} tensor state cannot hold a {type(state).__name__}.")
        for kind in self.names:
            _fill_(getattr(self, kind), self._values(state, kind))

    def vectors(self) -> List[torch.Tensor]:
        """The non-empty vectors, in :meth:`decode` order (what a snapshot copies)."""
        return [getattr(self, kind) for kind in self.names if self.names[kind]]

    def decode(self, host_vectors: Sequence[Sequence]) -> Tuple[ScaleState, float]:
        """``(state, scale_before)`` from host copies of :meth:`vectors` (lists of numbers)."""
        values = {}
        kinds = [kind for kind in self.names if self.names[kind]]
        for kind, vec in zip(kinds, host_vectors):
            values.update(zip(self.names[kind], vec))
        scale_before = float(values.pop("scale_before"))
        fields = {}
        for f in dataclasses.fields(self.state_type):
            v = values[f.name]
            fields[f.name] = (bool(v) if str(f.type) == "bool" else int(v) if field_kind(f) in _INT_KINDS
                              else float(v))
        return self.state_type(**fields), scale_before

    def to_state(self) -> ScaleState:
        """The pure state. Syncs host and device (one transfer per vector)."""
        return self.decode([v.tolist() for v in self.vectors()])[0]
