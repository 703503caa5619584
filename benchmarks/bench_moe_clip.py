"""What ``clip_grad_norm_(..., expert_parallel=...)`` costs: a mixture-of-experts iteration on gloo ranks.

    python benchmarks/bench_moe_clip.py              # 2 ranks, 200 pairs (about 1 minute)
    python benchmarks/bench_moe_clip.py --quick      # a smoke run

Writes ``benchmarks/results/bench_moe_clip.{json,md}`` (``--out`` to change).

Each of 2 CPU processes (gloo, one thread each) holds the dense layers (replicated: their gradients
summed over the ranks by hand, as DDP would) and its own experts (expert parallel over the two ranks).
An iteration: the forward under FP16 autocast (dense, then this rank's experts), ``scale(loss).backward()``,
the dense gradients all-reduced, ``scaler.clip_grad_norm_(opt, 1.0)``, ``step``, ``update``. Two twin
set-ups per rank differ only in the clip:

* ``expert_parallel``: ``clip_grad_norm_(opt, 1.0, expert_parallel=(expert params, the EP group))``,
  the global norm of the whole model (the experts' squares summed over the EP group, the dense
  parameters counted once);
* ``local``: ``clip_grad_norm_(opt, 1.0)``, the norm of this rank's gradients only: wrong for a MoE (each
  rank clips by another norm), and the cost of the clip without the reduction.

A measurement is a pair, one iteration of each, which goes first alternating (both ranks alike, so
their collectives meet); the ratio is the median of rank 0's pairs (expert_parallel / local). Nothing
is asserted; the norms' agreement is checked in ``tests/test_moe.py``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))  # measure the checkout this file lives in
sys.path.insert(0, HERE)
from bench_iteration import interleaved  # noqa: E402  (the benchmarks' one measuring loop)

import lossscale  # noqa: E402

WORLD = 2
HOST = "127.0.0.1"
TIMEOUT = datetime.timedelta(seconds=60)  # a collective left waiting raises after this long


class Model(torch.nn.Module):
    """Two dense layers, then this rank's expert (two layers); every width ``width``."""

    def __init__(self, width: int, rank: int):
        super().__init__()
        torch.manual_seed(0)
        self.dense = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))
        torch.manual_seed(1 + rank)  # each rank's experts are its own
        self.expert = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))

    def forward(self, x):
        h = self.dense(x)
        return h + self.expert(h)


class Side:
    def __init__(self, width: int, rank: int, expert_parallel: bool):
        self.model = Model(width, rank)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        self.scaler = lossscale.GradScaler()
        self.ep = (list(self.model.expert.parameters()), dist.group.WORLD) if expert_parallel else None
        g = torch.Generator().manual_seed(rank)
        self.x, self.y = torch.randn(32, width, generator=g), torch.randn(32, width, generator=g)

    def iteration(self) -> float:
        start = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(self.model(self.x).float(), self.y)
        self.scaler.scale(loss).backward()
        for p in self.model.dense.parameters():  # data parallel: what DDP does for the dense layers
            dist.all_reduce(p.grad)
        if self.ep is None:
            self.scaler.clip_grad_norm_(self.opt, 1.0)
        else:
            self.scaler.clip_grad_norm_(self.opt, 1.0, expert_parallel=self.ep)
        self.scaler.step(self.opt)
        self.scaler.update()
        return time.perf_counter() - start


def _loopback_interface() -> str:
    """The loopback interface's name ('lo' on Linux, 'lo0' on macOS), so gloo binds nothing else."""
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return ""


def measure(rank: int, width: int, pairs: int) -> tuple:
    """Rank ``rank``'s interleaved pairs: (expert_parallel seconds, local seconds)."""
    ep, local = Side(width, rank, True), Side(width, rank, False)
    # Both ranks run the same sequence, so their collectives meet.
    return interleaved(ep.iteration, local.iteration, pairs, warmup=5)


def worker(rank: int, port: int, width: int, pairs: int, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
    torch.set_num_threads(1)
    store = dist.TCPStore(HOST, port, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=TIMEOUT)
    try:
        t_ep, t_local = measure(rank, width, pairs)
        # Free what measure() built (some of it in reference cycles, which only the collector frees)
        # before the group is destroyed, so that nothing refers to the group any more and destroying it
        # joins gloo's worker threads. Without this a rank aborted at exit in about one run in ten
        # ("terminate called without an active exception": a gloo thread releasing a finished
        # all-reduce's tensors while the interpreter shut down).
        gc.collect()
        ratios = [a / b for a, b in zip(t_ep, t_local)]
        if rank == 0:
            with open(out, "w") as fh:
                json.dump(
                    dict(
                        ratio=statistics.median(ratios),
                        expert_parallel_ms=1e3 * statistics.median(t_ep),
                        local_ms=1e3 * statistics.median(t_local),
                    ),
                    fh,
                )
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--pairs", type=int, default=None)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    pairs = args.pairs or (5 if args.quick else 200)
    width = 16 if args.quick else args.width
    os.makedirs(args.out, exist_ok=True)
    name = "bench_moe_clip" + ("_quick" if args.quick else "")
    raw = os.path.join(args.out, f"{name}.rank0.json")
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    mp.spawn(worker, args=(store.port, width, pairs, raw), nprocs=WORLD, join=True)
    del store
    with open(raw) as fh:
        result = json.load(fh)
    os.remove(raw)
    meta = dict(torch=torch.__version__, python=platform.python_version(), ranks=WORLD, width=width, pairs=pairs)
    with open(os.path.join(args.out, f"{name}.json"), "w") as fh:
        json.dump(dict(meta=meta, **result), fh, indent=1)
    text = (
        f"# clip_grad_norm_(expert_parallel=...) on {WORLD} gloo ranks\n\n"
        f"`python benchmarks/bench_moe_clip.py{' --quick' if args.quick else ''}` ({meta})\n\n"
        "| clip | iteration ms (rank 0, median) |\n|---|---|\n"
        f"| `expert_parallel=(experts, group)`: the global norm | {result['expert_parallel_ms']:.3f} |\n"
        f"| none given: this rank's norm only | {result['local_ms']:.3f} |\n\n"
        f"Ratio (median of {pairs} interleaved pairs): **{result['ratio']:.3f}**.\n"
    )
    with open(os.path.join(args.out, f"{name}.md"), "w") as fh:
        fh.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
