"""``lossscale.audit``: what FP16 does to one batch of your model, module by module, against FP32.

(The module is ``lossscale.auditing``, not ``lossscale.audit``: a submodule of that name would replace
the function ``lossscale.audit`` on the package as soon as anything imported it.)

The first thing to run when an FP16 run goes NaN. One call answers the questions the scaler cannot:

* **Forward overflow** -- which modules' own FP16 output exceeds 65504 (no loss scale helps: the scale
  only touches the backward). Those go in ``report.keep_fp32``, ready for ``lossscale.keep_fp32``.
* **Backward overflow** -- which modules' output gradient, times the scale, overflows FP16 (the scale
  must drop).
* **Underflow** -- what share of the gradient values FP16 stores would flush to zero at the scale.
* **Broken hardware** -- whether this device's FP16 kernels agree with FP32 at all.

``print(report)`` is a table; ``report.to_dict()`` the same as plain data:

```python
report = lossscale.audit(model, lambda m, b: loss_fn(m(b[0]), b[1]), (x, y), scale=scaler)
print(report)
lossscale.keep_fp32(model, report.keep_fp32)
```

How it measures (``loss_fn(model, batch)`` runs once per pass; each pass starts from the same RNG state,
so dropout draws the same masks where the kernels allow):

1. **FP32 shadow**, in the model's training mode, forward and backward: the exact activation gradients
   (the mixed-precision paper's method, as ``lossscale.activation_grad_probe``), taken with
   ``torch.autograd.grad`` so no ``.grad`` is touched. The shadow is the model itself when every
   floating parameter and buffer is float32 already (autocast's recipe: nothing to convert, and a copy
   would double the memory), else a deep copy converted with ``.float()``; ``batch``'s float16/bfloat16
   tensors are cast to float32 for it.
2. **FP16 forward** under ``torch.autocast(dtype=torch.float16)``, in training mode, with grad enabled as
   in training. A module **overflows in its own forward** when a call whose floating inputs were all
   finite returned inf or NaN. The smallest such modules (none of whose submodules does) that the FP32
   shadow keeps finite are kept in FP32 and the forward runs again, because a module downstream of the
   first overflow saw inf as input and could not be judged: up to ``max_rounds`` times, until the
   FP16 forward is finite. ``report.keep_fp32`` is the union (modules kept already are left out: a
   second audit after ``keep_fp32`` shows none). The forward columns show the first round: the model as
   you gave it.
3. **The scale.** ``scale`` given (a number, or a ``GradScaler``'s ``get_scale()``), or the largest safe
   one: the largest power of two ``S`` with ``amax * S * 2 <= 65504``, where ``amax`` is the largest
   exact gradient FP16 would store -- the gradients of module outputs that are float16 under autocast
   (with ``keep_fp32`` applied) and those modules' own parameter gradients, which autocast's backward
   computes in FP16 too. The factor 2 is one binade of headroom for a batch whose gradients run twice
   as large (the dynamic policy backs off by one binade per overflow); capped at 2^24 (the scaler's
   ``max_scale``: above it a rescued gradient cannot move an FP32 weight). Each FP16-stored gradient is
   then classified as FP16 stores ``g * S`` (``lossscale.grad_stats``, exact counts): the flushed
   share (of the nonzero values) and overflow.
4. **Hardware check**, two parts. (a) Known answers: FP16 linear (forward and backward), bmm and conv2d
   under autocast on the model's device, on inputs whose products and sums are exact in FP16 (so the
   result must be bitwise the float64 one), plus a matmul of general values held to the rigorous
   rounding bound ``gamma(K+3) * |A| |B|`` (``gamma(n) = n u / (1 - n u)``, ``u = 2^-11``, FP16's unit
   roundoff; it holds for any summation order, FP16 accumulation included). A device whose FP16 kernels
   return NaN or garbage (GTX 16xx and Quadro T GPUs have been reported to pass simple AMP checks and
   give NaN losses in training) fails it. (b) Agreement: the model in eval mode (no dropout: the same
   computation in both), under ``no_grad``, FP16 (with ``keep_fp32`` applied) against FP32, module by
   module: ``max|y16 - y32| / amax(y32)`` must stay within ``tol(d) = min(1/4, 4u * (d + 1))``, where
   ``d`` is the number of leaf modules run up to it: each FP16 layer adds roundings of relative size
   ``u`` and, in the worst case, the errors add up through the depth. Measured on CPU, healthy errors
   stay under ``2u`` at every depth (a 6-layer GPT-2, a CNN with BatchNorm, a 12-layer tanh MLP), so
   a healthy device sits at most half-way to the line at the first layer and further below it after.
   A NaN or inf where FP32 is finite and within FP16's range, with finite inputs, is a disagreement
   too; one from an inf upstream or from an FP32 value past 65504 is not. The first disagreeing module
   in execution order is reported.

The model is left as it was: parameters and their ``.grad`` untouched, every module's training flag
restored, every buffer restored to its values (a BatchNorm's running statistics move in the training-
mode passes), every hook the audit registered removed, modules it kept in FP32 for the later rounds
un-kept, and the global RNG (CPU and the model's CUDA devices) restored, so the audit does not shift
your dropout stream. Hooks you registered run during the passes (on the shadow copy too).

Host syncs: many; it is a one-off diagnosis. It reads its figures after each pass.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from . import formats
from . import fp32 as _fp32
from .stats import GradStats, grad_stats

__all__ = ["audit", "AuditReport", "ModuleAudit", "HardwareCheck", "MAX_SCALE", "MARGIN_BITS"]

FP16 = formats.FP16

#: The largest scale the audit proposes: the scaler's default ``max_scale`` (2^24). Above it a gradient
#: the scale rescues is below 2^-48 and cannot move an FP32 weight.
MAX_SCALE = 2.0**24

#: Binades of headroom the proposed scale keeps above the largest gradient of the batch.
MARGIN_BITS = 1

# FP16's unit roundoff: the largest relative error of one rounding to nearest.
_U16 = 2.0**-11

#: Agreement tolerance: ``min(TOL_CAP, TOL_PER_LAYER * (d + 1))`` relative to the module output's amax,
#: ``d`` leaf modules deep. Four unit roundoffs per layer: twice the largest healthy error measured.
TOL_PER_LAYER = 4 * _U16
TOL_CAP = 0.25


# ------------------------------------------------------------------ the report
@dataclass
class ModuleAudit:
    """One module's figures (one row of the table).

    Attributes:
        name: its name in ``model.named_modules()`` (``""`` is the model itself).
        type: its class name.
        calls: forward calls in the FP16 pass.
        dtype: its (first floating) output's dtype under FP16 autocast, the model as given.
        fwd_amax: largest ``|output|`` of the FP16 forward, the model as given (inf or NaN when the
            output held them).
        fp32_amax: the same in the FP32 shadow.
        fwd_overflow: an FP16 call with finite inputs returned inf or NaN (its own overflow).
        nonfinite_input: an FP16 call got an inf or NaN input (an overflow upstream reached it).
        fp32_nonfinite: the FP32 shadow's output held inf or NaN too (not an FP16 problem).
        grad_amax: largest exact ``|gradient|`` of its output (FP32 shadow, unscaled); None when no
            gradient reached it.
        grad_fp16: its output gradient is stored in FP16 under autocast (with ``keep_fp32`` applied).
        flushed_frac: share of the nonzero gradient values FP16 flushes to zero at the report's scale
            (None unless ``grad_fp16``).
        grad_overflow: some ``gradient * scale`` overflows FP16 (only when ``grad_fp16``).
        rel_error: the agreement pass's ``max|y16 - y32| / amax(y32)`` (None when not compared).
        verdict: what the row says, in words ("" when nothing is wrong).
    """

    name: str
    type: str
    calls: int = 0
    dtype: Optional[str] = None
    fwd_amax: float = 0.0
    fp32_amax: float = 0.0
    fwd_overflow: bool = False
    nonfinite_input: bool = False
    fp32_nonfinite: bool = False
    grad_amax: Optional[float] = None
    grad_fp16: bool = False
    flushed_frac: Optional[float] = None
    grad_overflow: bool = False
    rel_error: Optional[float] = None
    verdict: str = ""


@dataclass
class HardwareCheck:
    """Whether this device's FP16 agrees with FP32.

    Attributes:
        verdict: ``"ok"``, ``"broken"`` (a known-answer kernel failed) or ``"disagrees"`` (the kernels
            pass, but the model's FP16 forward departs from FP32 beyond the tolerance at a module).
        known_answer: per checked kernel, ``"ok"`` or what went wrong.
        first_disagreement: the first module in execution order whose FP16 output disagrees, or None.
        rel_error: its relative error (None when none disagrees).
        tolerance: the tolerance it was held to (None when none disagrees).
        max_ratio: the largest ``rel_error / tolerance`` over every compared module (how close to the
            line a healthy device came).
        detail: one sentence.
    """

    verdict: str
    known_answer: Dict[str, str]
    first_disagreement: Optional[str] = None
    rel_error: Optional[float] = None
    tolerance: Optional[float] = None
    max_ratio: float = 0.0
    detail: str = ""


@dataclass
class AuditReport:
    """What ``audit`` found. ``print(report)`` shows it as a table; ``to_dict`` as plain data.

    Attributes:
        device: the device the model ran on.
        scale: the loss scale the backward figures are judged at.
        scale_source: ``"given"``, ``"scaler"`` (a ``GradScaler``'s current scale) or ``"largest safe"``.
        safe_scale: the largest safe power of two (see ``lossscale.auditing``).
        loss_fp16: the loss of the FP16 forward, the model as given.
        loss_fp16_kept: the loss of the last FP16 forward, with ``keep_fp32`` applied.
        loss_fp32: the FP32 shadow's loss.
        keep_fp32: modules to keep in FP32 (smallest first-cause modules of forward overflows), to pass
            to ``lossscale.keep_fp32``.
        already_kept: modules that were kept in FP32 before the audit.
        forward_finite: whether the FP16 forward is finite with ``keep_fp32`` applied.
        fp32_nonfinite: modules whose FP32 output is non-finite as well, from finite inputs (a model
            problem, not FP16's).
        batch_finite: whether the batch's floating tensors are all finite (False: a data problem).
        backward_overflow: modules whose FP16 output gradient overflows at ``scale``.
        flushed_frac: share of the nonzero FP16-stored activation-gradient values flushed at ``scale``
            (leaf modules, so no value counts twice).
        hardware: the ``HardwareCheck``.
        modules: ``{name: ModuleAudit}`` in execution order.
        notes: anything else worth saying.
    """

    device: str
    scale: float
    scale_source: str
    safe_scale: float
    loss_fp16: float
    loss_fp16_kept: float
    loss_fp32: float
    keep_fp32: List[str]
    already_kept: List[str]
    forward_finite: bool
    fp32_nonfinite: List[str]
    batch_finite: bool
    backward_overflow: List[str]
    flushed_frac: float
    hardware: HardwareCheck
    modules: Dict[str, ModuleAudit] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        """Every field as plain Python data (``modules`` as a list of dicts, in execution order)."""
        d = asdict(self)
        d["modules"] = list(d["modules"].values())
        return d

    def summary(self) -> List[str]:
        """The verdicts, one sentence per line (the head of ``str(report)``)."""
        lines = [
            f"lossscale.audit on {self.device}: FP16 autocast against an FP32 shadow of one batch. "
            f"Loss: fp16 {self.loss_fp16:.6g}, fp32 {self.loss_fp32:.6g}"
            + (f", fp16 with keep_fp32 {self.loss_fp16_kept:.6g}." if self.keep_fp32 else ".")
        ]
        if self.keep_fp32:
            lines.append(
                f"FORWARD: {len(self.keep_fp32)} module(s) overflow FP16 in their own output; no loss scale "
                f"helps (the scale only touches the backward). Keep them in FP32: "
                f"lossscale.keep_fp32(model, {self.keep_fp32!r}) -- with it the FP16 forward is "
                + ("finite." if self.forward_finite else "still NOT finite (see notes).")
            )
        elif not self.forward_finite:
            lines.append(
                "FORWARD: the FP16 forward is not finite, and no module could be kept in FP32 to fix it (see notes)."
            )
        else:
            lines.append("FORWARD: no module overflows FP16.")
        if not self.batch_finite:
            lines.append("DATA: the batch holds inf or NaN: a data problem, not FP16's (and no scale helps).")
        if self.fp32_nonfinite:
            lines.append(
                f"FP32 TOO: {', '.join(map(_label, self.fp32_nonfinite))} are non-finite in FP32 as well, "
                "from finite inputs: a model problem, not FP16's."
            )
        src = {"given": "given", "scaler": "the scaler's", "largest safe": "the largest safe"}[self.scale_source]
        over = ", ".join(map(_label, self.backward_overflow))
        bwd = (
            f"{len(self.backward_overflow)} module(s) overflow FP16 at it ({over}): the scale must drop"
            if self.backward_overflow
            else "no gradient overflows"
        )
        lines.append(
            f"BACKWARD at scale {_pow2(self.scale)} ({src}): {bwd}; {self.flushed_frac:.3%} of the nonzero "
            "FP16-stored activation-gradient values flush to zero. "
            f"Largest safe scale: {_pow2(self.safe_scale)}."
        )
        lines.append(f"HARDWARE: {self.hardware.verdict} -- {self.hardware.detail}")
        lines.extend(f"note: {n}" for n in self.notes)
        return lines

    def table(self, max_rows: Optional[int] = 40) -> str:
        """The per-module table, in execution order. With more than ``max_rows`` modules, the rows that name
        a cause and those with the least forward headroom and the largest flushed share are shown (None:
        every row)."""
        rows = list(self.modules.values())
        hidden = 0
        if max_rows is not None and len(rows) > max_rows:
            # Rows that name a cause first (the "from upstream" ones follow from another row's), then the
            # least forward headroom and the largest flushed share.
            strong = [r for r in rows if r.verdict and r.verdict != "inf/nan from upstream"][:max_rows]
            rest = [r for r in rows if r not in strong]
            by_amax = sorted(rest, key=lambda r: -_finite_or(r.fwd_amax, math.inf))
            by_flush = sorted(rest, key=lambda r: -(r.flushed_frac or 0.0))
            room = max_rows - len(strong)
            chosen = strong + by_amax[: room // 2] + by_flush[: room - room // 2]
            pick = {id(r) for r in chosen}
            shown = [r for r in rows if id(r) in pick]
            hidden = len(rows) - len(shown)
            rows = shown
        header = ("module", "type", "dtype", "fwd amax fp16", "fwd amax fp32", "grad amax", "flushed@S", "verdict")
        body = [header]
        for r in rows:
            body.append(
                (
                    _label(r.name),
                    r.type,
                    (r.dtype or "-").replace("float", "f"),
                    _num(r.fwd_amax),
                    _num(r.fp32_amax),
                    "-" if r.grad_amax is None else _num(r.grad_amax),
                    "-" if r.flushed_frac is None else f"{r.flushed_frac:.2%}",
                    r.verdict,
                )
            )
        widths = [max(len(row[i]) for row in body) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in body]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if hidden:
            lines.append(f"... {hidden} more module(s): report.table(max_rows=None) or report.to_dict()")
        lines.append(
            f"FP16's largest value is {FP16.max:g}; flushed@S: share of the nonzero gradient values FP16 "
            f"stores as 0 at S = {_pow2(self.scale)} (f32 rows: the gradient is float32, nothing flushes)."
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return "\n".join(self.summary()) + "\n\n" + self.table()


def _label(name: str) -> str:
    return name or "(model)"


def _num(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def _finite_or(x: float, default: float) -> float:
    return x if math.isfinite(x) else default


def _pow2(s: float) -> str:
    m, e = math.frexp(s)
    return f"2^{e - 1}" if m == 0.5 else f"{s:g}"


# ------------------------------------------------------------------ preserving the user's model
def _buffer_keeper(model: torch.nn.Module) -> Callable[[], None]:
    """A function that puts every buffer of ``model`` back: the object (a forward may replace it) and its
    values (a BatchNorm's running statistics move in training mode)."""
    saved = [
        (m, name, b, b.detach().clone()) for m in model.modules() for name, b in m._buffers.items() if b is not None
    ]

    def restore() -> None:
        with torch.no_grad():
            for m, name, b, values in saved:
                m._buffers[name] = b
                b.copy_(values)

    return restore


class _Preserved:
    """The user's model as it was: every module's training flag, every buffer and the global RNG.

    ``replay`` puts the buffers (of the model and of any module added with ``add_buffers``, the
    shadow copy) and the RNG back as they were (each pass starts from there); ``restore`` also puts
    the training flags back (at the end).
    """

    def __init__(self, model: torch.nn.Module, cuda_devices: List[int]):
        self._modes = [(m, m.training) for m in model.modules()]
        self._buffers = [_buffer_keeper(model)]
        self._cpu_rng = torch.get_rng_state()
        self._cuda_devices = cuda_devices
        self._cuda_rng = [torch.cuda.get_rng_state(d) for d in cuda_devices]

    def add_buffers(self, module: torch.nn.Module) -> None:
        self._buffers.append(_buffer_keeper(module))

    def replay(self) -> None:
        for restore in self._buffers:
            restore()
        torch.set_rng_state(self._cpu_rng)
        for d, state in zip(self._cuda_devices, self._cuda_rng):
            torch.cuda.set_rng_state(state, d)

    def restore(self) -> None:
        self.replay()
        for m, flag in self._modes:
            m.training = flag


def _set_eval(model: torch.nn.Module) -> None:
    for m in model.modules():
        m.training = False


# ------------------------------------------------------------------ hooking every module
def _floats(value) -> List[torch.Tensor]:
    """The floating tensors in a module's inputs or outputs (nested), in order."""
    return [t for t in _fp32.tensors_in(value) if t.is_floating_point()]


def _amax(ts: List[torch.Tensor]) -> torch.Tensor:
    """Largest ``|x|`` over the tensors, in float32, NaN when any holds NaN (amax propagates it)."""
    parts = [t.detach().abs().amax().float() for t in ts if t.numel()]
    return torch.stack([p.to(parts[0].device) for p in parts]).amax() if parts else torch.zeros(())


def _finite(ts: List[torch.Tensor]) -> torch.Tensor:
    parts = [torch.isfinite(t.detach()).all() for t in ts if t.numel()]
    return torch.stack([p.to(parts[0].device) for p in parts]).all() if parts else torch.ones((), dtype=torch.bool)


class _Call:
    """One forward call of one module: device tensors until the pass is read."""

    __slots__ = ("in_finite", "out_amax", "out_finite", "dtypes", "depth", "outputs", "rel_error", "grads")

    def __init__(self):
        self.in_finite = self.out_amax = self.out_finite = self.rel_error = None
        self.dtypes: Tuple[str, ...] = ()
        self.depth = 0
        self.outputs: Optional[List[torch.Tensor]] = None
        self.grads: List[Tuple[GradStats, torch.Tensor]] = []


class _Pass:
    """Hooks every module of ``model`` for one pass and records each call (see ``_Call``).

    ``grad_scale``: register tensor hooks on the outputs that collect their gradients' statistics at
    that scale. ``keep_outputs``: store detached float32 copies of the outputs (the FP32 agreement
    pass). ``compare``: a finished keep_outputs pass to compare this pass's outputs against.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        grad_scale: Optional[float] = None,
        keep_outputs: bool = False,
        compare: Optional["_Pass"] = None,
    ):
        self.names = [name for name, _ in model.named_modules()]
        self.leaf = {name: not any(True for _ in m.children()) for name, m in model.named_modules()}
        self.calls: Dict[str, List[_Call]] = {}
        self.order: List[str] = []
        self._stack: Dict[str, List[_Call]] = {}
        self._leaves_done = 0
        self._grad_scale, self._keep, self._compare = grad_scale, keep_outputs, compare
        self._handles = []
        for name, m in model.named_modules():
            self._handles.append(m.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post(name), with_kwargs=True))

    def _pre(self, name: str):
        def hook(module, args, kwargs):
            call = _Call()
            call.in_finite = _finite(_floats((args, kwargs)))  # before the module runs: in-place ops change them
            self._stack.setdefault(name, []).append(call)

        return hook

    def _post(self, name: str):
        def hook(module, args, kwargs, output):
            call = self._stack[name].pop()
            outs = _floats(output)
            if self.leaf[name]:
                self._leaves_done += 1
            call.depth = self._leaves_done
            call.dtypes = tuple(str(t.dtype).replace("torch.", "") for t in outs)
            call.out_amax, call.out_finite = _amax(outs), _finite(outs)
            if name not in self.calls:
                self.order.append(name)
            calls = self.calls.setdefault(name, [])
            if self._keep:
                call.outputs = [t.detach().float().clone() for t in outs]
            if self._compare is not None:
                theirs = self._compare.calls.get(name, [])
                if len(calls) < len(theirs):
                    call.rel_error = _rel_error(outs, theirs[len(calls)].outputs)
            if self._grad_scale is not None and torch.is_grad_enabled():
                for t in outs:
                    if t.requires_grad:
                        t.register_hook(self._grad_hook(call))
            calls.append(call)

        return hook

    def _grad_hook(self, call: _Call):
        def hook(grad: torch.Tensor) -> None:
            g = grad.detach()
            call.grads.append((grad_stats([g], scale=self._grad_scale, fmt="fp16"), _amax([g])))

        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _rel_error(ours: List[torch.Tensor], theirs: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """``max|a - b| / max(amax(b), FP16's smallest normal)`` over matching tensors (None if none match).
    The floor keeps a module whose FP32 output is ~0 from dividing by ~0."""
    pairs = [(a, b) for a, b in zip(ours, theirs) if a.shape == b.shape]
    if not pairs:
        return None
    err = _amax([a.detach().float() - b.to(a.device) for a, b in pairs])
    ref = _amax([b for _, b in pairs])
    return err / torch.clamp(ref, min=FP16.smallest_normal)


def _read(tensors: List[Optional[torch.Tensor]]) -> List[Optional[float]]:
    """Read scalar device tensors in one transfer per device (None entries stay None)."""
    present = [t for t in tensors if t is not None]
    if not present:
        return [None] * len(tensors)
    device = present[0].device
    values = iter(torch.stack([t.reshape(()).to(device, torch.float32) for t in present]).tolist())
    return [None if t is None else next(values) for t in tensors]


class _Read:
    """A finished pass read on the host: per module, every call's figures merged."""

    def __init__(self, p: _Pass):
        flat: List[Optional[torch.Tensor]] = []
        for name in p.order:
            for c in p.calls[name]:
                flat += [c.in_finite, c.out_amax, c.out_finite, c.rel_error]
        values = iter(_read(flat))
        self.order = list(p.order)
        self.calls = {name: len(p.calls[name]) for name in p.order}
        self.amax: Dict[str, float] = {}
        self.own_overflow: Dict[str, bool] = {}
        self.nonfinite_input: Dict[str, bool] = {}
        self.nonfinite: Dict[str, bool] = {}
        self.dtypes: Dict[str, Tuple[str, ...]] = {}
        self.rel_error: Dict[str, Optional[float]] = {}
        self.depth: Dict[str, int] = {}  # leaf modules run when its first call ended
        for name in p.order:
            amax, own, bad_in, bad_out, errs = 0.0, False, False, False, []
            dtypes: List[str] = []
            for c in p.calls[name]:
                in_ok, a, out_ok, rel = (next(values) for _ in range(4))
                amax = a if math.isnan(a) or math.isnan(amax) else max(amax, a)
                own |= bool(in_ok) and not out_ok
                bad_in |= not in_ok
                bad_out |= not out_ok
                dtypes += [d for d in c.dtypes if d not in dtypes]
                if rel is not None:
                    errs.append(rel)
            self.amax[name], self.own_overflow[name] = amax, own
            self.nonfinite_input[name], self.nonfinite[name] = bad_in, bad_out
            self.dtypes[name] = tuple(dtypes)
            self.depth[name] = p.calls[name][0].depth
            self.rel_error[name] = (math.nan if any(math.isnan(e) for e in errs) else max(errs)) if errs else None


# ------------------------------------------------------------------ the passes
def _run(loss_fn: Callable, model: torch.nn.Module, batch) -> torch.Tensor:
    loss = loss_fn(model, batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise ValueError(
            f"loss_fn returned {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            + "; loss_fn(model, batch) must return the batch's loss as a floating tensor with one "
            "element (e.g. lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))."
        )
    return loss.reshape(())


def _fp16_forward(model, loss_fn, batch, device_type: str, *, grad: bool, compare: Optional[_Pass] = None):
    rec = _Pass(model, compare=compare)
    try:
        with torch.set_grad_enabled(grad), torch.autocast(device_type, dtype=torch.float16):
            loss = _run(loss_fn, model, batch)
        value = float(loss.detach().float())
    finally:
        rec.close()
    return _Read(rec), value


def _minimal(names: List[str]) -> List[str]:
    """The names none of whose submodules is in ``names`` (by name: ``a.b`` is inside ``a``; all is inside "")."""

    def inside(child: str, parent: str) -> bool:
        return child != parent and (parent == "" or child.startswith(parent + "."))

    return [n for n in names if not any(inside(o, n) for o in names)]


def _known_answer(device: torch.device) -> Dict[str, str]:
    """The known-answer kernels (see the module docstring), each ``"ok"`` or what went wrong."""
    out: Dict[str, str] = {}
    for name, case in _KNOWN_ANSWER_CASES:
        try:
            got, want, bound = case(device)
        except Exception as e:  # a kernel that fails to run on this device is a failed check, not a crash
            out[name] = f"raised {type(e).__name__}: {e}"
            continue
        got64 = got.detach().double().cpu()
        err = (got64 - want).abs()
        if not bool(torch.isfinite(got64).all()):
            out[name] = f"{int((~torch.isfinite(got64)).sum())} non-finite values where every answer is finite"
        elif bool((err > bound).any()):
            i = int(torch.argmax(err - bound))
            out[name] = (
                f"{int((err > bound).sum())} wrong values; the worst is off by {float(err.flatten()[i]):.3g} "
                f"where FP16 rounding allows {float(bound.flatten()[i]):.3g}"
            )
        else:
            out[name] = "ok"
    return out


def _pattern(shape, a: int, b: int) -> torch.Tensor:
    """Values in {-1, -1/2, 0, 1/2, 1} from a fixed integer pattern: exact in FP16, and so are their
    products (multiples of 1/4) and every partial sum of fewer than 2^12 of them."""
    idx = torch.arange(math.prod(shape), dtype=torch.float64)
    return (torch.remainder(idx * a + b, 5) - 2).reshape(shape) / 2


def _exact_linear(device):
    x, w, bias = _pattern((8, 32), 3, 1), _pattern((16, 32), 7, 2), _pattern((16,), 1, 0)
    g = _pattern((8, 16), 2, 3)
    xd, wd = (t.float().to(device).requires_grad_() for t in (x, w))
    with torch.autocast(device.type, dtype=torch.float16):
        y = torch.nn.functional.linear(xd, wd, bias.float().to(device))
    dx, dw = torch.autograd.grad(y, (xd, wd), g.to(device, y.dtype))
    got = torch.cat([y.detach().double().cpu().flatten(), dx.double().cpu().flatten(), dw.double().cpu().flatten()])
    want = torch.cat([(x @ w.T + bias).flatten(), (g @ w).flatten(), (g.T @ x).flatten()])
    return got, want, torch.zeros_like(want)


def _exact_bmm(device):
    a, b = _pattern((2, 8, 16), 3, 4), _pattern((2, 16, 8), 2, 1)
    with torch.autocast(device.type, dtype=torch.float16):
        y = torch.bmm(a.float().to(device), b.float().to(device))
    return y, a @ b, torch.zeros(2, 8, 8, dtype=torch.float64)


def _exact_conv(device):
    x, w = _pattern((2, 3, 8, 8), 3, 2), _pattern((4, 3, 3, 3), 7, 1)
    g = _pattern((2, 4, 6, 6), 2, 0)
    xd, wd = (t.float().to(device).requires_grad_() for t in (x, w))
    with torch.autocast(device.type, dtype=torch.float16):
        y = torch.nn.functional.conv2d(xd, wd)
    dx, dw = torch.autograd.grad(y, (xd, wd), g.to(device, y.dtype))
    x64, w64 = x.clone().requires_grad_(), w.clone().requires_grad_()
    y64 = torch.nn.functional.conv2d(x64, w64)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), g)
    got = torch.cat([t.detach().double().cpu().flatten() for t in (y, dx, dw)])
    want = torch.cat([t.detach().flatten() for t in (y64, dx64, dw64)])
    return got, want, torch.zeros_like(want)


def _bounded_matmul(device):
    k = 64
    a = torch.sin(torch.arange(16 * k, dtype=torch.float64) * 0.37).reshape(16, k).float()
    b = torch.cos(torch.arange(k * 16, dtype=torch.float64) * 0.91).reshape(k, 16).float()
    with torch.autocast(device.type, dtype=torch.float16):
        y = torch.mm(a.to(device), b.to(device))
    a64, b64 = a.double(), b.double()
    n = k + 3  # K products and sums, the two inputs' roundings to FP16, the output's
    gamma = n * _U16 / (1 - n * _U16)
    return y, a64 @ b64, gamma * (a64.abs() @ b64.abs())


_KNOWN_ANSWER_CASES = (
    ("linear fwd+bwd (exact)", _exact_linear),
    ("bmm (exact)", _exact_bmm),
    ("conv2d fwd+bwd (exact)", _exact_conv),
    ("matmul (rounding bound)", _bounded_matmul),
)


# ------------------------------------------------------------------ audit
def _check_args(model, loss_fn, scale, max_rounds) -> None:
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model={model!r} must be a torch.nn.Module (the model to audit).")
    if not callable(loss_fn):
        raise ValueError(
            f"loss_fn={loss_fn!r} must be callable as loss_fn(model, batch) -> loss tensor, e.g. "
            "lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])."
        )
    if scale is not None and not hasattr(scale, "get_scale"):
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < scale < math.inf):
            raise ValueError(
                f"scale={scale!r} must be a positive finite number, a GradScaler (its get_scale() is "
                "read), or None (the largest safe power of two)."
            )
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
        raise ValueError(
            f"max_rounds={max_rounds!r} must be an int >= 1 (rounds of keeping modules in FP32 "
            "and running the FP16 forward again), e.g. 16."
        )


def _device_of(model: torch.nn.Module, batch) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    found = _fp32.tensors_in(batch)
    return found[0].device if found else torch.device("cpu")


def _cuda_devices(model: torch.nn.Module, batch) -> List[int]:
    found = {t.device.index for t in list(model.parameters()) + list(model.buffers()) if t.device.type == "cuda"}
    found |= {t.device.index for t in _fp32.tensors_in(batch) if t.device.type == "cuda"}
    return sorted(i if i is not None else torch.cuda.current_device() for i in found)


def _shadow_of(model: torch.nn.Module) -> Tuple[torch.nn.Module, bool]:
    """The FP32 shadow: the model itself when it is all float32 already, else a float32 deep copy."""
    tensors = list(model.parameters()) + list(model.buffers())
    if all(t.dtype == torch.float32 for t in tensors if t.is_floating_point()):
        return model, False
    return copy.deepcopy(model).float(), True


def _safe_scale(amaxes: List[float]) -> float:
    """The largest power of two ``S`` with ``amax * S * 2^MARGIN_BITS <= FP16.max``, capped at MAX_SCALE."""
    amax = max([a for a in amaxes if math.isfinite(a)], default=0.0)
    if amax == 0.0:
        return MAX_SCALE
    # Exact floor(log2(max / amax)) from the binary exponents, as lossscale.recommend_scale computes it.
    m_max, e_max = math.frexp(FP16.max)
    m_a, e_a = math.frexp(amax)
    k = e_max - e_a - (1 if m_max < m_a else 0) - MARGIN_BITS
    return min(math.ldexp(1.0, k), MAX_SCALE)


def audit(model: torch.nn.Module, loss_fn: Callable, batch, *, scale=None, max_rounds: int = 16) -> AuditReport:
    """Audit one batch of ``model`` under FP16 autocast against an FP32 shadow, module by module.

    Args:
        model: the model as you train it (float32 parameters under autocast, in training mode).
        loss_fn: ``loss_fn(model, batch) -> loss``, called once per pass, e.g.
            ``lambda m, b: F.cross_entropy(m(b[0]), b[1])`` or ``lambda m, b: m(**b).loss``.
        batch: one batch, passed to ``loss_fn`` as it is (its float16/bfloat16 tensors are cast to
            float32 for the FP32 shadow).
        scale: the loss scale to judge the backward at: a positive number, a ``GradScaler`` (its
            ``get_scale()``: one host sync), or None for the largest safe power of two (see
            ``lossscale.auditing`` for the rule).
        max_rounds: how many times at most the first-cause modules of the forward overflows are kept
            in FP32 and the FP16 forward run again (each round finds the overflows the last one hid).

    Returns:
        An ``AuditReport``: ``print(report)`` for the table, ``report.keep_fp32`` for
        ``lossscale.keep_fp32``, ``report.to_dict()`` as plain data.

    The model is left exactly as it was (parameters, ``.grad``, buffers, training flags, hooks, the
    modules kept in FP32, the global RNG): see ``lossscale.auditing``. Syncs host and device many times.

    Raises:
        ValueError: ``model`` is not a module, ``loss_fn`` not callable or returns no scalar loss tensor,
            a bad ``scale`` or ``max_rounds``.
    """
    _check_args(model, loss_fn, scale, max_rounds)
    device = _device_of(model, batch)
    scale_source, given = "largest safe", None
    if scale is not None:
        scale_source = "scaler" if hasattr(scale, "get_scale") else "given"
        given = float(scale.get_scale()) if scale_source == "scaler" else float(scale)  # get_scale() syncs
        if not 0 < given < math.inf:
            raise ValueError(f"scale: the scaler's scale is {given!r}; audit needs a positive finite scale.")
    already_kept = _fp32.kept_modules(model)
    notes: List[str] = []
    kept = _Preserved(model, _cuda_devices(model, batch))
    try:
        shadow, copied = _shadow_of(model)
        if copied:  # its buffers move in the training pass too, and the eval pass must see the model's
            kept.add_buffers(shadow)
            notes.append("the FP32 shadow is a float32 deep copy of the model (it holds non-float32 tensors).")
        shadow_batch = _fp32.to_float32(batch)
        kept.replay()
        p32, loss_fp32, param_grads = _shadow_pass(shadow, loss_fn, shadow_batch, device, given, notes)
        fp32_read = _Read(p32)
        rounds = _Rounds(model, loss_fn, batch, device, kept.replay)
        try:
            rounds.run(fp32_read, already_kept, max_rounds, notes)
            agree, ref = _agreement(model, shadow, loss_fn, batch, shadow_batch, device, kept.replay)
        finally:
            rounds.remove()
    finally:
        kept.restore()
    hardware = _hardware_verdict(_known_answer(device), agree, ref)

    # 3. The scale, and the backward figures at it.
    grad_fp16 = {n: "float16" in rounds.final.dtypes.get(n, ()) for n in fp32_read.order}
    stats = _grad_figures(p32, fp32_read.order)
    candidates = [a for n, (_, a) in stats.items() if grad_fp16[n] and a is not None]
    candidates += _own_param_amaxes(shadow, [n for n in fp32_read.order if grad_fp16[n]], param_grads)
    safe = _safe_scale(candidates)
    if any(not math.isfinite(a) for a in candidates):
        notes.append(
            "the FP32 shadow's gradients hold inf or NaN: a model or data problem; the safe scale fits the finite ones."
        )
    S = safe if given is None else given
    if S < 1.0:
        notes.append(f"the scale {_pow2(S)} is below 1: these gradients are too large for FP16 even unscaled.")

    first, named = rounds.first, dict(model.named_modules())
    modules: Dict[str, ModuleAudit] = {}
    leaf_stats: List[GradStats] = []
    for name in first.order + [n for n in fp32_read.order if n not in first.calls]:
        row = ModuleAudit(name=name, type=type(named[name]).__name__ if name in named else "?")
        if name in first.calls:
            row.calls, row.fwd_amax = first.calls[name], first.amax[name]
            row.dtype = first.dtypes[name][0] if first.dtypes[name] else None
            row.fwd_overflow, row.nonfinite_input = first.own_overflow[name], first.nonfinite_input[name]
        if name in fp32_read.calls:
            row.fp32_amax, row.fp32_nonfinite = fp32_read.amax[name], fp32_read.nonfinite[name]
        st, row.grad_amax = stats.get(name, (None, None))
        row.grad_fp16 = grad_fp16.get(name, False)
        if st is not None and row.grad_fp16:
            at = st if given is not None else st.at(S)  # measured at 1 when S was unknown: S is a power of two
            row.flushed_frac, row.grad_overflow = at.frac_of_nonzero("flushed"), at.overflow > 0
            if _leaf(named.get(name)):
                leaf_stats.append(at)
        row.rel_error = agree.rel_error.get(name)
        modules[name] = row
    fp32_bad = _minimal([n for n in fp32_read.order if fp32_read.nonfinite[n] and not fp32_read.nonfinite_input[n]])
    _write_verdicts(modules, rounds.found, already_kept, fp32_bad, hardware)
    report = AuditReport(
        device=str(device),
        scale=S,
        scale_source=scale_source,
        safe_scale=safe,
        loss_fp16=rounds.loss_first,
        loss_fp16_kept=rounds.loss_final,
        loss_fp32=loss_fp32,
        keep_fp32=rounds.found,
        already_kept=already_kept,
        forward_finite=rounds.forward_finite,
        fp32_nonfinite=fp32_bad,
        batch_finite=bool(_finite(_floats(batch))),
        backward_overflow=[n for n, r in modules.items() if r.grad_overflow],
        flushed_frac=_merged_flush(leaf_stats),
        hardware=hardware,
        modules=modules,
        notes=notes,
    )
    # Beside keep_fp32: where the residual stream is what overflows, rescaling it keeps every module in FP16.
    from .rescaling import audit_advice

    advice = audit_advice(model, report)
    if advice is not None:
        notes.append(advice)
    return report


def _shadow_pass(shadow, loss_fn, batch, device, given, notes):
    """1. The FP32 shadow in training mode, forward and backward: (the pass, the loss, {param id: grad}).
    The output gradients' statistics are taken at the given scale, or at 1 (then judged with ``at``)."""
    params = [p for p in shadow.parameters() if p.requires_grad]
    p32 = _Pass(shadow, grad_scale=1.0 if given is None else given)
    try:
        with torch.enable_grad(), torch.autocast(device.type, enabled=False):
            loss = _run(loss_fn, shadow, batch)
        if not loss.requires_grad:
            params = []
        grads = torch.autograd.grad(loss, params, allow_unused=True) if params else ()
    finally:
        p32.close()
    if not params:
        notes.append("the loss depends on no parameter that requires grad: the backward figures are empty.")
    # By identity: a tied weight (GPT-2's lm_head and wte) has one name but belongs to both modules.
    return p32, float(loss.detach()), {id(p): g for p, g in zip(params, grads)}


class _Rounds:
    """2. FP16 forwards in training mode: keep the first causes of forward overflows in FP32 and run
    again, until the forward is finite. ``first`` is the model as given, ``final`` the last round."""

    def __init__(self, model, loss_fn, batch, device, replay):
        self._args = (model, loss_fn, batch, device.type)
        self._replay = replay
        self._handles: List[_fp32.KeepFP32Handle] = []
        self.found: List[str] = []

    def _forward(self):
        self._replay()
        return _fp16_forward(*self._args, grad=True)

    def run(self, fp32_read: "_Read", already_kept: List[str], max_rounds: int, notes: List[str]) -> None:
        self.first, self.loss_first = read, loss = self._forward()
        for _ in range(max_rounds):
            causes = _minimal([n for n in read.order if read.own_overflow[n]])
            # A module FP32 cannot keep finite is a model problem: keeping it would not help.
            new = [
                n for n in causes if n not in self.found and n not in already_kept and not fp32_read.nonfinite.get(n)
            ]
            if not new:
                break
            try:
                self._handles.append(_fp32.keep_fp32(self._args[0], new))
            except ValueError as e:
                notes.append(f"cannot keep {new!r} in FP32: {e}")
                break
            self.found += new
            read, loss = self._forward()
        else:
            if any(read.own_overflow.values()):
                notes.append(
                    f"the FP16 forward still overflows after {max_rounds} rounds; run audit again after "
                    "keep_fp32, or pass a larger max_rounds."
                )
        self.final, self.loss_final = read, loss
        self.forward_finite = math.isfinite(loss) and not any(read.nonfinite.values())

    def remove(self) -> None:
        """Un-keep the modules the rounds kept."""
        for h in self._handles:
            h.remove()


def _agreement(model, shadow, loss_fn, batch, shadow_batch, device, replay) -> Tuple["_Read", "_Read"]:
    """4b. Both in eval mode without grad (no dropout: the same computation), FP32 first, its outputs kept;
    then FP16 compared against them module by module. Returns (FP16 read, FP32 read)."""
    replay()
    _set_eval(shadow)
    _set_eval(model)
    ref = _Pass(shadow, keep_outputs=True)
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            _run(loss_fn, shadow, shadow_batch)
    finally:
        ref.close()
    replay()
    agree, _ = _fp16_forward(model, loss_fn, batch, device.type, grad=False, compare=ref)
    return agree, _Read(ref)


def _grad_figures(p32: "_Pass", order: List[str]) -> Dict[str, Tuple[Optional[GradStats], Optional[float]]]:
    """Per module: its output gradients' merged statistics and their amax (NaN if any was NaN)."""
    out: Dict[str, Tuple[Optional[GradStats], Optional[float]]] = {}
    for name in order:
        gs = [g for c in p32.calls[name] for g in c.grads]
        if not gs:
            out[name] = (None, None)
            continue
        merged = gs[0][0]
        for st, _ in gs[1:]:
            merged = merged.merge(st)
        amaxes = _read([a for _, a in gs])
        out[name] = (merged, math.nan if any(math.isnan(a) for a in amaxes) else max(amaxes))
    return out


def _own_param_amaxes(shadow, names: List[str], grads: Dict[int, torch.Tensor]) -> List[float]:
    """The amaxes of the gradients of the modules' own parameters: autocast's backward computes a weight's
    gradient in FP16 where the module's output is FP16 (the cast's backward only then widens it)."""
    modules = dict(shadow.named_modules())
    own = [grads.get(id(p)) for n in names if n in modules for p in modules[n].parameters(recurse=False)]
    return [a for a in _read([_amax([g]) for g in own if g is not None]) if a is not None]


def _write_verdicts(
    modules: Dict[str, ModuleAudit],
    found: List[str],
    already_kept: List[str],
    fp32_bad: List[str],
    hardware: "HardwareCheck",
) -> None:
    for name, r in modules.items():
        words = []
        if name in found:
            inside = math.isfinite(r.fp32_amax) and r.fp32_amax <= FP16.max
            words.append("KEEP FP32 (overflows inside)" if inside else "KEEP FP32 (output overflows)")
        elif name in already_kept:
            words.append("kept fp32")
        elif r.nonfinite_input:
            words.append("inf/nan from upstream")
        if name in fp32_bad:
            words.append("NON-FINITE IN FP32")
        if r.grad_overflow:
            words.append("BWD OVERFLOW at S")
        if name == hardware.first_disagreement:
            words.append("FP16 DISAGREES")
        r.verdict = ", ".join(words)


def _leaf(module: Optional[torch.nn.Module]) -> bool:
    return module is not None and not any(True for _ in module.children())


def _merged_flush(stats: List[GradStats]) -> float:
    if not stats:
        return 0.0
    total = stats[0]
    for st in stats[1:]:
        total = total.merge(st)
    return total.frac_of_nonzero("flushed")


def _hardware_verdict(known: Dict[str, str], agree: _Read, ref: _Read) -> HardwareCheck:
    failed = {k: v for k, v in known.items() if v != "ok"}
    if failed:
        name, why = next(iter(failed.items()))
        return HardwareCheck(
            "broken",
            known,
            detail=(
                f"this device's FP16 {name} gives wrong answers ({why}); FP16 training here cannot be trusted: "
                "train in FP32 or BF16 (GTX 16xx GPUs have been reported to do the same)."
            ),
        )
    max_ratio = 0.0
    for name in agree.order:
        err = agree.rel_error[name]
        if err is None or name not in ref.amax or agree.nonfinite_input[name]:
            continue  # not compared, or an inf/NaN from upstream reached it: judged where it began
        if agree.nonfinite[name] and (ref.nonfinite[name] or ref.amax[name] > FP16.max):
            continue  # an overflow (FP32 holds a value FP16 cannot), not a wrong answer
        tol = min(TOL_CAP, TOL_PER_LAYER * (agree.depth[name] + 1))
        if math.isfinite(err) and err <= tol:
            max_ratio = max(max_ratio, err / tol)
            continue
        return HardwareCheck(
            "disagrees",
            known,
            name,
            err,
            tol,
            max_ratio,
            detail=(
                f"the known-answer kernels pass, but the FP16 output of `{_label(name)}` departs from FP32 by "
                f"{err:.3g} of its amax where FP16 rounding through {agree.depth[name]} layer(s) allows "
                f"{tol:.3g}: an op in it gives wrong FP16 results on this device; keep it in FP32 or train in "
                "FP32/BF16."
            ),
        )
    return HardwareCheck(
        "ok",
        known,
        max_ratio=max_ratio,
        detail=(
            f"FP16 linear, bmm and conv2d give the known answers, and the model's FP16 forward agrees with FP32 at "
            f"every module (at most {max_ratio:.2g} of the tolerance)."
        ),
    )
