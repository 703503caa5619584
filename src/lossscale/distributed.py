"""torch.distributed support: which group a scaler reduces over, a consistency check, pipeline stages.

What :class:`lossscale.GradScaler` does across ranks (its gradient check calls :func:`all_reduce_flags`)::

    per optimizer, in unscale_() or step():             # the same calls, in the same order, on every rank
        found_inf, found_nan = check(local gradients)   # a DTensor gradient: its local shard; none: 0, 0
        found_inf, found_nan = all_reduce(MAX, [found_inf, found_nan], group)   # one collective
                                              # (needs_amax policies: [found_inf, found_nan, amax] in that one)
        skip = found_inf                                # the same on every rank, so is the step
        if skip and the kernel could not tell NaN from inf (sync path):
            found_nan = all_reduce(MAX, local NaN flag, group)                   # overflow steps only
    update(): the policy sees the reduced flags, so every rank keeps the same scale and counters

``clip_grad_norm_`` adds one collective before the flags' one, when the gradients are spread over
ranks (DTensors, or a ``norm_group`` such as a pipeline's): the norm's partial power sum (see
:func:`norm_reduction`).

The flags, not the gradients' max, decide: a MAX over values holding NaN is not defined the same
way by every backend (NCCL and gloo may drop it), while 0/1 flags reduce exactly. A needs_amax
policy's amax rides along with its non-finite values sent as 0; the policy ignores it on overflow.

Nothing here moves data except through torch.distributed collectives. The functions take process
groups and tensors; the three that take a scaler use only its public methods.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from typing import Any, Callable, List, Optional, Tuple

import torch

from .policy import ScaleState

__all__ = [
    "reduction_group",
    "resolve_group",
    "all_reduce_flags",
    "all_reduce_any",
    "norm_reduction",
    "all_reduce_norm",
    "replica_copies",
    "check_consistency",
    "init_stage",
    "reduce_stats",
]


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def resolve_group(group: Any) -> Optional["torch.distributed.ProcessGroup"]:
    """The ProcessGroup a ``process_group`` setting reduces over now, or None for no reduction.

    Evaluated at every use, so a scaler built before ``init_process_group`` picks the group up.
    """
    if group is None or not _dist_ready():
        return None
    if isinstance(group, str):  # "default" (the scaler refuses any other string)
        return torch.distributed.group.WORLD if torch.distributed.get_world_size() > 1 else None
    if not isinstance(group, torch.distributed.ProcessGroup):  # NON_GROUP_MEMBER
        return None
    return group


def _require_scaler(scaler: Any, call: str):
    # Duck-typed: this module must not import the scaler (it is one of the scaler's parts).
    if not all(callable(getattr(scaler, m, None)) for m in ("state", "init_device", "is_enabled")):
        raise ValueError(f"{call} takes a lossscale.GradScaler, got {type(scaler).__name__}.")


def reduction_group(scaler) -> Optional["torch.distributed.ProcessGroup"]:
    """The process group over which ``scaler`` all-reduces its skip decision now; None if it does not.

    ``process_group="default"`` resolves to ``torch.distributed.group.WORLD`` once torch.distributed
    is initialised with more than one rank, and to None before (or with one rank). No sync.
    """
    _require_scaler(scaler, "reduction_group()")
    return resolve_group(scaler.process_group)


def all_reduce_flags(
    overflow: torch.Tensor,
    nan: torch.Tensor,
    bad_loss: torch.Tensor,
    spike: Optional[torch.Tensor],
    amax: Optional[torch.Tensor],
    group,
):
    """MAX-reduce the check's reasons (bool 0-dim tensors; ``spike`` and ``amax`` where given) over
    ``group`` in ONE collective; returns them in the same order and types. No host sync.

    ``amax`` (a needs_amax policy's max |g|) is sent as 0 where it is inf or NaN: a MAX over a NaN
    is not reliably NaN on gloo or NCCL (gloo keeps or drops it by rank order), and it need not be.
    A non-finite amax has set this rank's flags, which reduce exactly, and a needs_amax policy
    ignores the amax of an overflow step.
    """
    parts = [overflow, nan, bad_loss] + ([spike] if spike is not None else [])
    values = [p.float() for p in parts] + ([amax.nan_to_num(0.0, 0.0, 0.0)] if amax is not None else [])
    stacked = torch.stack(values)
    torch.distributed.all_reduce(stacked, op=torch.distributed.ReduceOp.MAX, group=group)
    reduced = list(stacked.unbind(0))
    reduced_amax = reduced.pop() if amax is not None else None
    flags = [r > 0 for r in reduced]
    return flags[0], flags[1], flags[2], flags[3] if spike is not None else None, reduced_amax


def all_reduce_any(flag: torch.Tensor, group) -> torch.Tensor:
    """A bool 0-dim ``flag`` OR-ed over ``group`` (a MAX of 0/1: exact on every backend). No host sync."""
    value = flag.float()
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=group)
    return value > 0


def norm_reduction(
    all_params: List[torch.Tensor],
    params: List[torch.Tensor],
    norm_type: float,
    norm_group: Any = None,
    expert_parallel: Any = None,
) -> Tuple[Optional[Callable[[torch.Tensor], torch.Tensor]], Optional[List[bool]]]:
    """How ``clip_grad_norm_`` turns this rank's gradients into the total norm: ``(reduce, counted)``.

    ``reduce`` maps the norm of the gradients this rank counts to the norm of all of them (one
    all-reduce, :func:`all_reduce_norm`), or is None when this rank's norm already is the total;
    ``counted[i]`` says whether this rank counts ``params[i]``'s gradient (None: all of them). The
    group and what is counted are decided on ``all_params`` (every parameter with a gradient, the
    same on every rank, empty local shards included) and ``norm_group`` only, never on values, so
    every rank takes the same collective or none::

        norm_group None (default): derived from the gradients
            no DTensor gradient                  -> no reduction (DDP's gradients are copies; one process)
            DTensor gradients, all on one mesh   -> the mesh's ranks: its group (1-D), or the world when
                                                    the mesh spans it; plain-tensor gradients beside
                                                    them are refused (copies or parts? not knowable)
        norm_group given (pipelines)             -> that group; it must hold every DTensor's mesh, and
                                                    each rank's plain gradients count as its own part
        a DTensor gradient is counted where this rank's mesh coordinate is 0 on every mesh dim
        where it is Replicate (one copy of each shard), and reduced over the dims where it is Shard
        expert_parallel=(expert params, ep group) (mixture-of-experts), over norm_group or the world:
            expert gradients                     -> each EP rank holds other experts: counted on the
                                                    ranks of one EP group (the one holding the lowest
                                                    rank of the reduction); the other EP groups hold
                                                    copies (expert data parallel)
            other plain gradients                -> copies on every rank (data parallel): counted once,
                                                    on the lowest rank
            DTensor gradients (FSDP2)            -> as above, on a mesh of every rank of the reduction

    torch's ``clip_grad_norm_`` on DTensors reduces with the same ``x**p``, SUM, ``**(1/p)``
    (``_NormPartial``), but the vector of per-tensor norms, one collective per mesh dim; here it is
    each rank's total in one collective over the group, so the two agree to rounding (FSDP1 reduces
    the total as here).

    Raises:
        ValueError: ``norm_group`` is not a process group; a gradient is a Partial DTensor (its local
            values are not the gradient); the gradients lie on several meshes, or mix DTensors and
            plain tensors, without a ``norm_group``; a mesh of more than one dim that is not the
            whole world, without a ``norm_group``; a mesh with ranks outside ``norm_group``; this
            rank is outside ``norm_group``. Decided on the layout, not on values, so every rank with
            the same layout raises alike.

    No host-device sync (placements and meshes are host objects).
    """
    if norm_group is not None and torch.distributed.is_available():
        from torch.distributed.distributed_c10d import GroupMember

        if norm_group is GroupMember.NON_GROUP_MEMBER:
            raise ValueError("clip_grad_norm_: this rank is not in norm_group; pass a group that holds it.")
    if norm_group is not None and not (
        torch.distributed.is_available() and isinstance(norm_group, torch.distributed.ProcessGroup)
    ):
        raise ValueError(
            f"norm_group={norm_group!r} ({type(norm_group).__name__}) must be None (derived from the DTensor "
            "gradients) or a torch.distributed ProcessGroup holding every rank whose gradients make up the "
            "norm: for a pipeline of plain stages its pipeline group, for pipeline x FSDP/TP the world "
            "(torch.distributed.group.WORLD)."
        )
    if expert_parallel is not None:
        experts, ep_group = _expert_parallel(expert_parallel)
    if not _dist_ready():
        return None, None
    meshes, copies, plain = [], {}, False
    for p in all_params:
        grad = p.grad
        if not hasattr(grad, "_local_tensor"):  # a plain tensor
            plain = True
            continue
        if any(pl.is_partial() for pl in grad.placements):
            raise ValueError(
                f"a gradient of shape {tuple(p.shape)} is a DTensor with placements {grad.placements}: its "
                "local values are partial sums, not the gradient, so its norm cannot be taken from them. "
                "Redistribute it to Shard or Replicate before clipping (torch would all-reduce it whole)."
            )
        if not any(grad.device_mesh is m for m in meshes):
            meshes.append(grad.device_mesh)
        copies[id(p)] = _is_copy(grad)
    if expert_parallel is not None:
        return _expert_reduction(params, experts, ep_group, meshes, copies, norm_type, norm_group)
    if norm_group is None:
        if not meshes:
            return None, None
        distinct = {(tuple(m.shape), tuple(m.mesh.flatten().tolist())) for m in meshes}
        if len(distinct) > 1 or plain:
            raise ValueError(
                "clip_grad_norm_: the gradients "
                + ("lie on several device meshes" if len(distinct) > 1 else "mix DTensors and plain tensors")
                + ", so lossscale cannot tell which ranks hold copies of a gradient and which hold other "
                "parts. Put every parameter on one mesh (torch's clip_grad_norm_ needs that too), or pass "
                "norm_group=<the group of every rank whose gradients make up the norm> (then a rank's plain "
                "gradients count as its own part, as in a pipeline stage)."
            )
        mesh = meshes[0]
        if mesh.ndim == 1:
            group = mesh.get_group()
        elif mesh.size() == torch.distributed.get_world_size():
            group = torch.distributed.group.WORLD
        else:
            raise ValueError(
                f"clip_grad_norm_: the gradients lie on a {mesh.ndim}-D mesh of {mesh.size()} ranks, not the "
                f"world's {torch.distributed.get_world_size()}; pass norm_group=<a group of every rank whose "
                "gradients make up the norm> (for example torch.distributed.group.WORLD with pipeline stages, "
                "or mesh._flatten().get_group())."
            )
    else:
        members = set(torch.distributed.get_process_group_ranks(norm_group))
        for mesh in meshes:
            outside = sorted(set(mesh.mesh.flatten().tolist()) - members)
            if outside:
                raise ValueError(
                    f"clip_grad_norm_: norm_group lacks ranks {outside[:8]} of the gradients' mesh {mesh}: the "
                    "norm would miss their shards. Pass a group that holds every mesh (the world for "
                    "pipeline x FSDP)."
                )
        group = norm_group
    counted = [not copies.get(id(p), False) for p in params]
    return functools.partial(all_reduce_norm, norm_type=norm_type, group=group), counted


def _expert_parallel(value) -> Tuple[set, "torch.distributed.ProcessGroup"]:
    """``expert_parallel=(params, group)`` validated: the ids of the expert parameters, and the group."""
    try:
        params, group = value
        ids = {id(p) for p in params}
    except (TypeError, ValueError):
        raise ValueError(
            f"expert_parallel={value!r} must be a pair (expert parameters, expert-parallel process "
            "group): the parameters of this rank's experts and the group over which the experts are "
            "split."
        ) from None
    if not (torch.distributed.is_available() and isinstance(group, torch.distributed.ProcessGroup)):
        raise ValueError(
            f"expert_parallel: the group {group!r} must be a torch.distributed ProcessGroup (the "
            "expert-parallel group: the ranks that hold different experts); this rank must be in it."
        )
    return ids, group


def _expert_reduction(params, experts, ep_group, meshes, copies, norm_type, norm_group):
    """:func:`norm_reduction` with expert parameters split over ``ep_group``: one SUM all-reduce over the
    reduction group (``norm_group`` or the world), each gradient counted on exactly one rank per copy."""
    group = norm_group if norm_group is not None else torch.distributed.group.WORLD
    members = torch.distributed.get_process_group_ranks(group)
    ep_ranks = torch.distributed.get_process_group_ranks(ep_group)
    rank = torch.distributed.get_rank()
    if rank not in ep_ranks or not set(ep_ranks) <= set(members):
        raise ValueError(
            f"clip_grad_norm_: expert_parallel's group holds ranks {ep_ranks[:8]}, which must include "
            f"this rank ({rank}) and lie within the reduction group (norm_group, else the world)."
        )
    for mesh in meshes:
        if sorted(mesh.mesh.flatten().tolist()) != sorted(members):
            raise ValueError(
                f"clip_grad_norm_: with expert_parallel, DTensor gradients must lie on a mesh of every rank of the "
                f"reduction group ({len(members)} ranks), not on {mesh}: lossscale cannot tell which other ranks "
                "hold copies of their shards."
            )
    first = min(members)
    ep_first = first in ep_ranks  # this EP group's experts are the counted copy of every expert
    counted = []
    for p in params:
        if id(p) in experts:
            counted.append(ep_first and not copies.get(id(p), False))
        elif id(p) in copies:  # a DTensor: its mesh says
            counted.append(not copies[id(p)])
        else:  # a data-parallel copy on every rank
            counted.append(rank == first)
    return functools.partial(all_reduce_norm, norm_type=norm_type, group=group), counted


def _is_copy(grad) -> bool:
    """Whether this rank's shard of a DTensor gradient is a copy that another rank counts: it is
    Replicate over a mesh dim where this rank's coordinate is not 0 (or this rank is off the mesh)."""
    coordinate = grad.device_mesh.get_coordinate()
    return coordinate is None or any(pl.is_replicate() and c != 0 for pl, c in zip(grad.placements, coordinate))


def replica_copies(params: List[torch.Tensor]) -> List[bool]:
    """Per parameter, whether this rank's gradient is a copy that another rank counts (see
    :func:`norm_reduction`): a sum over ranks counts each shard once if it leaves these out.

    Tensor parallelism keeps some gradients Replicate over the tp dim (a row-parallel bias, a norm
    layer's weight); FSDP2 shards them over the dp dim only. Plain tensors: False. No sync.
    """
    return [hasattr(p.grad, "_local_tensor") and _is_copy(p.grad) for p in params]


def all_reduce_norm(local: torch.Tensor, norm_type: float, group) -> torch.Tensor:
    """The total norm from every rank's ``local`` norm of the gradient parts it counts (0-dim).

    For p = 1, 2, ...: ``(all_reduce(SUM, local**p)) ** (1/p)``; for inf: a MAX. A NaN anywhere
    gives NaN on every rank: a SUM keeps it, and for the MAX (which gloo and NCCL may not) a NaN is
    sent as inf with a NaN flag beside it. One collective; no host sync.
    """
    if math.isinf(norm_type):
        sent = torch.stack([local.nan_to_num(nan=math.inf, posinf=math.inf), torch.isnan(local).to(local.dtype)])
        torch.distributed.all_reduce(sent, op=torch.distributed.ReduceOp.MAX, group=group)
        return torch.where(sent[1] > 0, math.nan, sent[0])
    power = local**norm_type  # torch's _NormPartial: x**p, SUM, **(1/p)
    torch.distributed.all_reduce(power, op=torch.distributed.ReduceOp.SUM, group=group)
    return power ** (1.0 / norm_type)


def _collective_device(group, preferred: Optional[torch.device] = None) -> torch.device:
    """Where a tensor must live for a collective on ``group``: CPU for gloo/MPI, else the accelerator
    (``preferred`` when it is one, else the current CUDA device)."""
    backend = str(torch.distributed.get_backend(group))
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    if preferred is not None and preferred.type != "cpu":
        return preferred
    return torch.device("cuda", torch.cuda.current_device())


_ALWAYS_SHOWN = ("scale", "growth_tracker")


def check_consistency(scaler, group=None) -> ScaleState:
    """Raise unless every rank of the group holds the same scaler state; return that state.

    A debug check: with the skip decision reduced, every rank's scale, trackers and counters are
    equal after every :meth:`~lossscale.GradScaler.update`, and a difference means some rank skipped
    alone (a scaler built with ``process_group=None``, a rank that loaded another checkpoint, calls
    that differ between ranks). Call it on every rank, between iterations (after ``update()``),
    every N steps::

        if step % 100 == 0:
            lossscale.distributed.check_consistency(scaler)

    Args:
        scaler: a :class:`lossscale.GradScaler`.
        group: the ranks to compare. None (default): the scaler's own reduction group, or the default
            group when the scaler does not reduce (``process_group=None``).

    Returns:
        The (common) :class:`lossscale.ScaleState`. Without torch.distributed initialised, or in a
        one-rank group, there is nothing to compare and it returns the local state.

    Raises:
        RuntimeError: the states differ; the message lists every rank's scale and growth tracker and
            every other field that differs. Every rank raises, so no rank is left in a collective.

    Syncs: host and device once (the state), plus one ``all_gather`` over the group.
    """
    _require_scaler(scaler, "check_consistency()")
    if group is not None and not isinstance(group, torch.distributed.ProcessGroup):
        raise ValueError(f"group={group!r} must be None (the scaler's group) or a torch.distributed ProcessGroup.")
    state = scaler.state()  # the sync
    if not _dist_ready():
        return state
    group = group or reduction_group(scaler) or torch.distributed.group.WORLD
    world = torch.distributed.get_world_size(group)
    if world <= 1:
        return state
    fields = [f.name for f in dataclasses.fields(state)]
    # float64 holds the float32 scales and every counter below 2**53 exactly.
    row = [float(scaler.is_enabled())] + [float(getattr(state, name)) for name in fields]
    preferred = scaler.device
    local = torch.tensor(row, dtype=torch.float64, device=_collective_device(group, preferred))
    gathered = [torch.empty_like(local) for _ in range(world)]
    torch.distributed.all_gather(gathered, local, group=group)
    rows: List[List[float]] = torch.stack(gathered).cpu().tolist()
    names = ["enabled"] + fields
    differing = [i for i in range(len(names)) if any(r[i] != rows[0][i] for r in rows)]
    if not differing:
        return state
    ranks = torch.distributed.get_process_group_ranks(group)
    shown = [i for i in range(len(names)) if names[i] in _ALWAYS_SHOWN or i in differing]

    def show(i, v):
        return repr(v) if "scale" in names[i] else str(int(v))

    lines = [f"  {names[i]}: " + ", ".join(f"rank {rk}: {show(i, r[i])}" for rk, r in zip(ranks, rows)) for i in shown]
    raise RuntimeError(
        f"lossscale.GradScaler state differs across the {world} ranks of the group "
        f"(differing: {', '.join(names[i] for i in differing)}):\n" + "\n".join(lines) + "\n"
        "Every rank must skip or step together: build the scaler with process_group='default' (or the "
        "group these ranks share), not None; call scale/unscale_/step/update the same way on every rank; "
        "and load the same checkpoint everywhere."
    )


def init_stage(scaler, device) -> None:
    """Start ``scaler`` on ``device`` on a rank that never calls ``scaler.scale()``.

    A pipeline stage before the last one computes no loss: its gradients come from
    ``torch.autograd.backward(outputs, received_grads)``, already multiplied by the loss scale of
    the stage that called :meth:`~lossscale.GradScaler.scale`. Its scaler must still unscale,
    check and take part in the skip decision, for which it needs to know its device. Call this once,
    before the first :meth:`~lossscale.GradScaler.unscale_` or ``step``; since every rank's scaler
    starts from the same settings and sees the same reduced flags, the scale it divides by is the
    one the loss was multiplied by. No sync.

    Raises:
        ValueError: ``device`` is not a device, or the scaler already started on another device.
    """
    _require_scaler(scaler, "init_stage()")
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError):
        raise ValueError(f"device={device!r} is not a device; pass e.g. 'cpu', 'cuda:0' or a torch.device.") from None
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if not scaler.is_enabled():
        return
    scaler.init_device(device)


def reduce_stats(stats, group=None):
    """Global gradient statistics from every rank's local ones: histograms summed, ``amax`` maxed.

    For gradients *sharded* over ``group`` (FSDP2 local shards, pipeline stages, tensor-parallel
    shards) the sum of the local histograms is the histogram of the whole gradient, so every figure
    of the result (counts, fractions, ``amax``, ``headroom_bits``, ``at()``) is the global one.
    Do not reduce *replicated* gradients (DDP, after its all-reduce): each element would be counted
    once per rank (fractions and ``amax`` would survive, counts would be world-size times too big).

    Args:
        stats: a :class:`lossscale.stats.GradStats`, a list/tuple of them, or a dict of name ->
            GradStats; the same structure (names, order, formats, scales) on every rank. A rank with
            nothing to measure passes empty stats: ``grad_stats([], scale=..., fmt=..., device=...)``.
        group: the ranks to reduce over; None (default): the default group.

    Returns:
        The same structure of new GradStats (the inputs are left as they are). Without
        torch.distributed initialised, or in a one-rank group, ``stats`` itself.

    Raises:
        ValueError: ``stats`` holds something other than GradStats.
        RuntimeError: the ranks passed different structures (every rank raises).

    Syncs: two collectives (every ``amax`` in one MAX all-reduce, every histogram in one SUM
    all-reduce) and one host read between them, of the check that all ranks passed alike. A
    collective: call it on every rank of the group, at the same steps (when the figures are read).
    """
    from .stats import GradStats

    if isinstance(stats, GradStats):
        kind, names, items = "one", [""], [stats]
    elif isinstance(stats, dict):
        kind, names, items = "dict", [str(k) for k in stats], list(stats.values())
    elif isinstance(stats, (list, tuple)):
        kind, names, items = type(stats).__name__, [str(i) for i in range(len(stats))], list(stats)
    else:
        raise ValueError(f"stats must be a GradStats, a list/tuple or a dict of them; got {type(stats).__name__}.")
    bad = [n for n, s in zip(names, items) if not isinstance(s, GradStats)]
    if bad:
        raise ValueError(f"stats entries {bad[:5]} are not GradStats (from lossscale.stats.grad_stats).")
    if group is not None and not isinstance(group, torch.distributed.ProcessGroup):
        raise ValueError(f"group={group!r} must be None (the default group) or a torch.distributed ProcessGroup.")
    if not _dist_ready() or torch.distributed.get_world_size(group) <= 1:
        return stats
    # Statistics of a model spread over several devices of one rank (model parallel) are reduced on
    # the collective's device: their histograms are small, and the copies are blocking onto the CPU.
    device = _collective_device(group or torch.distributed.group.WORLD, items[0].hist.device if items else None)
    items = [
        s
        if s.hist.device == device
        else dataclasses.replace(s, hist=s.hist.to(device), amax_tensor=s.amax_tensor.to(device))
        for s in items
    ]
    # A signature of the structure, below 2**48 so float64 holds it exactly. MAX-reducing it and its
    # negation gives max and -min: equal on every rank iff every rank passed the same structure.
    layout = repr((kind, names, [(s.fmt.name, s.scale, tuple(s.thresholds), s.hist.numel()) for s in items]))
    sig = float(int.from_bytes(hashlib.blake2b(layout.encode(), digest_size=6).digest(), "big"))
    maxed = torch.cat(
        [
            torch.stack([s.amax_tensor.reshape(()).double() for s in items])
            if items
            else torch.zeros(0, dtype=torch.float64, device=device),
            torch.tensor([sig, -sig], dtype=torch.float64, device=device),
        ]
    )
    torch.distributed.all_reduce(maxed, op=torch.distributed.ReduceOp.MAX, group=group)
    hi, neg_lo = maxed[-2:].tolist()  # the host read: every rank sees the same values, so all raise or none
    if hi != -neg_lo:
        raise RuntimeError(
            "reduce_stats: the ranks passed different statistics (other names, order, formats or scales); "
            "pass the same structure on every rank, with grad_stats([], scale=..., fmt=..., device=...) where a "
            "rank has nothing to measure."
        )
    if not items:
        return stats
    hists = torch.stack([s.hist for s in items])
    torch.distributed.all_reduce(hists, op=torch.distributed.ReduceOp.SUM, group=group)
    out = [
        dataclasses.replace(s, hist=hists[i], amax_tensor=maxed[i].to(s.amax_tensor.dtype).reshape(()))
        for i, s in enumerate(items)
    ]
    if kind == "one":
        return out[0]
    if kind == "dict":
        return dict(zip(stats.keys(), out))
    return type(stats)(out)
