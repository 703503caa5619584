"""A statistics-driven scale policy: calibrate from the measured gradient amax, grow by measured headroom.

Torch's dynamic rule learns only from overflow: it starts at 2**16, spends one skipped step per halving
when gradients are large, and grows by 2x after 2000 clean steps however far below the overflow line
the gradients sit. :class:`AdaptivePolicy` reads one more number per iteration, the largest scaled
gradient ``amax`` (the scaler computes it on device in a read-only pass: no host sync, one extra read
of the gradients on the non-fused path), and works in binades
(powers of two), so the scale stays exactly a power of two and the rule has no floating-point
rounding to disagree about between host and device.

The rule, as pseudocode (``e`` is the binade of the scaled amax: ``amax < 2**e``, i.e.
``math.frexp(amax)[1]``; ``LIMIT`` is the binade of the target format's max, 16 for FP16 because
65504 is just under 2**16 (``AdaptivePolicy.limit_exp``, from :mod:`lossscale.formats`); ``TOP`` is
``LIMIT - margin_bits``, the binade a measured amax is moved to; ``shift(s, k)`` is ``s * 2**k``
clamped to [min_scale, max_scale])::

    if amax is not finite: found_inf = True             # a non-finite amax is an overflow
    count the step (steps, skipped, inf/NaN, streak)      # shared with every policy
    if bad_loss: stop                                     # a loss non-finite before scaling: counted only
    if not calibrated:                                    # before the first measurable amax
        if found_inf:      scale = shift(scale, -search_bits)     # skipped; search down fast
        elif amax > 0:     scale = shift(scale, TOP - e)          # calibrate: jump there
                           calibrated = True
        elif amax == 0:    scale = shift(scale, +search_bits)     # everything flushed; search up
    elif found_inf:                                       # overflow: skip and back off, as dynamic
        window = NO_AMAX; growth_tracker = 0
        if hysteresis_tracker > 1: hysteresis_tracker -= 1     # tolerated
        else: scale = max(f32(scale * backoff_factor), min_scale)   # spent (the tracker stays at 1)
    else:                                                 # clean step
        if amax > 0: window = max(window, e)              # the window's largest binade
        growth_tracker += 1
        if consecutive_hysteresis: hysteresis_tracker = hysteresis
        if growth_tracker >= growth_interval:             # a full window of clean steps: check
            if window != NO_AMAX and TOP - window > 0:
                scale = shift(scale, TOP - window)        # grow by the measured headroom
            window = NO_AMAX; growth_tracker = 0; hysteresis_tracker = hysteresis

After a move by ``k = TOP - e`` binades the amax that was measured sits below ``2**TOP``: at least
``margin_bits`` binades under the format's overflow line. After
calibration the scale only goes up when a whole window of clean steps proved the room, by as many
binades as the window's largest gradient allows, and only goes down on an overflow.

Why it is safe, and what it measures:

* **amax is a proxy.** Under autocast the parameter gradients the scaler reads are FP32 (FP32 master
  weights); the overflow that matters happens earlier, in the FP16 *activation* gradients flowing
  backward. Those are not seen. The parameter-gradient amax is a proxy for them: on the digits MLP the
  largest activation gradient was at most 0.37 binade (1.3x) above the largest parameter gradient
  (``benchmarks/bench_policies.py`` measures it, see ``docs/policies.md``). The margin covers that gap
  plus the rise of the gradients after the measurement (early in training gradients grow: here up to
  4.2 binades above the first step's); an overflow the margin did not cover is caught as usual (the
  step is skipped, the scale backs off), so the proxy can cost a skipped step, never a corrupt update.
* **Calibration.** The first step runs at ``init_scale``. If its amax is measurable the scale jumps
  straight to its target (up or down): no burn-in of skipped steps. If it overflowed, nothing was
  measured; the scale drops ``search_bits`` binades at once (one skipped step instead of one per
  halving). FP16 resolves some 40 binades between its smallest subnormal and its max, so a drop of 16
  binades from an overflow lands where the amax is measurable (unless the gradients overflowed by more
  than 16 binades: then it drops again). All-zero gradients before calibration
  (everything flushed) move the scale up the same way.
* **All-zero gradients after calibration** carry no information: the scale holds (it never grows on
  zeros, so it cannot run away to ``max_scale`` the way a clean-step counter can).
* **Power of two, bounds, no sync.** Moves are by whole binades (exact), the backoff by
  ``backoff_factor`` (0.5 by default), all clamped to [``min_scale``, ``max_scale``] (float32's
  [2**-126, 2**127] when None). The device form (:meth:`AdaptivePolicy.tensor_update`, below) takes
  every decision with tensor ops, ``frexp`` for the binade, and agrees with this one bitwise.

State (:class:`AdaptiveState`): the shared counters, ``growth_tracker`` (the clean steps of the
window), ``hysteresis_tracker``, ``calibrated``, and ``window_exp``, the window's largest binade
(``NO_AMAX`` while the window has measured nothing).

Example (a training loop drives the state; here by hand)::

    >>> p = AdaptivePolicy(margin_bits=4, growth_interval=2, max_scale=None)
    >>> s = p.init_state()                               # the first step runs at 2**16
    >>> s = p.update(s, found_inf=False, amax=2.0**-10)  # its scaled amax is in binade e = -9
    >>> s.scale == 2.0**16 * 2.0**(16 - 4 + 9)           # calibrated: that amax now sits below 2**12
    True
    >>> s = p.update(p.update(s, found_inf=False, amax=1000.0), found_inf=False, amax=300.0)
    >>> s.scale == 2.0**37 * 2.0**(16 - 4 - 10)          # a window's largest amax, 1000 < 2**10
    True
    >>> s = p.update(s, found_inf=True)                  # overflow: skipped, backed off
    >>> s.scale == 2.0**38, s.skipped_steps
    (True, 1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Tuple

from . import formats
from ._validate import positive_finite, validate_backoff, validate_int, validate_stuck, warn_not_powers_of_two
from .hysteresis import backs_off_tensor, on_clean, on_overflow, track_tensor_
from .policy import (
    BOOL,
    I64,
    MIN_SCALE,
    SIGNED,
    SMALLEST_SCALE,
    PolicyBase,
    ScaleState,
    count,
    count_tensor,
    exact_pow2,
    f32,
    register,
    stuck_at_bound_or_streak,
)

__all__ = ["AdaptivePolicy", "AdaptiveState", "NO_AMAX"]

#: ``AdaptiveState.window_exp`` while the current window has measured no amax. Below the binade of
#: every float32 (>= -148), so ``max(window, e)`` needs no special case.
NO_AMAX = -(2**30)

#: The highest scale when ``max_scale`` is None: float32's largest power of two (the lowest is
#: :data:`~lossscale.policy.SMALLEST_SCALE`, float32's smallest normal).
HIGHEST_SCALE = 2.0**127

#: The pure rule clamps a move to this many binades. No move from a float32 amax comes near it (float32
#: spans 277 binades); it guards ``math.ldexp``, which raises where a caller's float64 amax (down to
#: 2**-1074) would move the scale out of float64's range. The tensor rule's amax is a float32: no clamp.
MAX_SHIFT = 400


def _shift(scale: float, k: int, lo: float, hi: float) -> float:
    """``scale * 2**k`` clamped to [lo, hi], as float32 (exact: only the exponent moves)."""
    k = max(-MAX_SHIFT, min(MAX_SHIFT, k))
    return f32(min(max(math.ldexp(scale, k), lo), hi))


def _binade(amax: float) -> int:
    """The binade of a positive finite amax: the ``e`` with ``2**(e-1) <= amax < 2**e``."""
    return math.frexp(amax)[1]


@dataclass(frozen=True)
class AdaptiveState(ScaleState):
    """:class:`~lossscale.policy.ScaleState` plus the adaptive rule's window.

    Attributes:
        growth_tracker: clean steps in the current window.
        hysteresis_tracker: overflows until the scale backs off, the one that does included (after
            calibration; as :class:`~lossscale.DynamicState`'s, never below 1).
        calibrated: whether a first amax has been measured (before: the scale searches).
        window_exp: the largest binade ``e`` (``amax < 2**e``) of the scaled gradients in the current
            window; ``NO_AMAX`` when the window measured nothing.
    """

    growth_tracker: int = field(default=0, metadata=I64)
    hysteresis_tracker: int = field(default=1, metadata=I64)
    calibrated: bool = field(default=False, metadata=BOOL)
    window_exp: int = field(default=NO_AMAX, metadata=SIGNED)

    @property
    def searching(self) -> bool:
        """Before its first measurement the scale searches (the health account's calibration)."""
        return not self.calibrated


@register
@dataclass(frozen=True)
class AdaptivePolicy(PolicyBase):
    """Loss scaling from measured gradient statistics: calibrate, grow by headroom, back off on overflow.

    The rule is in this module's docstring. Use it with ``lossscale.GradScaler(policy="adaptive")``
    or ``GradScaler(policy=AdaptivePolicy(...))``; the scaler then measures the amax of the scaled
    gradients in the read pass of its inf/NaN check (one extra read of the gradients on the
    non-fused path, no host sync).

    Args:
        init_scale: the scale of the first step, used until calibration. Default 2**16, torch's.
        margin_bits: binades kept between the measured amax and the format's overflow line (int >= 1).
            Default 5: covers the parameter-vs-activation proxy gap and the early rise of the
            gradients measured on the benchmark (see docs/policies.md); each binade of margin costs
            the bottom binade of the gradient distribution.
        growth_interval: clean steps per window; growth is checked at the end of each window from the
            window's largest amax. Default 100.
        search_bits: binades moved per step before calibration, down after an overflow or up after
            all-zero gradients (int in [1, 64]). Default 16.
        backoff_factor: multiplier on overflow after calibration, once hysteresis is spent.
        hysteresis: as in :class:`~lossscale.DynamicPolicy`; a completed window refills the
            tolerance (as a growth does there). Before calibration there is no scale known to be safe,
            so every overflow searches down.
        consecutive_hysteresis: as in :class:`~lossscale.DynamicPolicy`.
        min_scale: the lower bound (None: float32's smallest normal, 2**-126). Default 2**-24 (FP16's
            smallest subnormal), as :class:`~lossscale.DynamicPolicy`: a backward that overflows FP16 at
            every scale >= 1 searches and backs off below 1, as torch's scale would, instead of skipping
            every step at 1.
        max_scale: the upper bound (None: float32's largest power of two, 2**127). Default 2**24, as
            :class:`~lossscale.DynamicPolicy`. Measured growth cannot run away on zero gradients, so
            ``max_scale=None`` is safe here when gradients really live below 2**-40.
        on_stuck: as in :class:`~lossscale.DynamicPolicy`.
        max_consecutive_skips: as in :class:`~lossscale.DynamicPolicy`.
        fmt: the format the scaled gradients must fit (``lossscale.formats`` name, default "fp16"):
            the overflow line is the binade of its largest value (:attr:`limit_exp`).

    ``update`` takes ``amax``: the max |g| over the *scaled* gradients of the iteration, as a float32
    value (None: not measured, nothing learned).
    """

    name = "adaptive"
    state_type = AdaptiveState
    needs_amax = True

    init_scale: float = 2.0**16
    margin_bits: int = 5
    growth_interval: int = 100
    search_bits: int = 16
    backoff_factor: float = 0.5
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    min_scale: Optional[float] = MIN_SCALE
    max_scale: Optional[float] = 2.0**24
    on_stuck: str = "warn"
    max_consecutive_skips: Optional[int] = None
    fmt: str = "fp16"

    def __post_init__(self):
        self._plain_numbers()
        positive_finite("init_scale", self.init_scale)
        validate_int("margin_bits", self.margin_bits, 1, 30)
        validate_int("growth_interval", self.growth_interval, 1)
        validate_int("search_bits", self.search_bits, 1, 64)
        validate_int("hysteresis", self.hysteresis, 1)
        if not isinstance(self.consecutive_hysteresis, bool):
            raise ValueError(f"consecutive_hysteresis={self.consecutive_hysteresis!r} must be a bool.")
        validate_backoff(self.backoff_factor)
        formats.get(self.fmt)  # raises ValueError naming fmt and the valid names
        for name in ("min_scale", "max_scale"):
            v = getattr(self, name)
            if v is not None:
                positive_finite(name, v)
                if not SMALLEST_SCALE <= v <= HIGHEST_SCALE:
                    raise ValueError(f"{name}={v!r} must lie in float32's [2**-126, 2**127].")
        lo, hi = self.bounds()
        if lo > hi:
            raise ValueError(f"min_scale={self.min_scale!r} is above max_scale={self.max_scale!r}; swap them.")
        if not lo <= self.init_scale <= hi:
            raise ValueError(f"init_scale={self.init_scale!r} is outside [min_scale={lo!r}, max_scale={hi!r}].")
        validate_stuck(self.on_stuck, self.max_consecutive_skips)
        warn_not_powers_of_two(self, ("init_scale", "backoff_factor", "min_scale", "max_scale"))

    @property
    def limit_exp(self) -> int:
        """The binade of the format's largest finite value (fp16: 65504 < 2**16, so 16)."""
        return _binade(formats.get(self.fmt).max)

    def bounds(self) -> Tuple[float, float]:
        """(lowest, highest) scale as float32 values; float32's normal range where a bound is None."""
        lo = SMALLEST_SCALE if self.min_scale is None else f32(self.min_scale)
        hi = HIGHEST_SCALE if self.max_scale is None else f32(self.max_scale)
        return lo, hi

    def torch_factors(self):
        """torch's keys: a torch scaler that loads them grows by 2 once per window (it cannot measure)."""
        return {**super().torch_factors(), "growth_factor": 2.0}

    def init_state(self) -> AdaptiveState:
        """The state before the first step (not yet calibrated)."""
        return AdaptiveState(scale=f32(self.init_scale), hysteresis_tracker=self.hysteresis)

    def update(
        self,
        state: AdaptiveState,
        found_inf: bool,
        found_nan: bool = False,
        amax: Optional[float] = None,
        bad_loss: bool = False,
    ) -> AdaptiveState:
        """The next state after one iteration.

        ``found_inf``: any inf or NaN; ``found_nan``: NaN among them; ``amax``: max |g| of the scaled
        gradients (None if not measured). A non-finite ``amax`` counts as an overflow.
        """
        self.check_type(state)
        if amax is not None and not math.isfinite(amax):
            found_inf, found_nan = True, bool(found_nan) or math.isnan(amax)
        if bad_loss:  # non-finite before scaling: nothing to learn, nothing to move
            return count(state, True, found_nan, bad_loss=True)
        counted = count(state, found_inf, found_nan)
        lo, hi = self.bounds()
        top = self.limit_exp - self.margin_bits  # the binade a measured amax is moved to
        scale = state.scale
        measured = amax is not None and not found_inf and amax > 0
        if not state.calibrated:
            if found_inf:
                scale = _shift(scale, -self.search_bits, lo, hi)
            elif measured:
                return counted.replace(
                    scale=_shift(scale, top - _binade(amax), lo, hi), growth_tracker=0, calibrated=True
                )
            elif amax == 0:  # every gradient flushed (or truly zero)
                scale = _shift(scale, self.search_bits, lo, hi)
            return counted.replace(scale=scale, growth_tracker=0)
        if found_inf:
            scale, hyst = on_overflow(scale, state.hysteresis_tracker, self.backoff_factor, lo)
            return counted.replace(scale=scale, growth_tracker=0, hysteresis_tracker=hyst, window_exp=NO_AMAX)
        window = max(state.window_exp, _binade(amax)) if measured else state.window_exp
        growth = state.growth_tracker + 1
        hyst = on_clean(state.hysteresis_tracker, self.hysteresis, self.consecutive_hysteresis)
        if growth >= self.growth_interval:
            k = top - window
            if window != NO_AMAX and k > 0:
                scale = _shift(scale, k, lo, hi)
            growth, window, hyst = 0, NO_AMAX, self.hysteresis
        return counted.replace(scale=scale, growth_tracker=growth, hysteresis_tracker=hyst, window_exp=window)

    def tensor_update(self, t, found_inf, found_nan, bad_loss, amax=None) -> None:
        """:meth:`update` on device tensors, in place, without a host sync.

        Flags as for :meth:`lossscale.DynamicPolicy.tensor_update`, already counting a non-finite
        ``amax`` as an overflow (the scaler's check derives both from the same read). ``amax``: float32
        0-dim tensor, the max |g| of the scaled gradients, or None when not measured. A bad loss is
        neither an overflow the scale answers nor a clean step, so no line below moves anything on one.
        """
        import torch  # here, not at the top: the policies import without torch

        count_tensor(t, found_inf, found_nan, bad_loss)
        overflow, clean = found_inf & ~bad_loss, ~found_inf
        calibrated = t.calibrated > 0
        if amax is None:  # nothing measured: only the overflows teach anything
            amax = torch.zeros((), dtype=torch.float32, device=t.scale.device)
            measured = zero = torch.zeros_like(clean)
        else:
            measured, zero = clean & (amax > 0), clean & (amax == 0)
        e = torch.frexp(amax)[1]  # amax < 2**e; read only where measured
        top = self.limit_exp - self.margin_bits  # the binade a measured amax is moved to
        # update()'s branches end in one multiply: scale *= backoff_factor (a calibrated overflow with
        # the tolerance spent), else 2**move, then the clamp to the bounds; the trackers move in place.
        # After calibration: the window's largest binade, and its end after growth_interval clean steps.
        window_step = clean & calibrated
        window = torch.maximum(t.window_exp, e)
        torch.where(measured & calibrated, window, t.window_exp, out=t.window_exp)
        t.growth_tracker.add_(window_step)  # stays 0 before calibration (check_state holds states to it)
        window_end = t.growth_tracker >= self.growth_interval
        k = top - t.window_exp
        grow = window_end & (k > 0) & (t.window_exp != NO_AMAX)
        # The binades the scale moves by. Before calibration: down on an overflow, to the target on a
        # measurement, up on all-zero gradients. After: by the headroom at a window's end, else 0.
        # +search_bits, -search_bits or 0 (torch has no bool "-", but adds a bool with a negative weight)
        search = torch.add(zero * self.search_bits, overflow, alpha=-self.search_bits)
        # int64 (k's dtype), as exact_pow2 needs.
        move = torch.where(calibrated, k * grow, torch.where(measured, top - e, search))
        # After calibration an overflow backs off instead, as the dynamic policy's (hysteresis.py).
        answered = overflow & calibrated
        back_off = backs_off_tensor(t.hysteresis_tracker, answered)
        factor = torch.where(back_off, self.backoff_factor, exact_pow2(move))
        torch.mul(t.scale, factor, out=t.scale)  # in float64, rounded once to float32
        t.scale.clamp_(*self.bounds())
        track_tensor_(
            t.hysteresis_tracker, answered, window_step if self.consecutive_hysteresis else window_end, self.hysteresis
        )
        reset = overflow | window_end
        t.growth_tracker.masked_fill_(reset, 0)
        t.window_exp.masked_fill_(reset, NO_AMAX)
        t.calibrated.bitwise_or_(measured)

    def is_stuck(self, state: AdaptiveState, scale_before: float) -> bool:
        """True when the update that produced ``state`` was an overflow the scale could not answer.

        An overflow while the scale already sat at its lower bound, or a streak of
        ``max_consecutive_skips``.
        """
        return stuck_at_bound_or_streak(self, state, scale_before, self.bounds()[0])

    def scale_bounds(self):
        """(lowest, highest) scale: float32's normal range where a bound is None."""
        return self.bounds()

    def check_state(self, state: AdaptiveState) -> None:
        """Generic checks, plus the window's invariants."""
        super().check_state(state)
        if not 1 <= state.hysteresis_tracker <= self.hysteresis:
            raise ValueError(
                f"state.hysteresis_tracker={state.hysteresis_tracker} must be in [1, hysteresis={self.hysteresis}]."
            )
        if state.growth_tracker >= self.growth_interval:
            raise ValueError(
                f"state.growth_tracker={state.growth_tracker} must be below growth_interval={self.growth_interval}."
            )
        if state.window_exp != NO_AMAX and not (state.calibrated and -160 <= state.window_exp <= 140):
            raise ValueError(
                f"state.window_exp={state.window_exp} must be NO_AMAX ({NO_AMAX}) or a float32 binade "
                "of a calibrated policy."
            )
        if not state.calibrated and state.growth_tracker != 0:
            raise ValueError(
                f"state.growth_tracker={state.growth_tracker} must be 0 before calibration (every "
                "uncalibrated step resets it)."
            )
