"""Per-layer activation-gradient statistics: where FP16 actually flushes under autocast.

Under autocast the *parameter* gradients are FP32 (FP32 master weights); the flushing happens earlier,
in the FP16 activation gradients that flow backward between layers. Two tools look there:

* :class:`ActivationGradRecorder` — a context manager that records, per module, the statistics of the
  ``grad_output`` tensors of a real training backward at sampled steps, and removes its hooks on exit.
  Under FP16 autocast those tensors are already FP16: a value that flushed is already 0 and is counted
  among ``zeros`` (with true zeros, e.g. from ReLU), while ``subnormal`` counts values sitting on the
  cliff with reduced precision and ``headroom_bits`` the distance to overflow. Records say which dtype
  they measured (``measured_dtype``).
* :func:`activation_grad_probe` — the mixed-precision paper's method (Micikevicius et al. 2018 built
  their activation-gradient histogram from FP32 training): one FP32 forward/backward of a batch, leaving
  ``.grad`` untouched, whose exact activation gradients are classified as FP16 would store them at a
  given scale. Its ``flushed_frac`` is the fraction of gradient signal FP16 destroys at that scale.

Neither syncs host and device while recording; figures are read from the :class:`GradStats` objects
(reading a figure syncs).
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, List, Sequence, Union

import torch

from . import formats
from .stats import GradStats, grad_stats

__all__ = ["ActivationGradRecorder", "activation_grad_probe", "default_modules"]


def default_modules(model: torch.nn.Module) -> Dict[str, torch.nn.Module]:
    """The modules worth watching: every leaf module that has parameters (Linear, Conv, Norm, ...).

    Parameter-free leaves (ReLU, Dropout) pass their gradient through almost unchanged, so they would
    repeat their neighbours' figures.
    """
    return {
        name: m
        for name, m in model.named_modules()
        if name and not any(True for _ in m.children()) and any(True for _ in m.parameters(recurse=False))
    }


def _check_model(model) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model={model!r} must be a torch.nn.Module (the model whose layers to watch).")
    return model


def _check_fmt(fmt) -> str:
    """``fmt``'s canonical name; ValueError naming ``fmt`` and the valid names otherwise."""
    try:
        return formats.get(fmt).name
    except ValueError as e:
        raise ValueError(f"fmt={fmt!r}: {e}") from None


def _select(model: torch.nn.Module, modules) -> Dict[str, torch.nn.Module]:
    _check_model(model)
    if modules is None:
        chosen = default_modules(model)
    else:
        named = dict(model.named_modules())
        chosen = {}
        for m in modules:
            if isinstance(m, str):
                if m not in named:
                    raise ValueError(f"modules: {m!r} is not a submodule name of the model (see model.named_modules()).")
                chosen[m] = named[m]
            elif isinstance(m, type):
                chosen.update({n: sub for n, sub in named.items() if n and isinstance(sub, m)})
            else:
                raise ValueError(f"modules entries must be names or module types, got {m!r}.")
    if not chosen:
        raise ValueError("no modules to watch: the model has no leaf modules with parameters; pass modules=.")
    return chosen


class ActivationGradRecorder:
    """Record per-module statistics of the activation gradients (``grad_output``) at sampled steps.

    Args:
        model: the model to watch (a ``torch.nn.Module``).
        fmt: the format to classify against ("fp16" by default; any name :func:`lossscale.formats.get`
            knows).
        every: record on every ``every``-th step (steps advance with :meth:`step`).
        modules: module names or types to watch; default :func:`default_modules`.

    The gradients are measured as they flow in the user's backward, so they already carry the loss
    scale: an FP16 gradient is measured as stored; a wider one (an FP32 backward) as ``fmt`` would
    store it.

    Usage::

        with ActivationGradRecorder(model, every=50) as rec:
            for x, y in data:
                ...; scaler.scale(loss).backward(); ...; scaler.update()
                rec.step()
        rec.history   # [{"step", "module", "measured_dtype", "stats"}, ...]
        rec.latest    # {module name: GradStats} of the last recorded step

    Hooks are removed when the context exits, also on an exception.

    Raises:
        ValueError: at construction, for a ``model`` that is not a module, an unknown ``fmt``, a bad
            ``every`` or ``modules``.
    """

    def __init__(self, model: torch.nn.Module, *, fmt: str = "fp16", every: int = 1, modules=None):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every={every!r} must be an int >= 1.")
        self._fmt = _check_fmt(fmt)  # checked here, not at the first hooked backward
        self._modules = _select(model, modules)
        self._every = every
        self._handles: List = []
        self._step = 0
        self.latest: Dict[str, GradStats] = {}
        self.history: List[dict] = []

    def _hook(self, name: str) -> Callable:
        def hook(module, grad_output):
            if self._step % self._every:
                return
            grads = [g for g in grad_output if isinstance(g, torch.Tensor)]
            if not grads:
                return
            dtype = grads[0].dtype
            stats = grad_stats([g.detach() for g in grads], scale=1.0, fmt=self._fmt)
            self.latest[name] = stats
            self.history.append({"step": self._step, "module": name, "measured_dtype": str(dtype).replace("torch.", ""),
                                 "stats": stats})

        return hook

    def __enter__(self) -> "ActivationGradRecorder":
        if self._handles:
            raise RuntimeError("this ActivationGradRecorder is already active; exit it before entering again.")
        for name, module in self._modules.items():
            # A pre-hook sees grad_output before the module's backward runs, and (unlike a full
            # backward hook) needs no input that requires grad, so the first layer is covered too.
            self._handles.append(module.register_full_backward_pre_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove every hook this recorder registered (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def step(self) -> None:
        """Advance the step counter that decides which backward passes are recorded."""
        self._step += 1

    def summary(self) -> Dict[str, dict]:
        """Per module, the figures of the latest recorded step as plain numbers. Syncs."""
        return {name: s.to_dict() for name, s in self.latest.items()}


def activation_grad_probe(
    model: torch.nn.Module,
    loss_fn: Callable,
    inputs: Union[torch.Tensor, Sequence[torch.Tensor]],
    targets=None,
    *,
    scale: Union[float, torch.Tensor, "object"] = 1.0,
    fmt: str = "fp16",
    modules=None,
) -> Dict[str, GradStats]:
    """Per module: what ``fmt`` does to the exact activation gradients of one batch at ``scale``.

    Runs one FP32 forward and backward (autocast disabled) of ``loss_fn(model(*inputs), targets)``,
    captures every watched module's ``grad_output`` in FP32 and classifies ``grad * scale`` as ``fmt``
    would store it. Parameter ``.grad`` fields are left untouched (gradients are taken with
    ``torch.autograd.grad``). ``scale`` may be a ``GradScaler``: its current scale is read, which
    syncs host and device.

    Returns ``{module name: GradStats}``; ``flushed_frac`` is the share of the (nonzero) activation
    gradient values that ``fmt`` would flush to zero at ``scale``.
    """
    fmt = _check_fmt(fmt)  # before the forward and backward, not after them
    chosen = _select(model, modules)
    captured: Dict[str, List[torch.Tensor]] = {}
    handles = [
        m.register_full_backward_pre_hook(
            lambda mod, go, name=name: captured.setdefault(name, []).extend(
                g.detach() for g in go if isinstance(g, torch.Tensor)
            )
        )
        for name, m in chosen.items()
    ]
    args = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        with torch.autocast(device_type=args[0].device.type, enabled=False):
            out = model(*(a.float() if a.is_floating_point() else a for a in args))
            loss = loss_fn(out, targets) if targets is not None else loss_fn(out)
        with warnings.catch_warnings():
            # torch warns that a full backward hook on the first layer fires for its outputs only
            # (its input needs no grad): exactly the grad_output this probe wants.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            torch.autograd.grad(loss.float(), params, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    if hasattr(scale, "get_scale"):
        scale = scale.get_scale()  # syncs: the histogram boundaries depend on the scale's value
    return {name: grad_stats(gs, scale=scale, fmt=fmt) for name, gs in captured.items()}
