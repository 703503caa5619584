"""Pure loss-scale policies: frozen configs, immutable state, one update rule each.

This module imports no torch. A policy is a frozen dataclass (its configuration) with two pure
functions in jmp's shape::

    state = policy.init_state()
    state = policy.update(state, found_inf=..., found_nan=...)

so every rule can be tested with plain Python values, and the torch adapter
(:class:`lossscale.GradScaler`) runs the *same* rule on device tensors (``_device_rules.py``; a test
drives both forms with the same random sequences and asserts they agree bitwise).

The dynamic rule, as pseudocode (``found_inf`` means "some gradient was inf or NaN", torch's naming)::

    steps += 1
    if found_inf:                                   # overflow: the optimizer step is skipped
        skipped += 1; streak += 1
        inf_steps += not found_nan; nan_steps += found_nan
        growth_tracker = 0
        hysteresis_tracker = max(hysteresis_tracker - 1, 0)
        if hysteresis_tracker == 0:                 # tolerance spent: back off
            scale = max(f32(scale * backoff_factor), min_scale)
    else:                                           # clean step
        streak = 0
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
(``torch._amp_update_scale_``), including its float32 rounding of the scale. With ``hysteresis > 1``
and ``consecutive_hysteresis=False`` it is Megatron-core's ``DynamicGradScaler``: once the tolerance is
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

import dataclasses
import math
import struct
import warnings
from dataclasses import dataclass
from typing import Optional, Union

__all__ = [
    "ScaleState",
    "DynamicPolicy",
    "StaticPolicy",
    "Policy",
    "is_power_of_two",
    "diagnose",
    "STUCK_REACTIONS",
    "NO_AMAX",
]

STUCK_REACTIONS = ("raise", "warn", "ignore")

#: ``ScaleState.amax_exp`` when no gradient amax has been measured; policies that do not measure the
#: amax (dynamic, static) keep it. Below the binade of every float32 (>= -148).
NO_AMAX = -(2**30)


def _f32(x: float) -> float:
    """Round a Python float to the nearest float32, as the device scale tensor stores it.

    Why: torch keeps the scale in a float32 tensor and multiplies in double before storing
    (``static_cast<float>(scale * growth_factor)``); mirroring that rounding keeps the pure rule
    bitwise equal to the device one for any factor, not only powers of two.
    """
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # beyond float32's range: the cast gives inf, as on device
        return math.copysign(math.inf, x)


def is_power_of_two(x: float) -> bool:
    """True when ``x`` is a positive, finite power of two (2**k for any integer k, negative included)."""
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0 and math.frexp(x)[0] == 0.5


@dataclass(frozen=True)
class ScaleState:
    """Immutable state of a scale policy. Counters are Python ints: they never wrap.

    Attributes:
        scale: the current loss scale (a float32 value).
        growth_tracker: consecutive clean steps since the last growth or overflow (torch's
            ``_growth_tracker``).
        hysteresis_tracker: overflows still tolerated before the scale backs off (Megatron/DeepSpeed).
        steps: iterations seen by ``update`` (skipped ones included).
        skipped_steps: iterations whose optimizer step was skipped because of inf/NaN gradients.
        inf_steps: skipped iterations whose gradients held inf but no NaN.
        nan_steps: skipped iterations whose gradients held NaN (a NaN dominates an inf).
        overflow_streak: consecutive skipped iterations up to now (0 after a clean step).
        streak_nan_steps: how many of the current streak held NaN.
        streak_start_scale: the scale when the current streak began (for the diagnosis).
        amax_exp: for policies that measure the gradient amax (:class:`lossscale.adaptive.AdaptivePolicy`):
            the largest binade ``e`` (``amax < 2**e``) of the scaled gradients in the current growth
            window; ``NO_AMAX`` when nothing was measured (always, for the other policies).
    """

    scale: float
    growth_tracker: int = 0
    hysteresis_tracker: int = 1
    steps: int = 0
    skipped_steps: int = 0
    inf_steps: int = 0
    nan_steps: int = 0
    overflow_streak: int = 0
    streak_nan_steps: int = 0
    streak_start_scale: float = 0.0
    amax_exp: int = NO_AMAX

    def replace(self, **changes) -> "ScaleState":
        """A copy with ``changes`` applied (the state itself is frozen)."""
        return dataclasses.replace(self, **changes)


def _count(state: ScaleState, found_inf: bool, found_nan: bool) -> ScaleState:
    """The bookkeeping every policy shares: step, skip, inf/NaN and streak counters."""
    if not found_inf:
        return state.replace(steps=state.steps + 1, overflow_streak=0, streak_nan_steps=0)
    return state.replace(
        steps=state.steps + 1,
        skipped_steps=state.skipped_steps + 1,
        inf_steps=state.inf_steps + (not found_nan),
        nan_steps=state.nan_steps + bool(found_nan),
        overflow_streak=state.overflow_streak + 1,
        streak_nan_steps=state.streak_nan_steps + bool(found_nan),
        streak_start_scale=state.scale if state.overflow_streak == 0 else state.streak_start_scale,
    )


def _check_flags(found_inf, found_nan) -> None:
    if found_nan and not found_inf:
        raise ValueError(
            "found_nan=True with found_inf=False: found_inf means 'any inf or NaN', so a NaN step "
            "must pass found_inf=True as well."
        )


def _validate_stuck(on_stuck: str, max_consecutive_skips: Optional[int]) -> None:
    if on_stuck not in STUCK_REACTIONS:
        raise ValueError(f"on_stuck={on_stuck!r} is not one of {STUCK_REACTIONS}.")
    if max_consecutive_skips is not None and (
        isinstance(max_consecutive_skips, bool)
        or not isinstance(max_consecutive_skips, int)
        or max_consecutive_skips < 1
    ):
        raise ValueError(
            f"max_consecutive_skips={max_consecutive_skips!r} must be a positive int, or None to "
            "react only at the minimum scale."
        )


def _validate_backoff(value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 < value < 1.0):
        raise ValueError(f"backoff_factor={value!r} must be in (0, 1) (e.g. 0.5).")


def _warn_not_powers_of_two(policy, names) -> None:
    """Warn (once per config) about the ``names`` of ``policy`` that are not powers of two, and why."""
    bad = [f"{n}={getattr(policy, n)!r}" for n in names
           if getattr(policy, n) is not None and not is_power_of_two(getattr(policy, n))]
    if bad:
        warnings.warn(
            "lossscale: " + ", ".join(bad) + " is not a power of two, so the loss scale can leave the "
            "powers of two. Multiplying by a power of two only shifts the exponent and is exact; any "
            "other scale rounds every gradient when it is scaled and again when unscaled.",
            UserWarning,
            stacklevel=4,  # the user's constructor call: helper <- __post_init__ <- __init__ <- user
        )


def _positive_finite(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite number > 0.")


@dataclass(frozen=True)
class DynamicPolicy:
    """Dynamic loss scaling: back off on overflow (with optional hysteresis), grow after clean streaks.

    Args:
        init_scale: first scale. Default 2**16, torch's.
        growth_factor: multiplier after ``growth_interval`` clean steps; must be > 1.
        backoff_factor: multiplier on overflow once hysteresis is spent; must be in (0, 1).
        growth_interval: consecutive clean steps before a growth; int >= 1.
        hysteresis: overflows tolerated before backing off (1 = back off on every overflow, torch).
        consecutive_hysteresis: refill the hysteresis on every clean step, so only *consecutive*
            overflows spend it (DeepSpeed); otherwise only a growth refills it (Megatron-core).
        min_scale: lower bound of the scale, or None for none. Default 1.0: a scale below 1 shrinks
            gradients instead of protecting them, so reaching it means the overflow is not the
            scale's doing (torch documents the same symptom but does not stop there).
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

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    min_scale: Optional[float] = 1.0
    max_scale: Optional[float] = 2.0**24
    on_stuck: str = "warn"
    max_consecutive_skips: Optional[int] = None

    def __post_init__(self):
        _positive_finite("init_scale", self.init_scale)
        if not isinstance(self.growth_factor, (int, float)) or not (
            math.isfinite(self.growth_factor) and self.growth_factor > 1.0
        ):
            raise ValueError(f"growth_factor={self.growth_factor!r} must be a finite number > 1.0 (e.g. 2.0).")
        _validate_backoff(self.backoff_factor)
        for name in ("growth_interval", "hysteresis"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1.")
        for name in ("min_scale", "max_scale"):
            v = getattr(self, name)
            if v is not None:
                _positive_finite(name, v)
        if self.min_scale is not None and self.max_scale is not None and self.min_scale > self.max_scale:
            raise ValueError(f"min_scale={self.min_scale!r} is above max_scale={self.max_scale!r}; swap them.")
        if self.min_scale is not None and self.init_scale < self.min_scale:
            raise ValueError(f"init_scale={self.init_scale!r} is below min_scale={self.min_scale!r}.")
        if self.max_scale is not None and self.init_scale > self.max_scale:
            raise ValueError(
                f"init_scale={self.init_scale!r} is above max_scale={self.max_scale!r}; raise max_scale "
                "or pass max_scale=None."
            )
        _validate_stuck(self.on_stuck, self.max_consecutive_skips)
        _warn_not_powers_of_two(self, ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"))

    @property
    def torch_compatible(self) -> bool:
        """True when this rule is exactly ``torch.amp.GradScaler``'s (hysteresis 1, no bounds)."""
        return self.hysteresis == 1 and self.min_scale is None and self.max_scale is None

    def init_state(self) -> ScaleState:
        """The state before the first step."""
        return ScaleState(scale=_f32(self.init_scale), hysteresis_tracker=self.hysteresis)

    def update(self, state: ScaleState, found_inf: bool, found_nan: bool = False) -> ScaleState:
        """The next state after one iteration. ``found_inf``: any inf or NaN; ``found_nan``: NaN among them."""
        _check_flags(found_inf, found_nan)
        counted = _count(state, found_inf, found_nan)
        if found_inf:
            hyst = max(state.hysteresis_tracker - 1, 0)
            scale = state.scale
            if hyst == 0:
                scale = _f32(scale * self.backoff_factor)
                if self.min_scale is not None:
                    scale = max(scale, _f32(self.min_scale))
            return counted.replace(scale=scale, growth_tracker=0, hysteresis_tracker=hyst)
        growth = state.growth_tracker + 1
        hyst = self.hysteresis if self.consecutive_hysteresis else state.hysteresis_tracker
        scale = state.scale
        if growth >= self.growth_interval:
            grown = _f32(scale * self.growth_factor)
            if math.isfinite(grown):
                scale = grown if self.max_scale is None else min(grown, _f32(self.max_scale))
            growth, hyst = 0, self.hysteresis
        return counted.replace(scale=scale, growth_tracker=growth, hysteresis_tracker=hyst)

    def is_stuck(self, state: ScaleState, scale_before: float) -> bool:
        """True when the update that produced ``state`` was an overflow the scale could not answer.

        That is: an overflow while the scale already sat at ``min_scale`` (``scale_before``, the scale
        that iteration ran with, could not back off), or a streak of ``max_consecutive_skips``.
        """
        if state.overflow_streak == 0:
            return False
        at_min = self.min_scale is not None and scale_before <= _f32(self.min_scale)
        too_long = self.max_consecutive_skips is not None and state.overflow_streak >= self.max_consecutive_skips
        return at_min or too_long


@dataclass(frozen=True)
class StaticPolicy:
    """A fixed loss scale. Non-finite steps are still skipped and counted.

    ``StaticPolicy(scale=1.0)`` is the pass-through for bf16 or fp32 training, which needs no scaling
    but still wants a non-finite step skipped rather than written into the weights.

    Args:
        scale: the loss scale (a power of two keeps scaling exact; others are warned about).
        on_stuck, max_consecutive_skips: as in :class:`DynamicPolicy`; a static scale cannot back
            off, so every overflow is "at the minimum" when ``max_consecutive_skips`` is None.
    """

    scale: float = 2.0**16
    on_stuck: str = "warn"
    max_consecutive_skips: Optional[int] = None

    def __post_init__(self):
        _positive_finite("scale", self.scale)
        _validate_stuck(self.on_stuck, self.max_consecutive_skips)
        if not is_power_of_two(self.scale):
            warnings.warn(
                f"lossscale: static scale={self.scale!r} is not a power of two; multiplying by a power of "
                "two only shifts the exponent and is exact, any other scale rounds every gradient.",
                UserWarning,
                stacklevel=3,
            )

    torch_compatible = False
    init_scale = property(lambda self: self.scale)

    def init_state(self) -> ScaleState:
        """The state before the first step."""
        return ScaleState(scale=_f32(self.scale), hysteresis_tracker=1)

    def update(self, state: ScaleState, found_inf: bool, found_nan: bool = False) -> ScaleState:
        """Counts the step; the scale never changes."""
        _check_flags(found_inf, found_nan)
        return _count(state, found_inf, found_nan).replace(
            growth_tracker=0 if found_inf else state.growth_tracker + 1
        )

    def is_stuck(self, state: ScaleState, scale_before: float) -> bool:
        """True after an overflow (when no streak limit is set) or a streak of ``max_consecutive_skips``."""
        if state.overflow_streak == 0:
            return False
        if self.max_consecutive_skips is None:
            return True
        return state.overflow_streak >= self.max_consecutive_skips


Policy = Union[DynamicPolicy, StaticPolicy]


def diagnose(policy: Policy, state: ScaleState) -> str:
    """A plain-language diagnosis of a stuck run, from the counters alone (no tensors needed)."""
    streak, nan = state.overflow_streak, state.streak_nan_steps
    lines = [
        f"lossscale: {streak} consecutive skipped step(s) ({nan} with NaN, {streak - nan} with inf only); "
        f"the scale went from {state.streak_start_scale:g} to {state.scale:g}"
        + (f" (min_scale={policy.min_scale:g})." if getattr(policy, "min_scale", None) is not None else ".")
    ]
    if nan and streak > 1 and state.streak_start_scale != state.scale:
        lines.append(
            f"NaN persisted while the scale fell {state.streak_start_scale / state.scale:g}x: the scale is "
            "not the cause (a smaller scale cures inf, never NaN). NaN comes from the model or data: 0/0, "
            "log or sqrt of a negative or zero, inf - inf (e.g. an overflowed fp16 activation), NaN "
            "already in the weights or inputs, or a learning rate that diverged. Find it with "
            "torch.autograd.set_detect_anomaly(True)."
        )
    elif nan:
        lines.append(
            "NaN at the smallest scale the policy allows: lowering the scale cannot cure a NaN. Look for "
            "0/0, log or sqrt of a negative or zero, inf - inf (an overflowed fp16 activation), or NaN "
            "already in the weights or inputs (torch.autograd.set_detect_anomaly(True) finds the op)."
        )
    else:
        lines.append(
            "Gradients overflow even at the smallest scale allowed: the overflow is in the fp16 "
            "forward/backward itself (an activation or gradient above 65504), not in the scaling. Fixes: "
            "keep that layer in fp32 (autocast(enabled=False) around it, or a softmax/norm in fp32), "
            "lower the learning rate or clip gradients, check the inputs for extreme values, or train in "
            "bf16 (GradScaler.passthrough()). If the overflows are rare and isolated, lower min_scale."
        )
    lines.append("scaler.overflow_report() names the parameters that held inf and NaN on the last skipped step.")
    return "\n".join(lines)
