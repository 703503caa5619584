"""lossscale inside training frameworks: a few lines each, imported only when used.

- `lossscale.integrations.accelerate`: `attach(accelerator)` (Hugging Face accelerate).
- `lossscale.integrations.transformers`: `attach(trainer)` (the Hugging Face transformers `Trainer`).
- `lossscale.integrations.lightning`: the `MixedPrecision()` (`lightning.Trainer`) and
  `FabricMixedPrecision()` (`lightning.Fabric`) precision plugins.
- `lossscale.integrations.deepspeed`: `attach(engine)` (a `DeepSpeedEngine`, torch_autocast or classic
  fp16, ZeRO-0 to 3) and `log_health(engine)`.
- `lossscale.integrations.megatron`: `GradScaler(...)`, a Megatron-core `MegatronGradScaler`, and
  `attach(optimizer)`.
- `lossscale.integrations.verl`: `attach(engine)` (verl's FSDP training engines; verl is in no extra:
  `pip install verl`).
- `lossscale.integrations.torchtitan`: `attach(trainer)` (a torchtitan `Trainer` in FP16; torchtitan is in
  no extra: `pip install torchtitan`).
- `lossscale.integrations.loggers`: `log_tensorboard(writer, scaler, step)`.

Importing this package, or any of its modules, imports no framework: each framework is imported by
the function or class that needs it. A framework that is not installed is named with the extra that
installs it (`pip install ".[integrations]"` in a lossscale checkout). What each integration changes in its framework,
and the versions tested: the how-to guides and the Compatibility page of the documentation.
"""

import importlib

__all__ = ["accelerate", "transformers", "lightning", "loggers", "deepspeed", "megatron", "verl", "torchtitan"]


def _require(framework: str) -> None:
    """Import ``framework`` (a top-level package name), or raise ``ModuleNotFoundError`` (as the bare
    import would, so ``except ImportError`` still works) saying which extra installs it."""
    try:
        importlib.import_module(framework)
    except ModuleNotFoundError as error:
        if error.name != framework:
            raise  # the framework is there but something it imports is not: its own message says what
        raise ModuleNotFoundError(
            f"lossscale.integrations needs {framework}, which is not installed: pip install {framework}, or, in a "
            'lossscale checkout, pip install -c constraints.txt -e ".[integrations]" (the frameworks lossscale '
            "integrates with, at tested versions).",
            name=framework,
        ) from error
