"""Skip-aware EMA/SWA: ``skip_aware(AveragedModel(...), scaler)`` is bitwise an AveragedModel updated
only on the steps ``scaler.last_step_skipped`` reports as taken, and syncs nowhere with fused optimizers.

Each test trains one model and keeps two averages of it: ours, updated on every step (as a framework
or callback does), and torch's plain AveragedModel, updated only after taken steps (the reference).
"""

from __future__ import annotations

import copy
import io
import math
import pickle

import pytest
import torch
from _sync import count_host_syncs
from torch.optim.swa_utils import (
    SWALR,
    AveragedModel,
    get_ema_avg_fn,
    get_ema_multi_avg_fn,
    get_swa_avg_fn,
    get_swa_multi_avg_fn,
)

import lossscale
from lossscale.schedulers import is_skip_aware, skip_aware

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny ops, one thread

STEPS = 8
# step -> fault: lone and consecutive skips, inf and NaN gradients, a NaN loss. Not step 0: torch's
# fused SGD with momentum leaves its momentum buffers uninitialized (torch.empty_like) when its first
# step is skipped (torch/optim/sgd.py, _fused_sgd). A skipped first update has its own test below.
FAULTS = {1: "inf_grad", 3: "nan_grad", 4: "inf_grad", 6: "nan_loss"}

OPTIMIZERS = {
    "sgd_foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=0.01, foreach=True),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
}
FUSED = [k for k in OPTIMIZERS if k.endswith("_fused")]

AVERAGING = {  # every path of AveragedModel.update_parameters
    "swa_default": dict,
    "swa_avg_fn": lambda: dict(avg_fn=get_swa_avg_fn()),
    "swa_multi_avg_fn": lambda: dict(multi_avg_fn=get_swa_multi_avg_fn()),
    "ema_avg_fn": lambda: dict(avg_fn=get_ema_avg_fn(0.9)),
    "ema_multi_avg_fn": lambda: dict(multi_avg_fn=get_ema_multi_avg_fn(0.9)),
}


def net() -> torch.nn.Module:
    """Parameters and BatchNorm buffers (float running stats, an int64 batch counter)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def forward_backward(model, scaler, step):
    """One step's loss and scaled backward, with ``FAULTS[step]`` injected."""
    g = torch.Generator().manual_seed(step)
    loss = model(torch.randn(6, 4, generator=g)).square().mean()
    fault = FAULTS.get(step)
    if fault == "nan_loss":
        loss = loss * math.nan
    scaler.scale(loss).backward()
    if fault in ("inf_grad", "nan_grad"):
        model[0].weight.grad[0, 0] = math.inf if fault == "inf_grad" else math.nan


def equal_states(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Bitwise equality of two state dicts: parameters, buffers and n_averaged."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def train(opt_kind, averaging, use_buffers, when, steps=STEPS):
    """Train with faults; ours updated every step ``when`` ("before_update"/"after_update"), the
    reference only after taken steps. Returns per-step (skipped, equal) and the syncs of ours."""
    model = net()
    opt = OPTIMIZERS[opt_kind](model.parameters())
    scaler = lossscale.GradScaler("cpu", init_scale=2.0**10)
    ours = skip_aware(AveragedModel(model, use_buffers=use_buffers, **AVERAGING[averaging]()), scaler)
    ref = AveragedModel(model, use_buffers=use_buffers, **AVERAGING[averaging]())
    skipped, equal, syncs = [], [], []
    for step in range(steps):
        opt.zero_grad()
        forward_backward(model, scaler, step)
        scaler.step(opt)
        if when == "before_update":
            with count_host_syncs() as counter:
                ours.update_parameters(model)
            scaler.update()
        else:
            scaler.update()
            with count_host_syncs() as counter:
                ours.update_parameters(model)
        syncs.append(counter.count)
        skipped.append(scaler.last_step_skipped)
        if not skipped[-1]:
            ref.update_parameters(model)
        equal.append(equal_states(ours, ref))
    return dict(skipped=skipped, equal=equal, syncs=syncs, ours=ours, ref=ref, model=model, scaler=scaler)


@pytest.mark.parametrize("when", ["before_update", "after_update"])
@pytest.mark.parametrize("use_buffers", [False, True])
@pytest.mark.parametrize("averaging", sorted(AVERAGING))
@pytest.mark.parametrize("opt_kind", sorted(OPTIMIZERS))
def test_bitwise_an_average_updated_only_on_taken_steps(opt_kind, averaging, use_buffers, when):
    if averaging == "swa_multi_avg_fn" and use_buffers:
        pytest.skip("torch's get_swa_multi_avg_fn cannot average int64 buffers (swa_utils.py:106, addcdiv)")
    run = train(opt_kind, averaging, use_buffers, when)
    assert run["skipped"] == [s in FAULTS for s in range(STEPS)]
    assert run["equal"] == [True] * STEPS
    assert int(run["ours"].n_averaged) == STEPS - len(FAULTS)
    assert isinstance(run["ours"], AveragedModel) and is_skip_aware(run["ours"])


@pytest.mark.parametrize("when", ["before_update", "after_update"])
@pytest.mark.parametrize("averaging", ["ema_multi_avg_fn", "ema_avg_fn", "swa_avg_fn"])
@pytest.mark.parametrize("opt_kind", FUSED)
def test_fused_optimizers_gate_on_device_without_a_sync(opt_kind, averaging, when):
    run = train(opt_kind, averaging, True, when)
    # SGD(fused=True) with momentum has its first step decided on the host (a skip decided on device
    # would leave its momentum buffers uninitialised: lossscale._optimizers.first_step_needs_the_host),
    # so that step's average takes the host-decided path, torch's own update with its host reads.
    first = 0 if opt_kind != "sgd_fused" else run["syncs"][0]
    assert run["syncs"] == [first] + [0] * (STEPS - 1), run["syncs"]
    assert all(run["equal"])


@pytest.mark.parametrize("averaging", ["swa_default", "ema_multi_avg_fn"])
@pytest.mark.parametrize("opt_kind", ["adam_foreach", "adam_fused"])
def test_a_skipped_first_update_is_held_and_the_first_taken_one_copies_the_model(opt_kind, averaging, monkeypatch):
    monkeypatch.setitem(FAULTS, 0, "inf_grad")
    run = train(opt_kind, averaging, True, "before_update", steps=3)
    assert run["skipped"] == [True, True, False]
    assert run["equal"] == [True] * 3
    assert int(run["ours"].n_averaged) == 1
    assert equal_states(run["ours"].module, run["model"])  # the first taken update copied the model


def test_the_syncs_left_are_torchs_own():
    """torch's SWA multi_avg_fn reads its weight 1/(n+1) on the host (swa_utils.py:101): one sync
    inside torch's function, the one its default SWA path costs on CUDA; the gating adds none."""
    run = train("adam_fused", "swa_multi_avg_fn", False, "after_update")
    averaged = [torch.zeros(3)]
    with count_host_syncs() as torch_own:
        get_swa_multi_avg_fn()(averaged, [torch.ones(3)], torch.tensor(1))
    assert torch_own.count == 1
    assert run["syncs"] == [torch_own.count] * STEPS  # the average runs (and is dropped) on skipped steps too
    assert all(run["equal"])


def test_a_whole_fused_iteration_syncs_nowhere():
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    scaler = lossscale.GradScaler("cpu", init_scale=2.0**10)
    ema = skip_aware(AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True), scaler)
    for step in range(STEPS):
        opt.zero_grad()
        forward_backward(model, scaler, step)
        with count_host_syncs() as syncs:
            scaler.step(opt)
            ema.update_parameters(model)
            scaler.update()
        assert syncs.count == 0, (step, syncs.ops)


def test_host_decided_steps_are_torchs_own_update():
    """Non-fused optimizers: the scaler decided on the host; a skipped update returns at once (no
    work, no sync), a taken one is torch's update_parameters, its own host reads included."""
    run = train("sgd_foreach", "ema_multi_avg_fn", False, "after_update")
    ref_model = net()
    with count_host_syncs() as torch_own:
        AveragedModel(ref_model).update_parameters(ref_model)
    assert run["syncs"] == [0 if s in FAULTS else torch_own.count for s in range(STEPS)]


def test_state_dict_pickle_deepcopy_and_torch_save_keep_it_plain_and_skip_aware():
    run = train("adam_fused", "swa_default", True, "after_update")
    ours, ref, scaler = run["ours"], run["ref"], run["scaler"]
    assert type(ours).__bases__ == (AveragedModel,) and type(ours).__name__ == "SkipAwareAveragedModel"
    assert "_lossscale_scaler" not in vars(ours)
    # The state dict is the plain one (no scaler inside) and loads into a plain AveragedModel and back.
    state = ours.state_dict()
    assert state.keys() == ref.state_dict().keys()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    plain = AveragedModel(net(), use_buffers=True)
    plain.load_state_dict(torch.load(buf, weights_only=True))
    assert equal_states(plain, ours)
    again = skip_aware(AveragedModel(net(), use_buffers=True), scaler)
    again.load_state_dict(plain.state_dict())
    assert equal_states(again, ours)
    # Whole-object copies stay skip-aware (torch.save of the module pickles it).
    buf = io.BytesIO()
    torch.save(ours, buf)
    buf.seek(0)
    for clone in (pickle.loads(pickle.dumps(ours)), copy.deepcopy(ours), torch.load(buf, weights_only=False)):
        assert is_skip_aware(clone) and type(clone).__bases__ == (AveragedModel,)
        assert isinstance(type(clone)._lossscale_scaler, lossscale.GradScaler)
        assert equal_states(clone, ours)
        assert clone(torch.ones(2, 4)).shape == (2, 3)  # hooks and submodules restored


def test_a_copy_gates_like_the_original():
    """A copy of (model, optimizer, scaler, average) trains on: its average still holds on skipped
    steps, gated by the copied scaler. (deepcopy: torch's EMA functions are closures pickle refuses.)"""
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    scaler = lossscale.GradScaler("cpu", init_scale=2.0**10)
    ours = skip_aware(AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9)), scaler)
    model, opt, scaler, ours = copy.deepcopy((model, opt, scaler, ours))
    assert type(ours)._lossscale_scaler is scaler
    ref = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for step in range(STEPS):
        opt.zero_grad()
        forward_backward(model, scaler, step)
        scaler.step(opt)
        scaler.update()
        ours.update_parameters(model)
        if not scaler.last_step_skipped:
            ref.update_parameters(model)
        assert equal_states(ours, ref), step


def test_n_averaged_moves_to_the_parameters_device():
    """AveragedModel(model, device=None) keeps n_averaged on the default device; the gate needs it
    beside the parameters (a CPU count with CUDA parameters would copy to the host each update)."""
    with torch.device("meta"):
        model = net()
    averaged = AveragedModel(model)
    assert averaged.n_averaged.device.type == "cpu"
    skip_aware(averaged, lossscale.GradScaler("cpu"))
    assert averaged.n_averaged.device.type == "meta"
    assert "n_averaged" in dict(averaged.named_buffers())  # still the registered buffer


def test_optimizer_argument_follows_one_of_several_optimizers():
    """A GAN's generator EMA follows the generator's optimizer: each optimizer skips on its own
    gradients (as in torch). Without optimizer=, the iteration as a whole (held when any skipped)."""
    gen, disc = net(), net()
    opt_g = torch.optim.Adam(gen.parameters(), lr=0.01, fused=True)
    opt_d = torch.optim.Adam(disc.parameters(), lr=0.01, fused=True)
    scaler = lossscale.GradScaler("cpu", init_scale=2.0**10)
    follows_g = skip_aware(AveragedModel(gen, multi_avg_fn=get_ema_multi_avg_fn(0.9)), scaler, optimizer=opt_g)
    whole = skip_aware(AveragedModel(gen, multi_avg_fn=get_ema_multi_avg_fn(0.9)), scaler)
    ref = AveragedModel(gen, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for step in range(4):
        opt_g.zero_grad()
        opt_d.zero_grad()
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
        scaler.scale(gen(x).square().mean() + disc(x).square().mean()).backward()
        if step == 2:
            disc[0].weight.grad[0, 0] = math.inf  # only the discriminator's step is skipped
        scaler.step(opt_g)
        scaler.step(opt_d)
        g_skipped = scaler.step_was_skipped(opt_g)
        follows_g.update_parameters(gen)
        whole.update_parameters(gen)
        scaler.update()
        if not g_skipped:
            ref.update_parameters(gen)
    assert equal_states(follows_g, ref) and int(follows_g.n_averaged) == 4
    assert int(whole.n_averaged) == 3
    opt_copy, follows_copy = copy.deepcopy((opt_g, follows_g))  # a copy follows the copied optimizer
    assert type(follows_copy)._lossscale_optimizer is opt_copy


def test_a_subclass_with_its_own_update_gets_it_after_one_sync():
    calls = []

    class Counting(AveragedModel):
        def update_parameters(self, model):
            calls.append(True)
            super().update_parameters(model)

    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    scaler = lossscale.GradScaler("cpu", init_scale=2.0**10)
    ours = skip_aware(Counting(model), scaler)
    assert isinstance(ours, Counting)
    syncs = []
    for step in range(3):  # step 0 is skipped
        opt.zero_grad()
        forward_backward(model, scaler, step)
        scaler.step(opt)
        scaler.update()
        with count_host_syncs() as counter:
            ours.update_parameters(model)
        syncs.append(counter.count)
    assert len(calls) == 2
    assert syncs[1] == 1  # the flag read; a taken step adds torch's own reads of n_averaged
    assert syncs[0] == syncs[2] > 1


def test_swalr_is_an_lr_scheduler_like_any_other():
    """SWALR holds its annealing on skipped steps; its state dict is the plain one."""

    def run(wrap):
        model = net()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        sched = SWALR(opt, swa_lr=0.05, anneal_epochs=5, anneal_strategy="cos")
        scaler = lossscale.GradScaler("cpu", init_scale=2.0**10)
        if wrap:
            skip_aware(sched, scaler)
        lrs = []
        for step in range(STEPS):
            opt.zero_grad()
            forward_backward(model, scaler, step)
            scaler.step(opt)
            scaler.update()
            if wrap:
                sched.step()
            elif not scaler.last_step_skipped:
                sched.step()
            lrs.append(opt.param_groups[0]["lr"])
        return lrs, sched

    ours, sched = run(wrap=True)
    ref, plain = run(wrap=False)
    assert ours == ref and len(set(ours)) > 3
    assert isinstance(sched, SWALR) and sched.state_dict() == plain.state_dict()


def test_disabled_scaler_and_an_update_before_any_step_are_plain_updates():
    model = net()
    ours = skip_aware(AveragedModel(model), lossscale.GradScaler("cpu"))
    ours.update_parameters(model)  # before training: no decision yet, nothing was skipped
    assert int(ours.n_averaged) == 1
    off = skip_aware(AveragedModel(model), lossscale.GradScaler("cpu", enabled=False))
    off.update_parameters(model)
    off.update_parameters(model)
    assert int(off.n_averaged) == 2


def test_an_update_before_the_iterations_step_is_refused_with_the_order():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = lossscale.GradScaler("cpu")
    ours = skip_aware(AveragedModel(model), scaler)
    forward_backward(model, scaler, 1)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"after scaler\.step\(optimizer\)"):
        ours.update_parameters(model)
    assert int(ours.n_averaged) == 0


def test_validation_names_the_argument():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="scaler=.*lossscale.GradScaler"):
        skip_aware(AveragedModel(model), torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="optimizer=.*AveragedModel.*drop the argument"):
        skip_aware(torch.optim.lr_scheduler.StepLR(opt, 2), lossscale.GradScaler("cpu"), optimizer=opt)
    with pytest.raises(ValueError, match="obj=.*no step.*AveragedModel"):
        skip_aware(model, lossscale.GradScaler("cpu"))  # a plain module is neither
