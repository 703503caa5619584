"""Scaler metrics into loggers: TensorBoard in one call; anything dict-shaped takes `metrics()` as is.

```python
writer = torch.utils.tensorboard.SummaryWriter("runs/exp")
lossscale.integrations.loggers.log_tensorboard(writer, scaler, step)   # every logging step
wandb.log(scaler.metrics(), step=step)                                 # W&B, MLflow, ...: a flat dict
```

`scaler.metrics()` holds numbers only (int, float, bool); text such as what the gradient figures
measured is in `scaler.metric_labels()`. Reading the metrics syncs host and device once, so log them
every N steps, not every step.
"""


from __future__ import annotations

import numbers
from typing import Dict, Mapping, Union

__all__ = ["log_tensorboard", "scalars"]


def scalars(metrics: Mapping[str, object], prefix: str = "scaler/") -> Dict[str, float]:
    """``{prefix + key: float(value)}`` for a metrics dict; ValueError names a value that is not a number."""
    out = {}
    for key, value in metrics.items():
        # bool is an int: True/False become 1.0/0.0, as a scalar plot wants them.
        if not isinstance(value, numbers.Real):
            raise ValueError(f"metric {key!r} is {value!r}, not a number; scalar loggers take int, float or "
                             "bool (a scaler's text labels are in scaler.metric_labels()).")
        out[prefix + key] = float(value)
    return out


def log_tensorboard(writer, scaler_or_metrics: Union[object, Mapping[str, object]], step: int,
                    prefix: str = "scaler/") -> Dict[str, float]:
    """Write every metric as a scalar to a TensorBoard ``SummaryWriter``; returns what was written.

    Args:
        writer: a ``torch.utils.tensorboard.SummaryWriter`` (or anything with ``add_scalar``).
        scaler_or_metrics: a ``lossscale.GradScaler`` (its ``metrics()`` are read: one host sync) or
            a metrics dict.
        step: the global step to record.
        prefix: put before every key ("scaler/loss_scale", "scaler/grad/amax", ...).
    """
    if not callable(getattr(writer, "add_scalar", None)):
        raise ValueError(f"writer={writer!r} has no add_scalar(); pass a torch.utils.tensorboard.SummaryWriter.")
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise ValueError(f"step={step!r} must be an int (the global step).")
    if isinstance(scaler_or_metrics, Mapping):
        metrics = scaler_or_metrics
    elif callable(getattr(scaler_or_metrics, "metrics", None)):
        metrics = scaler_or_metrics.metrics()
    else:
        raise ValueError(f"scaler_or_metrics={scaler_or_metrics!r} must be a lossscale.GradScaler or a dict "
                         "of metrics.")
    values = scalars(metrics, prefix)
    for tag, value in values.items():
        writer.add_scalar(tag, value, int(step))
    return values
