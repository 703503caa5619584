"""OpenSeq2Seq's LogMax automatic loss scaler, as a pure policy (the published baseline of issue 4).

Source: NVIDIA/OpenSeq2Seq, ``open_seq2seq/optimizers/automatic_loss_scaler.py``, class
``LogMaxScaler`` (TensorFlow, 2018). It keeps exponential moving averages of ``x = log2(amax)`` of the
*unscaled* gradients (``NB: assumes that amax is already has been downscaled``) and sets::

    mu    = EMA_beta1(x)            (bias-corrected, beta1 = 0.99)
    sigma = sqrt(EMA_beta2(x^2) - EMA_beta2(x)^2)   (bias-corrected, beta2 = 0.999)
    scale = clip(2 ** (16 - (mu + 3.09 * sigma)), scale_min=1, scale_max=2**24)

starting from scale 1.0, every iteration, with the optimizer step skipped on inf/NaN. The scale is
*not* a power of two. Reproduced as published, including two behaviours worth knowing:

* On a non-finite step the source feeds ``x = tf.pow(2., log_max)`` = 65536 (not ``log_max`` = 16) into
  the averages, so one overflow drives mu to ~655 and pins the scale at ``scale_min`` for hundreds of
  steps (sigma, on the slow average, for thousands). Kept: it is the published behaviour.
* ``amax == 0`` (every gradient flushed, as happens at scale 1 when gradients live below 2**-24)
  gives ``log2(0) = -inf``, which turns the averages into NaN (inf - inf) and the scale with them.
  The one deviation here: such a step feeds ``log2(2**-24 / scale)`` instead, FP16's flush threshold
  at that scale, an upper bound of the true amax (so the scale rises out of the flushed region).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LogMaxPolicy", "LogMaxState"]

_FP16_SMALLEST_SUBNORMAL_LOG2 = -24


@dataclass(frozen=True)
class LogMaxState:
    """The scaler's TF variables, plus the counters the benchmark reads."""

    scale: float = 1.0
    x_hat: float = 0.0
    slow_x_hat: float = 0.0
    xsquared_hat: float = 0.0
    b1_correction: float = 1.0
    b2_correction: float = 1.0
    steps: int = 0
    skipped_steps: int = 0


@dataclass(frozen=True)
class LogMaxPolicy:
    """OpenSeq2Seq's ``LogMaxScaler`` with its defaults. ``update`` takes the *unscaled* amax."""

    scale_min: float = 1.0
    scale_max: float = 2.0**24
    log_max: float = 16.0
    beta1: float = 0.99
    beta2: float = 0.999
    overflow_std_dev: float = 3.09

    def init_state(self) -> LogMaxState:
        return LogMaxState()

    def update(self, state: LogMaxState, found_inf: bool, amax: float) -> LogMaxState:
        """One iteration. ``amax``: max |g| of the gradients after dividing by the scale."""
        nonfinite = found_inf or not math.isfinite(amax)
        if nonfinite:
            x = 2.0**self.log_max  # sic: tf.pow(2., self.log_max) in the source
        elif amax == 0.0:
            x = _FP16_SMALLEST_SUBNORMAL_LOG2 - math.log2(state.scale)  # deviation, see the module doc
        else:
            x = math.log2(amax)
        x_hat = self.beta1 * state.x_hat + (1 - self.beta1) * x
        b1 = state.b1_correction * self.beta1
        mu = x_hat / (1 - b1)
        slow = self.beta2 * state.slow_x_hat + (1 - self.beta2) * x
        xsq = self.beta2 * state.xsquared_hat + (1 - self.beta2) * (x * x)
        b2 = state.b2_correction * self.beta2
        e_xsquared = xsq / (1 - b2)
        slow_mu = slow / (1 - b2)
        sigma = math.sqrt(max(e_xsquared - slow_mu * slow_mu, 0.0))
        log_cutoff = sigma * self.overflow_std_dev + mu
        log_difference = 16 - log_cutoff  # the source hard-codes 16 here
        # clip in the log domain: 2**log_difference itself may overflow a float
        lo, hi = math.log2(self.scale_min), math.log2(self.scale_max)
        scale = 2.0 ** min(max(log_difference, lo), hi)
        return LogMaxState(scale=scale, x_hat=x_hat, slow_x_hat=slow, xsquared_hat=xsq, b1_correction=b1,
                           b2_correction=b2, steps=state.steps + 1,
                           skipped_steps=state.skipped_steps + bool(nonfinite))
