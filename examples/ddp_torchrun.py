"""Data-parallel FP16 training with lossscale.GradScaler, launched by torchrun.

    torchrun --standalone --nproc_per_node=2 examples/ddp_torchrun.py
    torchrun --standalone --nproc_per_node=2 examples/ddp_torchrun.py --inject-at 7

One GPU per rank with NCCL when CUDA is available, else CPU processes with gloo. ``--inject-at N``
writes an inf into the last rank's gradient at step N, after DDP's all-reduce, so only that rank
sees it: every rank still skips step N and keeps the same loss scale, because the scaler
all-reduces its found-inf flag over the default process group (``process_group="default"``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import lossscale
from lossscale import distributed as lsd


def train(steps: int = 20, inject_at: int = -1, log=print) -> lossscale.GradScaler:
    """Train a small classifier on the current default process group; returns the scaler."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    torch.manual_seed(0)  # DDP broadcasts rank 0's weights anyway
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(device)
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = lossscale.GradScaler(device.type, model=net)  # reduces over the default group
    data = torch.Generator().manual_seed(1234 + rank)  # each rank its own batches
    for step in range(steps):
        x = torch.randn(64, 32, generator=data).to(device)
        y = x[:, :10].argmax(dim=1)  # a learnable target
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if step == inject_at and rank == world - 1:
            net[0].weight.grad[0, 0] = float("inf")  # this rank only: DDP's all-reduce is done
        scaler.unscale_(optimizer)  # one all-reduce of the flags; the skip decision is global
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        if step % 5 == 0 or scaler.last_step_skipped:
            state = lsd.check_consistency(scaler)  # debug check: raises if the ranks disagree
            if rank == 0:
                log(
                    f"step {step:3d}  loss {loss.item():.4f}  scale {state.scale:g}  "
                    f"skipped {scaler.last_step_skipped}  (skipped so far: {state.skipped_steps})"
                )
    return scaler


# What torchrun sets in every process it starts; init_process_group("env://") reads them.
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--inject-at", type=int, default=-1, help="plant an inf on the last rank at this step")
    args = parser.parse_args()
    missing = [k for k in _TORCHRUN_ENV if k not in os.environ]
    if missing:  # run directly: torch would fail with "environment variable RANK expected, but not set"
        cmd = " ".join(["torchrun --standalone --nproc_per_node=2", sys.argv[0], *sys.argv[1:]])
        print(
            f"{sys.argv[0]} runs one process per rank and must be started by torchrun (not set: "
            f"{', '.join(missing)}). Run:\n    {cmd}",
            file=sys.stderr,
        )
        return 2
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # torchrun's env:// settings
    try:
        train(args.steps, args.inject_at)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
