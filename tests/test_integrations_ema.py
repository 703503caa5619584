"""Skip-aware EMA/SWA where the frameworks step: Lightning's EMAWeightAveraging callback with the
lossscale plugin, and an accelerate loop with ``attach``. Each keeps a plain AveragedModel updated
only after steps the scaler reports as taken (the reference) and asserts bitwise equality."""

import lightning as L
import pytest
import torch
from _integration_models import (
    INIT_SCALE,
    TORCH_LIKE,
    InfAt,
    batch,
    dataset,
    fresh_accelerate_state,  # noqa: F401  (fixture)
    mlp,
)
from _sync import count_host_syncs
from accelerate import Accelerator
from lightning.pytorch.callbacks import EMAWeightAveraging
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn

from lossscale.integrations import accelerate as ls_accelerate
from lossscale.integrations.lightning import MixedPrecision
from lossscale.schedulers import is_skip_aware, skip_aware

# Lightning 2.6.6's own use of a torch API it deprecated (lightning/pytorch/utilities/_pytree.py:21).
pytestmark = [
    pytest.mark.usefixtures("one_thread"),  # conftest: tiny ops, one thread
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated"),
]

SKIPS = [3, 4, 9]  # steps whose gradient gets an inf (a lone skip and two in a row)
STEPS = 14
LR = 1e-2
DECAY = 0.8


def equal_states(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class Module(L.LightningModule):
    def __init__(self, fused):
        super().__init__()
        self.net = mlp()
        self.fused = fused

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR, fused=self.fused, foreach=None if self.fused else False)


class SkipAwareEMA(EMAWeightAveraging):
    """The recipe in docs/integrations.md: Lightning builds the AveragedModel at fit's setup."""

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        if self._average_model is not None:
            skip_aware(self._average_model, trainer.precision_plugin.scaler)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with count_host_syncs() as syncs:  # the callback's update, as Lightning calls it
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.syncs = getattr(self, "syncs", []) + [syncs.count]


class Reference(L.Callback):
    """A plain AveragedModel like the callback's, updated only after taken steps."""

    def setup(self, trainer, pl_module, stage):
        self.average = AveragedModel(pl_module, avg_fn=get_ema_avg_fn(DECAY), use_buffers=True)
        self.skipped = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        skipped = trainer.precision_plugin.scaler.last_step_skipped
        self.skipped.append(skipped)
        if not skipped:
            self.average.update_parameters(pl_module)


@pytest.mark.parametrize("fused", [False, True])
def test_lightning_ema_callback_holds_on_skipped_steps(tmp_path, fused):
    module = Module(fused)
    InfAt(module.net[2].weight, SKIPS)
    ema, ref = SkipAwareEMA(decay=DECAY), Reference()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[MixedPrecision(init_scale=INIT_SCALE, **TORCH_LIKE)],
        callbacks=[ema, ref],
    )
    trainer.fit(module, torch.utils.data.DataLoader(dataset(STEPS), batch_size=8))
    assert ref.skipped == [s in SKIPS for s in range(STEPS)]
    averaged = ema._average_model
    assert is_skip_aware(averaged) and isinstance(averaged, AveragedModel)
    assert int(averaged.n_averaged) == STEPS - len(SKIPS)  # Lightning called it on every step, skipped too
    assert equal_states(averaged, ref.average)
    if fused:  # the device flag gates the update: the callback's update syncs nowhere
        assert ema.syncs == [0] * STEPS
    # Lightning's checkpoint of the callback is the plain AveragedModel state.
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert torch.equal(checkpoint["averaging_state"]["n_averaged"], ref.average.n_averaged)


@pytest.mark.parametrize("fused", [False, True])
def test_accelerate_loop_ema_holds_on_skipped_steps(fresh_accelerate_state, fused):  # noqa: F811
    accelerator = Accelerator(mixed_precision="fp16")
    scaler = ls_accelerate.attach(accelerator, init_scale=INIT_SCALE, **TORCH_LIKE)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=fused, foreach=None if fused else False)
    model, opt = accelerator.prepare(model, opt)
    ema = skip_aware(AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=True), scaler)
    ref = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=True)
    InfAt(model[2].weight, SKIPS)
    skipped = []
    for step in range(STEPS):
        x, y = batch(step)
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
        opt.step()
        ema.update_parameters(model)  # every step, as a loop written without skips in mind
        skipped.append(accelerator.optimizer_step_was_skipped)
        if not skipped[-1]:
            ref.update_parameters(model)
        opt.zero_grad()
    assert skipped == [s in SKIPS for s in range(STEPS)]
    assert int(ema.n_averaged) == STEPS - len(SKIPS)
    assert equal_states(ema, ref)
