"""One NaN batch, end to end, as a new user sets it up: the frameworks' default fused optimizers skip it.

Before the flag contract (``lossscale._check``) the "skipped" step ran in torch's fused kernel (it
skips only on ``found_inf == 1.0``; a NaN loss with NaN gradients gave 2.0): the weights turned NaN
and every later step was skipped. Both set-ups below showed it.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from _integration_models import (
    all_equal,
    batch,
    fresh_accelerate_state,  # noqa: F401  (fixture)
    mlp,
    snapshot,
    tiny_gpt2,
)
from transformers import Trainer, TrainerCallback, TrainingArguments

from lossscale.integrations import transformers as ls_transformers
from lossscale.integrations.lightning import MixedPrecision

pytestmark = [
    pytest.mark.usefixtures("one_thread"),  # conftest: tiny ops, one thread
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated"),
]

BAD = 3  # the sample with a NaN input
STEPS = 6


@pytest.fixture(autouse=True)
def _fresh(fresh_accelerate_state):  # noqa: F811  the pytest fixture imported from _integration_models
    """accelerate's process-wide state, reset around every test (see _integration_models)."""


class NaNEmbeddingAt(torch.utils.data.Dataset):
    """Random input embeddings and labels for GPT-2 (``inputs_embeds``); sample ``bad`` has a NaN in one
    position, so its loss and its gradients are NaN (the case that gave a flag of 2.0)."""

    def __init__(self, n: int, bad: int, length: int = 8, vocab: int = 64, n_embd: int = 32):
        g = torch.Generator().manual_seed(0)
        self.embeds = torch.randn(n, length, n_embd, generator=g)
        self.labels = torch.randint(1, vocab, (n, length), generator=g)
        self.embeds[bad, 2, 5] = math.nan

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"inputs_embeds": self.embeds[i], "labels": self.labels[i]}


class Moves(TrainerCallback):
    """Whether each optimizer step moved the parameters, and the skip flag accelerate reports."""

    def __init__(self, box):
        self.box, self.moved, self.skipped = box, [], []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self._before = snapshot(model.parameters())

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.moved.append(not all_equal(self._before, snapshot(model.parameters())))
        self.skipped.append(self.box["trainer"].accelerator.optimizer_step_was_skipped)


def test_trainer_default_fused_adamw_with_attach_skips_a_nan_batch(tmp_path):
    model = tiny_gpt2()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        fp16=True,
        use_cpu=True,
        per_device_train_batch_size=1,
        max_steps=STEPS,
        learning_rate=1e-3,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        save_strategy="no",
        dataloader_num_workers=0,
    )
    box = {}
    moves = Moves(box)
    trainer = box["trainer"] = Trainer(
        model=model, args=args, train_dataset=NaNEmbeddingAt(STEPS, BAD), callbacks=[moves]
    )
    ls_transformers.attach(trainer)  # lossscale's defaults
    trainer.train()
    assert trainer.optimizer.optimizer.defaults["fused"]  # the Trainer's default: fused AdamW
    assert sum(moves.skipped) == 1  # the NaN batch (the Trainer shuffles: its step is not fixed)
    assert moves.moved == [not s for s in moves.skipped]
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert all(bool(torch.isfinite(s["exp_avg_sq"]).all()) for s in trainer.optimizer.optimizer.state.values())


class NaNRowAt(torch.utils.data.Dataset):
    """The shared MLP's batches, one sample per step, with a NaN input row at step ``bad``."""

    def __init__(self, steps: int, bad: int):
        self.items = [batch(s, n=1) for s in range(steps)]
        self.bad = bad

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        x, y = self.items[i]
        x = x[0].clone()
        if i == self.bad:
            x[0] = math.nan
        return x, y[0]


class FusedModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = mlp()
        self.moved, self.skipped = [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x).float(), y)

    def on_before_optimizer_step(self, optimizer):
        self._before = snapshot(self.parameters())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.moved.append(not all_equal(self._before, snapshot(self.parameters())))
        self.skipped.append(self.trainer.precision_plugin.scaler.last_step_skipped)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2, fused=True)


def test_lightning_plugin_with_fused_adam_skips_a_nan_batch():
    module = FusedModule()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        plugins=[MixedPrecision()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(NaNRowAt(STEPS, BAD), batch_size=1))
    assert module.skipped == [s == BAD for s in range(STEPS)]
    assert module.moved == [s != BAD for s in range(STEPS)]
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())
