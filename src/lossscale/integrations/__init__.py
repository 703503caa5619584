"""lossscale inside training frameworks: a few lines each, imported only when used.

* :mod:`lossscale.integrations.accelerate`: ``attach(accelerator)`` (HF accelerate).
* :mod:`lossscale.integrations.transformers`: ``attach(trainer)`` (HF transformers ``Trainer``).
* :mod:`lossscale.integrations.lightning`: ``MixedPrecision()`` (``lightning.Trainer``) and
  ``FabricMixedPrecision()`` (``lightning.Fabric``) precision plugins.
* :mod:`lossscale.integrations.loggers`: ``log_tensorboard(writer, scaler, step)``.

Importing this package, or any of its modules, imports no framework: each framework is imported by
the function or class that needs it. See docs/integrations.md for what each integration changes in
its framework's behaviour and the versions tested.
"""

__all__ = ["accelerate", "transformers", "lightning", "loggers"]
