"""The gradient check: one optimizer's gradients gathered, checked for inf/NaN, unscaled or clipped.

What ``unscale_``, ``step`` and ``clip_grad_norm_`` share. Three ways to look at the gradients, each
one pass over them:

* **check and unscale** (optimizers without amp-scaling support): torch's fused kernel
  ``_amp_foreach_non_finite_check_and_unscale_``, one read and write, the same work as torch's scaler.
  It cannot tell NaN from inf, so on an overflow (which the host knows: it read the decision) one more
  read pass, :func:`largest_magnitudes`, does. Overflows are rare: a clean iteration pays torch's pass.
* **read only** (fused optimizers, which unscale themselves, and measuring policies): the largest
  magnitude of every gradient, NaN where it holds a NaN. One read, nothing written; the overall
  maximum tells clean, inf and NaN apart and is a measuring policy's ``amax``.
* **clip** (:func:`clip_scaled_`): the norm of the scaled gradients is the check, then one multiply
  unscales and clips.

**The flag contract.** Every ``found_inf`` handed on is a float32 0-dim tensor holding exactly 0.0 or
1.0: torch's fused optimizers skip only when ``found_inf == 1.0`` and otherwise *step*, subtracting
``found_inf`` from their step counters, so a sum of two flags (2.0) would write NaN into the weights.
Flags are combined with ``maximum`` or a MAX all-reduce, never added (``tests/test_skip_matrix.py``).

Across ranks the flags (and a measuring policy's amax) ride in one MAX all-reduce, so every rank
skips or steps together; the NaN pass after an overflow adds one more, on overflow steps only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set

import torch

__all__ = [
    "Gathered",
    "Flags",
    "found_inf",
    "combine",
    "GradientCheck",
    "largest_magnitudes",
    "inverse",
    "clip_scaled_",
    "validate_clip",
]

Groups = Dict[torch.device, Dict[torch.dtype, List[torch.Tensor]]]


def inverse(scale: torch.Tensor) -> torch.Tensor:
    """``1/scale`` as float32, bitwise torch's ``scale.double().reciprocal().float()``, in one float32
    operation and no float64 tensor (devices without float64, MPS and some Intel XPUs, run it as any other).

    Why the same value: float32 ``reciprocal`` is IEEE division ``1/scale`` rounded once to float32 (on
    the CPU; on CUDA too, where ``1.0f/x`` is compiled IEEE-correct unless built with fast-math). torch's
    route rounds the exact quotient to float64 first, then to float32; rounding twice through a format
    of p >= 2q + 2 bits (53 >= 2*24 + 2) is innocuous for division (Figueroa, "When is double rounding
    innocuous?", 1995), so both give the correctly rounded float32 quotient, subnormal ones included
    (scales above 2**126). Powers of two, every scale a dynamic policy reaches, are exact either way.
    Checked against torch's route over every binade and random float32 scales (tests/test_state.py)."""
    return scale.reciprocal()


def group_grads(tensors: List[torch.Tensor]) -> Groups:
    """Split tensors by device and dtype, the unit a foreach kernel accepts."""
    groups: Groups = {}
    for t in tensors:
        groups.setdefault(t.device, {}).setdefault(t.dtype, []).append(t)
    return groups


def _amax_aminmax(grads: List[torch.Tensor]) -> torch.Tensor:
    """max|g| per tensor from ``aminmax``, one vectorised read each: ``max(hi, -lo)`` (maximum keeps
    NaN, and -(-inf) = inf)."""
    lo, hi = zip(*map(torch.aminmax, grads))
    return torch.maximum(torch.stack(hi), torch.stack(lo).neg_())


def _amax_foreach_norm(grads: List[torch.Tensor]) -> torch.Tensor:
    """max|g| per tensor as ``_foreach_norm(ord=inf)``: one multi-tensor kernel whatever the number of
    tensors (CUDA's takes ``max_propagate_nan``: a NaN anywhere makes that tensor's value NaN)."""
    return torch.stack(torch._foreach_norm(grads, math.inf))


#: The read-only max|g| kernel per device type, chosen by measurement. On CPU ``aminmax`` per tensor is
#: as fast as torch's check kernel, where ``_foreach_norm(inf)`` takes a slow path at 8x the time (60 ms
#: against 7 ms for 7.9M values, one thread); elsewhere the multi-tensor kernel, since a launch per
#: tensor costs more than the read for small tensors. A 2-norm would be one read too, but it overflows
#: float32 for finite scaled gradients past ~1.8e19: a false overflow torch would not see.
AMAX_KERNELS = {"cpu": _amax_aminmax}


def largest_magnitudes(grads: List[torch.Tensor], device: torch.device):
    """max|g| of every gradient (NaN where it holds a NaN, inf where it holds an inf and no NaN): one
    read per (device, dtype) group, nothing written. Returns the per-tensor float32 vectors (one per
    group), their maximum on ``device`` (``max`` keeps NaN: NaN if any gradient held one), and the index
    in ``grads`` of each value, in the vectors' order."""
    groups: Dict[tuple, List[int]] = {}
    for i, g in enumerate(grads):
        groups.setdefault((g.device, g.dtype), []).append(i)
    vectors, order = [], []
    for (grad_device, _), indices in groups.items():
        kernel = AMAX_KERNELS.get(grad_device.type, _amax_foreach_norm)
        vectors.append(kernel([grads[i] for i in indices]).float().to(device))
        order += indices
    if not vectors:
        return [], torch.zeros((), dtype=torch.float32, device=device), order
    return vectors, (vectors[0] if len(vectors) == 1 else torch.cat(vectors)).max(), order


@dataclass
class Gathered:
    """One optimizer's gradients as checked: ``grads[i]`` is the tensor checked for ``params[i]``.

    ``all_params``: every parameter with a gradient, in the optimizer's order, empty local shards
    included; ``sharded``: whether the parameters are DTensors (FSDP2). Both are the same on every
    rank, unlike ``params`` (a rank may hold only empty shards), so collectives are decided on them.
    """

    params: List[torch.Tensor]
    grads: List[torch.Tensor]
    all_params: List[torch.Tensor] = field(default_factory=list)
    sharded: bool = False


@dataclass
class Flags:
    """Why one optimizer's step is skipped, if it is: what its check learned, on the state's device and
    reduced across ranks. Each reason is a bool 0-dim tensor (0 or 1: combined with ``|``, reduced with
    a MAX); several may hold at once.

    Attributes:
        overflow: a gradient was inf or NaN: the scale's business (the policy backs off).
        nan: a gradient held NaN. The synced path learns it after its readout, on overflow steps only
            (:meth:`GradientCheck.nan_pass`); until then it is False.
        bad_loss: a loss (or a traced forward output) was non-finite before scaling, or every
            micro-batch was dropped (``bad_microbatch``): skipped, the scale kept.
        spike: ``skip_if`` judged the finite step a spike: skipped, the scale kept. None without it.
        amax: max|g| of the scaled gradients (float32 0-dim) for a measuring policy, else None.
        skipped: the skip decision read on the host (the one readout: where the check read it, else on
            the first :meth:`was_skipped`), None until read.
        params, amax_vectors: the parameters and their max|g| (NaN/inf where one held it), in the
            same order, for ``overflow_report``; empty where not measured.
        skip: derived, never given: ``overflow | bad_loss | spike``, THE device flag of the decision.
            torch's ``found_inf`` is ``skip`` as float32 (:func:`found_inf`), made where a torch
            kernel or API needs it.
    """

    overflow: torch.Tensor
    nan: torch.Tensor
    bad_loss: torch.Tensor
    spike: Optional[torch.Tensor] = None
    amax: Optional[torch.Tensor] = None
    skipped: Optional[bool] = None
    params: List[torch.Tensor] = field(default_factory=list)
    amax_vectors: List[torch.Tensor] = field(default_factory=list)
    skip: torch.Tensor = field(init=False)

    def __post_init__(self):
        skip = self.overflow | self.bad_loss
        self.skip = skip if self.spike is None else skip | self.spike

    def was_skipped(self) -> bool:
        """The decision on the host: :attr:`skipped`, else ``skip`` read now (one sync) and kept."""
        if self.skipped is None:
            self.skipped = bool(self.skip.item())
        return self.skipped

    def learn_nan(self, nan: torch.Tensor, params: List[torch.Tensor], vectors: List[torch.Tensor]) -> None:
        """What :meth:`GradientCheck.nan_pass` found after a synced overflow (the reasons' one late news)."""
        self.nan, self.params, self.amax_vectors = nan, params, vectors


def found_inf(flags: Flags) -> torch.Tensor:
    """torch's ``found_inf`` for ``flags``: the skip flag as a float32 0-dim tensor holding 0.0 or 1.0,
    what a fused optimizer reads (and skips on when it is 1.0) and torch's records hold."""
    return flags.skip.float()


def combine(flags: List[Flags], device: torch.device) -> Flags:
    """The flags of several checks (one per optimizer) as one: each reason OR-ed, amax the largest (the
    flag contract: never a sum). The host decision is known when every one's is."""
    if len(flags) == 1:
        return flags[0]
    amaxes = [f.amax.to(device) for f in flags if f.amax is not None]
    spikes = [f.spike.to(device) for f in flags if f.spike is not None]
    known = [f.skipped for f in flags]
    return Flags(
        overflow=_any([f.overflow for f in flags], device),
        nan=_any([f.nan for f in flags], device),
        bad_loss=_any([f.bad_loss for f in flags], device),
        spike=_any(spikes, device) if spikes else None,
        amax=torch.stack(amaxes).max() if amaxes else None,
        skipped=None if None in known else any(known),
    )


def _any(flags: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    out = flags[0].to(device)
    for flag in flags[1:]:
        out = out | flag.to(device)
    return out


class GradientCheck:
    """Gathers, checks, unscales and reduces one optimizer's gradients at a time.

    Args:
        name_of: ``param -> name`` for error messages.
        process_group: the scaler's ``process_group`` setting ("default", None or a group); resolved
            at every use, so a scaler built before ``init_process_group`` picks the group up.
    """

    def __init__(self, name_of: Callable[[torch.Tensor], Optional[str]], process_group: Any):
        self._name_of = name_of
        self.process_group = process_group

    def group(self):
        """The process group the flags are reduced over, or None (one process, or no reduction)."""
        if self.process_group is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return None
        from . import distributed

        return distributed.resolve_group(self.process_group)

    # ------------------------------------------------------------------------------ gathering
    def gather(self, optimizer, allow_half: bool, coalesce: bool = False, known: Optional[Gathered] = None) -> Gathered:
        """The gradients to check (dense tensors, local shards, or the values of sparse ones).

        ``allow_half``: accept FP16 gradients (else a ValueError that says what to do).
        ``coalesce``: coalesce every sparse gradient (norms need it); FP16 sparse ones are always
        coalesced, like torch, because a sum of duplicate scaled fp16 values may overflow.
        ``known``: this optimizer's gradients gathered a moment ago with ``allow_half=True`` and no
        ``coalesce``, nothing having changed them since: returned as they are, unless FP16 ones are
        among them and must now be refused (then gathered afresh, which says which).
        """
        if known is not None and not coalesce and (allow_half or all(g.dtype != torch.float16 for g in known.grads)):
            return known
        grads, params, half, every = [], [], [], []
        sharded = False
        for gi, group in enumerate(optimizer.param_groups):
            for pi, param in enumerate(group["params"]):
                if not isinstance(param, torch.Tensor):
                    raise ValueError(f"optimizer.param_groups[{gi}]['params'][{pi}] is not a tensor.")
                grad = param.grad
                if grad is None:
                    continue
                every.append(param)
                if not allow_half and grad.dtype == torch.float16:
                    half.append(self._name_of(param) or f"param_groups[{gi}][{pi}] {tuple(param.shape)}")
                    continue
                if grad.is_sparse:
                    if (coalesce or grad.dtype == torch.float16) and not grad.is_coalesced():
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                elif isinstance(getattr(grad, "_local_tensor", None), torch.Tensor):
                    # A DTensor (on every rank alike): its local shard, whose in-place ops update it.
                    sharded, grad = True, grad._local_tensor
                if grad.numel() == 0:
                    continue  # an empty local shard (FSDP2: dim 0 smaller than the world): nothing to check
                grads.append(grad)
                params.append(param)
        if half:
            raise ValueError(
                f"{len(half)} parameter(s) have FP16 gradients ({', '.join(half[:5])}"
                f"{', ...' if len(half) > 5 else ''}): unscaling them in FP16 would flush the small ones, "
                "the very values loss scaling protects. Keep the parameters in FP32 and run the forward "
                "under torch.autocast(device_type, dtype=torch.float16) (FP32 master weights), use an "
                "optimizer that unscales itself in float32 (e.g. torch.optim.AdamW(fused=True)), or accept "
                "the flushing with GradScaler(allow_fp16=True), as torch's ShardedGradScaler does (the "
                "flushed values are counted in metrics() and health())."
            )
        return Gathered(params, grads, every, sharded)

    def claim(self, gathered: Gathered, unscaled: Set[int]) -> None:
        """Refuse gradients already unscaled this iteration (``unscaled``: their parameters' ids, which
        this adds to) before anything is rewritten: an optimizer wrapper (Fabric's, accelerate's) and its
        inner optimizer hold the same parameters, and torch's scaler, which keys by optimizer object,
        would divide them by the scale twice."""
        ids = set(map(id, gathered.params))
        again = ids & unscaled
        if again:
            names = [self._name_of(p) or f"param {tuple(p.shape)}" for p in gathered.params if id(p) in again]
            raise RuntimeError(
                f"{len(again)} gradient(s) were already unscaled in this iteration ({', '.join(names[:5])}"
                f"{', ...' if len(names) > 5 else ''}): unscale_()/clip_grad_norm_() reached them through "
                "another optimizer object over the same parameters (an optimizer wrapper such as Fabric's "
                "or accelerate's, and its inner optimizer). Dividing by the scale twice would shrink them "
                "silently; unscale through one of the two objects only."
            )
        unscaled |= ids

    # ------------------------------------------------------------------------------ the checks
    def check_and_unscale(
        self,
        gathered: Gathered,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        flushed: Optional[torch.Tensor] = None,
    ):
        """torch's fused check+unscale over the gathered gradients, per (device, dtype); returns
        ``{device: found_inf}``, as torch's ``_unscale_grads_`` (``found_inf`` is the entry on its
        own device, set to 1.0 where a gradient was inf or NaN). ``flushed``: see :func:`_counting_flushed`."""
        per_device = {}
        for device, per_dtype in group_grads(gathered.grads).items():
            flag = found_inf if found_inf.device == device else torch.zeros_like(found_inf, device=device)
            inv = inv_scale.to(device)
            for grads in per_dtype.values():
                if flushed is None:
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv)
                else:
                    _counting_flushed(flushed, torch._amp_foreach_non_finite_check_and_unscale_, grads, flag, inv)
            per_device[device] = flag
        return per_device

    def multiply_(
        self, gathered: Gathered, inv_scale: torch.Tensor, unscaled: Set[int], flushed: Optional[torch.Tensor] = None
    ) -> None:
        """Unscale the gathered gradients by ``inv_scale`` where the check already ran (the read-only
        pass): a plain multiply per (device, dtype), the same values as torch's check+unscale kernel (which
        multiplies in the same precision) at half its cost on CPU (3.4 against 7.3 ms for 7.9M values, one
        thread: it skips the finiteness test). ``unscaled``: see :meth:`claim`; ``flushed``: see
        :func:`_counting_flushed`."""
        self.claim(gathered, unscaled)
        for device, per_dtype in group_grads(gathered.grads).items():
            inv = inv_scale.to(device)
            for grads in per_dtype.values():
                if flushed is None:
                    torch._foreach_mul_(grads, inv)
                else:
                    _counting_flushed(flushed, torch._foreach_mul_, grads, inv)

    def flags(
        self,
        overflow: torch.Tensor,
        nan: torch.Tensor,
        bad_loss: torch.Tensor,
        spike: Optional[torch.Tensor] = None,
        amax: Optional[torch.Tensor] = None,
        sync: bool = False,
        params=(),
        vectors=(),
    ) -> Flags:
        """This rank's reasons (bool 0-dim tensors on the state's device) as :class:`Flags`, reduced across
        ranks in one collective (a measuring policy's ``amax`` riding along); with ``sync`` the decision is
        read on the host (THE sync of the iteration, as torch's ``.item()`` in ``step()``)."""
        group = self.group()
        if group is not None:
            from . import distributed

            overflow, nan, bad_loss, spike, amax = distributed.all_reduce_flags(
                overflow, nan, bad_loss, spike, amax, group
            )
        flags = Flags(overflow, nan, bad_loss, spike, amax, params=list(params), amax_vectors=list(vectors))
        if sync:
            flags.was_skipped()
        return flags

    def nan_pass(self, gathered: Gathered, device: torch.device):
        """After a synced overflow: whether it held NaN, and which gradients were bad (for the report), as
        ``(nan, params, vectors)`` for :meth:`Flags.learn_nan`. One more read pass; on overflow steps only,
        so every rank (the decision was reduced) runs it, and joins its one collective."""
        vectors, amax, order = largest_magnitudes(gathered.grads, device)
        nan = torch.isnan(amax)
        group = self.group()
        if group is not None:
            from . import distributed

            nan = distributed.all_reduce_any(nan, group)
        return nan, [gathered.params[i] for i in order], vectors


def _counting_flushed(flushed: torch.Tensor, unscale: Callable, grads: List[torch.Tensor], *args) -> None:
    """``unscale(grads, *args)`` for one (device, dtype) group, and where the gradients are half precision
    (FP16, bf16: ``allow_fp16``), add to ``flushed`` the values it turned to zero: counted before and
    after, two more reads, so the underflow the user accepted is visible (``metrics()``, ``health()``)."""
    half = grads[0].dtype in (torch.float16, torch.bfloat16)
    if half:
        before = torch.stack([torch.count_nonzero(g) for g in grads]).sum()
    unscale(grads, *args)
    if half:
        flushed.add_((before - torch.stack([torch.count_nonzero(g) for g in grads]).sum()).to(flushed.device))


# ------------------------------------------------------------------------------------------ clip
# Norm types whose per-tensor kernels (sum |x|, sum x*x then sqrt, max |x|) scale exactly by 2**k.
_SCALE_EXACT = (1.0, 2.0, math.inf)


def validate_clip(max_norm, norm_type) -> float:
    """Check ``clip_grad_norm_``'s arguments before anything changes; returns ``norm_type`` as a float."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or math.isnan(max_norm) or max_norm < 0:
        raise ValueError(f"max_norm={max_norm!r} must be a number >= 0 (inf: no clipping, only the norm).")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise ValueError(
            f"norm_type={norm_type!r} must be > 0 or inf (2.0 is the usual choice); the 0-'norm' and "
            "negative orders do not scale with the gradients, so they cannot be taken from scaled ones."
        )
    return float(norm_type)


def _torch_groups(grads: List[torch.Tensor]):
    """``(tensors, their indices in grads)`` per (device, dtype), in torch's clip_grad_norm_ order."""
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

    return [
        (tensors[0], indices)
        for tensors, indices in _group_tensors_by_device_and_dtype([grads], with_indices=True).values()
    ]


def clip_scaled_(
    grads: List[torch.Tensor],
    scale: torch.Tensor,
    inv_scale: torch.Tensor,
    max_norm: float,
    norm_type: float,
    counted: Optional[List[bool]] = None,
    reduce_norm: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
):
    """Unscale and clip the *scaled* ``grads`` in place by their true total norm, in two passes, not three.

    torch's recipe (``unscale_`` then ``clip_grad_norm_``) reads every gradient three times and writes
    it twice. Here the norm of the scaled gradients is taken first (one read; an inf or NaN anywhere makes
    it inf or NaN, so it is the check too), and one multiply by ``coef / S`` unscales and clips::

        total    = vector_norm(stack(foreach_norm(g)))          # torch's kernels and grouping
        true     = total * (1/S)                                # = ||g / S||
        coef     = clamp(max_norm / (true + 1e-6), max=1)       # torch's expression, verbatim
        g       <- g * (coef * (1/S))  if true is finite, else  g * (1/S)   (unscale only: inf stays inf)

    With S = 2**k each step is torch's on values scaled by an exact power of two, so the result is
    bitwise torch's while no value on either path leaves float32's normal range (``tests/test_clip.py``
    plants values on both sides). The norm of scaled gradients overflows when ``S * ||g||`` passes
    float32's range (~1.8e19) with every gradient finite: counted as an overflow. Norm types other than 1,
    2 and inf take ``pow``, which does not commute with scaling, so those are unscaled first (torch's
    three passes) and only the check is saved.

    Sharded gradients: ``counted``/``reduce_norm`` from ``lossscale.distributed.norm_reduction`` turn
    the norm of the parts this rank counts into the total (one all-reduce), the same on every rank.

    Returns ``(true_norm, total, per_tensor, order)``: the true norm (a tensor on ``scale``'s device:
    no sync), the scaled total whose finiteness is the check, the per-tensor norms of the scaled
    gradients (a NaN or inf one names its tensor) and the index into ``grads`` of each.
    """
    device = scale.device
    groups = _torch_groups(grads) if grads else []
    exact = norm_type in _SCALE_EXACT
    norms, order = [], []
    for tensors, indices in groups:
        if not exact:  # unscale first: these norms are torch's only when taken of unscaled values
            torch._foreach_mul_(tensors, inv_scale.to(tensors[0].device))
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
        per_tensor = stacked.float().to(device)
    bad = ~torch.isfinite(total)  # this rank's gradients, copies included
    if reduce_norm is not None:
        mine = [n for n, i in zip(moved, order) if counted is None or counted[i]]
        local = total
        if len(mine) < len(moved):
            local = (
                torch.linalg.vector_norm(torch.stack(mine), norm_type)
                if mine
                else torch.zeros((), dtype=torch.float32, device=first)
            )
            # A copy counted elsewhere adds nothing, unless it holds inf/NaN: then so does the total.
            copies = torch.linalg.vector_norm(
                torch.stack([n for n, i in zip(moved, order) if not counted[i]]), norm_type
            )
            local = local + torch.where(torch.isfinite(copies), 0.0, copies)
        total = reduce_norm(local.to(device))
        bad = bad.to(device) | ~torch.isfinite(total)
    inv = inv_scale.to(total.device) if exact else torch.ones_like(inv_scale, device=total.device)
    true_norm = total * inv  # exact: ||g|| / S == ||g / S|| for S = 2**k
    clip_coef = max_norm / (true_norm + 1e-6)
    clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
    # On overflow the multiplier is 1/S alone (fmax passes over the NaN or 0 coefficient of a bad norm).
    multiplier = torch.fmax(clip_coef_clamped, bad.to(clip_coef_clamped.dtype)) * inv
    for tensors, _ in groups:
        torch._foreach_mul_(tensors, multiplier.to(tensors[0].device))
    return true_norm.to(device), total.to(device), per_tensor, order
