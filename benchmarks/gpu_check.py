"""The GPU check: what only a GPU can show, in one call of at most 8 minutes (``gpu_check.sh`` runs it).

    PYTHONPATH=src python benchmarks/gpu_check.py --out "$OUT"       # on a bare GPU machine
    python benchmarks/gpu_check.py --stand-in --quick --out DIR       # its CPU twin (tests/test_fake_cuda.py)

Nothing is installed: lossscale is imported from this checkout (``src/``), the iterations from
``tests/_iterations.py``. Steps, each recorded whether it passes, fails or runs out of time:

1. ``tests``: the CUDA tests (``pytest -m cuda tests/test_cuda.py``, in a subprocess; skipped when
   pytest is missing, and on the stand-in).
2. ``paths``: one clean iteration of every path at lossscale's default settings beside torch's
   ``torch.amp.GradScaler`` doing the same (SGD, Adam foreach and fused, clip, hysteresis=2, adaptive, LogMax,
   telemetry, trace, skip-aware scheduler): launches, syncs and copies from ``_sync``,
   the syncs torch's own detector reports (``torch.cuda.set_sync_debug_mode("warn")``), the
   kernels and copies the profiler saw (a GPU only); and the iteration again under
   ``set_sync_debug_mode("error")`` wherever torch's counterpart makes no sync. Passes when
   lossscale makes no more syncs than torch and the "error" run raises nothing.
   ``metrics()`` (telemetry per parameter, every step) is counted beside them, not judged.
3. ``nan_batch``: a NaN in one input row with ``Adam(fused=True)``: the step is skipped, the weights
   are bitwise unchanged, no sync (the scaler's part runs under "error").
4. ``counter``: the counter against torch's detector on known operations (``.item()``, ``.cpu()``,
   ``nonzero``, copies to and from pinned and pageable memory, ``torch.tensor(list, device=...)``).
   Differences are reported, not failed: they are what the counter's model should learn.
5. ``graph_rule``: each policy's tensor rule captured once in a CUDA graph and replayed
   (``benchmarks/graph_rule.py``): bitwise agreement with the eager rule over random iterations,
   launches and host time per update, and a fused-Adam iteration with the replayed rule: the
   measurement issue 22's launch budgets for adaptive, LogMax and ``hysteresis=2`` wait for.
6. ``grad_stats``: each histogram method: bitwise the same histogram as ``index_add``, no sync
   (under "error"), and timed (``benchmarks/bench_stats.bench_one``).
7. ``bench_scaler``: ``benchmarks/bench_scaler.py`` at ``--settings default`` and ``torch-like``.

Every result goes to ``gpu_check.json`` under ``--out`` (rewritten after each step, so a run cut
short keeps what it measured) with the benchmarks' own files beside it; stdout gets a one-screen
summary. Exit status 1 when a step failed.

On the stand-in (``--stand-in``: ``tests/_fake_cuda.py``, tensors that report ``cuda:0`` and compute
on the CPU) the same code runs against a faked CUDA runtime: its sync detector flags what the
counter calls a sync, and it has no profiler, graphs or second device. ``--quick`` shrinks the
benchmarks to a smoke run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (os.path.join(ROOT, "src"), os.path.join(ROOT, "tests")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from lossscale import stats  # noqa: E402
from _sync import count_host_syncs  # noqa: E402
from _iterations import make_iteration  # noqa: E402

BUDGET_S = 450  # the whole run, under gpu_check.sh's 8-minute limit
SYNC_WARNING = "synchronizing CUDA operation"

# (name, optimizer, lossscale keywords, iteration keywords); torch runs the same optimizer and iteration.
PATHS = [
    ("sgd", "sgd", {}, {}),
    ("adam foreach", "adam", {}, {}),
    ("adam fused", "fused_adam", {}, {}),
    ("clip", "fused_adam", {}, dict(clip=1.0)),
    ("clip, sgd", "sgd", {}, dict(clip=1.0)),
    ("hysteresis=2", "fused_adam", dict(hysteresis=2), {}),
    ("adaptive", "fused_adam", dict(policy="adaptive"), {}),
    ("logmax", "fused_adam", dict(policy="logmax"), {}),
    ("telemetry", "fused_adam", dict(telemetry=1), {}),
    ("trace", "fused_adam", dict(trace=True), {}),
    ("skip-aware scheduler", "sgd", {}, dict(scheduler=True)),
]
METRICS_PATH = ("metrics() per param, sgd", "sgd", dict(telemetry={"every": 1, "per": "param"}), dict(metrics=True))


# ------------------------------------------------------------------ helpers
@contextlib.contextmanager
def sync_debug(mode: str, seen: Optional[List[str]] = None):
    """torch's sync detector at ``mode`` ("warn": its warnings are appended to ``seen``; "error": a
    sync raises). The detector's mode is restored on exit."""
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(before)
    if seen is not None:
        seen += [str(w.message) for w in caught if SYNC_WARNING in str(w.message)]
    for w in caught:
        if SYNC_WARNING not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


@contextlib.contextmanager
def cuda_kernels(tally: Dict[str, int]):
    """Add the kernels and memcpys/memsets the CUDA profiler sees inside the block to ``tally``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield
        torch.cuda.synchronize()
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            copy = any(w in e.name.lower() for w in ("memcpy", "memset"))
            tally["memcpys" if copy else "kernels"] += 1


def profiled(it, real_gpu: bool) -> Optional[Dict[str, Any]]:
    """Kernels and memcpys the CUDA profiler saw in one iteration's scaler share (the blocks
    ``count_device_work`` counts); None on the stand-in (no profiler), the error if it failed."""
    if not real_gpu:
        return None
    tally = {"kernels": 0, "memcpys": 0}
    try:
        it.counted(watch=lambda: cuda_kernels(tally))
        return tally
    except Exception as e:  # the profiler is a bonus: never the reason a check fails
        return {"error": f"{type(e).__name__}: {e}"[:200]}


def measure(scaler: str, optimizer: str, real_gpu: bool, kwargs: dict, it_kwargs: dict) -> Dict[str, Any]:
    """One path on one side: counted, detector-checked and profiled iterations after a warm-up."""
    it = make_iteration(scaler, optimizer, **kwargs, **it_kwargs)
    for _ in range(2):
        it.run()
    seen: List[str] = []
    work = it.counted(watch=lambda: sync_debug("warn", seen))
    out: Dict[str, Any] = {**work.summary(), "detector_syncs": len(seen), "sync_ops": work.ops}
    prof = profiled(it, real_gpu)
    if prof is not None:
        out["profiled"] = prof
    return out | {"_it": it}


def error_mode(it) -> str:
    """"ok", or the error, of one more iteration whose scaler share runs under "error"."""
    try:
        it.counted(watch=lambda: sync_debug("error"))
        return "ok"
    except RuntimeError as e:
        return f"raised: {str(e).splitlines()[0][:160]}"


def load_script(name: str):
    """A benchmarks/ script as a module (its ``main(argv)`` runs in this process)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ the steps
def step_tests(args, remaining: float) -> Dict[str, Any]:
    """The CUDA tests, in a subprocess with its own time limit."""
    if args.stand_in:
        return {"status": "skipped", "why": "the CUDA tests need a GPU (the stand-in runs their stand-in twins in CI)"}
    try:
        has_pytest = importlib.util.find_spec("pytest") is not None
    except ImportError:
        has_pytest = False
    if not has_pytest:
        return {"status": "skipped", "why": "pytest is not installed on this machine (no package index to get it)"}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests/test_cuda.py"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=min(180, remaining))
    except subprocess.TimeoutExpired as e:
        return {"status": "failed", "why": f"timed out after {e.timeout:.0f} s"}
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"status": "passed" if proc.returncode == 0 else "failed", "returncode": proc.returncode,
            "summary": tail[-1] if tail else "", "tail": tail}


def step_paths(args, remaining: float) -> Dict[str, Any]:
    """Every path beside torch: counts, the detector, the "error" run."""
    real_gpu = not args.stand_in
    rows: Dict[str, Any] = {}
    torch_side: Dict[tuple, Dict[str, Any]] = {}
    for name, optimizer, kwargs, it_kwargs in PATHS:
        key = (optimizer, tuple(sorted(it_kwargs.items())))
        if key not in torch_side:
            torch_side[key] = measure("torch", optimizer, real_gpu, {}, it_kwargs)
        ref = torch_side[key]
        ours = measure("lossscale", optimizer, real_gpu, kwargs, it_kwargs)
        row = {"lossscale": ours, "torch": {k: v for k, v in ref.items() if k != "_it"}}
        if ref["syncs"] == 0 and ref["detector_syncs"] == 0:
            row["error_mode"] = error_mode(ours["_it"])
        del ours["_it"]
        row["ok"] = (ours["syncs"] <= ref["syncs"] and ours["detector_syncs"] <= ref["detector_syncs"]
                     and row.get("error_mode", "ok") == "ok")
        rows[name] = row
    name, optimizer, kwargs, it_kwargs = METRICS_PATH
    metrics = measure("lossscale", optimizer, real_gpu, kwargs, it_kwargs)
    del metrics["_it"]
    return {"status": "passed" if all(r["ok"] for r in rows.values()) else "failed", "rows": rows,
            "not judged": {name: metrics}}


def step_nan_batch(args, remaining: float) -> Dict[str, Any]:
    """A NaN input row with fused Adam: skipped on device, weights unchanged, no sync."""
    it = make_iteration("lossscale", "fused_adam")
    for _ in range(2):
        it.run()
    before = [p.detach().clone() for p in it.model.parameters()]
    steps = it.scaler.counters()["steps"]
    try:
        it.counted(bad="nan", watch=lambda: sync_debug("error"))
        raised = None
    except RuntimeError as e:
        raised = str(e).splitlines()[0][:160]
    unchanged = all(torch.equal(a, b) for a, b in zip(before, it.model.parameters()))
    skipped = bool(it.scaler.last_step_skipped)
    counters = it.scaler.counters()
    ok = raised is None and unchanged and skipped and counters["skipped_steps"] >= 1
    return {"status": "passed" if ok else "failed", "weights_unchanged": unchanged, "skipped": skipped,
            "sync_raised": raised, "steps_before": steps, "counters": counters}


def step_counter(args, remaining: float) -> Dict[str, Any]:
    """The dispatch counter beside torch's detector, on operations whose syncs are known."""
    def pin(t):
        if args.stand_in:  # the stand-in's pinned memory (imported only there: it needs pytest)
            from _fake_cuda import pinned

            return pinned(t)
        return t.pin_memory()

    d = torch.arange(6.0, device="cuda")
    cases = {
        ".item()": lambda: d.sum().item(),
        ".cpu()": lambda: d.cpu(),
        ".tolist()": lambda: d.tolist(),
        "nonzero": lambda: d.nonzero(),
        "copy to pinned, non_blocking": lambda: pin(torch.empty(6)).copy_(d, non_blocking=True),
        "copy to pageable, non_blocking": lambda: torch.empty(6).copy_(d, non_blocking=True),
        "pinned .to(cuda, non_blocking)": lambda: pin(torch.ones(6)).to("cuda", non_blocking=True),
        "pageable .to(cuda, non_blocking)": lambda: torch.ones(6).to("cuda", non_blocking=True),
        "pageable .to(cuda)": lambda: torch.ones(6).to("cuda"),
        "torch.tensor(list, device=cuda)": lambda: torch.tensor([1.0, 2.0], device="cuda"),
    }
    rows = {}
    for name, fn in cases.items():
        seen: List[str] = []
        with count_host_syncs() as syncs, sync_debug("warn", seen):
            fn()
        rows[name] = {"counted": syncs.count, "detector": len(seen), "h2d": syncs.h2d, "d2h": syncs.d2h}
    sees_list = rows["torch.tensor(list, device=cuda)"]["counted"] == 1
    return {"status": "passed" if sees_list else "failed", "rows": rows,
            "differences": [k for k, r in rows.items() if r["counted"] != r["detector"]]}


def _run_script(name: str, argv: List[str], log: str) -> None:
    """``benchmarks/<name>.py``'s ``main(argv)`` here, its output to ``log`` (the summary stays one screen)."""
    threads = torch.get_num_threads()
    try:
        with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            load_script(name).main(argv)
    finally:
        torch.set_num_threads(threads)


def step_bench_scaler(args, remaining: float) -> Dict[str, Any]:
    """bench_scaler at the default and the torch-like settings (its files land beside gpu_check.json)."""
    sizes = "4000x4" if args.quick else "1000000x16,1000000x200,10000000x16,10000000x200"
    out: Dict[str, Any] = {"status": "passed"}
    for settings in ("default", "torch-like"):
        argv = ["--device", "cuda", "--settings", settings, "--sizes", sizes, "--out", args.out]
        start = time.time()
        stem = ("bench_scaler_quick" if args.quick else "bench_scaler") + "_cuda" + (
            "_default" if settings == "default" else "")
        _run_script("bench_scaler", argv + (["--quick"] if args.quick else []), os.path.join(args.out, stem + ".log"))
        with open(os.path.join(args.out, stem + ".json")) as f:
            result = json.load(f)
        out[settings] = {"seconds": round(time.time() - start, 1), "file": stem + ".json",
                         "ratios": {f"{s['n_params']}x{s['n_tensors']}" if "n_params" in s else str(i):
                                    {k: round(r["ratio"], 3) for k, r in s["rows"].items()}
                                    for i, s in enumerate(result["sizes"])},
                         "syncs": result["sizes"][0].get("syncs"), "result": result}
    return out


def step_graph_rule(args, remaining: float) -> Dict[str, Any]:
    """Each policy's tensor rule replayed from one CUDA graph (``benchmarks/graph_rule.py``): bitwise
    agreement with the eager rule, launches and host time per update, a fused-Adam iteration. On the
    stand-in its twin runs (no graphs there): the plumbing only."""
    graph_rule = load_script("graph_rule")
    results = graph_rule.run(torch.device("cuda"), twin=args.stand_in, quick=args.quick, out_dir=args.out)
    return {"status": "passed" if results["ok"] else "failed", "twin": args.stand_in,
            "summary": graph_rule.summary(results), "results": results}


def step_grad_stats(args, remaining: float) -> Dict[str, Any]:
    """Each histogram method: bitwise index_add's histogram, no sync, and its time."""
    bench = load_script("bench_stats")
    bench.DEVICE = torch.device("cuda")
    methods = [m for m in stats.METHODS if m != "bincount"]  # bincount syncs on a GPU: refused there
    g = torch.Generator().manual_seed(0)
    checks: Dict[str, Any] = {}
    ok = True
    for dtype in (torch.float32, torch.float16):
        values = (torch.randn(300_000, generator=g) * torch.exp2(torch.empty(300_000).uniform_(-30, 0, generator=g)))
        ts = [t.to("cuda", dtype) for t in values.chunk(7)]
        ref = stats.grad_stats(ts, scale=1024.0, method="index_add").hist
        for m in methods:
            try:
                with sync_debug("error"):
                    s = stats.grad_stats(ts, scale=1024.0, method=m)
                raised = None
            except RuntimeError as e:
                s, raised = stats.grad_stats(ts, scale=1024.0, method=m), str(e).splitlines()[0][:160]
            equal = torch.equal(s.hist, ref)
            ok = ok and equal and raised is None
            checks[f"{m}, {str(dtype)[6:]}"] = {"equal_to_index_add": equal, "sync_raised": raised}
    configs = [(20_000, 1, torch.float32)] if args.quick else [
        (4_000_000, 1, torch.float32), (50_000_000, 200, torch.float32), (4_000_000, 1, torch.float16),
        (50_000_000, 200, torch.float16)]
    timing = []
    for numel, pieces, dtype in configs:
        for m in methods:
            r = bench.bench_one(numel, pieces, dtype, 3 if args.quick else 9, 1.0 if args.quick else 2.0, m)
            timing.append({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
    return {"status": "passed" if ok else "failed", "checks": checks, "timing": timing}


# (name, function, seconds it needs on a GPU). The benchmarks run in this process (no time limit of
# their own), so they come last: a run stopped at the limit keeps everything before them.
STEPS = [("tests", step_tests, 200), ("paths", step_paths, 30), ("nan_batch", step_nan_batch, 5),
         ("counter", step_counter, 5), ("graph_rule", step_graph_rule, 45), ("grad_stats", step_grad_stats, 60),
         ("bench_scaler", step_bench_scaler, 150)]


# ------------------------------------------------------------------ the summary
def summary(results: Dict[str, Any]) -> str:
    """One screen: each step's verdict and its key figures."""
    meta, steps = results["meta"], results["steps"]
    lines = [f"gpu_check on {meta['device']} (torch {meta['torch']}), {meta['wall_s']:.0f} s: "
             + ("ALL PASSED" if results["ok"] else "FAILED: " + ", ".join(results["failures"]))]
    t = steps.get("tests", {})
    lines.append(f"tests: {t.get('status')} {t.get('summary') or t.get('why', '')}".rstrip())
    p = steps.get("paths", {})
    if "rows" in p:
        lines.append("paths (one clean iteration, default settings)  launches   syncs (detector)  error mode")
        lines.append("                                    ours/torch  ours/torch")
        for name, r in p["rows"].items():
            o, tr = r["lossscale"], r["torch"]
            kernels = (f"  profiler {o['profiled'].get('kernels', '?')}/{tr['profiled'].get('kernels', '?')}"
                       if "profiled" in o and "profiled" in tr else "")
            lines.append(f"  {'ok ' if r['ok'] else 'BAD'} {name:<30} {o['launches']:>4}/{tr['launches']:<4} "
                         f"{o['syncs']}/{tr['syncs']} ({o['detector_syncs']}/{tr['detector_syncs']})"
                         f"{'':<6}{r.get('error_mode', '-')[:40]}{kernels}")
        for name, r in p.get("not judged", {}).items():
            lines.append(f"      {name:<30} {r['launches']:>4}       {r['syncs']} ({r['detector_syncs']})")
    for key in ("nan_batch", "counter"):
        s = steps.get(key, {})
        extra = (f"weights unchanged {s.get('weights_unchanged')}, skipped {s.get('skipped')}, sync {s.get('sync_raised')}"
                 if key == "nan_batch" else f"differences from the detector: {s.get('differences')}")
        lines.append(f"{key}: {s.get('status')}; {extra}")
    g = steps.get("graph_rule", {})
    if "summary" in g:
        lines.append(g["summary"])
    elif g:
        lines.append(f"graph_rule: {g.get('status')} {g.get('why', '')}".rstrip())
    b = steps.get("bench_scaler", {})
    if "why" in b:
        lines.append(f"bench_scaler: {b.get('status')} {b['why']}")
    for settings in ("default", "torch-like"):
        for size, ratios in b.get(settings, {}).get("ratios", {}).items():
            pick = {k: v for k, v in ratios.items() if k.startswith(("check+", "fused", "clip", "iter"))}
            lines.append(f"bench_scaler {settings:<10} {size:>12}: "
                         + ", ".join(f"{k} {v:.2f}" for k, v in list(pick.items())[:5]))
    gs = steps.get("grad_stats", {})
    if "timing" in gs:
        by: Dict[str, List[str]] = {}
        for r in gs["timing"]:
            by.setdefault(f"{r['numel']:,}x{r['tensors']} {r['dtype']}", []).append(
                f"{r['method']} {r['grad_stats_ms']:.2f} ms ({r['ratio_vs_copy']:.1f}x copy)")
        lines.append(f"grad_stats: {gs['status']}; bitwise and sync-free: "
                     f"{all(c['equal_to_index_add'] and c['sync_raised'] is None for c in gs['checks'].values())}")
        lines += [f"  {k}: " + ", ".join(v) for k, v in by.items()]
    lines.append(f"results: {results['file']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run every step within the time budget; write gpu_check.json; print the summary; 1 if a step failed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--stand-in", action="store_true", help="run on tests/_fake_cuda.py's stand-in device (CPU)")
    ap.add_argument("--quick", action="store_true", help="tiny benchmarks (a smoke run)")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for the whole run (default {BUDGET_S})")
    ap.add_argument("--steps", default=",".join(s for s, _, _ in STEPS), help="comma list of steps to run")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if args.stand_in:
            from _fake_cuda import fake_cuda

            stack.enter_context(fake_cuda())
        elif not torch.cuda.is_available():
            print("gpu_check: no CUDA device (use --stand-in for the CPU twin)", file=sys.stderr)
            return 2
        return run(args)


def run(args) -> int:
    """The steps, in order, each given what is left of the budget."""
    start = time.time()
    results: Dict[str, Any] = {
        "meta": {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__, "python": platform.python_version(),
                 "device": f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}",
                 "stand_in": args.stand_in, "quick": args.quick, "wall_s": 0.0},
        "steps": {}, "ok": True, "failures": [], "file": os.path.join(args.out, "gpu_check.json")}
    wanted = args.steps.split(",")
    for name, fn, needs in STEPS:
        if name not in wanted:
            continue
        remaining = args.budget - (time.time() - start)
        t0 = time.time()
        if remaining < needs and not args.quick:
            out = {"status": "skipped", "why": f"out of time ({remaining:.0f} s left, needs ~{needs} s)"}
        else:
            try:
                out = fn(args, remaining)
            except Exception as e:  # a broken step is a result, and the next step still runs
                out = {"status": "failed", "why": f"{type(e).__name__}: {e}"[:400]}
        out["seconds"] = round(time.time() - t0, 1)
        results["steps"][name] = out
        if out["status"] == "failed":
            results["ok"] = False
            results["failures"].append(name)
        results["meta"]["wall_s"] = time.time() - start
        with open(results["file"], "w") as f:
            json.dump(results, f, indent=1, default=str)
    print(summary(results))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
