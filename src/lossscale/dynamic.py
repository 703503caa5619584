"""Dynamic loss scaling (torch's, Megatron's, DeepSpeed's): back off on overflow, grow after clean streaks.

The rule, as pseudocode (``found_inf`` means "some gradient was inf or NaN", torch's naming)::

    count the step (steps, skipped, inf/NaN, streak)        # policy.count, shared by every policy
    if bad_loss: stop                               # a loss non-finite before scaling: counted, skipped,
                                                    # and the scale and trackers left as they are
    if found_inf:                                   # overflow: the optimizer step is skipped
        growth_tracker = 0
        if hysteresis_tracker > 1:                  # tolerance left: spend one, keep the scale
            hysteresis_tracker -= 1
        else:                                       # tolerance spent (the tracker stays at 1): back off
            scale = max(f32(scale * backoff_factor), min_scale)   # min_scale None: no floor (torch's)
    else:                                           # clean step
        growth_tracker += 1
        if consecutive_hysteresis:
            hysteresis_tracker = hysteresis         # DeepSpeed: only *consecutive* overflows count
        if growth_tracker >= growth_interval:
            grown = f32(scale * growth_factor)
            if isfinite(grown):                     # torch: a non-finite growth is refused
                scale = min(grown, max_scale)       # the cap: clamp, so max_scale is reachable
            growth_tracker = 0
            hysteresis_tracker = hysteresis

With ``hysteresis=1`` and no bounds this is exactly ``torch.amp.GradScaler``'s rule
(``torch._amp_update_scale_``), including its float32 rounding of the scale (``f32``: the product is
taken in double and rounded once, as torch's kernel does), all the way down: without a floor the scale
backs off through float32's subnormals to 0.0, as torch's does. With ``hysteresis > 1`` and
``consecutive_hysteresis=False`` it is Megatron-core's ``DynamicGradScaler``: once the tolerance is
spent, every overflow backs off until a growth refills it.

Example (a training loop drives the state; here by hand)::

    >>> policy = DynamicPolicy(init_scale=2.0**16, growth_interval=2)
    >>> s = policy.init_state()
    >>> s = policy.update(s, found_inf=True)     # overflow: back off, skip
    >>> s.scale, s.skipped_steps
    (32768.0, 1)
    >>> s = policy.update(policy.update(s, found_inf=False), found_inf=False)
    >>> s.scale                                  # two clean steps: grow
    65536.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from ._validate import (
    positive_finite,
    validate_backoff,
    validate_bounds,
    validate_int,
    validate_stuck,
    warn_not_powers_of_two,
)
from .hysteresis import backs_off_tensor, on_clean, on_overflow, track_tensor_
from .policy import (
    I32,
    I64,
    MIN_SCALE,
    SMALLEST_SCALE,
    PolicyBase,
    ScaleState,
    count,
    count_tensor,
    f32,
    register,
    stuck_at_bound_or_streak,
)

__all__ = ["DynamicPolicy", "DynamicState"]


@dataclass(frozen=True)
class DynamicState(ScaleState):
    """:class:`~lossscale.policy.ScaleState` plus the dynamic rule's two trackers.

    Attributes:
        growth_tracker: consecutive clean steps since the last growth or overflow (torch's
            ``_growth_tracker``).
        hysteresis_tracker: overflows until the scale backs off, the one that does included: 1 means
            the next overflow backs off. Never below 1 (DeepSpeed's ``cur_hysteresis``), so with
            ``hysteresis=1`` it never moves.
    """

    growth_tracker: int = field(default=0, metadata=I32)  # int32 on device: torch's update kernel takes it
    hysteresis_tracker: int = field(default=1, metadata=I64)


@register
@dataclass(frozen=True)
class DynamicPolicy(PolicyBase):
    """Dynamic loss scaling: back off on overflow (with optional hysteresis), grow after clean streaks.

    Args:
        init_scale: first scale. Default 2**16, torch's.
        growth_factor: multiplier after ``growth_interval`` clean steps; must be > 1.
        backoff_factor: multiplier on overflow once hysteresis is spent; must be in (0, 1).
        growth_interval: consecutive clean steps before a growth; int >= 1.
        hysteresis: overflows tolerated before backing off (1 = back off on every overflow, torch).
        consecutive_hysteresis: refill the hysteresis on every clean step, so only *consecutive*
            overflows spend it (DeepSpeed); otherwise only a growth refills it (Megatron-core).
        min_scale: lower bound of the scale, or None for none, as torch: the backoff goes on below
            float32's smallest normal (2**-126) down to 0.0, bitwise torch's. Below 2**-126 the inverse
            1/scale overflows float32 to inf, so a step taken there writes inf or NaN into the weights,
            and at 0 every later step is NaN, as under torch. Default
            :data:`~lossscale.policy.MIN_SCALE`, 2**-24, FP16's smallest subnormal: at a lower scale even
            a gradient of 1 flushes to zero in an FP16 backward, so no such scale carries anything; above
            it, a backward that overflows FP16 at every scale >= 1 still trains where torch's unbounded
            backoff does. ``min_scale=1.0`` stops the backoff at 1 (a scale below 1 only shrinks
            gradients); a backward that overflows there then skips every step, which the ``on_stuck``
            diagnosis reports.
        max_scale: upper bound, or None. Default 2**24: a gradient still flushed at 2**24 is below
            2**-48 and could not move an FP32 master weight anyway, while an unbounded scale
            (e.g. when some gradients are all zero for a while) must later burn one skipped step per
            halving to come back.
        on_stuck: what to do when training is stuck: an overflow at ``min_scale``, or
            ``max_consecutive_skips`` skipped steps in a row. "raise" (RuntimeError with a diagnosis),
            "warn" (once per streak), or "ignore".
        max_consecutive_skips: the streak length that counts as stuck, or None (react only at the
            minimum scale).

    A configuration whose scale could leave the powers of two (non-power-of-two ``init_scale`` or
    factors) is accepted but warned about: only a power-of-two scale multiplies and divides
    gradients exactly, so any other value adds a rounding error to every gradient.
    """

    name = "dynamic"
    state_type = DynamicState

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    min_scale: Optional[float] = MIN_SCALE
    max_scale: Optional[float] = 2.0**24
    on_stuck: str = "warn"
    max_consecutive_skips: Optional[int] = None

    def __post_init__(self):
        self._plain_numbers()
        positive_finite("init_scale", self.init_scale)
        if (
            isinstance(self.growth_factor, bool)
            or not isinstance(self.growth_factor, (int, float))
            or not (math.isfinite(self.growth_factor) and self.growth_factor > 1.0)
        ):
            raise ValueError(f"growth_factor={self.growth_factor!r} must be a finite number > 1.0 (e.g. 2.0).")
        validate_backoff(self.backoff_factor)
        validate_int("growth_interval", self.growth_interval, 1, 2**31 - 1)  # torch's int32 tracker
        validate_int("hysteresis", self.hysteresis, 1)
        if not isinstance(self.consecutive_hysteresis, bool):
            raise ValueError(f"consecutive_hysteresis={self.consecutive_hysteresis!r} must be a bool.")
        validate_bounds(self)
        validate_stuck(self.on_stuck, self.max_consecutive_skips)
        warn_not_powers_of_two(self, ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"))

    def init_state(self) -> DynamicState:
        """The state before the first step."""
        return DynamicState(scale=f32(self.init_scale), hysteresis_tracker=self.hysteresis)

    def update(
        self,
        state: DynamicState,
        found_inf: bool,
        found_nan: bool = False,
        amax: Optional[float] = None,
        bad_loss: bool = False,
    ) -> DynamicState:
        """The next state after one iteration. ``found_inf``: any inf or NaN; ``found_nan``: NaN among
        them; ``amax`` is not used by this policy. ``bad_loss``: the loss was non-finite before scaling (not
        the scale's doing): the step is skipped and counted, the scale and trackers are left as they were."""
        self.check_type(state)
        if bad_loss:
            return count(state, True, found_nan, bad_loss=True)
        counted = count(state, found_inf, found_nan)
        if found_inf:
            scale, hyst = on_overflow(state.scale, state.hysteresis_tracker, self.backoff_factor, self.lowest())
            return counted.replace(scale=scale, growth_tracker=0, hysteresis_tracker=hyst)
        growth = state.growth_tracker + 1
        hyst = on_clean(state.hysteresis_tracker, self.hysteresis, self.consecutive_hysteresis)
        scale = state.scale
        if growth >= self.growth_interval:
            grown = f32(scale * self.growth_factor)
            if math.isfinite(grown):  # torch: a non-finite growth is refused
                scale = grown if self.max_scale is None else min(grown, f32(self.max_scale))
            growth, hyst = 0, self.hysteresis
        return counted.replace(scale=scale, growth_tracker=growth, hysteresis_tracker=hyst)

    def tensor_update(self, t, found_inf, found_nan, bad_loss, amax=None) -> None:
        """:meth:`update` on device tensors, in place, with no host sync. The flags are bool 0-dim
        tensors (``found_inf`` includes ``bad_loss``); ``amax`` is not used.

        The plan: torch's own update kernel applies the rule as if ``hysteresis=1`` (so the scale's
        arithmetic is bitwise torch's whatever the hysteresis), then one clamp floors a backoff, undoes
        one that the tolerance absorbed, and caps a growth. The kernel grows when ``tracker + 1 ==
        growth_interval``; the state never holds a tracker at or past the interval, so that is the pure
        rule's ``>=``. Every way of setting the scale keeps ``lowest() <= scale <= max_scale``, so the
        floor can only act on an overflow and the cap only on a growth: both are one clamp.
        """
        import torch  # here, not at the top: the policies import without torch

        count_tensor(t, found_inf, found_nan, bad_loss)
        # The overflow the scale answers (a bad loss is not the scale's). found_inf includes bad_loss, so
        # "found_inf and not bad_loss" is their exclusive or: one operation.
        overflow = found_inf ^ bad_loss
        # The bounds as Python floats: clamp compares a float32 tensor with them and stores a float32, so
        # they act as their float32 roundings do in the pure rule (lowest(), f32(max_scale)).
        floor = 0.0 if self.min_scale is None else self.min_scale  # None: none, as torch (down to 0)
        if self.hysteresis > 1:
            # An overflow with tolerance left keeps the scale: the kernel below backs off on every
            # overflow, and the floor then lifts the scale back to the one this iteration ran with.
            floor = torch.where(backs_off_tensor(t.hysteresis_tracker, overflow), floor, t.scale_before)
        # A bad loss must leave the scale and the tracker alone: the kernel sees no overflow, and the
        # tracker steps back first, so the kernel's + 1 lands where it was (and cannot reach the interval).
        t.growth_tracker.add_(bad_loss, alpha=-1)
        torch._amp_update_scale_(
            t.scale, t.growth_tracker, overflow.float(), self.growth_factor, self.backoff_factor, self.growth_interval
        )  # refuses a non-finite growth
        if self.min_scale is not None or self.hysteresis > 1:
            t.scale.clamp_(min=floor)
        if self.max_scale is not None:
            t.scale.clamp_(max=self.max_scale)
        if self.hysteresis > 1:
            # A clean step whose growth check ran (the tracker back at 0: a growth, or a refused one).
            clean = ~found_inf
            refill = clean if self.consecutive_hysteresis else clean & (t.growth_tracker == 0)
            track_tensor_(t.hysteresis_tracker, overflow, refill, self.hysteresis)

    def is_stuck(self, state: DynamicState, scale_before: float) -> bool:
        """True when the update that produced ``state`` was an overflow the scale could not answer.

        That is: an overflow while the scale already sat at ``min_scale`` (``scale_before``, the scale
        that iteration ran with, could not back off), or a streak of ``max_consecutive_skips``.
        """
        return stuck_at_bound_or_streak(self, state, scale_before, self.lowest())

    def lowest(self) -> float:
        """The scale the backoff stops at: ``min_scale`` as float32, or 0.0 when None (torch's: no floor)."""
        return 0.0 if self.min_scale is None else f32(self.min_scale)

    def smallest_scale(self) -> float:
        """The smallest scale a state may hold: 0.0 without a floor (``min_scale=None``: torch's backoff
        reaches it), else float32's smallest normal (see :class:`~lossscale.policy.PolicyBase`)."""
        return 0.0 if self.min_scale is None else SMALLEST_SCALE

    def check_state(self, state: DynamicState) -> None:
        """Generic checks, plus: the trackers within this configuration's range."""
        super().check_state(state)
        if not 1 <= state.hysteresis_tracker <= self.hysteresis:
            raise ValueError(
                f"state.hysteresis_tracker={state.hysteresis_tracker} must be in [1, hysteresis={self.hysteresis}]."
            )
        if state.growth_tracker >= self.growth_interval:
            raise ValueError(
                f"state.growth_tracker={state.growth_tracker} must be below growth_interval={self.growth_interval}."
            )
