"""The scaler's fixed host cost per iteration, warm and after a sweep of memory (lossscale vs torch).

    python benchmarks/bench_host.py                 # ~20 seconds; prints a table
    python benchmarks/bench_host.py --sweep-mb 0    # warm only

What it measures: ``update()`` alone, after ``scale`` + ``step`` with an optimizer whose ``step()``
does nothing, on 16 tiny parameters, so the time is the host's own work (Python, torch's dispatcher,
one small kernel or copy). "Warm": iteration after iteration, as a micro-benchmark runs. "After a
sweep": a copy of ``--sweep-mb`` MB between ``step`` and ``update``, as a real iteration's gradient
pass leaves the caches; both scalers then run their host code with cold caches, and their cost grows
several-fold. This is why ``bench_scaler.py``'s ratios at 10M parameters (40 MB of gradients) show a
gap several times the warm host cost. Each setting runs its repeats in a row (torch, then lossscale,
then again, median of each); the machine is shared, so the figures move between runs by ~20%.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scaler import NoopOptimizer  # noqa: E402  (the same optimizer stand-in)

import lossscale  # noqa: E402


def measure(scaler, optimizer, loss, sweep, repeats: int) -> float:
    """Median seconds of ``scaler.update()`` over ``repeats`` iterations, ``sweep()`` before each."""
    times = []
    for _ in range(repeats):
        scaler.scale(loss)
        scaler.step(optimizer)
        sweep()
        t0 = time.perf_counter()
        scaler.update()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    """Print update()'s median time, warm and after a sweep, for torch's scaler and lossscale's."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep-mb", type=int, default=80, help="MB copied before each update (0: warm only)")
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    params = [torch.nn.Parameter(torch.zeros(1000)) for _ in range(16)]
    for p in params:
        p.grad = torch.randn(1000)
    loss = torch.ones(())
    n = args.sweep_mb * 2**20 // 8  # two float32 buffers of half the size each
    src, dst = torch.ones(n), torch.zeros(n)
    settings = [("warm", lambda: None)] + ([(f"after a {args.sweep_mb} MB sweep", lambda: dst.copy_(src))] if n else [])
    print("| update() | torch (us) | lossscale default (us) | ratio |")
    print("|---|---|---|---|")
    gc.disable()
    try:
        for label, sweep in settings:
            medians = {"torch": [], "lossscale": []}
            for _ in range(2):
                for name in medians:
                    scaler = (
                        torch.amp.GradScaler("cpu", init_scale=2.0**16)
                        if name == "torch"
                        else lossscale.GradScaler("cpu", init_scale=2.0**16)
                    )
                    opt = NoopOptimizer(params)
                    measure(scaler, opt, loss, sweep, 20)  # state made, caches of the code path filled
                    medians[name].append(measure(scaler, opt, loss, sweep, args.repeats))
            a, b = (statistics.median(v) * 1e6 for v in medians.values())
            print(f"| {label} | {a:.1f} | {b:.1f} | {b / a:.1f} |")
    finally:
        gc.enable()


if __name__ == "__main__":
    main()
