"""lossscale.integrations.torchtitan on torchtitan's own Trainer, FP16: FSDP2, two pipeline stages, and
expert parallelism, over two gloo ranks.

A 2-layer llama3 (torchtitan's debugmodel config, cut to two layers) trains on an in-memory dataset
through torchtitan's ``Trainer.train_step``, checkpoints through its ``CheckpointManager`` (DCP) and
logs through its ``MetricsProcessor``; a 2-layer DeepSeek-V3 (its debugmodel config: one dense layer,
one MoE layer of 8 routed experts) trains the same way with its experts split over the two ranks.
torchtitan pins clash with the main test environment: these tests run in the venv
envs/torchtitan/ci.sh builds (skipped elsewhere). CPU stand-ins for CUDA-only pieces:
tests/_torchtitan_cpu.py.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("torchtitan")

pytestmark = pytest.mark.distributed

SEQ_LEN, BATCH, VOCAB, LOSS_CHUNKS = 32, 2, 2048, 2
INFLOW_STEP, NAN_STEP, CHECKPOINT_STEP = 2, 4, 3  # the overflow, the non-finite loss, the saved step
PP_MICROBATCHES, PP_STEPS = 2, 3  # pipeline parallel: microbatches per step; steps (INFLOW_STEP among them)
ACCUMULATION = 2  # gradient-accumulation steps of the accumulation scenario
EP_STEPS, EP_STARVED = 3, 7  # expert parallel: steps (INFLOW_STEP among them); the expert no token is routed to


# ------------------------------------------------------------------------------- torchtitan parts
def _components():
    """A tokenizer and a dataloader built by torchtitan's Configurable mechanism, in memory."""
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class TinyTokenizer(BaseTokenizer):
        """No files: the data are token ids already."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config, *, tokenizer_path=None):
            super().__init__()

        def encode(self, *args, **kwargs):
            raise NotImplementedError

        def decode(self, *args, **kwargs):
            raise NotImplementedError

        def get_vocab_size(self) -> int:
            return VOCAB

    class TokenBatches(BaseDataLoader):
        """Random token ids per data-parallel rank, one document per row (positions 0..L-1)."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(
            self, config, *, dp_world_size, dp_rank, tokenizer, seq_len, local_batch_size, snapshot_every_n_steps=None
        ):
            self.rank, self.seq_len, self.batch, self.served = dp_rank, seq_len, local_batch_size, 0

        def __iter__(self):
            while True:
                g = torch.Generator().manual_seed(1000 * self.rank + self.served)
                tokens = torch.randint(0, VOCAB, (self.batch, self.seq_len + 1), generator=g)
                self.served += 1
                positions = torch.arange(self.seq_len).expand(self.batch, -1).contiguous()
                yield {"input": tokens[:, :-1], "positions": positions}, tokens[:, 1:]

        def state_dict(self):
            return {f"served_{self.rank}": self.served}

        def load_state_dict(self, state_dict):
            self.served = state_dict.get(f"served_{self.rank}", self.served)

    return TinyTokenizer, TokenBatches


def _config(folder: str, parallel: str = "fsdp", accumulation: int = 1):
    """torchtitan's llama3 debugmodel run (its config_registry.py), smaller, in FP16, checkpointing; FSDP2
    over the two ranks; with ``parallel="pipeline"`` two pipeline stages (one layer each), with
    ``parallel="experts"`` torchtitan's DeepSeek-V3 debugmodel, expert parallel (no checkpointing in either).
    ``accumulation``: gradient-accumulation steps (torchtitan derives them from the global batch size)."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import TrainingConfig
    from torchtitan.models import deepseek_v3, llama3
    from torchtitan.trainer import Trainer

    tokenizer, loader = _components()
    spec = (deepseek_v3 if parallel == "experts" else llama3).model_registry("debugmodel")
    spec.model.layers = spec.model.layers[:2]
    parallelism = {"fsdp": _fsdp_parallelism, "pipeline": _pipeline_parallelism, "experts": _expert_parallelism}
    return Trainer.Config(
        model_spec=spec,
        tokenizer=tokenizer.Config(),
        dataloader=loader.Config(),
        loss=ChunkedLossWrapper.Config(num_chunks=LOSS_CHUNKS, loss_fn=CrossEntropyLoss.Config()),
        optimizer=default_adamw(lr=8e-4),  # AdamW, implementation "fused" (torchtitan's default)
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear"),
        training=TrainingConfig(
            local_batch_size=BATCH,
            global_batch_size=BATCH * 2 * accumulation if accumulation > 1 else -1,  # 2: the data-parallel ranks
            seq_len=SEQ_LEN,
            steps=10,
            disable_cuda_graphs=True,
            mixed_precision_param="float16",
        ),
        parallelism=parallelism[parallel](),
        metrics=MetricsProcessor.Config(log_freq=1),
        checkpoint=CheckpointManager.Config(enable=parallel == "fsdp", interval=CHECKPOINT_STEP, folder="checkpoint"),
        dump_folder=folder,
    )


def _fsdp_parallelism():
    from torchtitan.config import ParallelismConfig

    return ParallelismConfig(data_parallel_shard_degree=2, spmd_backend="partial_dtensor")  # FSDP2


def _pipeline_parallelism():
    """Stage 0: tok_embeddings, layers.0; stage 1: layers.1, norm, lm_head (pipeline_parallel.py:366-476).
    torchtitan's default schedule, 1F1B, over PP_MICROBATCHES microbatches; FSDP2's mixed precision (FP16
    compute) on a one-rank data-parallel mesh (models/llama3/parallelize.py:69-83)."""
    from torchtitan.config import ParallelismConfig

    return ParallelismConfig(
        pipeline_parallel_degree=2,
        data_parallel_shard_degree=1,
        pipeline_parallel_schedule="1F1B",
        pipeline_parallel_microbatch_size=BATCH // PP_MICROBATCHES,
        spmd_backend="partial_dtensor",
    )


def _expert_parallelism():
    """The routed experts split over the two ranks (ep: experts 0-3 on rank 0, 4-7 on rank 1), exchanged by
    torchtitan's all-to-all token dispatcher ("standard"); the dense parameters FSDP2-sharded over the same
    two ranks (the experts' own FSDP2 mesh, efsdp, is fsdp / ep = 1: parallel_dims.py:279)."""
    from torchtitan.config import ParallelismConfig

    return ParallelismConfig(data_parallel_shard_degree=2, expert_parallel_degree=2, spmd_backend="partial_dtensor")


class _Recorder:
    """Stands where torchtitan's TensorBoard/W&B loggers stand (MetricsProcessor.logger)."""

    def __init__(self):
        self.logged = []

    def log(self, metrics, step):
        self.logged.append((step, dict(metrics)))

    def close(self):
        pass

    def scaler_and_loss(self) -> list:
        """``(step, figures)`` for every logged step: the scaler's, the loss's and the grad norm only."""
        return [
            (step, {k: v for k, v in m.items() if k.startswith(("scaler/", "loss_metrics/", "grad_norm"))})
            for step, m in self.logged
        ]


def _snapshot(trainer):
    """Every rank's parameter shards and optimizer state, copied."""
    params = [p.detach().to_local().clone() for m in trainer.model_parts for p in m.parameters()]
    state = [
        {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in s.items()}
        for opt in trainer.optimizers
        for s in opt.state.values()
    ]
    return params, state


def _schedule(trainer):
    """Where every LR schedule stands: its step count and its learning rates."""
    return [(s.last_epoch, s.get_last_lr()) for s in trainer.lr_schedulers]


def _same(a, b) -> bool:
    return (
        len(a[0]) == len(b[0])
        and all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
        and len(a[1]) == len(b[1])
        and all(s.keys() == t.keys() and all(torch.equal(s[k], t[k]) for k in s) for s, t in zip(a[1], b[1]))
    )


# ------------------------------------------------------------------------------------ the scenario
def train(rank, world, folder: str, attach: bool = True):
    """On every rank: build torchtitan's Trainer, attach, run torchtitan's train_step as its train() loop
    does, with an injected inf in rank 1's gradient at INFLOW_STEP and a NaN forward on rank 0 at
    NAN_STEP; then a second Trainer loads the checkpoint of CHECKPOINT_STEP."""
    import _torchtitan_cpu

    _torchtitan_cpu.install()
    os.environ["LOCAL_RANK"] = str(rank)  # tools/utils.py get_local_device(): torchrun sets it
    from torchtitan.trainer import Trainer

    import lossscale.integrations.torchtitan as ls_torchtitan

    trainer = Trainer(_config(folder))
    _torchtitan_cpu.gloo_reductions(trainer)
    step_now, scaled_norm = {"n": 0}, []

    fwd_bwd = trainer.forward_backward_step

    def planting(**kwargs):  # an overflow in one rank's gradient, after the backward
        loss = fwd_bwd(**kwargs)
        if step_now["n"] == 1:  # the norm of the scaled gradients, over both ranks' shards
            grads = [p.grad for p in trainer.model_parts[0].parameters()]
            scaled_norm.append(torch.nn.utils.get_total_norm(grads).full_tensor().item())
        if step_now["n"] == INFLOW_STEP and rank == 1:
            grad = next(trainer.model_parts[0].parameters()).grad.to_local()
            grad.view(-1)[0] = float("inf")
        return loss

    trainer.forward_backward_step = planting
    model = trainer.model_parts[0]
    model.tok_embeddings.register_forward_hook(  # a batch whose forward is NaN on one rank
        lambda module, args, out: out * float("nan") if step_now["n"] == NAN_STEP and rank == 0 else None
    )
    if not attach:
        return _run_unattached(trainer, step_now)

    refusals = _refusals(trainer, ls_torchtitan)
    scaler = ls_torchtitan.attach(trainer, init_scale=2.0**10, growth_interval=100)
    refusals["same_scaler_again"] = ls_torchtitan.attach(trainer) is scaler
    with pytest.raises(ValueError, match="already attached"):
        ls_torchtitan.attach(trainer, init_scale=2.0)
    recorder = trainer.metrics_processor.logger = _Recorder()
    data = trainer.batch_generator(trainer.dataloader)
    out = {"steps": [], "refusals": refusals}
    saved = None
    for _ in range(NAN_STEP + 1):
        trainer.step += 1  # as Trainer.train() does (trainer.py:1032-1044)
        step_now["n"] = trainer.step
        out["steps"].append(dict(step=trainer.step, **_observed_step(trainer, scaler, data)))
        trainer.checkpointer.save(trainer.step, last_step=False)
        if trainer.step == CHECKPOINT_STEP:
            saved = scaler.state_dict()
    out["counters"], out["scaled_norm"] = scaler.counters(), scaled_norm
    out["logged"] = recorder.scaler_and_loss()

    # torchtitan's own DCP checkpoint, into a fresh Trainer with another scaler configuration.
    second = Trainer(_config(folder))
    _torchtitan_cpu.gloo_reductions(second)
    restored = ls_torchtitan.attach(second, init_scale=2.0**3)
    fresh = restored.state_dict()
    second.checkpointer.load(step=CHECKPOINT_STEP)
    out["restored"] = dict(
        step=second.step,
        equal=restored.state_dict() == saved,
        differed=fresh != saved,
        scale=restored.get_scale(),
        saved_scale=saved["scale"],
    )
    second.close()

    # A scale too large for FP16: the scaled backward overflows by itself on the first step, and with
    # max_consecutive_skips=1 that one skip is a stuck run, which attach's on_stuck="raise" stops.
    third = Trainer(_config(folder))
    _torchtitan_cpu.gloo_reductions(third)
    large = ls_torchtitan.attach(third, init_scale=2.0**24, max_consecutive_skips=1)
    third.step = 1
    try:
        third.train_step(third.batch_generator(third.dataloader))
        raised = None
    except RuntimeError as error:
        raised = str(error)
    out["too_large"] = dict(
        skipped=large.last_step_skipped, counters=large.counters(), scale=large.get_scale(), raised=raised
    )
    third.close()
    trainer.close()
    return out


def _refusals(trainer, ls_torchtitan):
    """attach() on what it cannot scale: a ValueError naming the fix, the trainer left as it was."""
    chunk_loss = trainer.loss_fn.loss_fn  # ChunkedLossWrapper's per-chunk loss: the one attach() scales
    loss_class, step = type(chunk_loss), trainer.optimizers.step
    with pytest.raises(ValueError, match="torchtitan.trainer.Trainer"):
        ls_torchtitan.attach(object())
    trainer.config.training.mixed_precision_param = "bfloat16"
    try:
        with pytest.raises(ValueError, match='set it to "float16"'):
            ls_torchtitan.attach(trainer)
    finally:
        trainer.config.training.mixed_precision_param = "float16"
    with pytest.raises(ValueError, match="device="):
        ls_torchtitan.attach(trainer, device="cpu")
    return {
        "untouched": type(chunk_loss) is loss_class
        and trainer.optimizers.step == step
        and ls_torchtitan._ATTACHED not in trainer.__dict__
    }


def _run_unattached(trainer, step_now):
    """torchtitan alone in FP16: the same injected overflow reaches the weights."""
    data = trainer.batch_generator(trainer.dataloader)
    for _ in range(INFLOW_STEP):
        trainer.step += 1
        step_now["n"] = trainer.step
        trainer.train_step(data)
    params = _snapshot(trainer)[0]
    trainer.close()
    return {"finite": all(torch.isfinite(p).all().item() for p in params)}


def pipeline(rank, world, folder: str):
    """Two pipeline stages, rank 0 the first and rank 1 the last (the one with the loss): torchtitan's
    train_step for PP_STEPS steps with an inf planted in the last stage's gradient at INFLOW_STEP; then a
    fresh Trainer whose scale is too large for FP16."""
    import _torchtitan_cpu
    import torch.distributed as dist

    _torchtitan_cpu.install()
    os.environ["LOCAL_RANK"] = str(rank)
    import lossscale.integrations.torchtitan as ls_torchtitan

    trainer = _pipeline_trainer(folder)
    step_now, scaled_sq = {"n": 0}, []
    fwd_bwd = trainer.forward_backward_step

    def planting(**kwargs):  # after the schedule's forwards and backwards, before attach unscales
        loss = fwd_bwd(**kwargs)
        if step_now["n"] == 1:  # the sum of squares of this stage's scaled gradients
            grads = [p.grad.to_local() for m in trainer.model_parts for p in m.parameters()]
            scaled_sq.append(torch.nn.utils.get_total_norm(grads).item() ** 2)
        if step_now["n"] == INFLOW_STEP and rank == 1:
            grad = next(trainer.model_parts[0].parameters()).grad.to_local()
            grad.view(-1)[0] = float("inf")
        return loss

    trainer.forward_backward_step = planting
    scaler = ls_torchtitan.attach(trainer, init_scale=2.0**10, growth_interval=100)
    scaled_losses = _counting_scaled_losses(scaler, step_now)
    recorder = trainer.metrics_processor.logger = _Recorder()
    data = trainer.batch_generator(trainer.dataloader)
    steps = []
    for _ in range(PP_STEPS):
        trainer.step += 1
        step_now["n"] = trainer.step
        steps.append(_observed_step(trainer, scaler, data))
    both_stages_sq = torch.tensor(scaled_sq, dtype=torch.float64)
    dist.all_reduce(both_stages_sq)  # the whole model's sum of squares, by hand
    out = dict(
        steps=steps,
        last_stage=trainer.pp_has_last_stage,
        scaled_losses=[scaled_losses[step] for step in range(1, PP_STEPS + 1)],
        counters=scaler.counters(),
        stage_sq=scaled_sq[0],
        both_stages_sq=both_stages_sq.item(),
        logged=dict(recorder.scaler_and_loss()),
    )
    trainer.close()

    # A scale too large for FP16: the schedule's scaled backward overflows by itself.
    fresh = _pipeline_trainer(folder)
    large = ls_torchtitan.attach(fresh, init_scale=2.0**24)
    fresh.step = 1
    out["too_large"] = _observed_step(fresh, large, fresh.batch_generator(fresh.dataloader))
    out["too_large"]["counters"] = large.counters()
    fresh.close()
    return out


def _pipeline_trainer(folder: str):
    """torchtitan's Trainer, pipeline parallel, with the CPU stand-ins."""
    import _torchtitan_cpu
    from torchtitan.trainer import Trainer

    trainer = Trainer(_config(folder, parallel="pipeline"))
    _torchtitan_cpu.gloo_reductions(trainer)
    _torchtitan_cpu.microbatch_lists(trainer)
    return trainer


def _counting_scaled_losses(scaler, step_now) -> Counter:
    """How many losses the scaler scales, per step."""
    counts, scale = Counter(), scaler.scale

    def counting(outputs):
        counts[step_now["n"]] += 1
        return scale(outputs)

    scaler.scale = counting
    return counts


def _observed_step(trainer, scaler, data) -> dict:
    """torchtitan's train_step, and what it did to this rank (its stage, its experts and shards)."""
    before, lr_before, scale_before = _snapshot(trainer), _schedule(trainer), scaler.get_scale()
    trainer.train_step(data)
    after = _snapshot(trainer)
    return dict(
        skipped=scaler.last_step_skipped,
        unchanged=_same(before, after),
        lr_held=_schedule(trainer) == lr_before,
        scale_before=scale_before,
        scale_after=scaler.get_scale(),
        finite=all(torch.isfinite(p).all().item() for p in after[0]),
    )


def experts(rank, world, folder: str):
    """Expert parallel: torchtitan's train_step for EP_STEPS steps, no token routed to expert EP_STARVED,
    and an inf planted at INFLOW_STEP in one expert's gradient on rank 1 only (expert gradients are not
    reduced across ranks: rank 0 never sees it)."""
    import _torchtitan_cpu
    import torch.distributed as dist

    _torchtitan_cpu.install()
    os.environ["LOCAL_RANK"] = str(rank)
    from torchtitan.models.common.moe import MoE
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
    from torchtitan.trainer import Trainer

    import lossscale.integrations.torchtitan as ls_torchtitan

    trainer = Trainer(_config(folder, parallel="experts"))
    _torchtitan_cpu.gloo_reductions(trainer)
    params = [p for m in trainer.model_parts for p in m.parameters()]
    is_expert = [_is_expert(p) for p in params]
    (moe,) = [m for part in trainer.model_parts for m in part.modules() if isinstance(m, MoE)]
    dispatcher = moe.routed_experts.token_dispatcher
    w1 = moe.routed_experts.inner_experts.w1_EFD  # (experts, hidden, dim): this rank's experts, dim 0
    local_experts = w1.to_local().shape[0]
    first_expert = w1.device_mesh.get_local_rank("ep") * local_experts
    with torch.no_grad():  # the router's load-balancing bias: no token chooses this expert
        _local(moe.expert_bias_E)[EP_STARVED] = -1e4

    step_now, hand = {"n": 0}, {}
    fwd_bwd = trainer.forward_backward_step

    def planting(**kwargs):  # after the forward-backward, before attach unscales
        loss = fwd_bwd(**kwargs)
        if step_now["n"] == 1:
            # this rank's share of the squared norm of the scaled gradients: its own experts, its FSDP2 shard
            # of the dense parameters (summed over the ranks below, every element once), in float64, and
            # from each shard's float32 norm as torch computes it (get_total_norm: one per tensor)
            grads = [p.grad.to_local() for p in params]
            exact = [g.double().square().sum().item() for g in grads]
            fp32 = [torch.linalg.vector_norm(g).double().item() ** 2 for g in grads]
            for name, squares in (("sq", exact), ("fp32_sq", fp32)):
                hand["expert_" + name] = sum(sq for sq, e in zip(squares, is_expert) if e)
                hand["dense_" + name] = sum(sq for sq, e in zip(squares, is_expert) if not e)
            tokens = _local(moe.tokens_per_expert_E).clone()  # routed from this rank's tokens, this step
            dist.all_reduce(tokens)
            hand["tokens"] = tokens.tolist()
            if first_expert <= EP_STARVED < first_expert + local_experts:
                starved = EP_STARVED - first_expert
                hand["starved_grad_zero"] = all(
                    not torch.any(p.grad.to_local()[starved]).item() for p, e in zip(params, is_expert) if e
                )
        if step_now["n"] == INFLOW_STEP and rank == 1:
            w1.grad.to_local().view(-1)[0] = float("inf")
        return loss

    trainer.forward_backward_step = planting
    scaler = ls_torchtitan.attach(trainer, init_scale=2.0**10, growth_interval=100)
    recorder = trainer.metrics_processor.logger = _Recorder()
    data = trainer.batch_generator(trainer.dataloader)
    steps = []
    for _ in range(EP_STEPS):
        trainer.step += 1
        step_now["n"] = trainer.step
        before = [p.detach().to_local().clone() for p in params]
        step = _observed_step(trainer, scaler, data)
        changed = [not torch.equal(b, p.detach().to_local()) for b, p in zip(before, params)]
        step["experts_changed"] = all(c for c, e in zip(changed, is_expert) if e)
        step["dense_changed"] = all(c for c, e in zip(changed, is_expert) if not e)
        steps.append(step)
    sq = {k: torch.tensor(v, dtype=torch.float64) for k, v in hand.items() if k.endswith("_sq")}
    for total in sq.values():
        dist.all_reduce(total)
    out = dict(
        steps=steps,
        counters=scaler.counters(),
        all_to_all=isinstance(dispatcher, AllToAllTokenDispatcher) and dispatcher.ep_mesh.size() == world,
        ep_enabled=trainer.parallel_dims.ep_enabled,
        experts=(first_expert, local_experts),
        expert_params=sum(is_expert),
        squares={k: v.item() for k, v in sq.items()},
        tokens=hand["tokens"],
        starved_grad_zero=hand.get("starved_grad_zero"),
        logged=dict(recorder.scaler_and_loss()),
    )
    trainer.close()
    return out


def _is_expert(param) -> bool:
    """How torchtitan's clip tells an expert parameter (distributed/utils.py:697-699): its mesh has "ep"."""
    return "ep" in param.device_mesh.mesh_dim_names


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def accumulation(rank, world, folder: str):
    """FSDP2 with ACCUMULATION gradient-accumulation steps (forward_backward_step runs that many times per
    step): at step 1 the scaled gradients' norm after the last micro-batch, by hand; at INFLOW_STEP an inf
    planted in rank 1's gradient by the last micro-batch's backward only."""
    import _torchtitan_cpu

    _torchtitan_cpu.install()
    os.environ["LOCAL_RANK"] = str(rank)
    from torchtitan.trainer import Trainer

    import lossscale.integrations.torchtitan as ls_torchtitan

    trainer = Trainer(_config(folder, accumulation=ACCUMULATION))
    _torchtitan_cpu.gloo_reductions(trainer)
    step_now, calls, scaled_norm = {"n": 0}, Counter(), []
    fwd_bwd = trainer.forward_backward_step

    def planting(**kwargs):  # inside attach's wrapper: before it unscales after the last micro-batch
        loss = fwd_bwd(**kwargs)
        calls[step_now["n"]] += 1
        last = calls[step_now["n"]] == ACCUMULATION
        if last and step_now["n"] == 1:
            grads = [p.grad for p in trainer.model_parts[0].parameters()]
            scaled_norm.append(torch.nn.utils.get_total_norm(grads).full_tensor().item())
        if last and step_now["n"] == INFLOW_STEP and rank == 1:
            next(trainer.model_parts[0].parameters()).grad.to_local().view(-1)[0] = float("inf")
        return loss

    trainer.forward_backward_step = planting
    scaler = ls_torchtitan.attach(trainer, init_scale=2.0**10, growth_interval=100)
    recorder = trainer.metrics_processor.logger = _Recorder()
    data = trainer.batch_generator(trainer.dataloader)
    steps = []
    for _ in range(INFLOW_STEP + 1):
        trainer.step += 1
        step_now["n"] = trainer.step
        steps.append(_observed_step(trainer, scaler, data))
    out = dict(
        accumulation=trainer.gradient_accumulation_steps,
        calls=[calls[n] for n in range(1, INFLOW_STEP + 2)],
        steps=steps,
        scaled_norm=scaled_norm,
        logged=dict(recorder.scaler_and_loss()),
    )
    trainer.close()
    return out


SCENARIOS = {"train": train, "pipeline": pipeline, "experts": experts, "accumulation": accumulation}


# ----------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from _dist_workers import WorkerPool

    pool = WorkerPool(world_size=2, scenarios=__name__)
    try:
        attached = pool.run("train", timeout_s=240, folder=str(tmp_path_factory.mktemp("titan")))
        alone = pool.run("train", timeout_s=120, folder=str(tmp_path_factory.mktemp("alone")), attach=False)
    finally:
        pool.close()
    return attached, alone


def test_without_a_scaler_the_overflow_reaches_the_weights(results):
    _, alone = results
    # torchtitan clips by the global norm (inf): rank 0's shard is zeroed, rank 1's keeps the inf, then AdamW
    assert [r["finite"] for r in alone] == [True, False]


def test_overflow_step_is_skipped_bitwise_lr_held_scale_backed_off(results):
    attached, _ = results
    for rank in attached:
        step = rank["steps"][INFLOW_STEP - 1]
        assert step["skipped"] and step["unchanged"] and step["lr_held"]  # weights, AdamW state, LR
        assert step["scale_after"] == step["scale_before"] / 2
        assert all(s["finite"] for s in rank["steps"])


def test_clean_steps_train(results):
    attached, _ = results
    for rank in attached:
        clean = [s for s in rank["steps"] if s["step"] not in (INFLOW_STEP, NAN_STEP)]
        assert clean and all(not s["skipped"] and not s["unchanged"] and not s["lr_held"] for s in clean)
        assert all(s["scale_after"] == s["scale_before"] for s in clean)  # growth_interval=100


def test_non_finite_loss_is_skipped_and_training_goes_on(results):
    """torchtitan raises "Loss is not finite" on this logging step; the skipped step does not stop the run."""
    attached, _ = results
    for rank in attached:
        step = rank["steps"][NAN_STEP - 1]
        assert step["skipped"] and step["unchanged"] and step["lr_held"]
        assert step["scale_after"] == step["scale_before"]  # the loss check: a bad batch, no backoff
        assert rank["steps"][NAN_STEP]["step"] == NAN_STEP + 1 and not rank["steps"][NAN_STEP]["skipped"]
        assert rank["counters"]["skipped_steps"] == 2 and rank["counters"]["bad_loss_steps"] == 1


def test_scaler_metrics_reach_torchtitans_loggers(results):
    attached, _ = results
    for rank in attached:
        logged = dict(rank["logged"])
        assert sorted(logged) == list(range(1, NAN_STEP + 2))  # every step logs (log_freq=1), the NaN one too
        assert logged[INFLOW_STEP]["scaler/last_step_skipped"] == 1.0
        assert logged[INFLOW_STEP]["scaler/loss_scale"] == 2.0**9
        assert logged[INFLOW_STEP + 1]["scaler/last_step_skipped"] == 0.0
        assert math.isfinite(logged[INFLOW_STEP + 1]["loss_metrics/global_avg_loss"])
        assert logged[NAN_STEP]["scaler/bad_loss_steps"] == 1.0
        assert "loss_metrics/global_avg_loss" not in logged[NAN_STEP]


def test_scaler_restored_from_torchtitans_checkpoint(results):
    attached, _ = results
    for rank in attached:
        restored = rank["restored"]
        assert restored["step"] == CHECKPOINT_STEP
        assert restored["differed"] and restored["equal"]
        assert restored["scale"] == restored["saved_scale"] == 2.0**9


def test_attach_refuses_what_it_cannot_scale_and_returns_the_same_scaler_again(results):
    attached, _ = results
    for rank in attached:
        assert rank["refusals"] == {"untouched": True, "same_scaler_again": True}


def test_torchtitans_clip_sees_the_true_gradients(results):
    """torchtitan logs the norm its clip_grad_norm_ computed: the scaled gradients' norm over the scale."""
    attached, _ = results
    for rank in attached:
        logged = dict(rank["logged"])
        assert logged[1]["scaler/loss_scale"] == 2.0**10 and len(rank["scaled_norm"]) == 1
        assert logged[1]["grad_norm"] == pytest.approx(rank["scaled_norm"][0] / 2.0**10, rel=1e-5)


def test_with_gradient_accumulation_the_gradients_are_unscaled_after_the_last_micro_batch(tmp_path):
    """torchtitan's clip sees the true accumulated gradients, and an overflow in the last micro-batch's
    backward skips the step on both ranks (unscaled after the first, it would reach the weights)."""
    from _dist_workers import WorkerPool

    pool = WorkerPool(world_size=2, scenarios=__name__)
    try:
        ranks = pool.run("accumulation", timeout_s=240, folder=str(tmp_path))
    finally:
        pool.close()
    for r in ranks:
        assert r["accumulation"] == ACCUMULATION and r["calls"] == [ACCUMULATION] * (INFLOW_STEP + 1)
        logged = r["logged"]
        assert logged[1]["scaler/loss_scale"] == 2.0**10 and len(r["scaled_norm"]) == 1
        assert logged[1]["grad_norm"] == pytest.approx(r["scaled_norm"][0] / 2.0**10, rel=1e-5)
        for n, step in enumerate(r["steps"], start=1):
            overflow = n == INFLOW_STEP
            assert step["skipped"] == overflow and step["lr_held"] == overflow, n
            assert step["unchanged"] == overflow and step["finite"], n
        assert r["steps"][INFLOW_STEP - 1]["scale_after"] == 2.0**9


def test_the_backward_is_scaled_a_too_large_scale_overflows_fp16(results):
    """2**24 over 128 tokens puts 131072 into the FP16 logits' gradient: inf, so the step is skipped."""
    attached, _ = results
    for rank in attached:
        too_large = rank["too_large"]
        assert too_large["skipped"] and too_large["counters"]["skipped_steps"] == 1
        assert too_large["counters"]["bad_loss_steps"] == 0 and too_large["scale"] == 2.0**23


def test_a_stuck_run_stops(results):
    """attach's on_stuck="raise": the scaler's stuck check ends torchtitan's train_step with its diagnosis."""
    attached, _ = results
    for rank in attached:
        assert rank["too_large"]["raised"] is not None and "consecutive skipped step" in rank["too_large"]["raised"]


# -------------------------------------------------------------------------------- pipeline parallel
@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    """Per rank (rank 0 the first stage, rank 1 the last): the pipeline scenario's results."""
    from _dist_workers import WorkerPool

    pool = WorkerPool(world_size=2, scenarios=__name__)
    try:
        first, last = pool.run("pipeline", timeout_s=240, folder=str(tmp_path_factory.mktemp("pipeline")))
    finally:
        pool.close()
    assert not first["last_stage"] and last["last_stage"]
    return first, last


def test_pipeline_clean_steps_train_on_both_stages(pipelined):
    """The first step too: torch's stages infer their backward's shapes on it, through the loss closure."""
    for rank in pipelined:
        clean = [s for step, s in enumerate(rank["steps"], 1) if step != INFLOW_STEP]
        assert clean and all(not s["skipped"] and not s["unchanged"] and not s["lr_held"] for s in clean)
        assert all(s["scale_after"] == s["scale_before"] for s in clean)  # growth_interval=100
        assert all(s["finite"] for s in rank["steps"])
        assert rank["counters"]["bad_loss_steps"] == 0
    _, last = pipelined
    assert all(math.isfinite(last["logged"][step]["loss_metrics/global_avg_loss"]) for step in (1, 3))


def test_pipeline_overflow_in_the_last_stage_is_skipped_on_both_stages(pipelined):
    """The inf is in the last stage's gradient only: the first stage skips by the all-reduced decision."""
    for rank in pipelined:
        step = rank["steps"][INFLOW_STEP - 1]
        assert step["skipped"] and step["unchanged"] and step["lr_held"]  # weights, AdamW state, LR bitwise
        assert step["scale_before"] == 2.0**10 and step["scale_after"] == 2.0**9
        assert rank["counters"]["skipped_steps"] == 1


def test_pipeline_torchtitans_clip_norm_across_stages_is_the_true_norm(pipelined):
    """torchtitan's clip_grad_norm_ reduces the norm over the pipeline stages (pp_mesh): it is the norm of
    both stages' scaled gradients, computed here by hand, over the scale."""
    for rank in pipelined:
        true_norm = math.sqrt(rank["both_stages_sq"]) / 2.0**10
        assert 0 < rank["stage_sq"] < rank["both_stages_sq"]  # both stages have gradients
        assert rank["logged"][1]["scaler/loss_scale"] == 2.0**10
        assert rank["logged"][1]["grad_norm"] == pytest.approx(true_norm, rel=1e-5)


def test_pipeline_scales_each_microbatch_loss_once_and_nothing_else(pipelined):
    """The last stage scales each microbatch's per-chunk losses, every step; the first step's shape inference
    (a forward of uninitialised tensors through the loss closure) is not scaled; the first stage has no loss."""
    first, last = pipelined
    assert last["scaled_losses"] == [PP_MICROBATCHES * LOSS_CHUNKS] * PP_STEPS
    assert first["scaled_losses"] == [0] * PP_STEPS


def test_pipeline_backward_is_scaled_a_too_large_scale_overflows_fp16(pipelined):
    """2**24 over the 64 tokens of a step puts 262144 into the FP16 logits' gradient in the schedule's backward."""
    for rank in pipelined:
        too_large = rank["too_large"]
        assert too_large["skipped"] and too_large["unchanged"] and too_large["lr_held"]
        assert too_large["scale_after"] == 2.0**23
        assert too_large["counters"]["skipped_steps"] == 1 and too_large["counters"]["bad_loss_steps"] == 0


# ------------------------------------------------------------------------------- expert parallel
@pytest.fixture(scope="module")
def expert_parallel(tmp_path_factory):
    """Per rank (rank 0 holds experts 0-3, rank 1 experts 4-7): the experts scenario's results."""
    from _dist_workers import WorkerPool

    pool = WorkerPool(world_size=2, scenarios=__name__)
    try:
        ranks = pool.run("experts", timeout_s=240, folder=str(tmp_path_factory.mktemp("experts")))
    finally:
        pool.close()
    for rank, result in enumerate(ranks):  # torchtitan's EP path: all-to-all dispatch, the clip's EP branch
        assert result["ep_enabled"] and result["all_to_all"]
        assert result["experts"] == (4 * rank, 4) and result["expert_params"] == 3  # w1, w2, w3 of the MoE layer
    return ranks


def test_expert_parallel_clean_steps_train_experts_and_dense_layers(expert_parallel):
    for rank in expert_parallel:
        clean = [s for step, s in enumerate(rank["steps"], 1) if step != INFLOW_STEP]
        assert clean and all(not s["skipped"] and not s["unchanged"] and not s["lr_held"] for s in clean)
        assert all(s["experts_changed"] and s["dense_changed"] for s in clean)
        assert all(s["scale_after"] == s["scale_before"] for s in clean)  # growth_interval=100
        assert all(s["finite"] for s in rank["steps"])
        assert all(math.isfinite(rank["logged"][step]["loss_metrics/global_avg_loss"]) for step in (1, 3))
        assert rank["counters"]["skipped_steps"] == 1 and rank["counters"]["bad_loss_steps"] == 0


def test_expert_parallel_overflow_in_one_ranks_expert_gradient_is_skipped_on_both_ranks(expert_parallel):
    """The inf is in an expert of rank 1's: rank 0 holds other experts and skips by the all-reduced decision."""
    for rank in expert_parallel:
        step = rank["steps"][INFLOW_STEP - 1]
        assert step["skipped"] and step["unchanged"] and step["lr_held"]  # weights, AdamW state, LR bitwise
        assert not step["experts_changed"] and not step["dense_changed"]
        assert step["scale_before"] == 2.0**10 and step["scale_after"] == 2.0**9


def test_expert_parallel_torchtitans_clip_norm_is_the_true_norm(expert_parallel):
    """torchtitan's clip_grad_norm_(ep_enabled=True) combines the experts' and the dense parameters' norms:
    the norm of the true gradients, every expert counted once, computed here by hand from the scaled ones.

    torch's float32 norm of a CPU tensor of 10**5-10**6 elements is itself off by up to a few 1e-5 (its
    accumulation): hence 1e-4 against the float64 norm, and 1e-6 against the same per-shard float32 norms
    torch computes, combined by hand: tight enough to tell the experts counted twice or not at all."""
    for rank in expert_parallel:
        squares, logged = rank["squares"], rank["logged"][1]
        assert squares["expert_sq"] > 0 and squares["dense_sq"] > 0
        assert logged["scaler/loss_scale"] == 2.0**10
        assert logged["grad_norm"] == pytest.approx(
            math.sqrt(squares["expert_sq"] + squares["dense_sq"]) / 2.0**10, rel=1e-4
        )

        experts_counted = [  # once (the true norm), twice, not at all
            math.sqrt(times * squares["expert_fp32_sq"] + squares["dense_fp32_sq"]) / 2.0**10 for times in (1, 2, 0)
        ]
        assert logged["grad_norm"] == pytest.approx(experts_counted[0], rel=1e-6)
        assert all(logged["grad_norm"] != pytest.approx(norm, rel=1e-6) for norm in experts_counted[1:])


def test_expert_parallel_an_expert_without_tokens_has_zero_gradients(expert_parallel):
    """No token chose expert EP_STARVED: its slice of its rank's expert weights has zero gradients (torchtitan
    holds a rank's experts in one parameter per weight), and the steps above train, skip and clip as checked."""
    first, last = expert_parallel
    assert first["tokens"] == last["tokens"]
    assert first["tokens"][EP_STARVED] == 0 and sum(first["tokens"]) > 0
    assert first["starved_grad_zero"] is None and last["starved_grad_zero"] is True
