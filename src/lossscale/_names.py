"""Parameter names for reports and error messages: ``model=`` or :meth:`GradScaler.name_parameters`.

Names are kept by ``id(param)`` (fast, per step) with a weak reference that tells a reused id from
the parameter itself, and also on the parameter as the attribute ``_lossscale_name``, so they survive
pickling or deep-copying the model and the scaler, together or apart. Pickling the names pickles no
parameter: ids mean nothing elsewhere, and a copied parameter carries its name.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Optional, Tuple

import torch

__all__ = ["ParamNames"]


class ParamNames:
    """``param -> name`` for the parameters it was given."""

    def __init__(self):
        self._names: Dict[int, Tuple[weakref.ref, str]] = {}

    def add(self, model_or_named_parameters: Any) -> None:
        """Learn the names of an ``nn.Module``'s parameters, or of ``(name, param)`` pairs."""
        named = (
            model_or_named_parameters.named_parameters()
            if isinstance(model_or_named_parameters, torch.nn.Module)
            else model_or_named_parameters
        )
        try:
            pairs = [(str(n), p) for n, p in named]
        except (TypeError, ValueError):
            raise ValueError("model must be an nn.Module or an iterable of (name, parameter) pairs.") from None
        bad = [n for n, p in pairs if not isinstance(p, torch.Tensor)]
        if bad:
            raise ValueError(
                f"model: {bad[0]!r} is paired with a {type(dict(pairs)[bad[0]]).__name__}, not a "
                "parameter; pass an nn.Module or (name, parameter) pairs."
            )
        for name, param in pairs:
            self._remember(param, name)

    def _remember(self, param: torch.Tensor, name: str) -> None:
        self._names[id(param)] = (weakref.ref(param), name)
        try:
            param._lossscale_name = name  # travels with the parameter through pickle and torch.save
        except (AttributeError, TypeError):  # a tensor type without a __dict__: the id map still names it
            pass

    def __call__(self, param) -> Optional[str]:
        """The name of ``param``, or None."""
        entry = self._names.get(id(param))
        if entry is not None and entry[0]() is param:
            return entry[1]
        return getattr(param, "_lossscale_name", None)  # a parameter named, then pickled (a new id)

    def __getstate__(self) -> Dict[str, Any]:
        return {"_names": {}}  # ids mean nothing elsewhere; each named parameter carries its name

    def __deepcopy__(self, memo: Dict[int, Any]) -> "ParamNames":
        # torch's Parameter.__deepcopy__ drops attributes: name the copies of our parameters that were
        # deep-copied before us (memo maps id(original) -> copy), and keep naming the originals.
        twin = ParamNames()
        for key, (ref, name) in self._names.items():
            param = ref()
            if param is not None:
                twin._names[key] = (ref, name)
                copied = memo.get(id(param))
                if isinstance(copied, torch.Tensor):
                    twin._remember(copied, name)
        return twin
