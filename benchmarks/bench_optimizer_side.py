"""Where the optimizer side's time goes: ``unscale_``, ``step`` and ``update`` timed apart, lossscale against torch.

    python benchmarks/bench_optimizer_side.py                 # GPT-2 (7.4M), AdamW foreach, AdamW fused, SGD
    python benchmarks/bench_optimizer_side.py --iterations 8  # fewer interleaved iterations
    python benchmarks/bench_optimizer_side.py --quick         # a smoke run (a tiny GPT-2, 2 iterations)
    python benchmarks/bench_optimizer_side.py --model mlp --iterations 300   # the host-bound MLP (batch 32)

``bench_iteration.py`` times the optimizer side (clip, step, update) as one figure; this splits it, on
the same GPT-2 from a config (or, with ``--model mlp``, the same host-bound MLP), one thread: each
iteration runs the forward and backward untimed except ``scaler.scale(loss)``, then times
``scaler.unscale_(opt)``, ``scaler.step(opt)`` and ``scaler.update()`` apart (torch's recipe without
the clip). lossscale's ``GradScaler()`` at its defaults and ``torch.amp.GradScaler("cpu")``
alternate iteration by iteration, after 3 warm-up iterations each; a figure is the median over the
iterations. Writes ``benchmarks/results/optimizer_side.md`` (``optimizer_side_mlp.md`` with ``--model mlp``,
``optimizer_side_quick.md`` with ``--quick``).
Nothing is asserted; CI runs ``--quick`` as a smoke test. Single calls of a few ms move by about 10%
between runs on a shared machine (``step``, the same code on both sides, is the control).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))  # measure the checkout this file lives in
sys.path.insert(0, HERE)
from bench_iteration import gpt2, mlp, optimizer  # noqa: E402  (the same models and optimizers)

import lossscale  # noqa: E402

PARTS = ("scale", "unscale_", "step", "update")


def iteration(model, loss, opt, scaler, times: list) -> None:
    """Forward and backward (untimed), ``scale`` and the three calls timed apart (ms)."""
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        value = loss(model)
    start = time.perf_counter()
    scaled = scaler.scale(value)
    scaled_at = time.perf_counter()
    scaled.backward()
    t0 = time.perf_counter()
    scaler.unscale_(opt)
    t1 = time.perf_counter()
    scaler.step(opt)
    t2 = time.perf_counter()
    scaler.update()
    t3 = time.perf_counter()
    times.append(((scaled_at - start) * 1e3, (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3))


def measure(kind: str, iterations: int, quick: bool = False, model_name: str = "gpt2") -> dict:
    """``{side: {part: median ms}}`` for one optimizer."""
    make = gpt2 if model_name == "gpt2" else mlp
    sides = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, scaler in (("lossscale", lossscale.GradScaler()), ("torch", torch.amp.GradScaler("cpu"))):
            model, loss = make(quick)
            sides[name] = (model, loss, optimizer(kind, model.parameters()), scaler)
    times = {name: [] for name in sides}
    for _ in range(3):
        for side in sides.values():
            iteration(*side, [])
    for i in range(iterations):
        order = ("lossscale", "torch") if i % 2 else ("torch", "lossscale")
        for name in order:
            iteration(*sides[name], times[name])
    return {
        name: {part: statistics.median(t[k] for t in times[name]) for k, part in enumerate(PARTS)} for name in sides
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=None, help="interleaved iterations (default 16)")
    parser.add_argument("--quick", action="store_true", help="a tiny GPT-2 and 2 iterations (a smoke run)")
    parser.add_argument("--model", choices=("gpt2", "mlp"), default="gpt2")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    iterations = args.iterations or (2 if args.quick else 16)
    lines = [
        "| optimizer | side | scale ms | unscale_ ms | step ms | update ms | total ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in ("adamw_foreach", "adamw_fused", "sgd"):
        result = measure(kind, iterations, args.quick, args.model)
        for name, parts in result.items():
            row = (
                f"| {kind} | {name} | "
                + " | ".join(f"{parts[p]:.3f}" for p in PARTS)
                + f" | {sum(parts.values()):.3f} |"
            )
            lines.append(row)
            print(row, flush=True)
    os.makedirs(args.out, exist_ok=True)
    name = "optimizer_side" + ("_quick" if args.quick else "_mlp" if args.model == "mlp" else "") + ".md"
    model = ("tiny " if args.quick else "") + ("GPT-2 7.4M" if args.model == "gpt2" else "MLP 8x256, batch 32")
    command = "python benchmarks/bench_optimizer_side.py " + " ".join(argv if argv is not None else sys.argv[1:])
    with open(os.path.join(args.out, name), "w") as f:
        f.write(
            f"# optimizer side, part by part ({time.strftime('%Y-%m-%d')}, torch {torch.__version__}, CPU, 1 thread, "
            f"{model}, {iterations} interleaved iterations, medians)\n\n`{command}`\n\n" + "\n".join(lines) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
