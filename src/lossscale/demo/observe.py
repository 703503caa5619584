"""Per-step measurements of a run, taken with lossscale's own telemetry APIs.

* The overflow side: ``grad/headroom_bits`` of the step's (FP16-born) parameter gradients at the scale
  the step ran with, from ``scaler.metrics()`` for lossscale's scaler (the demo turns its telemetry on
  for every step), else from ``lossscale.stats.grad_stats`` (torch's scaler, runs without a scaler).
* The underflow side: under autocast the parameter gradients are FP32 copies of FP16 results, so a
  flushed value is already 0 there and cannot be told from a true 0. The flushing happens in the FP16
  activation gradients, so every ``probe_every`` steps :func:`lossscale.hooks.activation_grad_probe`
  runs one exact FP32 backward of a fixed probe batch and reports what FP16 flushes at the scale in
  use: ``act/flushed_frac`` overall and ``act/<module>/flushed_frac`` per layer.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F

from ..hooks import activation_grad_probe, activation_metrics
from ..scaler import GradScaler
from ..stats import grad_stats
from .workload import Data, TrainConfig

__all__ = ["make_observer", "probe_activations"]

_KEEP = ("grad/headroom_bits", "grad/amax", "grad/overflow_frac")


def _num(v) -> Optional[float]:
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def probe_activations(
    model: torch.nn.Module, cfg: TrainConfig, x: torch.Tensor, y: torch.Tensor, scale: float
) -> Dict[str, Any]:
    """``{"act/flushed_frac": f, "act/<module>/flushed_frac": f, ...}`` at ``scale`` (and ``.../headroom_bits``)."""
    c = cfg.c
    per = activation_grad_probe(model, lambda out, t: F.cross_entropy(out, t) * c, x, y, scale=scale, fmt="fp16")
    # Shares of the *nonzero* activation gradients: ReLU's exact zeros are no signal to lose.
    figures = activation_metrics(per, of_nonzero=True)
    return {k: v for k, v in figures.items() if k.endswith(("/flushed_frac", "/headroom_bits"))}


def make_observer(
    cfg: TrainConfig, data: Data, probe_every: int = 5, probe_size: int = 256
) -> Callable[[int, torch.nn.Module, Any], Dict[str, Any]]:
    """An ``observe(step, model, scaler)`` for :class:`~lossscale.demo.workload.RunSpec` (see the module doc).

    Called after ``scaler.step`` and before ``scaler.update``, so the gradients are unscaled and the
    scaler's scale and telemetry are those of the step.
    """
    x_probe, y_probe = data.x_train[:probe_size], data.y_train[:probe_size]

    def observe(step: int, model: torch.nn.Module, scaler) -> Dict[str, Any]:
        scale = 1.0 if scaler is None else float(scaler.get_scale())
        rec: Dict[str, Any] = {}
        if isinstance(scaler, GradScaler):
            # lossscale's scaler with telemetry on reports the step's figures itself (metrics() syncs: fine on CPU).
            figures = scaler.metrics()
            rec.update({k: _num(figures[k]) for k in _KEEP if k in figures})
        else:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if grads:
                # The gradients are unscaled here; at ``scale`` they are the FP16 values of the backward.
                d = grad_stats(grads, scale=scale, fmt="fp16")
                rec["grad/headroom_bits"] = float(d.headroom_bits)
                rec["grad/amax"] = float(d.amax) * scale  # of the scaled gradients, as the telemetry reports it
        if step % probe_every == 0:
            rec.update(probe_activations(model, cfg, x_probe, y_probe, scale))
        return {k: v for k, v in rec.items() if v is None or not isinstance(v, float) or not math.isnan(v)}

    return observe
