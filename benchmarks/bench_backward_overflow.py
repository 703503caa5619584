"""A backward that overflows FP16 at any scale >= 1: optimizer steps taken, scalers side by side.

The model, its data and its training are :mod:`lossscale.demo.backward_overflow` (built from a config in
code; ``lossscale audit-demo`` runs five of these runs too). One block's backward overflows FP16 while
its forward and the gradient leaving it stay in range; a scale below 1 fits it, no scale >= 1 does.

Runs (AdamW, FP16 autocast on CPU, the same data and initial weights):

* ``torch``: ``torch.amp.GradScaler("cpu")``: its scale backs off below 1.
* ``lossscale``: ``lossscale.GradScaler()``: the default floor ``min_scale=2**-24`` lets it back off too.
* ``lossscale_min_scale_1``: ``lossscale.GradScaler(min_scale=1.0)``: a floor at 1 holds it; it reports
  stuck.
* ``lossscale_upcast``: ``lossscale.GradScaler(model=model, trace=True, on_backward_overflow="upcast")``.
* ``lossscale_upcast_min_scale_1``: the same with ``min_scale=1.0``.
* ``lossscale_min_scale_none``: ``lossscale.GradScaler(min_scale=None)``: torch's unbounded backoff.
* ``lossscale_min_scale_2**-8``: ``lossscale.GradScaler(min_scale=2**-8)``.
* ``fp32_by_hand``: ``lossscale.keep_fp32(model, ["block"])`` before training, ``lossscale.GradScaler()``.
* ``fp32``: no autocast, no scaler (the reference loss curve).

Usage::

    python benchmarks/bench_backward_overflow.py            # 40 steps, 9 runs, a few seconds on one core

Also, for the choice of the default floor: how many skipped steps a persistent NaN gradient takes to be
reported stuck with ``min_scale`` 1, 2**-24 (the default) and None.

Writes ``benchmarks/results/backward_overflow.json`` (every step's loss, skip and scale, per run) and
``backward_overflow.md`` (the table). Nothing is timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
from typing import Dict

import torch

import lossscale
from lossscale.demo.backward_overflow import SCALERS, Config, train

RUNS = tuple(SCALERS)
#: The floors compared for the cost of a lower one: how long a persistent NaN takes to be reported stuck.
FLOORS = {"1": 1.0, "2**-24 (default)": 2.0**-24, "None": None}


def stuck_after(min_scale, limit: int = 400):
    """Skipped steps until ``lossscale.GradScaler(min_scale=...)`` reports a persistent NaN gradient as
    stuck (``on_stuck="raise"``), or None within ``limit``: the price of a lower floor."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = lossscale.GradScaler(min_scale=min_scale, on_stuck="raise")
    for step in range(limit):
        opt.zero_grad()
        scaler.scale((p * p).sum()).backward()
        p.grad[0] = float("nan")  # a NaN in the backward every step: no scale cures it
        scaler.step(opt)
        try:
            scaler.update()
        except RuntimeError:
            return step + 1
    return None


def main(argv=None) -> Dict[str, Dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = Config(steps=args.steps)
    results = {run: train(cfg, run) for run in RUNS}
    stuck = {label: stuck_after(floor) for label, floor in FLOORS.items()}
    os.makedirs(args.out, exist_ok=True)
    meta = {
        "config": dataclasses.asdict(cfg),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": "python benchmarks/bench_backward_overflow.py",
    }
    with open(os.path.join(args.out, "backward_overflow.json"), "w") as f:
        json.dump({"meta": meta, "runs": results, "persistent_nan_stuck_after": stuck}, f, indent=1)
    text = markdown(cfg, results, stuck)
    with open(os.path.join(args.out, "backward_overflow.md"), "w") as f:
        f.write(text)
    print(text)
    return results


def markdown(cfg: Config, results: Dict[str, Dict], stuck: Dict[str, int]) -> str:
    lines = [
        f"# A backward that overflows FP16 at any scale >= 1: {cfg.steps} steps, AdamW",
        "",
        "`python benchmarks/bench_backward_overflow.py` (torch " + torch.__version__ + ", CPU, FP16 autocast; "
        f"block gain 2**{int(torch.log2(torch.tensor(cfg.gain)).item())}, batch {cfg.batch}, loss summed over "
        "the batch).",
        "",
        "| run | steps taken | first step taken | scale at the end | loss at step 0 | loss at the end |",
        "|---|---|---|---|---|---|",
    ]
    for run, r in results.items():
        taken = [i for i, s in enumerate(r["skipped"]) if not s]
        lines.append(
            f"| {run} | {len(taken)} of {cfg.steps} | {taken[0] if taken else '-'} | {r['scale'][-1]:g} | "
            f"{r['loss'][0]:.4g} | {r['loss'][-1]:.4g} |"
        )
    for run in ("lossscale_upcast", "lossscale_upcast_min_scale_1"):
        events = results[run]["events"]
        if events:
            lines += ["", f'What `on_backward_overflow="upcast"` did in `{run}`:', ""] + [f"- {e}" for e in events]
    lines += [
        "",
        "The price of a lower floor: a NaN gradient on every step (no scale cures it) is reported stuck "
        "(`on_stuck`) after this many skipped steps, from the default initial scale 2**16:",
        "",
        "| min_scale | skipped steps until reported stuck |",
        "|---|---|",
    ]
    lines += [f"| {label} | {n if n is not None else 'not within 400'} |" for label, n in stuck.items()]
    every = max(1, cfg.steps // 8)
    lines += [
        "",
        "Loss (before each step's update):",
        "",
        "| step | " + " | ".join(results) + " |",
        "|---|" + "---|" * len(results),
    ]
    for step in list(range(0, cfg.steps, every)) + [cfg.steps - 1]:
        lines.append(f"| {step} | " + " | ".join(f"{r['loss'][step]:.4g}" for r in results.values()) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
