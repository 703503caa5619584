"""A statistics-driven scale policy: calibrate from the measured gradient amax, grow by measured headroom.

Torch's dynamic rule learns only from overflow: it starts at 2**16, spends one skipped step per halving
when gradients are large, and grows by 2x after 2000 clean steps however far below the overflow line
the gradients sit. :class:`AdaptivePolicy` reads one more number per iteration, the largest scaled
gradient ``amax`` (the scaler computes it on device in a read-only pass: no host sync, one extra read
of the gradients on the non-fused path), and works in binades
(powers of two), so the scale stays exactly a power of two and the rule has no floating-point
rounding to disagree about between host and device.

The rule, as pseudocode (``e`` is the binade of the scaled amax: ``amax < 2**e``, i.e.
``math.frexp(amax)[1]``; ``LIMIT = 16`` because FP16's max 65504 is just under 2**16; ``shift(s, k)``
is ``s * 2**k`` clamped to [min_scale, max_scale])::

    if amax is not finite: found_inf = True             # a non-finite amax is an overflow
    count the step (steps, skipped, inf/NaN, streak)      # shared with every policy
    if not calibrated:                                    # before the first measurable amax
        if found_inf:      scale = shift(scale, -search_bits)     # skipped; search down fast
        elif amax == 0:    scale = shift(scale, +search_bits)     # everything flushed; search up
        elif amax > 0:     scale = shift(scale, LIMIT - margin_bits - e)    # calibrate: jump there
                           calibrated = True; window = EMPTY
    elif found_inf:                                       # overflow: skip and back off, as dynamic
        window = EMPTY; growth_tracker = 0
        hysteresis_tracker = max(hysteresis_tracker - 1, 0)
        if hysteresis_tracker == 0: scale = max(scale * backoff_factor, min_scale)
    else:                                                 # clean step
        if amax > 0: window = max(window, e)              # the window's largest binade
        growth_tracker += 1
        if consecutive_hysteresis: hysteresis_tracker = hysteresis
        if growth_tracker >= growth_interval:             # a full window of clean steps: check
            if window != EMPTY and LIMIT - margin_bits - window > 0:
                scale = shift(scale, LIMIT - margin_bits - window)    # grow by the measured headroom
            window = EMPTY; growth_tracker = 0; hysteresis_tracker = hysteresis

After a move by ``k = LIMIT - margin_bits - e`` binades the amax that was measured sits below
``2**(16 - margin_bits)``: at least ``margin_bits`` binades under the FP16 overflow line. After
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
  [2**-126, 2**127] when None). The device form (``lossscale._device_rules.adaptive_update_``) takes
  every decision with tensor ops, ``frexp`` for the binade, and agrees with this one bitwise.

State: the policy reuses :class:`~lossscale.policy.ScaleState`. ``amax_exp`` holds the window's
largest binade (``NO_AMAX`` when the window measured nothing, ``CALIBRATING`` before the first
measurement); ``growth_tracker`` counts the clean steps of the window.

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
from dataclasses import dataclass
from typing import Optional, Tuple

from . import _policy_registry
from .policy import (
    NO_AMAX,
    ScaleState,
    _check_flags,
    _count,
    _f32,
    _positive_finite,
    _validate_backoff,
    _validate_stuck,
    _warn_not_powers_of_two,
)

__all__ = ["AdaptivePolicy", "CALIBRATING", "LIMIT_EXP"]

#: FP16's largest finite value, 65504, is just under 2**16 (FP8 e5m2's 57344 too): a scaled amax
#: below 2**(LIMIT_EXP - margin_bits) is at least ``margin_bits`` binades under overflow.
LIMIT_EXP = 16

#: ``ScaleState.amax_exp`` before the first measurable amax (below NO_AMAX and every real exponent).
CALIBRATING = NO_AMAX - 1

#: Bounds of the scale when ``min_scale`` / ``max_scale`` is None: float32's normal powers of two.
LOWEST_SCALE, HIGHEST_SCALE = 2.0**-126, 2.0**127

#: Any single move is clamped to this many binades: far beyond any real one (float32 spans 277), and it
#: keeps ``scale * 2**k`` finite and normal in float64, where both forms compute it.
MAX_SHIFT = 400

_GRADSCALER_DEFAULT_INTERVAL = 2000  # GradScaler's growth_interval default (torch's)


def _shift(scale: float, k: int, lo: float, hi: float) -> float:
    """``scale * 2**k`` clamped to [lo, hi], as float32 (exact: only the exponent moves)."""
    k = max(-MAX_SHIFT, min(MAX_SHIFT, k))
    return _f32(min(max(math.ldexp(scale, k), lo), hi))


def _binade(amax: float) -> int:
    """The binade of a positive finite amax: the ``e`` with ``2**(e-1) <= amax < 2**e``."""
    return math.frexp(amax)[1]


@dataclass(frozen=True)
class AdaptivePolicy:
    """Loss scaling from measured gradient statistics: calibrate, grow by headroom, back off on overflow.

    The rule is in this module's docstring. Use it with ``lossscale.GradScaler(policy="adaptive")``
    or ``GradScaler(policy=AdaptivePolicy(...))``; the scaler then measures the amax of the scaled
    gradients in the read pass of its inf/NaN check (one extra read of the gradients on the
    non-fused path, no host sync).

    Args:
        init_scale: the scale of the first step, used until calibration. Default 2**16, torch's.
        margin_bits: binades kept between the measured amax and FP16's overflow line (int >= 1).
            Default 5: covers the parameter-vs-activation proxy gap and the early rise of the
            gradients measured on the benchmark (see docs/policies.md); each binade of margin costs
            the bottom binade of the gradient distribution.
        growth_interval: clean steps per window; growth is checked at the end of each window from the
            window's largest amax. Default 100.
        search_bits: binades moved per step before calibration, down after an overflow or up after
            all-zero gradients (int in [1, 64]). Default 16.
        backoff_factor: multiplier on overflow after calibration, once hysteresis is spent.
        hysteresis, consecutive_hysteresis: as in :class:`~lossscale.DynamicPolicy`; a completed
            window refills the tolerance (as a growth does there). Before calibration there is no
            scale known to be safe, so every overflow searches down.
        min_scale, max_scale: bounds (None: float32's [2**-126, 2**127]). Defaults 1.0 and 2**24, as
            :class:`~lossscale.DynamicPolicy`. Measured growth cannot run away on zero gradients, so
            ``max_scale=None`` is safe here when gradients really live below 2**-40.
        on_stuck, max_consecutive_skips: as in :class:`~lossscale.DynamicPolicy`.

    ``update`` takes ``amax``: the max |g| over the *scaled* gradients of the iteration, as a float32
    value (None: not measured, nothing learned).
    """

    init_scale: float = 2.0**16
    margin_bits: int = 5
    growth_interval: int = 100
    search_bits: int = 16
    backoff_factor: float = 0.5
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    min_scale: Optional[float] = 1.0
    max_scale: Optional[float] = 2.0**24
    on_stuck: str = "warn"
    max_consecutive_skips: Optional[int] = None

    torch_compatible = False
    #: The scaler computes the amax of the scaled gradients for policies that set this. Across ranks it
    #: passes the MAX of the ranks' finite amax (an inf/NaN one is sent as 0 in the flags' collective),
    #: so a policy that sets it must ignore ``amax`` when ``found_inf`` (this one does, in both forms).
    needs_amax = True

    def __post_init__(self):
        _positive_finite("init_scale", self.init_scale)
        for name, lo, hi in (("margin_bits", 1, 30), ("growth_interval", 1, None), ("search_bits", 1, 64),
                             ("hysteresis", 1, None)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
                raise ValueError(f"{name}={v!r} must be an int in [{lo}, {hi if hi is not None else 'inf'}].")
        _validate_backoff(self.backoff_factor)
        for name in ("min_scale", "max_scale"):
            v = getattr(self, name)
            if v is not None:
                _positive_finite(name, v)
                if not LOWEST_SCALE <= v <= HIGHEST_SCALE:
                    raise ValueError(f"{name}={v!r} must lie in float32's [2**-126, 2**127].")
        lo, hi = self.bounds()
        if lo > hi:
            raise ValueError(f"min_scale={self.min_scale!r} is above max_scale={self.max_scale!r}; swap them.")
        if not lo <= self.init_scale <= hi:
            raise ValueError(f"init_scale={self.init_scale!r} is outside [min_scale={lo!r}, max_scale={hi!r}].")
        _validate_stuck(self.on_stuck, self.max_consecutive_skips)
        _warn_not_powers_of_two(self, ("init_scale", "backoff_factor", "min_scale", "max_scale"))

    def bounds(self) -> Tuple[float, float]:
        """(lowest, highest) scale as float32 values; float32's normal range where a bound is None."""
        lo = LOWEST_SCALE if self.min_scale is None else _f32(self.min_scale)
        hi = HIGHEST_SCALE if self.max_scale is None else _f32(self.max_scale)
        return lo, hi

    def init_state(self) -> ScaleState:
        """The state before the first step (not yet calibrated)."""
        return ScaleState(scale=_f32(self.init_scale), hysteresis_tracker=self.hysteresis, amax_exp=CALIBRATING)

    def update(self, state: ScaleState, found_inf: bool, found_nan: bool = False,
               amax: Optional[float] = None) -> ScaleState:
        """The next state after one iteration.

        ``found_inf``: any inf or NaN; ``found_nan``: NaN among them; ``amax``: max |g| of the scaled
        gradients (None if not measured). A non-finite ``amax`` counts as an overflow.
        """
        if amax is not None and not math.isfinite(amax):
            found_inf, found_nan = True, bool(found_nan) or math.isnan(amax)
        _check_flags(found_inf, found_nan)
        counted = _count(state, found_inf, found_nan)
        lo, hi = self.bounds()
        scale = state.scale
        measured = amax is not None and not found_inf and amax > 0
        if state.amax_exp == CALIBRATING:
            if found_inf:
                scale = _shift(scale, -self.search_bits, lo, hi)
            elif measured:
                return counted.replace(scale=_shift(scale, LIMIT_EXP - self.margin_bits - _binade(amax), lo, hi),
                                       growth_tracker=0, amax_exp=NO_AMAX)
            elif amax == 0:  # every gradient flushed (or truly zero)
                scale = _shift(scale, self.search_bits, lo, hi)
            return counted.replace(scale=scale, growth_tracker=0)
        if found_inf:
            hyst = max(state.hysteresis_tracker - 1, 0)
            if hyst == 0:
                scale = max(_f32(scale * self.backoff_factor), lo)
            return counted.replace(scale=scale, growth_tracker=0, hysteresis_tracker=hyst, amax_exp=NO_AMAX)
        window = max(state.amax_exp, _binade(amax)) if measured else state.amax_exp
        growth = state.growth_tracker + 1
        hyst = self.hysteresis if self.consecutive_hysteresis else state.hysteresis_tracker
        if growth >= self.growth_interval:
            k = LIMIT_EXP - self.margin_bits - window
            if window != NO_AMAX and k > 0:
                scale = _shift(scale, k, lo, hi)
            growth, window, hyst = 0, NO_AMAX, self.hysteresis
        return counted.replace(scale=scale, growth_tracker=growth, hysteresis_tracker=hyst, amax_exp=window)

    def is_stuck(self, state: ScaleState, scale_before: float) -> bool:
        """True when the update that produced ``state`` was an overflow the scale could not answer.

        An overflow while the scale already sat at its lower bound, or a streak of
        ``max_consecutive_skips``.
        """
        if state.overflow_streak == 0:
            return False
        at_min = scale_before <= self.bounds()[0]
        too_long = self.max_consecutive_skips is not None and state.overflow_streak >= self.max_consecutive_skips
        return at_min or too_long


def _from_gradscaler_kwargs(*, init_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
                            consecutive_hysteresis, min_scale, max_scale, on_stuck, max_consecutive_skips):
    """``GradScaler(policy="adaptive", ...)``: the scale keywords mapped onto :class:`AdaptivePolicy`.

    ``growth_factor`` does not apply (growth is by measured headroom) and must stay at 2.0;
    ``growth_interval`` sets the window when given, and its GradScaler default (2000, torch's) means
    the adaptive default window.
    """
    if growth_factor != 2.0:
        raise ValueError(
            f"growth_factor={growth_factor!r} does not apply to policy='adaptive': it grows by as many "
            "binades as the measured headroom allows. Leave growth_factor at its default."
        )
    extra = {} if growth_interval == _GRADSCALER_DEFAULT_INTERVAL else {"growth_interval": growth_interval}
    return AdaptivePolicy(init_scale=init_scale, backoff_factor=backoff_factor, hysteresis=hysteresis,
                          consecutive_hysteresis=consecutive_hysteresis, min_scale=min_scale, max_scale=max_scale,
                          on_stuck=on_stuck, max_consecutive_skips=max_consecutive_skips, **extra)


_policy_registry.register("adaptive", _from_gradscaler_kwargs, AdaptivePolicy)
