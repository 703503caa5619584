"""Spawned gloo scenarios for tests/test_sharded.py: sharded gradients (FSDP2, tensor parallel, a 2-D
mesh of both, pipeline stages, FSDP1) against torch's own recipe on the same gradients.

They run in :class:`_dist_workers.WorkerPool` (``scenarios="_mesh_workers"``), two or four ranks on
loopback. Every scenario returns plain Python values per rank; the tests compare them across ranks.
A scenario may run several checks, so that four ranks are spawned once and reused.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from _dist_workers import _consistency, _local, _plant, _planted
from _integration_models import TORCH_LIKE

import lossscale

INF = math.inf
CFG = dict(init_scale=2.0**10, growth_interval=2)  # torch's keywords: both scalers take them


# ------------------------------------------------------------------------------------------- models
def _net(seed: int = 0) -> torch.nn.Sequential:
    """8 -> 16 -> 8 -> 4: every Linear splits over two tensor-parallel ranks, then over two FSDP ranks."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)
    )


def _mesh(layout: str, world: int, shape=None):
    """The mesh for ``layout``: "fsdp" and "tp" a 1-D mesh of every rank, "fsdp_tp" a 2-D (dp, tp) one,
    "hsdp" a 2-D (replicate, shard) one."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout in ("fsdp_tp", "hsdp"):
        names = ("dp", "tp") if layout == "fsdp_tp" else ("replicate", "shard")
        return init_device_mesh("cpu", shape or (2, world // 2), mesh_dim_names=names)
    return init_device_mesh("cpu", (world,), mesh_dim_names=("dp" if layout == "fsdp" else "tp",))


def _shard(model: torch.nn.Module, layout: str, mesh) -> torch.nn.Module:
    """Tensor-parallel (column, row, column with a replicated output), then FSDP2 over the dp dim.

    Row-parallel ``2.bias`` is Replicate over tp: the norm must count it once, not once per tp rank.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if "tp" in layout:
        parallelize_module(
            model,
            mesh["tp"],
            {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(output_layouts=Replicate())},
        )
    if "fsdp" in layout or layout == "hsdp":
        dp = mesh if layout == "hsdp" else mesh["dp"]  # HSDP: Replicate over one dim, Shard over the other
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
    return model


def _data(step: int):
    """The same batch on every rank (so the unsharded model is the reference of the sharded one)."""
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(100 + step))
    return x, x[:, :4].sin()


def _loss(model, step: int) -> torch.Tensor:
    x, y = _data(step)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    return torch.nn.functional.mse_loss(out.float(), y)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective), or the tensor itself."""
    return t.full_tensor() if type(t).__name__ == "DTensor" else t


def _global_norm(grads, norm_type: float) -> float:
    """The norm of whole gradients, as torch's clip_grad_norm_ takes it in one process."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(list(grads), norm_type)), norm_type).item()


def _max_rel_diff(a, b) -> float:
    """max |x - y| / max(|x|, tiny) over two lists of tensors (0.0: bitwise equal; NaN where both are NaN
    counts as equal, so a skipped step's gradients compare too)."""
    worst = 0.0
    for x, y in zip(a, b):
        if x.numel():
            same = (x == y) | (torch.isnan(x) & torch.isnan(y))
            rel = ((x - y).abs() / x.abs().clamp_min(1e-30)).masked_fill(same, 0.0)
            worst = max(worst, rel.max().item())
    return worst


def _torch_skipped(scaler: torch.amp.GradScaler, opt) -> bool:
    # torch's scaler records found_inf per device in unscale_ (read before update() clears it).
    return any(v.item() > 0 for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values())


# Step -> {rank: (what, parameter index)}: one fault on one rank's local shard. Parameter 2 is
# model[2].weight (row-parallel: Shard on tp; on the 2-D mesh Shard on both dims), 3 its Replicate
# bias, 0 model[0].weight.
FAULTS = {1: {-1: ("inf", 2)}, 2: {0: ("nan", 0)}, 4: {-1: ("inf", 3)}}


def _plant_fault(model, step: int, rank: int, world: int) -> str:
    """Write this step's fault into this rank's local gradient shard, if it has one; returns it."""
    for who, (kind, index) in FAULTS.get(step, {}).items():
        if who % world == rank:
            local = _local(list(model.parameters())[index].grad)
            local.view(-1)[0] = float(kind)
            return kind
    return ""


# ---------------------------------------------------------------------------------------- scenarios
def clip_vs_torch(
    rank, world, layout: str, norm_types=(2.0, 1.0, INF), optimizer: str = "sgd", steps: int = 6, faults: bool = True
):
    """``scaler.clip_grad_norm_`` against torch's recipe on the same sharded gradients.

    Per norm type, two copies of the model sharded alike: one trained with ``torch.amp.GradScaler``,
    ``unscale_`` and ``torch.nn.utils.clip_grad_norm_`` (DTensor-aware: the global norm), the other
    with lossscale's one call. Faults (FAULTS) land on single ranks' local shards, in both copies. A
    third figure is the norm of the whole gradients, gathered (what the norm must be). ``faults=False``:
    none (torch's recipe reduces found_inf over a DTensor's Shard dims only, so a fault in one replica
    of an HSDP gradient skips that replica's ranks alone; lossscale's skip every rank). Returns per
    norm type and step the three norms, both skip decisions and scales, and how far this rank's
    clipped gradients and its parameters after the step are from torch's (largest relative difference).
    """
    mesh = _mesh(layout, world)
    out = {}
    for norm_type in norm_types:
        base = _net(0)
        ref, mine = _shard(copy.deepcopy(base), layout, mesh), _shard(copy.deepcopy(base), layout, mesh)
        make = (
            (lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True))
            if optimizer == "fused_adam"
            else (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
        )
        ref_opt, opt = make(ref.parameters()), make(mine.parameters())
        ref_scaler, scaler = torch.amp.GradScaler("cpu", **CFG), lossscale.GradScaler("cpu", **CFG, **TORCH_LIKE)
        record = []
        for step in range(steps):
            for net, o, s in ((ref, ref_opt, ref_scaler), (mine, opt, scaler)):
                o.zero_grad(set_to_none=True)
                s.scale(_loss(net, step)).backward()
                planted = _plant_fault(net, step, rank, world) if faults else ""
            scale = ref_scaler.get_scale()
            whole = _global_norm([_full(p.grad) for p in mine.parameters()], norm_type) / scale
            ref_scaler.unscale_(ref_opt)
            ref_norm = _full(torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1.0, norm_type))
            norm = scaler.clip_grad_norm_(opt, 1.0, norm_type)
            grad_diff = _max_rel_diff(
                [_local(p.grad) for p in ref.parameters()], [_local(p.grad) for p in mine.parameters()]
            )
            ref_skipped = _torch_skipped(ref_scaler, ref_opt)
            for o, s in ((ref_opt, ref_scaler), (opt, scaler)):
                s.step(o)
                s.update()
            record.append(
                dict(
                    planted=planted,
                    whole=whole,
                    ref_norm=ref_norm.item(),
                    norm=norm.item(),
                    norm_is_plain=type(norm) is torch.Tensor,
                    grad_diff=grad_diff,
                    param_diff=_max_rel_diff(
                        [_local(p) for p in ref.parameters()], [_local(p) for p in mine.parameters()]
                    ),
                    skipped=scaler.last_step_skipped,
                    ref_skipped=ref_skipped,
                    scale=scaler.get_scale(),
                    ref_scale=ref_scaler.get_scale(),
                )
            )
        out[str(norm_type)] = dict(record=record, counters=scaler.counters(), consistency=_consistency(scaler))
    return out


class _Fp16Stage(torch.nn.Module):
    """A pipeline stage that runs its layers under fp16 autocast and sends float32 activations."""

    def __init__(self, *layers):
        super().__init__()
        self.layers = torch.nn.Sequential(*layers)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.float16):
            return self.layers(x).float()


def pipelining(rank, world, norm_type: float = 2.0, steps: int = 5, microbatches: int = 2):
    """``torch.distributed.pipelining`` (GPipe, two stages) with ``clip_grad_norm_(..., norm_group=WORLD)``.

    Compared with the same network in one process, trained with torch's scaler, ``unscale_`` and
    ``torch.nn.utils.clip_grad_norm_`` over all its parameters. The loss is scaled in the schedule's
    ``loss_fn`` on the last stage; the first stage starts its scaler with ``init_stage``. Also the
    same run with each stage clipping alone (``norm_group=None``), which gives per-stage norms.
    """
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    if world != 2:
        raise ValueError(f"the pipelining scenario has two stages, not world_size={world}")
    base = _net(0)
    out = {}
    for norm_group in ("world", None):
        whole = copy.deepcopy(base)
        layers = list(copy.deepcopy(base))
        stage_module = _Fp16Stage(*(layers[:2] if rank == 0 else layers[2:]))
        scaler = lossscale.GradScaler("cpu", **CFG, **TORCH_LIKE)
        if rank == 0:
            lossscale.distributed.init_stage(scaler, "cpu")
        stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))

        def loss_fn(output, target):
            return scaler.scale(torch.nn.functional.mse_loss(output, target))  # noqa: B023  used in this iteration only

        schedule = ScheduleGPipe(stage, microbatches, loss_fn=loss_fn)
        opt = torch.optim.SGD(stage_module.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(whole.parameters(), lr=0.1, momentum=0.9)
        ref_scaler = torch.amp.GradScaler("cpu", **CFG)
        own = list(whole.parameters())[:2] if rank == 0 else list(whole.parameters())[2:]
        record = []
        for step in range(steps):
            x, y = _data(step)
            opt.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y)
            # The reference: the same micro-batches, each loss scaled, gradients averaged as the
            # schedule does (scale_grads=True divides them by the number of micro-batches).
            ref_opt.zero_grad(set_to_none=True)
            for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
                with torch.autocast("cpu", dtype=torch.float16):
                    ref_out = whole(xs).float()
                ref_scaler.scale(torch.nn.functional.mse_loss(ref_out, ys)).backward()
            for p in whole.parameters():
                p.grad.div_(microbatches)
            planted = "inf" if step == 2 and rank == 0 else ""  # in the first stage only
            if step == 2:  # ... and in its part of every rank's reference
                _plant([p.grad for p in list(whole.parameters())[:2]], "inf", 0, step)
            if planted:
                _plant([p.grad for p in stage_module.parameters()], planted, rank, step)
            ref_scaler.unscale_(ref_opt)
            ref_norm = torch.nn.utils.clip_grad_norm_(whole.parameters(), 0.2, norm_type)
            group = dist.group.WORLD if norm_group == "world" else None
            norm = scaler.clip_grad_norm_(opt, 0.2, norm_type, norm_group=group)
            ref_skipped = _torch_skipped(ref_scaler, ref_opt)
            scaler.step(opt)
            scaler.update()
            ref_scaler.step(ref_opt)
            ref_scaler.update()
            diff = max((a - b).abs().max().item() for a, b in zip(stage_module.parameters(), own))
            record.append(
                dict(
                    norm=norm.item(),
                    ref_norm=ref_norm.item(),
                    skipped=scaler.last_step_skipped,
                    ref_skipped=ref_skipped,
                    scale=scaler.get_scale(),
                    ref_scale=ref_scaler.get_scale(),
                    param_diff=diff,
                    planted=planted,
                )
            )
        out[str(norm_group)] = dict(record=record, counters=scaler.counters(), consistency=_consistency(scaler))
    return out


def fsdp1_parity(rank, world, steps: int = 24, rate: float = 0.15):
    """FSDP1 (``FullyShardedDataParallel``) with torch's ``ShardedGradScaler`` against lossscale.

    Three copies of one model, each wrapped in FSDP1 over gloo on CPU, see the same gradients and
    the same random faults on single ranks' local shards:
    ``torch``: ShardedGradScaler, ``unscale_`` and FSDP1's own ``model.clip_grad_norm_``;
    ``drop_in``: lossscale.GradScaler (torch's settings) in the same calls;
    ``one_call``: lossscale.GradScaler with ``clip_grad_norm_(opt, 1.0, norm_group=model.process_group)``
    (FSDP1's gradients are plain tensors: each rank of the shard group holds its own part).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    base = _net(0)
    runs = {}
    for kind in ("torch", "drop_in", "one_call"):
        model = FSDP(copy.deepcopy(base), device_id=torch.device("cpu"), use_orig_params=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = (
            ShardedGradScaler("cpu", **CFG) if kind == "torch" else lossscale.GradScaler("cpu", **CFG, **TORCH_LIKE)
        )
        runs[kind] = (model, opt, scaler)
    record = []
    for step in range(steps):
        plants = [_planted(r, step, rate) for r in range(world)]
        entry = dict(planted=plants)
        for kind, (model, opt, scaler) in runs.items():
            opt.zero_grad(set_to_none=True)
            scaler.scale(_loss(model, step)).backward()
            local = [p.grad for p in model.parameters() if p.grad is not None and p.grad.numel()]
            if plants[rank] and local:
                _plant(local, plants[rank], rank, step)
            if kind == "one_call":
                norm = scaler.clip_grad_norm_(opt, 1.0, norm_group=model.process_group)  # FSDP1's shard group
            else:
                scaler.unscale_(opt)
                norm = model.clip_grad_norm_(1.0)
            skipped = _torch_skipped(scaler, opt) if kind == "torch" else None
            scaler.step(opt)
            scaler.update()
            entry[kind] = dict(
                norm=norm.item(),
                scale=scaler.get_scale(),
                skipped=skipped if kind == "torch" else scaler.last_step_skipped,
            )
        record.append(entry)
    params = {kind: [p.detach().clone() for p in model.parameters()] for kind, (model, _, _) in runs.items()}
    return dict(
        record=record,
        drop_in_params_equal=all(torch.equal(a, b) for a, b in zip(params["torch"], params["drop_in"])),
        one_call_param_diff=max(
            (a - b).abs().max().item() for a, b in zip(params["torch"], params["one_call"]) if a.numel()
        ),
        counters=runs["drop_in"][2].counters(),
        consistency=_consistency(runs["drop_in"][2]),
    )


def _error(call) -> str:
    try:
        call()
    except ValueError as e:
        return str(e)
    return ""


def layouts(rank, world):
    """norm_reduction on hand-made DTensor gradients: what is counted, which layouts it refuses (on
    every rank alike), and a disabled scaler's clip_grad_norm_ (scale 1, the same reduction)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from lossscale import distributed as lsd

    line = _mesh("fsdp", world)
    grid = _mesh("fsdp_tp", world, shape=(1, world))  # the same ranks, another shape

    def param(mesh, placements, seed):
        g = torch.Generator().manual_seed(seed)
        value = torch.randn(4, 6, generator=g)
        p = torch.nn.Parameter(distribute_tensor(value.clone(), mesh, placements))
        p.grad = distribute_tensor(value * 3.0, mesh, placements)
        return p

    sharded, replicated = param(line, [Shard(0)], 1), param(line, [Replicate()], 2)
    reduce, counted = lsd.norm_reduction([sharded, replicated], [sharded, replicated], 2.0)
    plain = torch.nn.Parameter(torch.ones(3))
    plain.grad = torch.ones(3)
    partial = torch.nn.Parameter(torch.zeros(4))
    partial.grad = DTensor.from_local(torch.ones(4), line, [Partial()])
    only_rank0 = dist.new_group([0])  # every rank calls new_group; rank 1 gets a sentinel
    out = dict(
        counted=counted,
        group_is_mesh=reduce.keywords["group"] is line.get_group(),
        copies=lsd.replica_copies([sharded, replicated, plain]),
        several_meshes=_error(lambda: lsd.norm_reduction([sharded, param(grid, [Replicate(), Shard(1)], 3)], [], 2.0)),
        mixed=_error(lambda: lsd.norm_reduction([sharded, plain], [], 2.0)),
        partial=_error(lambda: lsd.norm_reduction([partial], [], 2.0)),
        outside=_error(lambda: lsd.norm_reduction([sharded], [], 2.0, only_rank0)),
        plain_alone=lsd.norm_reduction([plain], [plain], 2.0) == (None, None),
    )
    # A disabled scaler: the global norm of DTensor gradients, and of plain ones over norm_group.
    scaler = lossscale.GradScaler("cpu", enabled=False)
    for name, params, group in (("dtensor", [sharded, replicated], None), ("plain", [plain], dist.group.WORLD)):
        opt = torch.optim.SGD(params, lr=0.1)
        expected = _global_norm([_full(p.grad) for p in params], 2.0) if name == "dtensor" else math.sqrt(3.0 * world)
        norm = scaler.clip_grad_norm_(opt, 100.0, norm_group=group)
        out[f"disabled_{name}"] = (norm.item(), expected, type(norm) is torch.Tensor)
    return out


GRAD_FIGURES = ("grad/numel", "grad/zeros", "grad/flushed", "grad/subnormal", "grad/overflow", "grad/inf", "grad/nan")


def _train_2d(rank, world, mesh, steps: int, nan_loss_at: int):
    """lossscale's defaults (loss check on, telemetry every step) on the 2-D model and, in each process,
    on the same model unsharded (``process_group=None``): the reference every rank must agree with.

    At ``nan_loss_at`` the last rank's loss is NaN (its batch is poisoned) and the reference's too.
    Returns per step the skip, scale and the telemetry figures of both.
    """
    base = _net(1)
    model, ref = _shard(copy.deepcopy(base), "fsdp_tp", mesh), copy.deepcopy(base)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3, foreach=True)
    tel = dict(telemetry=dict(every=1))
    scaler = lossscale.GradScaler("cpu", init_scale=2.0**12, growth_interval=3, **tel)
    ref_scaler = lossscale.GradScaler("cpu", init_scale=2.0**12, growth_interval=3, process_group=None, **tel)
    record = []
    for step in range(steps):
        for net, o, s, poisoned in ((model, opt, scaler, rank == world - 1), (ref, ref_opt, ref_scaler, True)):
            o.zero_grad(set_to_none=True)
            loss = _loss(net, step)
            if step == nan_loss_at and poisoned:
                loss = loss * math.nan
            s.scale(loss).backward()
            s.clip_grad_norm_(o, 1.0)
            s.step(o)
            s.update()
        m, ref_m = scaler.metrics(), ref_scaler.metrics()  # the first: a collective (sharded figures summed)
        record.append(
            dict(
                skipped=scaler.last_step_skipped,
                ref_skipped=ref_scaler.last_step_skipped,
                scale=scaler.get_scale(),
                ref_scale=ref_scaler.get_scale(),
                figures={k: m.get(k) for k in GRAD_FIGURES},
                ref_figures={k: ref_m.get(k) for k in GRAD_FIGURES},
                amax=m.get("grad/amax"),
                ref_amax=ref_m.get("grad/amax"),
            )
        )
    diff = max((_full(a) - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return (
        model,
        opt,
        scaler,
        dict(
            record=record,
            counters=scaler.counters(),
            ref_counters=ref_scaler.counters(),
            max_param_diff=diff,
            consistency=_consistency(scaler),
        ),
    )


def _one_step(model, opt, scaler, step: int):
    opt.zero_grad(set_to_none=True)
    scaler.scale(_loss(model, step)).backward()
    norm = scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()
    return norm.item()


def mesh2d(rank, world, checkpoint_dir: str, steps: int = 6, nan_loss_at: int = 3):
    """Four ranks, FSDP2 x tensor parallel on a 2 x 2 mesh, every check in one call:

    ``clip``: clip_vs_torch on the 2-D mesh (norm types 2, 1, inf; an inf on one rank's local TP
    shard, a NaN on another's, an inf in a Replicate copy); ``hsdp``: the same for HSDP (fully_shard
    on the 2-D mesh: Replicate x Shard), norm type 2. ``train``: lossscale's defaults with a
    NaN loss on one rank, and telemetry, against the model unsharded. ``checkpoint``: model,
    optimizer and scaler saved with torch.distributed.checkpoint from the 2 x 2 mesh, loaded into
    FSDP2 alone over a 1-D mesh of four; one more step on both meshes.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = _mesh("fsdp_tp", world)
    out = dict(clip=clip_vs_torch(rank, world, "fsdp_tp"), hsdp=clip_vs_torch(rank, world, "hsdp", norm_types=(2.0,)))
    model, opt, scaler, out["train"] = _train_2d(rank, world, mesh, steps, nan_loss_at)

    # Checkpoint: save on the 2 x 2 mesh ...
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd, "scaler": scaler.state_dict()}, checkpoint_id=checkpoint_dir)
    saved = [_full(p).clone() for p in model.parameters()]
    # ... load into FSDP2 over a 1-D mesh of all four ranks (every other layout differs too).
    other = _shard(_net(7), "fsdp", _mesh("fsdp", world))
    other_opt = torch.optim.Adam(other.parameters(), lr=1e-3, foreach=True)
    other_scaler = lossscale.GradScaler("cpu")  # other settings: the checkpoint's must win
    model_sd, optim_sd = get_state_dict(other, other_opt)
    state = {"model": model_sd, "optim": optim_sd, "scaler": other_scaler.state_dict()}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_state_dict(other, other_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    other_scaler.load_state_dict(state["scaler"])
    loaded = [_full(p) for p in other.parameters()]
    moments = [(_full(a["exp_avg"]), _full(b["exp_avg"])) for a, b in zip(opt.state.values(), other_opt.state.values())]
    norms = (_one_step(model, opt, scaler, steps), _one_step(other, other_opt, other_scaler, steps))
    after = max((_full(a) - _full(b)).abs().max().item() for a, b in zip(model.parameters(), other.parameters()))
    out["checkpoint"] = dict(
        params_equal=all(torch.equal(a, b) for a, b in zip(saved, loaded)),
        moments_equal=all(torch.equal(a, b) for a, b in moments),
        scaler_state=tuple(
            {k: s.state_dict()[k] for k in ("policy_type", "policy", "state")} for s in (scaler, other_scaler)
        ),
        norms=norms,
        param_diff_after=after,
        placements=[str(p.placements) for p in other.parameters()][:1],
    )
    return out


def clip_edges(rank, world):
    """The sharded clip where one rank's part is special, on hand-made DTensor gradients over a 1-D mesh.

    * ``copies``: every gradient Replicate, so rank 1 holds only copies that rank 0 counts: its own part
      of the norm is an empty sum (a float32 zero, under a float64 default dtype too), the total is the
      norm of one copy on every rank, and every rank clips alike.
    * ``huge``: the same with finite scaled copies near 3e19 and ``norm_type=inf``: their max is finite,
      while their 2-norm would overflow float32; the copies' check takes the clip's own order, so the
      step is taken.
    * ``inf_elsewhere``: a Shard(0) gradient with an inf in rank 0's rows only. The step is skipped on
      both ranks, and each rank's gradients are unscaled alone (multiplied by 1/S, not clipped): rank 1's
      finite rows are its gradient, not the zeros that the infinite norm's clip coefficient would make.
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    line = _mesh("fsdp", world)
    scale = 2.0**4

    def run(placements, values, norm_type, max_norm):
        params = []
        for v in values:
            p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(v), line, placements))
            p.grad = distribute_tensor(v * scale, line, placements)  # what backward of a scaled loss leaves
            params.append(p)
        opt = torch.optim.SGD(params, lr=0.0)
        scaler = lossscale.GradScaler("cpu", init_scale=scale, growth_interval=1000)
        scaler.scale(torch.ones(()))  # the iteration's scale() (the gradients were set by hand)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)  # a zero made without a dtype would be float64 here
        try:
            norm = scaler.clip_grad_norm_(opt, max_norm, norm_type)
        finally:
            torch.set_default_dtype(previous)
        grads = [p.grad.to_local().clone() for p in params]
        scaler.step(opt)
        scaler.update()
        return dict(
            norm=norm.item(),
            norm_dtype=str(norm.dtype),
            grads=[g.tolist() for g in grads],
            skipped=scaler.last_step_skipped,
        )

    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(4, 3, generator=g), torch.randn(2, 5, generator=g)
    rows = torch.randn(4, 3, generator=g)
    rows[0, 1] = INF  # row 0: rank 0's shard
    return dict(
        copies=run([Replicate()], [a, b], 2.0, 0.5),
        expected_norm=_global_norm([a, b], 2.0),
        expected_grads=[(x * min(1.0, 0.5 / (_global_norm([a, b], 2.0) + 1e-6))).tolist() for x in (a, b)],
        huge=run([Replicate()], [torch.full((3,), 3e19 / scale), torch.full((2,), 2e19 / scale)], INF, 1.0),
        inf_elsewhere=run([Shard(0)], [rows], 2.0, 1.0),
        rows=rows.tolist(),
    )


SCENARIOS = {f.__name__: f for f in (clip_vs_torch, pipelining, fsdp1_parity, layouts, clip_edges, mesh2d)}
