"""Spawned gloo workers for tests/test_distributed.py: a two-rank pool on loopback, and its scenarios.

Starting a process that imports torch costs seconds, so the test module starts the ranks once
(:class:`WorkerPool`) and sends them scenarios by name. Every wait is bounded: the process group has
a timeout (a collective that never completes raises on the rank waiting in it), the pool has a
deadline per scenario, and a pool that failed or timed out is killed, never reused.

Scenarios run on every rank with the same arguments and return a picklable dict per rank (plain
Python values, no tensors), which the tests compare across ranks and with single-process references.
"""

from __future__ import annotations

import copy
import datetime
import os
import queue
import socket
import time
import traceback

import torch
import torch.distributed as dist
from _models import batch, make_optimizer, tiny_mlp

import lossscale
from lossscale import distributed as lsd

HOST = "127.0.0.1"
PG_TIMEOUT_S = 30  # a collective left waiting raises after this long
IDLE_EXIT_S = 900  # a worker whose parent vanished exits after this long without a task


def _loopback_interface() -> str:
    """The loopback interface's name ('lo' on Linux, 'lo0' on macOS), so gloo binds nothing else."""
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return ""


# ---------------------------------------------------------------------------------------------- pool
class WorkerPool:
    """``world_size`` spawned processes joined in one gloo process group over loopback.

    ``scenarios``: the module whose ``SCENARIOS`` dict the workers run (this one by default).
    """

    def __init__(self, world_size: int = 2, scenarios: str = __name__):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.world_size = world_size
        # The parent serves the rendezvous store on an OS-chosen port: no race for a free port.
        self._store = dist.TCPStore(
            HOST, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S)
        )
        self._results = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(
                target=_serve,
                name=f"lossscale-test-rank{rank}",
                daemon=True,
                args=(rank, world_size, self._store.port, self._inboxes[rank], self._results, scenarios),
            )
            for rank in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.alive = True

    def run(self, scenario: str, timeout_s: float = 120.0, **kwargs):
        """Run ``scenario`` on every rank; return the per-rank results (index = rank).

        Raises (and kills the pool) when a rank fails, dies, or the deadline passes.
        """
        if not self.alive:
            raise RuntimeError("the worker pool was closed after an earlier failure")
        for inbox in self._inboxes:
            inbox.put((scenario, kwargs))
        results = [None] * self.world_size
        deadline = time.monotonic() + timeout_s
        pending = self.world_size
        while pending:
            try:
                rank, ok, payload = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.name for p in self._procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close(kill=True)
                    why = f"{', '.join(dead)} died" if dead else f"no result within {timeout_s:.0f} s (a hang?)"
                    raise RuntimeError(f"distributed scenario {scenario!r}: {why}; worker pool killed") from None
                continue
            if not ok:
                self.close(kill=True)  # the other rank may be waiting in a collective: do not wait for it
                raise RuntimeError(f"distributed scenario {scenario!r} failed on rank {rank}:\n{payload}")
            results[rank] = payload
            pending -= 1
        return results

    def close(self, kill: bool = False) -> None:
        """Stop the workers (politely unless ``kill``), then make sure each one is gone."""
        if not self.alive:
            return
        self.alive = False
        if not kill:
            for inbox in self._inboxes:
                inbox.put(None)
        for p in self._procs:
            p.join(timeout=0 if kill else 15)
            if p.is_alive():
                p.terminate()  # only these processes: the ones this pool started
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def _serve(rank, world_size, port, inbox, results, scenarios: str = __name__) -> None:
    """A worker's main loop: join the group, then run scenarios until told to stop."""
    import importlib

    os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
    torch.set_num_threads(1)  # the ranks share two cores
    table = importlib.import_module(scenarios).SCENARIOS
    timeout = datetime.timedelta(seconds=PG_TIMEOUT_S)
    store = dist.TCPStore(HOST, port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        while True:
            try:
                task = inbox.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                return
            if task is None:
                return
            name, kwargs = task
            try:
                results.put((rank, True, table[name](rank, world_size, **kwargs)))
            except BaseException:
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- helpers
def _flat(params) -> list:
    return torch.cat([p.detach().reshape(-1) for p in params]).tolist()


def _consistency(scaler):
    """None when every rank holds the same state, else check_consistency's message."""
    try:
        lsd.check_consistency(scaler)
    except RuntimeError as e:
        return str(e)
    return None


def _planted(rank: int, step: int, rate: float, seed: int = 0) -> str:
    """ "", "inf" or "nan": what ``rank`` plants at ``step`` (any rank can compute any rank's plan)."""
    g = torch.Generator().manual_seed(seed * 1000003 + step * 101 + rank)
    if torch.rand((), generator=g).item() >= rate:
        return ""
    return "nan" if torch.rand((), generator=g).item() < 0.3 else "inf"


def _plant(tensors, kind: str, rank: int, step: int) -> None:
    """Write one inf/NaN into one of ``tensors`` (chosen from rank and step)."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    t = tensors[int(torch.randint(0, len(tensors), (), generator=g))]
    t.view(-1)[int(torch.randint(0, t.numel(), (), generator=g))] = float(kind)


def _worst(kinds) -> str:
    """The reference's plant when the ranks planted ``kinds``: a NaN anywhere dominates."""
    return "nan" if "nan" in kinds else ("inf" if "inf" in kinds else "")


# -------------------------------------------------------------------------------------- scenarios
DDP_PLAN = {2: {1: "inf"}, 4: {0: "inf", 1: "nan"}}  # step -> {rank: plant}, in model[2].weight's gradient


def ddp(rank, world, kind: str, reduce: bool, steps: int = 6):
    """DDP; inf/NaN planted in one rank's gradient *after* backward (after DDP's all-reduce).

    kind: "sgd_clip" (unscale_ + clip_grad_norm_, host decision), "fused_adam" (decision on device,
    no host sync), "two_optimizers" (one per layer; only the second one's gradients are bad).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(tiny_mlp(0))
    net = model.module
    if kind == "two_optimizers":
        opts = [make_optimizer("sgd", net[0].parameters()), make_optimizer("sgd", net[2].parameters())]
    else:
        opts = [make_optimizer("fused_adam" if kind == "fused_adam" else "sgd", model.parameters())]
    scaler = lossscale.GradScaler(
        "cpu", init_scale=2.0**10, growth_interval=3, process_group="default" if reduce else None
    )
    record = []
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):  # counts the scaler's collectives (DDP's reducer is C++)
        calls.append(1)
        return real_all_reduce(*args, **kwargs)

    for step in range(steps):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        x, y = batch(step * world + rank)  # each rank its own data, as in DDP
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        bad = DDP_PLAN.get(step, {}).get(rank)
        if bad:
            net[2].weight.grad[0, 0] = float(bad)
        before = [p.detach().clone() for p in model.parameters()]
        calls.clear()
        dist.all_reduce = counting_all_reduce
        try:
            if kind == "sgd_clip":
                scaler.unscale_(opts[0])
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for opt in opts:
                scaler.step(opt)
            scaler.update()
        finally:
            dist.all_reduce = real_all_reduce
        changed = [not torch.equal(a, p) for a, p in zip(before, model.parameters())]
        record.append(
            dict(skipped=scaler.last_step_skipped, scale=scaler.get_scale(), changed=changed, collectives=len(calls))
        )
    return dict(
        record=record, params=_flat(model.parameters()), counters=scaler.counters(), consistency=_consistency(scaler)
    )


def _fsdp_net(seed: int) -> torch.nn.Module:
    # The last layer has one output: its bias has one row, so rank 1's local shard of it is empty.
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
    )


def fsdp(
    rank,
    world,
    steps: int,
    rate: float,
    optimizer: str = "adam",
    clip: bool = True,
    seed: int = 0,
    telemetry: bool = True,
):
    """FSDP2 (fully_shard, DTensor gradients) against a single-process reference.

    Every rank trains on the same batches, so the reference is the same model unsharded, trained
    with a scaler that sees a bad gradient whenever any rank planted one. At step 1 only rank 1
    plants an inf (in its local shard); later steps plant at random on each rank.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    ref = _fsdp_net(seed)
    model = copy.deepcopy(ref)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, ref_opt = make_optimizer(optimizer, model.parameters()), make_optimizer(optimizer, ref.parameters())
    cfg = dict(init_scale=2.0**10, growth_interval=10, max_scale=2.0**12)
    tel = dict(telemetry=dict(every=1000)) if telemetry else {}  # samples step 0 only
    scaler = lossscale.GradScaler("cpu", **cfg, **tel)
    ref_scaler = lossscale.GradScaler("cpu", **cfg, **tel, process_group=None)  # a local reference: must not reduce
    empty_shards = sum(p.to_local().numel() == 0 for p in model.parameters())
    record, figures = [], []
    for step in range(steps):
        plants = [("inf" if r == 1 else "") if step == 1 else _planted(r, step, rate, seed) for r in range(world)]
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        y = x[:, :1].sin()
        for net, o, s, mine in ((model, opt, scaler, plants[rank]), (ref, ref_opt, ref_scaler, _worst(plants))):
            o.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(net(x).float(), y)
            s.scale(loss).backward()
            if step == 0 and telemetry:
                from lossscale.stats import grad_stats

                # Telemetry's view: the scaled gradients, as local shards; reduced to global figures.
                local_stats = grad_stats([_local(p.grad) for p in net.parameters()], scale=1.0, fmt="fp16")
                figures.append((local_stats if net is ref else lsd.reduce_stats(local_stats)).to_dict())
            if mine:
                # Sharded: the rank-local shard of a DTensor gradient; the reference: plain tensors.
                _plant([_local(p.grad) for p in net.parameters() if _local(p.grad).numel()], mine, rank, step)
            if clip:
                s.unscale_(o)
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            s.step(o)
            s.update()
        if step == 0 and telemetry:  # the scaler's own telemetry: local shards reduced when read
            scaler_figures = (scaler.metrics(), ref_scaler.metrics())
        record.append(
            dict(
                skipped=scaler.last_step_skipped,
                ref_skipped=ref_scaler.last_step_skipped,
                scale=scaler.get_scale(),
                ref_scale=ref_scaler.get_scale(),
                planted=plants,
            )
        )
    full = [p.full_tensor() for p in model.parameters()]  # a collective: every rank gathers
    diff = max((a - b).abs().max().item() for a, b in zip(full, ref.parameters()))
    return dict(
        record=record,
        max_param_diff=diff,
        counters=scaler.counters(),
        ref_counters=ref_scaler.counters(),
        params=_flat(full),
        finite=all(torch.isfinite(p).all().item() for p in full),
        grads_are_dtensors=all(type(p.grad).__name__ == "DTensor" for p in model.parameters()),
        empty_local_shards=empty_shards,
        consistency=_consistency(scaler),
        telemetry=figures[0] if telemetry else None,
        ref_telemetry=figures[1] if telemetry else None,
        scaler_telemetry=scaler_figures if telemetry else None,
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what a rank owns), or the tensor itself."""
    return t.to_local() if type(t).__name__ == "DTensor" else t


def pipeline(rank, world, steps: int, rate: float, seed: int = 0):
    """A two-stage pipeline of plain tensors: each rank owns different parameters.

    Rank 0 (first stage) owns W0, b0 and a parameter that never gets a gradient; it never calls
    scaler.scale() (no loss), so it starts its scaler with lossscale.distributed.init_stage. Rank 1
    (last stage) owns W1, b1, computes the loss and the scaled backward, and sends the (scaled)
    activation gradient back. Compared with the same network trained in one process.
    """
    if world != 2:
        raise ValueError(f"the pipeline scenario has two stages, not world_size={world}")
    g = torch.Generator().manual_seed(seed)
    w0, b0 = torch.randn(8, 16, generator=g) * 0.3, torch.zeros(16)
    w1, b1 = torch.randn(16, 4, generator=g) * 0.3, torch.zeros(4)
    unused = torch.zeros(5)

    def leaf(t):
        return t.clone().requires_grad_(True)

    mine = [leaf(w0), leaf(b0), leaf(unused)] if rank == 0 else [leaf(w1), leaf(b1)]
    ref = [leaf(w0), leaf(b0), leaf(w1), leaf(b1)]
    opt, ref_opt = make_optimizer("sgd", mine), make_optimizer("sgd", ref)
    cfg = dict(init_scale=2.0**12, growth_interval=4, max_scale=2.0**14)
    scaler, ref_scaler = lossscale.GradScaler("cpu", **cfg), lossscale.GradScaler("cpu", **cfg, process_group=None)
    if rank == 0:
        lsd.init_stage(scaler, "cpu")
    record = []
    for step in range(steps):
        x, y = batch(step, n=8, d_in=8, d_out=4)
        plants = [_planted(r, step, rate, seed) for r in range(world)]
        # The pipeline: rank 0 -> activations -> rank 1 -> loss, backward -> activation grads -> rank 0.
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            if rank == 0:
                h = torch.relu(x @ mine[0] + mine[1])
                dist.send(h.detach(), dst=1)
                grad_h = torch.empty_like(h)
                dist.recv(grad_h, src=1)
            else:
                h = torch.empty(8, 16)  # float32: autocast runs the matmul in fp16, the bias add promotes
                dist.recv(h, src=0)
                h.requires_grad_(True)
                loss = torch.nn.functional.cross_entropy(h @ mine[0] + mine[1], y)
        if rank == 0:
            h.backward(grad_h)
        else:
            scaler.scale(loss).backward()
            dist.send(h.grad, dst=0)
        if plants[rank]:
            _plant([p.grad for p in mine if p.grad is not None], plants[rank], rank, step)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(mine, 5.0)  # local norm: the stages clip apart, as below
        scaler.step(opt)
        scaler.update()
        # The reference: the same network in one process, clipped per stage like the pipeline.
        ref_opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            out = torch.relu(x @ ref[0] + ref[1]) @ ref[2] + ref[3]
            ref_loss = torch.nn.functional.cross_entropy(out, y)
        ref_scaler.scale(ref_loss).backward()
        bad = _worst(plants)
        if bad:
            _plant([ref[0].grad], bad, rank, step)
        ref_scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref[:2], 5.0)
        torch.nn.utils.clip_grad_norm_(ref[2:], 5.0)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        record.append(
            dict(
                skipped=scaler.last_step_skipped,
                ref_skipped=ref_scaler.last_step_skipped,
                scale=scaler.get_scale(),
                ref_scale=ref_scaler.get_scale(),
                planted=plants,
            )
        )
    own = ref[:2] if rank == 0 else ref[2:]
    diff = max((a - b).abs().max().item() for a, b in zip(mine, own))
    return dict(
        record=record,
        max_param_diff=diff,
        counters=scaler.counters(),
        ref_counters=ref_scaler.counters(),
        unused_untouched=rank != 0 or bool((mine[2] == 0).all()),
        consistency=_consistency(scaler),
    )


ADAPTIVE_SHAPES = ([(8, 16), (16,)], [(16, 4), (4,)])  # rank -> the shapes of the parameters it owns


def _adaptive_grads(rank: int, step: int, seed: int, spread: int = 3) -> list:
    """The unscaled gradients of ``rank``'s parameters at ``step`` (any rank can compute any rank's).

    Their magnitude shrinks over training, and the ranks take turns (4 steps each) at being ``spread``
    binades larger, so the global amax that a calibration or a growth window sees comes from either rank
    (``spread=0``: the ranks' amax are alike, so their sum is in a higher binade than their max).
    """
    g = torch.Generator().manual_seed(seed * 7907 + step * 31 + rank)
    exp = -4 - step // 8 + (spread if rank == (step // 4) % 2 else 0) + int(torch.randint(-1, 2, (), generator=g))
    return [torch.randn(shape, generator=g) * 2.0**exp for shape in ADAPTIVE_SHAPES[rank]]


def adaptive(
    rank, world, steps: int, rate: float, reduce: bool = True, optimizer: str = "sgd", seed: int = 0, spread: int = 3
):
    """policy="adaptive" without DDP: each rank owns different parameters with different gradient amax.

    The loss of rank r is sum(p * g_r) over its parameters, so its scaled gradients are exactly
    scale * g_r (a power-of-two scale) and the scaled amax is exactly scale * max|g_r|. Two
    references see the *global* amax: a scaler in one process owning every rank's parameters (with
    the same gradients and the worst plant), and AdaptivePolicy.update fed scale * max over ranks.
    At step 1 only rank 1 plants an inf; later steps plant at random on each rank. The scaler's
    all-reduces are counted per iteration (unscale_/step/update), and what they sent is checked finite
    (a MAX over a NaN is not reliably NaN on gloo or NCCL: the flags must carry the overflow).
    """
    from lossscale.adaptive import AdaptivePolicy

    g = torch.Generator().manual_seed(seed)
    init = [[torch.randn(shape, generator=g) for shape in shapes] for shapes in ADAPTIVE_SHAPES]
    mine = [t.clone().requires_grad_(True) for t in init[rank]]
    ref = [t.clone().requires_grad_(True) for ts in init for t in ts]
    opt, ref_opt = make_optimizer(optimizer, mine), make_optimizer(optimizer, ref)
    cfg = dict(policy="adaptive", init_scale=2.0**16, growth_interval=3, max_scale=2.0**40)
    scaler = lossscale.GradScaler("cpu", **cfg, process_group="default" if reduce else None)
    ref_scaler = lossscale.GradScaler("cpu", **cfg, process_group=None)  # one process: must not reduce
    policy = AdaptivePolicy(init_scale=2.0**16, growth_interval=3, max_scale=2.0**40)
    assert scaler.policy == ref_scaler.policy == policy
    state = policy.init_state()
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):  # counts them, and notes whether all they sent was finite
        calls.append(bool(torch.isfinite(tensor).all()))
        return real_all_reduce(tensor, *args, **kwargs)

    record = []
    for step in range(steps):
        plants = [("inf" if r == 1 else "") if step == 1 else _planted(r, step, rate, seed) for r in range(world)]
        grads = [_adaptive_grads(r, step, seed, spread) for r in range(world)]
        local_amax = [max(t.abs().max().item() for t in gs) for gs in grads]
        for params, o, s, gs, bad in (
            (mine, opt, scaler, grads[rank], plants[rank]),
            (ref, ref_opt, ref_scaler, [t for ts in grads for t in ts], _worst(plants)),
        ):
            o.zero_grad(set_to_none=True)
            s.scale(sum((p * t).sum() for p, t in zip(params, gs))).backward()
            if bad:
                _plant([p.grad for p in params], bad, rank, step)
            calls.clear()
            dist.all_reduce = counting_all_reduce
            try:
                if optimizer == "sgd":
                    s.unscale_(o)  # the host-decided path
                s.step(o)
                s.update()
            finally:
                dist.all_reduce = real_all_reduce
            if s is scaler:
                collectives, sent_finite = len(calls), all(calls)
        # The pure rule fed the global amax of the scaled gradients (exact: a power-of-two scale).
        worst = _worst(plants)
        amax = float(worst) if worst else state.scale * max(local_amax)
        state = policy.update(state, found_inf=bool(worst), found_nan=worst == "nan", amax=amax)
        record.append(
            dict(
                skipped=scaler.last_step_skipped,
                ref_skipped=ref_scaler.last_step_skipped,
                scale=scaler.get_scale(),
                ref_scale=ref_scaler.get_scale(),
                pure_scale=state.scale,
                planted=plants,
                local_amax=local_amax,
                collectives=collectives,
                sent_finite=sent_finite,
            )
        )
    own = ref[:2] if rank == 0 else ref[2:]
    return dict(
        record=record,
        counters=scaler.counters(),
        ref_counters=ref_scaler.counters(),
        pure_counters=dict(
            steps=state.steps,
            skipped_steps=state.skipped_steps,
            inf_steps=state.inf_steps,
            nan_steps=state.nan_steps,
            bad_loss_steps=state.bad_loss_steps,
            overflow_streak=state.overflow_streak,
        ),
        params_equal=all(torch.equal(a, b) for a, b in zip(mine, own)),
        consistency=_consistency(scaler),
    )


def no_grads(rank, world, passthrough: bool, optimizer: str = "sgd"):
    """Rank 0's optimizer holds parameters that never get a gradient; the other ranks plant inf, NaN.

    Rank 0 still joins every collective (its flags are zeros). ``passthrough`` uses
    GradScaler.passthrough() (scale 1, no unscale pass), whose flags come from the read-only pass.
    """
    make = lossscale.GradScaler.passthrough if passthrough else lossscale.GradScaler
    scaler = make("cpu", init_scale=2.0**8) if not passthrough else make("cpu")
    p = torch.zeros(3, requires_grad=True)
    opt = make_optimizer(optimizer, [p])
    if rank == 0:
        lsd.init_stage(scaler, "cpu")
    plan = {1: "inf", 2: "nan"}
    record = []
    for step in range(4):
        opt.zero_grad(set_to_none=True)
        if rank != 0:
            scaler.scale((p * (step + 1.0)).sum()).backward()
            if step in plan:
                p.grad[0] = float(plan[step])
        scaler.step(opt)
        scaler.update()
        record.append(dict(skipped=scaler.last_step_skipped, scale=scaler.get_scale()))
    return dict(record=record, counters=scaler.counters(), params=p.detach().tolist(), consistency=_consistency(scaler))


def groups(rank, world):
    """Which group a scaler reduces over, and a scaler on an explicit group of all ranks."""
    everyone = dist.new_group(list(range(world)))
    only_rank0 = dist.new_group([0])  # every rank must call new_group; the others get a sentinel
    sub = lsd.reduction_group(lossscale.GradScaler("cpu", process_group=only_rank0))
    resolved = dict(
        default_is_world=lsd.reduction_group(lossscale.GradScaler("cpu")) is dist.group.WORLD,
        none_is_none=lsd.reduction_group(lossscale.GradScaler("cpu", process_group=None)) is None,
        subgroup=(sub is only_rank0) if rank == 0 else (sub is None),  # non-members: no reduction
    )
    scaler = lossscale.GradScaler("cpu", process_group=everyone)
    p = torch.ones(3, requires_grad=True)
    opt = make_optimizer("sgd", [p])
    skipped = []
    for step in range(3):
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        if step == 1 and rank == world - 1:
            p.grad[1] = float("inf")
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.last_step_skipped)
    # Each rank alone in a group of its own, an inf on rank 0 and a NaN on rank 1 in the same step: both
    # overflow, and the NaN pass that follows reduces over the scaler's group, not the world, so rank 0
    # counts an inf step and rank 1 a NaN step.
    own = [dist.new_group([r]) for r in range(world)]  # every rank calls new_group for every group
    alone = lossscale.GradScaler("cpu", process_group=own[rank])
    q = torch.ones(3, requires_grad=True)
    alone.scale(q.sum()).backward()
    q.grad[0] = float("inf") if rank == 0 else float("nan")
    alone.step(make_optimizer("sgd", [q]))
    alone.update()
    return dict(
        resolved=resolved,
        skipped=skipped,
        scale=scaler.get_scale(),
        consistency_on_group=_consistency_on(scaler, everyone),
        alone={k: alone.counters()[k] for k in ("inf_steps", "nan_steps")},
    )


def _consistency_on(scaler, group):
    try:
        lsd.check_consistency(scaler, group)
    except RuntimeError as e:
        return str(e)
    return None


def diverged(rank, world):
    """check_consistency on ranks whose scalers really differ: every rank raises, naming each value."""
    scaler = lossscale.GradScaler("cpu", init_scale=2.0 ** (10 + rank), process_group=None)
    scaler.scale(torch.ones(()))  # starts the state on the device
    return dict(message=_consistency(scaler))


def stats(rank, world):
    """reduce_stats on shards equals grad_stats on the whole; mismatched structures raise on every rank."""
    from lossscale.stats import grad_stats

    g = torch.Generator().manual_seed(3)
    specials = torch.tensor([0.0, 2.0**-26, 2.0**-25, 2.0**-24, 6e-8, 70000.0, float("inf"), float("nan")])
    chunks = [torch.randn(1000, generator=g) * 2.0 ** -float(k) for k in range(0, 30, 3)]
    chunks += [specials, torch.randn(64, generator=g).half(), torch.randn(50, generator=g).bfloat16()]
    mine = chunks[rank::world]
    out = {}
    for scale in (1.0, 2.0**10):
        whole = grad_stats(chunks, scale=scale).to_dict()
        out[f"one@{scale}"] = (lsd.reduce_stats(grad_stats(mine, scale=scale)).to_dict(), whole)
    # A dict (per-parameter telemetry): one pair of collectives for all entries; rank 1 has nothing.
    per = {"a": grad_stats(chunks[0] if rank == 0 else [], scale=1.0, device="cpu"), "b": grad_stats(mine, scale=1.0)}
    reduced = lsd.reduce_stats(per)
    out["dict"] = (
        {k: v.to_dict() for k, v in reduced.items()},
        {"a": grad_stats(chunks[0], scale=1.0).to_dict(), "b": grad_stats(chunks, scale=1.0).to_dict()},
    )
    out["at"] = (lsd.reduce_stats([grad_stats(mine)])[0].at(2.0**12).flushed, grad_stats(chunks).at(2.0**12).flushed)
    try:
        lsd.reduce_stats(grad_stats(mine, fmt="fp16" if rank == 0 else "bf16"))
        out["mismatch"] = None
    except RuntimeError as e:
        out["mismatch"] = str(e)
    return out


def example(rank, world, steps: int, inject_at: int):
    """examples/ddp_torchrun.py's train(), on this pool's group (torchrun would have made it)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "ddp_torchrun.py")
    spec = importlib.util.spec_from_file_location("ddp_torchrun_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lines = []
    scaler = module.train(steps=steps, inject_at=inject_at, log=lines.append)
    return dict(lines=lines, counters=scaler.counters(), scale=scaler.get_scale())


def fsdp_empty_rank(rank, world, per):
    """FSDP2 where rank 1 holds only empty local shards (every parameter has one row), with the
    scaler's telemetry reducing across ranks: both ranks must take the same collectives, and their
    figures must be the whole gradient's (rank 0 holds all of it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lossscale.stats import grad_stats

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 1))
    fully_shard(model, mesh=mesh)
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = lossscale.GradScaler("cpu", model=model, telemetry=dict(every=1, per=per))
    figures = []
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        scaler.scale(model(x).square().mean()).backward()
        whole = grad_stats([p.grad.full_tensor() for p in model.parameters()], scale=1.0, fmt="fp16")
        scaler.step(opt)
        scaler.update()
        m = scaler.metrics()  # a collective on both ranks
        figures.append(
            dict(
                numel=m["grad/numel"],
                zeros=m["grad/zeros"],
                whole_numel=whole.numel,
                keys=sorted(k for k in m if k.startswith("grad/")),
                per_group={k: v for k, v in m.items() if k.endswith("/numel") and k != "grad/numel"},
            )
        )
    return dict(local_numel=local_numel, figures=figures)


def bad_loss_elsewhere(rank, world, optimizer: str):
    """No DDP: each rank its own model; at step 1 rank 0's loss is NaN (a bad batch) while rank 1's
    gradients overflow. Reduced, that is an overflow with a bad loss: every rank skips and the scale
    holds (the bad loss is not the scale's doing), on the host's path and on the device's alike."""
    model = tiny_mlp(0)
    opt = make_optimizer(optimizer, model.parameters())
    scaler = lossscale.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000, process_group="default")
    record = []
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        x, y = batch(step * world + rank)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        if step == 1 and rank == 0:
            loss = loss * float("nan")
        scaler.scale(loss).backward()
        if step == 1 and rank == 1:
            model[2].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        record.append(dict(skipped=scaler.last_step_skipped, scale=scaler.get_scale()))
    return dict(record=record, counters=scaler.counters())


def one_rank_reasons(rank, world):
    """Reasons only one rank sees, and figures every rank sees alike.

    * ``skip_if``: each rank its own parameter (no DDP); at step 1 rank 0's gradient norm is above the
      threshold and rank 1's is not. The spike is reduced with the other flags, so both ranks skip.
    * Each rank alone in a group of its own: an inf on rank 0 only skips rank 0 only (the flags are
      reduced over the scaler's group, not the world).
    * Telemetry on replicated (DDP) gradients with ``reduce="auto"``: the figures are this rank's own,
      the same on every rank, not summed over the ranks.
    """
    spiky = lossscale.GradScaler("cpu", init_scale=2.0**4, skip_if=dict(grad_norm_above=10.0))
    p = torch.ones(4, requires_grad=True)
    opt = make_optimizer("sgd", [p])
    spike_skipped = []
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        size = 100.0 if step == 1 and rank == 0 else 1.0  # a gradient norm of 200 on rank 0 at step 1
        spiky.scale((p * size).sum()).backward()
        spiky.step(opt)
        spiky.update()
        spike_skipped.append(spiky.last_step_skipped)

    own = [dist.new_group([r]) for r in range(world)]  # every rank calls new_group for every group
    alone = lossscale.GradScaler("cpu", init_scale=2.0**4, process_group=own[rank])
    q = torch.ones(3, requires_grad=True)
    alone.scale(q.sum()).backward()
    if rank == 0:
        q.grad[0] = float("inf")
    alone.step(make_optimizer("sgd", [q]))
    alone.update()

    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(tiny_mlp(0))
    watched = lossscale.GradScaler("cpu", init_scale=2.0**4, telemetry=dict(every=1))
    ddp_opt = make_optimizer("sgd", model.parameters())
    x, y = batch(rank)
    watched.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
    watched.step(ddp_opt)
    watched.update()
    figures = watched.metrics()
    return dict(
        spike_skipped=spike_skipped,
        spike_counters=spiky.counters(),
        alone_skipped=alone.last_step_skipped,
        numel=figures["grad/numel"],
        model_numel=sum(p.numel() for p in model.parameters()),
        figures=figures,
    )


SCENARIOS = {
    f.__name__: f
    for f in (
        ddp,
        fsdp,
        pipeline,
        adaptive,
        no_grads,
        groups,
        diverged,
        stats,
        example,
        fsdp_empty_rank,
        bad_loss_elsewhere,
        one_rank_reasons,
    )
}
