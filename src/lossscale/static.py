"""Static loss scaling: one fixed scale; non-finite steps are still skipped, counted and diagnosed.

The rule::

    count the step (steps, skipped, inf/NaN, streak)    # policy.count, shared by every policy
    if bad_loss: stop                           # a loss non-finite before scaling: counted, skipped
    growth_tracker = 0 if found_inf else growth_tracker + 1   # clean steps in a row (torch's field)
    scale unchanged

``StaticPolicy(scale=1.0)`` is the pass-through for bf16 or fp32 training
(:meth:`lossscale.GradScaler.passthrough`), which needs no scaling but still wants a non-finite step
skipped rather than written into the weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ._validate import positive_finite, validate_stuck, warn_not_powers_of_two
from .policy import I64, PolicyBase, ScaleState, count, count_tensor, f32, register, stuck_at_bound_or_streak

__all__ = ["StaticPolicy", "StaticState"]

#: torch's growth tracker is an int32; a static scale written for torch never reaches its interval.
_TORCH_NEVER = 2**31 - 1


@dataclass(frozen=True)
class StaticState(ScaleState):
    """:class:`~lossscale.policy.ScaleState` plus ``growth_tracker``: clean steps in a row."""

    growth_tracker: int = field(default=0, metadata=I64)


@register
@dataclass(frozen=True)
class StaticPolicy(PolicyBase):
    """A fixed loss scale. Non-finite steps are still skipped and counted.

    Args:
        scale: the loss scale (a power of two keeps scaling exact; others are warned about).
            ``GradScaler(policy="static", init_scale=S)`` sets it.
        on_stuck: as in :class:`~lossscale.DynamicPolicy`.
        max_consecutive_skips: as in :class:`~lossscale.DynamicPolicy`; a static scale cannot back
            off, so while this is None every overflow counts as "at the minimum".
    """

    name = "static"
    state_type = StaticState
    keyword_aliases = {"init_scale": "scale"}

    scale: float = 2.0**16
    on_stuck: str = "warn"
    max_consecutive_skips: Optional[int] = None

    def __post_init__(self):
        self._plain_numbers()
        positive_finite("scale", self.scale)
        validate_stuck(self.on_stuck, self.max_consecutive_skips)
        warn_not_powers_of_two(self, ("scale",))

    @property
    def init_scale(self) -> float:
        """The fixed scale (the name the other policies use for their first scale)."""
        return self.scale

    def torch_factors(self):
        """For a scale that never moves: factors of 1 and an interval torch never reaches."""
        return {"growth_factor": 1.0, "backoff_factor": 1.0, "growth_interval": _TORCH_NEVER}

    def torch_state(self, state: StaticState):
        """torch's keys for a scale that never moves (the tracker 0: torch never reaches the interval)."""
        return {"scale": state.scale, **self.torch_factors(), "_growth_tracker": 0}

    def init_state(self) -> StaticState:
        """The state before the first step."""
        return StaticState(scale=f32(self.scale))

    def update(
        self,
        state: StaticState,
        found_inf: bool,
        found_nan: bool = False,
        amax: Optional[float] = None,
        bad_loss: bool = False,
    ) -> StaticState:
        """Counts the step; the scale never changes. A step with a non-finite loss (``bad_loss``)
        leaves the clean-step tracker as it was."""
        self.check_type(state)
        if bad_loss:
            return count(state, True, found_nan, bad_loss=True)
        return count(state, found_inf, found_nan).replace(growth_tracker=0 if found_inf else state.growth_tracker + 1)

    def tensor_update(self, t, found_inf, found_nan, bad_loss, amax=None) -> None:
        """:meth:`update` on device tensors, in place: the counters, and the clean-step tracker (reset
        by an overflow, left alone by a non-finite loss). Flags as for
        :meth:`lossscale.DynamicPolicy.tensor_update`."""
        count_tensor(t, found_inf, found_nan, bad_loss)
        t.growth_tracker.add_(~found_inf).masked_fill_(found_inf & ~bad_loss, 0)

    def settle_steps(self) -> int:
        """0: a fixed scale never searches, so no skip is calibration."""
        return 0

    def is_stuck(self, state: StaticState, scale_before: float) -> bool:
        """True after an overflow (when no streak limit is set) or a streak of ``max_consecutive_skips``;
        a streak of non-finite losses only after ``max_consecutive_skips`` (or ``BAD_LOSS_STREAK``)."""
        if self.max_consecutive_skips is None and state.streak_bad_loss_steps < state.overflow_streak:
            return True  # a static scale cannot answer an overflow: every one is "at the minimum"
        return stuck_at_bound_or_streak(self, state, scale_before, None)
