"""lossscale.integrations.deepspeed on OpenRLHF's DeepSpeed set-up, at the deepspeed release OpenRLHF pins.

OpenRLHF (0.11.2) trains its actor and critic with DeepSpeed's classic ``fp16`` mode and ZeRO-2 and pins
``deepspeed==0.19.6``. These tests build the engine from the config OpenRLHF's own builder returns
(``get_train_ds_config`` in openrlhf/utils/deepspeed/deepspeed_utils.py, called with the arguments
``DeepspeedStrategy.get_ds_train_config`` passes, ``--ds.param_dtype fp16``), OpenRLHF's parameter groups
and LR schedule, and a 2-layer Qwen2 built from a config; they run on CPU, one rank on gloo (the
``ds_cpu`` fixture of test_integrations_deepspeed.py). With lossscale attached, an overflow sequence is
skipped and backed off exactly as DeepSpeed's own ``DynamicLossScaler`` does it, with the weights and
the optimizer state bitwise untouched on skipped steps, and OpenRLHF's checkpoint calls round-trip the
scaler.

They run in the venv envs/openrlhf/ci.sh builds (deepspeed 0.19.6, OpenRLHF's transformers pin, openrlhf
installed without its GPU-only dependencies); elsewhere they are skipped.
"""

import importlib.util
import math
from functools import partial
from pathlib import Path

import pytest
import torch

openrlhf = pytest.importorskip("openrlhf", reason="OpenRLHF's venv only: bash envs/openrlhf/ci.sh")
deepspeed = pytest.importorskip("deepspeed")

from lossscale.integrations import deepspeed as ls_ds  # noqa: E402
from _integration_models import InfAt  # noqa: E402
# How the project runs DeepSpeed on CPU (one rank on gloo, no JIT-built ops), and its state read-back.
from test_integrations_deepspeed import _equal, _fresh_autocast_state, _snapshot, ds_cpu  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("one_thread", "ds_cpu")

STEPS = 6
INF_AT = (1, 2, 4)  # the steps whose gradient gets an inf
LR = 1e-3


def openrlhf_ds_utils():
    """OpenRLHF's config builder module, loaded from the installed openrlhf by path: importing it as
    ``openrlhf.utils.deepspeed.deepspeed_utils`` runs the package __init__s, which import flash_attn,
    peft and ray (GPU-only or not installed here). The module itself imports deepspeed and torch only."""
    path = Path(openrlhf.__file__).parent / "utils" / "deepspeed" / "deepspeed_utils.py"
    spec = importlib.util.spec_from_file_location("openrlhf_deepspeed_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def openrlhf_config(ds_utils, micro_batch=2):
    """The ZeRO-2 fp16 training config OpenRLHF builds for its actor (DeepspeedStrategy.get_ds_train_config
    with the CLI defaults: --ds.zero_stage 2, --ds.zpg 1, --actor.max_norm 1.0, --actor.adam.betas 0.9 0.95,
    --actor.adam.eps 1e-8, --actor.adam.weight_decay 0.0; --ds.param_dtype fp16)."""
    optim = {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}}
    cfg = ds_utils.get_train_ds_config(offload=False, adam_offload=False, stage=2, param_dtype="fp16", max_norm=1.0,
                                       zpg=1, grad_accum_dtype=None, overlap_comm=False, use_ds_universal_ckpt=False,
                                       deepcompile=False, tensor_parallel_size=1, optim_config=optim)
    cfg["train_micro_batch_size_per_gpu"] = micro_batch  # get_ds_train_config adds these two
    cfg["train_batch_size"] = micro_batch
    # Stand-in for FusedAdam, the CUDA kernel DeepSpeed picks for "AdamW" (engine.py, _configure_basic_optimizer):
    # torch's AdamW, the same update, on CPU.
    cfg["optimizer"]["params"]["torch_adam"] = True
    return cfg


def tiny_qwen2(seed=0):
    """A 2-layer Qwen2 causal LM (hidden 32, 2 heads, 1 KV head, vocabulary 32), built in code."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg)


def openrlhf_engine(seed=0):
    """deepspeed.initialize as DeepspeedStrategy._ds_init_train_model calls it: the config above, OpenRLHF's
    parameter groups (no decay for biases and norms) and its LR schedule (cosine to 10% after a 3% warmup)."""
    from transformers import get_scheduler

    ds_utils = openrlhf_ds_utils()
    model = tiny_qwen2(seed)
    schedule = partial(get_scheduler, "cosine_with_min_lr", num_warmup_steps=math.ceil(STEPS * 0.03),
                       num_training_steps=STEPS, scheduler_specific_kwargs={"min_lr_rate": 0.1})
    engine, *_ = deepspeed.initialize(model=model, optimizer=None, config=openrlhf_config(ds_utils),
                                      model_parameters=ds_utils.get_optimizer_grouped_parameters(model, 0.0),
                                      lr_scheduler=schedule)
    return engine


def _batch(step):
    ids = torch.randint(2, 32, (2, 8), generator=torch.Generator().manual_seed(100 + step))
    return dict(input_ids=ids, labels=ids)


def _train(engine, steps, start=0):
    """OpenRLHF's step (strategy.backward -> engine.backward, strategy.optimizer_step -> engine.step) with an
    inf gradient at INF_AT. Per step: the loss scale used, skipped (by the engine's count), the LR used, and
    the weights and optimizer state after."""
    hook = InfAt(engine.module.model.layers[0].mlp.up_proj.weight, INF_AT, start=start)
    out = []
    for step in range(start, start + steps):
        lr, skipped = engine.get_lr()[0], engine.skipped_steps
        engine.backward(engine(**_batch(step)).loss)
        scale = engine.optimizer.loss_scale  # the scale this backward used (ZeRO unscales by it)
        engine.step()
        out.append(dict(scale=scale, skipped=engine.skipped_steps - skipped, lr=lr, state=_snapshot(engine)))
    hook.handle.remove()
    return out


def test_this_is_openrlhfs_deepspeed_and_config():
    assert deepspeed.__version__ == "0.19.6"
    engine = openrlhf_engine()
    assert engine.fp16_enabled() and engine.zero_optimization_stage() == 2
    assert engine.dynamic_loss_scale() and engine.optimizer.loss_scale == 2.0**16  # DeepSpeed's defaults
    assert engine.gradient_clipping() == 1.0
    assert next(engine.module.parameters()).dtype == torch.float16


def test_openrlhf_zero2_fp16_skips_and_backs_off_as_deepspeeds_own_scaler():
    stock = _train(openrlhf_engine(), STEPS)
    engine = openrlhf_engine()
    first = _snapshot(engine)
    scaler = ls_ds.attach(engine)
    assert isinstance(scaler, ls_ds.LossScaler) and engine.optimizer.loss_scaler is scaler
    run = _train(engine, STEPS)
    # DeepSpeed's defaults: hysteresis 2 (the first overflow is tolerated, later ones halve), window 1000.
    assert [r["scale"] for r in run] == [r["scale"] for r in stock] == [2.0**16] * 3 + [2.0**15] * 2 + [2.0**14]
    assert [r["skipped"] for r in run] == [r["skipped"] for r in stock] == [int(s in INF_AT) for s in range(STEPS)]
    # The LR holds on skipped steps (the engine steps its scheduler only after a taken step).
    assert [r["lr"] for r in run] == [r["lr"] for r in stock]
    assert run[1]["lr"] == run[2]["lr"] == run[3]["lr"] and run[4]["lr"] == run[5]["lr"]
    # Weights and optimizer state bitwise untouched by the skipped steps, moved by the others.
    before = [first] + [r["state"] for r in run[:-1]]
    assert [not _equal(b, r["state"]) for b, r in zip(before, run)] == [s not in INF_AT for s in range(STEPS)]
    # And the same training as DeepSpeed's own scaler, bit for bit.
    assert all(_equal(a["state"], b["state"]) for a, b in zip(run, stock))
    assert scaler.counters()["skipped_steps"] == 3 and scaler.counters()["inf_steps"] == 3


def test_openrlhf_checkpoint_calls_round_trip_the_scaler(tmp_path):
    whole = openrlhf_engine()
    scaler = ls_ds.attach(whole)
    _train(whole, 3)
    assert scaler.get_scale() == 2.0**15  # backed off at step 2: the checkpoint carries a changed scale
    # DeepspeedStrategy.save_ckpt / load_ckpt (openrlhf/utils/deepspeed/deepspeed.py) call these.
    whole.save_checkpoint(str(tmp_path), tag="global_step3", client_state={"consumed_samples": 6}, save_latest=True)
    saved = scaler.state_dict()
    rest = _train(whole, STEPS - 3, start=3)

    resumed = openrlhf_engine(seed=1)  # other initial weights: the checkpoint brings them
    scaler2 = ls_ds.attach(resumed)
    _, states = resumed.load_checkpoint(str(tmp_path), "global_step3", load_module_strict=True,
                                        load_optimizer_states=True, load_lr_scheduler_states=True,
                                        load_module_only=False)
    assert states["consumed_samples"] == 6 and ls_ds.CLIENT_STATE_KEY not in states
    assert scaler2.state_dict() == saved
    again = _train(resumed, STEPS - 3, start=3)
    assert [r["scale"] for r in again] == [r["scale"] for r in rest]
    assert [r["lr"] for r in again] == [r["lr"] for r in rest]
    assert all(_equal(a["state"], b["state"]) for a, b in zip(again, rest))
    assert scaler2.state_dict() == scaler.state_dict()
    assert resumed.optimizer.loss_scaler is scaler2  # ZeRO's pickled loss_scaler did not replace it


def test_zero_torch_autocast_is_refused_on_this_release_and_classic_fp16_attaches():
    """The floor per mode: on deepspeed 0.19.6 ZeRO steps without an overflow check in torch_autocast
    mode, so attach refuses it (naming the release that has the check); classic fp16 attaches above."""
    ds_utils = openrlhf_ds_utils()
    cfg = openrlhf_config(ds_utils)
    cfg["fp16"] = {"enabled": False}
    cfg["torch_autocast"] = {"enabled": True, "dtype": "torch.float16"}
    model = tiny_qwen2()
    engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                      model_parameters=ds_utils.get_optimizer_grouped_parameters(model, 0.0))
    held = engine.optimizer.torch_autocast_gradscaler
    with pytest.raises(RuntimeError, match=r"needs deepspeed>=0\.19\.8 \(this is 0\.19\.6"):
        ls_ds.attach(engine)
    assert engine.optimizer.torch_autocast_gradscaler is held  # nothing changed
