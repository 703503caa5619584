"""How the scaler drives an optimizer's step: torch's two contracts for optimizers that unscale themselves.

* ``_step_supports_amp_scaling`` (torch's fused Adam, AdamW, SGD, Adagrad): the optimizer reads the
  attributes ``grad_scale`` (the scale its gradients carry, or None when already unscaled) and
  ``found_inf`` (a float32 0-dim tensor: it skips on device exactly when it is 1.0), set for the
  duration of its ``step()``;
* the older ``step(grad_scaler=...)`` keyword (torch is deprecating it): the optimizer asks the scaler
  itself.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Dict

import torch

__all__ = ["supports_amp_scaling", "takes_grad_scaler", "step_with_flags", "first_step_needs_the_host"]

# Optimizer step functions (a handful per process, alive as long as their classes): a plain dict, which
# torch.compile traces (a WeakKeyDictionary lookup does not survive tracing).
_GRAD_SCALER_KWARG: Dict[Any, bool] = {}


def supports_amp_scaling(optimizer) -> bool:
    """Whether the optimizer unscales and skips by itself (torch's fused optimizers)."""
    return getattr(optimizer, "_step_supports_amp_scaling", False)


def takes_grad_scaler(step) -> bool:
    """Whether ``step`` takes ``grad_scaler=``, cached per function: ``inspect.signature`` costs
    ~100 us, more than the rest of a small fused step."""
    func = getattr(step, "__func__", step)
    found = _GRAD_SCALER_KWARG.get(func)
    if found is None:
        found = _GRAD_SCALER_KWARG[func] = "grad_scaler" in inspect.signature(step).parameters
    return found


def first_step_needs_the_host(optimizer) -> bool:
    """Whether a skip decided on device would leave this optimizer's state garbage, so the host must
    decide its step (one sync) and not call it when skipped.

    torch's ``SGD(fused=True)`` with momentum makes its momentum buffers with ``torch.empty_like`` on
    its first step and lets the fused kernel fill them; a skipped step (``found_inf == 1``) returns
    before writing, and the next step reads the uninitialised memory as momentum (torch 2.13,
    ``optim/sgd.py`` ``_fused_sgd``; measured: weights at 5e27 two steps later). Torch's own GradScaler
    has the same hole. Only until the buffers exist: then this is False.
    """
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    for group in optimizer.param_groups:
        if group.get("fused") and group.get("momentum", 0) != 0:
            state = optimizer.state
            if any(p.grad is not None and state.get(p, {}).get("momentum_buffer") is None for p in group["params"]):
                return True
    return False


def step_with_flags(optimizer, scale, found_inf, unscaled: bool, args, kwargs):
    """``optimizer.step(*args, **kwargs)`` with ``grad_scale``/``found_inf`` set for its duration.

    ``scale``: the scale the gradients carry (None is passed when ``unscaled``); a ``grad_scale`` the
    user set on the optimizer is multiplied in, as torch does.
    """
    user_scale = getattr(optimizer, "grad_scale", None)
    optimizer.grad_scale = user_scale if unscaled else scale if user_scale is None else scale * user_scale
    optimizer.found_inf = found_inf
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        del optimizer.grad_scale
        del optimizer.found_inf


def warn_grad_scaler_contract() -> None:
    """The deprecated ``grad_scaler=`` contract is in use: say so (once per call site)."""
    warnings.warn("lossscale.GradScaler passes itself as grad_scaler=, a contract torch is deprecating; prefer "
                  "optimizers that read grad_scale/found_inf.", FutureWarning, stacklevel=3)
