"""Fused passes over lists of gradients: grouping, check+unscale, read-only check.

Kernel choice per device type lives here (:data:`AMAX_KERNELS`), as data, not as control flow in
the scaler: the sequence of operations is the same on every device.

Nothing here loops over tensors in Python to compute, with one exception: every pass is one foreach
kernel per (device, dtype) group, as in ``torch.amp.GradScaler`` (a per-tensor ``isfinite().all()``
loop is 7-8x slower on CPU), except the CPU's read-only amax pass, one ``aminmax`` per tensor, which
measured fastest there (:data:`AMAX_KERNELS`).
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from .policy import CLEAN, FLAG_LAYOUT, SCALE_OVERFLOW

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


def _amax_aminmax(grads: List[torch.Tensor]) -> List[torch.Tensor]:
    """max |x| per tensor from ``aminmax``: one vectorised read each; NaN propagates, -inf shows in the min.
    One vector of them."""
    lo, hi = zip(*[torch.aminmax(g) for g in grads])
    # max(hi, -lo) = max|x|; maximum propagates NaN, and -(-inf) = inf.
    return [torch.maximum(torch.stack(hi), torch.stack(lo).neg_())]


def _amax_foreach_norm(grads: List[torch.Tensor]) -> List[torch.Tensor]:
    """max |x| per tensor as ``_foreach_norm(ord=inf)``: one multi-tensor kernel per group, whatever
    the number of tensors (on CUDA four launches with its two workspace fills and its cleanup). CUDA's
    kernel takes ``max_propagate_nan(acc, |x|)`` (aten/src/ATen/native/cuda/ForeachReduceOp.cu), so a
    NaN anywhere makes that tensor's value NaN.
    One length-1 view per tensor (no kernel): the caller's ``cat`` stacks them."""
    return [norm.reshape(1) for norm in torch._foreach_norm(grads, math.inf)]


#: The read-only max|x| kernel per device type, returning the values as 1-dim pieces to ``cat``.
#: Measured on CPU (docs/performance.md): ``aminmax`` per tensor is the fastest exact formulation
#: there (0.9-2.4x torch's check kernel), ``_foreach_norm(inf)`` 14-19x torch's kernel. On CUDA a
#: launch per tensor costs more than the read itself for small tensors, so the multi-tensor kernel is
#: used; ``benchmarks/gpu_check.sh`` measures it on the first GPU.
AMAX_KERNELS = {"cpu": _amax_aminmax}
DEFAULT_AMAX_KERNEL = _amax_foreach_norm


def amax_kernel(device: torch.device):
    """The read-only max|x| kernel for ``device``'s type (see :data:`AMAX_KERNELS`)."""
    return AMAX_KERNELS.get(device.type, DEFAULT_AMAX_KERNEL)


def _amax_pieces(groups: Groups, device: torch.device) -> Tuple[List[torch.Tensor], List[int]]:
    """Every group's per-tensor max|x| as 1-dim pieces on ``device`` (one ``cat`` makes the vector),
    and the number of tensors per group, in group order."""
    pieces, sizes = [], []
    for grad_device, per_dtype in groups.items():
        kernel = amax_kernel(grad_device)
        for grads in per_dtype.values():
            part = kernel(grads)
            if grad_device != device:
                part = [to_device(torch.cat(part), device)]
            pieces.extend(part)
            sizes.append(len(grads))
    return pieces, sizes


def amax_per_tensor(groups: Groups, device: torch.device) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """Read-only pass: max |x| of every tensor (NaN if it holds a NaN, inf if an inf and no NaN).

    Returns the per-tensor float32 amax vectors (one per group, in group order) and their overall
    maximum on ``device`` (NaN-propagating: ``torch.max`` keeps NaN). Nothing is written.

    The kernel depends on the gradients' device type (:func:`amax_kernel`). Alternatives measured
    and rejected: a 2-norm overflows float32 for finite scaled gradients past ~1.8e19 (a false
    overflow torch would not see) and is 4-8x slower on fp16; ``_foreach_max`` is blind to -inf.
    """
    pieces, sizes = _amax_pieces(groups, device)
    if not pieces:
        return [], torch.zeros((), dtype=torch.float32, device=device)
    values = torch.cat(pieces, out=torch.empty(sum(sizes), dtype=torch.float32, device=device))
    return list(values.split(sizes)), values.max()


def read_only_check(groups: Groups, device: torch.device, loss_check: Optional[torch.Tensor],
                    needs_amax: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor], List[torch.Tensor]]:
    """The fused-optimizer path's check: nothing written, the flags and the amax from one read.

    Returns ``(flags, amax, amax_vectors)``: the flag vector (:func:`flags_of`), the NaN-propagating
    max|g| when ``needs_amax`` (else None), and the per-tensor max|g| vectors (views, one per group,
    for ``overflow_report``). ``loss_check``: non-finite where a loss was non-finite before scaling, or
    None (not checked). No sync.
    """
    pieces, sizes = _amax_pieces(groups, device)
    n = sum(sizes)
    flags, values = flags_of(pieces, n, loss_check, device)
    amax = None
    if needs_amax:
        amax = values[:n].max() if n else torch.zeros((), dtype=torch.float32, device=device)
    return flags, amax, list(values[:n].split(sizes))


def flags_of(pieces: List[torch.Tensor], n: int, loss_check: Optional[torch.Tensor],
             device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The flag vector as the tensor rules take it (float32 0/1, :data:`lossscale.policy.FLAG_LAYOUT`)
    from ``n`` values that are inf or NaN where the gradients held one (per-tensor max|g| or norms, in
    1-dim ``pieces`` on ``device``) and the loss check (None: not checked). Returns ``(flags, values)``,
    ``values[:n]`` the values as one float32 vector. Five kernels, however many values. No sync.

    How: the values, the loss check and a NaN are one vector ``u``; ``[u, u * 0] != itself`` tests,
    per value, "NaN" and "inf or NaN" (``inf * 0`` is NaN) as 0/1 floats, which are finite, so a
    constant matrix turns them into every flag at once: a flag is a count of the tests it covers,
    clamped to 1; the NaN column is the constant 1; and "overflow and not a bad loss" or "clean" (what
    the tests alone cannot say) subtract a test more often than any count can reach.
    """
    nan, zero = _nan_and_zero(device, torch.float32)
    loss = zero if loss_check is None else to_device(loss_check, device)
    values = torch.cat(pieces + [loss.reshape(1), nan.reshape(1)],
                       out=torch.empty(n + 2, dtype=torch.float32, device=device))
    both = values * _nan_rows(device)  # [u, u * 0]: NaN where u is NaN / where u is not finite
    tests = torch.ne(both, both, out=torch.empty_like(both))
    return torch.mv(_flag_matrix(n, device), tests.view(-1)).clamp_(0.0, 1.0), values


#: Device constants, made once per key (each would be a launch per call, and one made inside a CUDA-graph
#: capture must outlive it); filled on the device, as a copy from host memory would wait for it.
_MADE: Dict[tuple, Any] = {}


def _made_once(key: tuple, make: Callable[[], Any]) -> Any:
    """``make()`` the first time ``key`` is asked for, the same object after. Read what it gives only."""
    value = _MADE.get(key)
    if value is None:
        value = _MADE[key] = make()
    return value


def _nan_and_zero(device: torch.device, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """A 0-dim NaN and zero of ``dtype`` on ``device``."""
    return _made_once(("nan, zero", device, dtype), lambda: (torch.full((), math.nan, dtype=dtype, device=device),
                                                            torch.zeros((), dtype=dtype, device=device)))


def _nan_rows(device: torch.device) -> torch.Tensor:
    """``[[1], [0]]`` (float32) on ``device``: ``u * it`` is ``[u, u * 0]`` in one kernel."""
    def make():
        rows = torch.zeros((2, 1), dtype=torch.float32, device=device)
        rows[0].fill_(1.0)
        return rows
    return _made_once(("nan rows", device), make)


def _flag_matrix(n: int, device: torch.device) -> torch.Tensor:
    """The constant matrix of :func:`flags_of` for ``n`` values, made once per ``n`` and device.

    Its columns are the tests ``[nan(u_0..u_n-1), nan(loss), nan(NaN), bad(u_0..u_n-1), bad(loss),
    bad(NaN)]`` ("bad": inf or NaN); its rows the flags laid out as ``FLAG_LAYOUT``, each from the
    sources ``(1, overflow, nan, bad_loss, scale_overflow, clean)``.
    """
    def make():
        width = n + 2
        loss_bad = width + n  # column of the loss's "inf or NaN" test
        # The weight that outweighs any count: above n + 1, and a power of two, so it is exact in any
        # reduced-precision mode a product may run in (TF32 keeps 10 mantissa bits).
        big = 2.0 ** math.ceil(math.log2(n + 2))
        sources = torch.zeros((6, 2 * width), dtype=torch.float32, device=device)
        sources[0, n + 1].fill_(1.0)                  # 1: the NaN constant's test, always set
        sources[1, width:loss_bad + 1].fill_(1.0)     # overflow: any value inf or NaN, the loss included
        sources[2, :n].fill_(1.0)                     # nan: any gradient value NaN
        sources[3, loss_bad].fill_(1.0)               # bad_loss
        sources[4, width:loss_bad].fill_(1.0)         # scale_overflow: any gradient value inf or NaN ...
        sources[4, loss_bad].fill_(-big)              # ... unless the loss was bad (the clamp takes it to 0)
        sources[5, n + 1].fill_(1.0)                  # clean: 1 ...
        sources[5, width:loss_bad + 1].fill_(-big)    # ... unless any value was inf or NaN
        return torch.stack([sources[i] for i in FLAG_LAYOUT])
    return _made_once(("flag matrix", device, n), make)


def bit_weights(like: torch.Tensor) -> torch.Tensor:
    """``[1, 2, 4]`` on ``like``'s device and dtype, made once: a flag vector's ``[overflow, nan, bad]``
    dotted with it is one number that carries all three (``Flags.read``'s one ``.item()``)."""
    return _made_once(("bit weights", like.device, like.dtype),
                      lambda: torch.exp2(torch.arange(3, dtype=like.dtype, device=like.device)))


def derive_(vector: torch.Tensor) -> torch.Tensor:
    """Fill a flag vector's last two entries from its first four, in place, and return it: the overflow
    the scale answers (``overflow - bad_loss``: a bad loss is always an overflow too) and clean
    (``1 - overflow``). Two kernels. For flags made from the four (a MAX, a NaN test), which cannot
    say "and not"."""
    torch.sub(vector[1], vector[3], out=vector[SCALE_OVERFLOW])
    torch.sub(vector[0], vector[1], out=vector[CLEAN])
    return vector


def laid_out(parts) -> torch.Tensor:
    """``(1, overflow, nan, bad_loss)`` (four float 0-dim tensors, one dtype) stacked as the tensor rules
    take them (:data:`lossscale.policy.FLAG_LAYOUT`), then :func:`derive_`: three kernels."""
    vector = torch.empty(len(FLAG_LAYOUT), dtype=parts[0].dtype, device=parts[0].device)
    torch.stack([parts[i] for i in FLAG_LAYOUT[:SCALE_OVERFLOW]], out=vector[:SCALE_OVERFLOW])
    return derive_(vector)


def from_bools(bools: torch.Tensor) -> torch.Tensor:
    """:func:`flag_bools`' vector as the float32 flags the tensor rules take (:func:`derive_` adds the
    last two). Three kernels."""
    vector = torch.empty(len(FLAG_LAYOUT), dtype=torch.float32, device=bools.device)
    vector[:SCALE_OVERFLOW].copy_(bools)
    return derive_(vector)


def combined(vectors: List[torch.Tensor]) -> torch.Tensor:
    """The flag vectors of several checks (one per optimizer) as one: the MAX of each entry (any
    overflow, any NaN, ...), then :func:`derive_` (a MAX of "clean" would say clean where one check
    overflowed). Four kernels."""
    return derive_(torch.stack(vectors).amax(0))


def zero_on(device: torch.device) -> torch.Tensor:
    """A float32 0-dim zero on ``device``, made once (no launch per call). Read it only."""
    return _nan_and_zero(device, torch.float32)[1]


def loss_nan(loss_check: torch.Tensor) -> torch.Tensor:
    """The loss check (non-finite where a loss was non-finite before scaling: the loss itself, or
    ``x - x`` summed) times 0: NaN exactly where a loss was non-finite, else 0. One kernel."""
    return loss_check * 0


def bad_loss_flag(loss_check: torch.Tensor) -> torch.Tensor:
    """The loss check as a float32 0/1 flag (1: a loss was non-finite before scaling), which reduces
    across ranks exactly (a MAX over a NaN need not). Three kernels."""
    return torch.isnan(loss_nan(loss_check)).float()


def flag_bools(amax: torch.Tensor, loss_check: Optional[torch.Tensor]) -> torch.Tensor:
    """The counters' flags (the first :data:`~lossscale.policy.SCALE_OVERFLOW` entries of
    :data:`~lossscale.policy.FLAG_LAYOUT`) as bools, from one NaN test, for a host that reads them
    (:func:`read_four_bools` of the first four); :func:`from_bools` makes the float vector a tensor
    rule needs (NaN tests cannot say "and not").

    ``amax``: a NaN-propagating max |g| (or a norm: never -inf); ``loss_check``: non-finite where a
    loss was non-finite before scaling, or None. The values tested: ``loss_check * 0 + amax * 0`` is
    NaN exactly when the gradients held an inf or a NaN (``inf * 0`` is NaN) or the loss was bad (the
    overflow, a bad loss included); ``amax`` itself when they held a NaN; ``loss_check * 0`` when the
    loss was bad; a NaN constant gives the leading 1 (the step itself, for the counters).
    """
    nan, zero = _nan_and_zero(amax.device, amax.dtype)
    bad = zero if loss_check is None else loss_nan(loss_check).to(amax.dtype)
    sources = (nan, torch.addcmul(bad, amax, zero), amax, bad)
    return torch.isnan(torch.stack([sources[i] for i in FLAG_LAYOUT[:SCALE_OVERFLOW]]))


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
