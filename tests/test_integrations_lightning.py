"""lossscale.integrations.lightning against the real Lightning (Trainer and Fabric), on CPU with FP16."""

import lightning as L
import pytest
import torch
from _integration_models import (
    INIT_SCALE,
    TORCH_LIKE,
    DtypeProbe,
    InfAt,
    all_equal,
    batch,
    dataset,
    lr_reference,
    mlp,
    read_tensorboard,
    snapshot,
    warmup_decay,
)
from lightning.fabric.plugins.precision import MixedPrecision as LightningFabricMixedPrecision
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision

import lossscale
from lossscale.integrations.lightning import FabricMixedPrecision, MixedPrecision
from lossscale.schedulers import is_skip_aware, skip_aware

# Lightning 2.6.6's own use of a torch API it deprecated (lightning/pytorch/utilities/_pytree.py:21).
pytestmark = [
    pytest.mark.usefixtures("one_thread"),  # conftest: tiny ops, one thread
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated"),
]

K = 9  # the step whose gradient gets an inf
STEPS = 24
LR = 1e-2


def _warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, warmup_decay)


class Module(L.LightningModule):
    def __init__(self, fused=False, schedule=True, epoch_scheduler=False):
        super().__init__()
        self.net = mlp()
        self.fused, self.schedule, self.epoch_scheduler = fused, schedule, epoch_scheduler

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=LR, fused=self.fused, foreach=None if self.fused else False)
        if not self.schedule:
            return opt
        configs = [{"scheduler": _warmup(opt), "interval": "step"}]
        if self.epoch_scheduler:  # multiplies the LR by 1.0 at each epoch end: present, harmless
            configs.append(
                {"scheduler": torch.optim.lr_scheduler.MultiplicativeLR(opt, lambda e: 1.0), "interval": "epoch"}
            )
        return [opt], configs


class Recorder(L.Callback):
    def __init__(self):
        self.lrs, self.scales, self.skipped, self.moved = [], [], [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])
        self._before = snapshot(pl_module.parameters())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        scaler = trainer.precision_plugin.scaler
        self.scales.append(scaler.get_scale())
        self.skipped.append(getattr(scaler, "last_step_skipped", None))  # torch's scaler does not say
        self.moved.append(not all_equal(self._before, snapshot(pl_module.parameters())))


def _fit(plugin, module, *, steps=STEPS, epochs=None, logger=False, ckpt_path=None, start=0, clip=None):
    probe = DtypeProbe(module.net[0])
    InfAt(module.net[2].weight, [K], start=start)
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=-1 if epochs else steps,
        max_epochs=epochs,
        plugins=[plugin],
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=5,
        gradient_clip_val=clip,
        callbacks=[recorder],
    )
    loader = torch.utils.data.DataLoader(dataset(12 if epochs else steps), batch_size=8)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return dict(trainer=trainer, rec=recorder, params=snapshot(module.parameters()), dtypes=set(probe.dtypes))


def _check_skip_at_k(run, steps=STEPS):
    rec = run["rec"]
    assert rec.skipped == [s == K for s in range(steps)]
    assert rec.moved == [s != K for s in range(steps)]  # the skipped step left the weights alone
    assert rec.scales[K] == rec.scales[K - 1] / 2
    assert run["dtypes"] == {torch.float16}  # FP16 autocast on CPU (Lightning's own flag would give bf16)


def test_trainer_matches_lightnings_torch_scaler_plugin():
    # No scheduler (Lightning with torch's scaler would advance it on the skipped step), gradient
    # clipping on: Lightning unscales before clipping (amp.py:88).
    ours = _fit(MixedPrecision(init_scale=INIT_SCALE, **TORCH_LIKE), Module(schedule=False), clip=1.0)
    ref = _fit(
        LightningMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)),
        Module(schedule=False),
        clip=1.0,
    )
    _check_skip_at_k(ours)
    assert ours["rec"].scales == ref["rec"].scales
    assert all_equal(ours["params"], ref["params"])


@pytest.mark.parametrize("fused", [False, True])
def test_trainer_step_schedulers_hold_the_lr_and_metrics_reach_the_logger(tmp_path, fused):
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    run = _fit(
        MixedPrecision(init_scale=INIT_SCALE, **TORCH_LIKE), Module(fused=fused, epoch_scheduler=True), logger=logger
    )
    _check_skip_at_k(run)
    rec = run["rec"]
    assert rec.lrs == lr_reference(_warmup, [not s for s in rec.skipped], LR)
    assert rec.lrs[K + 1] == rec.lrs[K]
    step_config, epoch_config = run["trainer"].lr_scheduler_configs
    assert is_skip_aware(step_config.scheduler) and not is_skip_aware(epoch_config.scheduler)
    # Every metric, through Lightning's TensorBoardLogger (a real SummaryWriter), read back by tensorboard,
    # at the Trainer's logging steps only.
    tb = read_tensorboard(logger.log_dir)
    names = {f"scaler/{k}" for k in run["trainer"].precision_plugin.scaler.metrics()}
    assert names <= set(tb)
    logged = [s for s, _ in tb["scaler/loss_scale"]]
    assert logged == [4, 9, 14, 19]
    for name in names:
        assert [s for s, _ in tb[name]] == logged
    assert tb["scaler/loss_scale"] == [(s, rec.scales[s]) for s in logged]
    assert tb["scaler/steps"] == [(s, float(s + 1)) for s in logged]
    assert tb["scaler/skipped_steps"] == [(s, float(s >= K)) for s in logged]
    assert tb["scaler/last_step_skipped"] == [(s, float(s == K)) for s in logged]


def test_trainer_checkpoint_round_trip(tmp_path):
    # Two epochs of 12 steps, the skip in the first; resume the second from the end of the first.
    plugin = lambda: MixedPrecision(init_scale=INIT_SCALE, **TORCH_LIKE)  # noqa: E731
    whole = _fit(plugin(), Module(), epochs=2)
    first = _fit(plugin(), Module(), epochs=1)
    first["trainer"].save_checkpoint(tmp_path / "epoch1.ckpt")
    ckpt = torch.load(tmp_path / "epoch1.ckpt", weights_only=True)
    assert ckpt["MixedPrecision"] == first["trainer"].precision_plugin.scaler.state_dict()
    assert ckpt["MixedPrecision"]["scale"] == INIT_SCALE / 2
    resumed = _fit(plugin(), Module(), epochs=2, ckpt_path=tmp_path / "epoch1.ckpt", start=12)
    assert resumed["rec"].scales == whole["rec"].scales[12:]
    assert resumed["rec"].lrs == whole["rec"].lrs[12:]
    assert all_equal(resumed["params"], whole["params"])
    final = whole["trainer"].precision_plugin.scaler.state_dict()
    assert resumed["trainer"].precision_plugin.scaler.state_dict() == final
    # The key is Lightning's own plugin's: its torch scaler takes the same entry, and the same scale.
    native = LightningMixedPrecision("16-mixed", "cpu")
    native.load_state_dict(ckpt["MixedPrecision"])
    assert native.scaler.get_scale() == INIT_SCALE / 2
    # An adaptive-policy checkpoint gives torch's scaler a real growth factor and interval (it keeps growing).
    native.load_state_dict(MixedPrecision(policy="adaptive").state_dict())
    assert native.scaler.get_growth_factor() == 2.0 and 1 <= native.scaler.get_growth_interval() <= 2000


def _fabric_run(plugin, schedule, *, steps=range(STEPS), save=None, load=None, clip=True):
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    sched = _warmup(opt) if schedule else None
    if sched is not None and isinstance(plugin, FabricMixedPrecision):
        skip_aware(sched, plugin.scaler)
    model, opt = fabric.setup(model, opt)
    state = {"model": model, "optimizer": opt, "scaler": plugin.scaler}
    if sched is not None:
        state["scheduler"] = sched
    if load is not None:
        fabric.load(load, state)
    probe = DtypeProbe(model.module[0])
    InfAt(model.module[2].weight, [K], start=steps[0])
    out = dict(scales=[], lrs=[], norms=[], moved=[])
    for step in steps:
        x, y = batch(step)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)
        if clip:
            # Fabric raises on a non-finite norm unless told not to (fabric.py error_if_nonfinite=True)
            out["norms"].append(fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False))
        out["lrs"].append(opt.param_groups[0]["lr"])
        before = snapshot(model.parameters())
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        out["moved"].append(not all_equal(before, snapshot(model.parameters())))
        out["scales"].append(plugin.scaler.get_scale())
        if save is not None and step == save[0]:
            fabric.save(save[1], state)
            out["saved"] = plugin.scaler.state_dict()
    out.update(
        params=snapshot(model.parameters()),
        dtypes=set(probe.dtypes),
        scaler=plugin.scaler,
        fabric=fabric,
        model=model,
        opt=opt,
    )
    return out


def test_fabric_matches_torch_holds_the_lr_and_round_trips(tmp_path):
    ours = _fabric_run(FabricMixedPrecision(init_scale=INIT_SCALE, **TORCH_LIKE), schedule=False)
    ref = _fabric_run(
        LightningFabricMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)),
        schedule=False,
    )
    assert ours["moved"] == [s != K for s in range(STEPS)]
    assert ours["scales"][K] == ours["scales"][K - 1] / 2
    assert ours["dtypes"] == {torch.float16}
    assert ours["scales"] == ref["scales"]
    assert torch.equal(torch.stack(ours["norms"]), torch.stack(ref["norms"]))
    assert all_equal(ours["params"], ref["params"])

    sched_run = _fabric_run(
        FabricMixedPrecision(init_scale=INIT_SCALE, **TORCH_LIKE), schedule=True, save=(12, tmp_path / "fabric.ckpt")
    )
    taken = [s != K for s in range(STEPS)]
    assert sched_run["lrs"] == lr_reference(_warmup, taken, LR)
    assert sched_run["lrs"][K + 1] == sched_run["lrs"][K]
    resumed = _fabric_run(
        FabricMixedPrecision(init_scale=INIT_SCALE, **TORCH_LIKE),
        schedule=True,
        steps=range(13, STEPS),
        load=tmp_path / "fabric.ckpt",
    )
    assert resumed["scales"] == sched_run["scales"][13:]
    assert resumed["lrs"] == sched_run["lrs"][13:]
    assert all_equal(resumed["params"], sched_run["params"])
    assert resumed["scaler"].state_dict() == sched_run["scaler"].state_dict()


def test_fabric_unscaling_through_the_wrapper_after_clip_raises():
    plugin = FabricMixedPrecision()
    run = _fabric_run(plugin, schedule=False, steps=range(1))
    fabric, model, opt = run["fabric"], run["model"], run["opt"]
    x, y = batch(1)
    fabric.backward(torch.nn.functional.cross_entropy(model(x), y))
    fabric.clip_gradients(model, opt, max_norm=1.0)  # unscales the inner optimizer
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="already unscaled"):
        plugin.scaler.unscale_(opt)  # Fabric's wrapper, over the same parameters
    assert all_equal(grads, [p.grad for p in model.parameters()])


def test_plugin_validation():
    with pytest.raises(ValueError, match="must be a lossscale.GradScaler"):
        MixedPrecision(scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="either scaler= or GradScaler keywords"):
        FabricMixedPrecision(scaler=lossscale.GradScaler(), init_scale=2.0)
    with pytest.raises(ValueError, match="device="):
        MixedPrecision(device=3)
    loss = torch.ones((), requires_grad=True) * 2
    with pytest.raises(ValueError, match="pass device='cpu'"):
        MixedPrecision(device="cuda").pre_backward(loss, None)
    with pytest.raises(ValueError, match="pass device='cpu'"):
        FabricMixedPrecision(device="cuda").backward(loss, None)
    plugin = MixedPrecision()
    assert plugin.precision == "16-mixed" and plugin.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert type(plugin).__qualname__ == "MixedPrecision" and isinstance(plugin, LightningMixedPrecision)


# ------------------------------------------------------------------ misuse is named (issue 19)
def test_the_trainer_plugin_given_to_fabric_names_the_fabric_plugin():
    # It crashed at the first backward, deep in Lightning: 'NoneType' object has no attribute 'trainer'.
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision()])
    model = mlp()
    with pytest.raises(RuntimeError, match=r"use FabricMixedPrecision with Fabric"):
        fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    x, y = batch(0)
    with pytest.raises(RuntimeError, match=r"use FabricMixedPrecision with Fabric"):
        fabric.backward(torch.nn.functional.cross_entropy(model(x), y))  # without setup()


@pytest.mark.parametrize("plugin", [MixedPrecision, FabricMixedPrecision])
def test_a_precision_other_than_fp16_says_what_to_use(plugin):
    for make in (lambda: plugin(precision="bf16-mixed"), lambda: plugin("bf16-mixed")):
        with pytest.raises(ValueError, match=r"FP16 only.*precision='bf16-mixed'.*GradScaler\.passthrough\(\)"):
            make()
    with pytest.raises(ValueError, match=r"FP16 only.*pass precision='32-true' to Lightning"):
        plugin(precision="32-true")
    with pytest.raises(ValueError, match=r"scaler='16-mixed' is a precision.*drop it"):
        plugin("16-mixed", "cpu")  # Lightning's own plugin's signature
    assert plugin(precision="16-mixed", device="cpu").precision == "16-mixed"
