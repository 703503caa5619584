"""What ``GradScaler.scale`` accepts: a tensor, or lists, tuples (named ones too) and dicts of them.

The structure is checked whole before anything is scaled, so a failed call leaves no trace (no loss
remembered as checked, no state created). Other iterables are scaled lazily, as torch does.
"""

from __future__ import annotations

import copy
from collections import abc
from typing import Any, Callable

import torch

__all__ = ["refuse_unscalable", "map_tensors"]


def refuse_unscalable(outputs: Any) -> None:
    """ValueError for what cannot be scaled: a value that is not a tensor or a list, tuple or dict of
    them (other iterables are checked as they are consumed), or a tensor on the meta device (it holds
    no values: the scale would have to live there too, and no later step could read it)."""
    if isinstance(outputs, torch.Tensor):
        if outputs.device.type == "meta":
            raise ValueError("scale() got a tensor on the meta device, which holds no values; scale the loss of a "
                             "real forward (the scaler's state lives on the loss's device).")
        return
    if isinstance(outputs, dict):
        values = outputs.values()
    elif isinstance(outputs, (list, tuple)):
        values = outputs
    elif isinstance(outputs, abc.Iterable) and not isinstance(outputs, (str, bytes)):
        return
    else:
        raise ValueError(
            f"scale() takes a tensor or (nested) lists, tuples or dicts of tensors, got {type(outputs).__name__}."
        )
    for value in values:
        refuse_unscalable(value)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor, keeping the containers' types (a named tuple stays
    one, a defaultdict keeps its factory); other iterables come back as a lazy ``map``, as in torch."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        out = copy.copy(value)  # keeps the mapping's type (a defaultdict keeps its factory)
        for k, v in value.items():
            out[k] = map_tensors(fn, v)
        return out
    if isinstance(value, (list, tuple)):
        mapped = [map_tensors(fn, v) for v in value]
        return type(value)(*mapped) if hasattr(value, "_fields") else type(value)(mapped)
    if isinstance(value, abc.Iterable) and not isinstance(value, (str, bytes)):
        return map(lambda v: map_tensors(fn, v), value)
    raise ValueError(f"scale() takes a tensor or (nested) lists, tuples or dicts of tensors, got {type(value).__name__}.")
