"""FSDP2 + FP16 with lossscale.GradScaler, launched by torchrun: the recipe verl, torchtitan and NeMo-RL ask for.

    torchrun --standalone --nproc_per_node=2 examples/fsdp2_fp16.py
    torchrun --standalone --nproc_per_node=2 examples/fsdp2_fp16.py --nan-at 5 --checkpoint /tmp/ckpt

The lines FP16 needs on FSDP2 (``fully_shard``), and nothing else:

* ``MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)``: the forward and
  backward run in FP16, the gradients are reduced (and kept) in FP32, the optimizer steps FP32 shards;
* ``scaler = lossscale.GradScaler(model=model)``: one scaler per rank; its skip decision is
  all-reduced over the default group, so every rank skips or steps together;
* ``scaler.scale(loss).backward()``, ``scaler.clip_grad_norm_(optimizer, max_norm)`` (the global
  norm over every rank's shards, one small all-reduce), ``scaler.step(optimizer)``, ``scaler.update()``;
* the scaler's ``state_dict()`` beside the model's and the optimizer's in the DCP checkpoint.

``--nan-at N`` puts a NaN into one input row of the last rank's batch at step N, a bad batch: the
loss is NaN before any scaling, so every rank skips the step and the scale is kept (torch's scaler
would halve it). One GPU per rank with NCCL when CUDA is available, else CPU processes with gloo.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import lossscale


def build(device: torch.device, seed: int = 0):
    """The model, sharded with FP16 compute and FP32 gradient reduction, and its optimizer."""
    torch.manual_seed(seed)  # the same initial weights on every rank, before sharding
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    ).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def batch(step: int, rank: int, device: torch.device, nan_at: int = -1, world: int = 1):
    """This rank's batch for ``step`` (a NaN row on the last rank at ``nan_at``)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 16, generator=g)
    y = x[:, :4].argmax(dim=1)
    if step == nan_at and rank == world - 1:
        x[0, 0] = float("nan")
    return x.to(device), y.to(device)


def save(path: str, model, optimizer, scaler) -> None:
    """A DCP checkpoint of the model, the optimizer and the scaler (every rank calls it)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "scaler": scaler.state_dict()}, checkpoint_id=path)


def load(path: str, model, optimizer, scaler) -> None:
    """Load :func:`save`'s checkpoint in place (every rank calls it)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "scaler": scaler.state_dict()}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scaler.load_state_dict(state["scaler"])


def train(steps: int = 20, nan_at: int = -1, checkpoint: str = "", save_at: int = -1, resume: bool = False, log=print):
    """Train on the current default process group. With ``checkpoint``: save there after step
    ``save_at``, or (``resume``) load it first and continue from ``save_at + 1``. Returns
    ``(model, scaler, records)``, a record per step: the loss scale used, skipped, the global norm."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model, optimizer = build(device)
    scaler = lossscale.GradScaler(device.type, model=model, init_scale=2.0**12)
    first = 0
    if resume:
        load(checkpoint, model, optimizer, scaler)
        first = save_at + 1
    records = []
    for step in range(first, steps):
        x, y = batch(step, rank, device, nan_at, world)
        optimizer.zero_grad(set_to_none=True)
        scale = scaler.get_scale()
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)  # FP16 forward; the loss in FP32
        scaler.scale(loss).backward()
        norm = scaler.clip_grad_norm_(optimizer, max_norm=1.0)  # the global norm, the same on every rank
        scaler.step(optimizer)
        scaler.update()
        records.append({"scale": scale, "skipped": scaler.last_step_skipped, "norm": float(norm)})
        if rank == 0 and (step % 5 == 0 or scaler.last_step_skipped):
            log(
                f"step {step:3d}  loss {loss.item():.4f}  scale {scale:g}  norm {float(norm):.4f}  "
                f"skipped {scaler.last_step_skipped}"
            )
        if checkpoint and step == save_at and not resume:
            save(checkpoint, model, optimizer, scaler)
    if rank == 0:
        log(scaler.health().text)
    return model, scaler, records


# What torchrun sets in every process it starts; init_process_group("env://") reads them.
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nan-at", type=int, default=-1, help="a NaN input row on the last rank at this step")
    parser.add_argument("--checkpoint", default="", help="a folder for the DCP checkpoint, saved at the middle step")
    args = parser.parse_args()
    missing = [k for k in _TORCHRUN_ENV if k not in os.environ]
    if missing:
        cmd = " ".join(["torchrun --standalone --nproc_per_node=2", sys.argv[0], *sys.argv[1:]])
        print(
            f"{sys.argv[0]} runs one process per rank and must be started by torchrun (not set: "
            f"{', '.join(missing)}). Run:\n    {cmd}",
            file=sys.stderr,
        )
        return 2
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        train(args.steps, args.nan_at, args.checkpoint, save_at=args.steps // 2 if args.checkpoint else -1)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
