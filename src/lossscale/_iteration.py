"""One iteration's bookkeeping, from the first ``scale()`` to ``update()``: what the scaler must remember.

* the per-optimizer stage machine (READY, UNSCALED, STEPPED, as torch's) and what each optimizer's
  gradient check learned (:class:`lossscale._check.Flags`);
* the loss check: the losses handed to ``scale()``, from which the gradient check learns whether one
  was non-finite before scaling (:meth:`Iteration.loss_check_value`);
* whether the iteration has begun (a ``load_state_dict`` in mid-iteration is refused);
* the skip decision of the steps taken so far (read on the host once, where it is on device).

A record is kept only once the call that made it has succeeded: a failed call leaves nothing behind.
"""

from __future__ import annotations

import enum
from typing import Dict, List, Optional

import torch

from . import _kernels
from ._check import Flags, any_flag

__all__ = ["OptState", "Record", "Iteration", "LastUpdate"]


class OptState(enum.Enum):
    """Per-optimizer stage within one iteration, as in torch."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


class Record:
    """One optimizer's stage and what the gradient check learned in this iteration."""

    __slots__ = ("stage", "flags", "skipped")

    def __init__(self):
        self.stage = OptState.READY
        self.flags: Optional[Flags] = None
        self.skipped: Optional[bool] = None  # this optimizer's skip, once read on the host

    def read_skipped(self) -> bool:
        """Whether this optimizer's step was skipped: the host's decision, or the device flag read
        once (a sync, on the fused path only)."""
        if self.skipped is None:
            if self.flags is None:  # an optimizer stepped through grad_scaler=: it checked itself
                self.skipped = False
            elif self.flags.host_found is not None:
                self.skipped = self.flags.host_found
            else:
                self.skipped = bool(self.flags.fold().found_inf.item())
        return self.skipped

    def host_knows(self) -> bool:
        """Whether reading the decision needs no sync."""
        return self.skipped is not None or self.flags is None or self.flags.host_found is not None


_NOT_DECIDED = (
    "The optimizer step of this iteration has not happened yet (unscale_()/clip_grad_norm_() ran, step() did "
    "not), so whether it is skipped is not known. Step schedulers (and anything that asks whether the step was "
    "skipped) after scaler.step(optimizer): either scaler.step(o); scaler.step_scheduler(s); scaler.update(), "
    "or scaler.step(o); scaler.update(); scaler.step_scheduler(s)."
)


class Iteration:
    """The bookkeeping of the iteration in flight (see the module doc)."""

    def __init__(self):
        self.records: Dict[int, Record] = {}
        self.loss_check: Optional[torch.Tensor] = None  # non-finite where a loss was (made when asked)
        self.losses: List[torch.Tensor] = []  # detached, for overflow_report()'s "loss"
        self.begun = False  # scale() was called since the last update()

    def record(self, optimizer, call: str) -> Record:
        """``optimizer``'s record; a new one is kept only by :meth:`keep`, once ``call`` has succeeded."""
        if not hasattr(optimizer, "param_groups"):
            raise ValueError(f"{call}: optimizer={optimizer!r} is not an optimizer (no param_groups); pass the "
                             "torch.optim optimizer whose gradients were scaled.")
        rec = self.records.get(id(optimizer))
        return Record() if rec is None else rec

    def keep(self, optimizer, rec: Record) -> None:
        """Keep ``rec`` as ``optimizer``'s record of this iteration."""
        self.records[id(optimizer)] = rec

    def flags(self) -> List[Flags]:
        """What the checks of this iteration learned, one per checked optimizer."""
        return [r.flags for r in self.records.values() if r.flags is not None]

    def stepped(self, optimizer=None) -> List[Record]:
        """The records of the steps taken: ``optimizer``'s when it has stepped, else every one. Raises
        RuntimeError when gradients were checked but no optimizer has stepped yet (nothing decided)."""
        rec = self.records.get(id(optimizer)) if optimizer is not None else None
        if rec is not None and rec.stage is OptState.STEPPED:
            return [rec]
        stepped = [r for r in self.records.values() if r.stage is OptState.STEPPED]
        if self.records and not stepped:
            raise RuntimeError(_NOT_DECIDED)
        return stepped

    def skipped(self, optimizer=None) -> Optional[bool]:
        """Whether the steps taken so far were skipped (None: none taken). May sync once per stepped fused optimizer (each is read once)."""
        stepped = self.stepped(optimizer)
        return any(r.read_skipped() for r in stepped) if stepped else None

    def skip_flag(self, optimizer, device: torch.device):
        """:meth:`skipped` without a sync: a host bool where known, else a bool device tensor (None: no
        step taken)."""
        stepped = self.stepped(optimizer)
        if not stepped:
            return None
        if all(r.host_knows() for r in stepped):
            return any(r.read_skipped() for r in stepped)
        return any_flag([r.flags.fold().found_inf for r in stepped if r.flags is not None], device) > 0

    def check_loss(self, loss: torch.Tensor) -> None:
        """Remember ``loss`` (detached) for the loss check, which the gradient check reads: whether it
        was non-finite *before* scaling (the scale did not cause it then, and the step is skipped
        without backing off). An FP16 loss that overflows only once scaled is finite here: that one is
        the scale's doing. No kernel here."""
        self.losses.append(loss.detach())
        self.loss_check = None  # made again, with this loss, when next asked

    def loss_check_value(self, device: torch.device, tracer) -> torch.Tensor:
        """The loss check, with the traced forward folded in: a float tensor on ``device`` that is
        non-finite exactly where a loss (or a traced forward output) was non-finite before scaling; its
        consumers test ``value * 0`` for NaN. Made once per iteration (the traced forward's part, two
        kernels, at every call).

        One float32 0-dim loss on ``device`` is handed on as it is, no kernel: the host, which reads the
        skip decision, adds ``loss * 0`` to the decision in one ``addcmul`` just before its read.
        Otherwise ``x - x`` (NaN exactly where ``x`` is inf or NaN, else 0) per loss, cast and summed
        (about two kernels per loss). A rank that never called ``scale()`` (a pipeline stage) sends 0,
        so every rank joins the same collective."""
        if self.loss_check is None:
            losses = self.losses
            if len(losses) == 1 and losses[0].dim() == 0 and losses[0].dtype == torch.float32 \
                    and losses[0].device == device:
                self.loss_check = losses[0]
            elif not losses:
                self.loss_check = _kernels.zero_on(device)  # a constant: no launch
            else:
                bad = [x - x for x in losses]
                bad = [_kernels.to_device((b if b.dim() == 0 else b.sum()).float(), device) for b in bad]
                self.loss_check = bad[0] if len(bad) == 1 else torch.stack(bad).sum()
        forward = None if tracer is None else tracer.forward_flag()
        if forward is None:
            return self.loss_check
        return self.loss_check + torch.where(_kernels.to_device(forward, device), float("nan"), 0.0)


class LastUpdate:
    """Whether the iteration that the last ``update()`` closed was skipped: the host's decision where
    it knew the flags, else the device state's (``overflow_streak > 0``), read once (one sync)."""

    def __init__(self, skipped: Optional[bool] = None):
        self.skipped = skipped
        self._read: Optional[bool] = None

    def was_skipped(self, t, graphed: bool) -> bool:
        """The decision (``t``: the device state or None). ``graphed``: an update was captured in a CUDA
        graph or compiled, so replays move the state without ``update()``: read it every time."""
        if self.skipped is not None:
            return self.skipped
        if t is None:
            return False
        if self._read is None:
            skipped = bool(t.overflow_streak.item() > 0)
            if graphed:
                return skipped
            self._read = skipped
        return self._read

    def flag(self, t):
        """:meth:`was_skipped` without a sync: a host bool, or a bool device tensor."""
        if self.skipped is not None or t is None:
            return bool(self.skipped)
        return t.overflow_streak > 0
