"""Tensor operations after the backward (unscale, clip, step, update) per optimizer path, beside torch's.

    python benchmarks/ops_per_path.py --json > benchmarks/results/ops_per_path.json
    git archive <base commit> src | tar -x -C /tmp/base
    python benchmarks/ops_per_path.py --src /tmp/base/src --json > benchmarks/results/ops_per_path_before.json
    python benchmarks/ops_per_path.py --compare benchmarks/results/ops_per_path_before.json \\
        benchmarks/results/ops_per_path.json        # the before/after table (docs/performance.md)

The model is ``benchmarks/bench_iteration.py``'s MLP (8 layers, 256 wide, batch 32, FP16 autocast on one CPU
thread), the optimizers its three (SGD momentum, AdamW foreach, AdamW fused), each with no clip, torch's
recipe (``unscale_`` then ``torch.nn.utils.clip_grad_norm_``) and lossscale's own ``clip_grad_norm_``.
lossscale is counted configured as torch (``loss_check=False, min_scale=None, max_scale=None``) and at
its defaults; ``torch.amp.GradScaler`` beside it (its "own clip" row is its recipe: it has no other).
Operations are kernel launches as ``tests/_sync.count_device_work`` models a device (the CPU stands for
it), counted at steady state (after 3 iterations). Deterministic: fine on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
OPTIMIZERS = ("sgd", "adamw_foreach", "adamw_fused")
CLIPS = ("none", "torch recipe", "own clip")
CONFIGS = {"as torch": dict(loss_check=False, min_scale=None, max_scale=None), "defaults": {}}


def _side(kind: str, scaler, clip: str):
    """A fresh 8 x 256 MLP, its optimizer, and ``(forward_backward, optimizer_side)`` with ``scaler``."""
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 256, generator=g), torch.randint(0, 256, (32,), generator=g)
    if kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **{kind.split("_")[1]: True})

    def forward_backward():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()

    def optimizer_side():
        if clip == "torch recipe" or (clip == "own clip" and isinstance(scaler, torch.amp.GradScaler)):
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        elif clip == "own clip":
            scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()

    return forward_backward, optimizer_side


def _ops(kind: str, scaler, clip: str) -> int:
    from _sync import count_device_work

    forward_backward, optimizer_side = _side(kind, scaler, clip)
    for _ in range(3):
        forward_backward()
        optimizer_side()
    forward_backward()
    with count_device_work() as work:
        optimizer_side()
    return work.launches


def count() -> dict:
    import torch

    import lossscale

    rows = []
    for kind in OPTIMIZERS:
        for clip in CLIPS:
            row = {"optimizer": kind, "clip": clip, "torch": _ops(kind, torch.amp.GradScaler("cpu"), clip)}
            for name, keywords in CONFIGS.items():
                row[name] = _ops(kind, lossscale.GradScaler(**keywords), clip)
            rows.append(row)
    return {"lossscale": os.path.dirname(lossscale.__file__), "torch": torch.__version__, "rows": rows}


def table(before: dict, after: dict) -> str:
    """A markdown table: per path, torch's count and lossscale's before -> after, as torch and at the defaults."""
    lines = [
        "| optimizer | clip | torch | lossscale as torch (before → after) | lossscale defaults (before → after) |",
        "|---|---|---:|---:|---:|",
    ]
    for a, b in zip(before["rows"], after["rows"]):
        lines.append(
            f"| {b['optimizer']} | {b['clip']} | {b['torch']} | {a['as torch']} → {b['as torch']} "
            f"| {a['defaults']} → {b['defaults']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", default=os.path.join(HERE, "..", "src"), help="the src/ directory to count")
    parser.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="two --json outputs: a table")
    args = parser.parse_args(argv)
    if args.compare:
        print(table(*(json.load(open(path)) for path in args.compare)))
        return 0
    sys.path.insert(0, os.path.abspath(args.src))
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the launch counter (a test instrument)
    import torch

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    result = count()
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for r in result["rows"]:
            print(
                f"{r['optimizer']:14s} {r['clip']:13s} torch {r['torch']:3d}  as torch {r['as torch']:3d}  "
                f"defaults {r['defaults']:3d}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
