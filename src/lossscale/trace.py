"""Where a non-finite value first appeared: the first module in execution order whose forward output,
and the first in backward order whose gradient, held inf or NaN. On device, without a host sync.

By the time the scaler checks the parameter gradients, a NaN has spread backward through every layer
below its source, so ``overflow_report()`` names them all. A :class:`Tracer` hooks every leaf module
and keeps, per hook call, one boolean on device ("this output was non-finite"); at the end of the
forward (the scaler's ``scale(loss)``) and of the backward (its check) the booleans are stacked and
the first ``True`` is found with tensor ops, so the per-module cost is two small kernels
(``isfinite(x).all()``) and a list append. Nothing is read on the host until ``overflow_report()``.

Host syncs: none while training; one when a report is read.

Usage (``GradScaler(model=model, trace=True)`` does this for you)::

    tracer = Tracer(model)
    ...forward...
    tracer.end_forward()          # stacks the forward flags (no sync)
    ...backward...
    tracer.end_backward()
    tracer.first()                # {"forward": "encoder.3.attn" or None, "backward": ...}  (syncs)
    tracer.close()                # removes every hook (also: ``with Tracer(model) as t:``)
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

__all__ = ["Tracer"]


def _tensors(value) -> List[torch.Tensor]:
    """The floating-point tensors in a module's output / gradient tuple (nested one level)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _bad(tensors: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """A bool 0-dim tensor: any of ``tensors`` holds inf or NaN (None when there is nothing to check)."""
    out = None
    for t in tensors:
        if t.numel():
            bad = ~torch.isfinite(t.detach()).all()
            out = bad if out is None else out | bad
    return out


#: A pass's events are coded ``order * _SLOTS + module_index`` so one ``min`` finds the first in call
#: order and says which module it was; ``_NONE`` marks "finite".
_SLOTS = 2**20
_NONE = 2**62


class _Pass:
    """One direction's events for the current iteration, as int64 codes on device."""

    def __init__(self):
        self.codes: List[torch.Tensor] = []
        self.first: Optional[torch.Tensor] = None  # int64 0-dim: module index, or -1

    def add(self, index: int, flag: Optional[torch.Tensor]) -> None:
        if flag is not None:
            # A where() with Python scalars: no host-to-device copy, no sync.
            self.codes.append(torch.where(flag, len(self.codes) * _SLOTS + index, _NONE))

    def close(self) -> None:
        """Fold this pass's events into ``first`` (the first flagged module over the iteration's passes)."""
        if not self.codes:
            return
        device = self.codes[0].device
        low = torch.stack([c.to(device) for c in self.codes]).min()
        found = torch.where(low < _NONE, low % _SLOTS, -1)
        self.first = found if self.first is None else torch.where(self.first >= 0, self.first, found)
        self.codes = []


class Tracer:
    """Hooks on every leaf module of ``model`` that find the first non-finite forward output and the
    first module whose backward produced a non-finite gradient.

    Forward: a forward hook checks each leaf's output. Backward: a tensor hook on each leaf's inputs
    sees the gradient *its* backward computed (a module hook would wrap outputs and break in-place
    ops such as ``ReLU(inplace=True)``). The gradient of the loss itself is not a module's: a
    non-finite loss shows as the last module in backward order, and the scaler's loss check names it.

    Args:
        model: the ``nn.Module`` to watch; names come from ``named_modules()``.
    """

    def __init__(self, model: torch.nn.Module):
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"trace=True needs model= to be an nn.Module, got {type(model).__name__}.")
        self.names: List[str] = []
        self._handles = []
        self._fwd, self._bwd = _Pass(), _Pass()
        for name, module in model.named_modules():
            if next(module.children(), None) is not None:
                continue  # leaves only: a container's output is its last leaf's
            index = len(self.names)
            if index >= _SLOTS:
                raise ValueError(f"trace=True supports up to {_SLOTS} leaf modules.")
            self.names.append(name or type(module).__name__)
            self._handles.append(module.register_forward_pre_hook(self._inputs_hook(index)))
            self._handles.append(module.register_forward_hook(self._outputs_hook(index)))

    def _inputs_hook(self, index: int):
        # Before the module runs: an in-place module (ReLU(inplace=True)) has not yet changed its
        # input, so the tensor hook sees the gradient of the input this module received.
        def hook(module, args):
            if torch.is_grad_enabled():
                for x in _tensors(args):
                    if x.requires_grad:
                        x.register_hook(lambda g, i=index: self._bwd.add(i, _bad([g])))
        return hook

    def _outputs_hook(self, index: int):
        def hook(module, args, output):
            self._fwd.add(index, _bad(_tensors(output)))
        return hook

    # ---------------------------------------------------------------------------------- iteration
    def end_forward(self) -> None:
        """Fold the flags of the forward passes so far (no sync). The scaler calls it in ``scale()``."""
        self._fwd.close()

    def end_backward(self) -> None:
        """Fold the flags of the backward passes so far (no sync). The scaler calls it in its check."""
        self._bwd.close()

    def forward_flag(self) -> Optional[torch.Tensor]:
        """A bool 0-dim tensor: some forward output of this iteration was non-finite (None: nothing traced)."""
        return None if self._fwd.first is None else self._fwd.first >= 0

    def snapshot(self) -> Dict[str, Optional[torch.Tensor]]:
        """This iteration's first-module tensors, kept for the report; then start the next iteration."""
        self.end_forward()
        self.end_backward()
        out = {"forward": self._fwd.first, "backward": self._bwd.first}
        self._fwd.first = self._bwd.first = None
        return out

    def names_of(self, snap: Dict[str, Optional[torch.Tensor]]) -> Dict[str, Optional[str]]:
        """``{"forward": name or None, "backward": name or None}`` for a :meth:`snapshot`. Syncs."""
        out = {}
        for key, first in snap.items():
            k = -1 if first is None else int(first.item())
            out[key] = self.names[k] if k >= 0 else None
        return out

    # ---------------------------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Remove every hook (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "Tracer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self):
        # Hook handles do not pickle; a restored tracer is closed (the scaler re-hooks a model it owns).
        state = self.__dict__.copy()
        state["_handles"] = []
        state["_fwd"], state["_bwd"] = _Pass(), _Pass()
        return state
