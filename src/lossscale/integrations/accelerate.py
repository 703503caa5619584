"""Hugging Face accelerate: `attach(accelerator)` puts a `lossscale.GradScaler` where accelerate keeps its scaler.

```python
accelerator = Accelerator(mixed_precision="fp16")
scaler = lossscale.integrations.accelerate.attach(accelerator)        # before prepare()
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
# the loop is unchanged: accelerator.backward(loss), accelerator.clip_grad_norm_(...),
# optimizer.step(), scheduler.step()
lossscale.integrations.accelerate.log_health(accelerator)            # after the loop
```

What it changes in accelerate (1.x):

- FP16 autocast and loss scaling on CPU too: accelerate enables them only off CPU.
- `accelerator.optimizer_step_was_skipped` (and so accelerate's prepared schedulers and the
  transformers Trainer's scheduler) is True exactly on the steps the scaler skipped, fused optimizers
  included: accelerate infers a skip from whether the inner `optimizer.step()` ran, and a fused
  optimizer always runs and skips inside its kernel. Reading the flag costs one host sync per step for
  fused optimizers (none otherwise).
- `accelerator.load_state` leaves the scaler exactly as saved: torch's distributed-checkpoint loader
  makes an optimizer's state with a dummy `optimizer.step()`, which through a prepared optimizer
  would run `scaler.step` and `scaler.update` and move the scale just restored; while `load_state`
  runs, a prepared optimizer's step is the plain optimizer's.

At the end of training, `log_health(accelerator)` prints the scaler's health account on the main
process and logs its numbers to the accelerator's trackers.

Tested with accelerate 1.16.0, and 1.3.0 (the oldest release the extra allows), on CPU.
"""


from __future__ import annotations

from typing import Any

from . import _require

__all__ = ["attach", "log_health", "EngineScaler"]

_SKIP_AWARE_NAME = "SkipAwareAcceleratedOptimizer"
_ENGINE_SCALER = "_lossscale_engine_scaler"  # where attach() leaves the EngineScaler on a DeepSpeed accelerator


def attach(accelerator, scaler=None, **scaler_kwargs):
    """Make ``accelerator`` scale FP16 losses with a ``lossscale.GradScaler``; returns the scaler.

    Call it on an ``Accelerator(mixed_precision="fp16")`` before ``accelerator.prepare(...)``. On
    CUDA it replaces the torch ``GradScaler`` accelerate built; on CPU, where accelerate turns FP16
    off, it turns FP16 autocast and scaling on. After it, ``accelerator.backward`` scales,
    ``accelerator.clip_grad_norm_`` unscales before clipping, ``accelerator.optimizer_step_was_skipped``
    is True exactly on skipped steps (fused optimizers included) so accelerate's prepared schedulers
    do not advance then, and ``save_state``/``load_state`` carry the scaler's complete state.

    With accelerate's DeepSpeed plugin the engine scales the loss, and it exists only once ``prepare``
    built it: ``attach`` then returns an ``EngineScaler``, which becomes the scaler
    ``lossscale.integrations.deepspeed.attach`` installs in the engine when ``prepare`` returns (called
    after ``prepare``, it attaches at once). The loop is unchanged.

    Called again on the same accelerator, it returns the scaler the first call installed (at any
    time, before or after ``prepare``); given a different scaler or scaler keywords then, it raises
    ``ValueError``: a second scaler would leave the first, and whatever holds it, out of training.

    Args:
        accelerator: an ``accelerate.Accelerator`` built with ``mixed_precision="fp16"``.
        scaler: a ``lossscale.GradScaler``, or None to build one from ``scaler_kwargs`` (and from the
            accelerator's ``GradScalerKwargs`` handler, if one was given; ``scaler_kwargs`` win).
        **scaler_kwargs: ``lossscale.GradScaler`` arguments, only when ``scaler`` is None.
    """
    _require("accelerate")
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    from ..scaler import GradScaler

    if not isinstance(accelerator, Accelerator):
        raise ValueError(f"accelerator={accelerator!r} must be an accelerate.Accelerator.")
    if accelerator.mixed_precision != "fp16":
        # The autocast dtype comes from accelerate's process-wide state (utils/modeling.py:2066) and
        # unscaling happens only for "fp16" (accelerator.py:2852): neither can be switched afterwards.
        raise ValueError(
            f"accelerator.mixed_precision is {accelerator.mixed_precision!r}; build it with "
            'Accelerator(mixed_precision="fp16") (or `accelerate launch --mixed_precision fp16`) to use a '
            "loss scaler. bf16 needs none."
        )
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return _attach_deepspeed(accelerator, scaler, scaler_kwargs)
    if accelerator.distributed_type == DistributedType.MEGATRON_LM:
        raise ValueError("accelerator.distributed_type is MEGATRON_LM, whose engine scales the loss itself "
                         "(accelerator.py:539): give Megatron's optimizer lossscale.integrations.megatron.GradScaler.")
    attached = _attached(accelerator, scaler, scaler_kwargs)
    if attached is not None:
        return attached
    if _prepared(accelerator):
        raise RuntimeError("attach() was called after accelerator.prepare(...); call it right after "
                           "building the Accelerator, before prepare().")
    if scaler is None:
        handler = accelerator.scaler_handler  # GradScalerKwargs, read by accelerate at accelerator.py:549
        kwargs = dict(handler.to_kwargs()) if handler is not None else {}
        kwargs.update(scaler_kwargs)
        kwargs.setdefault("device", accelerator.device.type)
        scaler = GradScaler(**kwargs)
    elif scaler_kwargs:
        raise ValueError(f"pass either scaler= or GradScaler keywords ({', '.join(scaler_kwargs)}), not both.")
    elif not isinstance(scaler, GradScaler):
        raise ValueError(f"scaler={scaler!r} must be a lossscale.GradScaler (or None to build one).")

    # accelerator.py:534-548 sets these only off CPU; native_amp gates autocast in prepare_model
    # (1791) and unscaling in unscale_gradients (2852), scaler gates scaling in backward (2763).
    accelerator.scaler = scaler
    accelerator.native_amp = True
    accelerator.prepare_optimizer = _reporting_prepare_optimizer(accelerator.prepare_optimizer)
    accelerator.load_state = _scaler_keeping_load_state(accelerator.load_state, scaler)
    return scaler


class EngineScaler:
    """What ``attach`` returns on a DeepSpeed accelerator: the loss scaler
    ``lossscale.integrations.deepspeed.attach`` installs in the engine once ``accelerator.prepare(...)``
    has built it (a ``lossscale.GradScaler`` in torch_autocast mode; a
    ``lossscale.integrations.deepspeed.LossScaler`` in classic fp16 mode, accelerate's default for
    ``mixed_precision="fp16"``). Every attribute is that scaler's; before ``prepare()`` there is none
    yet, and reading one raises RuntimeError."""

    def __init__(self):
        self.target = None

    def __getattr__(self, name: str):
        target = self.__dict__.get("target")
        if target is None:
            raise RuntimeError(f"scaler.{name}: under DeepSpeed the loss scaler lives in the engine, which "
                               "accelerator.prepare(...) builds; use the scaler after prepare().")
        return getattr(target, name)

    def __repr__(self) -> str:
        return f"EngineScaler({self.target!r})"


def _attach_deepspeed(accelerator, scaler, scaler_kwargs):
    """accelerate with its DeepSpeed plugin: the engine, which scales the loss itself
    (accelerator.py:539), exists only once ``prepare()`` built it (``_prepare_deepspeed``), so the
    scaler is attached to it there, by ``lossscale.integrations.deepspeed.attach``; accelerate's
    ``backward`` is the engine's, its ``optimizer_step_was_skipped`` reads the engine's overflow, and
    ``save_state``/``load_state`` go through the engine's checkpoints, which carry the scaler."""
    from . import deepspeed as ls_deepspeed

    handle = accelerator.__dict__.get(_ENGINE_SCALER)
    if handle is not None:
        if scaler is None and not scaler_kwargs:
            return handle
        raise ValueError("a lossscale scaler is already attached to this accelerator (attach(accelerator) returns "
                         "it); pass scaler= or its keywords to the first attach().")
    handle = EngineScaler()
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if wrapped is not None:  # prepare() already ran: attach now
        handle.target = ls_deepspeed.attach(wrapped.engine, scaler, **scaler_kwargs)
    else:
        prepare = accelerator.prepare

        def prepare_then_attach(*args, **kwargs):
            out = prepare(*args, **kwargs)
            engine_wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
            if engine_wrapped is not None and handle.target is None:
                handle.target = ls_deepspeed.attach(engine_wrapped.engine, scaler, **scaler_kwargs)
            return out

        accelerator.prepare = prepare_then_attach
    accelerator.__dict__[_ENGINE_SCALER] = handle
    return handle


def log_health(accelerator, step=None):
    """Report the run's health at the end of training; returns the ``lossscale.health.HealthReport``.

    Prints its paragraph on the main process (``accelerator.print``) and logs its numbers, prefixed
    ``scaler/health/``, to the accelerator's trackers (``accelerator.log``, at ``step`` when given;
    nothing when there are none). One host sync (two with telemetry on). Call it on every process,
    after the training loop, on an accelerator that ``attach`` prepared.
    """
    _require("accelerate")
    from accelerate import Accelerator

    from .loggers import scalars

    scaler = _training_scaler(accelerator) if isinstance(accelerator, Accelerator) else None
    if scaler is None:
        raise ValueError(f"accelerator={accelerator!r} has no lossscale scaler: call "
                         "lossscale.integrations.accelerate.attach(accelerator) before prepare(...).")
    report = scaler.health()
    accelerator.print(report.text)
    accelerator.log(scalars(report.metrics(prefix=""), prefix="scaler/health/"), step=step)
    return report


def _training_scaler(accelerator):
    """The lossscale scaler ``accelerator`` trains with, or None: the one ``attach`` installed, or
    under DeepSpeed the one in the engine, once ``prepare()`` built it."""
    handle = accelerator.__dict__.get(_ENGINE_SCALER)
    if handle is not None:
        return handle.target
    return _attached(accelerator, None, {})


def _attached(accelerator, scaler, scaler_kwargs):
    """The scaler an earlier ``attach`` installed on ``accelerator`` (None: none did), if this call
    asks for nothing else; a ValueError if it asks for another scaler."""
    if not getattr(accelerator.prepare_optimizer, "_lossscale", False):
        return None
    if (scaler is None or scaler is accelerator.scaler) and not scaler_kwargs:
        return accelerator.scaler
    raise ValueError("a lossscale scaler is already attached to this accelerator (attach(accelerator) returns it); "
                     "a second one would leave the first, and whatever holds it, out of training. Pass scaler= or "
                     "its keywords to the first attach(), or build a new Accelerator.")


def _prepared(accelerator) -> bool:
    """Whether ``accelerator.prepare(...)`` has run: then attaching is too late. prepare() wraps the
    model's forward in autocast only if native_amp is already set (accelerator.py:1791) and hands each
    optimizer the scaler it finds then (accelerator.py:2690)."""
    return bool(accelerator._models or accelerator._optimizers)


def _reporting_prepare_optimizer(prepare_optimizer):
    """Wrap ``Accelerator.prepare_optimizer`` (accelerator.py:2653, the one place that builds an
    ``AcceleratedOptimizer``, at 2690) so each prepared optimizer reports skips from the scaler."""

    def wrapped(optimizer, device_placement=None):
        prepared = prepare_optimizer(optimizer, device_placement=device_placement)
        cls = _skip_aware_class()
        if type(prepared) is cls.__base__:
            prepared.__class__ = cls
        return prepared

    wrapped._lossscale = True
    wrapped.__doc__ = prepare_optimizer.__doc__
    return wrapped


# Scalers whose accelerator is inside load_state(): a prepared optimizer's step() then is a checkpoint
# loader's dummy step, not training (see the module docstring). Keyed by id: a scaler need not hash.
_LOADING: set = set()


def _scaler_keeping_load_state(load_state, scaler):
    """Wrap ``Accelerator.load_state`` so that no step of a prepared optimizer reaches ``scaler`` while
    it runs (the module docstring says why)."""

    def wrapped(*args: Any, **kwargs: Any):
        _LOADING.add(id(scaler))
        try:
            return load_state(*args, **kwargs)
        finally:
            _LOADING.discard(id(scaler))

    wrapped.__doc__ = load_state.__doc__
    return wrapped


def _skip_aware_class():
    """``AcceleratedOptimizer`` whose ``step_was_skipped`` comes from the scaler (built once, lazily)."""
    cls = globals().get(_SKIP_AWARE_NAME)
    if cls is not None:
        return cls
    _require("accelerate")
    from accelerate.optimizer import AcceleratedOptimizer

    from ..scaler import GradScaler

    class SkipAwareAcceleratedOptimizer(AcceleratedOptimizer):
        """accelerate's optimizer wrapper, reporting skipped steps as the lossscale scaler decided them."""

        def step(self, *args: Any, **kwargs: Any):
            """accelerate's step, then ``step_was_skipped`` from the scaler (see the module docstring)."""
            if id(self.scaler) in _LOADING:
                # A checkpoint loader's dummy step (zero gradients, lr 0): the plain optimizer's, as
                # accelerate >= 1.16 hands torch's loader (utils/fsdp_utils.py, _unwrap_optimizer).
                return self.optimizer.step(*args, **kwargs)
            out = super().step(*args, **kwargs)
            # optimizer.py:176-179 infers a skip from whether the inner step() ran; a fused optimizer
            # always runs and skips in its kernel. The scaler knows (one host sync for fused, cached).
            if isinstance(self.scaler, GradScaler) and self.gradient_state.sync_gradients:
                self._is_overflow = self.scaler.last_step_skipped
            return out

    SkipAwareAcceleratedOptimizer.__module__ = __name__
    SkipAwareAcceleratedOptimizer.__qualname__ = _SKIP_AWARE_NAME
    globals()[_SKIP_AWARE_NAME] = SkipAwareAcceleratedOptimizer
    return SkipAwareAcceleratedOptimizer


def __getattr__(name: str):
    # Pickle finds the class by name; build it on first lookup (importing accelerate then, not before).
    if name == _SKIP_AWARE_NAME:
        return _skip_aware_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
