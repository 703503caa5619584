"""How far the synced ``update()``'s own work keeps ``check+unscale+update`` from torch's time.

    python benchmarks/update_bound.py                      # 1M parameters / 16 tensors, both settings
    python benchmarks/update_bound.py --sizes 1000000x200 --runs 3

``bench_scaler.py``'s ``check+unscale+update`` row (``step`` + ``update`` with a no-op optimizer,
lossscale against torch in one process, interleaved, median of per-repeat ratios), measured twice in
one run: as it is, and with the three parts of the synced ``update()`` that torch has no counterpart
for made free (replaced by no-ops): the policy's pure rule (``_update.host_rule`` returns the state it
was given), sending the state to the device (``TensorState.load_``), and the health account and stuck
check (``GradScaler._learn``). The scale never moves in this row, so the free version runs the same
kernels. The ratio it reaches is the floor of the rest (the gather, torch's check kernel, the skip
decision's read, the bookkeeping): what no work on those three parts alone can go below.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_scaler as B  # noqa: E402

import lossscale  # noqa: E402
from lossscale import _state, scaler  # noqa: E402


@contextlib.contextmanager
def free_update_parts():
    """The pure rule, the state's copy to the device and the health account as no-ops."""
    saved = scaler.host_rule, _state.TensorState.load_, scaler.GradScaler._learn
    scaler.host_rule = lambda policy, before, flags, new_scale: before
    _state.TensorState.load_ = lambda self, state, staging_free=False: None
    scaler.GradScaler._learn = lambda self, state, scale_before, evidence: None
    try:
        yield
    finally:
        scaler.host_rule, _state.TensorState.load_, scaler.GradScaler._learn = saved


def ratios(n_params: int, n_tensors: int, settings: str, free: bool, runs: int, repeats: int):
    """``runs`` medians of per-repeat ratios (lossscale / torch) of the row, fresh scalers each call."""
    per = n_params // n_tensors
    g = torch.Generator().manual_seed(0)
    grads0 = [torch.randn(per, generator=g).mul_(1e-3 * B.SCALE) for _ in range(n_tensors)]
    params = [torch.nn.Parameter(torch.zeros(per)) for _ in range(n_tensors)]
    for p, grad in zip(params, grads0):
        p.grad = grad.clone()
    cfg = dict(init_scale=B.SCALE, growth_interval=10**9)
    with free_update_parts() if free else contextlib.nullcontext():
        sides = [B.Side("torch", torch.amp.GradScaler("cpu", **cfg), params),
                 B.Side("lossscale", lossscale.GradScaler("cpu", **cfg, **B.SETTINGS[settings]), params)]
        row = lambda side: B.iteration(side, "noop", clip=False)  # noqa: E731
        for side in sides:
            row(side)  # warm-up
        return [B.timed_pair(sides, row, grads0, repeats)[1] for _ in range(runs)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1000000x16", help="comma list of PARAMSxTENSORS")
    ap.add_argument("--runs", type=int, default=5, help="medians per configuration (default 5)")
    ap.add_argument("--repeats", type=int, default=401, help="repeats per median (default 401)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print("| size | settings | as it is | rule, copy and account free |")
    print("|---|---|---|---|")
    for size in args.sizes.split(","):
        n, k = (int(v) for v in size.split("x"))
        for settings in ("default", "torch-like"):
            cells = [" ".join(f"{r:.3f}" for r in ratios(n, k, settings, free, args.runs, args.repeats))
                     for free in (False, True)]
            print(f"| {n / 1e6:g}M / {k} | {settings} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
