"""First cause (issue 13): a non-finite loss skips the step without costing the scale, in every
policy's pure and tensor rule alike, and with ``trace=True`` the report names the module where the
non-finite value began."""

import math
import pickle

import pytest
import torch
from _models import TORCH_RULE, five_layer_mlp
from _rules import TensorForm
from _sync import count_host_syncs
from hypothesis import given, settings
from hypothesis import strategies as st

import lossscale
from lossscale import AdaptivePolicy, DynamicPolicy, LogMaxPolicy, StaticPolicy
from lossscale.policy import BAD_LOSS_STREAK

# ------------------------------------------------------------------ the rules: pure and tensor agree
policies = st.sampled_from(
    [
        DynamicPolicy(init_scale=2.0**8, growth_interval=2, hysteresis=2),
        DynamicPolicy(init_scale=2.0**8, growth_interval=3, consecutive_hysteresis=True, hysteresis=2, min_scale=None),
        StaticPolicy(scale=2.0**4),
        AdaptivePolicy(growth_interval=2, max_scale=None),
        LogMaxPolicy(max_scale=2.0**30),
    ]
)
events = st.lists(
    st.tuples(st.booleans(), st.booleans(), st.sampled_from([None, 0.0, 2.0**-7, 3.0, math.inf]), st.booleans()),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(policies, events)
def test_a_bad_loss_skips_without_touching_the_scale_in_both_forms(policy, seq):
    s, dev = policy.init_state(), TensorForm(policy)
    for found_inf, found_nan, amax, bad in seq:
        found_nan = found_nan and found_inf
        amax = amax if policy.needs_amax else None
        before = s
        s = policy.update(s, found_inf=found_inf, found_nan=found_nan, amax=amax, bad_loss=bad)
        dev.step(found_inf, found_nan, amax, bad)
        got = dev.to_state()
        assert got == s.replace(streak_start_scale=got.streak_start_scale), (before, found_inf, amax, bad)
        if bad:
            assert s.skipped_steps == before.skipped_steps + 1 and s.bad_loss_steps == before.bad_loss_steps + 1
            # the scale and every policy-specific tracker are left as they were
            kept = {k: v for k, v in vars(before).items() if k not in vars(lossscale.ScaleState(1.0))}
            assert s.scale == before.scale and all(getattr(s, k) == v for k, v in kept.items())


def test_a_bad_loss_streak_is_stuck_after_the_default_length():
    p = DynamicPolicy()
    s = p.init_state()
    for k in range(BAD_LOSS_STREAK):
        before, s = s.scale, p.update(s, True, True, bad_loss=True)
        assert p.is_stuck(s, before) == (k + 1 >= BAD_LOSS_STREAK)
    assert "the loss was non-finite before any scaling" in lossscale.diagnose(p, s)
    assert StaticPolicy().is_stuck(StaticPolicy().update(StaticPolicy().init_state(), True, bad_loss=True), 1) is False


# ------------------------------------------------------------------ the scaler
def _run(scaler, steps, bad_steps, kind="nan", second_loss=False, seed=0):
    """A linear model whose loss is NaN/inf on ``bad_steps`` (a bad batch: one input value)."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scales = []
    for step in range(steps):
        opt.zero_grad()
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        if step in bad_steps:
            x[0, 0] = float(kind)
        loss = model(x).square().mean()
        scaler.scale(loss).backward()
        if second_loss:  # a second, finite loss in the same iteration (several losses / accumulation)
            scaler.scale(model(x[1:]).abs().mean()).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_loss_check_off_is_bitwise_torch_and_on_keeps_the_scale(kind):
    bad = {2, 3, 7}
    ref_scales, ref_params = _run(torch.amp.GradScaler("cpu", growth_interval=3), 12, bad, kind)
    off_scales, off_params = _run(
        lossscale.GradScaler(growth_interval=3, loss_check=False, **TORCH_RULE), 12, bad, kind
    )
    assert off_scales == ref_scales and all(torch.equal(a, b) for a, b in zip(ref_params, off_params))
    on = lossscale.GradScaler(growth_interval=3, **TORCH_RULE)
    on_scales, on_params = _run(on, 12, bad, kind)
    assert all(torch.equal(a, b) for a, b in zip(ref_params, on_params))  # the same steps were skipped
    assert min(ref_scales) < 2.0**16 and min(on_scales) >= 2.0**16  # torch backed off; the check did not
    c = on.counters()
    assert c["skipped_steps"] == c["bad_loss_steps"] == 3 and on.metrics()["bad_loss_steps"] == 3
    assert on.state_dict()["state"]["bad_loss_steps"] == 3


def test_several_losses_per_iteration_one_bad():
    scaler = lossscale.GradScaler(growth_interval=100)
    scales, _ = _run(scaler, 6, {1, 4}, second_loss=True)
    assert scales == [2.0**16] * 6 and scaler.counters()["bad_loss_steps"] == 2


def test_a_loss_that_overflows_only_when_scaled_is_the_scales_fault():
    # An fp16 loss vector: finite as computed, inf once multiplied by 2**16 (fp16 times a 0-dim float32).
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = lossscale.GradScaler()
    loss = (p * torch.tensor([60000.0, 1.0])).half()
    scaled = scaler.scale(loss)
    assert torch.isinf(scaled).any()
    scaled.float().sum().backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**15 and scaler.counters()["bad_loss_steps"] == 0


def test_a_hundred_bad_batches_among_a_thousand_leave_the_scale_where_a_clean_run_has_it():
    bad = set(range(5, 1000, 10))
    clean, _ = _run(lossscale.GradScaler(growth_interval=2000), 1000, set())
    ours, _ = _run(lossscale.GradScaler(growth_interval=2000), 1000, bad)
    ref, _ = _run(torch.amp.GradScaler("cpu", growth_interval=2000), 1000, bad)
    assert ours[-1] == clean[-1] == 2.0**16
    assert ref[-1] == 2.0**-84  # torch halves the scale for every bad batch


def test_a_run_of_bad_batches_is_reported_as_a_data_problem():
    scaler = lossscale.GradScaler(on_stuck="raise")
    with pytest.raises(RuntimeError, match="the loss was non-finite before any scaling"):
        _run(scaler, BAD_LOSS_STREAK + 3, set(range(BAD_LOSS_STREAK + 3)))
    assert scaler.get_scale() == 2.0**16


def test_bad_loss_steps_survive_a_checkpoint():
    scaler = lossscale.GradScaler()
    _run(scaler, 5, {1, 2})
    other = lossscale.GradScaler()
    other.load_state_dict(scaler.state_dict())
    assert other.state() == scaler.state() and other.state().bad_loss_steps == 2


# ------------------------------------------------------------------ tracing
def mlp():
    return five_layer_mlp()


def _traced_step(model, scaler, x):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().square().mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return scaler.overflow_report()


def test_trace_names_the_forward_module_and_keeps_the_scale():
    model = mlp()
    model[2].register_forward_hook(lambda m, a, out: out.index_fill(1, torch.tensor([0]), math.inf), prepend=True)
    with lossscale.GradScaler(model=model, trace=True) as scaler:
        report = _traced_step(model, scaler, torch.randn(4, 6))
    # tanh(inf) = 1: the loss is finite, yet the step is skipped (a forward value was not) and the scale kept
    assert report["forward"] == "2" and report["loss"] == "finite" and scaler.get_scale() == 2.0**16
    assert scaler.counters()["bad_loss_steps"] == 1
    assert "forward output of `2`" in report["cause"] and "not the loss scale" in report["cause"]


def test_trace_names_the_backward_overflow_and_backs_off():
    model = mlp()
    with torch.no_grad():
        model[0].bias.zero_()
        model[2].bias.zero_()
        model[2].weight.mul_(1e3)
    scaler = lossscale.GradScaler(model=model, trace=True, init_scale=2.0**15)
    report = _traced_step(model, scaler, torch.randn(4, 6) * 1e-4)
    assert report["loss"] == "finite" and report["forward"] is None and report["backward"] == "2"
    assert report["scale"] == 2.0**15 and scaler.get_scale() == 2.0**14
    assert "backward of `2` overflowed fp16 at scale 2^15" in report["cause"]
    scaler.close()


def test_tracing_adds_no_host_sync_and_is_removed_cleanly():
    counts = {}
    for trace in (False, True):
        model = mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
        scaler = lossscale.GradScaler(model=model, trace=trace)
        for _ in range(3):
            with count_host_syncs() as syncs:
                opt.zero_grad()
                scaler.scale(model(torch.randn(4, 6)).square().mean()).backward()
                scaler.step(opt)
                scaler.update()
        counts[trace] = syncs.count
        restored = pickle.loads(pickle.dumps(scaler))
        assert restored.state() == scaler.state()
        scaler.close()
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert counts[True] == counts[False] == 0


def test_trace_needs_a_model():
    with pytest.raises(ValueError, match="model="):
        lossscale.GradScaler(trace=True)
    with pytest.raises(ValueError, match="loss_check"):
        lossscale.GradScaler(loss_check="yes")


def test_a_nan_in_a_no_grad_evaluation_does_not_skip_the_next_training_step():
    # Issue 19: an evaluation batch with a NaN, run under no_grad between two training steps, made
    # the next clean step skip and blamed "forward of `0`".
    model = mlp()
    scaler = lossscale.GradScaler(model=model, trace=True)
    bad = torch.randn(4, 6)
    bad[0, 0] = math.nan
    for evaluate in (torch.no_grad, torch.inference_mode):
        with evaluate():
            assert torch.isnan(model(bad)).any()
        report = _traced_step(model, scaler, torch.randn(4, 6))
        assert not scaler.last_step_skipped and report["forward"] is None
    assert scaler.counters()["skipped_steps"] == 0
    scaler.close()
