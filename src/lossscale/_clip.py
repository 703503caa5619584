"""``GradScaler.clip_grad_norm_``'s arithmetic: unscale, check and clip in two passes over the gradients, not five.

This module computes on tensors only; the scaler does the bookkeeping (stages, the skip decision,
the reduction across ranks) through its gradient check, as for ``unscale_``.

torch's recipe reads and writes every gradient three times::

    scaler.unscale_(optimizer)                    # read+write: g <- g * (1/S), and look for inf/NaN
    torch.nn.utils.clip_grad_norm_(params, c)     # read: the norm; read+write: g <- g * coef

Here the norm of the *scaled* gradients is taken first (one read; a NaN or inf in any gradient makes
it NaN or inf, so the same pass is the inf/NaN check), the true norm is that norm times 1/S, and one
multiply by ``coef * (1/S)`` does the unscaling and the clipping together (one read+write)::

    norms    = foreach_norm(g)                    # per tensor, torch's kernel and grouping
    total    = vector_norm(stack(norms))          # the scaled total norm, ||g||
    true     = total * (1/S)                      # = ||g/S||
    coef     = clamp(max_norm / (true + 1e-6), max=1)        # torch's expression, verbatim
    g       <- g * (coef * (1/S))   if true is finite        # unscale + clip, one pass
    g       <- g * (1/S)            otherwise                # unscale only; inf/NaN stay as they are

When it equals torch bitwise. With S = 2**k every step above is torch's step on values scaled by
an exact power of two, and binary floating point rounds ``x * 2**k`` exactly as it rounds ``x``, so
``||g|| / S == ||g / S||`` and ``g * (coef / S) == (g / S) * coef`` bit for bit, *provided no value
on either path leaves float32's normal range*: no gradient ``|g/S|`` or product ``|g * coef/S|``
below 2**-126 (a subnormal loses bits that the other path keeps), no square in the norm's sum below
2**-126 or above 2**128, and ``coef/S`` normal. ``tests/test_clip.py`` plants values on both sides of
these limits. For a scale that is not a power of two the results agree to rounding, not bitwise.

A policy that learns from the gradients' amax (``needs_amax``, the adaptive policy) gets it from one
more read pass before anything is rewritten, as in ``unscale_``.

Norm types other than 1, 2 and inf raise ``|x|`` to a power with libm's ``pow``, which does not
commute with scaling bit for bit, so for them the gradients are unscaled *first* (three passes,
torch's arithmetic exactly) and only the check is saved.

Differences from the two-step recipe, by design:

* A non-finite norm is an overflow: the step is skipped and counted (NaN if the norm is NaN, else
  inf). Because the norm sums squares of the *scaled* gradients, it also overflows when
  ``S * ||g||`` exceeds float32's range (about 1.8e19) with every gradient finite; torch's recipe
  would have stepped. With lossscale's default ``max_scale=2**24`` that needs a true norm above 1e12.
* On overflow the gradients are unscaled but not clipped, so an inf stays inf (torch's recipe
  multiplies them by ``coef = 0`` and turns every inf into NaN).
* Sharded gradients (FSDP): the norm is this rank's shard's. The total norm needs a sum of squares
  across ranks, which this does not do; DDP replicates gradients, so every rank's norm is the total.
"""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch

from . import _device, _kernels

__all__ = ["clip_scaled_", "validate"]

# Norm types whose per-tensor kernels (sum |x|, sum x*x then sqrt, max |x|) scale exactly by 2**k.
_SCALE_EXACT = (1.0, 2.0, math.inf)

try:  # the grouping torch's clip_grad_norm_ uses: same groups, same order, so the same sums
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype as _torch_grouping
except ImportError:  # pragma: no cover - older or trimmed torch
    _torch_grouping = None


def _groups(grads: List[torch.Tensor]) -> List[Tuple[List[torch.Tensor], List[int]]]:
    """``(tensors, their indices in grads)`` per (device, dtype), in torch's clip_grad_norm_ order."""
    if _torch_grouping is not None:
        return [(tensors[0], indices) for tensors, indices in _torch_grouping([grads], with_indices=True).values()]
    out: Dict[Tuple[torch.device, torch.dtype], Tuple[List[torch.Tensor], List[int]]] = {}
    for i, g in enumerate(grads):
        tensors, indices = out.setdefault((g.device, g.dtype), ([], []))
        tensors.append(g)
        indices.append(i)
    return list(out.values())


def validate(max_norm, norm_type) -> float:
    """Check the arguments before anything changes; returns ``norm_type`` as a float."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or math.isnan(max_norm) or max_norm < 0:
        raise ValueError(f"max_norm={max_norm!r} must be a number >= 0 (inf: no clipping, only the norm).")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise ValueError(
            f"norm_type={norm_type!r} must be > 0 or inf (2.0 is the usual choice); the 0-'norm' and "
            "negative orders do not scale with the gradients, so they cannot be taken from scaled ones."
        )
    return float(norm_type)


def clip_scaled_(grads: List[torch.Tensor], scale: torch.Tensor, max_norm: float, norm_type: float
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[int]]:
    """Unscale and clip ``grads`` (the *scaled* gradients) in place by their true total norm.

    Args:
        grads: the gradients to clip (dense, or the coalesced values of sparse ones).
        scale: the float32 0-dim scale the gradients carry; results land on its device.
        max_norm, norm_type: as ``torch.nn.utils.clip_grad_norm_`` (validated by :func:`validate`).

    Returns:
        ``(true_norm, flags, per_tensor, order)``: the total norm of the unscaled gradients (a
        tensor: no sync); ``flags``, float32 ``[non-finite, NaN]`` of that norm (this rank's, not
        reduced); the per-tensor norms of the *scaled* gradients (a NaN or inf one names the tensor
        that held it, like an amax vector) and the index into ``grads`` of each, in that order.
    """
    device = scale.device
    # Inverse in float64, as unscale_ and torch: exact for a power of two either way.
    inv_scale = _device.reciprocal(scale)
    groups = _groups(grads)
    exact = norm_type in _SCALE_EXACT
    norms, order = [], []
    for tensors, indices in groups:
        if not exact:  # unscale first: these norms are torch's only when taken of unscaled values
            torch._foreach_mul_(tensors, _kernels.to_device(inv_scale, tensors[0].device))
        norms.extend(torch._foreach_norm(tensors, norm_type))
        order.extend(indices)
    if not norms:
        total = torch.zeros((), dtype=torch.float32, device=device)
        per_tensor = torch.zeros(0, dtype=torch.float32, device=device)
    else:
        first = grads[0].device  # torch stacks the norms on the first gradient's device
        stacked = torch.stack([n.to(first) for n in norms])
        total = torch.linalg.vector_norm(stacked, norm_type)
        per_tensor = _kernels.to_device(stacked.float(), device)
    # What is left to divide by: 1/S, or nothing when the gradients were unscaled first.
    inv = _kernels.to_device(inv_scale, total.device) if exact else torch.ones_like(inv_scale, device=total.device)
    true_norm = total * inv  # exact: ||g|| / S == ||g / S|| for S = 2**k
    # torch's clip_grad_norm_, verbatim, on the true norm.
    clip_coef = max_norm / (true_norm + 1e-6)
    clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
    # [non-finite, NaN]: total - total is NaN exactly when total is inf or NaN (a norm is never
    # -inf); one isnan gives both flags (torch.isfinite alone is four kernels on CPU).
    bad = torch.isnan(torch.stack([total - total, total]))
    multiplier = torch.where(bad[0], inv, clip_coef_clamped * inv)
    per_device: Dict[torch.device, torch.Tensor] = {}
    for tensors, _ in groups:
        target = tensors[0].device
        m = per_device.get(target)
        if m is None:
            m = per_device[target] = _kernels.to_device(multiplier, target)
        torch._foreach_mul_(tensors, m)
    return true_norm, _kernels.to_device(bad.float(), device), per_tensor, order
