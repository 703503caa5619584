"""``GradScaler.clip_grad_norm_``'s arithmetic: unscale, check and clip in two passes over the gradients, not three.

This module computes on tensors only; the scaler does the bookkeeping (stages, the skip decision,
the reduction across ranks) through its gradient check, as for ``unscale_``.

torch's recipe reads every gradient three times and writes it twice::

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

A policy that learns from the gradients' amax (``needs_amax``: adaptive, LogMax) gets it from one
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

Sharded gradients (FSDP2, tensor parallel, both on a 2-D mesh, pipeline stages): each rank holds
parts of the gradients, so between the two passes one all-reduce turns this rank's norm into the
total (``lossscale.distributed.norm_reduction`` decides the group and which parts a rank counts)::

    local    = vector_norm(stack(norms of the parts this rank counts))   # a Replicate copy: one rank
    total    = all_reduce(SUM, local**p) ** (1/p)      # inf: all_reduce(MAX, local); one collective
    ... then as above, on every rank with the same total, so every rank clips alike

torch reduces DTensor norms with the same ``x**p``, SUM, ``**(1/p)`` (``_NormPartial``), but of the
vector of per-tensor norms and one mesh dim at a time, then takes the norm of that vector; so sharded
totals agree with torch's to a few ulps, not bitwise (FSDP1's ``clip_grad_norm_`` reduces the rank's
total as here: bitwise). The power is taken of the scaled norm: exact for S = 2**k, and it overflows
where the sum of squares above does. The inf/NaN flags stay this rank's:
the scaler's check reduces them, as for ``unscale_``. DDP replicates gradients, so there every
rank's norm is the total and nothing is reduced.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

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


def clip_scaled_(grads: List[torch.Tensor], scale: torch.Tensor, max_norm: float, norm_type: float,
                 counted: Optional[List[bool]] = None,
                 reduce_norm: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 loss_check: Optional[torch.Tensor] = None, inv_scale: Optional[torch.Tensor] = None,
                 host_reads: bool = True) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[int]]:
    """Unscale and clip ``grads`` (the *scaled* gradients) in place by their true total norm.

    Args:
        grads: the gradients to clip (dense, or the coalesced values of sparse ones; local shards).
        scale: the float32 0-dim scale the gradients carry; results land on its device.
        max_norm, norm_type: as ``torch.nn.utils.clip_grad_norm_`` (validated by :func:`validate`).
        counted, reduce_norm: for gradients spread over ranks (``lossscale.distributed.norm_reduction``):
            which of ``grads`` this rank counts in the norm (the others are copies another rank
            counts), and the collective that turns the norm of the counted ones into the total.
            None (default): this rank's gradients are the whole.
        loss_check: the loss check (non-finite where a loss was non-finite before scaling),
            or None: folded into the flags.
        inv_scale: ``1/scale`` as torch computes it (float32, rounded once from float64), or None to
            compute it here.
        host_reads: the host reads the flags (bools, read in one copy with no kernel); otherwise they
            are made as the tensor rules take them (floats, :func:`lossscale._kernels.flags_of`).

    Returns:
        ``(true_norm, flags, per_tensor, order)``: the total norm of the unscaled gradients (a
        tensor: no sync; the same on every rank when reduced); ``flags``, the flag vector
        (``FLAG_LAYOUT``: 1, overflow, nan, bad_loss at 0-3; bools or floats, see ``host_reads``) of this
        rank's gradients, copies included (not reduced); the per-tensor norms of the
        *scaled* gradients (a NaN or inf one names the tensor that held it, like an amax vector) and
        the index into ``grads`` of each, in that order.
    """
    device = scale.device
    # Inverse in float64, as unscale_ and torch: exact for a power of two either way.
    inv_scale = _device.reciprocal(scale) if inv_scale is None else inv_scale
    groups = _groups(grads)
    exact = norm_type in _SCALE_EXACT
    norms, order = [], []
    for tensors, indices in groups:
        if not exact:  # unscale first: these norms are torch's only when taken of unscaled values
            torch._foreach_mul_(tensors, _kernels.to_device(inv_scale, tensors[0].device))
        norms.extend(torch._foreach_norm(tensors, norm_type))
        order.extend(indices)
    first = grads[0].device if grads else device  # torch stacks the norms on the first gradient's device
    moved = [n.to(first) for n in norms]
    if not norms:
        total = torch.zeros((), dtype=torch.float32, device=device)
        per_tensor = torch.zeros(0, dtype=torch.float32, device=device)
    else:
        stacked = torch.stack(moved)
        total = torch.linalg.vector_norm(stacked, norm_type)
        per_tensor = _kernels.to_device(stacked.float(), device)
    # A norm is never -inf: the flags' NaN tests tell inf from NaN, the bad loss folded in.
    loss_check = None if loss_check is None else _kernels.to_device(loss_check, total.device)
    if host_reads:
        flags = _kernels.flag_bools(total, loss_check)
    else:
        flags, _ = _kernels.flags_of([total.reshape(1)], 1, loss_check, total.device)
    overflow = flags[1]  # a bool, or a float 0/1
    if reduce_norm is not None:
        # Sharded: the norm of the parts this rank counts, then one all-reduce to the total. Every
        # rank gets the same total, so every rank clips by the same coefficient.
        mine = [n for n, i in zip(moved, order) if counted is None or counted[i]]
        local = total
        if len(mine) < len(moved):
            local = (torch.linalg.vector_norm(torch.stack(mine), norm_type) if mine
                     else torch.zeros((), dtype=torch.float32, device=first))
            # A copy counted elsewhere adds nothing, unless it holds inf/NaN: then so does the total,
            # on every rank, as in torch (copies should agree; one that does not is a fault).
            copies = torch.linalg.vector_norm(torch.stack([n for n, i in zip(moved, order) if not counted[i]]),
                                              norm_type)
            local = local + torch.where(torch.isfinite(copies), 0.0, copies)
        total = reduce_norm(_kernels.to_device(local, device))
        # Unscale only where this rank saw a non-finite value (a copy it does not count included) or
        # the total is non-finite; the step is skipped then, by the reduced flags.
        overflow = torch.logical_or(overflow.to(device), torch.isnan(total - total))
    # What is left to divide by: 1/S, or nothing when the gradients were unscaled first.
    inv = _kernels.to_device(inv_scale, total.device) if exact else torch.ones_like(inv_scale, device=total.device)
    true_norm = total * inv  # exact: ||g|| / S == ||g / S|| for S = 2**k
    # torch's clip_grad_norm_, verbatim, on the true norm.
    clip_coef = max_norm / (true_norm + 1e-6)
    clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
    # On overflow the multiplier is 1/S alone: fmax takes the larger and passes over a NaN, so with
    # overflow = 1 it is 1 whatever the coefficient (0 for an inf norm, NaN for a NaN one, or a finite
    # one when only the loss was bad), and with overflow = 0 it is the coefficient (never negative).
    multiplier = torch.fmax(clip_coef_clamped, overflow) * inv
    per_device: Dict[torch.device, torch.Tensor] = {}
    for tensors, _ in groups:
        target = tensors[0].device
        m = per_device.get(target)
        if m is None:
            m = per_device[target] = _kernels.to_device(multiplier, target)
        torch._foreach_mul_(tensors, m)
    return true_norm, _kernels.to_device(flags, device), per_tensor, order
