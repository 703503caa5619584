"""Mixture-of-experts on four gloo ranks: the skip decision, the check and the clip against a
single-process reference of the whole model.

The layout is Megatron's: experts sharded over an expert-parallel (EP) group, {0, 1} and {2, 3}, each
holding half the experts; each expert copied over the expert-data-parallel group ({0, 2}, {1, 3}); the
dense parameters (embedding, router, head) replicated on every rank (data parallel, gradients summed
over the world), or sharded by FSDP2 (``fully_shard`` over the world mesh). Tokens reach experts through
differentiable all-reduces over the EP group (gloo has no all-to-all). The routing is fixed by the data
so that some experts receive no tokens on some ranks (no gradient there), one expert none anywhere.

The ranks are the spawned pool of tests/_dist_workers.py, running this module's SCENARIOS.
"""

import math
import warnings

import pytest
import torch
import torch.distributed as dist

import lossscale

pytestmark = pytest.mark.distributed

needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

WORLD, EP, D, HIDDEN, E, TOKENS = 4, 2, 8, 16, 4, 6
SCALE = 2.0**10


class MoE(torch.nn.Module):
    """embed -> top-1 expert (gate from the router, expert fixed by the data) added to the residual -> head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(D, D)
        self.router = torch.nn.Linear(D, E)
        self.experts = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(D, HIDDEN), torch.nn.Tanh(),
                                                               torch.nn.Linear(HIDDEN, D)) for _ in range(E))
        self.head = torch.nn.Linear(D, 2)

    def expert_params(self, experts):
        return [p for e in experts for p in self.experts[e].parameters()]

    def forward(self, x, assign, combine=None):
        """``combine(h, partial_fn)``: how the experts' outputs for these tokens are made (None: every
        expert here, one process)."""
        h = self.embed(x)
        gate = torch.softmax(self.router(h).float(), -1).gather(1, assign[:, None])
        if combine is None:
            out = _apply_experts(self.experts, range(E), h, assign)
        else:
            out = combine(h, assign)
        return self.head(h + gate * out)


def _apply_experts(experts, which, h, assign):
    # h * 0, not zeros: the output depends on h even where these experts get no token, so every EP rank's
    # backward reaches the all-reduces (collectives) that gathered h and summed the outputs.
    out = h * 0
    for e in which:
        rows = (assign == e).nonzero().squeeze(1)
        if rows.numel():  # an expert without tokens is not called: it gets no gradient
            out = out.index_add(0, rows, experts[e](h[rows]).to(out.dtype))
    return out


def _data(rank, step):
    """Rank ``rank``'s tokens and their experts. Expert 3 gets no token anywhere; expert 2 none in the
    first EP group (ranks 0, 1): no gradient on rank 1 before the expert-data-parallel sum."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(TOKENS, D, generator=g)
    choices = torch.tensor([0, 1] if rank < EP else [0, 1, 2])
    assign = choices[torch.randint(len(choices), (TOKENS,), generator=g)]
    return x, assign, x[:, :2].sin()


def _layout(rank):
    ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group, in order
    edp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep, edp = ep_groups[rank // EP], edp_groups[rank % EP]
    local = list(range((rank % EP) * (E // EP), (rank % EP + 1) * (E // EP)))  # rank 0: experts 0, 1
    return ep, edp, local


def _ep_combine(model, local, ep, rank):
    """The experts' outputs for this rank's tokens: every EP rank's tokens gathered (an all-reduce SUM of
    zero-padded slots), each rank's experts applied, the outputs summed back (another all-reduce)."""
    from torch.distributed.nn.functional import all_reduce  # differentiable: its backward all-reduces too

    # torch 2.13 calls it deprecated in favour of a private module; it is the public differentiable one.
    warnings.filterwarnings("ignore", "torch.distributed.nn.functional.all_reduce is deprecated", FutureWarning)

    slot = rank % EP

    def combine(h, assign):
        padded = torch.zeros(EP * TOKENS, D, dtype=h.dtype)
        padded = padded.index_copy(0, torch.arange(slot * TOKENS, (slot + 1) * TOKENS), h)
        every_h = all_reduce(padded, group=ep)
        every_assign = torch.zeros(EP * TOKENS, dtype=torch.int64)
        every_assign[slot * TOKENS:(slot + 1) * TOKENS] = assign
        dist.all_reduce(every_assign, group=ep)
        partial = _apply_experts(model.experts, local, every_h, every_assign)
        return all_reduce(partial.float(), group=ep)[slot * TOKENS:(slot + 1) * TOKENS]

    return combine


def _sum_expert_grads(params, edp):
    """Expert data parallel: each expert's gradient summed over its copies, divided by the world (the
    mean over every rank's loss, as DDP and FSDP2 take it). A copy without tokens has None: zeros where a
    peer has a gradient, None where no copy has one."""
    for p in params:
        has = torch.tensor([float(p.grad is not None)])
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=edp)
        if has.item():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=edp)
            p.grad.div_(WORLD)  # a power of two: exact on the scaled gradient


def _sum_dense_grads(params):
    for p in params:  # data parallel: the mean over the world, as DDP
        dist.all_reduce(p.grad)
        p.grad.div_(WORLD)


def _step(model, opt, scaler, rank, step, parts, plant=None, clip=True, fsdp=False):
    """One iteration on this rank; returns the clip's norm (None without clipping)."""
    ep, edp, local = parts
    x, assign, y = _data(rank, step)
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x, assign, _ep_combine(model, local, ep, rank))
    loss = torch.nn.functional.mse_loss(out.float(), y)
    scaler.scale(loss).backward()
    experts = model.expert_params(local)
    _sum_expert_grads(experts, edp)
    if not fsdp:
        _sum_dense_grads([p for p in model.parameters() if all(p is not q for q in model.expert_params(range(E)))])
    if plant is not None and plant[0] == rank:
        model.experts[plant[1]][0].weight.grad[0, 0] = float("inf")  # one expert, one rank
    norm = None
    if clip:
        norm = scaler.clip_grad_norm_(opt, 1.0, expert_parallel=(experts, ep)).item()
    scaler.step(opt)
    scaler.update()
    return norm


def _reference_step(model, opt, scaler, step, plant=None, clip=True):
    opt.zero_grad(set_to_none=True)
    loss = 0.0
    for r in range(WORLD):  # every rank's batch through the whole model
        x, assign, y = _data(r, step)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x, assign)
        loss = loss + torch.nn.functional.mse_loss(out.float(), y) / WORLD
    scaler.scale(loss).backward()
    if plant is not None:
        model.experts[plant[1]][0].weight.grad[0, 0] = float("inf")
    norm = scaler.clip_grad_norm_(opt, 1.0).item() if clip else None
    scaler.step(opt)
    scaler.update()
    return norm


STEPS, PLANT_AT = 4, 2


def moe(rank, world, fsdp: bool = False, optimizer: str = "sgd", clip: bool = True):
    parts = _layout(rank)
    ep, edp, local = parts
    model, ref = MoE(), MoE()
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for m in (model.embed, model.router, model.head):
            fully_shard(m, mesh=mesh)  # gradients reduce-scattered as the mean over the world
    # This rank's parameters: the dense ones and its experts (the others are not its to train).
    mine = [p for n, p in model.named_parameters() if not n.startswith("experts.")] + model.expert_params(local)
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
            "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)}[optimizer]
    opt, ref_opt = make(mine), make(list(ref.parameters()))
    scaler = lossscale.GradScaler("cpu", init_scale=SCALE)
    ref_scaler = lossscale.GradScaler("cpu", init_scale=SCALE, process_group=None)
    record = []
    for step in range(STEPS):
        plant = (1, local[0]) if step == PLANT_AT else None  # rank 1's expert 2: one expert, one rank
        norm = _step(model, opt, scaler, rank, step, parts, plant=plant, clip=clip, fsdp=fsdp)
        ref_norm = _reference_step(ref, ref_opt, ref_scaler, step, plant=(1, 2) if plant else None, clip=clip)
        record.append(dict(norm=norm, ref_norm=ref_norm, skipped=scaler.last_step_skipped,
                           ref_skipped=ref_scaler.last_step_skipped, scale=scaler.get_scale()))
    full = {n: (p.full_tensor() if type(p).__name__ == "DTensor" else p).detach() for n, p in model.named_parameters()}
    names = [n for n in full if not n.startswith("experts.") or int(n.split(".")[1]) in local]
    ref_params = dict(ref.named_parameters())
    diff = max(((full[n] - ref_params[n]).abs().max() / ref_params[n].abs().max()).item() for n in names)
    no_grad = sorted(n for n, p in model.named_parameters() if n.startswith("experts.") and p.grad is None
                     and int(n.split(".")[1]) in local)
    return dict(record=record, param_diff=diff, counters=scaler.counters(), no_grad=no_grad,
                expert3_untouched=all(torch.equal(p, q) for p, q in zip(model.experts[3].parameters(),
                                                                         MoE().experts[3].parameters())))


SCENARIOS = {"moe": moe}


@pytest.fixture(scope="module")
def pool():
    from _dist_workers import WorkerPool

    workers = WorkerPool(world_size=WORLD, scenarios=__name__)
    yield workers
    workers.close()


def _check(results, tolerance=1e-5):
    for rank, r in enumerate(results):
        for step, rec in enumerate(r["record"]):
            assert rec["skipped"] == rec["ref_skipped"] == (step == PLANT_AT), (rank, step)
            if rec["norm"] is None:  # no clip: the check in step() decided
                pass
            elif step != PLANT_AT:  # the global norm: the norm of the whole gradient, on every rank
                assert rec["norm"] == pytest.approx(rec["ref_norm"], rel=1e-5), (rank, step)
            else:
                assert math.isinf(rec["norm"]) and math.isinf(rec["ref_norm"])
        assert [rec["scale"] for rec in r["record"]] == [SCALE] * PLANT_AT + [SCALE / 2] * (STEPS - PLANT_AT)
        assert r["counters"]["skipped_steps"] == 1 and r["counters"]["inf_steps"] == 1
        assert r["param_diff"] < tolerance, rank  # the same training as one process over every token
    # Expert 3 (ranks 1, 3) never got a token: no gradient, never moved; every rank agrees on the norm.
    assert results[1]["no_grad"] == results[3]["no_grad"] == ["experts.3.0.bias", "experts.3.0.weight",
                                                              "experts.3.2.bias", "experts.3.2.weight"]
    assert results[1]["expert3_untouched"] and results[0]["no_grad"] == []
    assert len({repr(r["record"]) for r in results}) == 1


@needs_gloo
@pytest.mark.parametrize("optimizer", ["sgd", "adamw_fused"])
def test_moe_data_parallel_dense(pool, optimizer):
    # Adam divides by sqrt(v): a gradient element near zero, equal to rounding between the two runs'
    # sums (the norms agree to 1e-7), moves its weight by up to lr either way; SGD keeps the rounding.
    _check(pool.run("moe", timeout_s=300, optimizer=optimizer), 1e-5 if optimizer == "sgd" else 1e-3)


@needs_gloo
def test_moe_skip_without_clipping(pool):
    _check(pool.run("moe", timeout_s=300, clip=False))


@needs_gloo
def test_moe_fsdp2_dense(pool):
    _check(pool.run("moe", timeout_s=300, fsdp=True))


def test_expert_parallel_must_be_parameters_and_a_group():
    model = MoE()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = lossscale.GradScaler("cpu")
    scaler.scale(model(*_data(0, 0)[:2]).square().mean()).backward()
    for bad, match in ((3, "must be a pair"), ((list(model.parameters()), "ep"), "ProcessGroup")):
        with pytest.raises(ValueError, match=match):
            scaler.clip_grad_norm_(opt, 1.0, expert_parallel=bad)
    scaler.clip_grad_norm_(opt, 1.0)  # nothing changed: the iteration goes on
    scaler.step(opt)
    scaler.update()
