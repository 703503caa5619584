"""The demo's workload: sklearn digits, a small MLP, and one training loop with the loss shift ``c``.

The controlled shift: the loss is multiplied by ``c`` and the SGD learning rate divided by ``c``.
For a power-of-two ``c`` this changes nothing in FP32 (multiplying by a power of two only moves the
exponent, and SGD with momentum is linear in the gradient), so every FP32 run is bitwise the same
for every ``c``; but every FP16 gradient moves down ``log2(1/c)`` binades, towards and over FP16's
underflow cliff. That is how a 64-pixel digits MLP gets the 1e-8..1e-10 gradients of a deep network.

Everything here is plain PyTorch; the scaler under test is passed in. Nothing is downloaded: the
digits data set ships inside scikit-learn.
"""

from __future__ import annotations

import copy
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "Data",
    "load_digits_data",
    "make_mlp",
    "TrainConfig",
    "RunSpec",
    "RunResult",
    "train",
    "grads_of",
    "reference_grads",
]

#: Clip orders of :class:`RunSpec`: None (no clipping), unscale then clip (right), clip the scaled
#: gradients and let ``scaler.step`` unscale afterwards (wrong).
CLIP_ORDERS = (None, "unscale_then_clip", "clip_scaled")


@dataclass(frozen=True)
class Data:
    """Digits split into train and test tensors (pixels scaled to [0, 1])."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def n_classes(self) -> int:
        """Number of classes (10 digits)."""
        return int(self.y_train.max().item()) + 1


def load_digits_data(seed: int = 0, test_size: float = 0.25) -> Data:
    """sklearn's 8x8 digits (1797 images, shipped with scikit-learn), stratified train/test split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(
        digits.data, digits.target, test_size=test_size, random_state=seed, stratify=digits.target
    )
    # Pixels are 0..16; /16 keeps inputs in [0, 1] so the forward pass sits well inside FP16's range.
    to_x = lambda a: torch.tensor(a, dtype=torch.float32) / 16.0  # noqa: E731
    return Data(to_x(x_tr), torch.tensor(y_tr), to_x(x_te), torch.tensor(y_te))


def make_mlp(seed: int, d_in: int = 64, hidden: Sequence[int] = (64, 64), d_out: int = 10) -> torch.nn.Module:
    """An MLP with FP32 parameters (the master weights) and named layers ``fc1``, ``relu1``, ... ."""
    torch.manual_seed(seed)
    layers: "OrderedDict[str, torch.nn.Module]" = OrderedDict()
    widths = [d_in, *hidden]
    for i in range(len(hidden)):
        layers[f"fc{i + 1}"] = torch.nn.Linear(widths[i], widths[i + 1])
        layers[f"relu{i + 1}"] = torch.nn.ReLU()
    layers[f"fc{len(hidden) + 1}"] = torch.nn.Linear(widths[-1], d_out)
    return torch.nn.Sequential(layers)


@dataclass(frozen=True)
class TrainConfig:
    """What every run of one demo shares.

    Args:
        epochs: passes over the training set.
        batch_size: examples per step.
        lr: SGD learning rate of the unshifted problem (the optimizer gets ``lr / c``).
        momentum: SGD momentum.
        shift_log2: ``c = 2**-shift_log2``; 0 is the unshifted problem.
        hidden: MLP hidden widths.
        seed: model init, data order and split.
    """

    epochs: int = 10
    batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    shift_log2: int = 20
    hidden: Sequence[int] = (64, 64)
    seed: int = 0

    @property
    def c(self) -> float:
        """The loss multiplier, a power of two so that FP32 training is unchanged by it."""
        return 2.0**-self.shift_log2


@dataclass
class RunSpec:
    """One training run of the demo.

    Args:
        name: key in summary.json.
        label: legend label.
        fp16: train under FP16 autocast (FP32 master weights); False = FP32 throughout.
        make_scaler: factory called with the run's model (for ``model=`` and ``trace=``), returning a
            GradScaler (lossscale's or torch's), or None (no scaling).
        clip: None, "unscale_then_clip" or "clip_scaled"; the threshold is ``clip_norm`` of the
            unshifted problem (``clip_norm * c`` in the shifted one).
        clip_norm: clipping threshold.
        epochs: overrides :attr:`TrainConfig.epochs`.
        observe: called after every optimizer step with ``(step, model, scaler)``, when gradients are
            unscaled; returns a dict merged into that step's record (telemetry figures).
        capture_steps: steps whose (unscaled) gradients are kept, as ``{name: fp32 tensor}``.
        bad_steps: steps whose batch carries one corrupt example: its first input row is set to NaN,
            so the step's loss is NaN before any scaling (a bad batch).
        diagnose: after every skipped step, record the scaler's ``overflow_report()`` as the step's
            ``diagnosis``, and its ``counters()`` at the end (lossscale's scaler only).
    """

    name: str
    label: str
    fp16: bool = True
    make_scaler: Optional[Callable[[torch.nn.Module], Any]] = None
    clip: Optional[str] = None
    clip_norm: float = 1.0
    epochs: Optional[int] = None
    observe: Optional[Callable[..., Dict[str, Any]]] = None
    capture_steps: Sequence[int] = ()
    bad_steps: Sequence[int] = ()
    diagnose: bool = False

    def __post_init__(self):
        if self.clip not in CLIP_ORDERS:
            raise ValueError(f"clip={self.clip!r} must be one of {CLIP_ORDERS}.")
        if self.clip is not None and self.make_scaler is None:
            raise ValueError(f"clip={self.clip!r} compares clip orders around a scaler; give make_scaler.")
        if self.diagnose and self.make_scaler is None:
            raise ValueError("diagnose=True reads the scaler's overflow_report(); give make_scaler.")


@dataclass
class RunResult:
    """What one run measured.

    Attributes:
        steps: one dict per optimizer step: ``step``, ``epoch``, ``loss`` (unshifted, FP32 value),
            ``loss_scale`` (the scale the step ran with; 1.0 without a scaler), ``skipped``, plus
            the clip figures (``clip_fired``, ``true_norm``, ``applied_norm``) and whatever
            ``observe`` returned.
        epochs: one dict per epoch: ``epoch``, ``step`` (steps done), ``train_loss`` (mean),
            ``test_acc``.
        final_acc: test accuracy after the last epoch.
        unchanged_frac: fraction of weights bitwise equal to their initial value at the end.
        captured: ``{step: {param name: gradient}}`` for ``capture_steps``.
        final_scale: the scale after the last update (1.0 without a scaler).
        counters: the scaler's ``counters()`` after the last step (runs with ``diagnose``).
        wall_s: seconds the run took.
    """

    name: str
    label: str
    steps: List[Dict[str, Any]] = field(default_factory=list)
    epochs: List[Dict[str, Any]] = field(default_factory=list)
    final_acc: float = float("nan")
    unchanged_frac: float = float("nan")
    captured: Dict[int, Dict[str, torch.Tensor]] = field(default_factory=dict)
    final_scale: float = float("nan")
    counters: Dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def skipped_steps(self) -> int:
        """Steps whose optimizer update was skipped (inf/NaN gradients)."""
        return sum(1 for s in self.steps if s["skipped"])

    def series(self, key: str) -> List[Any]:
        """The per-step values of ``key`` (None where a step lacks it)."""
        return [s.get(key) for s in self.steps]


def grads_of(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """``{parameter name: gradient}`` for parameters that have one (the tensors themselves)."""
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _batches(n: int, batch_size: int, generator: torch.Generator):
    perm = torch.randperm(n, generator=generator)
    for i in range(0, n, batch_size):
        yield perm[i : i + batch_size]


def _accuracy(model: torch.nn.Module, data: Data, fp16: bool) -> float:
    # Evaluate in the precision the run trained in: an FP16 model is judged as it would be used.
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        pred = model(data.x_test).argmax(1)
    return float((pred == data.y_test).float().mean().item())


def _total_norm(grads: List[torch.Tensor]) -> float:
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])).item())


def _scale_of(scaler) -> float:
    return 1.0 if scaler is None else float(scaler.get_scale())


def _was_skipped(scaler, scale_before: float) -> bool:
    if scaler is None:
        return False
    skipped = getattr(scaler, "last_step_skipped", None)
    if isinstance(skipped, bool):  # lossscale.GradScaler knows
        return skipped
    # torch.amp.GradScaler: a skipped step is exactly one whose update() backed the scale off.
    return float(scaler.get_scale()) < scale_before


def train(spec: RunSpec, cfg: TrainConfig, data: Data, progress: Optional[Callable[[int], None]] = None) -> RunResult:
    """Train one run and measure it. ``progress(n)`` is called after every step (a tqdm ``update``)."""
    t0 = time.perf_counter()
    c = cfg.c
    model = make_mlp(cfg.seed, d_in=data.x_train.shape[1], hidden=cfg.hidden, d_out=data.n_classes)
    init = copy.deepcopy(model.state_dict())
    params = [p for p in model.parameters()]
    # lr / c: the update lr/c * (c * g) = lr * g is exact for a power-of-two c (momentum is linear).
    opt = torch.optim.SGD(params, lr=cfg.lr / c, momentum=cfg.momentum)
    scaler = spec.make_scaler(model) if spec.make_scaler is not None else None
    gen = torch.Generator().manual_seed(cfg.seed)
    res = RunResult(spec.name, spec.label)
    max_norm = spec.clip_norm * c  # the unshifted threshold, moved by the same c as the gradients
    bad = set(spec.bad_steps)
    step = 0
    epochs = spec.epochs if spec.epochs is not None else cfg.epochs
    for epoch in range(epochs):
        losses = []
        for idx in _batches(len(data.x_train), cfg.batch_size, gen):
            x = data.x_train[idx]
            if step in bad:
                x = x.clone()
                x[0] = float("nan")  # one corrupt example: a NaN loss that no loss scale can cause or cure
            with torch.autocast("cpu", dtype=torch.float16, enabled=spec.fp16):
                loss = F.cross_entropy(model(x), data.y_train[idx])
            shifted = loss * c
            opt.zero_grad(set_to_none=True)
            scale = _scale_of(scaler)
            (scaler.scale(shifted) if scaler is not None else shifted).backward()
            rec: Dict[str, Any] = {"step": step, "epoch": epoch, "loss": float(loss.item()), "loss_scale": scale}
            if spec.clip == "unscale_then_clip":
                scaler.unscale_(opt)
                true = torch.nn.utils.clip_grad_norm_(params, max_norm)
                rec["true_norm"] = float(true) / c
                rec["clip_fired"] = bool(float(true) > max_norm)
            elif spec.clip == "clip_scaled":
                # The mistake: clip_grad_norm_ sees S * g, so its norm is S times too large.
                seen = torch.nn.utils.clip_grad_norm_(params, max_norm)
                rec["true_norm"] = float(seen) / scale / c
                rec["clip_fired"] = bool(float(seen) > max_norm)
            if scaler is not None:
                scaler.step(opt)
                scaler_skipped_pending = True
            else:
                opt.step()
                scaler_skipped_pending = False
            if spec.clip is not None:
                # After step() the gradients are unscaled in place: what the optimizer applied.
                rec["applied_norm"] = _total_norm([p.grad for p in params if p.grad is not None]) / c
            if step in spec.capture_steps:
                res.captured[step] = {n: g.detach().clone() for n, g in grads_of(model).items()}
            if spec.observe is not None:
                rec.update(spec.observe(step, model, scaler))
            if scaler_skipped_pending:
                scaler.update()
            rec["skipped"] = _was_skipped(scaler, scale)
            if bad:
                rec["injected"] = step in bad
            if spec.diagnose and rec["skipped"]:
                rec["diagnosis"] = dict(scaler.overflow_report())
            res.steps.append(rec)
            losses.append(rec["loss"])
            step += 1
            if progress is not None:
                progress(1)
        finite = [x for x in losses if math.isfinite(x)]
        res.epochs.append(
            {
                "epoch": epoch,
                "step": step,
                "train_loss": sum(finite) / len(finite) if finite else float("nan"),
                "test_acc": _accuracy(model, data, spec.fp16),
            }
        )
    res.final_scale = _scale_of(scaler)
    if spec.diagnose:
        res.counters = dict(scaler.counters())
        scaler.close()  # trace=True hooked the model's modules
    res.final_acc = res.epochs[-1]["test_acc"] if res.epochs else float("nan")
    final = model.state_dict()
    same = sum(int((final[k] == init[k]).sum()) for k in init)
    res.unchanged_frac = same / sum(v.numel() for v in init.values())
    res.wall_s = time.perf_counter() - t0
    return res


def steps_per_epoch(cfg: TrainConfig, data: Data) -> int:
    """Optimizer steps in one epoch."""
    return math.ceil(len(data.x_train) / cfg.batch_size)


def reference_grads(cfg: TrainConfig, data: Data, fp16: bool = False, scale: float = 1.0) -> Dict[str, torch.Tensor]:
    """The gradients of the first batch for the freshly initialised model (shifted by ``c``).

    ``fp16=False``: the true FP32 gradients, the ones FP16 must carry. ``fp16=True``: the same
    backward under FP16 autocast with the loss scaled by ``scale`` and the gradients unscaled after
    (``scale=1`` is FP16 without loss scaling).
    """
    model = make_mlp(cfg.seed, d_in=data.x_train.shape[1], hidden=cfg.hidden, d_out=data.n_classes)
    gen = torch.Generator().manual_seed(cfg.seed)
    idx = next(_batches(len(data.x_train), cfg.batch_size, gen))
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        loss = F.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
    (loss * cfg.c * scale).backward()
    # Dividing by a power of two is exact: this is the unscale a scaler does.
    return {n: g.detach() / scale for n, g in grads_of(model).items()}
