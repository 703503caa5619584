"""verl: ``attach(engine)`` makes a verl FSDP engine train FP16 with a ``lossscale.ShardedGradScaler``.

::

    worker = TrainingWorker(config)           # or the engine of an ActorRolloutRefWorker / critic worker
    worker.reset()                            # builds the engine (engine.initialize())
    scaler = lossscale.integrations.verl.attach(worker.engine)      # right after, before training
    # training is unchanged: worker.train_batch(data) / train_mini_batch(data),
    # worker.save_checkpoint(dir) / load_checkpoint(dir) carry the scaler

verl's FSDP engines (``strategy`` "fsdp2" and "fsdp") scale the loss when the parameters are fp16
(``mixed_precision.param_dtype: fp16``). The ``fsdp_turbo`` engine subclasses them, but its
``_build_fsdp_module`` (fsdp_turbo_impl.py:50-63) builds no scaler and leaves the forward's autocast
at bf16 (transformer_impl.py:169, 1559), whatever the config says, so ``attach`` refuses it. What
``attach`` changes (line numbers are verl 0.9.1's):

* The scaler. verl builds torch's ``ShardedGradScaler(growth_interval=400)``
  (workers/engine/fsdp/transformer_impl.py:406-411), whose numbers cannot be configured, and which
  disables itself when its default device "cuda" is absent. Because a scaler object exists, verl also
  skips its own non-finite guard (transformer_impl.py:817-826), so an overflow step is applied there
  and the weights become NaN. ``attach`` puts a ``lossscale.ShardedGradScaler`` in its place, on the
  engine's device: verl's growth interval of 400 unless you give another, any other
  ``lossscale.GradScaler`` keyword. Its skip decision is all-reduced over the default group, which is
  the engine's device mesh: verl builds the mesh over the whole world (transformer_impl.py:241). An
  overflow step is skipped on every rank with the weights and the optimizer state unchanged, and the
  scale backs off.
* The LR. verl's workers step the LR scheduler after the last mini-batch of ``train_mini_batch`` and
  after every SFT ``train_batch``, whether the optimizer stepped or not (engine_workers.py:374-376).
  With ``attach`` the scheduler advances only if at least one optimizer step since its previous
  advance was taken: a schedule that advances on skipped steps drifts ahead of the weights. A held
  call returns the LR in force, which verl logs as ``lr``.
* Checkpoints. verl's ``FSDPCheckpointManager`` saves the model, the optimizer, the LR scheduler and
  the RNG, not the scaler (utils/checkpoint/fsdp_checkpoint_manager.py:355-362): a resumed run
  restarts at the initial scale. With ``attach`` each rank also writes
  ``lossscale_scaler_world_size_{W}_rank_{R}.pt`` beside its ``extra_state_*`` file, and loads it back,
  whenever the manager saves and loads its extra state (``checkpoint.save_contents`` /
  ``load_contents`` with "extra", verl's default).
* Metrics. Every ``engine.train_batch`` adds ``scaler.metrics()`` as ``scaler/<name>`` (``loss_scale``,
  ``skipped_steps``, ``last_step_skipped``, ...) and the run-health account's numbers
  (``scaler.health().metrics()``) as ``scaler/health/<name>`` to the metrics verl returns beside
  ``grad_norm`` (workers/engine/base.py:129-131), each a one-element list as verl's per-micro-batch
  metrics are, so they reach verl's tracking loggers with the rest (``train_batch``: one list per
  rank; ``train_mini_batch``: one flat list, a value per rank for each mini-batch in turn).
  Reading them syncs host and device twice per step; verl's step already syncs for ``grad_norm``.

Tested with verl 0.9.1 and torch 2.13 on CPU (FSDP2 and FSDP1, two gloo ranks); see docs/how-to/verl.md.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from typing import Any

__all__ = ["attach", "CHECKPOINT_FILE"]

#: The scaler's file in a verl checkpoint directory, per rank (beside verl's ``extra_state_*`` files).
CHECKPOINT_FILE = "lossscale_scaler_world_size_{world_size}_rank_{rank}.pt"
_ATTR = "_lossscale_attached"
#: verl's own growth interval for its fp16 scaler (transformer_impl.py:409), kept as attach()'s default.
VERL_GROWTH_INTERVAL = 400


@dataclasses.dataclass
class _Attached:
    """What attach() keeps on an engine: the scaler, and whether an optimizer step was taken since the
    LR scheduler last advanced."""

    scaler: Any
    stepped_since_lr_step: bool = False


def attach(engine, **scaler_kwargs):
    """Make verl's FSDP ``engine`` scale FP16 losses with a ``lossscale.ShardedGradScaler``; returns it.

    Call it once the engine is built (``engine.initialize()``, which ``TrainingWorker.reset()`` and the
    workers' ``init_model()`` run) and before training. The module docstring says what it changes.

    Args:
        engine: a verl ``FSDPEngine`` (``worker.engine``; strategy "fsdp2" or "fsdp") whose parameters
            train in fp16 (``engine.mixed_precision.param_dtype: fp16``).
        **scaler_kwargs: ``lossscale.GradScaler`` keywords (``init_scale``, ``growth_interval``,
            ``policy``, ``skip_if``, ...). Defaults: ``growth_interval=400`` (verl's), the device
            verl trains on.

    Called again on the same engine without keywords, it returns the scaler installed first; with
    keywords it raises ValueError (a second scaler would leave the first out of training). After
    ``engine.initialize()`` ran again (``TrainingWorker.reset()`` rebuilds the engine, verl's scaler and
    checkpoint manager with it), it installs a new scaler.
    """
    _require_verl()
    import torch
    from verl.utils.device import get_device_name
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    from ..sharded import ShardedGradScaler

    if not isinstance(engine, FSDPEngine):
        raise ValueError(
            f"engine={type(engine).__name__}(...) must be a verl FSDPEngine (a worker's .engine with "
            "strategy 'fsdp2' or 'fsdp')."
        )
    attached = engine.__dict__.get(_ATTR)
    if attached is not None and engine.scaler is attached.scaler:
        if not scaler_kwargs:
            return attached.scaler
        raise ValueError(
            "a lossscale scaler is already attached to this engine (attach(engine) returns it); a "
            "second one would leave the first out of training."
        )
    if getattr(engine, "checkpoint_manager", None) is None:  # set by initialize() (transformer_impl.py:217)
        raise RuntimeError(
            "attach(engine) was called before the engine was built: call it after "
            "engine.initialize() (TrainingWorker.reset(), or the worker's init_model())."
        )
    if engine.optimizer is None:  # forward_only engines (a reference policy) build none (transformer_impl.py:622)
        raise ValueError("the engine is forward_only (it has no optimizer): there is nothing to scale.")
    if engine._autocast_dtype != torch.float16:  # the param_dtype verl read from the config (transformer_impl.py:400)
        if (
            engine.engine_config.strategy == "fsdp_turbo"
        ):  # its _build_fsdp_module sets neither (fsdp_turbo_impl.py:50-63)
            raise ValueError(
                "verl's fsdp_turbo engine autocasts to bf16 whatever the config says (it builds no "
                "scaler and no fp16 autocast): use strategy 'fsdp2' to train in FP16."
            )
        raise ValueError(
            f"the engine trains in {engine._autocast_dtype} (engine.mixed_precision.param_dtype), not "
            "fp16: bf16 and fp32 need no loss scaler. Set param_dtype: fp16 to train in FP16."
        )

    scaler_kwargs.setdefault("growth_interval", VERL_GROWTH_INTERVAL)
    scaler_kwargs.setdefault("device", get_device_name())
    # The default process group: verl's FSDP mesh spans the world (transformer_impl.py:241).
    scaler = ShardedGradScaler(**scaler_kwargs)
    # forward_backward_batch and optimizer_step read engine.scaler at each call (transformer_impl.py:747, 798).
    engine.scaler = scaler
    if attached is None:
        state = engine.__dict__[_ATTR] = _Attached(scaler)
        engine.train_batch = _reporting(engine, engine.train_batch, state)
        engine.lr_scheduler_step = _holding(engine, engine.lr_scheduler_step, state)
    else:  # initialize() ran again (TrainingWorker.reset()): a new verl scaler and checkpoint manager
        attached.scaler, attached.stepped_since_lr_step = scaler, False
    manager = engine.checkpoint_manager
    manager.save_checkpoint = _saving(manager, manager.save_checkpoint, scaler)
    manager.load_checkpoint = _loading(manager, manager.load_checkpoint, scaler)
    return scaler


def _require_verl() -> None:
    """Import verl, or raise ``ModuleNotFoundError`` naming how to install it. verl is in no lossscale
    extra: its pins (transformers<5.11) clash with the other frameworks'."""
    try:
        import verl  # noqa: F401
    except ModuleNotFoundError as error:
        if error.name != "verl":
            raise  # verl is there but something it imports is not: its own message says what
        raise ModuleNotFoundError(
            "lossscale.integrations.verl needs verl, which is not installed: pip install verl (tested: verl==0.9.1).",
            name="verl",
        ) from error


def _reporting(engine, train_batch, state: _Attached):
    """``engine.train_batch`` (workers/engine/base.py:113-132) that notes whether the step was taken and
    adds the scaler's metrics where verl adds ``grad_norm`` (base.py:129-131)."""
    from .loggers import scalars

    def wrapped(*args: Any, **kwargs: Any):
        outputs = train_batch(*args, **kwargs)
        scaler = state.scaler
        # One host sync each (verl's own step already synced for grad_norm.item()); metrics() may be a
        # collective (telemetry reduced across ranks), so every rank reads them.
        state.stepped_since_lr_step |= not scaler.last_step_skipped
        figures = {**scalars(scaler.metrics()), **scalars(scaler.health().metrics(prefix=""), "scaler/health/")}
        if engine.is_mp_src_rank_with_outputs():
            # Each a list of one value, the form of verl's own per-micro-batch metrics: the worker gathers
            # it over the data-parallel ranks, and train_mini_batch flattens the gathered lists (a bare
            # float there raises TypeError).
            outputs["metrics"].update({k: [v] for k, v in figures.items()})
        return outputs

    wrapped.__doc__ = train_batch.__doc__
    return wrapped


def _holding(engine, lr_scheduler_step, state: _Attached):
    """``engine.lr_scheduler_step`` (transformer_impl.py:836-842), which the workers call after training
    (engine_workers.py:374-376), held when no optimizer step was taken since the scheduler last advanced;
    returns the LR in force, as verl's does."""

    def wrapped(*args: Any, **kwargs: Any):
        if not state.stepped_since_lr_step:
            return engine.lr_scheduler.get_last_lr()[0]  # the first group's, as transformer_impl.py:841
        state.stepped_since_lr_step = False
        return lr_scheduler_step(*args, **kwargs)

    wrapped.__doc__ = lr_scheduler_step.__doc__
    return wrapped


def _path(manager, local_path: str) -> str:
    # Named like the manager's own per-rank files (fsdp_checkpoint_manager.py:316-318).
    return os.path.join(local_path, CHECKPOINT_FILE.format(world_size=manager.world_size, rank=manager.rank))


def _saving(manager, save_checkpoint, scaler):
    """``FSDPCheckpointManager.save_checkpoint`` that also writes the scaler's state, per rank, when the
    manager writes its extra state (fsdp_checkpoint_manager.py:355-362)."""
    import torch

    def wrapped(local_path, *args: Any, **kwargs: Any):
        out = save_checkpoint(local_path, *args, **kwargs)
        if local_path is not None and manager.should_save_extra:
            torch.save(scaler.state_dict(), _path(manager, local_path))
        return out

    wrapped.__doc__ = save_checkpoint.__doc__
    return wrapped


def _loading(manager, load_checkpoint, scaler):
    """``FSDPCheckpointManager.load_checkpoint`` that also loads the scaler's state when the manager
    loads its extra state (fsdp_checkpoint_manager.py:240-255). A checkpoint saved without lossscale has
    no scaler file: the scaler then keeps its state, with a warning."""
    import torch

    def wrapped(local_path, *args: Any, **kwargs: Any):
        out = load_checkpoint(local_path, *args, **kwargs)
        if local_path is None or not manager.should_load_extra:
            return out
        path = _path(manager, local_path)
        if os.path.exists(path):
            scaler.load_state_dict(torch.load(path, weights_only=True))
        else:
            warnings.warn(
                f"lossscale.integrations.verl: {path} is missing (the checkpoint was saved without "
                "lossscale attached); the scaler keeps its state, starting at its initial scale.",
                RuntimeWarning,
                stacklevel=_user_stacklevel(),
            )
        return out

    wrapped.__doc__ = load_checkpoint.__doc__
    return wrapped


def _user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by the caller point at the first frame outside
    lossscale and verl: the user's line that led there through verl's worker and engine."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in ("lossscale", "verl"):
        frame, level = frame.f_back, level + 1
    return level
