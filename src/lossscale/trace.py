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

The tracer behaves like a part of the model:

* Only forwards that autograd records count (``torch.is_grad_enabled()``). Evaluation and
  generation under ``torch.no_grad()`` / ``torch.inference_mode()`` are not checked and hold
  nothing, so a NaN in an evaluation batch does not skip the next training step. A forward in
  ``eval()`` mode *with* grad on counts: that is training with frozen batch norm or without
  dropout. Run evaluation under ``no_grad`` (as one should anyway) to keep it out.
* Forwards with grad on that no ``scale()`` follows keep at most :data:`FOLD_AT` checks pending
  (then they fold), not one tensor per module call.
* A traced model pickles (``torch.save(model)``) and deep-copies. With its scaler in the same
  pickle or copy (``copy.deepcopy((model, scaler))``), the copy traces the copied modules; alone,
  its hooks find no tracer and remove themselves at the first call.
* Hooks running on several threads (a model split over devices) keep each value with its module.

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

import threading
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from ._features import Feature

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


#: Checks one direction holds before they fold (a few kernels). Forwards with grad on that no
#: ``scale()`` follows (a metric computed outside ``no_grad``) then keep a bounded number of tensors:
#: at most this many sums, plus one folded record.
FOLD_AT = 1024


class _Pass:
    """One direction's checks for the current iteration, on device until a report is read.

    Each hook call appends one (module index, float32 sum) pair per tensor, in one list operation:
    the hooks of a model split over two devices run on two threads, and two lists extended in two
    statements could interleave. The pairs fold at the end of a pass (:meth:`close`) and whenever
    :data:`FOLD_AT` are pending: the sums are stacked and the position of the first non-finite one
    is found with a handful of kernels, whatever the number of modules, and merged into the
    iteration's one record. Which module a position is stays on the host, so nothing is copied to
    the device and nothing read back until the report.
    """

    def __init__(self):
        # Folds take a lock (two threads may reach FOLD_AT at once); appends do not, so a hook
        # under torch.compile has no lock to break its graph on.
        self._lock = threading.Lock()
        self.pending: List[Tuple[int, torch.Tensor]] = []
        self.folded: Optional[tuple] = None  # (indices, first position tensor, any tensor), or None

    def add(self, index: int, sums: List[torch.Tensor]) -> None:
        self.pending.extend([(index, s) for s in sums])
        if len(self.pending) >= FOLD_AT:
            self.close()

    def close(self) -> None:
        """Fold the pending checks into the iteration's record (no sync)."""
        with self._lock:
            # Take the pending pairs as a prefix, in place: a pair another thread appends meanwhile
            # lands after it and waits for the next fold.
            n = len(self.pending)
            if not n:
                return
            indices, sums = zip(*self.pending[:n])
            del self.pending[:n]
            device = sums[0].device if self.folded is None else self.folded[1].device
            bad = ~torch.isfinite(torch.stack([x.to(device) for x in sums]))
            # argmax of a bool vector is its first True (0 when none: read with ``any``).
            first, found = torch.argmax(bad.to(torch.uint8)), bad.any()
            if self.folded is None:
                self.folded = (list(indices), first, found)
                return
            seen, first_before, found_before = self.folded
            # The earlier checks ran first: theirs, if any was non-finite, else this block's, past them.
            first = torch.where(found_before, first_before, first + len(seen))
            seen.extend(indices)
            self.folded = (seen, first, found_before | found)

    def any(self) -> Optional[torch.Tensor]:
        """A bool 0-dim tensor: some folded check was non-finite (None: nothing checked)."""
        return None if self.folded is None else self.folded[2]

    def take(self) -> List[tuple]:
        """The iteration's record (a list of at most one), handed over (for a report) and forgotten."""
        self.close()
        with self._lock:
            out, self.folded = self.folded, None
        return [] if out is None else [out]


class _Hook:
    """A tracer's hook on one module. It holds its tracer weakly: a tracer nobody keeps (a scaler
    dropped without ``close()``; a model pickled or copied without its scaler) stops tracing, and
    its hooks remove themselves at the module's next call. A hook pickles and deep-copies with its
    tracer, and rejoins the copy (:func:`_rebuild_hook`), so a copy of ``(model, scaler)`` traces
    the copied modules."""

    def __init__(self, tracer: Optional["Tracer"], index: int):
        self._tracer = None if tracer is None else weakref.ref(tracer)
        self.index = index
        self.handle = None  # its RemovableHandle, set once registered

    def tracer(self) -> Optional["Tracer"]:
        """The tracer to report to; None (and this hook removed) when it is gone. For the hook calls."""
        tracer = None if self._tracer is None else self._tracer()
        if tracer is None and self.handle is not None:
            self.handle.remove()
        return tracer

    def __reduce__(self):
        # No removal here: pickling or copying the model must not change the original.
        return _rebuild_hook, (type(self), None if self._tracer is None else self._tracer(), self.index, self.handle)


def _rebuild_hook(cls, tracer: Optional["Tracer"], index: int, handle) -> _Hook:
    """Unpickle or copy a hook, and give it back to its (unpickled or copied) tracer to remove on close."""
    hook = cls(tracer, index)
    hook.handle = handle
    if tracer is not None:
        tracer._hooks.append(hook)
    return hook


class _InputsHook(_Hook):
    """Forward pre-hook: registers, on each input that needs a gradient, a tensor hook that checks
    the gradient this module's backward computes for it."""

    def __call__(self, module, args) -> None:
        # Before the module runs: an in-place module (ReLU(inplace=True)) has not yet changed its
        # input, so the tensor hook sees the gradient of the input this module received.
        tracer = self.tracer()
        if tracer is None or not torch.is_grad_enabled():
            return
        checks, index = tracer._bwd, self.index
        for x in _tensors(args):
            if x.requires_grad:
                x.register_hook(lambda g: checks.add(index, _sums([g])))


class _OutputsHook(_Hook):
    """Forward hook: checks the module's outputs, in forwards that autograd records."""

    def __call__(self, module, args, output) -> None:
        tracer = self.tracer()
        # no_grad / inference_mode forwards (evaluation, generation) are never backpropagated: a
        # non-finite value there says nothing about the next training step, and is not kept.
        if tracer is not None and torch.is_grad_enabled():
            tracer._fwd.add(self.index, _sums(_tensors(output)))


#: Leaf modules that cannot *originate* a non-finite value: finite inputs give finite outputs and
#: finite gradients (bounded, or a mask of their input), so a non-finite value there was already
#: non-finite in a neighbour, which is checked. Not hooking them halves the cost on a plain MLP.
PASS_THROUGH = (
    torch.nn.ReLU,
    torch.nn.ReLU6,
    torch.nn.LeakyReLU,
    torch.nn.Tanh,
    torch.nn.Sigmoid,
    torch.nn.Hardtanh,
    torch.nn.Identity,
    torch.nn.Flatten,
    torch.nn.Unflatten,
)


class Tracer(Feature):
    """Hooks on every leaf module of ``model`` that find the first non-finite forward output and the
    first module whose backward produced a non-finite gradient.

    Forward: a forward hook checks each leaf's output (leaves in :data:`PASS_THROUGH` are skipped), in
    forwards with grad on. Backward: a tensor hook on each leaf's inputs sees the gradient *its*
    backward computed (a module hook would wrap outputs and break in-place ops such as
    ``ReLU(inplace=True)``). The gradient of the loss itself is not a module's: a non-finite loss
    shows as the last module in backward order, and the scaler's loss check names it.

    The hooks hold the tracer weakly: keep a reference to it (the scaler does) for as long as it
    should trace.

    Args:
        model: the ``nn.Module`` to watch; names come from ``named_modules()``.
    """

    def __init__(self, model: torch.nn.Module):
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"trace=True needs model= to be an nn.Module, got {type(model).__name__}.")
        self.__setstate__({"names": []})  # no hooks, no checks yet
        for name, module in model.named_modules():
            if next(module.children(), None) is not None or isinstance(module, PASS_THROUGH):
                continue  # leaves only (a container's output is its last leaf's), and not pass-throughs
            index = len(self.names)
            self.names.append(name or type(module).__name__)
            for hook, register in (
                (_InputsHook(self, index), module.register_forward_pre_hook),
                (_OutputsHook(self, index), module.register_forward_hook),
            ):
                hook.handle = register(hook)
                self._hooks.append(hook)

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
        for hook in self._hooks:
            hook.handle.remove()
        self._hooks = []

    def __enter__(self) -> "Tracer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self):
        # Pickled or copied alone, a tracer hooks nothing. Its hooks pickle and copy with the modules
        # and rejoin it there (_rebuild_hook): a model pickled or copied with the scaler traces.
        return {"names": self.names}

    def __setstate__(self, state) -> None:
        self.names: List[str] = state["names"]
        self._hooks: List[_Hook] = []
        self._fwd, self._bwd = _Pass(), _Pass()
