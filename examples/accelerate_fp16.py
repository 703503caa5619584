"""HF accelerate with lossscale: FP16 training (CPU or CUDA) with a skip-aware LR schedule and TensorBoard.

    pip install -c constraints.txt -e ".[integrations]"
    python examples/accelerate_fp16.py

A small MLP learns a random teacher network's labels (nothing is downloaded). The scale starts at
2**24, so the first steps overflow FP16 and are skipped: accelerate reports them
(``accelerator.optimizer_step_was_skipped``) and its prepared scheduler does not advance on them,
fused AdamW included. Runs on the CPU in a few seconds.
"""

import argparse
import tempfile

import torch
from accelerate import Accelerator
from torch.utils.tensorboard import SummaryWriter

from lossscale.integrations import accelerate as ls_accelerate
from lossscale.integrations.loggers import log_tensorboard


def data(steps: int, batch: int = 64, seed: int = 0):
    """Batches labelled by a fixed random teacher MLP."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    for p in teacher.parameters():
        p.data = torch.randn(p.shape, generator=g)
    for _ in range(steps):
        x = torch.randn(batch, 32, generator=g)
        with torch.no_grad():
            y = teacher(x).argmax(-1)
        yield x, y


def main(steps: int = 300, logdir: str = "") -> dict:
    """Train; return the loss, the scale, skipped steps and scheduler steps."""
    torch.manual_seed(0)
    accelerator = Accelerator(mixed_precision="fp16")  # FP16 needs no GPU here
    scaler = ls_accelerate.attach(accelerator, init_scale=2.0**24)  # before prepare()
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    writer = SummaryWriter(logdir or tempfile.mkdtemp(prefix="lossscale-accelerate-"))
    skipped = 0
    for step, (x, y) in enumerate(data(steps)):
        x, y = x.to(accelerator.device), y.to(accelerator.device)
        loss = torch.nn.functional.cross_entropy(model(x), y)  # the forward runs under FP16 autocast
        accelerator.backward(loss)  # scaled
        accelerator.clip_grad_norm_(model.parameters(), 1.0)  # unscaled first: the true norm
        optimizer.step()  # skipped on inf/NaN
        scheduler.step()  # not on skipped steps
        optimizer.zero_grad()
        skipped += accelerator.optimizer_step_was_skipped
        if step % 50 == 0 or step == steps - 1:
            log_tensorboard(writer, scaler, step)  # every scaler metric, one call
            print(
                f"step {step:4d}  loss {loss.item():.4f}  scale {scaler.get_scale():10.0f}  "
                f"lr {scheduler.get_last_lr()[0]:.2e}  skipped {skipped}"
            )
    writer.close()
    result = {
        "loss": loss.item(),
        "scale": scaler.get_scale(),
        "skipped": skipped,
        "scheduler_steps": scheduler.scheduler.last_epoch,
        "logdir": writer.log_dir,
    }
    print(
        f"{skipped} of {steps} steps skipped; the LR schedule advanced {result['scheduler_steps']} times. "
        f"TensorBoard: tensorboard --logdir {writer.log_dir}"
    )
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--logdir", default="", help="TensorBoard directory (default: a new temporary one)")
    args = parser.parse_args()
    main(args.steps, args.logdir)
