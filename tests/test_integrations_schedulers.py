"""lossscale.schedulers.skip_aware: any torch LR scheduler holds its LR on skipped steps, keeps its
state_dict, and costs at most one host sync per step (fused optimizers), none otherwise."""

import copy
import io
import pickle
import subprocess
import sys

import pytest
import torch
from _integration_models import INIT_SCALE, TORCH_LIKE, InfAt, all_equal, batch, lr_reference, mlp, snapshot
from _sync import count_host_syncs
from torch.optim import lr_scheduler as lrs

import lossscale
from lossscale.schedulers import is_skip_aware, skip_aware

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny ops, one thread

K = 5  # the step whose gradient gets an inf
STEPS = 12
LR = 0.1

SCHEDULERS = {
    "LambdaLR": lambda o: lrs.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    "MultiplicativeLR": lambda o: lrs.MultiplicativeLR(o, lambda s: 0.9),
    "StepLR": lambda o: lrs.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: lrs.MultiStepLR(o, milestones=[3, 6, 8], gamma=0.5),
    "ConstantLR": lambda o: lrs.ConstantLR(o, factor=0.5, total_iters=6),
    "LinearLR": lambda o: lrs.LinearLR(o, start_factor=0.1, total_iters=8),
    "ExponentialLR": lambda o: lrs.ExponentialLR(o, gamma=0.8),
    "PolynomialLR": lambda o: lrs.PolynomialLR(o, total_iters=10, power=2.0),
    "CosineAnnealingLR": lambda o: lrs.CosineAnnealingLR(o, T_max=10),
    "CosineAnnealingWarmRestarts": lambda o: lrs.CosineAnnealingWarmRestarts(o, T_0=4),
    "CyclicLR": lambda o: lrs.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=3),
    "OneCycleLR": lambda o: lrs.OneCycleLR(o, max_lr=0.1, total_steps=STEPS + 2),
    "SequentialLR": lambda o: lrs.SequentialLR(
        o, [lrs.LinearLR(o, start_factor=0.1, total_iters=4), lrs.ExponentialLR(o, gamma=0.8)], milestones=[4]
    ),
    "ChainedScheduler": lambda o: lrs.ChainedScheduler(
        [lrs.ExponentialLR(o, gamma=0.9), lrs.StepLR(o, step_size=3, gamma=0.5)]
    ),
}


def _run(make_scheduler, kind, wrap, steps=STEPS, inject=(K,)):
    """A hand-written loop. ``wrap``: skip_aware + an unconditional scheduler.step() (what a framework
    does); otherwise a plain scheduler stepped through scaler.step_scheduler (the reference)."""
    model = mlp()
    opt = (
        torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        if kind == "sgd"
        else torch.optim.Adam(model.parameters(), lr=LR, fused=True)
    )
    sched = make_scheduler(opt)
    scaler = lossscale.GradScaler("cpu", init_scale=INIT_SCALE, **TORCH_LIKE)
    if wrap:
        assert skip_aware(sched, scaler) is sched
    InfAt(model[2].weight, inject)
    lrs_used, skipped, scales, before_k, after_k = [], [], [], None, None
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        lrs_used.append(opt.param_groups[0]["lr"])
        if step == K:
            before_k = snapshot(model.parameters())
        scaler.step(opt)
        scaler.update()
        if step == K:
            after_k = snapshot(model.parameters())
        if wrap:
            sched.step()
        else:
            scaler.step_scheduler(sched)
        skipped.append(scaler.last_step_skipped)
        scales.append(scaler.get_scale())
    return dict(
        lrs=lrs_used,
        skipped=skipped,
        scales=scales,
        params=snapshot(model.parameters()),
        sched=sched,
        before_k=before_k,
        after_k=after_k,
        scaler=scaler,
        opt=opt,
    )


def _tensors_in(value):
    if isinstance(value, dict):
        return [x for v in value.values() for x in _tensors_in(v)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _tensors_in(v)]
    return [value]


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_skip_aware_holds_the_lr_on_skipped_steps(name):
    make = SCHEDULERS[name]
    ours = _run(make, "sgd", wrap=True)
    ref = _run(make, "sgd", wrap=False)
    assert ours["skipped"] == [s == K for s in range(STEPS)]
    assert all_equal(ours["before_k"], ours["after_k"])  # the skipped step left the weights alone
    assert ours["scales"][K] == ours["scales"][K - 1] / 2
    # The LR at K+1 is the LR it would have had without step K, and so on for every later step.
    assert ours["lrs"] == ref["lrs"] == lr_reference(make, [not s for s in ours["skipped"]], LR)
    assert ours["lrs"][K + 1] == ours["lrs"][K]
    assert all_equal(ours["params"], ref["params"])
    # The state dict is the plain scheduler's: equal to the reference's, no scaler inside, and it
    # survives torch.save / torch.load(weights_only=True) into a plain scheduler of the same kind.
    state = ours["sched"].state_dict()
    assert state == ref["sched"].state_dict()
    assert not any(isinstance(v, lossscale.GradScaler) for v in _tensors_in(state))
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    fresh_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    plain = make(fresh_opt)
    plain.load_state_dict(torch.load(buf, weights_only=True))
    # The optimizer's checkpoint carries the current LR (chainable schedulers continue from it).
    fresh_opt.param_groups[0].update({k: v for k, v in ours["opt"].param_groups[0].items() if k != "params"})
    assert plain.get_last_lr() == ours["sched"].get_last_lr()
    for _ in range(3):  # and it goes on exactly like the wrapped one would
        fresh_opt.step()
        plain.step()
        ours["opt"].step()
        ours["sched"].step()  # last_step_skipped is False after the last iteration
        assert plain.get_last_lr() == ours["sched"].get_last_lr()


def test_fused_optimizer_one_sync_per_step():
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=LR, fused=True)
    scaler = lossscale.GradScaler("cpu", init_scale=INIT_SCALE, **TORCH_LIKE)
    sched = skip_aware(SCHEDULERS["LambdaLR"](opt), scaler)
    InfAt(model[2].weight, [2])
    counts, lrs_used = [], []
    for step in range(4):
        x, y = batch(step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        lrs_used.append(opt.param_groups[0]["lr"])
        with count_host_syncs() as syncs:
            scaler.step(opt)  # fused: skips on device, no sync
            scaler.update()
            sched.step()  # reads the device-side flag: the one sync
        counts.append(syncs.count)
    assert counts == [1, 1, 1, 1]
    assert lrs_used == [LR, LR / 2, LR / 3, LR / 3]  # step 2 was skipped on device: the LR held


def test_host_decided_skip_costs_no_sync():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = lossscale.GradScaler("cpu", init_scale=INIT_SCALE, **TORCH_LIKE)
    sched = skip_aware(lrs.StepLR(opt, 2), scaler)
    for step in range(2):
        x, y = batch(step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)  # the decision sync happens here, as in torch
        scaler.update()
        with count_host_syncs() as syncs:
            sched.step()
        assert syncs.count == 0


def test_reduce_lr_on_plateau_takes_its_metric_and_skips():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = lossscale.GradScaler("cpu", init_scale=INIT_SCALE, **TORCH_LIKE)
    sched = skip_aware(lrs.ReduceLROnPlateau(opt, patience=0, factor=0.5), scaler)
    InfAt(model[2].weight, [1])
    for step in range(3):
        x, y = batch(step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step(1.0)  # a metric that never improves: every taken step is a bad epoch
    # Steps 0 and 2 were taken (the first sets the best, the second is bad: the LR halves); step 1 was not.
    assert sched.last_epoch == 2
    assert opt.param_groups[0]["lr"] == LR / 2


def test_class_identity_relinking_and_pickle():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    a = lossscale.GradScaler("cpu")
    b = lossscale.GradScaler("cpu")
    sched = lrs.StepLR(opt, 2)
    assert not is_skip_aware(sched)
    skip_aware(sched, a)
    assert is_skip_aware(sched) and isinstance(sched, lrs.StepLR) and type(sched).__name__ == "SkipAwareStepLR"
    skip_aware(sched, b)  # re-link: one level of subclass, the new scaler
    assert type(sched).__bases__ == (lrs.StepLR,) and type(sched)._lossscale_scaler is b
    assert "_lossscale_scaler" not in vars(sched)  # nothing on the instance: state_dict stays clean
    for clone in (pickle.loads(pickle.dumps(sched)), copy.deepcopy(sched)):
        assert is_skip_aware(clone) and type(clone).__bases__ == (lrs.StepLR,)
        assert clone.state_dict().keys() == sched.state_dict().keys()
        assert isinstance(type(clone)._lossscale_scaler, lossscale.GradScaler)


def test_disabled_scaler_never_skips():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = lossscale.GradScaler("cpu", enabled=False)
    sched = skip_aware(lrs.StepLR(opt, 1, gamma=0.5), scaler)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == LR / 2


def test_validation_names_the_argument():
    opt = torch.optim.SGD(mlp().parameters(), lr=LR)
    with pytest.raises(ValueError, match="scaler=.*lossscale.GradScaler"):
        skip_aware(lrs.StepLR(opt, 2), torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="obj=.*no step"):
        skip_aware(object(), lossscale.GradScaler("cpu"))


def test_importing_integrations_imports_no_framework():
    code = (
        "import sys, lossscale, lossscale.schedulers, lossscale.integrations\n"
        "import lossscale.integrations.accelerate, lossscale.integrations.transformers\n"
        "import lossscale.integrations.lightning, lossscale.integrations.loggers\n"
        "heavy = ('accelerate', 'transformers', 'lightning', 'pytorch_lightning', 'tensorboard',\n"
        "         'torch.utils.tensorboard', 'lightning_fabric')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_public_integration_names_have_docstrings():
    import lossscale.integrations as integrations
    import lossscale.schedulers as schedulers
    from lossscale.integrations import accelerate, lightning, loggers, transformers

    for module in (integrations, schedulers, accelerate, transformers, lightning, loggers):
        assert module.__doc__
        for name in getattr(module, "__all__", []):
            if module is integrations:
                continue
            obj = getattr(module, name)  # builds the Lightning classes (imports lightning: fine here)
            assert obj.__doc__, f"{module.__name__}.{name} has no docstring"
            for attr, member in vars(obj).items() if isinstance(obj, type) else ():
                if not attr.startswith("_") and callable(member):
                    assert member.__doc__, f"{module.__name__}.{name}.{attr} has no docstring"


def test_a_deep_copy_follows_the_live_scaler():
    # A deep copy used to carry a frozen copy of the scaler, which never saw a later skip: the copy's
    # last_epoch advanced on a step the live scaler skipped.
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = lossscale.GradScaler("cpu", init_scale=INIT_SCALE, **TORCH_LIKE)
    sched = skip_aware(lrs.StepLR(opt, 1, gamma=0.5), scaler)
    clone = copy.deepcopy(sched)
    assert type(clone)._lossscale_scaler is scaler and clone.optimizer is not opt
    InfAt(model[2].weight, (0,))
    epochs = []
    for step in range(2):  # step 0 skipped (inf gradient), step 1 taken
        x, y = batch(step)
        opt.zero_grad()
        scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        clone.step()
        epochs.append((scaler.last_step_skipped, sched.last_epoch, clone.last_epoch))
    assert epochs == [(True, 0, 0), (False, 1, 1)]
    # Copied together, the scheduler's copy follows the scaler's copy.
    scaler2, sched2 = copy.deepcopy((scaler, sched))
    assert type(sched2)._lossscale_scaler is scaler2 and scaler2 is not scaler
