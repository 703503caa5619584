"""``lossscale demo``: train every run, measure every claim, write the report.

The runs (all on the same data, model init and batch order, under the shift ``c = 2**-shift_log2``):

============== =================================================================================
fp32           FP32 throughout: the reference (identical for every c)
fp16_noscale   FP16 autocast, no loss scaling (C2)
static         FP16 + ``GradScaler(policy="static", init_scale=2**static_log2)`` (C3)
dynamic        FP16 + lossscale's dynamic rule from torch's 2**16, short growth interval, no cap: the
               overflow line C6 looks for lies above the default cap 2**24 under the shift (C6)
torch_default  FP16 + ``torch.amp.GradScaler("cpu")`` as shipped (C6)
adaptive       FP16 + ``GradScaler(policy="adaptive")`` (C6)
clip_right     static, unscale_ -> clip_grad_norm_ -> step (C4)
clip_wrong     static, clip_grad_norm_ on the scaled gradients -> step (C4)
static_2^k     the sweep: static scale 2**k for each k of ``sweep_log2`` (C5)
bad_*          bad batches, torch's scaler against lossscale's (not a claim: see :mod:`.bad_batches`)
============== =================================================================================
"""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import __version__
from ..scaler import GradScaler
from . import bad_batches as B
from . import claims as C
from .observe import make_observer
from .workload import Data, RunResult, RunSpec, TrainConfig, load_digits_data, reference_grads, steps_per_epoch, train

__all__ = ["DemoConfig", "DemoResult", "run_demo", "execute", "header"]


@dataclass(frozen=True)
class DemoConfig:
    """Sizes and settings of one demo. :meth:`quick` and :meth:`full` are the two presets.

    Args:
        quick: the CI-sized preset (recorded in the report).
        seed: data split, model init and batch order.
        shift_log2: the controlled shift, ``c = 2**-shift_log2``.
        epochs: epochs of the main runs.
        sweep_epochs: epochs of each static-sweep run.
        sweep_log2: the static scales ``2**k`` of the sweep.
        static_log2: the scale of the static and clip runs.
        growth_interval: the dynamic run's growth interval (torch's 2000 is longer than this demo).
        clip_norm: clip threshold of the true (unshifted) gradients.
        non_pow2_scale: the non-power-of-two scale C3 contrasts with.
        probe_every: steps between activation-gradient probes.
        hidden: MLP hidden widths.
        bad_frac: share of the batches of the bad-batch runs that carry a NaN input row.
        bad_epochs: epochs of each bad-batch run.
    """

    quick: bool = False
    seed: int = 0
    shift_log2: int = 20
    epochs: int = 40
    sweep_epochs: int = 10
    sweep_log2: Tuple[int, ...] = tuple(range(0, 43, 2))
    static_log2: int = 16
    growth_interval: int = 20
    clip_norm: float = 1.0
    non_pow2_scale: float = 1e5
    probe_every: int = 5
    hidden: Tuple[int, ...] = (64, 64)
    bad_frac: float = 0.1
    bad_epochs: int = 16

    @classmethod
    def full(cls, seed: int = 0, **changes) -> "DemoConfig":
        """The default demo (72-101 s measured on 2 shared CPU cores)."""
        return cls(quick=False, seed=seed, **changes)

    @classmethod
    def quick_preset(cls, seed: int = 0, **changes) -> "DemoConfig":
        """The CI smoke-test size (16-27 s measured on 2 shared CPU cores)."""
        base = dict(
            quick=True,
            seed=seed,
            epochs=8,
            sweep_epochs=3,
            sweep_log2=(0, 8, 16, 24, 32, 40),
            growth_interval=5,
            probe_every=8,
            bad_epochs=8,
        )
        base.update(changes)
        return cls(**base)

    def train_config(self) -> TrainConfig:
        """The shared training settings."""
        return TrainConfig(epochs=self.epochs, shift_log2=self.shift_log2, hidden=self.hidden, seed=self.seed)


@dataclass
class DemoResult:
    """Everything one demo measured."""

    config: DemoConfig
    runs: Dict[str, RunResult]
    sweep: List[Tuple[int, RunResult]]
    claims: List[C.ClaimResult]
    grads: Dict[str, Dict[str, torch.Tensor]]
    chance: float
    layer_probe: Dict[str, Dict[str, float]] = field(default_factory=dict)
    bad_batches: Optional[B.BadBatches] = None
    timings: Dict[str, float] = field(default_factory=dict)
    environment: Dict[str, Any] = field(default_factory=dict)


def _lossscale_scaler(**kw) -> Callable[[torch.nn.Module], GradScaler]:
    """A factory of lossscale scalers; telemetry on every step feeds the observer's overflow line (C6)."""

    def make(model: torch.nn.Module) -> GradScaler:
        return GradScaler("cpu", on_stuck="ignore", telemetry=1, **kw)

    return make


def _torch_scaler(model: torch.nn.Module) -> Any:
    return torch.amp.GradScaler("cpu")


def plan(cfg: DemoConfig, observe) -> Tuple[List[RunSpec], List[Tuple[int, RunSpec]]]:
    """The run specs of a demo: the main runs and the static sweep."""
    S = 2.0**cfg.static_log2
    static = dict(policy="static", init_scale=S)
    main = [
        RunSpec("fp32", "FP32", fp16=False, observe=observe),
        RunSpec("fp16_noscale", "FP16, no scaling", observe=observe),
        RunSpec(
            "static", f"FP16, static S=2^{cfg.static_log2}", make_scaler=_lossscale_scaler(**static), observe=observe
        ),
        RunSpec(
            "dynamic",
            f"FP16, lossscale dynamic (interval {cfg.growth_interval}, uncapped)",
            make_scaler=_lossscale_scaler(init_scale=2.0**16, growth_interval=cfg.growth_interval, max_scale=None),
            observe=observe,
        ),
        RunSpec("torch_default", "FP16, torch.amp.GradScaler()", make_scaler=_torch_scaler, observe=observe),
        RunSpec(
            "adaptive",
            "FP16, lossscale adaptive (default max_scale 2^24)",
            make_scaler=_lossscale_scaler(policy="adaptive"),
            observe=observe,
        ),
        RunSpec(
            "clip_right",
            "unscale_ -> clip -> step",
            make_scaler=_lossscale_scaler(**static),
            clip="unscale_then_clip",
            clip_norm=cfg.clip_norm,
        ),
        RunSpec(
            "clip_wrong",
            "clip scaled grads -> step",
            make_scaler=_lossscale_scaler(**static),
            clip="clip_scaled",
            clip_norm=cfg.clip_norm,
        ),
    ]
    sweep = [
        (
            k,
            RunSpec(
                f"static_2^{k}",
                f"static 2^{k}",
                make_scaler=_lossscale_scaler(policy="static", init_scale=2.0**k),
                epochs=cfg.sweep_epochs,
            ),
        )
        for k in cfg.sweep_log2
    ]
    return main, sweep


def _progress_factory(enabled: bool):
    """``open(total, desc) -> (update, close)`` using tqdm when available and enabled."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the demo extra brings tqdm; without it, no bars
        tqdm = None

    def open_bar(total: int, desc: str):
        if not enabled or tqdm is None:
            return None, (lambda: None)
        bar = tqdm(
            total=total, desc=desc, unit="step", leave=False, dynamic_ncols=True, file=sys.stderr, disable=None
        )  # None: no bar when stderr is not a terminal (CI logs)
        return bar.update, bar.close

    return open_bar


def execute(cfg: DemoConfig, *, progress: bool = True, log: Callable[[str], None] = print) -> DemoResult:
    """Train every run of ``cfg`` and compute the claims (no files written).

    Runs torch on one thread: the demo's matrices are 64 wide, a second thread only adds
    synchronisation, and on a busy machine OpenMP's spinning threads made it 10x slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _execute(cfg, progress, log)
    finally:
        torch.set_num_threads(threads)


def header(cfg: DemoConfig, steps_per_epoch: int) -> List[str]:
    """The lines ``lossscale demo`` starts with: what it trains, and the loss shift in plain words."""
    k = cfg.shift_log2
    return [
        f"lossscale demo: a small MLP {list(cfg.hidden)} on sklearn's digits, {cfg.epochs} epochs of "
        f"{steps_per_epoch} steps" + (" (quick)" if cfg.quick else ""),
        f"  On purpose, the demo multiplies the loss by 2^-{k} (and the learning rate by 2^{k} to make up",
        "  for it), so that this small model's gradients are as tiny as a deep network's and fall off FP16's",
        "  underflow cliff. FP32 is unaffected: it trains bit for bit as without the shift.",
    ]


def _execute(cfg: DemoConfig, progress: bool, log: Callable[[str], None]) -> DemoResult:
    t_start = time.perf_counter()
    timings: Dict[str, float] = {}
    data = load_digits_data(cfg.seed)
    tc = cfg.train_config()
    observe = make_observer(tc, data, probe_every=cfg.probe_every)
    main, sweep_specs = plan(cfg, observe)
    spe = steps_per_epoch(tc, data)
    bad_steps = B.pick_bad_steps(cfg.bad_epochs * spe, cfg.bad_frac, cfg.seed)
    bad_specs = B.plan(bad_steps, cfg.bad_epochs)
    open_bar = _progress_factory(progress)
    runs: Dict[str, RunResult] = {}
    # One column for all.
    width = max(len(spec.label) for spec in main + [spec for _, spec in sweep_specs] + bad_specs)

    def do(spec: RunSpec) -> RunResult:
        epochs = spec.epochs if spec.epochs is not None else tc.epochs
        update, close = open_bar(epochs * spe, f"{spec.name:<14}")
        try:
            res = train(spec, tc, data, progress=update)
        finally:
            close()
        log(
            f"  {spec.label:<{width}}  acc {100 * res.final_acc:5.1f}%  skipped {res.skipped_steps:4d}  "
            f"{res.wall_s:5.1f}s"
        )
        timings[spec.name] = round(res.wall_s, 3)
        return res

    for line in header(cfg, spe):
        log(line)
    for spec in main:
        runs[spec.name] = do(spec)
    log(f"static-scale sweep: 2^{cfg.sweep_log2[0]} .. 2^{cfg.sweep_log2[-1]}, {cfg.sweep_epochs} epochs each")
    sweep = [(k, do(spec)) for k, spec in sweep_specs]
    log(
        f"bad batches: {len(bad_steps)} of {cfg.bad_epochs * spe} batches carry a NaN input row, "
        f"{cfg.bad_epochs} epochs each"
    )
    t0 = time.perf_counter()
    bad_runs = {spec.name: do(spec) for spec in bad_specs}
    bad = B.BadBatches(
        bad_runs, B.figures(bad_runs, bad_steps), cfg.bad_epochs, cfg.bad_frac, wall_s=time.perf_counter() - t0
    )
    timings["bad_batches"] = round(bad.wall_s, 3)

    t0 = time.perf_counter()
    S = 2.0**cfg.static_log2
    grads = {
        "fp32": reference_grads(tc, data),
        "fp16": reference_grads(tc, data, fp16=True),
        "fp16_scaled": reference_grads(tc, data, fp16=True, scale=S),
    }
    counts = torch.bincount(data.y_test)
    chance = float(counts.max()) / float(counts.sum())
    results = [
        C.c1_fp16_facts(),
        C.c2_underflow_stalls(tc, runs["fp32"], runs["fp16_noscale"], grads["fp32"], grads["fp16"], chance),
        C.c3_power_of_two_scaling(
            runs["fp32"], runs["static"], S, grads["fp32"], grads["fp16_scaled"], grads["fp16"], cfg.non_pow2_scale
        ),
        C.c4_clip_order(runs["fp32"], runs["clip_right"], runs["clip_wrong"], S, cfg.clip_norm),
        C.c5_static_sweep(runs["fp32"], sweep, grads["fp32"]),
        C.c6_dynamic_scaling(
            runs["fp32"], runs["dynamic"], runs["torch_default"], runs["adaptive"], cfg.growth_interval
        ),
    ]
    layer_probe = _layer_probe(
        tc,
        data,
        {
            "no scaling": 1.0,
            f"static S=2^{cfg.static_log2}": S,
            "dynamic, final S": runs["dynamic"].steps[-1]["loss_scale"],
        },
    )
    timings["claims"] = round(time.perf_counter() - t0, 3)
    timings["total_train_and_measure"] = round(time.perf_counter() - t_start, 3)
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "lossscale": __version__,
    }
    return DemoResult(cfg, runs, sweep, results, grads, chance, layer_probe, bad, timings, env)


def _layer_probe(tc: TrainConfig, data: Data, scales: Dict[str, float]) -> Dict[str, Dict[str, float]]:
    """Per layer, the share of exact activation gradients FP16 flushes at each scale (fresh model, first batch)."""
    from .observe import probe_activations
    from .workload import make_mlp

    model = make_mlp(tc.seed, d_in=data.x_train.shape[1], hidden=tc.hidden, d_out=data.n_classes)
    out: Dict[str, Dict[str, float]] = {}
    for label, s in scales.items():
        probed = probe_activations(model, tc, data.x_train[:256], data.y_train[:256], s)
        out[label] = {k.split("/")[1]: v for k, v in probed.items() if k.count("/") == 2 and k.endswith("flushed_frac")}
    return out


def run_demo(
    out_dir: str = "lossscale-report",
    *,
    quick: bool = False,
    seed: int = 0,
    progress: bool = True,
    log: Callable[[str], None] = print,
    **changes,
) -> Dict[str, Any]:
    """Run the demo and write ``out_dir/index.html``, its PNGs and ``summary.json``; returns the summary.

    ``changes`` override :class:`DemoConfig` fields (e.g. ``epochs=5``).

    Raises:
        ValueError: ``out_dir`` is a file or cannot be created or written; checked before training.
    """
    from ..report.html import check_out_dir
    from .render import render, terminal_summary

    cfg = DemoConfig.quick_preset(seed, **changes) if quick else DemoConfig.full(seed, **changes)
    check_out_dir(out_dir)  # before a minute of training, not after it
    t0 = time.perf_counter()
    result = execute(cfg, progress=progress, log=log)
    t1 = time.perf_counter()
    summary = render(result, out_dir)
    result.timings["report"] = round(time.perf_counter() - t1, 3)
    summary["timings"]["report"] = result.timings["report"]
    summary["timings"]["total"] = round(time.perf_counter() - t0, 3)
    from .render import write_summary

    write_summary(summary, out_dir)
    log(terminal_summary(summary, out_dir))
    return summary
