"""Lightning: FP16 precision plugins with a ``lossscale.GradScaler``, for ``Trainer`` and ``Fabric``.

::

    from lossscale.integrations.lightning import MixedPrecision, FabricMixedPrecision
    trainer = lightning.Trainer(plugins=[MixedPrecision()])        # no precision= argument
    fabric = lightning.Fabric(plugins=[FabricMixedPrecision()])

They are Lightning's own ``MixedPrecision`` plugins (lightning 2.x; line numbers are lightning
2.6.6's) with ``precision="16-mixed"`` and a lossscale scaler, plus:

* FP16 autocast on CPU too: ``Trainer(accelerator="cpu", precision="16-mixed")`` silently becomes
  bf16 without a scaler (pytorch/trainer/connectors/accelerator_connector.py:478-483). ``device``
  defaults to "cuda" when CUDA is available, else "cpu"; a loss on another device type raises
  (autocast on the wrong device type is a silent no-op).
* ``Trainer``: LR schedulers with ``interval="step"`` do not advance on skipped steps. Lightning
  steps them after every optimizer step (pytorch/loops/training_epoch_loop.py:484-486;
  Lightning-AI/pytorch-lightning#5558 was closed as "won't fix"); the plugin makes them
  :func:`lossscale.schedulers.skip_aware` (one host sync per step for fused optimizers, none
  otherwise). Epoch-interval schedulers step as before.
* ``Trainer``: ``scaler.metrics()`` go to the module's loggers (``scaler/...``) at the Trainer's
  logging steps only (``log_every_n_steps``), so reading them costs one sync per logged step.
* Checkpoints: the plugin's state is the scaler's ``state_dict()``, saved under the key
  "MixedPrecision" as Lightning's own plugin does; either plugin loads the other's checkpoints.
  With Fabric, put the scaler in the state you save: ``fabric.save(path, {..., "scaler": plugin.scaler})``.

Fabric steps no schedulers itself: wrap yours with ``lossscale.schedulers.skip_aware(scheduler,
plugin.scaler)``, and log ``plugin.scaler.metrics()`` with ``fabric.log_dict``.

The classes are built on first access, so importing this module does not import Lightning.
Tested with lightning 2.6.6 on CPU; see docs/integrations.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MixedPrecision", "FabricMixedPrecision"]

_BUILDERS = {}


def _device_type(device) -> str:
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device={device!r} must be None, a device type such as 'cpu'/'cuda', or a torch.device.")
    return torch.device(device).type


def _scaler(scaler, scaler_kwargs):
    from ..scaler import GradScaler

    if scaler is None:
        return GradScaler(**scaler_kwargs)
    if scaler_kwargs:
        raise ValueError(f"pass either scaler= or GradScaler keywords ({', '.join(scaler_kwargs)}), not both.")
    if not isinstance(scaler, GradScaler):
        raise ValueError(f"scaler={scaler!r} must be a lossscale.GradScaler (or None to build one).")
    return scaler


def _check_device(device_type: str, tensor) -> None:
    if tensor.device.type != device_type:
        raise ValueError(f"the loss is on {tensor.device} but the plugin autocasts on {device_type!r}, so the "
                         f"forward did not run in FP16; pass device={tensor.device.type!r} to the plugin.")


def _builder(name):
    def register(fn):
        _BUILDERS[name] = fn
        return fn

    return register


@_builder("MixedPrecision")
def _trainer_plugin():
    from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision

    from ..schedulers import is_skip_aware, skip_aware

    class MixedPrecision(LightningMixedPrecision):
        """``lightning.Trainer`` plugin: FP16 autocast (CPU too) with a ``lossscale.GradScaler``.

        Args:
            scaler: a ``lossscale.GradScaler``, or None to build one from ``scaler_kwargs``.
            device: the autocast device type; None: "cuda" if available, else "cpu".
            **scaler_kwargs: ``lossscale.GradScaler`` arguments, only when ``scaler`` is None.

        Interval-"step" LR schedulers do not advance on skipped steps, and the scaler's metrics go to
        the module's loggers at logging steps. See :mod:`lossscale.integrations.lightning`.
        """

        def __init__(self, scaler=None, device=None, **scaler_kwargs: Any) -> None:
            super().__init__("16-mixed", _device_type(device), scaler=_scaler(scaler, scaler_kwargs))

        def pre_backward(self, tensor, module):
            """Check the loss's device, then scale it (Lightning's own pre_backward)."""
            _check_device(self.device, tensor)
            return super().pre_backward(tensor, module)

        def optimizer_step(self, optimizer, model, closure, **kwargs: Any):
            """Lightning's step (closure, unscale, step, update), with skip-aware schedulers and logging."""
            trainer = model.trainer
            for config in trainer.lr_scheduler_configs:
                # training_epoch_loop.py:486 steps interval-"step" schedulers after every optimizer
                # step, skipped or not; before the first one this wraps them (same objects).
                if config.interval == "step" and not is_skip_aware(config.scheduler):
                    skip_aware(config.scheduler, self.scaler)
            out = super().optimizer_step(optimizer, model, closure, **kwargs)
            # logger_connector.py:51 decides whether this batch's on-step values reach the loggers; read
            # the scaler (a sync) only then.
            if trainer.loggers and trainer._logger_connector.should_update_logs:
                figures = {f"scaler/{k}": float(v) for k, v in self.scaler.metrics().items()}
                model.log_dict(figures, on_step=True, on_epoch=False, batch_size=1)
            return out

    return MixedPrecision


@_builder("FabricMixedPrecision")
def _fabric_plugin():
    from lightning.fabric.plugins.precision import MixedPrecision as FabricBase

    class FabricMixedPrecision(FabricBase):
        """``lightning.Fabric`` plugin: FP16 autocast (CPU too) with a ``lossscale.GradScaler``.

        Args:
            scaler: a ``lossscale.GradScaler``, or None to build one from ``scaler_kwargs``.
            device: the autocast device type; None: "cuda" if available, else "cpu".
            **scaler_kwargs: ``lossscale.GradScaler`` arguments, only when ``scaler`` is None.

        Wrap LR schedulers with ``lossscale.schedulers.skip_aware(scheduler, plugin.scaler)``; save
        ``plugin.scaler`` in ``fabric.save`` states. See :mod:`lossscale.integrations.lightning`.
        """

        def __init__(self, scaler=None, device=None, **scaler_kwargs: Any) -> None:
            super().__init__("16-mixed", _device_type(device), scaler=_scaler(scaler, scaler_kwargs))

        def backward(self, tensor, model, *args: Any, **kwargs: Any) -> None:
            """Check the loss's device, then scale and backpropagate (Fabric's own backward)."""
            _check_device(self.device, tensor)
            super().backward(tensor, model, *args, **kwargs)

    return FabricMixedPrecision


def __getattr__(name: str):
    build = _BUILDERS.get(name)
    if build is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = build()
    # Lightning keys the plugin's checkpoint entry by __qualname__ (checkpoint_connector.py:479 and 315):
    # "MixedPrecision", as its own plugin's, not "_trainer_plugin.<locals>.MixedPrecision".
    cls.__module__, cls.__qualname__ = __name__, name
    globals()[name] = cls  # built once; pickle finds it by name
    return cls


def __dir__():
    return sorted(set(globals()) | set(_BUILDERS))
