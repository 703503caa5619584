"""lossscale.integrations.transformers against the real transformers Trainer: a 2-layer GPT-2 built
in code, fp16=True on CPU (use_cpu=True), the default fused AdamW, nothing downloaded."""

import pytest
import torch
from _integration_models import (
    INIT_SCALE,
    TORCH_LIKE,
    DtypeProbe,
    InfAt,
    TokenData,
    all_equal,
    fresh_accelerate_state,  # noqa: F401  (fixture)
    lr_reference,
    read_tensorboard,
    snapshot,
    tiny_gpt2,
)
from transformers import Trainer, TrainerCallback, TrainingArguments, get_linear_schedule_with_warmup

import lossscale
from lossscale.integrations import transformers as ls_transformers

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny ops, one thread


@pytest.fixture(autouse=True)
def _fresh(fresh_accelerate_state):  # noqa: F811  the pytest fixture imported from _integration_models
    """accelerate's process-wide state, reset around every test (see _integration_models)."""


K = 7  # the step whose gradient gets an inf
STEPS = 20
LR = 1e-3
WARMUP = 4


class Recorder(TrainerCallback):
    """LR used, skip flag, scale, and whether the parameters moved, for every optimizer step."""

    def __init__(self, trainer_box):
        self.box = trainer_box
        self.lrs, self.skipped, self.scales, self.moved = [], [], [], []
        self.scaler_at_begin = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.scaler_at_begin = self.box["trainer"].accelerator.scaler.state_dict()

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, model=None, **kwargs):
        self.lrs.append(optimizer.param_groups[0]["lr"])
        self._before = snapshot(model.parameters())

    def on_step_end(self, args, state, control, model=None, **kwargs):
        accelerator = self.box["trainer"].accelerator
        self.skipped.append(accelerator.optimizer_step_was_skipped)
        self.scales.append(accelerator.scaler.get_scale())
        self.moved.append(not all_equal(self._before, snapshot(model.parameters())))


def _train(tmp_path, scaler_kind, schedule, *, save=False, resume=None, report_tb=False):
    model = tiny_gpt2()
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        fp16=True,
        use_cpu=True,
        per_device_train_batch_size=2,
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type=schedule,
        warmup_steps=WARMUP,
        max_grad_norm=1.0,
        logging_steps=5,
        save_strategy="steps" if save else "no",
        save_steps=10,
        report_to=["tensorboard"] if report_tb else [],
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    box = {}
    recorder = Recorder(box)
    trainer = box["trainer"] = Trainer(
        model=model, args=args, train_dataset=TokenData(2 * STEPS, length=8), callbacks=[recorder]
    )
    if scaler_kind == "lossscale":
        scaler = ls_transformers.attach(trainer, init_scale=INIT_SCALE, **TORCH_LIKE)
    else:  # torch's GradScaler by hand, the way accelerate would install it on CUDA
        scaler = trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        trainer.accelerator.native_amp = True
    probe = DtypeProbe(model.lm_head)  # an nn.Linear (GPT-2's blocks use Conv1D)
    InfAt(model.transformer.h[0].mlp.c_fc.weight, [K], start=0 if resume is None else 10)
    trainer.train(resume_from_checkpoint=resume)
    return dict(
        trainer=trainer, scaler=scaler, rec=recorder, params=snapshot(model.parameters()), dtypes=set(probe.dtypes)
    )


def _check_skip_at_k(run):
    rec = run["rec"]
    assert rec.skipped == [s == K for s in range(STEPS)]
    assert rec.moved[K - 1] and not rec.moved[K] and rec.moved[K + 1]  # the skipped step left the weights alone
    assert rec.scales[K] == rec.scales[K - 1] / 2
    assert run["dtypes"] == {torch.float16}  # FP16 autocast really on, on CPU
    assert type(run["trainer"].optimizer.optimizer) is torch.optim.AdamW  # the Trainer's default...
    assert run["trainer"].optimizer.optimizer.defaults["fused"]  # ...fused AdamW


def test_matches_torch_gradscaler_where_torch_works(tmp_path):
    # A constant LR: torch's scaler (installed by hand) trains the fused default right there.
    ours = _train(tmp_path / "ours", "lossscale", "constant")
    ref = _train(tmp_path / "ref", "torch", "constant")
    _check_skip_at_k(ours)
    assert ours["rec"].scales == ref["rec"].scales
    assert all_equal(ours["params"], ref["params"])


def test_skipped_step_holds_the_lr_logs_metrics_and_resumes(tmp_path):
    run = _train(tmp_path, "lossscale", "linear", save=True, report_tb=True)
    _check_skip_at_k(run)
    rec = run["rec"]
    # The LR at K+1 is the LR it would have had without step K (and so on after it).
    make = lambda opt: get_linear_schedule_with_warmup(opt, WARMUP, STEPS)  # noqa: E731
    assert rec.lrs == lr_reference(make, [not s for s in rec.skipped], LR)
    assert rec.lrs[K + 1] == rec.lrs[K]

    # scaler.metrics() in log_history at every logging step, with the values of that step.
    logged = [h for h in run["trainer"].state.log_history if "loss" in h]
    assert [h["step"] for h in logged] == [5, 10, 15, 20]
    for h in logged:
        assert h["scaler/loss_scale"] == rec.scales[h["step"] - 1]
        assert h["scaler/skipped_steps"] == (1 if h["step"] > K else 0)
    assert set(run["scaler"].metrics()) == {k[len("scaler/") :] for k in logged[-1] if k.startswith("scaler/")}
    # ... and through report_to's real SummaryWriter, read back by tensorboard.
    tb = read_tensorboard(next((tmp_path / "out").rglob("events.out.tfevents*")).parent)
    assert tb["train/scaler/loss_scale"] == [(h["step"], h["scaler/loss_scale"]) for h in logged]
    assert tb["train/scaler/skipped_steps"] == [(h["step"], float(h["scaler/skipped_steps"])) for h in logged]

    # Resume from the step-10 checkpoint (after the skip): the scaler comes back exactly, and the
    # rest of the run is the same run.
    ckpt = tmp_path / "out" / "checkpoint-10"
    saved = torch.load(ckpt / "scaler.pt", weights_only=True)
    assert saved["scale"] == rec.scales[9] == rec.scales[0] / 2
    resumed = _train(tmp_path / "resumed", "lossscale", "linear", resume=str(ckpt))
    assert resumed["rec"].scaler_at_begin == saved
    assert resumed["rec"].scales == rec.scales[10:]
    assert resumed["rec"].lrs == rec.lrs[10:]
    assert all_equal(resumed["params"], run["params"])
    assert resumed["scaler"].state_dict() == run["scaler"].state_dict()


def test_validation_and_rebuilt_accelerator(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenData(4, length=8))
    with pytest.raises(ValueError, match=r"TrainingArguments\(fp16=True\)"):
        ls_transformers.attach(trainer)
    with pytest.raises(ValueError, match="transformers.Trainer"):
        ls_transformers.attach(object())

    args = TrainingArguments(output_dir=str(tmp_path), fp16=True, use_cpu=True, report_to=[], max_steps=1)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenData(4, length=8))
    scaler = ls_transformers.attach(trainer)
    ls_transformers.attach(trainer, scaler)  # idempotent: one callback, the same scaler
    assert sum(getattr(cb, "_lossscale", False) for cb in trainer.callback_handler.callbacks) == 1
    trainer.create_accelerator_and_postprocess()  # what hyperparameter_search does per trial
    with pytest.raises(RuntimeError, match="rebuilt its accelerator"):
        trainer.train()
    assert isinstance(scaler, lossscale.GradScaler)


# ------------------------------------------------------------------ misuse is named (issue 19)
def test_attach_twice_returns_the_same_scaler_and_after_train_names_the_trainer_fix(tmp_path):
    def trainer():
        args = TrainingArguments(
            output_dir=str(tmp_path),
            fp16=True,
            use_cpu=True,
            report_to=[],
            max_steps=1,
            per_device_train_batch_size=2,
            disable_tqdm=True,
        )
        return Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenData(2, length=8))

    first = trainer()
    scaler = ls_transformers.attach(first)
    assert ls_transformers.attach(first) is scaler and first.accelerator.scaler is scaler  # was a second scaler
    late = trainer()
    late.train()  # without the scaler: on CPU the Trainer trains in FP32
    # It said accelerate's "called after accelerator.prepare(...)", which the Trainer's user never called.
    with pytest.raises(RuntimeError, match=r"before trainer\.train\(\)") as error:
        ls_transformers.attach(late)
    assert "accelerator.prepare" not in str(error.value)
