"""lossscale.integrations.deepspeed against the real deepspeed, on CPU: one rank on gloo.

Both of DeepSpeed's fp16 modes, ZeRO-0 to 3: ``torch_autocast`` (the engine's stock torch
GradScaler replaced by lossscale's) and classic ``fp16`` (DeepSpeed's DynamicLossScaler replaced by
lossscale's LossScaler). A gradient hook puts an inf into one gradient inside backward at chosen
steps, as a real overflow would.

Two settings of this test bench, not of the integration: the ops DeepSpeed would JIT-compile at
initialize (a shared-memory all-reduce: ~100 s on 2 cores, useless to one rank) are marked absent,
and the CPU accelerator's fp16 probe (mkldnn fp16, which this machine's CPU lacks) is answered yes:
DeepSpeed refuses classic fp16 otherwise, while the math it runs is torch's and works on any CPU.
"""

import math
import os
import random
import socket
import subprocess
import sys

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from _integration_models import InfAt, fresh_accelerate_state  # noqa: E402,F401  (fixture)

import lossscale  # noqa: E402
from lossscale.integrations import deepspeed as ls_ds  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "ds_cpu")

INIT_POWER = 10  # 2**10: no step overflows by itself, only the injected inf does


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ds_cpu():
    """DeepSpeed on the CPU accelerator, one rank on gloo; the process group torn down afterwards."""
    import logging

    import deepspeed.comm.comm as ds_comm
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    env = dict(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    assert get_accelerator().device_name() == "cpu"
    patch = pytest.MonkeyPatch()
    patch.setattr(deepspeed.ops, "__compatible_ops__", dict.fromkeys(ALL_OPS, False), raising=False)
    patch.setattr(get_accelerator(), "is_fp16_supported", lambda: True)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    level = logging.getLogger("DeepSpeed").level
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    yield
    logging.getLogger("DeepSpeed").setLevel(level)
    patch.undo()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    ds_comm.cdb = None
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def _fresh_autocast_state():
    """DeepSpeed keeps "torch_autocast is on" in a process-wide global (runtime/torch_autocast.py:26-27,
    set by any engine built with it): ZeRO engines built later in the same process would get a torch
    GradScaler too. Reset around every test."""
    import deepspeed.runtime.torch_autocast as autocast

    autocast.TORCH_AUTOCAST_INITIALIZED, autocast.TORCH_AUTOCAST_DTYPE = False, None
    yield
    autocast.TORCH_AUTOCAST_INITIALIZED, autocast.TORCH_AUTOCAST_DTYPE = False, None


def _config(stage, mode, **fp16):
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "wall_clock_breakdown": False,
    }
    if mode == "autocast":
        cfg["torch_autocast"] = {"enabled": True, "dtype": "torch.float16"}
    else:
        cfg["fp16"] = {
            "enabled": True,
            "initial_scale_power": INIT_POWER,
            "loss_scale_window": 4,
            "hysteresis": 1,
            "min_loss_scale": 1,
            **fp16,
        }
    return cfg


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _engine(stage, mode, optimizer="adam", scheduler=False, seed=0, **fp16):
    model = _model(seed)
    opt = (
        torch.optim.Adam(model.parameters(), lr=1e-2)
        if optimizer == "adam"
        else torch.optim.SGD(model.parameters(), lr=1.0)
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1)) if scheduler else None
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config=_config(stage, mode, **fp16)
    )
    return engine


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)


def _scale(engine, scaler=None):
    if scaler is not None:
        return scaler.get_scale()
    opt = engine.optimizer
    if engine.torch_autocast_z0_gradscaler is not None:
        return engine.torch_autocast_z0_gradscaler.get_scale()
    if getattr(opt, "torch_autocast_gradscaler", None) is not None:
        return opt.torch_autocast_gradscaler.get_scale()
    return float(opt.loss_scale)


def _snapshot(engine):
    """Weights and optimizer state, copied: the module's parameters (ZeRO-3 gathers them only around
    forward and backward: its fp32 partitions instead) and every tensor of the optimizer's state with
    the master copy it belongs to."""
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    if engine.zero_optimization_stage() == 3:
        tensors = [p.detach().clone() for p in opt.fp32_partitioned_groups_flat]
    else:
        tensors = [p.detach().clone() for p in engine.module.parameters()]
    for master, state in inner.state.items():
        tensors.append(master.detach().clone())
        tensors += [v.detach().clone() for v in state.values() if torch.is_tensor(v)]
    return tensors


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _train(engine, steps, inf_at=(), scaler=None, start=0):
    """Train ``steps`` steps; returns per step (scale used, skipped by the engine, snapshot after)."""
    hook = InfAt(engine.module[0].weight, inf_at, start=start) if inf_at else None
    out = []
    for step in range(start, start + steps):
        x, y = _batch(step)
        dtype = next(engine.module.parameters()).dtype
        before = _scale(engine, scaler)
        loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        skipped_before = engine.skipped_steps
        engine.step()
        out.append((before, engine.skipped_steps - skipped_before, _snapshot(engine)))
    if hook is not None:
        hook.handle.remove()
    return out


# ------------------------------------------------------------------------------ torch_autocast mode
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_autocast_mode_skips_bitwise_and_backs_off(stage):
    engine = _engine(stage, "autocast")
    scaler = ls_ds.attach(engine, init_scale=2.0**INIT_POWER, growth_interval=3)
    assert isinstance(scaler, lossscale.GradScaler)
    held = engine.torch_autocast_z0_gradscaler if stage == 0 else engine.optimizer.torch_autocast_gradscaler.scaler
    assert held is scaler
    first = _snapshot(engine)
    run = _train(engine, 8, inf_at=(0, 4), scaler=scaler)
    scales = [r[0] for r in run] + [scaler.get_scale()]
    # skipped at 0 and 4: the scale halves there and grows after 3 clean steps
    assert scales == [1024, 512, 512, 512, 1024, 512, 512, 512, 1024]
    assert [r[1] for r in run] == [1, 0, 0, 0, 1, 0, 0, 0]  # engine.skipped_steps counts them
    assert _equal(run[0][2], first) and _equal(run[4][2], run[3][2])  # weights and optimizer state bitwise
    assert not _equal(run[1][2], run[0][2])
    assert scaler.counters()["skipped_steps"] == 2 and scaler.counters()["inf_steps"] == 2
    assert engine.torch_autocast_enabled() and next(engine.module.parameters()).dtype == torch.float32


@pytest.mark.parametrize("stage", [1, 2])
def test_autocast_zero_stock_scaler_never_backs_off_lossscale_does(stage):
    """The issue's claim, measured: ZeRO-1/2 skip the step themselves and return before their torch
    GradScaler's step/update, so the stock scaler's scale never backs off."""
    stock = _engine(stage, "autocast")
    run = _train(stock, 4, inf_at=(1, 2))
    assert [r[1] for r in run] == [0, 1, 1, 0]
    assert [r[0] for r in run] + [_scale(stock)] == [65536.0] * 5  # never backed off
    engine = _engine(stage, "autocast")
    scaler = ls_ds.attach(engine)
    _train(engine, 4, inf_at=(1, 2), scaler=scaler)
    assert scaler.get_scale() == 16384.0 and scaler.counters()["skipped_steps"] == 2


def test_autocast_zero0_is_bitwise_torch_and_holds_the_lr_on_skips():
    ref = _engine(0, "autocast", scheduler=True)
    ref.torch_autocast_z0_gradscaler = torch.amp.GradScaler("cpu", init_scale=2.0**INIT_POWER, growth_interval=3)
    ref_run = _train(ref, 6, inf_at=(2,))
    engine = _engine(0, "autocast", scheduler=True)
    scaler = ls_ds.attach(
        engine,
        init_scale=2.0**INIT_POWER,
        growth_interval=3,
        hysteresis=1,
        min_scale=None,
        max_scale=None,
        loss_check=False,
    )
    run = _train(engine, 6, inf_at=(2,), scaler=scaler)
    assert [r[0] for r in run] == [r[0] for r in ref_run]
    assert all(_equal(a[2], b[2]) for a, b in zip(run[:3], ref_run[:3]))  # the same until the skip
    # torch's scaler and DeepSpeed disagree: the engine did not see the skip and stepped the LR
    assert [r[1] for r in ref_run] == [0] * 6 and ref.lr_scheduler.last_epoch == 6
    assert [r[1] for r in run] == [0, 0, 1, 0, 0, 0] and engine.lr_scheduler.last_epoch == 5


def _two_group_engine(stage, scaler_kwargs=None):
    """SGD (lr 1, no momentum: the step is the unscaled gradient itself) over two parameter groups,
    weights and biases, as transformers' Trainer builds (decay, no decay)."""
    model = _model()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.SGD([{"params": weights}, {"params": biases}], lr=1.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=_config(stage, "autocast"))
    return engine, ls_ds.attach(engine, init_scale=2.0**INIT_POWER, growth_interval=3, **(scaler_kwargs or {}))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_autocast_zero_two_groups_grow_once_per_step_and_unscale_by_the_backwards_scale(stage):
    """ZeRO-1/2/3 step one parameter group at a time and call their scaler's step() then update() for
    each: a stock GradScaler then counts every iteration once per group, and on a growth step unscales
    the later groups by the grown scale. Attached, the scaler advances once per ZeRO step, and every
    group's update is ZeRO-0's (which steps once) bit for bit, growth steps included."""
    engine, scaler = _two_group_engine(stage)
    ref, ref_scaler = _two_group_engine(0)
    run = _train(engine, 8, inf_at=(4,), scaler=scaler)
    ref_run = _train(ref, 8, inf_at=(4,), scaler=ref_scaler)
    scales = [r[0] for r in run] + [scaler.get_scale()]
    assert scales == [1024, 1024, 1024, 2048, 2048, 1024, 1024, 1024, 2048]  # growth after 3 clean steps
    assert scales == [r[0] for r in ref_run] + [ref_scaler.get_scale()]
    assert scaler.counters()["steps"] == 8 and scaler.counters()["skipped_steps"] == 1
    assert [r[1] for r in run] == [0, 0, 0, 0, 1, 0, 0, 0]
    weights = _snapshot(engine)[:4] if stage != 3 else None
    if stage != 3:  # ZeRO-3 keeps its own flat fp32 partitions (compared through the module below)
        assert _equal(weights, _snapshot(ref)[:4])
    with torch.no_grad():
        x, _ = _batch(99)
        assert torch.equal(engine(x), ref(x))


def test_autocast_zero_two_groups_keep_their_skip_if_windows_from_step_to_step():
    """skip_if under ZeRO-2 with two parameter groups: each group's z-score window fills over the steps
    (the scaler meets the same group every step), so a gradient spike after ``min_steps`` is skipped,
    the weights stay as they were, and the engine counts the skip though its own check saw none."""
    engine, scaler = _two_group_engine(2, dict(skip_if=lossscale.SkipIf(grad_norm_zscore=4.0, min_steps=4)))
    skipped, moved = [], []
    for step in range(8):
        x, y = _batch(step)
        before = _snapshot(engine)[:4]
        loss = torch.nn.functional.mse_loss(engine(x).float(), y) * (10.0 if step == 6 else 1.0)
        engine.backward(loss)
        was = engine.skipped_steps
        engine.step()
        skipped.append(engine.skipped_steps - was)
        moved.append(not _equal(before, _snapshot(engine)[:4]))
    assert skipped == [0, 0, 0, 0, 0, 0, 1, 0]  # engine.skipped_steps counts the spike (the LR holds)
    assert moved == [True] * 6 + [False, True]
    assert scaler.counters()["skipped_steps"] == 0 and scaler.counters()["inf_steps"] == 0  # not an overflow


# ------------------------------------------------------------------------------ classic fp16 mode
def _ds_scaler(init, window, min_scale, hysteresis, consecutive):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    return DynamicLossScaler(
        init_scale=init,
        scale_window=window,
        min_scale=min_scale,
        delayed_shift=hysteresis,
        consecutive_hysteresis=consecutive,
        raise_error_at_min_scale=False,
    )


def test_loss_scaler_is_deepspeeds_dynamic_loss_scaler_over_random_fault_sequences():
    cls = ls_ds.LossScaler
    for seed in range(60):
        rng = random.Random(seed)
        # window >= 2 keeps the scale below float32's top (DeepSpeed's Python float would go past 2**127,
        # where lossscale refuses a growth to inf, as torch does)
        init, window = 2.0 ** rng.randint(0, 10), rng.randint(2, 6)
        min_scale, hysteresis, consecutive = min(init, 2.0 ** rng.randint(-2, 2)), rng.randint(1, 4), rng.random() < 0.5
        ref = _ds_scaler(init, window, min_scale, hysteresis, consecutive)
        mine = cls(
            lossscale.DynamicPolicy(
                init_scale=init,
                growth_interval=window,
                min_scale=min_scale,
                hysteresis=hysteresis,
                consecutive_hysteresis=consecutive,
                max_scale=None,
                on_stuck="ignore",
            )
        )
        rate = rng.choice([0.05, 0.3, 0.7])
        for i in range(150):
            overflow = rng.random() < rate
            mine.scale_loss(torch.ones(()))
            ref.update_scale(overflow)
            mine.update_scale(overflow)
            assert mine.get_scale() == ref.cur_scale, (seed, i)
            assert mine.cur_hysteresis == ref.cur_hysteresis, (seed, i)


def test_loss_scaler_diagnoses_instead_of_already_at_minimum():
    ref = _ds_scaler(2.0, 10, 1.0, 1, False)
    ref.raise_error_at_min_scale = True
    mine = ls_ds.LossScaler(
        lossscale.DynamicPolicy(init_scale=2.0, growth_interval=10, min_scale=1.0, max_scale=None, on_stuck="raise")
    )
    ref.update_scale(True)
    mine.scale_loss(torch.ones(()))
    mine.update_scale(True)
    with pytest.raises(Exception, match="Current loss scale already at minimum"):
        ref.update_scale(True)
    mine.scale_loss(torch.ones(()))
    with pytest.raises(RuntimeError, match="overflow even at the smallest scale") as caught:
        mine.update_scale(True)
    assert "scaler.health()" in str(caught.value)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_classic_fp16_skips_bitwise_and_follows_deepspeeds_scale(stage):
    ref = _engine(stage, "fp16", hysteresis=2, loss_scale_window=100)
    ref_run = _train(ref, 6, inf_at=(1, 2, 4))
    engine = _engine(stage, "fp16", hysteresis=2, loss_scale_window=100)
    scaler = ls_ds.attach(engine)
    assert isinstance(scaler, ls_ds.LossScaler)
    run = _train(engine, 6, inf_at=(1, 2, 4), scaler=scaler)
    ref_scales = [r[0] for r in ref_run]
    # hysteresis=2: the first overflow is tolerated, the next back off (a clean step does not refill it)
    if stage == 0:  # FP16_UnfusedOptimizer ignores hysteresis: every overflow halves
        assert ref_scales == [1024, 1024, 512, 256, 256, 128]
    else:
        assert ref_scales == [1024, 1024, 1024, 512, 512, 256]
    assert [r[0] for r in run] == [1024, 1024, 1024, 512, 512, 256]  # the config's hysteresis, every stage
    assert [r[1] for r in run] == [0, 1, 1, 0, 1, 0] == [r[1] for r in ref_run]
    for k in (1, 2, 4):
        assert _equal(run[k][2], run[k - 1][2])
    assert scaler.counters()["skipped_steps"] == 3


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_pr8588_and_the_zero0_unscaled_backward(stage):
    """SGD on a linear model whose gradient is 1 everywhere: each step moves every weight by the LR
    (2**-4; from 0, every value is exact in fp16). Measured in LRs. DeepSpeed's own scalers: at the
    growth step (the 5th: 4 + 1 clean steps) ZeRO-1/2 divide by twice the scale (PR #8588); ZeRO-0
    never scales the loss, so every step moves by 1/scale (and by 1/(2 scale) from the growth on)."""

    def steps(attach):
        model = torch.nn.Linear(4, 1, bias=False)
        torch.nn.init.zeros_(model.weight)
        opt = torch.optim.SGD(model.parameters(), lr=2.0**-4)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=_config(stage, "fp16"))
        if attach:
            ls_ds.attach(engine)
        moved = []
        for _ in range(6):
            w = engine.module.weight.detach().float().clone()
            engine.backward(engine(torch.ones(4, 4, dtype=torch.float16)).float().mean())
            engine.step()
            moved.append(float((w - engine.module.weight.detach().float())[0, 1]) / 2.0**-4)
        return moved, engine.optimizer.loss_scale

    (stock, stock_scale), (fixed, fixed_scale) = steps(False), steps(True)
    if stage == 0:
        assert stock == [2.0**-10] * 4 + [2.0**-11] * 2
    else:
        assert stock == [1.0] * 4 + [0.5, 1.0]
    assert fixed == [1.0] * 6
    assert stock_scale == fixed_scale == 2048  # the same scale trajectory


# ------------------------------------------------------------------------------ checkpoints, health
@pytest.mark.parametrize("stage,mode", [(0, "autocast"), (2, "autocast"), (0, "fp16"), (1, "fp16")])
def test_checkpoint_round_trip_resumes_bitwise(tmp_path, stage, mode):
    kw = {} if mode == "fp16" else dict(init_scale=2.0**INIT_POWER, growth_interval=3)
    whole = _engine(stage, mode)
    scaler = ls_ds.attach(whole, **kw)
    _train(whole, 4, inf_at=(1,), scaler=scaler)  # the run up to the checkpoint
    whole.save_checkpoint(str(tmp_path), tag="t", client_state={"mine": 7})
    saved = scaler.state_dict()
    rest = _train(whole, 4, inf_at=(5,), scaler=scaler, start=4)

    resumed = _engine(stage, mode, seed=1)  # other initial weights: the checkpoint must bring them
    scaler2 = ls_ds.attach(resumed, **kw)
    _, client = resumed.load_checkpoint(str(tmp_path), tag="t")
    assert client["mine"] == 7 and ls_ds.CLIENT_STATE_KEY not in client
    assert scaler2.state_dict() == saved
    again = _train(resumed, 4, inf_at=(5,), scaler=scaler2, start=4)
    assert [r[0] for r in again] == [r[0] for r in rest]
    assert all(_equal(a[2], b[2]) for a, b in zip(again, rest))
    assert scaler2.counters() == scaler.counters()
    if mode == "fp16" and stage:
        assert resumed.optimizer.loss_scaler is scaler2  # ZeRO's pickled loss_scaler did not replace it


def test_log_health_and_attach_is_idempotent(caplog):
    engine = _engine(1, "fp16")
    scaler = ls_ds.attach(engine)
    assert ls_ds.attach(engine) is scaler
    with pytest.raises(ValueError, match="already attached"):
        ls_ds.attach(engine, on_stuck="warn")
    _train(engine, 3, inf_at=(0,), scaler=scaler)
    report = ls_ds.log_health(engine)
    assert report.steps == 3 and report.skipped == 1 and report.verdict == "healthy"
    assert report.text


def test_validation_names_the_argument():
    with pytest.raises(ValueError, match="engine=.*DeepSpeedEngine"):
        ls_ds.attach(torch.nn.Linear(1, 1))
    model = _model()
    bf16, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.Adam(model.parameters()),
        config={"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}},
    )
    with pytest.raises(ValueError, match="bf16 and fp32 need no loss scaler"):
        ls_ds.attach(bf16)
    with pytest.raises(ValueError, match="has no lossscale scaler"):
        ls_ds.log_health(bf16)


def test_importing_the_integration_imports_no_deepspeed():
    code = "import sys, lossscale.integrations.deepspeed\nprint('deepspeed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def _deepspeed_accelerator(monkeypatch):
    """accelerate with its DeepSpeedPlugin (ZeRO-2; classic fp16 for mixed_precision="fp16"), the MLP and
    six batches, none prepared yet."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    accelerator = Accelerator(
        mixed_precision="fp16", deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, gradient_clipping=0.0)
    )
    model = _model()
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randn(24, 2)), batch_size=4
    )
    return accelerator, model, data


def _train_accelerated(accelerator, model, opt, data):
    """accelerate's loop over ``data`` with an inf gradient at steps 2 and 3; the skip flag per step."""
    hook = InfAt(model.module[0].weight, (2, 3))
    skipped = []
    for x, y in data:
        accelerator.backward(torch.nn.functional.mse_loss(model(x.half()).float(), y))
        opt.step()
        opt.zero_grad()
        skipped.append(accelerator.optimizer_step_was_skipped)
    hook.handle.remove()
    return skipped


def test_accelerate_with_deepspeed_goes_through_attach_on_its_engine(fresh_accelerate_state, monkeypatch):  # noqa: F811  the pytest fixture imported from _integration_models
    """accelerate builds the engine in prepare() (its DeepSpeedPlugin: classic fp16 for
    mixed_precision="fp16") and steps it with engine.backward/step: attaching to that engine works."""
    accelerator, model, data = _deepspeed_accelerator(monkeypatch)
    model, opt, data = accelerator.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2), data)
    scaler = ls_ds.attach(accelerator.deepspeed_engine_wrapped.engine)
    assert isinstance(scaler, ls_ds.LossScaler)
    assert _train_accelerated(accelerator, model, opt, data) == [False, False, True, True, False, False]
    assert scaler.get_scale() == 2.0**15  # accelerate's DeepSpeed config: hysteresis 2, so one backoff


@pytest.mark.parametrize("when", ["before prepare", "after prepare"])
def test_accelerate_attach_takes_a_deepspeed_accelerator_and_attaches_to_its_engine(
    fresh_accelerate_state,  # noqa: F811  the pytest fixture imported from _integration_models
    monkeypatch,
    when,
):
    """ls_accelerate.attach(accelerator) on accelerate's DeepSpeed plugin: the scaler lands in the engine
    prepare() builds (classic fp16 for mixed_precision="fp16", ZeRO-2), with the same steps as attaching
    to the engine by hand; log_health(accelerator) reads it."""
    from lossscale.integrations import accelerate as ls_accelerate

    accelerator, model, data = _deepspeed_accelerator(monkeypatch)
    if when == "before prepare":
        scaler = ls_accelerate.attach(accelerator)
        with pytest.raises(RuntimeError, match="use the scaler after prepare"):
            scaler.get_scale()
    model, opt, data = accelerator.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2), data)
    if when == "after prepare":
        scaler = ls_accelerate.attach(accelerator)
    assert isinstance(scaler, ls_accelerate.EngineScaler) and ls_accelerate.attach(accelerator) is scaler
    assert isinstance(scaler.target, ls_ds.LossScaler)
    assert accelerator.deepspeed_engine_wrapped.engine.optimizer.loss_scaler is scaler.target
    assert _train_accelerated(accelerator, model, opt, data) == [False, False, True, True, False, False]
    assert scaler.get_scale() == 2.0**15  # as attaching to the engine by hand (the test above)
    report = ls_accelerate.log_health(accelerator)
    assert report.skipped == 2


def _trainer_run(tmp_path, mode, use_lossscale, resume=None, steps=12, inf_step=5):
    """transformers' Trainer with TrainingArguments(deepspeed=...), ZeRO-2, the tiny GPT-2 (two parameter
    groups: decay and no decay); an inf gradient at step ``inf_step``. Per step: skipped, scale after."""
    from _integration_models import TokenData, tiny_gpt2
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from lossscale.integrations import transformers as ls_transformers

    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if mode == "autocast":
        cfg["torch_autocast"] = {"enabled": True, "dtype": "torch.float16"}
    else:
        cfg["fp16"] = {"enabled": "auto", "initial_scale_power": INIT_POWER, "loss_scale_window": 4, "hysteresis": 1}
    box, out = {}, dict(skipped=[], scales=[])

    class Recorder(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            trainer = box["trainer"]
            out["skipped"].append(trainer.accelerator.optimizer_step_was_skipped)
            out["scales"].append(box["scaler"].get_scale() if use_lossscale else _scale(trainer.model_wrapped))

    model = tiny_gpt2()
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        fp16=True,
        use_cpu=True,
        per_device_train_batch_size=2,
        max_steps=steps,
        learning_rate=1e-3,
        logging_steps=4,
        save_strategy="steps",
        save_steps=6,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        deepspeed=cfg,
    )
    trainer = box["trainer"] = Trainer(
        model=model, args=args, train_dataset=TokenData(2 * steps, length=8), callbacks=[Recorder()]
    )
    if use_lossscale:
        box["scaler"] = ls_transformers.attach(trainer, init_scale=2.0**INIT_POWER, growth_interval=4)
    InfAt(model.transformer.h[0].mlp.c_fc.weight, [inf_step], start=0 if resume is None else 6)
    out["metrics"] = trainer.train(resume_from_checkpoint=resume).metrics
    out.update(trainer=trainer, scaler=box.get("scaler"), params=[p.detach().clone() for p in model.parameters()])
    return out


@pytest.fixture
def trainer_deepspeed_globals(monkeypatch):
    """TrainingArguments(deepspeed=...) sets ACCELERATE_USE_DEEPSPEED=true in os.environ
    (training_args.py:1900) and a process-wide HfDeepSpeedConfig (integrations/deepspeed.py:275):
    later Trainers and Accelerators in the process would take DeepSpeed. Put both back afterwards."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what TrainingArguments sets; undone after
    yield
    unset_hf_deepspeed_config()


@pytest.mark.parametrize("mode", ["fp16", "autocast"])
def test_trainer_with_deepspeed_goes_through_attach_and_resumes(
    tmp_path,
    fresh_accelerate_state,  # noqa: F811  the pytest fixture imported from _integration_models
    trainer_deepspeed_globals,
    mode,
):
    """ls_transformers.attach(trainer) on TrainingArguments(deepspeed=...): the scaler lands in the engine
    train() builds. Classic fp16: DeepSpeed's own skips and scale (its DynamicLossScaler's arithmetic);
    torch_autocast: the scale halves on the skip and grows once per 4 clean steps, though ZeRO steps the
    Trainer's two parameter groups one at a time. The health account reaches train()'s metrics, and a
    run resumed from its step-6 checkpoint is the uninterrupted run."""
    run = _trainer_run(tmp_path / "run", mode, True)
    assert run["skipped"] == [s == 5 for s in range(12)]
    if mode == "fp16":  # DeepSpeed's window counts from the last overflow's iteration (loss_scaler.py)
        assert run["scales"] == [1024.0] * 4 + [2048.0] + [1024.0] * 5 + [2048.0] * 2
    else:  # torch's: 4 clean steps, then grow
        assert run["scales"] == [1024.0] * 3 + [2048.0] * 2 + [1024.0] * 4 + [2048.0] * 3
    assert run["metrics"]["scaler/health/skipped"] == 1 and run["metrics"]["scaler/health/steps"] == 12
    if mode == "fp16":
        stock = _trainer_run(tmp_path / "stock", mode, False)
        assert stock["skipped"] == run["skipped"] and stock["scales"] == run["scales"]
        assert isinstance(run["scaler"].target, ls_ds.LossScaler)
    else:
        assert isinstance(run["scaler"].target, lossscale.GradScaler)
    resumed = _trainer_run(tmp_path / "resumed", mode, True, resume=str(tmp_path / "run" / "out" / "checkpoint-6"))
    assert resumed["scales"] == run["scales"][6:] and resumed["skipped"] == run["skipped"][6:]
    assert resumed["scaler"].state_dict() == run["scaler"].state_dict()
    assert all(torch.equal(a, b) for a, b in zip(resumed["params"], run["params"]))


@pytest.mark.parametrize("stage,classic", [(2, False), (1, True)])
def test_the_example_skips_the_first_steps_backs_off_and_round_trips(tmp_path, stage, classic):
    """examples/deepspeed_fp16.py, shortened: the scale starts at 2**24, so the first steps overflow and
    are skipped (the engine counts them as the scaler does) until the scale has backed off; the
    checkpoint it saves restores the scaler in a second engine."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "deepspeed_fp16.py")
    spec = importlib.util.spec_from_file_location("deepspeed_fp16_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(steps=30, stage=stage, classic=classic, ckpt_dir=str(tmp_path))
    assert 0 < result["skipped"] < 30 and result["counters"]["skipped_steps"] == result["skipped"]
    assert result["scale"] < 2.0**24
    assert result["reloaded_scale"] == result["scale"] and result["reloaded_counters"] == result["counters"]


def test_a_bad_loss_skips_without_backing_off_where_deepspeed_halves():
    def run(attach):
        engine = _engine(1, "fp16")
        scaler = ls_ds.attach(engine) if attach else None
        scales = []
        for step in range(3):
            x, y = _batch(step)
            loss = torch.nn.functional.mse_loss(engine(x.half()).float(), y) * (math.nan if step == 1 else 1.0)
            engine.backward(loss)
            engine.step()
            scales.append(_scale(engine, scaler))
        return scales, engine.skipped_steps, scaler

    stock, stock_skipped, _ = run(False)
    mine, skipped, scaler = run(True)
    assert stock_skipped == skipped == 1
    assert stock == [1024, 512, 512] and mine == [1024, 1024, 1024]
    assert scaler.counters()["bad_loss_steps"] == 1


def test_public_names_have_docstrings():
    for name in ls_ds.__all__:
        obj = getattr(ls_ds, name)
        assert obj.__doc__, name
        for attr, member in vars(obj).items() if isinstance(obj, type) else ():
            if not attr.startswith("_") and (callable(member) or isinstance(member, property)):
                assert member.__doc__, f"{name}.{attr}"


def test_zero_torch_autocast_before_0_19_8_is_refused_with_the_fix(monkeypatch):
    """deepspeed 0.19.0-0.19.7 ZeRO steps without its own overflow check in torch_autocast mode (measured:
    with lossscale attached, a ZeRO-2 step with an inf gradient moved the weights): attach refuses."""
    import deepspeed

    monkeypatch.setattr(deepspeed, "__version__", "0.19.7")
    engine = _engine(2, "autocast")
    held = engine.optimizer.torch_autocast_gradscaler
    with pytest.raises(RuntimeError, match=r"needs deepspeed>=0\.19\.8 \(this is 0\.19\.7"):
        ls_ds.attach(engine)
    assert engine.optimizer.torch_autocast_gradscaler is held  # nothing changed
    assert isinstance(ls_ds.attach(_engine(0, "autocast")), lossscale.GradScaler)  # ZeRO-0 is unaffected
