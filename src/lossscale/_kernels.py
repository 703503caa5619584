"""Fused passes over lists of gradients: grouping, check+unscale, read-only check.

Kernel choice per device type lives here (:data:`AMAX_KERNELS`), as data, not as control flow in
the scaler: the sequence of operations is the same on every device.

Nothing here loops over tensors in Python to compute: every pass is one foreach kernel per
(device, dtype) group, as in ``torch.amp.GradScaler`` (a per-tensor ``isfinite().all()`` loop is
7-8x slower on CPU).
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from .policy import FLAG_LAYOUT

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
        inv = to_device(inv_scale, device)
        for grads in per_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv)
        per_device[device] = flag
    return per_device


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, without waiting where that is safe.

    A copy *to the CPU* is blocking: ``non_blocking=True`` would return a pinned buffer that the
    host may read (a CPU kernel runs at once) before the device has filled it. Copies to an
    accelerator are queued on its stream, after whatever produced ``t``, so they need no wait.
    """
    if t.device == device:
        return t
    return t.to(device, non_blocking=device.type != "cpu")


def _amax_aminmax(grads: List[torch.Tensor]) -> torch.Tensor:
    """max |x| per tensor from ``aminmax``: one vectorised read each; NaN propagates, -inf shows in the min."""
    lo, hi = zip(*[torch.aminmax(g) for g in grads])
    # max(hi, -lo) = max|x|; maximum propagates NaN, and -(-inf) = inf.
    return torch.maximum(torch.stack(hi), torch.stack(lo).neg_())


def _amax_foreach_norm(grads: List[torch.Tensor]) -> torch.Tensor:
    """max |x| per tensor as ``_foreach_norm(ord=inf)``: one multi-tensor launch per group, whatever
    the number of tensors. CUDA's kernel takes ``max_propagate_nan(acc, |x|)``
    (aten/src/ATen/native/cuda/ForeachReduceOp.cu), so a NaN anywhere makes that tensor's value NaN."""
    return torch.stack(torch._foreach_norm(grads, math.inf))


#: The read-only max|x| kernel per device type. Measured on CPU (docs/performance.md): ``aminmax`` per
#: tensor is the fastest exact formulation there, ``_foreach_norm(inf)`` 7-8x slower. On CUDA a
#: launch per tensor costs more than the read itself for small tensors, so the multi-tensor kernel is
#: used; ``benchmarks/gpu_check.sh`` measures it on the first GPU.
AMAX_KERNELS = {"cpu": _amax_aminmax}
DEFAULT_AMAX_KERNEL = _amax_foreach_norm


def amax_kernel(device: torch.device):
    """The read-only max|x| kernel for ``device``'s type (see :data:`AMAX_KERNELS`)."""
    return AMAX_KERNELS.get(device.type, DEFAULT_AMAX_KERNEL)


def amax_per_tensor(groups: Groups, device: torch.device) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """Read-only pass: max |x| of every tensor (NaN if it holds a NaN, inf if an inf and no NaN).

    Returns the per-tensor float32 amax vectors (one per group, in group order) and their overall
    maximum on ``device`` (NaN-propagating: ``torch.max`` keeps NaN). Nothing is written.

    The kernel depends on the gradients' device type (:func:`amax_kernel`). Alternatives measured
    and rejected: a 2-norm overflows float32 for finite scaled gradients past ~1.8e19 (a false
    overflow torch would not see) and is 4-8x slower on fp16; ``_foreach_max`` is blind to -inf.
    """
    vectors = []
    for grad_device, per_dtype in groups.items():
        kernel = amax_kernel(grad_device)
        for grads in per_dtype.values():
            vectors.append(to_device(kernel(grads).float(), device))
    if not vectors:
        return [], torch.zeros((), dtype=torch.float32, device=device)
    overall = torch.cat(vectors).max() if len(vectors) > 1 else vectors[0].max()
    return vectors, overall


#: Per device: a NaN and a zero, made once (each would be a launch per call, and a tensor made inside
#: a CUDA-graph capture must outlive it).
_CONSTANTS: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}


def _nan_and_zero(like: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    pair = _CONSTANTS.get(like.device)
    if pair is None or pair[0].dtype != like.dtype:
        pair = _CONSTANTS[like.device] = (torch.full_like(like, math.nan), torch.zeros_like(like))
    return pair


_WEIGHTS: Dict[torch.device, torch.Tensor] = {}


def bit_weights(like: torch.Tensor) -> torch.Tensor:
    """``[1, 2, 4]`` on ``like``'s device and dtype, made once: a flag vector's ``[overflow, nan, bad]``
    dotted with it is one number that carries all three (``Flags.read``'s one ``.item()``)."""
    w = _WEIGHTS.get(like.device)
    if w is None or w.dtype != like.dtype:
        # Made on the device (a copy from host memory would wait for it, and fail in a graph capture).
        w = _WEIGHTS[like.device] = torch.exp2(torch.arange(3, dtype=like.dtype, device=like.device))
    return w


def laid_out(parts) -> torch.Tensor:
    """``(1, overflow, nan, bad_loss)`` (four 0-dim tensors, one dtype) stacked as the tensor rules take
    them (:data:`lossscale.policy.FLAG_LAYOUT`): one kernel, however often an entry repeats."""
    return torch.stack([parts[i] for i in FLAG_LAYOUT])


def zero_on(device: torch.device) -> torch.Tensor:
    """A float32 0-dim zero on ``device``, made once (no launch per call). Read it only."""
    pair = _CONSTANTS.get(device)
    if pair is None or pair[0].dtype != torch.float32:
        pair = _CONSTANTS[device] = (torch.full((), math.nan, device=device), torch.zeros((), device=device))
    return pair[1]


def loss_nan(loss_check: torch.Tensor) -> torch.Tensor:
    """The loss check (non-finite where a loss was non-finite before scaling: the loss itself, or
    ``x - x`` summed) times 0: NaN exactly where a loss was non-finite, else 0. One kernel."""
    return loss_check * 0


def _flag_sources(amax: torch.Tensor, loss_check: Optional[torch.Tensor]) -> torch.Tensor:
    """The values whose NaN-ness is the flag vector, laid out (:func:`flag_vector` says why)."""
    nan, zero = _nan_and_zero(amax)
    bad = zero if loss_check is None else loss_nan(loss_check).to(amax.dtype)
    return laid_out([nan, torch.addcmul(bad, amax, zero), amax, bad])


def flag_bools(amax: torch.Tensor, loss_check: Optional[torch.Tensor]) -> torch.Tensor:
    """:func:`flag_vector` as bools, for a host that reads them (:func:`read_four_bools` of the first
    four)."""
    return torch.isnan(_flag_sources(amax, loss_check))


def read_four_bools(bools: torch.Tensor) -> List[bool]:
    """The values of a 4-element bool vector, read by the host in one ``.item()`` and no kernel: its
    four bytes are one int32 (a view). Syncs host and device.

    Why not ``tolist()``: the same one copy on a GPU, but on the CPU it reads memory without passing
    torch's dispatcher, so a CPU run that stands for the device (``lossscale._sync``) would not
    count the read; and a ``dot`` with bit weights (the float path) is one more kernel.
    """
    if bools.dtype != torch.bool or bools.shape != (4,):
        raise ValueError(f"read_four_bools needs a bool vector of 4; got {bools.dtype} {tuple(bools.shape)}.")
    word = bools.contiguous().view(torch.int32).item()  # a fresh vector is contiguous: no kernel
    return [bool(b) for b in int(word).to_bytes(4, sys.byteorder, signed=True)]


def flag_vector(amax: torch.Tensor, loss_check: Optional[torch.Tensor]) -> torch.Tensor:
    """The flags as the tensor rules take them (``(1, overflow, nan, bad_loss)`` laid out as
    :data:`lossscale.policy.FLAG_LAYOUT`), float32 0/1, from a NaN-propagating max |g| and the loss
    check (non-finite where a loss was non-finite before scaling; None: not checked), whose ``* 0``
    is ``loss_check`` below.

    One NaN test over the laid-out values: ``loss_check + amax * 0`` is NaN exactly when the gradients held
    an inf or a NaN (``inf * 0`` is NaN) or the loss was bad: the overflow, a bad loss included;
    ``amax`` itself when they held a NaN; ``loss_check`` when the loss was bad; a NaN constant gives
    the leading 1 (the step itself, for the counters: :func:`lossscale.policy.count_tensor`). The
    test is ``v != v`` (true for NaN alone) written into a float32 output: the 0/1 floats in one
    kernel, where ``isnan(v).float()`` is two.
    """
    v = _flag_sources(amax, loss_check)
    return torch.ne(v, v, out=torch.empty_like(v))


def flags_from_amax(amax: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(found_inf, found_nan) as float32 0/1 tensors from a NaN-propagating max |x|.

    ``amax - amax`` is NaN exactly when amax is inf or NaN (amax >= 0 is never -inf), so one isnan
    over a 2-vector gives both flags: 4 small kernels, where isfinite alone is 4 on CPU.
    """
    flags = torch.isnan(torch.stack([amax - amax, amax])).float()
    return flags[0], flags[1]
