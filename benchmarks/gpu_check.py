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
5. ``cuda_graph`` (**never run yet**: written without a GPU): fused AdamW (``capturable=True``) at the
   defaults, ``unscale_`` (or ``clip_grad_norm_``), ``step`` and ``update`` captured in one CUDA graph
   and replayed over gradients with inf and NaN batches, bitwise the same scaler run eagerly (weights,
   moments, step counts, scale, growth tracker, counters), no sync per replay; then ``check_stuck()``
   and ``health()`` eagerly.
6. ``bench_iteration``: ``benchmarks/bench_iteration.py --device cuda``, the whole-iteration ratios.
7. ``bench_beyond``: ``benchmarks/bench_beyond.py --device cuda``, what the opt-in features beyond
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


def _graph_grads(params, k):
    """Iteration ``k``'s (scaled) gradients: an inf at k % 8 == 3, a NaN at k % 8 == 7."""
    g = torch.Generator().manual_seed(k)
    out = [torch.randn(p.shape, generator=g).mul_(100.0).to(CUDA) for p in params]
    if k % 4 == 3:
        out[k % len(out)].view(-1)[0] = float("inf") if k % 8 == 3 else float("nan")
    return out


def _graph_side(clip: bool):
    """A model, its fused AdamW (capturable, as CUDA-graph capture needs) and a default scaler, warmed
    up eagerly on a side stream; the calls after the backward as one function."""
    model = _model(2)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True, capturable=True)
    scaler = lossscale.GradScaler("cuda", init_scale=2.0**16, growth_interval=2)
    for p in params:
        p.grad = torch.zeros_like(p)  # static gradient buffers, refilled before every replay
    scaler.scale(torch.ones((), device=CUDA))

    def after_backward():
        if clip:
            scaler.clip_grad_norm_(opt, 1.0)
        else:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for k in range(3):
            for p, g in zip(params, _graph_grads(params, k)):
                p.grad.copy_(g)
            after_backward()
    torch.cuda.current_stream().wait_stream(side)
    return params, opt, scaler, after_backward


def step_cuda_graph(quick):
    """Never run yet (written without a GPU). The captured iteration against the same scaler eagerly."""
    rows = {}
    for name, clip in (("unscale_", False), ("clip_grad_norm_", True)):
        eager = _graph_side(clip)
        graphed = _graph_side(clip)
        params_g, opt_g, scaler_g, after_g = graphed
        graph = torch.cuda.CUDAGraph()
        for p, g in zip(params_g, _graph_grads(params_g, 3)):
            p.grad.copy_(g)
        with torch.cuda.graph(graph):
            after_g()
        mismatches, syncs = [], 0
        for k in range(3, 11 if quick else 19):  # capture ran nothing: both sides start at iteration 3
            params_e, opt_e, scaler_e, after_e = eager
            for p, g in zip(params_e, _graph_grads(params_e, k)):
                p.grad.copy_(g)
            after_e()
            for p, g in zip(params_g, _graph_grads(params_g, k)):
                p.grad.copy_(g)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    graph.replay()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs += sum("synchroniz" in str(w.message) for w in caught)
            torch.cuda.synchronize()
            same = [torch.equal(a, b) for a, b in zip(params_e, params_g)]
            same += [
                torch.equal(a, b)
                for sa, sb in zip(opt_e.state.values(), opt_g.state.values())
                for a, b in zip(sa.values(), sb.values())
            ]
            same += [torch.equal(scaler_e._t.scale, scaler_g._t.scale)]
            same += [torch.equal(scaler_e._t.growth_tracker, scaler_g._t.growth_tracker)]
            if not all(same):
                mismatches.append(k)
        scaler_g.check_stuck()  # the eager points a captured loop calls now and then (one sync each)
        verdict = scaler_g.health().verdict
        counters = (scaler_e.counters(), scaler_g.counters())
        rows[name] = dict(
            bitwise=not mismatches,
            mismatched_iterations=mismatches,
            syncs_in_replays=syncs,
            counters_equal=counters[0] == counters[1],
            counters=counters[1],
            health=verdict,
        )
    ok = all(r["bitwise"] and r["counters_equal"] and r["syncs_in_replays"] == 0 for r in rows.values())
    ok = ok and all(r["counters"]["skipped_steps"] >= 2 for r in rows.values())
    return dict(ok=ok, never_run_before=True, rows=rows)


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
    ("cuda_graph", step_cuda_graph),
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
