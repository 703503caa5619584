"""lossscale inside training frameworks: a few lines each, imported only when used.

* :mod:`lossscale.integrations.accelerate`: ``attach(accelerator)`` (HF accelerate).
* :mod:`lossscale.integrations.transformers`: ``attach(trainer)`` (HF transformers ``Trainer``).
* :mod:`lossscale.integrations.lightning`: ``MixedPrecision()`` (``lightning.Trainer``) and
  ``FabricMixedPrecision()`` (``lightning.Fabric``) precision plugins.
* :mod:`lossscale.integrations.loggers`: ``log_tensorboard(writer, scaler, step)``.
* :mod:`lossscale.integrations.deepspeed`: ``attach(engine)`` (a ``DeepSpeedEngine``, torch_autocast or
  classic fp16, ZeRO-0 to 3) and ``log_health(engine)``.
* :mod:`lossscale.integrations.megatron`: ``GradScaler(...)``, a Megatron-core ``MegatronGradScaler``,
  and ``attach(optimizer)``.

Importing this package, or any of its modules, imports no framework: each framework is imported by
the function or class that needs it. See docs/integrations.md for what each integration changes in
its framework's behaviour and the versions tested. A framework that is not installed is named
with the extra that installs it.
"""

import importlib

__all__ = ["accelerate", "transformers", "lightning", "loggers", "deepspeed", "megatron"]


def _require(framework: str) -> None:
    """Import ``framework`` (a top-level package name), or raise ``ModuleNotFoundError`` (as the bare
    import would, so ``except ImportError`` still works) saying which extra installs it."""
    try:
        importlib.import_module(framework)
    except ModuleNotFoundError as error:
        if error.name != framework:
            raise  # the framework is there but something it imports is not: its own message says what
        raise ModuleNotFoundError(
            f'lossscale.integrations needs {framework}, which is not installed: pip install "lossscale[integrations]" '
            f"(the frameworks lossscale integrates with, at tested versions), or pip install {framework}.",
            name=framework,
        ) from error
