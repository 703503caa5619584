"""Per-layer activation-gradient statistics: where FP16 actually flushes under autocast.

Under autocast the *parameter* gradients are FP32 (FP32 master weights); the flushing happens earlier,
in the FP16 activation gradients that flow backward between layers. Two tools look there:

* ``ActivationGradRecorder`` — a context manager that records, per module, the statistics of the
  gradients of the module's outputs (``grad_output``) in a real training backward at sampled steps,
  and removes its hooks on exit.
  Under FP16 autocast those tensors are already FP16: a value that flushed is already 0 and is counted
  among ``zeros`` (with true zeros, e.g. from ReLU), while ``subnormal`` counts values sitting on the
  cliff with reduced precision and ``headroom_bits`` the distance to overflow. Records say which dtype
  they measured (``measured_dtype``).
* ``activation_grad_probe`` — the mixed-precision paper's method (Micikevicius et al. 2018 built
  their activation-gradient histogram from FP32 training): one FP32 forward/backward of a batch, leaving
  ``.grad`` untouched, whose exact activation gradients are classified as FP16 would store them at a
  given scale. Its ``flushed_frac`` is the fraction of gradient signal FP16 destroys at that scale.

Neither syncs host and device while recording; figures are read from the ``GradStats`` objects
(reading a figure syncs). ``activation_metrics`` (and ``ActivationGradRecorder.metrics``) turn
them into the flat ``act/<module>/<figure>`` keys that ``lossscale report RUN.jsonl`` plots.

Both hook the module's *outputs* (a forward hook puts a hook on each output tensor) rather than using
``register_full_backward_hook``: that one wraps the outputs in a custom autograd function, so a
following in-place op (``ReLU(inplace=True)``) fails, and it warns "Full backward hook is firing ..." for
every module whose inputs need no grad (the first layer, in the common case).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Sequence, Union

import torch

from . import formats
from .report.schema import LAYER_METRICS
from .stats import GradStats, grad_stats

__all__ = ["ActivationGradRecorder", "activation_grad_probe", "activation_metrics", "default_modules"]


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


def _grad_outputs(output) -> List[torch.Tensor]:
    """The tensors of a module's output (a tensor, or nested tuples, lists and dicts) that will get a gradient."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for o in output for t in _grad_outputs(o)]
    return []


def _hook_outputs(modules: Mapping[str, torch.nn.Module],
                  on_forward: Callable[[str], Union[Callable[[torch.Tensor], None], None]]) -> List:
    """Forward hooks that put ``on_forward(name)`` on each output tensor of each call of the modules.

    The tensor hook receives the gradient of that output (the module's ``grad_output``) in the backward;
    ``on_forward`` returns None to leave a call unwatched. Returns the forward hooks' handles.
    """

    def forward_hook(name: str) -> Callable:
        def hook(module, args, output):
            tensors = _grad_outputs(output)  # none under no_grad: nothing to hook, nothing left behind
            grad_hook = on_forward(name) if tensors else None
            if grad_hook is not None:
                for t in tensors:
                    t.register_hook(grad_hook)

        return hook

    return [m.register_forward_hook(forward_hook(name)) for name, m in modules.items()]


def activation_metrics(per_module: Mapping[str, GradStats], *, prefix: str = "act",
                       of_nonzero: bool = False) -> Dict[str, float]:
    """Per-module statistics as the flat keys ``lossscale report RUN.jsonl`` reads. Syncs.

    Returns ``{"<prefix>/<module>/<figure>": value}`` for each module and ``{"<prefix>/<figure>": value}``
    over all modules together, for the per-layer figures the report reads
    (``lossscale.report.schema.LAYER_METRICS``). Log it with the scaler's metrics:

    ```python
    log.log(step, {**scaler.metrics(), **activation_metrics(per_module)})
    ```

    ``per_module`` is ``ActivationGradRecorder.latest`` or what ``activation_grad_probe``
    returns (all measured with one ``fmt`` and scale). With ``of_nonzero=True`` the fractions are
    shares of the nonzero values (so a ReLU's exact zeros do not dilute them), as the demo reports.
    Empty for an empty ``per_module``.
    """
    def figures(key: str, st: GradStats) -> Dict[str, float]:
        d = st.to_dict()  # one read of the counts
        out = {f"{key}/{m}": d[m] for m in LAYER_METRICS}
        if of_nonzero:
            out.update({f"{key}/{count}_frac": st.frac_of_nonzero(count) for count in ("flushed", "subnormal", "overflow")})
        return out

    out: Dict[str, float] = {}
    total = None
    for name, st in per_module.items():
        out.update(figures(f"{prefix}/{name}", st))
        total = st if total is None else total.merge(st)
    if total is not None:
        out.update(figures(prefix, total))
    return out


class ActivationGradRecorder:
    """Record per-module statistics of the activation gradients (``grad_output``) at sampled steps.

    Args:
        model: the model to watch (a ``torch.nn.Module``).
        fmt: the format to classify against ("fp16" by default; any name ``lossscale.formats.get``
            knows).
        every: record on every ``every``-th step (steps advance with ``step``).
        modules: module names or types to watch; default ``default_modules``.

    The gradients are measured as they flow in the user's backward, so they already carry the loss
    scale: an FP16 gradient is measured as stored; a wider one (an FP32 backward) as ``fmt`` would
    store it. Each call of a watched module in a sampled step's forward gives one record, covering
    the gradients of all its outputs; models with in-place ops after a watched module
    (``ReLU(inplace=True)``) and first layers whose input needs no grad work as any other.

    Usage, with the figures logged where ``lossscale report RUN.jsonl`` finds them:

    ```python
    log = lossscale.JsonlLogger("run.jsonl")
    with ActivationGradRecorder(model, every=50) as rec:
        for step, (x, y) in enumerate(data):
            ...; scaler.scale(loss).backward(); ...; scaler.update()
            if step % 50 == 0:
                log.log(step, {**scaler.metrics(), **rec.metrics()})
            rec.step()
    rec.history   # [{"step", "module", "measured_dtype", "stats"}, ...]
    rec.latest    # {module name: GradStats} of the last recorded step
    ```

    Under FP16 autocast a value that flushed is already 0 when it is measured, so ``act/flushed_frac``
    reads 0 and the loss lands in ``zeros``; for the share FP16 flushes, log
    ``activation_metrics(activation_grad_probe(...))`` every N steps instead (see ``activation_metrics``).

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

    def _watch(self, name: str) -> Union[Callable[[torch.Tensor], None], None]:
        """At a watched module's forward: the gradient hook for its outputs, or None on unsampled steps."""
        if self._step % self._every:
            return None
        entry = {"step": self._step, "module": name, "measured_dtype": None, "stats": None}

        def record(grad: torch.Tensor) -> None:
            if not self._handles:
                return  # removed since the forward: a later backward records nothing
            stats = grad_stats([grad.detach()], scale=1.0, fmt=self._fmt)
            if entry["stats"] is None:
                entry["measured_dtype"] = str(grad.dtype).replace("torch.", "")
                entry["stats"] = stats
                self.history.append(entry)
            else:  # another output of the same call
                entry["stats"] = entry["stats"].merge(stats)
            self.latest[name] = entry["stats"]

        return record

    def __enter__(self) -> "ActivationGradRecorder":
        if self._handles:
            raise RuntimeError("this ActivationGradRecorder is already active; exit it before entering again.")
        self._handles = _hook_outputs(self._modules, self._watch)
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

    def metrics(self) -> Dict[str, float]:
        """The latest recorded figures as the flat ``act/...`` keys ``lossscale report`` reads. Syncs.

        ``activation_metrics`` of ``latest``: ``act/<module>/flushed_frac`` (and
        ``subnormal_frac``, ``overflow_frac``, ``headroom_bits``) per module and ``act/<figure>`` over all
        watched modules together; empty before the first recorded backward.
        """
        return activation_metrics(self.latest)


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
    gradient values that ``fmt`` would flush to zero at ``scale``. ``activation_metrics`` turns it
    into the keys ``lossscale report`` plots.
    """
    fmt = _check_fmt(fmt)  # before the forward and backward, not after them
    chosen = _select(model, modules)
    captured: Dict[str, List[torch.Tensor]] = {}
    handles = _hook_outputs(chosen, lambda name: lambda g: captured.setdefault(name, []).append(g.detach()))
    args = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        with torch.autocast(device_type=args[0].device.type, enabled=False):
            out = model(*(a.float() if a.is_floating_point() else a for a in args))
            loss = loss_fn(out, targets) if targets is not None else loss_fn(out)
        torch.autograd.grad(loss.float(), params, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    if hasattr(scale, "get_scale"):
        scale = scale.get_scale()  # syncs: the histogram boundaries depend on the scale's value
    return {name: grad_stats(gs, scale=scale, fmt=fmt) for name, gs in captured.items()}
