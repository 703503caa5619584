"""Fused passes over lists of gradients: grouping, check+unscale, read-only check.

Nothing here loops over tensors in Python to compute: every pass is one foreach kernel per
(device, dtype) group, as in ``torch.amp.GradScaler`` (a per-tensor ``isfinite().all()`` loop is
7-8x slower on CPU).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, List, Tuple

import torch

Groups = Dict[torch.device, Dict[torch.dtype, List[torch.Tensor]]]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of ``t``: a DTensor's local shard (in-place ops on it update the DTensor)."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def grad_to_check(param: torch.Tensor) -> torch.Tensor:
    """The tensor to check/unscale for ``param.grad`` (its values for a sparse gradient).

    A sparse fp16 gradient is coalesced first, like torch does: duplicate indices are summed by
    coalescing, and a sum of scaled fp16 values may overflow, so the coalesced values are the ones
    that must be checked.
    """
    grad = param.grad
    if grad.is_sparse:
        if grad.dtype is torch.float16:
            param.grad = grad = grad.coalesce()
        return grad._values()
    return local_tensor(grad)


def group_grads(tensors: Iterable[torch.Tensor]) -> Groups:
    """Split tensors by device and dtype, the unit a foreach kernel accepts."""
    groups: Groups = defaultdict(lambda: defaultdict(list))
    for t in tensors:
        groups[t.device][t.dtype].append(t)
    return groups


def check_and_unscale_(groups: Groups, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> Dict[torch.device, torch.Tensor]:
    """torch's fused check+unscale (one read+write pass), per device; returns found_inf per device.

    ``inv_scale`` must be float32 and computed as ``scale.double().reciprocal().float()`` so the
    result is bitwise torch's.
    """
    per_device: Dict[torch.device, torch.Tensor] = {}
    for device, per_dtype in groups.items():
        flag = found_inf if found_inf.device == device else torch.zeros_like(found_inf, device=device)
        inv = inv_scale if inv_scale.device == device else inv_scale.to(device, non_blocking=True)
        for grads in per_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv)
        per_device[device] = flag
    return per_device


def amax_per_tensor(groups: Groups, device: torch.device) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """Read-only pass: max |x| of every tensor (NaN if it holds a NaN, inf if an inf and no NaN).

    Returns the per-tensor float32 amax vectors (one per group, in group order) and their overall
    maximum on ``device`` (NaN-propagating: ``torch.max`` keeps NaN). Nothing is written.

    Why ``aminmax`` per tensor: it is the fastest exact read-only formulation measured on CPU (one
    vectorised read of each tensor, NaN-propagating, and -inf shows in the min). The obvious
    ``torch._foreach_norm(grads, inf)`` runs 7-8x slower than torch's check+unscale kernel there;
    ``_foreach_max`` is a little faster but blind to -inf; a 2-norm overflows float32 for finite scaled
    gradients past ~1.8e19 (a false overflow torch would not see) and is 4-8x slower on fp16.
    Reductions cost more per tensor than an elementwise kernel, so on many small (cache-resident)
    tensors this pass is *slower* than torch's read+write kernel; it wins on large ones (see
    docs/performance.md).
    """
    vectors = []
    for per_dtype in groups.values():
        for grads in per_dtype.values():
            lo, hi = zip(*[torch.aminmax(g) for g in grads])
            # max(hi, -lo) = max|x|; maximum propagates NaN, and -(-inf) = inf.
            amax = torch.maximum(torch.stack(hi), torch.stack(lo).neg_())
            vectors.append(amax.float().to(device, non_blocking=True))
    if not vectors:
        return [], torch.zeros((), dtype=torch.float32, device=device)
    overall = torch.cat(vectors).max() if len(vectors) > 1 else vectors[0].max()
    return vectors, overall


def flags_from_amax(amax: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(found_inf, found_nan) as float32 0/1 tensors from a NaN-propagating max |x|.

    ``amax - amax`` is NaN exactly when amax is inf or NaN (amax >= 0 is never -inf), so one isnan
    over a 2-vector gives both flags: 4 small kernels, where isfinite alone is 4 on CPU.
    """
    flags = torch.isnan(torch.stack([amax - amax, amax])).float()
    return flags[0], flags[1]
