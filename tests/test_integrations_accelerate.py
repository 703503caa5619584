"""lossscale.integrations.accelerate against the real accelerate, on CPU with FP16 autocast."""

import pickle
import sys

import pytest
import torch
from _integration_models import (
    INIT_SCALE,
    TORCH_LIKE,
    DtypeProbe,
    InfAt,
    all_equal,
    batch,
    fresh_accelerate_state,  # noqa: F401  (fixture)
    lr_reference,
    mlp,
    snapshot,
    warmup_decay,
)
from _sync import count_host_syncs
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import GradScalerKwargs

import lossscale
from lossscale.integrations import accelerate as ls_accelerate

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny ops, one thread

K = 9  # the step whose gradient gets an inf
STEPS = 24
LR = 1e-2


@pytest.fixture(autouse=True)
def _fresh(fresh_accelerate_state):  # noqa: F811  the pytest fixture imported from _integration_models
    """accelerate's process-wide state, reset around every test (see _integration_models)."""


def _scheduler(kind):
    if kind == "warmup":
        return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup_decay)
    return lambda opt: torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=0)


def _run(
    scaler_kind,
    fused,
    schedule="warmup",
    steps=range(STEPS),
    inject=(K,),
    save=None,
    load=None,
    count_syncs=False,
    register=None,
    lazy_init=False,
):
    """One accelerate training script; ``scaler_kind`` "lossscale" (attach) or "torch" (torch's
    GradScaler installed by hand, as accelerate would on CUDA: the reference where it works)."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(mixed_precision="fp16")
    if scaler_kind == "lossscale":
        scaler = ls_accelerate.attach(accelerator, init_scale=INIT_SCALE, **TORCH_LIKE)
    else:
        scaler = accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        accelerator.native_amp = True
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=fused, foreach=None if fused else False)
    make_scheduler = _scheduler(schedule)
    sched = make_scheduler(opt)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    if register is not None:
        accelerator.register_for_checkpointing(register(accelerator))
    loaded_state = lazy = None
    if load is not None:
        accelerator.load_state(load)
        if lazy_init:  # what accelerate up to 1.15.0 did after loading the scaler on FSDP2
            scaler._lazy_init_scale_growth_tracker(scaler._device)
            lazy = (scaler._scale.clone(), scaler._growth_tracker.clone())
        loaded_state = scaler.state_dict()
    probe = DtypeProbe(model[0])
    InfAt(model[2].weight, inject, start=steps[0])
    out = dict(
        scales=[],
        skipped=[],
        lrs=[],
        norms=[],
        syncs=[],
        scaler=scaler,
        accelerator=accelerator,
        opt=opt,
        make_scheduler=make_scheduler,
        loaded_state=loaded_state,
        lazy=lazy,
    )
    for step in steps:
        x, y = batch(step)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        accelerator.backward(loss)
        out["norms"].append(accelerator.clip_grad_norm_(model.parameters(), 1.0))
        out["lrs"].append(opt.param_groups[0]["lr"])
        before = snapshot(model.parameters())
        with count_host_syncs() as syncs:
            opt.step()
            sched.step()
            skipped = accelerator.optimizer_step_was_skipped
        out["syncs"].append(syncs.count)
        if step == K:
            out["untouched_at_k"] = all_equal(before, snapshot(model.parameters()))
        opt.zero_grad()
        out["skipped"].append(skipped)
        out["scales"].append(scaler.get_scale())
        if save is not None and step == save[0]:
            accelerator.save_state(save[1])
            out["saved_state"] = scaler.state_dict()
    out["params"] = snapshot(model.parameters())
    out["dtypes"] = set(probe.dtypes)
    out["logits_dtype"] = logits.dtype
    return out


def _check_skip_at_k(run, steps=STEPS):
    assert run["skipped"] == [s == K for s in range(steps)]
    assert run["untouched_at_k"]
    assert run["scales"][K] == run["scales"][K - 1] / 2
    assert run["dtypes"] == {torch.float16}  # autocast really on in the prepared forward, on CPU
    assert run["logits_dtype"] == torch.float32  # accelerate converts outputs back (convert_outputs_to_fp32)


def test_matches_torch_gradscaler_bitwise():
    ours = _run("lossscale", fused=False)
    ref = _run("torch", fused=False)
    _check_skip_at_k(ours)
    assert ours["scales"] == ref["scales"]
    assert ours["skipped"] == ref["skipped"]
    # clip_grad_norm_ unscaled before clipping: the true norms (torch's), not norms of scaled gradients.
    assert torch.equal(torch.stack(ours["norms"]), torch.stack(ref["norms"]))
    assert max(n for i, n in enumerate(ours["norms"]) if i != K) < 10.0
    assert all_equal(ours["params"], ref["params"])
    # The LR at K+1 is the LR it would have had without step K.
    taken = [not s for s in ours["skipped"]]
    assert ours["lrs"] == lr_reference(ours["make_scheduler"], taken, LR)
    assert ours["lrs"][K + 1] == ours["lrs"][K]


def test_fused_optimizer_reports_skips_and_holds_the_lr():
    ours = _run("lossscale", fused=True)
    _check_skip_at_k(ours)
    taken = [not s for s in ours["skipped"]]
    assert ours["lrs"] == lr_reference(ours["make_scheduler"], taken, LR)
    assert ours["lrs"][K + 1] == ours["lrs"][K]
    # One host sync per step to read the device-side skip, shared by the scheduler and the flag;
    # a fused AdamW step on CPU syncs nothing by itself.
    assert ours["syncs"] == [1] * STEPS


def test_fused_optimizer_matches_torch_where_torch_works():
    # With a constant LR, torch's scaler in accelerate trains a fused optimizer right (only the
    # skip report and so the scheduler were wrong): the trajectories must be bitwise the same.
    ours = _run("lossscale", fused=True, schedule="constant")
    ref = _run("torch", fused=True, schedule="constant")
    _check_skip_at_k(ours)
    assert ours["scales"] == ref["scales"]
    assert torch.equal(torch.stack(ours["norms"]), torch.stack(ref["norms"]))
    assert all_equal(ours["params"], ref["params"])


@pytest.mark.parametrize("fused", [False, True])
def test_checkpoint_round_trip(tmp_path, fused):
    # Save after the skip (scale halved, growth tracker restarted), resume in a fresh accelerator.
    whole = _run("lossscale", fused=fused, save=(12, tmp_path / "ckpt"))
    saved = torch.load(tmp_path / "ckpt" / "scaler.pt", weights_only=True)
    assert saved == whole["saved_state"]
    resumed = _run("lossscale", fused=fused, steps=range(13, STEPS), load=tmp_path / "ckpt")
    assert resumed["scales"] == whole["scales"][13:]
    assert resumed["lrs"] == whole["lrs"][13:]
    assert all_equal(resumed["params"], whole["params"])
    assert resumed["scaler"].state_dict() == whole["scaler"].state_dict()
    # A torch GradScaler takes the same file and continues from the same scale.
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(saved)
    assert torch_scaler.get_scale() == whole["scales"][12]


class DummyStepOnLoad:
    """A registered checkpoint object whose loading runs torch's distributed-checkpoint dummy step
    through a prepared optimizer, after accelerate loaded the scaler: what torch's
    ``set_optimizer_state_dict`` does when accelerate <= 1.15 hands it the prepared optimizer
    (accelerate #4289), on any accelerate version."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        fresh = self.accelerator.prepare_optimizer(torch.optim.AdamW(mlp().parameters(), lr=LR))
        _init_optim_state(fresh)  # zero grads, lr 0, fresh.step(): through the scaler, if it lets it


def test_load_state_restores_the_saved_scaler_bitwise_and_training_continues(tmp_path):
    # Save at step 12, after the skip at 9 (scale halved, tracker restarted), resume in a fresh
    # accelerator. accelerate 1.16 loads the scaler the same way on every distributed type, FSDP2's
    # included: load_state (accelerator.py:3768-3811) hands self.scaler to load_accelerator_state, which
    # calls scaler.load_state_dict(torch.load("scaler.pt")) (checkpointing.py:276-279) and nothing else.
    whole = _run("lossscale", fused=False, save=(12, tmp_path / "ckpt"))
    resumed = _run("lossscale", fused=False, steps=range(13, STEPS), load=tmp_path / "ckpt")
    assert resumed["loaded_state"] == whole["saved_state"]  # every key and value: scale, trackers, counters
    assert resumed["scales"] == whole["scales"][13:]
    assert all_equal(resumed["params"], whole["params"])


def test_lazy_init_after_load_state_starts_the_loaded_state_as_torchs_does(tmp_path):
    # accelerate up to 1.15.0 (FSDP2 load_state, accelerator.py:3867-3873 of 1.15.0), like torch's own
    # graphed-optimizer tests, loads a state into a fresh scaler and then calls
    # scaler._lazy_init_scale_growth_tracker(scaler._device), so the state exists on the device before the
    # first scale(). Here after accelerate 1.16's load_state, for lossscale and for torch's GradScaler.
    for kind in ("lossscale", "torch"):
        _run(kind, fused=False, save=(12, tmp_path / kind))
    ours = _run("lossscale", fused=False, steps=range(13, STEPS), load=tmp_path / "lossscale", lazy_init=True)
    ref = _run("torch", fused=False, steps=range(13, STEPS), load=tmp_path / "torch", lazy_init=True)
    # The loaded scale and growth tracker, on the device, as tensors of torch's dtypes and values.
    for a, b in zip(ours["lazy"], ref["lazy"]):
        assert a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
    assert ours["lazy"][0].item() == ours["loaded_state"]["scale"] < INIT_SCALE  # the loaded scale, not the initial one
    assert ours["lazy"][1].item() == ref["loaded_state"]["_growth_tracker"] > 0
    assert ours["scales"] == ref["scales"]
    assert all_equal(ours["params"], ref["params"])


def test_a_checkpoint_loaders_dummy_step_leaves_the_loaded_scaler_alone(tmp_path):
    # accelerate #4289: torch's loader steps the optimizer once to make its state; through the prepared
    # optimizer that step ran scaler.step + update, and the restored scale moved (1024 -> 2048 there).
    # With lossscale it runs the plain optimizer: the scaler holds what was saved, and the run goes on
    # as if it had never stopped.
    whole = _run("lossscale", fused=False, save=(12, tmp_path / "ckpt"), register=DummyStepOnLoad)
    resumed = _run("lossscale", fused=False, steps=range(13, STEPS), load=tmp_path / "ckpt", register=DummyStepOnLoad)
    assert whole["saved_state"]["state"]["growth_tracker"] > 0  # so a dummy update would show
    assert resumed["loaded_state"] == whole["saved_state"]
    assert resumed["scales"] == whole["scales"][13:]
    assert all_equal(resumed["params"], whole["params"])


def test_outside_load_state_a_prepared_step_is_a_training_step():
    # The load-time bypass is scoped to load_state: an ordinary step still goes through the scaler.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(mixed_precision="fp16")
    scaler = ls_accelerate.attach(accelerator, init_scale=INIT_SCALE, **TORCH_LIKE)
    model = mlp()
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    x, y = batch(0)
    accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
    opt.step()
    assert scaler.state().steps == 1


def test_unscaling_through_the_wrapper_after_clip_raises():
    # accelerate unscales the inner optimizer (accelerator.py:2955); the prepared wrapper exposes the
    # same parameters, so unscaling it too would divide the gradients by the scale twice.
    accelerator = Accelerator(mixed_precision="fp16")
    scaler = ls_accelerate.attach(accelerator)
    model = mlp()
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    x, y = batch(0)
    accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="already unscaled"):
        scaler.unscale_(opt)
    assert all_equal(grads, [p.grad for p in model.parameters()])  # refused before touching anything


def test_prepared_optimizer_pickles_as_the_skip_aware_class():
    accelerator = Accelerator(mixed_precision="fp16")
    ls_accelerate.attach(accelerator)
    model = mlp()
    _, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    assert type(opt).__name__ == "SkipAwareAcceleratedOptimizer"
    clone = pickle.loads(pickle.dumps(opt))
    assert type(clone) is type(opt)
    assert isinstance(clone.scaler, lossscale.GradScaler)


def test_grad_scaler_kwargs_handler_is_honoured():
    accelerator = Accelerator(
        mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=2.0**7, growth_interval=5)]
    )
    scaler = ls_accelerate.attach(accelerator, hysteresis=2)
    assert scaler.get_scale() == 2.0**7
    assert scaler.get_growth_interval() == 5
    assert scaler.policy.hysteresis == 2


def test_validation_errors_name_the_fix():
    accelerator = Accelerator(mixed_precision="no")
    with pytest.raises(ValueError, match='mixed_precision="fp16"'):
        ls_accelerate.attach(accelerator)
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(mixed_precision="fp16")
    with pytest.raises(ValueError, match="either scaler= or GradScaler keywords"):
        ls_accelerate.attach(accelerator, lossscale.GradScaler(), init_scale=2.0)
    with pytest.raises(ValueError, match="must be a lossscale.GradScaler"):
        ls_accelerate.attach(accelerator, torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="accelerate.Accelerator"):
        ls_accelerate.attach(object())
    accelerator.prepare(mlp())
    with pytest.raises(RuntimeError, match="before prepare"):
        ls_accelerate.attach(accelerator)


# ------------------------------------------------------------------ misuse is named (issue 19)
def test_attach_twice_returns_the_same_scaler_and_refuses_a_second_one():
    # A second attach() built a second scaler and orphaned the first (and whatever held it).
    accelerator = Accelerator(mixed_precision="fp16")
    scaler = ls_accelerate.attach(accelerator, init_scale=2.0**8)
    assert ls_accelerate.attach(accelerator) is scaler
    assert ls_accelerate.attach(accelerator, scaler) is scaler
    for other in (dict(init_scale=2.0**4), dict(scaler=lossscale.GradScaler())):
        with pytest.raises(ValueError, match=r"already attached.*attach\(accelerator\) returns it"):
            ls_accelerate.attach(accelerator, **other)
    model = mlp()
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    assert ls_accelerate.attach(accelerator) is scaler and accelerator.scaler is scaler
    assert type(opt).__name__ == "SkipAwareAcceleratedOptimizer" and scaler.get_scale() == 2.0**8


def _lightning_plugin():
    from lossscale.integrations import lightning

    return lightning.MixedPrecision()


def _transformers_attach():
    from lossscale.integrations import transformers

    return transformers.attach(None)


@pytest.mark.parametrize(
    "framework, use",
    [
        ("accelerate", lambda: ls_accelerate.attach(None)),
        ("transformers", _transformers_attach),
        ("lightning", _lightning_plugin),
    ],
)
def test_a_missing_framework_names_the_extra_to_install(monkeypatch, framework, use):
    from lossscale.integrations import lightning

    # As if not installed: the framework itself (imported yet or not, so the test does not depend on
    # which tests ran before it) and any of its submodules already imported.
    for name in {framework} | {m for m in sys.modules if m.startswith(framework + ".")}:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(vars(lightning), "MixedPrecision", raising=False)  # built on first use
    with pytest.raises(
        ModuleNotFoundError,
        match=rf'needs {framework}.*pip install {framework}, .*pip install -c constraints.txt -e "\.\[integrations\]"',
    ):
        use()
