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
``loss / accumulation_steps``; transformers, accelerate and Lightning do). A loop that weights its
micro-batches otherwise says so with each loss: ``scaler.scale(loss_i, weight=w_i)``, ``w_i`` the
micro-batch's share of the step in any unit. The usual one is its token count, for a loss summed over
the tokens and divided by the step's token count (the "token-mean" of RL trainers)::

    loss_i = token_losses_i.sum() / tokens_in_step          # the step's loss is the mean over its tokens
    scaler.scale(loss_i, weight=n_tokens_i).backward()
    at the step:    the gradients carry S * (kept weight / total weight): the step is the token-mean over
                    the kept micro-batches' tokens

Every micro-batch of an iteration gives a weight, or none does (ValueError at the ``scale()`` that
mixes them, before anything changes). A weight is a number >= 0 (a 0-dim tensor is read on the host:
one more sync). The dropped weight is counted beside the dropped micro-batches (``dropped_weight``:
tokens, with token counts; equal to ``dropped_microbatches`` without weights). For a loop that sums
unnormalised losses, ``bad_microbatch="zero"`` drops without renormalising (weights are only counted).
The kept share is not a power of two in general, so that unscale rounds once more than a step over the
kept micro-batches alone would (float32 relative error about 2**-24); with nothing dropped the arithmetic
is untouched.

Each ``scale()``-d tensor is one micro-batch: a loop that scales two losses per micro-batch has each
judged on its own. A dropped micro-batch's forward is still traced (``trace=True``), so the overflow
report and ``on_forward_overflow="upcast"`` see where it overflowed; the step's skip decision comes from
the micro-batches' losses, not from the trace's forward flag.
"""

from __future__ import annotations

import numbers
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from ._features import Feature, saved_count

__all__ = ["MODES", "MicroBatches", "valid_weight"]

#: ``GradScaler(bad_microbatch=...)``: "skip" (the default, torch's: a bad loss skips the whole step),
#: "drop" (drop it, renormalise over the kept ones), "zero" (drop it, no renormalisation).
MODES = ("skip", "drop", "zero")

_KEY = "dropped_microbatches"
_WEIGHT_KEY = "dropped_weight"


def _plain(value):
    """A real number as a Python int (integral: token counts stay exact) or float; anything else as it is."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def valid_weight(weight, outputs) -> Union[int, float]:
    """``scale(outputs, weight=...)``'s weight as a Python number >= 0; ValueError naming it otherwise
    (nothing changes). A 0-dim tensor is read on the host (a sync)."""
    if not isinstance(outputs, torch.Tensor):
        raise ValueError(
            "scale(outputs, weight=...): a weight is one micro-batch's share, so outputs must be one "
            "loss tensor, not a container of them; scale each loss with its own weight."
        )
    if isinstance(weight, torch.Tensor):
        if weight.numel() != 1:
            raise ValueError(
                f"scale(weight=...) got a tensor of shape {tuple(weight.shape)}; pass the micro-batch's "
                "weight (its token count) as a number or a 1-element tensor."
            )
        weight = weight.item()  # the host read the docstring names
    weight = _plain(weight)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < float("inf"):
        raise ValueError(
            f"scale(weight={weight!r}): a micro-batch's weight must be a finite number >= 0 (its "
            "token count, or any share of the step)."
        )
    return weight


class MicroBatches(Feature):
    """One scaler's micro-batch account: this iteration's micro-batches and weights, total and kept, and
    the dropped ones over the run."""

    def __init__(self, mode: str):
        if mode not in MODES[1:]:
            raise ValueError(f"bad_microbatch={mode!r} must be one of {MODES}.")
        self.mode = mode
        self.dropped = 0  # micro-batches over the run (checkpointed)
        self.dropped_weight: Union[int, float] = 0  # their weight over the run (checkpointed)
        self.new_iteration()

    @classmethod
    def of(cls, mode: str) -> Optional["MicroBatches"]:
        """``GradScaler(bad_microbatch=mode)``: None for "skip" (torch's behaviour: nothing to keep)."""
        return None if mode == "skip" else cls(mode)

    def new_iteration(self) -> None:
        """Forget the iteration's micro-batches (the scaler's ``update()`` and ``discard_iteration()``)."""
        self.total = self.kept = 0
        self.total_weight: Union[int, float] = 0
        self.kept_weight: Union[int, float] = 0
        self.weighted: Optional[bool] = None  # whether this iteration's micro-batches give weights
        self.dropped_losses: List[torch.Tensor] = []  # this iteration's, for the loss check when none is kept

    def expect(self, weight) -> None:
        """ValueError (nothing changed) if ``weight`` breaks the rule that every micro-batch of an
        iteration gives a weight or none does. The scaler asks before ``scale()`` changes anything."""
        if self.weighted is not None and self.weighted != (weight is not None):
            raise ValueError(
                "scale(weight=...): every micro-batch of an iteration gives a weight, or none does; "
                f"this one {'does not' if weight is None else 'does'}, the earlier ones "
                f"{'did' if self.weighted else 'did not'}."
            )

    def admit(self, loss: torch.Tensor, weight: Optional[Union[int, float]] = None) -> bool:
        """Whether the micro-batch whose ``loss`` is being scaled is kept (every value finite); ``weight``:
        its share (None: one micro-batch's; :meth:`expect` checked it). Syncs once: the host must know
        before the backward, which it decides to run or not."""
        self.weighted = weight is not None
        share = 1 if weight is None else weight
        self.total += 1
        self.total_weight += share
        if bool(torch.isfinite(loss).all()):
            self.kept += 1
            self.kept_weight += share
            return True
        self.dropped += 1
        self.dropped_weight += share
        self.dropped_losses.append(loss.detach())
        return False

    def carried(self, scale: torch.Tensor) -> torch.Tensor:
        """The scale the gradients carry: ``scale``, or with "drop" and some dropped, ``scale * kept share
        / total share`` (float32, on device; no sync), which the unscale divides by. Kept micro-batches of
        weight 0 carry nothing to renormalise (their gradients are zeros): ``scale``."""
        if self.mode == "zero" or self.kept in (0, self.total) or self.kept_weight == 0:
            return scale
        return scale * (self.kept_weight / self.total_weight)

    def counts(self) -> Dict[str, Union[int, float]]:
        """For ``counters()``, ``metrics()`` and ``health()``."""
        return {_KEY: self.dropped, _WEIGHT_KEY: self.dropped_weight}

    def entries(self) -> Dict[str, Any]:
        """The checkpoint's entries."""
        return self.counts()

    def loadable(self, state_dict: Dict[str, Any]) -> Optional[Tuple[int, Union[int, float]]]:
        """The counts a checkpoint holds (None when absent), validated (ValueError naming the key). A
        checkpoint from before weights counts its dropped micro-batches as their weight."""
        dropped = saved_count(state_dict, _KEY)
        if dropped is None:
            return None
        weight = _plain(state_dict.get(_WEIGHT_KEY, dropped))
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < float("inf"):
            raise ValueError(f"state dict '{_WEIGHT_KEY}'={state_dict[_WEIGHT_KEY]!r} must be a finite number >= 0.")
        return dropped, weight

    def load(self, value: Optional[Tuple[int, Union[int, float]]]) -> None:
        """Take what :meth:`loadable` returned."""
        if value is not None:
            self.dropped, self.dropped_weight = value
