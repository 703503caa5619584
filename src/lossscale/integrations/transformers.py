"""Hugging Face transformers: `attach(trainer)` gives a `Trainer` a `lossscale.GradScaler`.

```python
args = TrainingArguments(..., fp16=True)              # use_cpu=True works too
trainer = Trainer(model=model, args=args, train_dataset=ds)
scaler = lossscale.integrations.transformers.attach(trainer)
trainer.train()
```

The Trainer runs on accelerate: this is `lossscale.integrations.accelerate.attach` on
`trainer.accelerator` (FP16 on CPU too; skipped steps reported exactly, fused optimizers included, so
the Trainer's `if not accelerator.optimizer_step_was_skipped: lr_scheduler.step()` holds the LR on
skipped steps), plus a callback. The callback adds `scaler.metrics()` (prefixed `scaler/`) to the
Trainer's training logs: `trainer.state.log_history` and every `report_to` logger. At the end of
training it adds the scaler's health account (`scaler.health().metrics()`, prefixed `scaler/health/`)
to the Trainer's final training log (the one with `train_runtime`, which `train()` returns) and writes
its paragraph to the Trainer's logger `transformers.trainer` (INFO when healthy, WARNING otherwise).
The Trainer's checkpoints save and restore the scaler (`scaler.pt`, loaded with `weights_only=True`).

With `TrainingArguments(deepspeed=...)` the scaler is accelerate's `EngineScaler`: `train()` builds the
DeepSpeed engine and installs the scaler there, before the Trainer loads a DeepSpeed checkpoint; the
engine's checkpoints carry it.

Tested with transformers 5.24.0 (accelerate 1.16.0) on CPU.
"""


from __future__ import annotations

import weakref

from . import _require

__all__ = ["attach"]


def attach(trainer, scaler=None, **scaler_kwargs):
    """Make a ``transformers.Trainer`` scale FP16 losses with a ``lossscale.GradScaler``; returns it.

    Call it after constructing the Trainer with ``TrainingArguments(fp16=True)`` and before
    ``trainer.train()``. Works on CUDA and on CPU (``use_cpu=True``, where the Trainer would
    otherwise train in FP32 without a word), and with the default fused AdamW: a skipped step does
    not advance the LR (one host sync per step for fused optimizers, to read the skip flag).
    ``scaler.metrics()`` appear in the Trainer's training logs under ``scaler/`` at its logging
    steps (one host sync each), and ``scaler.health()`` at the end of training (its numbers in the
    final log, its paragraph in the Trainer's logger); checkpoints and ``resume_from_checkpoint``
    restore the scaler. With ``TrainingArguments(deepspeed=...)`` it returns an ``EngineScaler`` that
    ``train()`` points at the scaler installed in the DeepSpeed engine
    (``lossscale.integrations.accelerate.attach``).

    Called again on the same Trainer, it returns the same scaler (a different scaler or scaler
    keywords then raise ``ValueError``, as in ``lossscale.integrations.accelerate.attach``).

    Args:
        trainer: a ``transformers.Trainer`` whose ``args.fp16`` is True.
        scaler: a ``lossscale.GradScaler``, or None to build one from ``scaler_kwargs``.
        **scaler_kwargs: ``lossscale.GradScaler`` arguments, only when ``scaler`` is None.
    """
    _require("transformers")
    from transformers import Trainer

    from . import accelerate as _accelerate

    if not isinstance(trainer, Trainer):
        raise ValueError(f"trainer={trainer!r} must be a transformers.Trainer.")
    if not trainer.args.fp16:
        # training_args.py:1615 turns fp16=True into the accelerator's mixed_precision="fp16".
        raise ValueError("trainer.args.fp16 is False; build the Trainer with TrainingArguments(fp16=True) "
                         "to use a loss scaler (bf16=True needs none).")
    accelerator = trainer.accelerator
    if _accelerate._attached(accelerator, scaler, scaler_kwargs) is None and _accelerate._prepared(accelerator):
        # train() prepares the model and optimizer (trainer.py:1764-1773), evaluate()/predict() the model
        # (trainer.py:2928-2932); later calls reuse them, without the scaler.
        raise RuntimeError("attach(trainer) was called after the Trainer prepared its model (trainer.train(), "
                           "evaluate() or predict() do), so it would train without FP16 loss scaling. Call "
                           "attach(trainer) right after building the Trainer, before trainer.train() or "
                           "evaluate(); to go on training this model, build a new Trainer with it.")
    scaler = _accelerate.attach(accelerator, scaler, **scaler_kwargs)  # the same one if attached
    callbacks = trainer.callback_handler.callbacks
    callbacks[:] = [cb for cb in callbacks if not getattr(cb, "_lossscale", False)]
    # First in line: on_log callbacks share one `logs` dict, so the report_to loggers after it see
    # the scaler's figures too.
    callbacks.insert(0, _metrics_callback(trainer, scaler))
    return scaler


def _metrics_callback(trainer, scaler):
    from transformers import TrainerCallback

    from . import accelerate as _accelerate

    trainer_ref = weakref.ref(trainer)

    class LossScaleCallback(TrainerCallback):
        """Adds ``scaler.metrics()`` to the Trainer's training logs and ``scaler.health()`` at the end of
        training; checks the scaler is in place."""

        _lossscale = True
        _health = None  # the end-of-training account, from the final log to on_train_end

        def on_train_begin(self, args, state, control, **kwargs):
            """Refuse to train if the Trainer rebuilt its accelerator after attach()."""
            trainer = trainer_ref()
            # Under DeepSpeed the handle's target: train()'s prepare() installed it in the engine by now.
            training = scaler.target if isinstance(scaler, _accelerate.EngineScaler) else scaler
            in_place = trainer is None or (training is not None and
                                           _accelerate._training_scaler(trainer.accelerator) is training)
            if not in_place:
                # trainer.py:4658 (hyperparameter_search) builds a new accelerator per trial.
                raise RuntimeError("The Trainer rebuilt its accelerator after lossscale attach(), so "
                                   "training would run without the scaler. hyperparameter_search does this "
                                   "for every trial and is not supported; call attach(trainer) last, right "
                                   "before trainer.train().")

        def on_log(self, args, state, control, logs=None, **kwargs):
            """Add the scaler's figures to a training log (the one with "loss"), and its health account
            to the final one (with "train_runtime")."""
            if logs is None:
                return
            if "train_runtime" in logs:
                # trainer.py:2022 logs the training's closing metrics (speed_metrics("train", ...)); the
                # same dict is TrainOutput.metrics (trainer.py:2049), so the figures reach train()'s result.
                self._health = scaler.health()
                figures = self._health.metrics(prefix="scaler/health/")
            elif "loss" in logs:
                figures = {f"scaler/{k}": v for k, v in scaler.metrics().items()}
            else:
                return
            logs.update(figures)
            # trainer.py:4209-4211 appends a copy of `logs` (plus "step") to log_history, then calls on_log.
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update(figures)

        def on_train_end(self, args, state, control, **kwargs):
            """Write the health paragraph to the Trainer's logger (where "Training completed" goes,
            trainer.py:2003): INFO when healthy, WARNING otherwise."""
            report, self._health = self._health or scaler.health(), None
            if state.is_world_process_zero:
                from transformers.utils import logging as hf_logging

                logger = hf_logging.get_logger("transformers.trainer")
                (logger.info if report.verdict == "healthy" else logger.warning)(report.text)

    return LossScaleCallback()
