"""lossscale.integrations.verl on verl's own training step: a TrainingWorker (the worker verl's SFT trainer
runs, verl/trainer/sft_trainer.py:174) with an FSDP2 (and an FSDP1) engine on two gloo ranks, a 2-layer
Qwen2 with fp16 parameters built from a config, an overflow injected by a loss multiplied so the
backward overflows FP16.

verl pins transformers<5.11, which clashes with the main test environment: these tests run in their
own venv (envs/verl/ci.sh) and are skipped elsewhere. The CPU platform verl lacks is tests/_verl_cpu.py.
"""

import os

import pytest

pytest.importorskip("verl")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

pytestmark = pytest.mark.distributed

INIT_SCALE = 2.0**10  # a scale at which this model's clean FP16 steps do not overflow
# Times the loss: the loss stays finite in FP16 (about 4e3), and times the scale the backward passes
# 65504, FP16's largest value: an overflow of the scale's, not a bad batch.
BLOW_UP = 1e3
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "verl_fp16.py")
SEQ_LENS = [(7, 5), (6, 8)]  # per rank: two sequences each


# --------------------------------------------------------------------------------- in the ranks
def _on_cpu():
    """verl on this rank's CPU, in the pool's process group."""
    import _verl_cpu

    _verl_cpu.use_cpu()
    os.environ.update(
        VERL_ENGINE_DEVICE="cuda",  # the engine registered for "cuda" (verl/workers/engine/base.py:404)
        RANK=str(dist.get_rank()),
        WORLD_SIZE=str(dist.get_world_size()),  # what Worker.__init__ reads
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="0",
    )


def _worker(model_dir, strategy, param_dtype="fp16", build=True):
    """verl's TrainingWorker with an FSDP engine over the pool's process group, built (reset()) if ``build``."""
    _on_cpu()
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.config.engine import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    model = HFModelConfig(
        path=model_dir,
        load_tokenizer=False,
        use_remove_padding=False,
        enable_gradient_checkpointing=False,
        override_config={"attn_implementation": "eager"},
    )  # verl's default: flash_attention_2
    engine = FSDPEngineConfig(
        strategy=strategy,
        forward_only=False,
        use_torch_compile=False,
        mixed_precision={"param_dtype": param_dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
    )
    # A warm-up schedule: the LR changes at every scheduler step, so a held step shows.
    optim = FSDPOptimizerConfig(lr=1e-3, lr_warmup_steps=10, total_training_steps=20)
    config = TrainingWorkerConfig(
        model_type="language_model",
        model_config=model,
        engine_config=engine,
        optimizer_config=optim,
        checkpoint_config=CheckpointConfig(),
    )
    worker = TrainingWorker(config=config)
    worker.set_loss_fn(_Loss())
    if build:
        worker.reset()  # engine.initialize()
    return worker


class _Loss:
    """verl's SFT loss (verl/workers/utils/losses.py:28), times ``factor``."""

    factor = 1.0

    def __call__(self, model_output, data, dp_group=None):
        from verl.workers.utils.losses import sft_loss

        loss, metrics = sft_loss(None, model_output, data, dp_group)
        return loss * self.factor, metrics


def _batch(rank, world, step):
    """This rank's batch in the layout verl's SFT trainer builds (no padding: nested tensors)."""
    from tensordict.tensorclass import NonTensorData
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    g = torch.Generator().manual_seed(1000 * step + rank)
    lens = SEQ_LENS[rank % len(SEQ_LENS)]
    ids = [torch.randint(1, 64, (n,), generator=g) for n in lens]
    nested = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    data = {
        "input_ids": nested(ids),
        "position_ids": nested([torch.arange(n) for n in lens]),
        "loss_mask": nested([torch.ones(n, dtype=torch.long) for n in lens]),
    }
    meta = dict(
        use_remove_padding=False,
        use_dynamic_bsz=False,
        max_token_len_per_gpu=64,
        micro_batch_size_per_gpu=len(lens),
        temperature=1.0,
        global_batch_size=len(lens) * world,
        pad_mode=DatasetPadMode.NO_PADDING,
        pad_token_id=0,
    )
    td = tu.get_tensordict(tensor_dict=data, non_tensor_dict=meta)
    every_rank = [n for r in range(world) for n in SEQ_LENS[r % len(SEQ_LENS)]]  # the batch's lengths, all ranks
    tu.assign_non_tensor(td, update_lr_scheduler=True, global_token_num=NonTensorData(every_rank))
    return td


def _snapshot(engine):
    """Copies of this rank's weight shards and optimizer state."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    weights = [local(p).detach().clone() for p in engine.module.parameters()]
    state = [
        {k: local(v).clone() if torch.is_tensor(v) else v for k, v in s.items()}
        for s in engine.optimizer.state.values()
    ]
    return weights, state


def _same(a, b) -> bool:
    (wa, sa), (wb, sb) = a, b
    return (
        len(wa) == len(wb)
        and all(torch.equal(x, y) for x, y in zip(wa, wb))
        and len(sa) == len(sb)
        and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(sa, sb))
    )


def _finite(engine) -> bool:
    return all(torch.isfinite(w).all() for w in _snapshot(engine)[0])


def _train(worker, rank, world, step, factor=1.0):
    """verl's training step (the worker's train_batch: the engine's, then the LR scheduler's step) on
    this rank's batch, with the loss times ``factor``; what it did to the weights, the optimizer state
    and the LR, and the metrics verl returned."""
    engine = worker.engine
    before, lr_epoch = _snapshot(engine), engine.lr_scheduler.last_epoch
    worker.loss_fn.factor = factor
    metrics = worker.train_batch(_batch(rank, world, step))["metrics"]
    return {
        "unchanged": _same(before, _snapshot(engine)),
        "finite": _finite(engine),
        "lr_stepped": engine.lr_scheduler.last_epoch - lr_epoch,
        "metrics": {k: v for k, v in metrics.items() if k.startswith("scaler/") or k == "lr"},
    }


# step -> the loss factor: clean, clean, an overflow, clean, a NaN batch
PLAN = [1.0, 1.0, BLOW_UP, 1.0, float("nan")]


def overflow(rank, world, model_dir, strategy, checkpoint_dir):
    """The PLAN's steps with lossscale attached; then save, a new worker, attach, load."""
    from lossscale.integrations import verl as ls_verl

    worker = _worker(model_dir, strategy)
    scaler = ls_verl.attach(worker.engine, init_scale=INIT_SCALE)
    result = {
        "attached_twice": ls_verl.attach(worker.engine) is scaler,
        "engine_scaler": worker.engine.scaler is scaler,
        "steps": [_train(worker, rank, world, step, factor) for step, factor in enumerate(PLAN)],
        "scaler_device": str(scaler.device),
        "state": scaler.state_dict(),
        "tracker": scaler._get_growth_tracker(),
    }
    worker.save_checkpoint(checkpoint_dir, global_step=len(PLAN))
    result["files"] = sorted(os.listdir(checkpoint_dir))
    saved_lr_epoch = worker.engine.lr_scheduler.last_epoch
    worker.reset()  # initialize() again: a new engine state, verl's scaler and checkpoint manager with it
    again = ls_verl.attach(worker.engine, init_scale=INIT_SCALE)
    result["reattached"] = again is not scaler and worker.engine.scaler is again
    result["after_reset"] = _train(worker, rank, world, 0)["metrics"]["scaler/steps"]

    fresh = _worker(model_dir, strategy)
    fresh_scaler = ls_verl.attach(fresh.engine, init_scale=INIT_SCALE)
    result["fresh_scale"] = fresh_scaler.get_scale()
    fresh.load_checkpoint(checkpoint_dir)
    result["loaded_state"] = fresh_scaler.state_dict()
    result["loaded_tracker"] = fresh_scaler._get_growth_tracker()
    result["lr_epochs"] = (fresh.engine.lr_scheduler.last_epoch, saved_lr_epoch)
    return result


def stock(rank, world, model_dir, strategy, checkpoint_dir):
    """The PLAN's NaN batch on verl's own fp16 path, without lossscale; then its checkpoint loaded by an
    engine with lossscale attached."""
    import warnings

    from lossscale.integrations import verl as ls_verl

    worker = _worker(model_dir, strategy)
    scaler = worker.engine.scaler
    step = _train(worker, rank, world, 4, factor=PLAN[4])
    result = {
        "scaler": type(scaler).__module__ + "." + type(scaler).__name__,
        "enabled": scaler.is_enabled(),
        "finite": step["finite"],
        "unchanged": step["unchanged"],
    }
    worker.save_checkpoint(checkpoint_dir, global_step=1)
    attached = ls_verl.attach(worker.engine, init_scale=INIT_SCALE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worker.load_checkpoint(checkpoint_dir)
    result["warnings"] = [
        (str(w.message), os.path.basename(w.filename)) for w in caught if issubclass(w.category, RuntimeWarning)
    ]
    result["scale"] = attached.get_scale()
    return result


def example(rank, world, model_dir, checkpoint_dir):
    """examples/verl_fp16.py's demo."""
    import importlib.util

    _on_cpu()
    spec = importlib.util.spec_from_file_location("verl_fp16_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lines = []
    out = module.main(model_dir, checkpoint_dir, attn_implementation="eager", log=lines.append)
    return {
        **out,
        "lines": lines,
        "classes": [module.FP16ActorRolloutRefWorker.__name__, module.FP16SFTTrainer.__name__],
    }


def refusals(rank, world, model_dir):
    """attach() on an engine not built yet and on a bf16 engine: the error, and the engine as it was."""
    from lossscale.integrations import verl as ls_verl

    out = {}
    for name, worker in (
        ("unbuilt", _worker(model_dir, "fsdp2", build=False)),
        ("bf16", _worker(model_dir, "fsdp2", param_dtype="bf16")),
    ):
        engine, before = worker.engine, dict(vars(worker.engine))
        try:
            ls_verl.attach(engine)
        except (RuntimeError, ValueError) as error:
            out[name] = f"{type(error).__name__}: {error}"
        out[name + "_untouched"] = vars(engine) == before
    return out


# train_mini_batch's steps -> the loss factor of each of its two mini-batches
MINI_PLAN = [[1.0, BLOW_UP], [BLOW_UP, 1.0], [BLOW_UP, BLOW_UP], [1.0, 1.0]]
MINI_LENS = [(7, 5, 6, 8), (6, 8, 5, 7)]  # per rank: four sequences, two mini-batches of two


def _mini_batch_data(rank, world, step):
    """This rank's batch for verl's ``train_mini_batch``: four sequences in two mini-batches."""
    from tensordict.tensorclass import NonTensorData
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    g = torch.Generator().manual_seed(1000 * step + rank)
    lens = MINI_LENS[rank % len(MINI_LENS)]
    ids = [torch.randint(1, 64, (n,), generator=g) for n in lens]
    nested = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    data = {
        "input_ids": nested(ids),
        "position_ids": nested([torch.arange(n) for n in lens]),
        "loss_mask": nested([torch.ones(n, dtype=torch.long) for n in lens]),
    }
    meta = dict(
        use_remove_padding=False,
        use_dynamic_bsz=False,
        max_token_len_per_gpu=64,
        micro_batch_size_per_gpu=2,
        temperature=1.0,
        global_batch_size=2 * world,
        pad_mode=DatasetPadMode.NO_PADDING,
        pad_token_id=0,
        num_mini_batch=2,
        seed=step,
    )
    td = tu.get_tensordict(tensor_dict=data, non_tensor_dict=meta)
    tu.assign_non_tensor(td, global_token_num=NonTensorData([n for r in range(world) for n in MINI_LENS[r]]))
    return td


def mini_batches(rank, world, model_dir, strategy):
    """verl's ``train_mini_batch`` (engine_workers.py:243: the LR scheduler steps after the last
    mini-batch only) over MINI_PLAN, with lossscale attached: per call, which mini-batches were skipped
    and how far the LR schedule advanced."""
    from lossscale.integrations import verl as ls_verl

    worker = _worker(model_dir, strategy)
    scaler = ls_verl.attach(worker.engine, init_scale=INIT_SCALE)
    train_batch, factors, skipped = worker.train_batch, [], []

    def each_mini_batch(data):  # the loss factor of this mini-batch, and whether its step was skipped
        worker.loss_fn.factor = factors.pop(0)
        out = train_batch(data)
        skipped.append(scaler.last_step_skipped)
        return out

    worker.train_batch = each_mini_batch
    steps = []
    for step, plan in enumerate(MINI_PLAN):
        factors[:], skipped[:] = list(plan), []
        before, lr_epoch = _snapshot(worker.engine), worker.engine.lr_scheduler.last_epoch
        metrics = worker.train_mini_batch(_mini_batch_data(rank, world, step))["metrics"]
        steps.append(
            dict(
                skipped=list(skipped),
                logged=metrics["scaler/last_step_skipped"],
                lr_stepped=worker.engine.lr_scheduler.last_epoch - lr_epoch,
                unchanged=_same(before, _snapshot(worker.engine)),
                finite=_finite(worker.engine),
            )
        )
    return steps


SCENARIOS = {
    "overflow": overflow,
    "stock": stock,
    "example": example,
    "refusals": refusals,
    "mini_batches": mini_batches,
}


# --------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 2-layer Qwen2 built from a config, saved where verl loads models from (nothing downloaded)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("qwen2-tiny")
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def pool():
    from _dist_workers import WorkerPool

    pool = WorkerPool(world_size=2, scenarios=__name__)
    yield pool
    pool.close()


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_overflow_is_skipped_lr_held_metrics_logged_scaler_checkpointed(pool, model_dir, tmp_path, strategy):
    results = pool.run(
        "overflow", timeout_s=300, model_dir=model_dir, strategy=strategy, checkpoint_dir=str(tmp_path / "ckpt")
    )
    for rank, r in enumerate(results):
        assert r["attached_twice"] and r["engine_scaler"] and r["scaler_device"] == "cpu"
        assert r["reattached"] and r["after_reset"] == [[1.0], [1.0]]  # a new scaler after reset(), in training
        steps = r["steps"]
        skipped = [s["metrics"]["scaler/last_step_skipped"] for s in steps]
        assert skipped == [[[float(f != 1.0)]] * 2 for f in PLAN]  # as verl logs it: a list per dp rank
        for s, factor in zip(steps, PLAN):
            assert s["finite"]
            assert s["unchanged"] == (factor != 1.0)  # weights and optimizer state, bitwise
            assert s["lr_stepped"] == (factor == 1.0)  # the LR held on the skipped steps
        scales = [s["metrics"]["scaler/loss_scale"] for s in steps]
        # The overflow backs off; the NaN batch (a non-finite loss) keeps the scale.
        assert scales == [[[INIT_SCALE]] * 2] * 2 + [[[INIT_SCALE / 2]] * 2] * 3
        last = steps[-1]["metrics"]
        assert last["scaler/skipped_steps"] == [[2.0], [2.0]] and last["scaler/bad_loss_steps"] == [[1.0], [1.0]]
        assert last["scaler/health/verdict"] == [[0.0], [0.0]]  # healthy
        lrs = [s["metrics"]["lr"] for s in steps]
        assert lrs[2] == lrs[1] != lrs[3] == lrs[4]  # verl logs the LR in force
        assert f"lossscale_scaler_world_size_2_rank_{rank}.pt" in r["files"]
        assert r["fresh_scale"] == INIT_SCALE
        assert r["loaded_state"] == r["state"]  # every field, scale and tracker included
        assert r["loaded_tracker"] == r["tracker"] and r["state"]["scale"] == INIT_SCALE / 2
        assert r["lr_epochs"][0] == r["lr_epochs"][1] == PLAN.count(1.0)


def test_the_lr_steps_when_any_mini_batch_of_the_call_stepped(pool, model_dir):
    # verl steps the LR scheduler once, after the last mini-batch: it must advance when any mini-batch's
    # optimizer step was taken (the last one skipped included), and hold only when every one was skipped.
    results = pool.run("mini_batches", timeout_s=300, model_dir=model_dir, strategy="fsdp2")
    for r in results:
        assert [s["skipped"] for s in r] == [[f != 1.0 for f in plan] for plan in MINI_PLAN]
        # as verl returns it: one flat list, a value per dp rank for each mini-batch in turn
        assert [s["logged"] for s in r] == [[float(f != 1.0) for f in plan for _ in range(2)] for plan in MINI_PLAN]
        assert [s["lr_stepped"] for s in r] == [int(1.0 in plan) for plan in MINI_PLAN]
        assert [s["unchanged"] for s in r] == [1.0 not in plan for plan in MINI_PLAN]
        assert all(s["finite"] for s in r)


def test_stock_verl_applies_the_nan_step_and_its_checkpoint_loads_with_a_warning(pool, model_dir, tmp_path):
    """What attach() fixes: verl's ShardedGradScaler disables itself off CUDA, and because it exists verl
    skips its own non-finite guard, so the NaN batch's step is applied. Its checkpoint has no scaler:
    loading it with lossscale attached warns and keeps the scaler's state."""
    for r in pool.run(
        "stock", timeout_s=300, model_dir=model_dir, strategy="fsdp2", checkpoint_dir=str(tmp_path / "ckpt")
    ):
        assert r["scaler"] == "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler"
        assert not r["enabled"]
        assert not r["unchanged"] and not r["finite"]
        [(message, where)] = r["warnings"]
        assert "saved without lossscale attached" in message and where == "test_rl_verl.py"  # the user's line
        assert r["scale"] == INIT_SCALE


def test_the_example_trains_skips_and_resumes(pool, model_dir, tmp_path):
    r0, r1 = pool.run("example", timeout_s=300, model_dir=model_dir, checkpoint_dir=str(tmp_path / "ckpt"))
    for r in (r0, r1):
        assert [rec["scaler/last_step_skipped"] for rec in r["records"]] == [[[float(s == 2)]] * 2 for s in range(4)]
        assert [rec["scaler/loss_scale"][0] for rec in r["records"]] == [[1024.0], [1024.0], [512.0], [512.0]]
        assert r["resumed"] == r["saved"]
        assert r["classes"] == ["FP16ActorRolloutRefWorker", "FP16SFTTrainer"]
    assert len(r0["lines"]) == 5 and not r1["lines"]  # rank 0 logs


def test_attach_refuses_an_unbuilt_or_bf16_engine_and_changes_nothing(pool, model_dir):
    for r in pool.run("refusals", timeout_s=300, model_dir=model_dir):
        assert r["unbuilt"].startswith("RuntimeError: attach(engine) was called before the engine was built")
        assert r["bf16"].startswith("ValueError: the engine trains in torch.bfloat16")
        assert r["unbuilt_untouched"] and r["bf16_untouched"]


def test_attach_refuses_what_is_not_a_verl_fsdp_engine():
    from lossscale.integrations import verl as ls_verl

    with pytest.raises(ValueError, match="must be a verl FSDPEngine"):
        ls_verl.attach(torch.nn.Linear(2, 2))


def test_importing_the_integration_imports_no_verl():
    import subprocess
    import sys

    code = "import sys, lossscale.integrations.verl\nprint('verl' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_missing_verl_is_named_with_how_to_install_it(monkeypatch):
    import sys

    from lossscale.integrations import verl as ls_verl

    for name in {"verl"} | {m for m in sys.modules if m.startswith("verl.")}:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.raises(ModuleNotFoundError, match=r"needs verl, which is not installed: pip install verl"):
        ls_verl.attach(object())
