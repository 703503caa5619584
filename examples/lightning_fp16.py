"""Lightning with lossscale: FP16 on CPU or CUDA, a step-interval LR schedule that holds on skipped
steps, the scaler's metrics in TensorBoard; the Trainer and, with --fabric, Fabric.

    pip install -c constraints.txt -e ".[integrations]"
    python examples/lightning_fp16.py            # lightning.Trainer
    python examples/lightning_fp16.py --fabric   # lightning.Fabric

A small MLP learns a random teacher network's labels (nothing is downloaded). The scale starts at
2**24, so the first steps overflow FP16 and are skipped; the OneCycle schedule does not advance on
them. Runs on the CPU in a few seconds.
"""

import argparse
import tempfile

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lossscale.integrations.lightning import FabricMixedPrecision, MixedPrecision
from lossscale.schedulers import skip_aware


def dataset(n: int = 19200, seed: int = 0) -> torch.utils.data.TensorDataset:
    """Inputs labelled by a fixed random teacher MLP."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    for p in teacher.parameters():
        p.data = torch.randn(p.shape, generator=g)
    x = torch.randn(n, 32, generator=g)
    with torch.no_grad():
        return torch.utils.data.TensorDataset(x, teacher(x).argmax(-1))


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))


class Classifier(L.LightningModule):
    """An MLP classifier with AdamW and a per-step OneCycle schedule."""

    def __init__(self, steps: int):
        super().__init__()
        self.net, self.steps = net(), steps

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=self.steps)
        return [opt], [{"scheduler": sched, "interval": "step"}]


def with_trainer(steps: int, logdir: str) -> dict:
    plugin = MixedPrecision(init_scale=2.0**24)  # FP16 autocast on this machine's device, CPU included
    trainer = L.Trainer(
        max_steps=steps,
        plugins=[plugin],
        logger=TensorBoardLogger(logdir, name="trainer"),
        gradient_clip_val=1.0,
        log_every_n_steps=25,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Classifier(steps)
    trainer.fit(model, torch.utils.data.DataLoader(dataset(), batch_size=64))
    sched = trainer.lr_scheduler_configs[0].scheduler
    return {
        "loss": float(trainer.callback_metrics["loss"]),
        "skipped": plugin.scaler.counters()["skipped_steps"],
        "scheduler_steps": sched.last_epoch,
        "logdir": trainer.logger.log_dir,
    }


def with_fabric(steps: int, logdir: str) -> dict:
    plugin = FabricMixedPrecision(init_scale=2.0**24)
    fabric = L.Fabric(plugins=[plugin], loggers=L.fabric.loggers.TensorBoardLogger(logdir, name="fabric"))
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = skip_aware(torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps), plugin.scaler)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(dataset(), batch_size=64))
    for step, (x, y) in zip(range(steps), loader):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)  # scaled
        fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)  # unscaled first
        opt.step()  # skipped on inf/NaN
        sched.step()  # not on skipped steps
        opt.zero_grad()
        if step % 25 == 0:
            fabric.log_dict({"loss": loss.item(), **plugin.scaler.metrics()}, step=step)
    fabric.logger.finalize("success")
    return {
        "loss": loss.item(),
        "skipped": plugin.scaler.counters()["skipped_steps"],
        "scheduler_steps": sched.last_epoch,
        "logdir": fabric.logger.log_dir,
    }


def main(steps: int = 300, fabric: bool = False, logdir: str = "") -> dict:
    """Train with the Trainer (or Fabric); return loss, skipped steps and scheduler steps."""
    logdir = logdir or tempfile.mkdtemp(prefix="lossscale-lightning-")
    result = (with_fabric if fabric else with_trainer)(steps, logdir)
    print(
        f"loss {result['loss']:.3f}; {result['skipped']} of {steps} steps skipped; the LR schedule advanced "
        f"{result['scheduler_steps']} times. TensorBoard: tensorboard --logdir {result['logdir']}"
    )
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--fabric", action="store_true", help="use lightning.Fabric instead of the Trainer")
    parser.add_argument("--logdir", default="", help="TensorBoard directory (default: a new temporary one)")
    args = parser.parse_args()
    main(args.steps, args.fabric, args.logdir)
