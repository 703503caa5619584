"""LogMax: OpenSeq2Seq's automatic loss scaler, a scale set every step from the statistics of log2(amax).

Source: NVIDIA/OpenSeq2Seq, ``open_seq2seq/optimizers/automatic_loss_scaler.py``, class
``LogMaxScaler`` (TensorFlow, 2018). It keeps exponential moving averages of ``x = log2(amax)`` of the
*unscaled* gradients and puts the scale where an overflow is ``overflow_std_dev`` standard deviations
away. The rule (``x`` from the scaled amax the scaler measures: ``log2(amax) - log2(scale)``)::

    count the step (steps, skipped, inf/NaN, streak)           # policy.count, shared by every policy
    if bad_loss or (amax is None and not found_inf): stop     # counted; nothing to learn from
    if found_inf:     x = LIMIT - log2(scale)        # deviation 1: the overflow says amax >~ 2**LIMIT / S
    elif amax == 0:   x = FLUSH - log2(scale)        # deviation 2: everything flushed, amax <~ 2**FLUSH / S
    else:             x = q(log2(amax)) - log2(scale)
    x_hat   = beta1 * x_hat + (1 - beta1) * x;      b1 = b1 * beta1;    mu = x_hat / (1 - b1)
    slow    = beta2 * slow + (1 - beta2) * x;       xsq = beta2 * xsq + (1 - beta2) * (x * x)
    b2      = b2 * beta2;  e_xsq = xsq / (1 - b2);  slow_mu = slow / (1 - b2)
    sigma   = sqrt(max(e_xsq - slow_mu * slow_mu, 0))
    scale   = 2 ** clamp(floor(LIMIT - (mu + overflow_std_dev * sigma)), log2(min_scale), log2(max_scale))

``LIMIT`` is the binade of the format's max (16 for fp16, the source's hard-coded 16) and ``FLUSH``
the log2 of its smallest subnormal (-24 for fp16).

Where this differs from the published scaler, and why:

* **Powers of two** (deviation 3): the source sets ``2 ** (16 - cutoff)``, not a power of two, so
  every gradient is rounded twice; here the exponent is floored (at most one binade lower). It also
  makes ``log2(scale)`` exact, which the rule needs to unscale the measured amax.
* **Overflow** (deviation 1): the source feeds ``x = 2 ** 16 = 65536`` (``tf.pow(2., log_max)``) into
  the averages, which pins the scale at ``min_scale`` for thousands of steps after one overflow. Here
  it feeds the binade the overflow proves the true amax reached, so the scale drops a few binades.
* **All-zero gradients** (deviation 2): ``log2(0) = -inf`` would turn the averages into NaN; the
  flush threshold at this scale is fed instead, an upper bound of the true amax.
* **q()** quantises ``log2(amax)`` down to a multiple of 2**-16 binade. ``log2`` is the one
  transcendental step, and libm, Sleef and CUDA may round it one ulp apart; on a 2**-16 grid the
  host and device forms agree unless ``log2(amax)`` lies within an ulp (2**-46 binade) of a grid
  point. Everything else is float64 arithmetic in the same order on both sides (IEEE: bitwise).

The scale may move on every step, so the state has no growth tracker: ``torch_state`` writes torch's
defaults, which a torch scaler loading this checkpoint then follows.

Example::

    >>> p = LogMaxPolicy()
    >>> s = p.update(p.init_state(), found_inf=False, amax=2.0**-10)   # at scale 1: x = -10
    >>> s.scale == 2.0**24                       # 16 - (-10) = 26 binades of room, clamped to max_scale
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from . import formats
from ._validate import validate_stuck
from .policy import (
    F64,
    PolicyBase,
    ScaleState,
    count,
    count_tensor,
    exact_pow2,
    f32,
    is_power_of_two,
    register,
    stuck_at_bound_or_streak,
)

__all__ = ["LogMaxPolicy", "LogMaxState"]

#: ``log2(amax)`` is rounded down to a multiple of 1/GRID binade (see the module doc, q()).
GRID = 2.0**16

#: A bound on |x| (float32 binades span [-149, 128], the scale's [-126, 127]): checkpoint validation.
X_BOUND = 1024.0


@dataclass(frozen=True)
class LogMaxState(ScaleState):
    """:class:`~lossscale.policy.ScaleState` plus the source's TF variables (float64 on device)."""

    x_hat: float = field(default=0.0, metadata=F64)
    slow_x_hat: float = field(default=0.0, metadata=F64)
    xsquared_hat: float = field(default=0.0, metadata=F64)
    b1_correction: float = field(default=1.0, metadata=F64)
    b2_correction: float = field(default=1.0, metadata=F64)


@register
@dataclass(frozen=True)
class LogMaxPolicy(PolicyBase):
    """OpenSeq2Seq's LogMax scaler with its defaults, kept to powers of two (see the module doc).

    Args:
        init_scale: the first step's scale (the source starts at 1). A power of two.
        beta1: the EMA rate of ``mu`` (0.99).
        beta2: the EMA rate of the variance (0.999).
        overflow_std_dev: how many standard deviations of ``log2(amax)`` to keep below the overflow
            line (3.09, the source's: about a 1-in-1000 overflow for a normal distribution).
        min_scale: the lower bound, a power of two (the source's 1).
        max_scale: the upper bound, a power of two (the source's 2**24).
        on_stuck: as in :class:`~lossscale.DynamicPolicy`.
        max_consecutive_skips: as in :class:`~lossscale.DynamicPolicy`.
        fmt: the format the scaled gradients must fit (default "fp16").
    """

    name = "logmax"
    state_type = LogMaxState
    needs_amax = True

    init_scale: float = 1.0
    beta1: float = 0.99
    beta2: float = 0.999
    overflow_std_dev: float = 3.09
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    on_stuck: str = "warn"
    max_consecutive_skips: Optional[int] = None
    fmt: str = "fp16"

    def __post_init__(self):
        self._plain_numbers()
        for name in ("init_scale", "min_scale", "max_scale"):
            v = getattr(self, name)
            if not is_power_of_two(v) or not 2.0**-126 <= v <= 2.0**127:
                raise ValueError(
                    f"{name}={v!r} must be a power of two in float32's normal range: the rule "
                    "takes log2(scale) exactly."
                )
        if not self.min_scale <= self.init_scale <= self.max_scale:
            raise ValueError(
                f"init_scale={self.init_scale!r} is outside [min_scale={self.min_scale!r}, "
                f"max_scale={self.max_scale!r}]."
            )
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v < 1.0:
                raise ValueError(f"{name}={v!r} must be in (0, 1) (e.g. 0.99).")
        v = self.overflow_std_dev
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 0 <= v <= 100):
            raise ValueError(f"overflow_std_dev={v!r} must be a number of standard deviations in [0, 100] (e.g. 3.09).")
        formats.get(self.fmt)
        validate_stuck(self.on_stuck, self.max_consecutive_skips)

    @property
    def limit_exp(self) -> int:
        """The binade of the format's largest finite value (fp16: 16)."""
        return math.frexp(formats.get(self.fmt).max)[1]

    @property
    def flush_exp(self) -> int:
        """log2 of the format's smallest subnormal (fp16: -24)."""
        return math.frexp(formats.get(self.fmt).smallest_subnormal)[1] - 1

    def init_state(self) -> LogMaxState:
        """The state before the first step."""
        return LogMaxState(scale=f32(self.init_scale))

    def _exponent_range(self):
        return math.frexp(self.min_scale)[1] - 1, math.frexp(self.max_scale)[1] - 1

    def _averages(self, s, x):
        """The moving averages after one more sample ``x``, and what the rule reads from them.

        The source's arithmetic, written once for both forms: ``s`` is the pure state (Python floats)
        or the tensor state (float64 0-dim tensors) and ``x`` the same kind; the operators are IEEE
        float64 on both, in this order, so the two forms agree bitwise. Returns
        ``(x_hat, slow_x_hat, xsquared_hat, b1_correction, b2_correction, mu, variance)``.
        """
        b1, b2 = self.beta1, self.beta2
        x_hat = b1 * s.x_hat + (1 - b1) * x
        b1c = s.b1_correction * b1
        mu = x_hat / (1 - b1c)
        slow = b2 * s.slow_x_hat + (1 - b2) * x
        xsq = b2 * s.xsquared_hat + (1 - b2) * (x * x)
        b2c = s.b2_correction * b2
        unbias = 1 - b2c  # once: on device each "1 - b2c" is a kernel
        e_xsq = xsq / unbias
        slow_mu = slow / unbias
        return x_hat, slow, xsq, b1c, b2c, mu, e_xsq - slow_mu * slow_mu

    def update(
        self,
        state: LogMaxState,
        found_inf: bool,
        found_nan: bool = False,
        amax: Optional[float] = None,
        bad_loss: bool = False,
    ) -> LogMaxState:
        """The next state after one iteration; ``amax``: max |g| of the *scaled* gradients (None: not
        measured, then only the step is counted). A non-finite ``amax`` counts as an overflow.
        ``bad_loss`` (a loss non-finite before scaling): skipped and counted, nothing learned."""
        self.check_type(state)
        if amax is not None and not math.isfinite(amax):
            found_inf, found_nan = True, bool(found_nan) or math.isnan(amax)
        if bad_loss:
            return count(state, True, found_nan, bad_loss=True)
        counted = count(state, found_inf, found_nan)
        if amax is None and not found_inf:
            return counted
        log2_scale = math.frexp(state.scale)[1] - 1  # exact: the scale is a power of two
        if found_inf:
            log2_amax = float(self.limit_exp)
        elif amax == 0:
            log2_amax = float(self.flush_exp)
        else:
            log2_amax = math.floor(math.log2(amax) * GRID) / GRID
        x_hat, slow, xsq, b1c, b2c, mu, var = self._averages(state, log2_amax - log2_scale)
        sigma = math.sqrt(max(var, 0.0))
        lo, hi = self._exponent_range()
        k = min(max(math.floor(self.limit_exp - (mu + self.overflow_std_dev * sigma)), lo), hi)
        return counted.replace(
            scale=math.ldexp(1.0, k),
            x_hat=x_hat,
            slow_x_hat=slow,
            xsquared_hat=xsq,
            b1_correction=b1c,
            b2_correction=b2c,
        )

    def tensor_update(self, t, found_inf, found_nan, bad_loss, amax=None) -> None:
        """:meth:`update` on device tensors, in place, without a host sync (float64 arithmetic in
        the pure rule's order, so the two agree bitwise). Flags as for
        :meth:`lossscale.DynamicPolicy.tensor_update`, already counting a non-finite ``amax`` as an
        overflow (the scaler's check derives both from the same read)."""
        import torch  # here, not at the top: the policies import without torch

        count_tensor(t, found_inf, found_nan, bad_loss)
        overflow = found_inf & ~bad_loss  # a bad loss's overflow learns nothing (see learn)
        if amax is None:  # not measured: only an overflow carries information
            amax = torch.full((), math.nan, dtype=torch.float32, device=t.scale.device)
            learn = overflow
        else:
            learn = ~bad_loss  # a non-finite loss: counted, nothing learned
        log2_scale = torch.frexp(t.scale)[1] - 1  # int32; exact in the float64 subtraction below
        log2_amax = torch.floor(torch.log2(amax.to(torch.float64)) * GRID) / GRID
        # In place on that fresh tensor; the overflow last, as found_inf is tested first.
        log2_amax.masked_fill_(amax == 0, float(self.flush_exp)).masked_fill_(overflow, float(self.limit_exp))
        x_hat, slow, xsq, b1c, b2c, mu, var = self._averages(t, log2_amax - log2_scale)
        sigma = torch.sqrt(var.clamp_min(0.0))
        lo, hi = self._exponent_range()
        k = torch.floor(self.limit_exp - (mu + self.overflow_std_dev * sigma)).clamp(lo, hi).to(torch.int64)
        for name, value in (
            ("x_hat", x_hat),
            ("slow_x_hat", slow),
            ("xsquared_hat", xsq),
            ("b1_correction", b1c),
            ("b2_correction", b2c),
            ("scale", exact_pow2(k).float()),
        ):
            field = getattr(t, name)
            torch.where(learn, value, field, out=field)

    def is_stuck(self, state: LogMaxState, scale_before: float) -> bool:
        """An overflow at ``min_scale``, or a streak of ``max_consecutive_skips``."""
        return stuck_at_bound_or_streak(self, state, scale_before, self.min_scale)

    def check_state(self, state: LogMaxState) -> None:
        """Generic checks, plus: the scale a power of two, the bias corrections in (0, 1]."""
        self.check_type(state)
        x_fields = ("x_hat", "slow_x_hat", "xsquared_hat")
        # The averages of log2(amax) may be negative: check them apart from the generic rule (>= 0).
        # Only numbers are made positive; anything else (None, a string) meets the generic rule, which
        # raises ValueError naming the field.
        values = {n: getattr(state, n) for n in x_fields}
        probe = state.replace(
            **{n: abs(v) for n, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        )
        super().check_state(probe)
        if not is_power_of_two(state.scale):
            raise ValueError(f"state.scale={state.scale!r} must be a power of two for the logmax policy.")
        for n in ("b1_correction", "b2_correction"):
            if not 0.0 < getattr(state, n) <= 1.0:
                raise ValueError(f"state.{n}={getattr(state, n)!r} must be in (0, 1].")
        # Every x is a difference of two float32 binades, so |x| < X_BOUND: the averages of x stay
        # within it and the average of x*x within its square. Outside, the rule squares its way to
        # inf - inf = NaN and the scale's exponent becomes garbage.
        for n in x_fields:
            bound = X_BOUND**2 if n == "xsquared_hat" else X_BOUND
            if not -bound <= getattr(state, n) <= bound or (n == "xsquared_hat" and state.xsquared_hat < 0):
                raise ValueError(
                    f"state.{n}={getattr(state, n)!r} must be in [{0 if n == 'xsquared_hat' else -bound}, "
                    f"{bound}] (an average of log2 amaxes{' squared' if n == 'xsquared_hat' else ''})."
                )
