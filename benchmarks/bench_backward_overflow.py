"""A backward that overflows FP16 at any scale >= 1: optimizer steps taken, scalers side by side.

The model (:class:`Config`, built in code) has one block whose backward overflows FP16 while its forward
and the gradient leaving it stay in range: the block divides ``down``'s output by ``gain`` and multiplies
``up``'s by it, so the forward comes back to its input's size, while the gradient between the two is
``gain`` times the one arriving (past 65504 at scale 1 for the loss this model trains on: a sum over
tokens). A scale below 1 fits it; no scale >= 1 does.

Runs (AdamW, FP16 autocast on CPU, the same data and initial weights):

* ``torch``: ``torch.amp.GradScaler("cpu")``: its scale backs off below 1.
* ``lossscale``: ``lossscale.GradScaler()``: the default floor ``min_scale=1`` holds it; it reports stuck.
* ``lossscale_upcast``: ``lossscale.GradScaler(model=model, trace=True, on_backward_overflow="upcast")``.
* ``lossscale_min_scale_none``: ``lossscale.GradScaler(min_scale=None)``: torch's unbounded backoff.
* ``lossscale_min_scale_2**-8``: ``lossscale.GradScaler(min_scale=2**-8)``: a lower floor.
* ``fp32_by_hand``: ``lossscale.keep_fp32(model, ["block"])`` before training, ``lossscale.GradScaler()``.
* ``fp32``: no autocast, no scaler (the reference loss curve).

Usage::

    python benchmarks/bench_backward_overflow.py            # 40 steps, 6 runs, about 10 s on one core

Also, for the choice of the default floor: how many skipped steps a persistent NaN gradient takes to be
reported stuck with ``min_scale`` 1, 2**-8 and None.

Writes ``benchmarks/results/backward_overflow.json`` (every step's loss, skip and scale, per run) and
``backward_overflow.md`` (the table). Nothing is timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import warnings
from typing import Dict, List

import torch

import lossscale

RUNS = ("torch", "lossscale", "lossscale_upcast", "lossscale_min_scale_none", "lossscale_min_scale_2**-8",
        "fp32_by_hand", "fp32")
#: The floors compared for the cost of a lower one: how long a persistent NaN takes to be reported stuck.
FLOORS = {"1 (default)": 1.0, "2**-8": 2.0**-8, "None": None}


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
    def __init__(self, cfg: Config):
        super().__init__()
        torch.manual_seed(cfg.seed)
        self.inp = torch.nn.Linear(cfg.d_in, cfg.d)
        self.block = Block(cfg)
        self.head = torch.nn.Linear(cfg.d, cfg.d_out)

    def forward(self, x):
        return self.head(self.block(torch.relu(self.inp(x))))


def data(cfg: Config, step: int):
    """The batch of ``step``: inputs and a fixed linear target of them."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(cfg.batch, cfg.d_in, generator=g) * cfg.input_scale
    w = torch.randn(cfg.d_in, cfg.d_out, generator=torch.Generator().manual_seed(7)) / cfg.d_in**0.5
    return x, x @ w


def loss_of(model, x, y, fp16: bool):
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        out = model(x)
    return (out.float() - y).pow(2).sum()  # summed over the batch's tokens (the large-gradient case)


def _torch_skipped(scaler, opt) -> bool:
    return any(v.item() > 0 for v in scaler._found_inf_per_device(opt).values())


def train(cfg: Config, run: str) -> Dict[str, List]:
    """One run: per step the loss (before the step), whether it was skipped, the scale it ran with."""
    model = Model(cfg)
    if run == "fp32_by_hand":
        lossscale.keep_fp32(model, ["block"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    scaler = {"torch": lambda: torch.amp.GradScaler("cpu"),
              "lossscale": lambda: lossscale.GradScaler(),
              "lossscale_upcast": lambda: lossscale.GradScaler(model=model, trace=True,
                                                               on_backward_overflow="upcast"),
              "lossscale_min_scale_none": lambda: lossscale.GradScaler(min_scale=None),
              "lossscale_min_scale_2**-8": lambda: lossscale.GradScaler(min_scale=2.0**-8),
              "fp32_by_hand": lambda: lossscale.GradScaler(),
              "fp32": lambda: None}[run]()
    out = {"loss": [], "skipped": [], "scale": [], "events": []}
    for step in range(cfg.steps):
        x, y = data(cfg, step)
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, x, y, fp16=run != "fp32")
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
            warnings.simplefilter("always")
            scaler.update()
        out["skipped"].append(skipped)
        out["events"] += [f"step {step}: {w.message}" for w in caught if "FP32" in str(w.message)]
    if run == "lossscale_upcast":
        out["upcast_modules"] = list(scaler.health().upcast_modules)
    return out


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
    meta = {"config": dataclasses.asdict(cfg), "torch": torch.__version__, "python": platform.python_version(),
            "command": "python benchmarks/bench_backward_overflow.py"}
    with open(os.path.join(args.out, "backward_overflow.json"), "w") as f:
        json.dump({"meta": meta, "runs": results, "persistent_nan_stuck_after": stuck}, f, indent=1)
    text = markdown(cfg, results, stuck)
    with open(os.path.join(args.out, "backward_overflow.md"), "w") as f:
        f.write(text)
    print(text)
    return results


def markdown(cfg: Config, results: Dict[str, Dict], stuck: Dict[str, int]) -> str:
    lines = [f"# A backward that overflows FP16 at any scale >= 1: {cfg.steps} steps, AdamW",
             "", "`python benchmarks/bench_backward_overflow.py` (torch " + torch.__version__ + ", CPU, FP16 autocast; "
             f"block gain 2**{int(torch.log2(torch.tensor(cfg.gain)).item())}, batch {cfg.batch}, loss summed over "
             "the batch).", "",
             "| run | steps taken | first step taken | scale at the end | loss at step 0 | loss at the end |",
             "|---|---|---|---|---|---|"]
    for run, r in results.items():
        taken = [i for i, s in enumerate(r["skipped"]) if not s]
        lines.append(f"| {run} | {len(taken)} of {cfg.steps} | {taken[0] if taken else '-'} | {r['scale'][-1]:g} | "
                     f"{r['loss'][0]:.4g} | {r['loss'][-1]:.4g} |")
    events = results["lossscale_upcast"]["events"]
    if events:
        lines += ["", "What `on_backward_overflow=\"upcast\"` did:", ""] + [f"- {e}" for e in events]
    lines += ["", "The price of a lower floor: a NaN gradient on every step (no scale cures it) is reported stuck "
              "(`on_stuck`) after this many skipped steps, from the default initial scale 2**16:", "",
              "| min_scale | skipped steps until reported stuck |", "|---|---|"]
    lines += [f"| {label} | {n if n is not None else 'not within 400'} |" for label, n in stuck.items()]
    every = max(1, cfg.steps // 8)
    lines += ["", "Loss (before each step's update):", "",
              "| step | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]
    for step in list(range(0, cfg.steps, every)) + [cfg.steps - 1]:
        lines.append(f"| {step} | " + " | ".join(f"{r['loss'][step]:.4g}" for r in results.values()) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
