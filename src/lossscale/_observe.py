"""The deferred stuck check: look at the state after an update without making the host wait.

After every ``update()`` whose flags stayed on device (fused optimizers), the state's buffer is
copied to a host buffer without blocking (one copy) and an event is recorded; a later ``update()`` reads every snapshot whose event has
completed, oldest first, and the scaler reacts (warn or raise) if the policy says training is stuck.
On CPU the copy is a memcpy and its event is always complete, so a stuck iteration is reported at
the next ``update()``; on CUDA at the next one whose snapshot has landed by then (usually the next:
an iteration's work separates the two). The same code runs on both (the device primitives are in
``lossscale._device``).

A small ring of buffer/event pairs keeps the check alive in a loop that never syncs: a snapshot
whose copy is still in flight is not overwritten by the next one. When every slot is in flight the
oldest unread one is dropped (its streak is still counted in the newer ones).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch

from . import _device
from ._state import TensorState

__all__ = ["Observer"]

SLOTS = 4


class _Slot:
    __slots__ = ("buffer", "event", "state", "seq", "evidence")

    def __init__(self):
        self.buffer: Optional[torch.Tensor] = None
        self.event = None
        self.state: Optional[TensorState] = None  # decodes the buffers (None: empty or read)
        self.seq = 0
        self.evidence: Any = None  # what the caller keeps with the snapshot (its iteration's first cause)


class Observer:
    """Snapshots of a :class:`~lossscale._state.TensorState`, read once they have landed.

    Args:
        slots: ring size.
        record_event: ``device -> event`` (``lossscale._device.record_event``; tests pass a stand-in
            whose events complete late).
    """

    def __init__(self, slots: int = SLOTS, record_event: Callable = _device.record_event):
        self._ring = [_Slot() for _ in range(slots)]
        self._next = 0
        self._seq = 0
        self._record_event = record_event

    def reset(self) -> None:
        """Drop every pending snapshot (after a checkpoint load: they describe another state)."""
        for slot in self._ring:
            slot.state = slot.event = slot.evidence = None

    def push(self, t: TensorState, evidence: Any = None) -> None:
        """Queue a snapshot of ``t`` (no sync), with ``evidence`` returned beside it by :meth:`poll`.
        The caller skips it during CUDA-graph capture."""
        slot = self._ring[self._next]
        self._next = (self._next + 1) % len(self._ring)
        if slot.buffer is None or slot.buffer.shape != t.buffer.shape:
            slot.buffer = _device.host_buffer(t.buffer)
        _device.copy_to_host_(slot.buffer, t.buffer)
        slot.event = self._record_event(t.device)
        slot.state = t
        slot.evidence = evidence
        self._seq += 1
        slot.seq = self._seq

    def poll(self) -> List[Tuple[object, float, Any]]:
        """``(state, scale_before, evidence)`` of every landed, unread snapshot, oldest first; each is
        read once.

        A slot is marked read *before* it is returned, so a reaction that raises cannot make the same
        snapshot raise again at the next update.
        """
        ready = sorted((s for s in self._ring if s.state is not None and s.event.query()), key=lambda s: s.seq)
        out = []
        for slot in ready:
            t, slot.state = slot.state, None
            evidence, slot.evidence = slot.evidence, None
            out.append((*t.decode(slot.buffer), evidence))
        return out
