"""The first run on a GPU: what the CPU test bench cannot show, in one short call.

    bash benchmarks/gpu_check.sh                 # on a machine with CUDA; results under $OUT
    python benchmarks/gpu_check.py --quick       # the same steps, shortened (a smoke run)

Steps, in order, each recorded in ``gpu_check.json`` under ``--out`` (rewritten after every step, so a
run cut short keeps what it measured):

1. ``tests``: ``tests/test_cuda.py`` on the GPU (bitwise torch and syncs per iteration on every path, a
   CUDA-graph captured step + update replayed like torch, the snapshot's pinned copy and event, a
   state on a second GPU when there is one).
2. ``syncs``: one warm iteration of each path (SGD, Adam foreach, fused AdamW, each with the clip, and
   the other policies on fused AdamW) under ``torch.cuda.set_sync_debug_mode("warn")``: the syncs
   torch's own detector reports, lossscale beside torch.
3. ``kernels``: the kernels one warm iteration launches on the GPU (``torch.profiler``), lossscale
   beside torch, for the same paths: the figure the CPU suite can only model.
4. ``nan_batch``: fused AdamW through a NaN batch: the weights and optimizer state bitwise unchanged,
   the scale kept (the loss check).
5. ``bench_iteration``: ``benchmarks/bench_iteration.py --device cuda``, the whole-iteration ratios.
6. ``bench_beyond``: ``benchmarks/bench_beyond.py --device cuda``, what the opt-in features beyond
   scaling cost (the micro-batch drop's read per micro-batch is a real stall there).

Exit status 1 when a step failed. Without CUDA it exits 2 at once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
import lossscale  # noqa: E402

CUDA = torch.device("cuda")
#: (name, optimizer, lossscale keywords, clip)
PATHS = [
    ("sgd", "sgd", {}, False),
    ("adam foreach", "adam", {}, False),
    ("adamw fused", "adamw_fused", {}, False),
    ("sgd + clip", "sgd", {}, True),
    ("adamw fused + clip", "adamw_fused", {}, True),
    ("hysteresis=2", "adamw_fused", {"hysteresis": 2}, False),
    ("adaptive", "adamw_fused", {"policy": "adaptive"}, False),
    ("logmax", "adamw_fused", {"policy": "logmax"}, False),
]


def _model(seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]).to(CUDA)


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-4, foreach=True)
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def _iteration(model, opt, scaler, clip, x, y, ours):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    if clip and ours:
        scaler.clip_grad_norm_(opt, 1.0)
    elif clip:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()


def _sides(kind, keywords, clip):
    x, y = torch.randn(64, 256, device=CUDA), torch.randint(0, 256, (64,), device=CUDA)
    out = {}
    for ours in (False, True):
        model = _model()
        opt = _optimizer(kind, model.parameters())
        scaler = lossscale.GradScaler(**keywords) if ours else torch.amp.GradScaler("cuda")

        def run(m=model, o=opt, s=scaler, ours=ours):
            return _iteration(m, o, s, clip, x, y, ours)

        for _ in range(3):
            run()
        torch.cuda.synchronize()
        out["lossscale" if ours else "torch"] = run
    return out


def step_tests(quick):
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return dict(ok=done.returncode == 0, tail=done.stdout[-3000:] + done.stderr[-1000:])


def step_syncs(quick):
    rows = {}
    for name, kind, keywords, clip in PATHS:
        row = {}
        for side, run in _sides(kind, keywords, clip).items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    run()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize()
            row[side] = sum("synchroniz" in str(w.message) for w in caught)
        rows[name] = row
    ok = all(r["lossscale"] <= r["torch"] for r in rows.values()) and all(
        rows[n]["lossscale"] == 0 for n, k, _, _ in PATHS if k == "adamw_fused"
    )
    return dict(ok=ok, rows=rows)


def step_kernels(quick):
    from torch.profiler import ProfilerActivity, profile

    rows = {}
    for name, kind, keywords, clip in PATHS:
        row = {}
        for side, run in _sides(kind, keywords, clip).items():
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run()
                torch.cuda.synchronize()
            row[side] = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        rows[name] = row
    return dict(ok=True, rows=rows)


def step_nan_batch(quick):
    model = _model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = lossscale.GradScaler()
    x, y = torch.randn(64, 256, device=CUDA), torch.randint(0, 256, (64,), device=CUDA)
    for _ in range(3):
        _iteration(model, opt, scaler, False, x, y, True)
    before = [p.detach().clone() for p in model.parameters()]
    state = [v.clone() for s in opt.state.values() for v in s.values()]
    scale = scaler.get_scale()
    bad = x.clone()
    bad[0, 0] = float("nan")
    _iteration(model, opt, scaler, False, bad, y, True)
    same = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    same_state = all(torch.equal(a, b) for a, b in zip(state, [v for s in opt.state.values() for v in s.values()]))
    return dict(
        ok=same and same_state and scaler.get_scale() == scale and scaler.last_step_skipped,
        weights_unchanged=same,
        optimizer_state_unchanged=same_state,
        scale_kept=scaler.get_scale() == scale,
        counters=scaler.counters(),
    )


def _bench(script: str, quick: bool, *extra: str):
    out = os.environ.get("GPU_CHECK_OUT", os.path.join(ROOT, "benchmarks", "results"))
    argv = [sys.executable, os.path.join(ROOT, "benchmarks", script), "--device", "cuda", "--out", out, *extra]
    if quick:
        argv.append("--quick")
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    return dict(ok=done.returncode == 0, tail=done.stdout[-4000:] + done.stderr[-1000:])


def step_bench_iteration(quick):
    return _bench("bench_iteration.py", quick)


def step_bench_beyond(quick):
    """The opt-in features' cost on the GPU, where bad_microbatch='drop''s read per micro-batch stalls."""
    return _bench("bench_beyond.py", quick, "--pairs", "8")


STEPS = [
    ("tests", step_tests),
    ("syncs", step_syncs),
    ("kernels", step_kernels),
    ("nan_batch", step_nan_batch),
    ("bench_iteration", step_bench_iteration),
    ("bench_beyond", step_bench_beyond),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", nargs="*", default=[n for n, _ in STEPS])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    os.environ["GPU_CHECK_OUT"] = args.out
    results = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, steps={})
    path = os.path.join(args.out, "gpu_check.json")
    for name, step in STEPS:
        if name not in args.steps:
            continue
        start = time.time()
        try:
            results["steps"][name] = step(args.quick)
        except Exception:  # a step that breaks must not lose the others' results
            results["steps"][name] = dict(ok=False, error=traceback.format_exc()[-3000:])
        results["steps"][name]["seconds"] = round(time.time() - start, 1)
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        r = results["steps"][name]
        print(
            f"gpu_check {name}: {'ok' if r['ok'] else 'FAILED'} ({r['seconds']} s)"
            + (f" {r['rows']}" if "rows" in r else ""),
            flush=True,
        )
    return 0 if all(r["ok"] for r in results["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
