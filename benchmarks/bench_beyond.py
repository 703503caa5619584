"""What the opt-in features beyond scaling cost per iteration, against the same scaler without them.

    python benchmarks/bench_beyond.py            # GPT-2 7.4M, 4 micro-batches, 16 pairs per row (~3 min)
    python benchmarks/bench_beyond.py --quick    # a smoke run
    python benchmarks/bench_beyond.py --model mlp --pairs 200   # the host-bound MLP, where fixed costs show

Writes ``benchmarks/results/bench_beyond.{json,md}`` (``bench_beyond_mlp.*`` with ``--model mlp``; ``--out``
to change). Each row is a pair of twin models (bench_iteration's GPT-2 from a config, or its host-bound
MLP, the same weights and batches), AdamW fused, an
accumulated step of 4 micro-batches under FP16 autocast, one side with ``GradScaler()`` at its defaults
and the other with one feature on; interleaved pairs, which goes first alternating; the ratio is the
median of the pairs' ratios (feature / default), with the host syncs of one iteration each side
(``tests/_sync``; a CPU run stands for the device). The first row runs the default on both sides: how
far from 1 a feature that costs nothing measures on this machine. Also timed, once:
``lossscale.check_setup(model, optimizer, scaler)``, which runs before training, not per iteration.
Nothing is asserted.

On the CPU a host read costs what its kernel costs: the queue a GPU would drain at each read is not
there. So the ``bad_microbatch="drop"`` row measures the check (one ``isfinite`` reduction and read per
micro-batch), not the pipeline stall a GPU pays for a sync (about the time the host needs to queue the
next micro-batch's first kernels; ``gpu_check.sh`` runs this file with ``--device cuda``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_iteration as bench  # noqa: E402  (its path set-up, model and clock)
from _sync import count_device_work  # noqa: E402

import lossscale  # noqa: E402

MICRO_BATCHES = 4

#: row name -> (GradScaler keywords, clip through the scaler)
ROWS = {
    "none (the default against itself: the noise floor)": (dict(), False),
    "bad_microbatch='drop'": (dict(bad_microbatch="drop"), False),
    "skip_if grad-norm z-score (its own norm pass)": (dict(skip_if=dict(grad_norm_zscore=6.0)), False),
    "skip_if grad-norm z-score, norm from clip_grad_norm_": (dict(skip_if=dict(grad_norm_zscore=6.0)), True),
    "skip_if loss z-score": (dict(skip_if=dict(loss_zscore=6.0)), False),
    "trace=True, on_forward_overflow='upcast'": (dict(trace=True, on_forward_overflow="upcast"), False),
    "trace=True, on_backward_overflow='upcast'": (dict(trace=True, on_backward_overflow="upcast"), False),
    "bad_microbatch='drop', scale(loss, weight=n_tokens)": (dict(bad_microbatch="drop"), False),
}
#: Rows whose micro-batches give their token count to scale() (the sequence length, the same for each).
WEIGHTED = {"bad_microbatch='drop', scale(loss, weight=n_tokens)"}
TOKENS = 32


class Side:
    """A model, AdamW fused and a scaler; one accumulated iteration of them."""

    def __init__(self, quick: bool, keywords: dict, clip: bool, weighted: bool = False, model: str = "gpt2"):
        self.model, self.loss = (bench.gpt2 if model == "gpt2" else bench.mlp)(quick)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        if keywords.get("trace"):
            keywords = dict(keywords, model=self.model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.scaler = lossscale.GradScaler(**keywords)
        self.clip = clip
        self.weight = {"weight": TOKENS} if weighted else {}

    def run(self):
        self.opt.zero_grad(set_to_none=True)
        for _ in range(MICRO_BATCHES):
            with torch.autocast(bench.DEVICE.type, dtype=torch.float16):
                loss = self.loss(self.model) / MICRO_BATCHES
            self.scaler.scale(loss, **self.weight).backward()
        if self.clip:
            self.scaler.clip_grad_norm_(self.opt, 1.0)
        self.scaler.step(self.opt)
        self.scaler.update()

    def iteration(self) -> float:
        start = bench.clock()
        self.run()
        return bench.clock() - start

    def syncs(self) -> int:
        with count_device_work() as work:
            self.run()
        return work.syncs


def row(name: str, pairs: int, quick: bool, model: str = "gpt2") -> dict:
    keywords, clip = ROWS[name]
    ours = Side(quick, keywords, clip, weighted=name in WEIGHTED, model=model)
    base = Side(quick, {}, clip, model=model)
    t_ours, t_base = bench.interleaved(ours.iteration, base.iteration, pairs)
    ratios = [a / b for a, b in zip(t_ours, t_base)]
    return dict(
        row=name,
        clip=clip,
        pairs=pairs,
        ratio=statistics.median(ratios),
        feature_ms=1e3 * statistics.median(t_ours),
        default_ms=1e3 * statistics.median(t_base),
        syncs=dict(feature=ours.syncs(), default=base.syncs()),
    )


def time_check_setup(quick: bool, model_name: str = "gpt2", repeats: int = 20) -> float:
    """Milliseconds one ``lossscale.check_setup`` takes on the benchmark's model (median of ``repeats``)."""
    model, _ = (bench.gpt2 if model_name == "gpt2" else bench.mlp)(quick)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    scaler = lossscale.GradScaler()
    times = []
    for _ in range(repeats):
        start = bench.clock()
        lossscale.check_setup(model, opt, scaler, dtype=torch.float16)
        times.append(bench.clock() - start)
    return 1e3 * statistics.median(times)


def table(rows) -> str:
    lines = [
        "| feature (vs the same scaler without it) | ratio | feature ms | default ms | syncs (feature / default) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['row']}{' + clip' if r['clip'] else ''} | {r['ratio']:.3f} | {r['feature_ms']:.1f} | "
            f"{r['default_ms']:.1f} | {r['syncs']['feature']} / {r['syncs']['default']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--pairs", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", choices=("gpt2", "mlp"), default="gpt2")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    bench.DEVICE = torch.device(args.device)
    if bench.DEVICE.type == "cpu":
        torch.set_num_threads(1)
    pairs = args.pairs or (3 if args.quick else 16)
    rows = []
    for name in ROWS:
        rows.append(row(name, pairs, args.quick, args.model))
        r = rows[-1]
        print(
            f"{name:58s} {r['ratio']:.3f}  ({r['feature_ms']:.1f} vs {r['default_ms']:.1f} ms; syncs "
            f"{r['syncs']['feature']} vs {r['syncs']['default']})",
            flush=True,
        )
    setup_ms = time_check_setup(args.quick, args.model)
    print(f"check_setup, once before training: {setup_ms:.2f} ms", flush=True)
    meta = dict(
        device=str(bench.DEVICE),
        torch=torch.__version__,
        python=platform.python_version(),
        threads=torch.get_num_threads(),
        micro_batches=MICRO_BATCHES,
        model=args.model,
        quick=args.quick,
    )
    os.makedirs(args.out, exist_ok=True)
    suffix = (
        ("_quick" if args.quick else "")
        + ("" if args.model == "gpt2" else f"_{args.model}")
        + ("" if bench.DEVICE.type == "cpu" else f"_{bench.DEVICE.type}")
    )
    with open(os.path.join(args.out, f"bench_beyond{suffix}.json"), "w") as fh:
        json.dump(dict(meta=meta, rows=rows, check_setup_ms=setup_ms), fh, indent=1)
    with open(os.path.join(args.out, f"bench_beyond{suffix}.md"), "w") as fh:
        fh.write(
            f"# Opt-in features beyond scaling: cost per iteration\n\n`python benchmarks/bench_beyond.py"
            f"{' --quick' if args.quick else ''}{'' if args.model == 'gpt2' else ' --model ' + args.model} "
            f"--pairs {pairs}`\n\n{meta}\n\n{table(rows)}\n\n"
            f"`lossscale.check_setup(model, optimizer, scaler)`, once before training: {setup_ms:.2f} ms "
            "(median of 20 calls).\n"
        )
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
