"""lossscale.integrations.transformers.attach on TRL's trainers (GRPO and SFT), run for real on CPU.

TRL's trainers are transformers ``Trainer``s, so ``attach(trainer)`` is the whole integration. Each test
trains a 2-layer Qwen2 built from a config, with a character tokenizer built in code (nothing
downloaded), ``fp16=True`` (attach turns FP16 autocast and scaling on on CPU, where the Trainer alone
would train in FP32), the Trainer's default fused AdamW and a linear LR schedule. GRPO samples 4
completions of 3 tokens per prompt and scores them with a rule (later letters score higher).

Two faults at chosen steps: an inf in one gradient inside backward (an FP16 overflow) and a NaN out of
the embedding in the training forward (a batch that produces a NaN loss). Both steps are skipped with
the weights and the optimizer state bitwise unchanged and the LR held; the overflow backs the scale
off, the NaN loss does not (the scale was not the cause). ``scaler/*`` keys reach ``log_history``, and
a run resumed from a checkpoint ends bitwise equal to the uninterrupted run.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")

from transformers import TrainerCallback, get_linear_schedule_with_warmup  # noqa: E402

import lossscale  # noqa: E402
from lossscale.integrations import transformers as ls_transformers  # noqa: E402
from _integration_models import fresh_accelerate_state  # noqa: E402,F401  (fixture)
from _integration_models import DtypeProbe, InfAt, all_equal, lr_reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny ops, one thread


@pytest.fixture(autouse=True)
def _fresh(fresh_accelerate_state):
    """accelerate's process-wide state, reset around every test (see _integration_models)."""


STEPS = 8
INF_AT = 2    # the step whose gradient gets an inf
NAN_AT = 4    # the step whose training forward gives NaN
SAVE_AT = 6   # the checkpoint the resumed run starts from (after both faults)
LR = 1e-3
WARMUP = 2
INIT_SCALE = 2.0**10  # no step overflows by itself: only the injected inf does


def _load_example():
    path = Path(__file__).resolve().parent.parent / "examples" / "trl_grpo_fp16.py"
    spec = importlib.util.spec_from_file_location("trl_grpo_fp16", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The example's tiny Qwen2, character tokenizer and rule-based reward (one definition for both).
example = _load_example()


class NanAt:
    """A forward hook that makes ``module``'s output NaN at given training forwards (those with grad on:
    generation runs under no_grad and is not counted). ``start`` offsets the count for resumed runs."""

    def __init__(self, module, calls, start=0):
        self.calls, self.n = set(calls), start
        module.register_forward_hook(self)

    def __call__(self, module, inputs, output):
        if not torch.is_grad_enabled():
            return None
        call, self.n = self.n, self.n + 1
        return output * float("nan") if call in self.calls else None


def _state(model, optimizer):
    """Weights and every tensor of the optimizer's state, copied."""
    tensors = [p.detach().clone() for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [v.detach().clone() for v in state.values() if torch.is_tensor(v)]
    return tensors


class Recorder(TrainerCallback):
    """Per optimizer step: the LR used, the skip flag, the scale after, whether weights or optimizer
    state moved."""

    def __init__(self, box):
        self.box = box
        self.lrs, self.skipped, self.scales, self.moved = [], [], [], []
        self.scaler_at_begin = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.scaler_at_begin = self.box["trainer"].accelerator.scaler.state_dict()

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, model=None, **kwargs):
        self.lrs.append(optimizer.param_groups[0]["lr"])
        self._before = _state(model, optimizer)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        accelerator = self.box["trainer"].accelerator
        self.skipped.append(accelerator.optimizer_step_was_skipped)
        self.scales.append(accelerator.scaler.get_scale())
        self.moved.append(not all_equal(self._before, _state(model, optimizer)))


def _trainer(kind, recorder, scaler_kwargs=(), **training_args):
    """A TRL trainer of ``kind`` ("grpo" or "sft") over the example's tiny Qwen2, FP16, lossscale attached
    (init_scale INIT_SCALE, then ``scaler_kwargs``); returns (model, trainer, scaler)."""
    from datasets import Dataset

    common = dict(fp16=True, use_cpu=True, learning_rate=LR, lr_scheduler_type="linear", report_to=[], seed=0,
                  disable_tqdm=True, dataloader_num_workers=0, **training_args)
    model, tokenizer = example.tiny_qwen2(), example.char_tokenizer()
    if kind == "grpo":
        args = trl.GRPOConfig(per_device_train_batch_size=4, num_generations=4, max_completion_length=3, **common)
        data = Dataset.from_dict({"prompt": ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"] * 2})
        trainer = trl.GRPOTrainer(model=model, reward_funcs=example.later_letters, args=args, train_dataset=data,
                                  processing_class=tokenizer, callbacks=[recorder])
    else:
        args = trl.SFTConfig(per_device_train_batch_size=2, max_length=16, **common)
        data = Dataset.from_dict({"text": ["the cat sat", "a dog ran far", "birds sing", "fish swim deep"] * 4})
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                                 callbacks=[recorder])
    recorder.box["trainer"] = trainer
    scaler = ls_transformers.attach(trainer, init_scale=INIT_SCALE, **dict(scaler_kwargs))
    return model, trainer, scaler


def _train(tmp_path, kind, *, resume=None):
    """``kind`` for STEPS steps with the two faults, saving a checkpoint at SAVE_AT."""
    start = 0 if resume is None else SAVE_AT
    recorder = Recorder({})
    model, trainer, scaler = _trainer(kind, recorder, output_dir=str(tmp_path / "out"), max_steps=STEPS,
                                      warmup_steps=WARMUP, logging_steps=2, save_strategy="steps", save_steps=SAVE_AT)
    probe = DtypeProbe(model.model.layers[-1].mlp.down_proj)  # an nn.Linear in every forward
    InfAt(model.model.layers[0].mlp.up_proj.weight, [INF_AT], start=start)
    NanAt(model.model.embed_tokens, [NAN_AT], start=start)
    trainer.train(resume_from_checkpoint=resume)
    return dict(trainer=trainer, scaler=scaler, rec=recorder, state=_state(model, trainer.optimizer),
                dtypes=set(probe.dtypes))


@pytest.mark.parametrize("kind", ["grpo", "sft"])
def test_trl_trainer_skips_overflow_and_nan_holds_the_lr_logs_and_resumes_bitwise(tmp_path, kind):
    run = _train(tmp_path / "run", kind)
    rec, scaler = run["rec"], run["scaler"]
    assert run["dtypes"] == {torch.float16}  # FP16 autocast really on, on CPU
    optimizer = run["trainer"].optimizer.optimizer
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"]  # the Trainer's default

    # Both faults skipped, weights and optimizer state bitwise untouched there; every other step moved.
    assert rec.skipped == [s in (INF_AT, NAN_AT) for s in range(STEPS)]
    assert rec.moved == [s not in (INF_AT, NAN_AT) for s in range(STEPS)]
    # The overflow backs the scale off; the NaN loss is a bad batch, not a scale too large: held.
    assert rec.scales == [INIT_SCALE] * INF_AT + [INIT_SCALE / 2] * (STEPS - INF_AT)
    counters = scaler.counters()
    assert (counters["skipped_steps"], counters["inf_steps"], counters["bad_loss_steps"]) == (2, 1, 1)

    # The LR at each step is the schedule's over the taken steps only.
    make = lambda opt: get_linear_schedule_with_warmup(opt, WARMUP, STEPS)  # noqa: E731
    assert rec.lrs == lr_reference(make, [not s for s in rec.skipped], LR)
    assert rec.lrs[INF_AT + 1] == rec.lrs[INF_AT] and rec.lrs[NAN_AT + 1] == rec.lrs[NAN_AT]

    # scaler.metrics() in log_history at every logging step, with that step's values; health at the end.
    history = run["trainer"].state.log_history
    logged = [h for h in history if "loss" in h]
    assert [h["step"] for h in logged] == [2, 4, 6, 8]
    for h in logged:
        assert h["scaler/loss_scale"] == rec.scales[h["step"] - 1]
        assert h["scaler/skipped_steps"] == (h["step"] > INF_AT) + (h["step"] > NAN_AT)
    final = history[-1]
    assert final["scaler/health/steps"] == STEPS and final["scaler/health/skipped"] == 2

    # Resumed from the checkpoint at SAVE_AT: the scaler comes back exactly, and the rest of the run is
    # the same run, bit for bit (weights, optimizer state, scaler).
    ckpt = tmp_path / "run" / "out" / f"checkpoint-{SAVE_AT}"
    saved = torch.load(ckpt / "scaler.pt", weights_only=True)
    resumed = _train(tmp_path / "resumed", kind, resume=str(ckpt))
    assert resumed["rec"].scaler_at_begin == saved
    assert resumed["rec"].scales == rec.scales[SAVE_AT:]
    assert resumed["rec"].lrs == rec.lrs[SAVE_AT:]
    assert all_equal(resumed["state"], run["state"])
    assert resumed["scaler"].state_dict() == scaler.state_dict()


def test_the_grpo_example_runs_fp16_and_reports_health(tmp_path):
    """examples/trl_grpo_fp16.py, shortened: FP16 GRPO with its RL settings, the scaler's figures in the
    logs, the health account in the final log, the LR schedule advanced once per taken step."""
    final = example.main(steps=4, output_dir=str(tmp_path))
    assert final["scaler/health/steps"] == 4 and final["scaler/health/verdict"] == 0
    assert final["lr_steps"] == 4 - final["scaler/health/skipped"]
    assert final["scaler/health/spike_steps"] == 0  # skip_if is on (min_steps not reached in 4 steps)


class TimesAt:
    """A gradient hook that multiplies ``param``'s gradient by ``factor`` at given backward calls: a finite
    spike (an outlier reward's advantage), which an inf check lets through."""

    def __init__(self, param, calls, factor):
        self.calls, self.factor, self.n = set(calls), factor, 0
        param.register_hook(self)

    def __call__(self, grad):
        call, self.n = self.n, self.n + 1
        return grad * self.factor if call in self.calls else None


def _short_run(tmp_path, kind, scaler_kwargs, fault, steps=6, accumulation=1):
    """A short run of ``kind`` with ``fault(model)`` installed; returns the scaler and the Recorder."""
    recorder = Recorder({})
    model, trainer, scaler = _trainer(kind, recorder, scaler_kwargs, output_dir=str(tmp_path), max_steps=steps,
                                      logging_steps=steps, save_strategy="no", gradient_accumulation_steps=accumulation)
    fault(model)
    trainer.train()
    return scaler, recorder


def test_grpo_skip_if_skips_a_finite_gradient_spike_and_holds_the_lr(tmp_path):
    """skip_if through the Trainer: a x1000 gradient (finite) after min_steps is skipped as a spike: the
    weights and optimizer state untouched, the LR held, the scale not backed off (it fits FP16)."""
    spike = 4
    scaler, rec = _short_run(tmp_path, "grpo", dict(skip_if=lossscale.SkipIf(grad_norm_zscore=6.0, min_steps=3)),
                             lambda m: TimesAt(m.model.layers[0].mlp.up_proj.weight, [spike], 1e3))
    assert rec.skipped == [s == spike for s in range(6)]
    assert rec.moved == [s != spike for s in range(6)]
    assert rec.lrs[spike + 1] == rec.lrs[spike]
    assert rec.scales == [INIT_SCALE] * 6
    counters = scaler.counters()
    assert counters["spike_steps"] == 1 and counters["skipped_steps"] == 0  # a spike, not an overflow


def test_sft_bad_microbatch_drop_costs_only_the_bad_micro_batch(tmp_path):
    """bad_microbatch="drop" with gradient accumulation: a micro-batch whose forward gives NaN is left out
    and the step is taken over the others (by default the whole step would be skipped); the scale is kept."""
    scaler, rec = _short_run(tmp_path, "sft", dict(bad_microbatch="drop"),
                             lambda m: NanAt(m.model.embed_tokens, [5]), steps=4, accumulation=2)
    assert rec.skipped == [False] * 4 and all(rec.moved)  # micro-batch 5 is the second of step 2
    assert rec.scales == [INIT_SCALE] * 4
    assert scaler.counters()["skipped_steps"] == 0 and scaler.health().dropped_microbatches == 1
    default, rec = _short_run(tmp_path / "default", "sft", {}, lambda m: NanAt(m.model.embed_tokens, [5]),
                              steps=4, accumulation=2)
    assert rec.skipped == [s == 2 for s in range(4)]  # the default: the whole step skipped
