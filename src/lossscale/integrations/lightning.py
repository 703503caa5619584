"""Lightning: FP16 precision plugins with a `lossscale.GradScaler`, for `Trainer` and `Fabric`.

```python
from lossscale.integrations.lightning import MixedPrecision, FabricMixedPrecision
trainer = lightning.Trainer(plugins=[MixedPrecision()])        # no precision= argument
fabric = lightning.Fabric(plugins=[FabricMixedPrecision()])
```

Both classes are built on first access (they subclass Lightning's own `MixedPrecision` plugins, and
importing this module must not import Lightning):

``MixedPrecision(scaler=None, device=None, *, precision="16-mixed", **scaler_kwargs)``
: The `lightning.Trainer` plugin. `scaler`: a `lossscale.GradScaler`, or None to build one from
  `scaler_kwargs` (`GradScaler` arguments). `device`: the autocast device type; None: "cuda" if
  available, else "cpu". `precision`: "16-mixed" only (the plugin is FP16); anything else raises
  `ValueError` saying what to use instead. Given to `Fabric`, it raises `RuntimeError`.

``FabricMixedPrecision(scaler=None, device=None, *, precision="16-mixed", **scaler_kwargs)``
: The `lightning.Fabric` plugin, with the same arguments. `plugin.scaler` is its scaler.

What they change in Lightning (2.x):

- FP16 autocast on CPU too: `Trainer(accelerator="cpu", precision="16-mixed")` silently becomes bf16
  without a scaler. A loss on another device type than the plugin's raises (autocast on the wrong
  device type does nothing).
- `Trainer`: LR schedulers with `interval="step"` do not advance on skipped steps. Lightning steps
  them after every optimizer step; before the first step the plugin makes them
  `lossscale.schedulers.skip_aware` (one host sync per step for fused optimizers, none otherwise).
  Epoch-interval schedulers step as before.
- `Trainer`: `scaler.metrics()` go to the module's loggers (`scaler/...`) at the Trainer's logging steps
  only (`log_every_n_steps`), so reading them costs one sync per logged step.
- `Trainer`: at the end of fit, `scaler.health()`: its numbers to the loggers (`scaler/health/...`) and
  its paragraph to Lightning's console log (info when healthy, a warning otherwise).
- Checkpoints: the plugin's state is the scaler's `state_dict()`, saved under the key
  "MixedPrecision" as Lightning's own plugin does; either plugin loads the other's checkpoints. With
  Fabric, put the scaler in the state you save: `fabric.save(path, {..., "scaler": plugin.scaler})`.

Fabric steps no schedulers itself: wrap yours with `lossscale.schedulers.skip_aware(scheduler,
plugin.scaler)`, log `plugin.scaler.metrics()` with `fabric.log_dict`, and at the end
`fabric.print(plugin.scaler.health())`.

Tested with lightning 2.6.6, and 2.4.0 (the oldest release the extra allows), on CPU.
"""


from __future__ import annotations

import weakref
from typing import Any

from . import _require

__all__ = ["MixedPrecision", "FabricMixedPrecision"]

_BUILDERS = {}
_FP16 = "16-mixed"  # the one precision the plugins run


def _device_type(device) -> str:
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device={device!r} must be None, a device type such as 'cpu'/'cuda', or a torch.device.")
    return torch.device(device).type


def _check_precision(precision, argument: str = "precision") -> None:
    """Refuse any precision but FP16 mixed, saying what to use instead."""
    if precision == _FP16:
        return
    if "bf16" in str(precision):
        advice = ("bf16 needs no loss scaling: use Lightning's own precision='bf16-mixed' without this plugin. To "
                  "also skip steps whose gradients hold inf/NaN, drive a lossscale.GradScaler.passthrough() "
                  "yourself (scale, step, update; with Fabric or manual optimization).")
    else:
        advice = f"For another precision, pass precision={precision!r} to Lightning without this plugin."
    raise ValueError(f"{argument}={precision!r}: this plugin is FP16 only ({_FP16!r}, with a loss scaler). {advice}")


def _plugin_args(scaler, device, precision, scaler_kwargs):
    """Lightning's ``MixedPrecision(precision, device, scaler=)`` arguments for either plugin."""
    from ..scaler import GradScaler

    _check_precision(precision)
    if isinstance(scaler, str):
        # Lightning's own plugin takes (precision, device): MixedPrecision("16-mixed", "cuda").
        _check_precision(scaler, argument="scaler")
        raise ValueError(f"scaler={scaler!r} is a precision: this plugin's first argument is scaler=, and its "
                         f"precision is always {_FP16!r}; drop it.")
    if scaler is None:
        scaler = GradScaler(**scaler_kwargs)
    elif scaler_kwargs:
        raise ValueError(f"pass either scaler= or GradScaler keywords ({', '.join(scaler_kwargs)}), not both.")
    elif not isinstance(scaler, GradScaler):
        raise ValueError(f"scaler={scaler!r} must be a lossscale.GradScaler (or None to build one).")
    return _FP16, _device_type(device), scaler


def _check_trainer(module) -> None:
    """Refuse Fabric. The Trainer's plugin runs on a LightningModule attached to a Trainer
    (pytorch/core/module.py:137 is that link); Fabric hands it the user's module, or None
    (fabric/strategies/strategy.py:191), and Lightning's pre_backward then fails on ``module.trainer``."""
    if getattr(module, "_trainer", None) is None:
        raise RuntimeError("lossscale.integrations.lightning.MixedPrecision is the Trainer's plugin; use "
                           "FabricMixedPrecision with Fabric: lightning.Fabric(plugins=[FabricMixedPrecision()]).")


def _check_device(device_type: str, tensor) -> None:
    if tensor.device.type != device_type:
        raise ValueError(f"the loss is on {tensor.device} but the plugin autocasts on {device_type!r}, so the "
                         f"forward did not run in FP16; pass device={tensor.device.type!r} to the plugin.")


def _log_health(trainer, scaler) -> None:
    """``scaler.health()`` at the end of fit: its numbers to the Trainer's loggers, its paragraph to
    Lightning's console log (info when healthy, a warning otherwise)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

    from .loggers import scalars

    report = scaler.health()
    figures = scalars(report.metrics(prefix=""), prefix="scaler/health/")
    for logger in trainer.loggers:
        logger.log_metrics(figures, step=trainer.global_step)  # rank zero only (logger.py's decorator)
    (rank_zero_info if report.verdict == "healthy" else rank_zero_warn)(report.text)


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
            precision: "16-mixed" only (the plugin is FP16); any other raises ``ValueError`` saying
                what to use instead.
            **scaler_kwargs: ``lossscale.GradScaler`` arguments, only when ``scaler`` is None.

        Interval-"step" LR schedulers do not advance on skipped steps, the scaler's metrics go to
        the module's loggers at logging steps, and its health account is logged at the end of fit.
        Given to ``Fabric``, it raises ``RuntimeError``: use ``FabricMixedPrecision`` there. See
        ``lossscale.integrations.lightning``.
        """

        def __init__(self, scaler=None, device=None, *, precision: str = _FP16, **scaler_kwargs: Any) -> None:
            super().__init__(*_plugin_args(scaler, device, precision, scaler_kwargs))
            self._fitting = None  # the Trainer whose fit stepped the optimizer (weakly), until teardown

        def convert_module(self, module):
            """Refuse Fabric (whose setup() calls this first), then Lightning's own convert_module."""
            _check_trainer(module)
            return super().convert_module(module)

        def pre_backward(self, tensor, module):
            """Check the loss's device, then scale it (Lightning's own pre_backward)."""
            _check_device(self.device, tensor)
            _check_trainer(module)
            return super().pre_backward(tensor, module)

        def optimizer_step(self, optimizer, model, closure, **kwargs: Any):
            """Lightning's step (closure, unscale, step, update), with skip-aware schedulers and logging."""
            trainer = model.trainer
            self._fitting = weakref.ref(trainer)
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

        def teardown(self) -> None:
            """Log the scaler's health after a fit that stepped (strategy.py:537 calls this when a
            stage ends, before the loggers are finalized), then Lightning's own teardown."""
            trainer, self._fitting = (None if self._fitting is None else self._fitting()), None
            if trainer is not None:
                _log_health(trainer, self.scaler)
            super().teardown()

    return MixedPrecision


@_builder("FabricMixedPrecision")
def _fabric_plugin():
    from lightning.fabric.plugins.precision import MixedPrecision as FabricBase

    class FabricMixedPrecision(FabricBase):
        """``lightning.Fabric`` plugin: FP16 autocast (CPU too) with a ``lossscale.GradScaler``.

        Args:
            scaler: a ``lossscale.GradScaler``, or None to build one from ``scaler_kwargs``.
            device: the autocast device type; None: "cuda" if available, else "cpu".
            precision: "16-mixed" only (the plugin is FP16); any other raises ``ValueError`` saying
                what to use instead.
            **scaler_kwargs: ``lossscale.GradScaler`` arguments, only when ``scaler`` is None.

        Wrap LR schedulers with ``lossscale.schedulers.skip_aware(scheduler, plugin.scaler)``; save
        ``plugin.scaler`` in ``fabric.save`` states. See ``lossscale.integrations.lightning``.
        """

        def __init__(self, scaler=None, device=None, *, precision: str = _FP16, **scaler_kwargs: Any) -> None:
            super().__init__(*_plugin_args(scaler, device, precision, scaler_kwargs))

        def backward(self, tensor, model, *args: Any, **kwargs: Any) -> None:
            """Check the loss's device, then scale and backpropagate (Fabric's own backward)."""
            _check_device(self.device, tensor)
            super().backward(tensor, model, *args, **kwargs)

    return FabricMixedPrecision


def __getattr__(name: str):
    build = _BUILDERS.get(name)
    if build is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _require("lightning")
    cls = build()
    # Lightning keys the plugin's checkpoint entry by __qualname__ (checkpoint_connector.py:479 and 315):
    # "MixedPrecision", as its own plugin's, not "_trainer_plugin.<locals>.MixedPrecision".
    cls.__module__, cls.__qualname__ = __name__, name
    globals()[name] = cls  # built once; pickle finds it by name
    return cls


def __dir__():
    return sorted(set(globals()) | set(_BUILDERS))
