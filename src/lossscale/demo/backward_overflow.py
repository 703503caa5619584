"""A backward that overflows FP16 at any scale >= 1: the model, its training, and the audit-demo's section.

The model (:class:`Config`, built in code, no download) has one block whose backward overflows FP16 while
its forward and the gradient leaving it stay in range: the block divides ``down``'s output by ``gain``
and multiplies ``up``'s by it, so the forward comes back to its input's size, while the gradient between
the two is ``gain`` times the one arriving (past 65504 at scale 1 for the loss this model trains on: a
sum over tokens). A scale below 1 fits it; no scale >= 1 does.

:func:`train` runs one of :data:`SCALERS` on it (AdamW, FP16 autocast on CPU, the same data and initial
weights every time). ``benchmarks/bench_backward_overflow.py`` compares all of them; ``lossscale
audit-demo`` runs :data:`DEMO_RUNS` (:func:`run_section`): torch's ``GradScaler``, lossscale with a
floor at 1 (``min_scale=1.0``), lossscale's default, ``on_backward_overflow="upcast"`` and FP32, prints the
steps each took and a small loss table, checks its claims against what it measured and plots the
loss curves (:func:`plot_losses`, matplotlib).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..fp32 import keep_fp32
from ..scaler import GradScaler

__all__ = [
    "Config",
    "Block",
    "Model",
    "data",
    "loss_of",
    "train",
    "SCALERS",
    "DEMO_RUNS",
    "run_section",
    "plot_losses",
]


@dataclasses.dataclass(frozen=True)
class Config:
    """The model and its training: ``inputs -> inp -> block(down, up) + residual -> head``."""

    d_in: int = 16
    d: int = 32
    d_out: int = 8
    gain: float = 2.0**14  # the block's forward divides by it and multiplies back: its backward's gain
    batch: int = 256
    input_scale: float = 4.0
    lr: float = 1e-3
    steps: int = 40
    seed: int = 0


class Block(torch.nn.Module):
    """``x + gain * up(down(x) / gain)``: equal to ``x + up(down(x))`` in exact arithmetic (the trained
    weights are of the usual size), but in FP16 the gradient arriving at ``up``'s output is ``gain`` times
    the block's output gradient, while every forward value stays in range."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.gain = cfg.gain
        self.down = torch.nn.Linear(cfg.d, cfg.d)
        self.up = torch.nn.Linear(cfg.d, cfg.d, bias=False)

    def forward(self, x):
        return x + self.gain * self.up(self.down(x) / self.gain)


class Model(torch.nn.Module):
    """``inp`` -> ReLU -> :class:`Block` -> ``head``, initialised from ``cfg.seed``."""

    def __init__(self, cfg: Config):
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # the caller's random stream is left as it was
            torch.manual_seed(cfg.seed)
            self.inp = torch.nn.Linear(cfg.d_in, cfg.d)
            self.block = Block(cfg)
            self.head = torch.nn.Linear(cfg.d, cfg.d_out)

    def forward(self, x):
        return self.head(self.block(torch.relu(self.inp(x))))


def data(cfg: Config, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``: inputs and a fixed linear target of them."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(cfg.batch, cfg.d_in, generator=g) * cfg.input_scale
    w = torch.randn(cfg.d_in, cfg.d_out, generator=torch.Generator().manual_seed(7)) / cfg.d_in**0.5
    return x, x @ w


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, fp16: bool) -> torch.Tensor:
    """The squared error summed over the batch's tokens (the large-gradient case), FP16 autocast or not."""
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        out = model(x)
    return (out.float() - y).pow(2).sum()


#: The runs: how each builds its scaler from the model (None: FP32, no autocast, no scaler).
SCALERS: Dict[str, Optional[Callable[[torch.nn.Module], Any]]] = {
    "torch": lambda model: torch.amp.GradScaler("cpu"),
    "lossscale": lambda model: GradScaler(),
    "lossscale_min_scale_1": lambda model: GradScaler(min_scale=1.0),
    "lossscale_upcast": lambda model: GradScaler(model=model, trace=True, on_backward_overflow="upcast"),
    "lossscale_upcast_min_scale_1": lambda model: GradScaler(
        model=model, trace=True, on_backward_overflow="upcast", min_scale=1.0
    ),
    "lossscale_min_scale_none": lambda model: GradScaler(min_scale=None),
    "lossscale_min_scale_2**-8": lambda model: GradScaler(min_scale=2.0**-8),
    "fp32_by_hand": lambda model: GradScaler(),  # the block kept in FP32 before training (train())
    "fp32": None,
}

#: The runs of the audit-demo's section: (short name, what it runs).
DEMO_RUNS = {
    "torch": ("torch", 'torch.amp.GradScaler("cpu")'),
    "lossscale_min_scale_1": ("floor 1", "lossscale.GradScaler(min_scale=1.0)"),
    "lossscale": ("default", "lossscale.GradScaler()"),
    "lossscale_upcast": ("upcast", 'lossscale.GradScaler(model=model, trace=True, on_backward_overflow="upcast")'),
    "fp32": ("fp32", "FP32, no autocast, no scaler"),
}


def _torch_skipped(scaler, opt) -> bool:
    return any(v.item() > 0 for v in scaler._found_inf_per_device(opt).values())


def train(cfg: Config, run: str) -> Dict[str, List]:
    """One run of :data:`SCALERS`: per step the loss (before the step), whether it was skipped, the scale
    it ran with; ``events``: the scaler's warnings about modules it kept in FP32; ``upcast_modules``
    (upcast runs): the modules kept."""
    if run not in SCALERS:
        raise ValueError(f"run={run!r} must be one of {sorted(SCALERS)}.")
    model = Model(cfg)
    if run == "fp32_by_hand":
        keep_fp32(model, ["block"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    make = SCALERS[run]
    scaler = None if make is None else make(model)
    out: Dict[str, List] = {"loss": [], "skipped": [], "scale": [], "events": []}
    for step in range(cfg.steps):
        x, y = data(cfg, step)
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, x, y, fp16=scaler is not None)
        out["loss"].append(loss.item())
        if scaler is None:
            loss.backward()
            opt.step()
            out["skipped"].append(False)
            out["scale"].append(1.0)
            continue
        out["scale"].append(scaler.get_scale())
        scaler.scale(loss).backward()
        scaler.step(opt)
        skipped = _torch_skipped(scaler, opt) if run == "torch" else scaler.last_step_skipped
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # the stuck warning of a run held at a floor included
            scaler.update()
        out["skipped"].append(skipped)
        out["events"] += [f"step {step}: {w.message}" for w in caught if "now runs in FP32" in str(w.message)]
    if isinstance(scaler, GradScaler):
        kept = scaler.health().upcast_modules  # None without an upcast option
        if kept is not None:
            out["upcast_modules"] = list(kept)
        scaler.close()
    return out


def taken(run: Dict[str, List]) -> int:
    """The optimizer steps a run took."""
    return sum(not s for s in run["skipped"])


def run_section(cfg: Config = Config()) -> Dict[str, Any]:
    """The audit-demo's section: train :data:`DEMO_RUNS`, and return ``runs`` (as :func:`train`),
    ``lines`` (what it prints: the steps taken, a loss table) and ``checks`` ``(claim, passed, detail)``,
    each decided from the runs."""
    runs = {name: train(cfg, name) for name in DEMO_RUNS}
    n = {name: taken(r) for name, r in runs.items()}
    lines = [
        f"A backward that overflows FP16 at any scale >= 1 (block gain 2^{int(math.log2(cfg.gain))}, "
        f"{cfg.steps} AdamW steps):",
        f"  {'run':8s}  steps taken  final scale  scaler",
    ]
    for name, (short, label) in DEMO_RUNS.items():
        end = "-" if name == "fp32" else f"{runs[name]['scale'][-1]:g}"
        lines.append(f"  {short:8s}  {n[name]:>2d} of {cfg.steps:<3d}    {end:11s}  {label}")
    shown = sorted({0, cfg.steps // 4, cfg.steps // 2, 3 * cfg.steps // 4, cfg.steps - 1})
    lines += ["", f"  {'loss at step':12s}" + "".join(f"{s:>10d}" for s in shown)]
    for name, (short, _) in DEMO_RUNS.items():
        lines.append(f"  {short:12s}" + "".join(f"{runs[name]['loss'][s]:>10.4g}" for s in shown))
    default, torch_run, upcast = runs["lossscale"], runs["torch"], runs["lossscale_upcast"]
    checks = [
        (
            "lossscale.GradScaler() takes at least as many steps as torch's GradScaler",
            n["lossscale"] >= n["torch"],
            f"{n['lossscale']} and {n['torch']} of {cfg.steps}; the scale ends at "
            f"{default['scale'][-1]:g} and {torch_run['scale'][-1]:g}",
        ),
        (
            "a floor at 1 (min_scale=1.0) holds the scale at 1 and skips every step",
            n["lossscale_min_scale_1"] == 0 and runs["lossscale_min_scale_1"]["scale"][-1] == 1.0,
            f"{n['lossscale_min_scale_1']} of {cfg.steps} steps taken",
        ),
        (
            "on_backward_overflow='upcast' takes at least as many steps as torch's and keeps a module in FP32",
            n["lossscale_upcast"] >= n["torch"] and bool(upcast.get("upcast_modules")),
            f"{n['lossscale_upcast']} of {cfg.steps}; kept in FP32: {', '.join(upcast.get('upcast_modules', []))}",
        ),
        (
            "every run that takes steps lowers the loss, and none below FP32's",
            all(r["loss"][-1] < r["loss"][0] for name, r in runs.items() if n[name] > 0)
            and all(r["loss"][-1] >= runs["fp32"]["loss"][-1] for r in runs.values()),
            f"FP32 {runs['fp32']['loss'][0]:.4g} -> {runs['fp32']['loss'][-1]:.4g}; lossscale.GradScaler() "
            f"{default['loss'][0]:.4g} -> {default['loss'][-1]:.4g}",
        ),
    ]
    return {
        "config": dataclasses.asdict(cfg),
        "runs": runs,
        "lines": lines,
        "checks": [{"check": c, "passed": bool(ok), "detail": d} for c, ok, d in checks],
    }


def plot_losses(section: Dict[str, Any], path: str) -> str:
    """The loss curves of :func:`run_section`'s runs, by their short names; a skipped step is a dot."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 3.8), layout="constrained")
    ax = fig.subplots()
    style = {  # FP32 wide and pale underneath; torch's wide, so the runs that follow it step for step show
        "fp32": ("#bbbbbb", 4.0, "-"),
        "torch": ("#ff7f0e", 3.2, "-"),
        "lossscale_min_scale_1": ("#d62728", 1.6, "-"),
        "lossscale": ("#1f77b4", 1.6, "--"),
        "lossscale_upcast": ("#2ca02c", 1.4, ":"),
    }
    for name, (short, _) in DEMO_RUNS.items():
        r = section["runs"][name]
        color, width, line = style[name]
        steps = list(range(len(r["loss"])))
        ax.plot(steps, r["loss"], line, color=color, lw=width, label=f"{short}: {taken(r)} steps taken")
        skipped = [s for s in steps if r["skipped"][s]]
        ax.plot(skipped, [r["loss"][s] for s in skipped], ".", color=color, ms=4)
    ax.set_xlabel("step (dots: skipped steps)")
    ax.set_ylabel("training loss (sum over the batch)")
    ax.set_title("A backward that overflows FP16 at any scale >= 1", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=110)
    return path
