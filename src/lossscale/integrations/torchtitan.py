"""torchtitan: ``attach(trainer)`` makes a torchtitan ``Trainer`` train in FP16 with a ``lossscale.GradScaler``.

::

    config = llama3_debugmodel()                           # any Trainer.Config
    config.training.mixed_precision_param = "float16"      # FSDP2 computes in FP16 (the CLI offers bf16/fp32)
    trainer = Trainer(config)
    scaler = lossscale.integrations.torchtitan.attach(trainer)
    trainer.train()                                        # torchtitan's own loop, unchanged

torchtitan has no loss scaler: in FP16 the first overflow writes inf/NaN into the weights. What
``attach`` changes in the trainer it is given (line numbers are torchtitan 0.3.0's):

* **The backward is scaled.** Both the plain step (trainer.py:818-828) and the pipeline schedules
  (distributed/pipeline_parallel.py:327-329) call the trainer's one loss object; its loss keeps its
  value and carries the scale in its backward only, so the loss torchtitan logs and checks is the true
  one. Under ``ChunkedLossWrapper`` the per-chunk loss is the one scaled: the wrapper runs each chunk's
  backward itself (components/loss.py:754-762). Under pipeline parallelism only the losses the schedule
  computes for its microbatches are scaled: torch's stages also call the closure to infer their
  backward's shapes, on a forward of uninitialised tensors (torch 2.13 pipelining/stage.py:2009-2024),
  whose loss, often NaN, must not count as a bad batch.
* **The gradients are unscaled before torchtitan's clip** (trainer.py:940): right after the step's
  last forward-backward, every optimizer is unscaled and checked, its skip flag all-reduced over the
  default group, so every rank (pipeline stages, expert-parallel ranks) decides the same.
  torchtitan's ``clip_grad_norm_`` then computes its global norm, across PP and EP as it does, of the
  true gradients.
* **``optimizers.step()`` and ``lr_schedulers.step()`` skip together** (trainer.py:948-949):
  ``scaler.step`` for each optimizer, then ``scaler.update()``; the container's step hooks (MoE load
  balancing) run as before. The LR schedule is held on a skipped step: one host sync per step with
  fused optimizers (torchtitan's default) to read the decision.
* **Checkpoints** (DCP) hold the scaler under ``"lossscale"``, beside ``"train_state"``
  (trainer.py:596), saved and restored with the rest.
* **Metrics**: ``scaler.metrics()`` (prefixed ``scaler/``) join every log torchtitan writes
  (``MetricsProcessor.log``, components/metrics.py:451-519; TensorBoard, W&B); one host sync per
  logging step.
* **A batch whose loss is not finite** is skipped (the loss check: no backoff, counted in
  ``bad_loss_steps``). torchtitan would stop the run on it on a logging step only (trainer.py:994):
  here a step the scaler skipped does not stop it, on any step; its figures are logged and a warning
  names it. The run stops when the scaler finds it stuck: ``on_stuck="raise"`` by default here, so
  ten non-finite losses in a row (or an overflow with the scale at its floor) raise RuntimeError with
  the scaler's diagnosis. A non-finite loss on a step that was taken still raises torchtitan's error.

Tested with torchtitan 0.3.0 (torch 2.13) on CPU over two gloo ranks: FSDP2, two pipeline stages
(1F1B), and expert parallelism (DeepSeek-V3's debug model, all-to-all dispatch); see
docs/how-to/torchtitan.md.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Dict

import torch

from . import _require

__all__ = ["attach", "CHECKPOINT_KEY"]

#: The key of the scaler's state in torchtitan's checkpoints (``CheckpointManager.states``).
CHECKPOINT_KEY = "lossscale"
_ATTACHED = "_lossscale_attachment"  # where attach() leaves its record on the trainer
_NOT_FINITE = "Loss is not finite"  # torchtitan's error, trainer.py:994-998


@dataclass
class _Attachment:
    """What attach() keeps on a trainer: its scaler, and how far the step in flight has got."""

    scaler: Any
    backward_passes: int = 0  # forward_backward_step calls in this step (one per gradient-accumulation step)


def attach(trainer, **scaler_kwargs):
    """Make a torchtitan ``Trainer`` train in FP16 with loss scaling; returns the ``lossscale.GradScaler``.

    Call it after ``Trainer(config)``, before ``trainer.train()``, on a trainer whose config has
    ``training.mixed_precision_param = "float16"`` (set from Python: torchtitan's command line offers
    bfloat16 and float32 only). The module docstring lists what changes in the trainer.

    Called again on the same trainer, it returns the same scaler; with scaler keywords then it raises
    ValueError (a second scaler would leave the first, and the checkpoint entry it owns, behind).

    Args:
        trainer: a ``torchtitan.trainer.Trainer``.
        **scaler_kwargs: ``lossscale.GradScaler`` arguments. The device is the trainer's; ``on_stuck``
            defaults to "raise" (a run whose batches keep failing stops, as torchtitan's own check
            intends), unless a policy object is given.
    """
    _require("torchtitan")
    from torchtitan.components.loss import BaseLoss
    from torchtitan.trainer import Trainer

    from ..scaler import GradScaler

    if not isinstance(trainer, Trainer):
        raise ValueError(f"trainer={trainer!r} must be a torchtitan.trainer.Trainer.")
    attached = trainer.__dict__.get(_ATTACHED)
    if attached is not None:
        if scaler_kwargs:
            raise ValueError(
                "a lossscale scaler is already attached to this trainer (attach(trainer) returns it); "
                "pass its keywords to the first attach()."
            )
        return attached.scaler
    precision = trainer.config.training.mixed_precision_param
    if precision != "float16":
        # models/llama3/parallelize.py:83 gives FSDP2 this dtype to compute in; the model is built with it.
        raise ValueError(
            f'trainer.config.training.mixed_precision_param is {precision!r}; set it to "float16" on the '
            "Trainer.Config before Trainer(config) to train in FP16 (bfloat16 needs no loss scaler)."
        )
    if not isinstance(trainer.loss_fn, BaseLoss):
        raise ValueError(
            f"trainer.loss_fn={trainer.loss_fn!r} is not a torchtitan BaseLoss; attach() scales the "
            "loss that a BaseLoss (config.loss) returns."
        )
    if "device" in scaler_kwargs:
        raise ValueError("device= is the trainer's (trainer.device); leave it out.")
    if isinstance(scaler_kwargs.get("policy", "dynamic"), str):
        scaler_kwargs.setdefault("on_stuck", "raise")
    scaler = GradScaler(trainer.device.type, **scaler_kwargs)
    # Pipeline stages without the loss never call scale(); they join the skip decision all the same.
    scaler.init_device(trainer.device)
    attachment = _Attachment(scaler)

    _scale_backward(trainer.loss_fn, scaler, trainer.pp_schedule if trainer.parallel_dims.pp_enabled else None)
    trainer.forward_backward_step = _unscaling_forward_backward(trainer, attachment)
    trainer.optimizers.step = _scaled_step(trainer.optimizers, attachment)
    trainer.lr_schedulers.step = _held_on_skip(trainer.lr_schedulers.step, scaler)
    states = getattr(trainer.checkpointer, "states", None)  # absent when checkpointing is off (dcp.py:143-145)
    if states is not None:
        states[CHECKPOINT_KEY] = _ScalerState(scaler)
    trainer.metrics_processor.log = _logging_scaler_metrics(trainer.metrics_processor.log, scaler)
    trainer.train_step = _going_on_after_skipped_bad_loss(trainer, scaler)
    trainer.__dict__[_ATTACHED] = attachment
    return scaler


class _ScaledBackward(torch.autograd.Function):
    """The loss's value forward, the scaled loss's gradient backward: ``loss.backward()`` then runs
    ``scaler.scale(loss).backward()``, bitwise, while the loss torchtitan logs and checks is the true one."""

    @staticmethod
    def forward(ctx, loss, scaled):
        return loss.detach()

    @staticmethod
    def backward(ctx, grad):
        return None, grad


def _scale_backward(loss_fn, scaler, pp_schedule=None) -> None:
    """Make ``loss_fn`` (torchtitan's loss object) return losses whose backward carries the scale.

    The object's class is swapped for a subclass, because both callers hold the object itself: the
    trainer (trainer.py:818) and the pipeline schedule's closure (distributed/pipeline_parallel.py:328).
    With a pipeline schedule, only the losses it computes for its microbatches are scaled (see
    ``_scaling_microbatch_losses_only``)."""
    from torchtitan.components.loss import ChunkedLossWrapper

    if isinstance(loss_fn, ChunkedLossWrapper):
        loss_fn = loss_fn.loss_fn  # components/loss.py:754-762: the per-chunk loss is the one backpropagated
    base = type(loss_fn)

    class ScaledBackwardLoss(base):
        def __call__(self, *args, **kwargs):
            loss, metrics = super().__call__(*args, **kwargs)
            if not (torch.is_grad_enabled() and loss.requires_grad):
                return loss, metrics  # validation (components/validate.py:215 runs under no_grad): nothing to scale
            if self._lossscale_pipelined and not self._lossscale_in_microbatch:
                return loss, metrics  # torch's pipeline stages inferring their backward's shapes
            return _ScaledBackward.apply(loss, self._lossscale_scaler.scale(loss)), metrics

    ScaledBackwardLoss.__name__ = ScaledBackwardLoss.__qualname__ = f"ScaledBackward{base.__name__}"
    loss_fn.__class__ = ScaledBackwardLoss
    loss_fn._lossscale_scaler = scaler
    loss_fn._lossscale_pipelined = pp_schedule is not None
    loss_fn._lossscale_in_microbatch = False
    if pp_schedule is not None:
        _scaling_microbatch_losses_only(pp_schedule, loss_fn)


def _scaling_microbatch_losses_only(schedule, loss_fn) -> None:
    """Mark the losses the pipeline schedule computes for its microbatches (``_compute_loss``, torch 2.13
    pipelining/schedules.py:586-587, called by ``_maybe_compute_loss`` for every schedule) as the ones to
    scale. The schedule's stages call the same closure on their first step, and again after an eval, to
    infer their backward's shapes (``_backward_metadata_inference``, stage.py:2009-2024) on a forward of
    uninitialised tensors (``_to_tensor``, stage.py:1844-1858): that loss is often NaN, and the scaler
    would take it for a bad batch and skip a clean step on every rank."""

    compute_loss = schedule._compute_loss

    def wrapped(*args, **kwargs):
        loss_fn._lossscale_in_microbatch = True
        try:
            return compute_loss(*args, **kwargs)
        finally:
            loss_fn._lossscale_in_microbatch = False

    schedule._compute_loss = wrapped


def _unscaling_forward_backward(trainer, attachment: _Attachment):
    """``trainer.forward_backward_step``, then, after the step's last one (trainer.py:907-925 calls it
    once per gradient-accumulation step), unscale and check every optimizer's gradients: the clip at
    trainer.py:940 comes next and must see true gradients. One all-reduce of the flags per optimizer;
    a host sync per optimizer unless it is fused."""
    forward_backward_step = trainer.forward_backward_step

    def wrapped(*args, **kwargs):
        loss = forward_backward_step(*args, **kwargs)
        attachment.backward_passes += 1
        if attachment.backward_passes == trainer.gradient_accumulation_steps:
            for optimizer in trainer.optimizers.optimizers:
                attachment.scaler.unscale_(optimizer)
        return loss

    return wrapped


def _scaled_step(optimizers, attachment: _Attachment):
    """``OptimizersContainer.step`` (components/optimizer/optimizer.py:296-300) through the scaler: each
    optimizer stepped or skipped by ``scaler.step``, then ``scaler.update()``. Wrapped as torch wraps
    every optimizer's step, so the container's step hooks (MoE load balancing) run as before."""

    def step(self, closure=None):
        if closure is not None:
            raise RuntimeError("OptimizersContainer does not support closures.")
        for optimizer in self.optimizers:
            attachment.scaler.step(optimizer)
        attachment.scaler.update()
        attachment.backward_passes = 0

    return torch.optim.Optimizer.profile_hook_step(step).__get__(optimizers)


def _held_on_skip(step, scaler):
    """``LRSchedulersContainer.step`` unless the scaler skipped the optimizer step (trainer.py:949 steps
    it unconditionally). Reading the decision syncs once with fused optimizers."""

    def held(*args, **kwargs):
        if scaler.last_step_skipped:
            return None
        return step(*args, **kwargs)

    return held


class _ScalerState:
    """The scaler as a DCP ``Stateful``: its state dict travels as one serialised blob (as torchtitan's
    dataloader state does, components/dataloader.py:140-146), so a checkpoint loads whatever the
    scaler's configuration was when it was saved (its policy wins, as in ``GradScaler.load_state_dict``).
    Every rank holds the same state (the skip decision is all-reduced). Saving syncs once, as
    ``scaler.state_dict()`` does."""

    def __init__(self, scaler) -> None:
        self.scaler = scaler

    def state_dict(self) -> Dict[str, Any]:
        buffer = io.BytesIO()
        torch.save(self.scaler.state_dict(), buffer)
        return {"state_dict": buffer.getvalue()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.scaler.load_state_dict(torch.load(io.BytesIO(state_dict["state_dict"]), weights_only=True))


def _logging_scaler_metrics(log, scaler):
    """``MetricsProcessor.log`` with ``scaler.metrics()`` (prefixed ``scaler/``) in its extra metrics, which
    it writes to TensorBoard and W&B (components/metrics.py:517-519). One host sync per logging step."""
    from .loggers import scalars

    def wrapped(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        extra = dict(extra_metrics or {})
        extra.update(scalars(scaler.metrics()))
        return log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)

    return wrapped


def _going_on_after_skipped_bad_loss(trainer, scaler):
    """``trainer.train_step``, going on where torchtitan stops the run on a non-finite loss
    (trainer.py:994-998, after the optimizer step) when the scaler skipped that step: the weights, the
    optimizer state and the LR are as before the batch. The scaler's figures go to torchtitan's metric
    loggers (one host sync) and a warning to its console; torchtitan's loss figures for that step are
    not logged."""
    from torchtitan.tools.logging import logger

    from .loggers import scalars

    train_step = trainer.train_step

    def wrapped(data_iterator):
        try:
            return train_step(data_iterator)
        except RuntimeError as error:
            if not str(error).startswith(_NOT_FINITE) or not scaler.last_step_skipped:
                raise
            trainer.metrics_processor.logger.log(scalars(scaler.metrics()), trainer.step)
            logger.warning(
                f"{error.args[0].split('. Stopping training.')[0]}: lossscale skipped this step (weights, "
                "optimizer state and learning rate unchanged); training goes on."
            )
            return None

    return wrapped
