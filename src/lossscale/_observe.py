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

import warnings
from typing import Any, Callable, List, Optional, Tuple

import torch

from . import _device
from ._state import TensorState
from .diagnosis import diagnose

__all__ = ["Observer", "StuckCheck"]

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


class StuckCheck:
    """When training is stuck (the policy's ``is_stuck``), warn once per streak or raise (``on_stuck``).

    It sees every state the host learns: at once after an update the host ran itself (the synced
    path), and through the :class:`Observer` ring one or more updates late after a device update.
    ``describe(evidence, scale_before)`` builds the one-line first cause of the step that tripped it
    (it syncs; called only when stuck). Under CUDA-graph capture or torch.compile nothing reaches the
    host: :meth:`capture_warning` says so once, and :meth:`now` is the eager point.
    """

    def __init__(self, record_event: Callable = _device.record_event):
        self.observer = Observer(record_event=record_event)
        self.warned_streak = False
        self.warned_capture = False

    def reset(self) -> None:
        """Forget pending snapshots and the streak (after a checkpoint load)."""
        self.observer.reset()
        self.warned_streak = False

    def after_device_update(self, t: TensorState, clean: bool, evidence: Any, policy, describe: Callable,
                            tracing: bool) -> List[Tuple[object, float, Any]]:
        """React to every landed snapshot of earlier updates, then queue this one's (none when the
        host knows the step was clean); returns the states it read (oldest first)."""
        landed = self.observer.poll()
        for state, scale_before, kept in landed:
            self.react(policy, state, scale_before, kept, describe, tracing, stacklevel=4)
        if clean:
            self.warned_streak = False
        else:
            self.observer.push(t, evidence)
        return landed

    def now(self, policy, t: TensorState, describe: Callable, tracing: bool) -> None:
        """Run the check on the device state now (one sync)."""
        state, scale_before = t.decode(t.buffer.cpu())
        self.react(policy, state, scale_before, None, describe, tracing, stacklevel=4)

    def react(self, policy, state, scale_before: float, evidence: Any, describe: Callable, tracing: bool,
              stacklevel: int = 4) -> None:
        """Warn (once per streak) or raise if ``state`` says the run is stuck."""
        if state.overflow_streak == 0:
            self.warned_streak = False
            return
        if not policy.is_stuck(state, scale_before) or policy.on_stuck == "ignore":
            return
        message = diagnose(policy, state, tracing=tracing)
        if evidence is not None:
            # Rare (the run is stuck): one sync to say where the stuck step's trouble began.
            message += "\nThe step that tripped this check: " + describe(evidence, scale_before)
        if policy.on_stuck == "raise":
            raise RuntimeError(message)
        if not self.warned_streak:
            warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)
            self.warned_streak = True

    def capture_warning(self) -> None:
        """Say once that the check is off inside a CUDA-graph capture or torch.compile. Under
        torch.compile the warning breaks the first trace's graph only: the flag is then True, dynamo's
        guard on it recompiles once, and later traces have no break."""
        if not self.warned_capture:
            self.warned_capture = True
            warnings.warn(
                "lossscale: update() runs inside a CUDA-graph capture or torch.compile, where the host cannot "
                "read the device, so the stuck check (on_stuck) is off for these updates. Call "
                "scaler.check_stuck() eagerly now and then (e.g. every few hundred steps; one sync) to run it.",
                RuntimeWarning, stacklevel=3)
