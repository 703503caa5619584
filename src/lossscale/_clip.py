"""``GradScaler.clip_grad_norm_``: unscale, check and clip in two passes over the gradients, not five.

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

from . import _kernels

__all__ = ["clip_grad_norm_"]

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


def _validate(max_norm, norm_type) -> float:
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or math.isnan(max_norm) or max_norm < 0:
        raise ValueError(f"max_norm={max_norm!r} must be a number >= 0 (inf: no clipping, only the norm).")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise ValueError(
            f"norm_type={norm_type!r} must be > 0 or inf (2.0 is the usual choice); the 0-'norm' and "
            "negative orders do not scale with the gradients, so they cannot be taken from scaled ones."
        )
    return float(norm_type)


def clip_grad_norm_(scaler, optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """See :meth:`lossscale.GradScaler.clip_grad_norm_` (this is its body)."""
    from .policy import StaticPolicy
    from .scaler import OptState

    norm_type = _validate(max_norm, norm_type)
    if not scaler._enabled:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    st = scaler._require_state("clip_grad_norm_()")
    rec = scaler._record(optimizer)
    if rec.stage is OptState.UNSCALED:
        raise RuntimeError(
            "clip_grad_norm_() unscales the gradients itself, and unscale_() (or clip_grad_norm_()) was "
            "already called on this optimizer since the last update(); call only one of them per iteration."
        )
    if rec.stage is OptState.STEPPED:
        raise RuntimeError("clip_grad_norm_() is being called after step(); call it before step() in the iteration.")
    sync = not getattr(optimizer, "_step_supports_amp_scaling", False)
    policy = scaler._policy
    passthrough = isinstance(policy, StaticPolicy) and policy.scale == 1.0
    with torch.no_grad():
        grads = scaler._gather(optimizer, allow_half=passthrough)
        params = rec.params
        if scaler._gathered_sparse:
            # The norm of a sparse tensor is the norm of its *coalesced* values (duplicates add up).
            for i, p in enumerate(params):
                if p.grad.is_sparse and not p.grad.is_coalesced():
                    p.grad = p.grad.coalesce()
                    grads[i] = p.grad._values()
        if scaler._telemetry is not None:
            scaler._telemetry.observe(scaler, optimizer, params, grads)
        amax = None
        if getattr(policy, "needs_amax", False):
            # The policy learns from max|g| of the *scaled* gradients: take it before anything below
            # rewrites them (one read pass, what the adaptive policy costs in unscale_ as well).
            _, amax = _kernels.amax_per_tensor(_kernels.group_grads(grads), st.device)
        # Inverse in float64, as unscale_ and torch: exact for a power of two either way.
        inv_scale = st.scale.double().reciprocal().float()
        groups = _groups(grads)
        exact = norm_type in _SCALE_EXACT
        norms, order = [], []
        for tensors, indices in groups:
            if not exact:  # unscale first: these norms are torch's only when taken of unscaled values
                torch._foreach_mul_(tensors, inv_scale.to(tensors[0].device, non_blocking=True))
            norms.extend(torch._foreach_norm(tensors, norm_type))
            order.extend(indices)
        if not norms:
            total = torch.zeros((), dtype=torch.float32, device=st.device)
            per_tensor = torch.zeros(0, dtype=torch.float32, device=st.device)
        else:
            first = grads[0].device  # torch stacks the norms on the first gradient's device
            stacked = torch.stack([n.to(first) for n in norms])
            total = torch.linalg.vector_norm(stacked, norm_type)
            per_tensor = stacked.float().to(st.device, non_blocking=True)
        # What is left to divide by: 1/S, or nothing when the gradients were unscaled first.
        inv = inv_scale.to(total.device) if exact else torch.ones_like(inv_scale, device=total.device)
        true_norm = total * inv  # exact: ||g|| / S == ||g / S|| for S = 2**k
        # torch's clip_grad_norm_, verbatim, on the true norm.
        clip_coef = max_norm / (true_norm + 1e-6)
        clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
        # [non-finite, NaN]: total - total is NaN exactly when total is inf or NaN (a norm is never
        # -inf); one isnan gives both flags (torch.isfinite alone is four kernels on CPU).
        bad = torch.isnan(torch.stack([total - total, total]))
        multiplier = torch.where(bad[0], inv, clip_coef_clamped * inv)
        per_device = {}
        for tensors, _ in groups:
            device = tensors[0].device
            m = per_device.get(device)
            if m is None:
                m = per_device[device] = multiplier.to(device, non_blocking=True)
            torch._foreach_mul_(tensors, m)
        flags = bad.float().to(st.device, non_blocking=True)
    if amax is None:
        found_inf, found_nan = scaler._reduce_flags(flags[0], flags[1])
    else:
        found_inf, found_nan, rec.amax = scaler._reduce_flags(flags[0], flags[1], amax)
    rec.found_inf = {st.device: found_inf}
    rec.found_nan = found_nan
    # overflow_report() reads one value per parameter: the per-tensor norm is NaN for a tensor holding
    # a NaN and inf for one holding an inf, so it serves as the amax vector does elsewhere.
    rec.params = [params[i] for i in order]
    rec.amax_vectors = [per_tensor] if norms else []
    if sync:
        rec.host_found = bool(found_inf.item())  # THE sync of this optimizer's iteration, as in unscale_()
    rec.stage = OptState.UNSCALED
    return true_norm
