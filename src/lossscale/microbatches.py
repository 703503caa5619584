"""A bad micro-batch costs only itself: ``GradScaler(bad_microbatch="drop")``.

With gradient accumulation every micro-batch's backward adds into the same ``.grad``, so one micro-batch
whose loss is inf or NaN poisons the sum and the whole accumulated step is skipped (NeMo-RL #1230,
prime-rl PR #1961, mflux PR #447 each hit it). With ``bad_microbatch="drop"`` the scaler looks at each
loss as it is scaled, before its backward::

    scale(loss_i):  finite(loss_i)?  (one host read per micro-batch: the opt-in's cost)
        yes -> loss_i * S, as usual
        no  -> a zero that requires grad: its backward touches no parameter, so the micro-batch adds
               nothing; it is counted (``dropped_microbatches``)
    at the step:    the gradients carry S * kept / total, so the unscale divides by that: the step is the
                    one over the kept micro-batches, renormalised (``loss_i / total`` summed over kept
                    ones, times total / kept, is their mean)
                    every micro-batch dropped -> the step is skipped as a bad-loss step (scale kept)

The renormalisation assumes the loop divides each loss by the number of micro-batches (the usual
``loss / accumulation_steps``; transformers, accelerate and Lightning do). For a loop that sums
unnormalised losses, ``bad_microbatch="zero"`` drops without renormalising. ``kept / total`` is not a
power of two in general, so that unscale rounds once more than a step over the kept micro-batches alone
would (float32 relative error about 2**-24); with nothing dropped the arithmetic is untouched.

Each ``scale()``-d tensor is one micro-batch: a loop that scales two losses per micro-batch has each
judged on its own. A dropped micro-batch's forward is still traced (``trace=True``), so the overflow
report and ``on_forward_overflow="upcast"`` see where it overflowed; the step's skip decision comes from
the micro-batches' losses, not from the trace's forward flag.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from ._features import Feature, saved_count

__all__ = ["MODES", "MicroBatches"]

#: ``GradScaler(bad_microbatch=...)``: "skip" (the default, torch's: a bad loss skips the whole step),
#: "drop" (drop it, renormalise over the kept ones), "zero" (drop it, no renormalisation).
MODES = ("skip", "drop", "zero")

_KEY = "dropped_microbatches"


class MicroBatches(Feature):
    """One scaler's micro-batch account: this iteration's total and kept counts, and the dropped ones."""

    def __init__(self, mode: str):
        if mode not in MODES[1:]:
            raise ValueError(f"bad_microbatch={mode!r} must be one of {MODES}.")
        self.mode = mode
        self.dropped = 0  # over the run (checkpointed)
        self.new_iteration()

    @classmethod
    def of(cls, mode: str) -> Optional["MicroBatches"]:
        """``GradScaler(bad_microbatch=mode)``: None for "skip" (torch's behaviour: nothing to keep)."""
        return None if mode == "skip" else cls(mode)

    def new_iteration(self) -> None:
        """Forget the iteration's micro-batches (the scaler's ``update()`` and ``discard_iteration()``)."""
        self.total = self.kept = 0
        self.dropped_losses: List[torch.Tensor] = []  # this iteration's, for the loss check when none is kept

    def admit(self, loss: torch.Tensor) -> bool:
        """Whether the micro-batch whose ``loss`` is being scaled is kept (every value finite). Syncs
        once: the host must know before the backward, which it decides to run or not."""
        self.total += 1
        if bool(torch.isfinite(loss).all()):
            self.kept += 1
            return True
        self.dropped += 1
        self.dropped_losses.append(loss.detach())
        return False

    def carried(self, scale: torch.Tensor) -> torch.Tensor:
        """The scale the gradients carry: ``scale``, or with "drop" and some dropped, ``scale * kept /
        total`` (float32, on device; no sync), which the unscale divides by."""
        if self.mode == "zero" or self.kept in (0, self.total):
            return scale
        return scale * (self.kept / self.total)

    def counts(self) -> Dict[str, int]:
        """For ``counters()``, ``metrics()`` and ``health()``."""
        return {_KEY: self.dropped}

    def entries(self) -> Dict[str, Any]:
        """The checkpoint's entry."""
        return {_KEY: self.dropped}

    def loadable(self, state_dict: Dict[str, Any]) -> Optional[int]:
        """The count a checkpoint holds (None when absent), validated (ValueError naming the key)."""
        return saved_count(state_dict, _KEY)

    def load(self, value: Optional[int]) -> None:
        """Take what :meth:`loadable` returned."""
        if value is not None:
            self.dropped = value
