"""Where a non-finite value first appeared: the first module in execution order whose forward output,
and the first in backward order whose gradient, held inf or NaN. On device, without a host sync.

By the time the scaler checks the parameter gradients, a NaN has spread backward through every layer
below its source, so ``overflow_report()`` names them all. A :class:`Tracer` hooks every leaf module
and keeps, per checked tensor, its float32 sum on device (non-finite exactly when the tensor holds
inf or NaN); at the end of the forward (the scaler's ``scale(loss)``) and of the backward (its
check) the sums are stacked and the first non-finite one is found with a few tensor ops, so the
per-module cost is one small kernel and a list append. Nothing is read on the host until
``overflow_report()``.

Host syncs: none while training; one when a report is read.

Usage (``GradScaler(model=model, trace=True)`` does this for you)::

    tracer = Tracer(model)
    ...forward...
    tracer.end_forward()          # stacks the forward checks (no sync)
    ...backward...
    tracer.end_backward()
    tracer.names_of(tracer.snapshot())   # {"forward": "encoder.3.attn" or None, "backward": ...}  (syncs)
    tracer.close()                # removes every hook (also: ``with Tracer(model) as t:``)
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from . import _kernels

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


def _sums(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """One float32 sum per tensor: non-finite exactly when the tensor holds an inf or a NaN.

    One kernel per tensor, where ``isfinite(x).all()`` costs two. Summed in float32 (an fp16 sum
    would overflow at 65504); a false alarm needs finite values adding up past 3.4e38.
    """
    return [t.detach().sum(dtype=torch.float32) for t in tensors if t.numel()]


class _Pass:
    """One direction's checks for the current iteration, on device until a report is read.

    Each hook call appends one float32 sum per tensor and its module index (a host list). A pass ends
    at :meth:`close`: the sums are stacked and the position of the first non-finite one is found
    with a handful of kernels, whatever the number of modules; which module that is stays on the
    host list, so nothing is copied to the device and nothing read back until the report.
    """

    def __init__(self):
        self.indices: List[int] = []
        self.sums: List[torch.Tensor] = []
        self.closed: List[tuple] = []  # (indices, first position tensor, any tensor) per pass

    def add(self, index: int, sums: List[torch.Tensor]) -> None:
        self.indices.extend([index] * len(sums))
        self.sums.extend(sums)

    def close(self) -> None:
        if not self.sums:
            return
        device = self.sums[0].device
        bad = ~torch.isfinite(torch.stack([_kernels.to_device(x, device) for x in self.sums]))
        # argmax of a bool vector is its first True (0 when none: read with ``any``).
        self.closed.append((self.indices, torch.argmax(bad.to(torch.uint8)), bad.any()))
        self.indices, self.sums = [], []

    def any(self) -> Optional[torch.Tensor]:
        """A bool 0-dim tensor: some closed pass found a non-finite value (None: nothing checked)."""
        flags = [a for _, _, a in self.closed]
        if not flags:
            return None
        out = flags[0]
        for f in flags[1:]:
            out = out | f
        return out

    def take(self) -> List[tuple]:
        """The closed passes, handed over (for a report) and forgotten."""
        self.close()
        out, self.closed = self.closed, []
        return out


#: Leaf modules that cannot *originate* a non-finite value: finite inputs give finite outputs and
#: finite gradients (bounded, or a mask of their input), so a non-finite value there was already
#: non-finite in a neighbour, which is checked. Not hooking them halves the cost on a plain MLP.
PASS_THROUGH = (torch.nn.ReLU, torch.nn.ReLU6, torch.nn.LeakyReLU, torch.nn.Tanh, torch.nn.Sigmoid,
                torch.nn.Hardtanh, torch.nn.Identity, torch.nn.Flatten, torch.nn.Unflatten)


class Tracer:
    """Hooks on every leaf module of ``model`` that find the first non-finite forward output and the
    first module whose backward produced a non-finite gradient.

    Forward: a forward hook checks each leaf's output (leaves in :data:`PASS_THROUGH` are skipped). Backward: a tensor hook on each leaf's inputs
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
            if next(module.children(), None) is not None or isinstance(module, PASS_THROUGH):
                continue  # leaves only (a container's output is its last leaf's), and not pass-throughs
            index = len(self.names)
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
                        x.register_hook(lambda g, i=index: self._bwd.add(i, _sums([g])))
        return hook

    def _outputs_hook(self, index: int):
        def hook(module, args, output):
            self._fwd.add(index, _sums(_tensors(output)))
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
        return self._fwd.any()

    def snapshot(self) -> Dict[str, List[tuple]]:
        """This iteration's checks, kept for the report; then start the next iteration. No sync."""
        return {"forward": self._fwd.take(), "backward": self._bwd.take()}

    def names_of(self, snap: Dict[str, List[tuple]]) -> Dict[str, Optional[str]]:
        """``{"forward": name or None, "backward": name or None}`` for a :meth:`snapshot`: the first
        module, over the iteration's passes in order, whose checked value was non-finite. Syncs."""
        out = {}
        for key, passes in snap.items():
            out[key] = None
            for indices, first, found in passes:
                if bool(found.item()):
                    out[key] = self.names[indices[int(first.item())]]
                    break
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
