"""GradScaler beyond torch parity: skips, fault injection, checkpoints, errors, diagnosis, extras."""

import copy
import math
import pickle
import random
import warnings

import pytest
import torch
from _devices import CUDA_LIKE, on
from _models import (
    TORCH_LIKE,
    backward,
    batch,
    drive,
    inject,
    make_optimizer,
    params_equal,
    states_equal,
    tiny_mlp,
    twins,
    two_optimizer_run,
)

import lossscale


def snapshot(model, opt):
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())


@pytest.mark.parametrize("kind", ["sgd", "adam", "fused_adam"])
@pytest.mark.parametrize("bad", ["inf", "nan"])
def test_skipped_step_leaves_parameters_and_optimizer_state_untouched(kind, bad):
    model = tiny_mlp()
    opt = make_optimizer(kind, model.parameters())
    scaler = lossscale.GradScaler()
    for step in range(3):  # warm the optimizer state (momentum, exp_avg, step count)
        opt.zero_grad()
        backward(model, scaler, step)
        scaler.step(opt)
        scaler.update()
    params, state = snapshot(model, opt)
    opt.zero_grad()
    backward(model, scaler, 3)
    next(model.parameters()).grad[0, 0] = float(bad)
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    after = opt.state_dict()["state"]
    for k, entry in state["state"].items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(after[k][name])), (k, name)
    counters = scaler.counters()
    assert counters[f"{bad}_steps"] == 1 and counters["skipped_steps"] == 1
    report = scaler.overflow_report()
    assert report[bad] and not report["nan" if bad == "inf" else "inf"]


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, fused=True),
        lambda ps: torch.optim.Adam(ps, fused=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True),
    ],
    ids=["AdamW", "Adam", "SGD"],
)
@pytest.mark.parametrize("bad", ["inf", "nan"])
def test_unscale_on_a_fused_optimizer_tells_inf_from_nan_and_names_the_parameter(make, bad):
    # unscale_() before a fused optimizer's step (the clipping loop): the skip is decided on the device,
    # and the report still says which kind of value and which parameter, as it does without unscale_.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = make(model.parameters())
    scaler = lossscale.GradScaler("cpu")
    scaler.name_parameters(model)
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    model[1].weight.grad[0, 0] = float(bad)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped
    counters = scaler.counters()
    assert (counters["inf_steps"], counters["nan_steps"]) == ((1, 0) if bad == "inf" else (0, 1)), counters
    report = scaler.overflow_report()
    other = "nan" if bad == "inf" else "inf"
    assert report[bad] == ["1.weight"] and report[other] == [], report
    assert report["cause"].startswith(f"{'NaN' if bad == 'nan' else 'inf'} in the gradients (1.weight)"), report


# 5% random faults keep the scale at its floor (2000 clean steps in a row never happen), so the
# stuck warning fires by design here.
@pytest.mark.filterwarnings("ignore:lossscale:RuntimeWarning")
def test_fault_injection_2000_steps():
    model = tiny_mlp(1)
    opt = make_optimizer("sgd", model.parameters())
    scaler = lossscale.GradScaler(model=model)
    injected = skipped = wrong = 0
    for step in range(2000):
        opt.zero_grad(set_to_none=True)
        backward(model, scaler, step % 50)
        kind = inject(model, step, rate=0.05, seed=3)
        scaler.step(opt)
        scaler.update()
        injected += bool(kind)
        skipped += scaler.last_step_skipped
        wrong += scaler.last_step_skipped != bool(kind)
        if kind:
            assert scaler.overflow_report()[kind], step
    assert wrong == 0  # every injected step skipped, no clean step skipped
    assert skipped == injected > 50
    assert all(torch.isfinite(p).all() for p in model.parameters())
    c = scaler.counters()
    assert c["skipped_steps"] == injected and c["steps"] == 2000
    assert c["inf_steps"] + c["nan_steps"] == injected and c["inf_steps"] > 0 and c["nan_steps"] > 0


@pytest.mark.filterwarnings("ignore:lossscale. the checkpoint.s policy replaces:UserWarning")  # by design here
@pytest.mark.parametrize("kind", ["sgd", "fused_adam"])
def test_checkpoint_continuation_is_bitwise_identical(kind, tmp_path):
    rng = random.Random(kind)
    save_at = rng.randrange(5, 25)
    model, _ = twins(2)
    opt = make_optimizer(kind, model.parameters())
    scaler = lossscale.GradScaler(init_scale=2.0**18, growth_interval=4, hysteresis=2, min_scale=2.0**-4)

    def iteration(m, o, s, step):
        o.zero_grad()
        backward(m, s, step, loss_mult=8.0)
        inject(m, step, rate=0.2, seed=7)
        s.step(o)
        s.update()

    for step in range(save_at):
        iteration(model, opt, scaler, step)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}, path)
    ckpt = torch.load(path, weights_only=True)  # the state dict is plain Python: weights_only works
    model2 = tiny_mlp(99)
    opt2 = make_optimizer(kind, model2.parameters())
    scaler2 = lossscale.GradScaler()  # different config: the checkpoint's config wins
    scaler2.load_state_dict(ckpt["scaler"])  # before the first scale(): must work
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    for step in range(save_at, save_at + 20):
        iteration(model, opt, scaler, step)
        iteration(model2, opt2, scaler2, step)
        assert scaler.get_scale() == scaler2.get_scale()
        assert params_equal(model, model2) and states_equal(opt, opt2)
    assert scaler.state_dict() == scaler2.state_dict()


@pytest.mark.filterwarnings("ignore:lossscale. the checkpoint.s policy replaces:UserWarning")  # by design here
def test_state_dict_round_trip_covers_every_field():
    # jmp's bug: a round trip that forgets a field silently resets it. Make every field non-default.
    scaler = lossscale.GradScaler(
        init_scale=2.0**5,
        growth_factor=4.0,
        backoff_factor=0.25,
        growth_interval=9,
        hysteresis=3,
        consecutive_hysteresis=True,
        min_scale=2.0**-3,
        max_scale=2.0**20,
        on_stuck="ignore",
        max_consecutive_skips=7,
    )
    drive(scaler, (True, False, True, True))
    sd = scaler.state_dict()
    other = lossscale.GradScaler()
    other.load_state_dict(sd)
    assert other.state_dict() == sd
    assert other.policy == scaler.policy
    assert sd["state"]["nan_steps"] == 3 and sd["state"]["hysteresis_tracker"] == 1
    assert pickle.loads(pickle.dumps(scaler)).state_dict() == sd


def test_bad_call_orders_raise_and_change_nothing():
    model = tiny_mlp()
    opt = make_optimizer("sgd", model.parameters())
    scaler = lossscale.GradScaler()
    for call in (lambda: scaler.step(opt), lambda: scaler.unscale_(opt), lambda: scaler.update()):
        with pytest.raises(RuntimeError, match="scale\\(loss\\)"):
            call()
    backward(model, scaler, 0)
    with pytest.raises(RuntimeError, match="step\\(optimizer\\)"):
        scaler.update()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    before = scaler.state_dict()
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="Closure"):
        scaler.step(opt, closure=lambda: 0)
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(new_scale=-1.0)
    with pytest.raises(ValueError, match="max_scale"):
        scaler.update(new_scale=2.0**30)
    assert scaler.state_dict() == before
    scaler.update()
    assert scaler.state_dict()["state"]["steps"] == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(growth_factor=0.9), "growth_factor"),
        (dict(backoff_factor=2.0), "backoff_factor"),
        (dict(growth_interval=0), "growth_interval"),
        (dict(policy="fancy"), "policy"),
        (dict(policy=lossscale.StaticPolicy(), init_scale=4.0), "init_scale"),
        (dict(device=3), "device"),
        (dict(on_stuck="maybe"), "on_stuck"),
    ],
)
def test_bad_scaler_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lossscale.GradScaler(**kwargs)


def test_setters_validate_and_keep_state():
    scaler = lossscale.GradScaler()
    with pytest.raises(ValueError, match="growth_factor"):
        scaler.set_growth_factor(1.0)
    assert scaler.get_growth_factor() == 2.0
    scaler.set_growth_interval(10)
    scaler.set_backoff_factor(0.25)
    assert (scaler.get_growth_interval(), scaler.get_backoff_factor()) == (10, 0.25)


def test_bad_state_dicts_raise_and_change_nothing():
    scaler = lossscale.GradScaler(init_scale=2.0**8)
    with pytest.raises(RuntimeError, match="empty"):
        scaler.load_state_dict({})
    with pytest.raises(ValueError, match="missing"):
        scaler.load_state_dict({"scale": 1.0})
    bad = lossscale.GradScaler().state_dict()
    bad["lossscale_version"] = 99
    with pytest.raises(ValueError, match="version"):
        scaler.load_state_dict(bad)
    torch_sd = torch.amp.GradScaler("cpu", init_scale=2.0**-30).state_dict()  # below the default floor
    torch_sd["_growth_tracker"] = 2000  # at its interval: no torch scaler holds it
    with pytest.raises(ValueError, match="_growth_tracker"):
        scaler.load_state_dict(torch_sd)
    assert scaler.get_scale() == 2.0**8 and scaler.policy.min_scale == 2.0**-24


def test_fp16_parameters_with_plain_optimizer_name_the_parameters_and_fixes():
    model = tiny_mlp().half()
    scaler = lossscale.GradScaler(model=model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(0)
    scaler.scale(torch.nn.functional.cross_entropy(model(x.half()), y)).backward()
    with pytest.raises(ValueError, match=r"0\.weight.*autocast"):
        scaler.step(opt)


def test_stuck_at_min_scale_raises_with_nan_diagnosis():
    scaler = lossscale.GradScaler(init_scale=4.0, min_scale=1.0, on_stuck="raise")
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    with pytest.raises(RuntimeError, match="NaN persisted") as err:
        for _ in range(10):
            opt.zero_grad()
            scaler.scale(p.sum()).backward()
            p.grad[0] = float("nan")
            scaler.step(opt)
            scaler.update()
    assert "not the cause" in str(err.value)
    assert scaler.get_scale() == 1.0


def test_stuck_inf_warns_once_per_streak():
    scaler = lossscale.GradScaler(init_scale=2.0, min_scale=1.0)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)

    def it(bad):
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        if bad:
            p.grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for bad in [True] * 6 + [False] + [True] * 3:
            it(bad)
    stuck = [w for w in rec if "overflow" in str(w.message)]
    assert len(stuck) == 2  # one per streak
    assert "fp32" in str(stuck[0].message)


def test_last_step_skipped_and_scheduler_do_not_advance_on_skips():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = lossscale.GradScaler()
    advanced = []
    for bad in (False, True, False):
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        if bad:
            p.grad[1] = float("inf")
        scaler.step(opt)
        scaler.update()
        assert scaler.last_step_skipped == bad
        advanced.append(scaler.step_scheduler(sched))
    assert advanced == [True, False, True]
    assert sched.last_epoch == 2 and scaler.skipped_steps == 1


def test_fused_path_skip_awareness_reads_device_flag():
    model = tiny_mlp()
    opt = make_optimizer("fused_adam", model.parameters())
    scaler = lossscale.GradScaler()
    backward(model, scaler, 0)
    model[0].bias.grad[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped and scaler.overflow_report()["inf"]


def test_several_optimizers_and_losses_per_iteration():
    a, b = tiny_mlp(0), tiny_mlp(1)
    oa, ob = make_optimizer("sgd", a.parameters()), make_optimizer("adam", b.parameters())
    ta, tb = copy.deepcopy(a), copy.deepcopy(b)
    toa, tob = make_optimizer("sgd", ta.parameters()), make_optimizer("adam", tb.parameters())
    ours = lossscale.GradScaler(min_scale=None, max_scale=None, growth_interval=2)
    ref = torch.amp.GradScaler("cpu", growth_interval=2)
    for step in range(6):
        for ma, mb, o1, o2, s in ((a, b, oa, ob, ours), (ta, tb, toa, tob, ref)):
            o1.zero_grad(), o2.zero_grad()
            x, y = batch(step)
            with torch.autocast("cpu", dtype=torch.float16):
                l1 = torch.nn.functional.cross_entropy(ma(x), y)
                l2 = torch.nn.functional.cross_entropy(mb(x), y)
            s.scale(l1).backward(retain_graph=True)
            s.scale(l2).backward()
            if step == 3:
                next(mb.parameters()).grad[0, 0] = float("inf")
            s.step(o1)
            s.step(o2)
            s.update()
        assert ours.get_scale() == ref.get_scale()
        assert params_equal(a, ta) and params_equal(b, tb)


def test_two_optimizers_overflow_in_the_first_is_counted_and_skips_both():
    """Kills the same change seen through the counters: the iteration must count as skipped."""
    scaler = lossscale.GradScaler("cpu", growth_interval=100, **TORCH_LIKE)
    a, b, _ = two_optimizer_run(scaler, {0}, "inf", False)
    s = scaler.state()
    assert (s.steps, s.skipped_steps, s.inf_steps, s.nan_steps) == (6, 1, 1, 0)
    # No streak runs now: streak_start_scale is the last step's scale, where a next streak would begin.
    assert s.streak_start_scale == 2.0**15 and s.scale == 2.0**15


def test_gradient_accumulation_matches_torch():
    m1, m2 = twins(4)
    o1, o2 = make_optimizer("sgd", m1.parameters()), make_optimizer("sgd", m2.parameters())
    ours, ref = lossscale.GradScaler(min_scale=None, max_scale=None), torch.amp.GradScaler("cpu")
    for step in range(4):
        for m, o, s in ((m1, o1, ours), (m2, o2, ref)):
            o.zero_grad()
            for micro in range(3):
                x, y = batch(10 * step + micro)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.cross_entropy(m(x), y) / 3
                s.scale(loss).backward()
            s.step(o)
            s.update()
    assert params_equal(m1, m2)


def test_scale_nested_outputs_and_device_inference():
    scaler = lossscale.GradScaler(init_scale=4.0)
    out = scaler.scale({"a": torch.ones(2), "b": [torch.ones(1), (torch.ones(3),)]})
    assert torch.equal(out["a"], torch.full((2,), 4.0)) and torch.equal(out["b"][1][0], torch.full((3,), 4.0))
    assert scaler._get_scale_async().device.type == "cpu"
    with pytest.raises(ValueError, match="scale\\(\\) takes"):
        scaler.scale([torch.ones(1), "x"])
    wrong = lossscale.GradScaler(device="cuda") if torch.cuda.is_available() else None
    if wrong is not None:
        with pytest.raises(ValueError, match="device"):
            wrong.scale(torch.ones(1))


@pytest.mark.filterwarnings("ignore:lossscale:RuntimeWarning")
def test_passthrough_for_bf16_skips_nonfinite_without_scaling():
    model = tiny_mlp().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = lossscale.GradScaler.passthrough()
    x, y = batch(0)
    loss = torch.nn.functional.cross_entropy(model(x.bfloat16()), y)
    assert torch.equal(scaler.scale(loss), loss)
    loss_scaled = scaler.scale(loss)
    loss_scaled.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert not scaler.last_step_skipped and scaler.get_scale() == 1.0
    # the gradients were not rewritten (no unscale pass at scale 1)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    scaler.scale(torch.nn.functional.cross_entropy(model(x.bfloat16()), y)).backward()
    model[2].weight.grad[0, 0] = float("nan")
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_disabled_scaler_is_a_no_op():
    scaler = lossscale.GradScaler(enabled=False)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    loss = p.sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {} and not scaler.is_enabled()
    assert torch.equal(p.detach(), torch.zeros(2))


def test_update_with_new_scale_like_torch():
    ours = lossscale.GradScaler(min_scale=None, max_scale=None)
    ref = torch.amp.GradScaler("cpu")
    for s in (ours, ref):
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=1.0)
        s.scale(p.sum()).backward()
        s.step(opt)
        s.update(new_scale=8.0)
        s.scale(p.sum())
        s.update(new_scale=torch.tensor(16.0))
    assert ours.get_scale() == ref.get_scale() == 16.0
    assert ours._get_growth_tracker() == ref._get_growth_tracker()


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 3.0])
def test_a_single_float32_loss_is_checked_by_the_read_itself(value):
    """The iteration's one float32 loss reaches the host's read as it is, which adds ``loss * 0`` to
    the decision (no kernel at ``scale()``): +inf, -inf and NaN before scaling skip the step without
    backing off, a finite loss does not. The gradients are finite either way, so only the loss check
    can skip. Kills: the raw loss added without ``* 0`` (an inf loss read as a clean step)."""
    p = torch.nn.Parameter(torch.ones(2))
    ref = torch.nn.Parameter(torch.ones(2))
    opt, ref_opt = torch.optim.SGD([p], lr=0.1), torch.optim.SGD([ref], lr=0.1)
    scaler = lossscale.GradScaler("cpu", init_scale=2.0**4)
    scaler.scale(p.sum() + torch.tensor(value)).backward()
    scaler.step(opt)
    scaler.update()
    ref.grad = torch.ones(2)
    ref_opt.step()
    bad = not math.isfinite(value)
    state = scaler.state()
    assert (state.skipped_steps, state.bad_loss_steps, state.scale) == (int(bad), int(bad), 16.0)
    assert torch.equal(p.detach(), torch.ones(2) if bad else ref.detach())


def _two_optimizer_states(policy_kwargs, fused, script, bad_loss_at=(), device="cpu"):
    """Run ``script`` (per iteration: the two optimizers' gradient kinds and an optional new_scale) with
    two SGD optimizers (lr 0: the gradients stay as set), foreach or ``fused=True``, the loss NaN at the
    iterations in ``bad_loss_at``; return the scaler's state and scale after every iteration."""
    scaler = lossscale.GradScaler(device, **policy_kwargs)
    a = torch.nn.Parameter(torch.zeros(3, device=device))
    b = torch.nn.Parameter(torch.zeros(2, device=device))
    opts = [
        torch.optim.SGD([a], lr=0.0, fused=fused, foreach=None if fused else True),
        torch.optim.SGD([b], lr=0.0, fused=fused, foreach=None if fused else True),
    ]
    values = {"clean": 3.0, "small": 1e-3, "zero": 0.0, "inf": math.inf, "nan": math.nan}
    out = []
    for i, (kinds, new_scale) in enumerate(script):
        scaler.scale(torch.full((), math.nan if i in bad_loss_at else 1.0, device=device))
        for p, kind in zip((a, b), kinds):
            p.grad = torch.full_like(p, values[kind]) * scaler.get_scale()
        for o in opts:
            scaler.step(o)
        scaler.update(new_scale)
        out.append((scaler.state(), scaler.get_scale()))
    return out


@pytest.mark.parametrize(
    "policy_kwargs",
    [
        dict(growth_interval=2),
        dict(growth_interval=2, hysteresis=2),
        dict(min_scale=None, max_scale=None),
        dict(policy="adaptive", growth_interval=2),
        dict(policy="logmax"),
        dict(policy="static", scale=2.0**4),
    ],
    ids=["dynamic", "hysteresis", "unbounded", "adaptive", "logmax", "static"],
)
@pytest.mark.filterwarnings("ignore:lossscale. .* consecutive skipped:RuntimeWarning")  # the script hits the floor
def test_two_optimizers_device_rule_agrees_with_the_host_rule(policy_kwargs):
    """Two optimizers per iteration: synced (SGD foreach: the host knows the flags and runs the pure
    rule) and fused (SGD ``fused=True``: the flags stay on device, the tensor rule runs on the two flag
    vectors combined and the larger of the two amaxes). Every state along the way agrees bitwise,
    ``update(new_scale)`` (a float, a tensor, float32's smallest normal) included. Kills: the device
    combining only one optimizer's flags or amax, or the two vectors into one number; a tensor
    ``new_scale`` compared with ``>`` (2**-126 refused) or not cast to the scale's dtype."""
    rng = random.Random(5)
    kinds = ["clean", "clean", "small", "zero", "inf", "nan"]
    script = [((rng.choice(kinds), rng.choice(kinds)), None) for _ in range(24)]
    unbounded = policy_kwargs.get("min_scale", 1) is None
    script[7] = (("clean", "nan"), 2.0**6)  # an overflow that still sets the scale: counted as one
    script[13] = (("clean", "inf"), torch.tensor(2.0**-126 if unbounded else 2.0**3, dtype=torch.float64))
    script[19] = (("inf", "clean"), torch.tensor(math.inf))  # refused on device: the scale stays
    if policy_kwargs.get("policy") in ("logmax", "static"):  # their scales are their own: no new_scale
        script = [(k, None) for k, _ in script]
    host = _two_optimizer_states(policy_kwargs, False, script, bad_loss_at={3, 7})
    device = _two_optimizer_states(policy_kwargs, True, script, bad_loss_at={3, 7})
    assert host == device
    assert any(s.skipped_steps for s, _ in host) and host[-1][0].steps == len(script)
    assert host[-1][0].bad_loss_steps == 2  # the one at 7 with a new_scale too
    if unbounded:  # a tensor new_scale goes to the device either way: the smallest normal is taken
        assert host[13][1] == 2.0**-126


@pytest.mark.parametrize("device", CUDA_LIKE)
@pytest.mark.parametrize(
    "policy_kwargs",
    [
        dict(growth_interval=2),
        dict(growth_interval=2, hysteresis=2),
        dict(growth_interval=2, backoff_factor=0.7),
        dict(min_scale=None, max_scale=None, hysteresis=3, consecutive_hysteresis=True),
        dict(policy="adaptive", growth_interval=2),
        dict(policy="logmax"),
    ],
    ids=["dynamic", "hysteresis", "backoff-0.7", "unbounded-deepspeed", "adaptive", "logmax"],
)
@pytest.mark.filterwarnings("ignore:lossscale. .* consecutive skipped:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:lossscale. backoff_factor=0.7 is not a power of two:UserWarning")
def test_the_device_rules_agree_with_the_host_rule_on_a_cuda_device(policy_kwargs, device):
    """The agreement above on a CUDA device (only where there is one: skipped on CPU, tests/README.md), where the
    flags are one matrix product and the rules run on the device's kernels: the read-only check's
    ``mv``, float64 constants, a float32 inverse of a power-of-two scale, bool flags. Kills on a GPU:
    a kernel that rounds or flushes where the CPU does not."""
    rng = random.Random(11)
    kinds = ["clean", "clean", "clean", "small", "zero", "inf", "nan"]
    script = [((rng.choice(kinds), rng.choice(kinds)), None) for _ in range(30)]
    with on(device) as device:
        host = _two_optimizer_states(policy_kwargs, False, script, bad_loss_at={4, 9}, device=device)
        fused = _two_optimizer_states(policy_kwargs, True, script, bad_loss_at={4, 9}, device=device)
    assert host == fused and any(s.skipped_steps for s, _ in host)


def test_update_new_scale_takes_its_bounds_and_refuses_what_a_tensor_cannot_be():
    """A float ``new_scale`` exactly at ``min_scale`` or ``max_scale`` is taken, and float32's smallest
    normal where there is no floor; a tensor one must be one floating-point value without grad. Kills:
    the bounds compared strictly, the range check's ``<=`` made ``<``, the tensor checks joined with
    ``and``."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.0)

    def iteration(scaler, new_scale):
        scaler.scale(p.sum()).backward()
        scaler.step(opt)
        scaler.update(new_scale)
        return scaler.get_scale()

    bounded = lossscale.GradScaler("cpu", init_scale=2.0**5, min_scale=2.0, max_scale=2.0**10)
    assert [iteration(bounded, v) for v in (2.0, 2.0**10)] == [2.0, 2.0**10]
    assert iteration(lossscale.GradScaler("cpu", min_scale=None, max_scale=None), 2.0**-126) == 2.0**-126
    bounded.scale(p.sum()).backward()
    bounded.step(opt)
    for bad in (torch.tensor(4.0, requires_grad=True), torch.tensor(4), torch.ones(2), 2.0**-127):
        with pytest.raises(ValueError, match="new_scale"):
            bounded.update(new_scale=bad)
    bounded.update(new_scale=4.0)
    assert bounded.get_scale() == 4.0 and bounded.state().steps == 3


@pytest.mark.parametrize("fused", [False, True], ids=["host state", "device state"])
def test_a_lowered_growth_interval_caps_the_tracker_so_the_next_clean_step_grows(fused):
    """After 5 clean steps, ``set_growth_interval(3)`` keeps the tracker below 3 (on the host's copy and
    on device), so the next clean step grows the scale. torch's setter leaves its tracker at 5, which
    its kernel's ``== interval`` never meets again until an overflow. Kills: the cap dropped or off by one."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.0, fused=fused)
    scaler = lossscale.GradScaler("cpu", init_scale=2.0**4, growth_interval=100)
    for step in range(7):
        if step == 5:
            scaler.set_growth_interval(3)
            assert scaler._get_growth_tracker() == 2
        scaler.scale(torch.ones(()))
        p.grad = torch.ones(2)
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 2.0**5 and scaler._get_growth_tracker() == 1


def test_the_call_order_errors_keep_torchs_words_first_and_name_the_fix():
    # torch's wording starts each message (so a search finds it); what follows says what to do, and the
    # forgotten update() that most often leads there. Each refusal changes nothing.
    model = tiny_mlp()
    opt = make_optimizer("sgd", model.parameters())
    scaler = lossscale.GradScaler()
    backward(model, scaler, 0)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError) as e:
        scaler.unscale_(opt)
    assert str(e.value).startswith("unscale_() has already been called on this optimizer since the last update(). ")
    assert "once per optimizer per iteration" in str(e.value) and "scaler.update()" in str(e.value)
    scaler.step(opt)
    scaler.update()
    backward(model, scaler, 1)
    scaler.step(opt)  # ... and the update() forgotten:
    backward(model, scaler, 2)
    with pytest.raises(RuntimeError) as e:
        scaler.step(opt)
    assert str(e.value).startswith("step() has already been called since the last update(). ")
    assert "Call scaler.update() once at the end of every iteration" in str(e.value)
    with pytest.raises(RuntimeError) as e:
        scaler.unscale_(opt)
    assert str(e.value).startswith("unscale_() is being called after step(); call it before step()")
    assert "end every iteration with scaler.update()" in str(e.value)
    scaler.update()
    assert scaler.counters()["steps"] == 2
