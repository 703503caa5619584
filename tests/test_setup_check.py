"""lossscale.check_setup: each finding on the set-up that causes it, with what the finding claims shown
on the real thing (the unscale that raises, the gradient dtype FSDP2 writes, the update a fused optimizer
makes, the files a framework saves); a clean set-up says so. FSDP2 (fully_shard) and FSDP1 run on two
gloo ranks (the pool of tests/_dist_workers.py, running this module's SCENARIOS)."""

import os

import pytest
import torch
import torch.distributed as dist

import lossscale
from lossscale.setup_check import Kind

from _models import tiny_mlp

K = Kind


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _backward(model, dtype=torch.float16, scaler=None):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=dtype):
        loss = model(x.to(next(model.parameters()).dtype)).float().square().mean()
    (loss if scaler is None else scaler.scale(loss)).backward()


# ------------------------------------------------------------------------------------ single process
def test_a_clean_setup_says_so():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    report = lossscale.check_setup(model, opt, lossscale.GradScaler(), dtype=torch.float16)
    assert report.ok and report.findings == () and report.dtype == torch.float16 and report.dtype_from == "dtype="
    assert str(report).startswith("lossscale.check_setup: no problems found.")
    # What it could not see is said, not passed over: the checkpoint path of a hand-written loop.
    assert any("checkpointed" in n for n in report.not_checked)
    assert lossscale.check_setup(model, opt).ok and lossscale.check_setup(model, opt).not_checked == ()


def test_a_half_model_has_no_master_weights_and_fp16_gradients():
    model = _mlp().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = lossscale.GradScaler()
    report = lossscale.check_setup(model, opt, scaler)
    assert report.kinds() == [K.FP16_MASTER_WEIGHTS, K.FP16_GRADIENTS]
    names = ("0.weight", "0.bias", "2.weight", "2.bias")
    assert all(f.where == names for f in report.findings)
    assert "model.float()" in report.findings[0].fix and "allow_fp16" in report.findings[1].fix
    text = str(report)
    assert "2 problem(s)" in text and "[fp16_master_weights] 0.weight, 0.bias, 2.weight, 2.bias" in text
    assert report.dtype == torch.float16 and report.dtype_from == "parameters"
    # What the finding says happens: the first unscale_ raises.
    _backward(model, scaler=scaler)
    with pytest.raises(ValueError, match="FP16 gradients"):
        scaler.unscale_(opt)


def test_grad_dtype_decides_the_gradient_finding():
    model = _mlp()
    model[2].weight.grad_dtype = torch.float16  # an FP32 parameter whose gradient autograd casts to FP16
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    report = lossscale.check_setup(model, opt, dtype=torch.float16)
    assert report.kinds() == [K.FP16_GRADIENTS] and report.findings[0].where == ("2.weight",)
    _backward(model)
    assert model[2].weight.grad.dtype == torch.float16 and model[0].weight.grad.dtype == torch.float32

    half = _mlp().half()
    for p in half.parameters():
        p.grad_dtype = torch.float32  # FP32 gradients of FP16 weights: the masters are still FP16
    report = lossscale.check_setup(half, torch.optim.SGD(half.parameters(), lr=0.1))
    assert report.kinds() == [K.FP16_MASTER_WEIGHTS]


def test_a_fused_optimizer_over_fp16_parameters_keeps_fp16_state():
    model = _mlp().half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    report = lossscale.check_setup(model, opt)
    # No gradient finding: a fused optimizer unscales in float32 arithmetic itself.
    assert report.kinds() == [K.FP16_MASTER_WEIGHTS, K.FUSED_FP16_STATE]
    assert report.findings[1].where == ("0.weight", "0.bias", "2.weight", "2.bias")
    # What it says happens: a small gradient's second moment flushes to zero in FP16 state at every
    # step, and the update grows past Adam's: 100 steps of a constant gradient 1e-3 move an FP32 weight
    # by 100 * lr, an FP16 one (FP16 state) by more than 6 times that.
    moved = {}
    for dtype in (torch.float16, torch.float32):
        w = torch.nn.Parameter(torch.zeros(4, dtype=dtype))
        adamw = torch.optim.AdamW([w], lr=1e-3, weight_decay=0.0, fused=True)
        for _ in range(100):
            w.grad = torch.full_like(w, 1e-3)
            adamw.step()
        moved[dtype] = w.detach().float().abs().max().item()
    assert moved[torch.float32] == pytest.approx(0.1, rel=1e-3) and moved[torch.float16] > 6 * 0.1

    # FP16 state a fused optimizer already holds (FP32 parameters) is named too.
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    opt.state[model[0].bias] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(16, dtype=torch.float16),
                                "exp_avg_sq": torch.zeros(16, dtype=torch.float16)}
    report = lossscale.check_setup(model, opt, dtype=torch.float16)
    assert report.kinds() == [K.FUSED_FP16_STATE] and report.findings[0].where == ("0.bias",)


def test_bf16_with_a_scaling_scaler():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    for scaler in (lossscale.GradScaler(), torch.amp.GradScaler("cpu")):
        report = lossscale.check_setup(model, opt, scaler, dtype=torch.bfloat16)
        assert report.kinds() == [K.BF16_WITH_SCALING] and "passthrough()" in report.findings[0].fix
    assert lossscale.check_setup(model, opt, lossscale.GradScaler.passthrough(), dtype=torch.bfloat16).ok
    assert lossscale.check_setup(model, opt, lossscale.GradScaler(enabled=False), dtype=torch.bfloat16).ok
    # Called inside the loop's autocast region, the dtype is read from it.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = lossscale.check_setup(model, opt, lossscale.GradScaler())
    assert report.kinds() == [K.BF16_WITH_SCALING] and report.dtype_from == "autocast"
    # A model entirely in bf16 computes in bf16.
    report = lossscale.check_setup(model.bfloat16(), opt, lossscale.GradScaler())
    assert report.kinds() == [K.BF16_WITH_SCALING] and report.dtype_from == "parameters"
    # Not knowable before the loop runs: said, not guessed.
    report = lossscale.check_setup(_mlp(), opt, lossscale.GradScaler())
    assert report.ok and report.dtype is None and any("dtype=" in n for n in report.not_checked)


def test_bad_arguments_name_themselves():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for kwargs, match in ((dict(model=object(), optimizer=opt), "model="),
                          (dict(model=model, optimizer=model), "optimizer="),
                          (dict(model=model, optimizer=opt, scaler=3), "scaler="),
                          (dict(model=model, optimizer=opt, dtype=torch.float64), "dtype="),
                          (dict(model=model, optimizer=opt, framework="trainer"), "framework=")):
        with pytest.raises(ValueError, match=match):
            lossscale.check_setup(**kwargs)


# ------------------------------------------------------------------------------------ frameworks
@pytest.fixture
def _accelerate(fresh_accelerate_state):
    """accelerate's process-wide state, reset around the test (see _integration_models)."""


from _integration_models import fresh_accelerate_state  # noqa: E402,F401  (fixture)


def test_accelerate_saves_the_scaler_only_when_it_knows_it(_accelerate, tmp_path):
    from accelerate import Accelerator

    model = tiny_mlp()
    opt = torch.optim.AdamW(model.parameters())
    scaler = lossscale.GradScaler()
    accelerator = Accelerator(cpu=True)
    report = lossscale.check_setup(model, opt, scaler, dtype=torch.float16, framework=accelerator)
    assert report.kinds() == [K.SCALER_NOT_CHECKPOINTED] and not any("checkpointed" in n for n in report.not_checked)
    # What it says: accelerator.save_state writes nothing of the scaler.
    accelerator.save_state(str(tmp_path / "before"))
    assert not any("scaler" in f or "custom" in f for f in os.listdir(tmp_path / "before"))
    accelerator.register_for_checkpointing(scaler)
    assert lossscale.check_setup(model, opt, scaler, dtype=torch.float16, framework=accelerator).ok
    accelerator.save_state(str(tmp_path / "after"))
    assert any("custom_checkpoint" in f for f in os.listdir(tmp_path / "after"))


def test_accelerate_attach_and_a_second_scaler(_accelerate):
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    from lossscale.integrations import accelerate as ls_accelerate

    model = tiny_mlp()
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    scaler = ls_accelerate.attach(accelerator)
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    assert lossscale.check_setup(model, opt, scaler, dtype=torch.float16, framework=accelerator).ok
    # accelerate's optimizer stepping through a torch scaler of its own, beside ours.
    theirs = AcceleratedOptimizer(torch.optim.AdamW(tiny_mlp().parameters()), scaler=torch.amp.GradScaler("cpu"))
    report = lossscale.check_setup(tiny_mlp(), theirs, lossscale.GradScaler(), dtype=torch.float16)
    assert report.kinds() == [K.SECOND_SCALER] and report.findings[0].where == ("GradScaler",)


def test_a_trainer_saves_its_accelerators_scaler(_accelerate, tmp_path):
    from transformers import Trainer, TrainingArguments

    from _integration_models import TokenData, tiny_gpt2
    from lossscale.integrations import transformers as ls_transformers

    args = TrainingArguments(output_dir=str(tmp_path), fp16=True, use_cpu=True, report_to=[], max_steps=1)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenData(4, length=8))
    opt = torch.optim.AdamW(trainer.model.parameters())
    mine = lossscale.GradScaler()
    report = lossscale.check_setup(trainer.model, opt, mine, dtype=torch.float16, framework=trainer)
    assert report.kinds() == [K.SCALER_NOT_CHECKPOINTED] and "scaler.pt" in report.findings[0].message
    attached = ls_transformers.attach(trainer)
    assert lossscale.check_setup(trainer.model, opt, attached, dtype=torch.float16, framework=trainer).ok


# ------------------------------------------------------------------------------------ FSDP on gloo
def _fsdp2(kind):
    """A fully_shard-ed MLP on the default group, with the policy and order ``kind`` names."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = _mlp()
    policy = {"clean": MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32),
              "fp16_reduce": MixedPrecisionPolicy(param_dtype=torch.float16),
              "half_first": MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32),
              "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}[kind]
    if kind == "half_first":
        model.half()  # before sharding: the policy's upcast to FP32 masters is a no-op
        for p in model.parameters():
            p.grad_dtype = torch.float32  # asks for FP32 gradients; fully_shard does not keep it
    for layer in (model[0], model[2]):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def fsdp_cases(rank, world):
    out = {}
    for kind in ("clean", "fp16_reduce", "half_first", "bf16"):
        model = _fsdp2(kind)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = lossscale.GradScaler("cpu")
        report = lossscale.check_setup(model, opt, scaler)
        entry = dict(kinds=[k.value for k in report.kinds()], where=[f.where for f in report.findings],
                     text=str(report), dtype=str(report.dtype), dtype_from=report.dtype_from)
        if kind != "bf16":  # the ground truth: one real FP16 step
            opt.zero_grad()
            _backward(model, scaler=scaler)
            entry["grad_dtypes"] = sorted({str(p.grad.dtype) for p in model.parameters()})
            try:
                scaler.unscale_(opt)
                entry["unscale"] = "ok"
            except ValueError as e:
                entry["unscale"] = str(e)
        if kind == "bf16":
            entry["passthrough_ok"] = lossscale.check_setup(model, opt, lossscale.GradScaler.passthrough("cpu")).ok
        out[kind] = entry
    return out


def fsdp1_cases(rank, world):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision

    out = {}
    for kind, mp in (("fp16_reduce", MixedPrecision(param_dtype=torch.float16)),
                     ("low_precision_grads", MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32,
                                                            keep_low_precision_grads=True)),
                     ("clean", MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32))):
        torch.manual_seed(0)
        model = FSDP(_mlp(), device_id=torch.device("cpu"), use_orig_params=True, mixed_precision=mp)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        report = lossscale.check_setup(model, opt, lossscale.GradScaler("cpu"))
        opt.zero_grad()
        _backward(model)
        out[kind] = dict(kinds=[k.value for k in report.kinds()], where=[f.where for f in report.findings],
                         grad_dtypes=sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}))
    return out


SCENARIOS = {"fsdp_cases": fsdp_cases, "fsdp1_cases": fsdp1_cases}

needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")


@pytest.fixture(scope="module")
def pool():
    from _dist_workers import WorkerPool

    workers = WorkerPool(world_size=2, scenarios=__name__)
    yield workers
    workers.close()


@needs_gloo
@pytest.mark.distributed
def test_fully_shard_policies_on_two_ranks(pool):
    for r in pool.run("fsdp_cases", timeout_s=240):
        clean, fp16_reduce, half_first, bf16 = (r[k] for k in ("clean", "fp16_reduce", "half_first", "bf16"))
        assert clean["kinds"] == [] and "no problems found" in clean["text"]
        assert clean["dtype"] == "torch.float16" and clean["dtype_from"] == "FSDP policy"
        assert clean["grad_dtypes"] == ["torch.float32"] and clean["unscale"] == "ok"
        # reduce_dtype unset: reduced in FP16, named per sharded module (the root holds no parameter).
        assert fp16_reduce["kinds"] == ["fp16_reduce"] and fp16_reduce["where"] == [("0", "2")]
        # .half() before fully_shard: FP16 shards for the optimizer, FP16 gradients despite grad_dtype.
        assert half_first["kinds"] == ["fp16_master_weights", "fp16_gradients"]
        assert "fully_shard" in half_first["text"] and "grad_dtype" in half_first["text"]
        assert half_first["where"][0] == ("0.weight", "0.bias", "2.weight", "2.bias")
        assert half_first["grad_dtypes"] == ["torch.float16"] and "FP16 gradients" in half_first["unscale"]
        assert bf16["kinds"] == ["bf16_with_scaling"] and bf16["dtype_from"] == "FSDP policy"
        assert bf16["passthrough_ok"]


@needs_gloo
@pytest.mark.distributed
def test_fsdp1_mixed_precision_on_two_ranks(pool):
    for r in pool.run("fsdp1_cases", timeout_s=240):
        assert r["fp16_reduce"]["kinds"] == ["fp16_reduce"]
        assert r["low_precision_grads"]["kinds"] == ["fp16_gradients"]
        assert r["low_precision_grads"]["grad_dtypes"] == ["torch.float16"]  # what it says, after a backward
        assert r["clean"]["kinds"] == [] and r["clean"]["grad_dtypes"] == ["torch.float32"]
