"""lossscale.GradScaler vs torch.amp.GradScaler: the optimizer side of an iteration, side by side.

    python benchmarks/bench_scaler.py                  # the full table (~1M, 10M, 50M parameters)
    python benchmarks/bench_scaler.py --quick          # a smoke run (tiny sizes, a few repeats)
    python benchmarks/bench_scaler.py --settings default   # lossscale at its defaults (torch-like otherwise)

Writes ``benchmarks/results/bench_scaler.json`` and ``bench_scaler.md`` (``--out`` to change).

Method. Both scalers run in the same process on the same parameters, whose scaled FP32 gradients
(FP32 master weights, as under autocast) are restored before every timed call (untimed), so every
call sees the same values in the same memory; each side has its own optimizer objects. Each
measurement alternates torch and lossscale (which goes first alternates too), repeats, and reports
the median of each side and the median of the per-repeat ratios (lossscale / torch; below 1 is
faster). ``torch.set_num_threads(1)`` by default, as in the issue's reference numbers: on a shared
2-core machine one thread is what can be measured stably.
The scale is 2**16 and never changes (no overflow, growth_interval huge).

Rows (each "lossscale vs torch"):

* ``check+unscale+update``: ``step`` + ``update`` with an optimizer whose ``step()`` does nothing
  (the scaler's own work: gather, check+unscale, the skip decision, the policy update).
* ``fused check+update``: the same with a no-op optimizer that declares amp-scaling support, the
  fused-optimizer path (read-only check, ``grad_scale``/``found_inf`` hand-off, update).
* ``clip``: ``scaler.clip_grad_norm_(opt, 1.0)`` vs ``scaler.unscale_(opt)`` +
  ``torch.nn.utils.clip_grad_norm_(params, 1.0)``.
* ``iter SGD`` / ``iter Adam`` / ``iter fused Adam``: ``step`` + ``update`` with the real optimizer
  (SGD with momentum and Adam, both foreach; ``Adam(fused=True)``); ``+clip`` adds the clip path.
* ``telemetry (a sampled iteration)``: one ``Telemetry.observe`` (the gradient statistics of the
  scaled gradients) over a memcpy of the gradients (``torch._foreach_copy_``); torch has no
  counterpart. ``(per iteration, every=100)``: the same amortised over the default sampling period.

Host syncs per iteration are counted with ``_sync.count_host_syncs`` (a dispatch mode).
Nothing here is asserted: CI runs ``--quick`` only as a smoke test.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict

import torch

# Measure the checkout this file lives in, whatever else is installed.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from _sync import count_host_syncs  # noqa: E402

import lossscale  # noqa: E402

SCALE = 2.0**16
DEVICE = torch.device("cpu")  # --device; the scalers, parameters and gradients live there


def clock() -> float:
    """``time.perf_counter()`` once the device has finished what was queued (CUDA runs async)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    return time.perf_counter()


TORCH_LIKE = dict(hysteresis=1, min_scale=None, max_scale=None, loss_check=False)
SETTINGS = {"torch-like": TORCH_LIKE, "default": {}}  # --settings: lossscale's keywords beside torch's
OURS = TORCH_LIKE
FULL_SIZES = [
    (1_000_000, 16),
    (1_000_000, 200),
    (10_000_000, 16),
    (10_000_000, 200),
    (50_000_000, 16),
    (50_000_000, 200),
]
QUICK_SIZES = [(20_000, 16), (20_000, 200)]


def repeats_for(n_params: int, quick: bool):
    """(repeats for the scaler-only rows, repeats for the rows with a real optimizer step)."""
    if quick:
        return 3, 3
    return (401, 41) if n_params <= 2_000_000 else (101, 15) if n_params <= 20_000_000 else (41, 7)


class NoopOptimizer(torch.optim.Optimizer):
    """An optimizer whose step does nothing: isolates the scaler's own work."""

    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        return None


class NoopFusedOptimizer(NoopOptimizer):
    """The same, declaring amp-scaling support (takes grad_scale/found_inf like Adam(fused=True))."""

    _step_supports_amp_scaling = True


def make_optimizer(kind: str, params):
    if kind == "noop":
        return NoopOptimizer(params)
    if kind == "noop_fused":
        return NoopFusedOptimizer(params)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-3, foreach=True)
    if kind == "fused_adam":
        return torch.optim.Adam(params, lr=1e-3, fused=True)
    raise ValueError(kind)


class Side:
    """One scaler with its own optimizers, over parameters shared by every side.

    Shared tensors, so both sides read and write the very same memory: separately allocated twins
    can differ in page placement (transparent huge pages), which biases a memory-bound kernel by
    several percent however the calls are interleaved.
    """

    def __init__(self, name: str, scaler, params):
        self.name, self.scaler = name, scaler
        self.params = params
        self.grads = [p.grad for p in self.params]
        self.optimizers = {}
        scaler.scale(torch.ones((), device=DEVICE))  # fixes the device; scale = 2**16

    def opt(self, kind):
        if kind not in self.optimizers:
            self.optimizers[kind] = make_optimizer(kind, self.params)
        return self.optimizers[kind]

    def reset_stage(self):
        """Forget this iteration's unscale_ (torch's and ours), untimed, so clip can run again."""
        if isinstance(self.scaler, torch.amp.GradScaler):
            from torch.amp.grad_scaler import _refresh_per_optimizer_state

            self.scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        else:
            self.scaler.discard_iteration()  # the records and which gradients were unscaled


def clip_only(side: Side, kind: str):
    """Each side's best way to unscale and clip: torch's two steps, lossscale's fused call."""
    opt, scaler = side.opt(kind), side.scaler
    if isinstance(scaler, torch.amp.GradScaler):
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(side.params, 1.0)
    else:
        scaler.clip_grad_norm_(opt, 1.0)


def iteration(side: Side, kind: str, clip: bool):
    opt, scaler = side.opt(kind), side.scaler
    if clip:
        clip_only(side, kind)
    scaler.step(opt)
    scaler.update()


def timed_pair(sides, fn, grads0, repeats, after=None):
    """Interleaved medians: {side name: median seconds}, and the median of per-repeat ratios."""
    times = {s.name: [] for s in sides}
    ratios = []
    gc.collect()
    gc.disable()  # a collection inside a timed call would land on one side only
    try:
        _timed_loop(sides, fn, grads0, repeats, after, times, ratios)
    finally:
        gc.enable()
    return {k: statistics.median(v) for k, v in times.items()}, statistics.median(ratios)


def _timed_loop(sides, fn, grads0, repeats, after, times, ratios):
    for r in range(repeats):
        order = sides if r % 2 == 0 else sides[::-1]
        this = {}
        for side in order:
            torch._foreach_copy_(side.grads, grads0)
            t0 = clock()
            fn(side)
            this[side.name] = clock() - t0
            if after is not None:
                after(side)
        for k, v in this.items():
            times[k].append(v)
        ratios.append(this["lossscale"] / this["torch"])


def count_syncs(side: Side, kind: str, mode: str, grads0) -> int:
    """Host syncs of one iteration (after a warm-up one)."""
    opt, scaler = side.opt(kind), side.scaler

    def run():
        torch._foreach_copy_(side.grads, grads0)
        if mode == "unscale_":
            scaler.unscale_(opt)
        elif mode == "unscale_+clip":
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(side.params, 1.0)
        elif mode == "clip":
            clip_only(side, kind)
        scaler.step(opt)
        scaler.update()

    run()
    with count_host_syncs() as syncs:
        run()
    return syncs.count


def optimizer_syncs(side: Side, kind: str, grads0) -> int:
    """Syncs of the optimizer's own step, without a scaler (Adam(foreach) on CPU reads its step counts)."""
    opt = side.opt(kind)
    torch._foreach_copy_(side.grads, grads0)
    opt.step()
    with count_host_syncs() as syncs:
        opt.step()
    return syncs.count


def read_only_kernels(grads0, repeats):
    """The candidates for the fused path's read-only check, each over torch's check+unscale kernel
    (inverse scale 1.0, what torch runs for fused optimizers). Medians, interleaved."""
    grads = [g.clone() for g in grads0]
    flag, one = torch.zeros((), device=DEVICE), torch.ones((), device=DEVICE)
    candidates = {
        "torch check+unscale (1.0), read+write": lambda: torch._amp_foreach_non_finite_check_and_unscale_(
            grads, flag, one
        ),
        "aminmax per tensor (lossscale)": lambda: [torch.aminmax(g) for g in grads],
        "_foreach_norm(inf)": lambda: torch._foreach_norm(grads, float("inf")),
        "_foreach_norm(2)": lambda: torch._foreach_norm(grads, 2),
        "_foreach_max (blind to -inf)": lambda: torch._foreach_max(grads),
    }
    times = {k: [] for k in candidates}
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            for k, fn in candidates.items():
                t0 = clock()
                fn()
                times[k].append(clock() - t0)
    finally:
        gc.enable()
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["torch check+unscale (1.0), read+write"]
    return {k: v / base for k, v in med.items()}


def bench_size(n_params, n_tensors, repeats, seed=0, telemetry_every=100):
    per = n_params // n_tensors
    shapes = [per] * n_tensors
    g = torch.Generator().manual_seed(seed)
    # Typical scaled FP32 gradients: |g| around 1e-3 * S, no inf, nothing near a subnormal.
    grads0 = [torch.randn(per, generator=g).mul_(1e-3 * SCALE).to(DEVICE) for _ in shapes]
    cfg = dict(init_scale=SCALE, growth_interval=10**9)
    params = [torch.nn.Parameter(torch.zeros(s, device=DEVICE)) for s in shapes]
    for p, g in zip(params, grads0):
        p.grad = g.clone()
    t = Side("torch", torch.amp.GradScaler(DEVICE.type, **cfg), params)
    ours = Side("lossscale", lossscale.GradScaler(DEVICE.type, **cfg, **OURS), params)
    tel = Side("lossscale", lossscale.GradScaler(DEVICE.type, **cfg, **OURS, telemetry=1), params)
    sides = [t, ours]
    rows = {}
    cheap, full = repeats

    def pair(key, fn, after=None, repeats=cheap):
        fn(t), fn(ours)  # warm-up (optimizer state allocation, caches)
        for s in sides:
            if after is not None:
                after(s)
        med, ratio = timed_pair(sides, fn, grads0, repeats, after)
        rows[key] = {"torch_ms": med["torch"] * 1e3, "lossscale_ms": med["lossscale"] * 1e3, "ratio": ratio}

    # Reference: a memcpy of the gradients (read + write of every element).
    buf = [torch.empty_like(x) for x in grads0]
    memcpy = []
    for _ in range(cheap):
        t0 = clock()
        torch._foreach_copy_(buf, grads0)
        memcpy.append(clock() - t0)
    memcpy_ms = statistics.median(memcpy) * 1e3

    pair("check+unscale+update", lambda s: iteration(s, "noop", clip=False))
    pair("fused check+update", lambda s: iteration(s, "noop_fused", clip=False))
    pair("clip", lambda s: clip_only(s, "noop"), after=lambda s: s.reset_stage())
    for kind, label in (("sgd", "SGD"), ("adam", "Adam"), ("fused_adam", "fused Adam")):
        pair(f"iter {label}", lambda s, k=kind: iteration(s, k, clip=False), repeats=full)
        pair(f"iter {label} +clip", lambda s, k=kind: iteration(s, k, clip=True), repeats=full)
    for s in (t, ours):
        for o in s.optimizers.values():
            o.state.clear()  # free the optimizer state before the next measurements

    # Telemetry: one sampled observe() over a memcpy of the gradients.
    telemetry = tel.scaler.telemetry
    scale = tel.scaler._get_scale_async()
    obs = []
    for _ in range(cheap):
        telemetry.iteration = 0  # due
        t0 = clock()
        telemetry.observe(tel.params, tel.grads, lambda p: None, scale)
        obs.append(clock() - t0)
    tel_ms = statistics.median(obs) * 1e3
    rows["telemetry (a sampled iteration)"] = {
        "torch_ms": None,
        "lossscale_ms": tel_ms,
        "memcpy_ms": memcpy_ms,
        "ratio": tel_ms / memcpy_ms,
    }
    rows[f"telemetry (per iteration, every={telemetry_every})"] = {
        "torch_ms": None,
        "lossscale_ms": tel_ms / telemetry_every,
        "memcpy_ms": memcpy_ms,
        "ratio": tel_ms / telemetry_every / memcpy_ms,
    }

    kernels = read_only_kernels(grads0, max(3, cheap // 4))

    # Host syncs per iteration (size-independent; counted here on this size's tensors).
    syncs = {}
    for kind in ("sgd", "adam", "fused_adam"):
        for mode in ("plain", "unscale_", "unscale_+clip", "clip"):
            syncs[f"{kind} {mode}"] = {s.name: count_syncs(s, kind, mode, grads0) for s in (t, ours)}
        syncs[f"{kind} telemetry"] = {"torch": None, "lossscale": count_syncs(tel, kind, "plain", grads0)}
        syncs[f"{kind} optimizer alone"] = {
            "torch": None,
            "lossscale": None,
            "optimizer": optimizer_syncs(t, kind, grads0),
        }
        for s in (t, ours, tel):
            s.opt(kind).state.clear()
    return {
        "n_params": per * n_tensors,
        "n_tensors": n_tensors,
        "repeats": list(repeats),
        "memcpy_ms": memcpy_ms,
        "rows": rows,
        "syncs": syncs,
        "read_only_kernels": kernels,
    }


GOALS = {
    "check+unscale+update": 1.0,
    "iter SGD": 1.0,
    "iter Adam": 1.0,
    "clip": 0.7,
    "fused check+update": 0.7,
    "telemetry (a sampled iteration)": 1.0,
    "telemetry (per iteration, every=100)": 1.0,
}


def markdown(results) -> str:
    meta = results["meta"]
    lines = [
        f"Measured {meta['date']} on {meta['machine']}, torch {meta['torch']}, {meta['threads']} thread(s), "
        f"Python {meta['python']}. Command: `{meta['command']}` ({meta['wall_s']:.0f} s).",
        "",
        "Ratio = lossscale / torch, median of per-repeat ratios (below 1: lossscale is faster). "
        "Telemetry rows: lossscale's collection over a memcpy of the gradients.",
        "",
    ]
    keys = list(results["sizes"][0]["rows"])
    head = (
        "| measurement | goal | "
        + " | ".join(f"{s['n_params'] / 1e6:g}M / {s['n_tensors']}" for s in results["sizes"])
        + " |"
    )
    lines += [head, "|" + "---|" * (2 + len(results["sizes"]))]
    for key in keys:
        goal = GOALS.get(key)
        cells = []
        for s in results["sizes"]:
            r = s["rows"][key]
            mark = "" if goal is None else (" ✓" if r["ratio"] <= goal else " ✗")
            cells.append(f"{r['ratio']:.2f}{mark}")
        lines.append(f"| {key} | {'' if goal is None else f'<= {goal}'} | " + " | ".join(cells) + " |")
    lines += ["", "Times (ms, median): torch / lossscale; memcpy of the gradients for scale.", ""]
    lines += [head.replace("| goal ", ""), "|" + "---|" * (1 + len(results["sizes"]))]
    lines.append("| memcpy of the gradients | " + " | ".join(f"{s['memcpy_ms']:.2f}" for s in results["sizes"]) + " |")
    for key in keys:
        cells = []
        for s in results["sizes"]:
            r = s["rows"][key]
            cells.append(
                f"{r['lossscale_ms']:.2f}"
                if r["torch_ms"] is None
                else f"{r['torch_ms']:.2f} / {r['lossscale_ms']:.2f}"
            )
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines += ["", "Read-only check candidates, time over torch's check+unscale kernel (the fused path's pass):", ""]
    lines += [head.replace("| goal ", ""), "|" + "---|" * (1 + len(results["sizes"]))]
    for key in results["sizes"][0]["read_only_kernels"]:
        lines.append(f"| {key} | " + " | ".join(f"{s['read_only_kernels'][key]:.2f}" for s in results["sizes"]) + " |")
    lines += [
        "",
        "Host syncs per iteration, torch / lossscale (the optimizer's own step included; "
        "'optimizer alone' is that share):",
        "",
        "| optimizer, path | syncs |",
        "|---|---|",
    ]
    for key, v in results["sizes"][0]["syncs"].items():
        if "optimizer" in v:
            lines.append(f"| {key} | {v['optimizer']} |")
        else:
            lines.append(f"| {key} | {'—' if v['torch'] is None else v['torch']} / {v['lossscale']} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 3 repeats (a smoke test)")
    ap.add_argument("--device", default="cpu", help="where to measure: cpu (default) or cuda")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--sizes", default=None, help="comma list of PARAMSxTENSORS, e.g. 1000000x16,1000000x200")
    ap.add_argument(
        "--settings",
        choices=sorted(SETTINGS) + ["both"],
        default="both",
        help="lossscale's settings: default (what users run), torch-like (hysteresis=1, no bounds, no "
        "loss check), or both (the default: one table each); the outputs of 'default' end in _default",
    )
    args = ap.parse_args(argv)
    for settings in ["default", "torch-like"] if args.settings == "both" else [args.settings]:
        run(args, settings)


def run(args, settings: str) -> None:
    """Measure every size with lossscale at ``settings`` and write its JSON and markdown table."""
    global DEVICE, OURS
    DEVICE = torch.device(args.device)
    OURS = SETTINGS[settings]
    torch.set_num_threads(args.threads)
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    if args.sizes:
        sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    start = time.time()
    results = {"sizes": []}
    for n, k in sizes:
        t0 = time.time()
        results["sizes"].append(bench_size(n, k, repeats_for(n, args.quick)))
        print(f"{n / 1e6:g}M params / {k} tensors: {time.time() - t0:.0f} s", file=sys.stderr)
        gc.collect()
    results["meta"] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": args.threads,
        "command": "python benchmarks/bench_scaler.py"
        + (" --quick" if args.quick else "")
        + (f" --device {args.device}" if args.device != "cpu" else "")
        + (f" --threads {args.threads}" if args.threads != 1 else "")
        + (f" --sizes {args.sizes}" if args.sizes else "")
        + f" --settings {settings}",
        "settings": settings,
        "wall_s": time.time() - start,
        "goals": GOALS,
    }
    os.makedirs(args.out, exist_ok=True)
    stem = (
        ("bench_scaler_quick" if args.quick else "bench_scaler")
        + ("" if DEVICE.type == "cpu" else f"_{DEVICE.type}")
        + ("" if settings == "torch-like" else "_default")
    )
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump(results, f, indent=1)
    table = markdown(results)
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
