"""Spike skipping (issue 33): ``GradScaler(skip_if=SkipIf(...))`` skips a finite step whose gradient norm
or loss is far off its recent run, through the scaler's own skip flag, without backing the scale off.

The device rule is held to a plain-Python reference (the module docstring's pseudocode) over random
sequences; the rest runs torch's real optimizers, fused AdamW included, and a GPT-2 from a config.
"""

import math
import random
import statistics

import pytest
import torch
from _gpt2 import gpt2_batch, gpt2_loss, tiny_gpt2
from _sync import count_host_syncs

import lossscale
from lossscale import SkipIf
from lossscale.spikes import SpikeWindows


def _reference(rule, xs, kind):
    """The pseudocode: which of the values ``xs`` (one statistic) are spikes, the window of taken ones."""
    window, out = [], []
    z = rule.grad_norm_zscore if kind == "norm" else rule.loss_zscore
    for x in xs:
        spike = kind == "norm" and rule.grad_norm_above is not None and x > rule.grad_norm_above
        if z is not None and len(window) >= rule.min_steps:
            spike = spike or x > statistics.fmean(window) + z * statistics.pstdev(window)
        spike = spike and math.isfinite(x)
        out.append(spike)
        if not spike and math.isfinite(x):
            window = (window + [x])[-rule.window :]
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["norm", "loss"])
def test_the_device_rule_is_the_pseudocodes(seed, kind):
    rng = random.Random(seed)
    rule = SkipIf(
        grad_norm_zscore=3.0,
        grad_norm_above=40.0 if seed % 2 else None,
        loss_zscore=2.5,
        window=rng.choice([4, 8, 16]),
        min_steps=rng.choice([2, 3, 4]),
    )
    xs = [rng.lognormvariate(0, 0.3) * (rng.choice([1, 1, 1, 1, 10, 50])) for _ in range(60)]
    windows = SpikeWindows(rule, torch.device("cpu"))
    got = []
    for x in xs:
        t = torch.tensor(x, dtype=torch.float32)
        value = float(t)  # what the device sees: the float32 value
        spike = windows.check(t if kind == "norm" else None, t if kind == "loss" else None)
        got.append((value, bool(spike)))
        windows.learn(t if kind == "norm" else None, t if kind == "loss" else None, spike, taken=~spike)
    assert [s for _, s in got] == _reference(rule, [v for v, _ in got], kind)
    assert sum(s for _, s in got) == int(windows.spikes.item())


def _gpt2_run(fused_clip, spike_at, rule):
    model = tiny_gpt2(0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: the same run every time
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    scaler = lossscale.GradScaler(skip_if=rule, init_scale=2.0**8)
    seen, lrs, syncs = [], [], []
    scaler.on_step(seen.append)
    for step in range(14):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = gpt2_loss(model, gpt2_batch(step))
        scaler.scale(loss * (50.0 if step == spike_at else 1.0)).backward()  # a finite gradient spike (FP16 holds it)
        with count_host_syncs() as counted:
            if fused_clip:
                scaler.clip_grad_norm_(opt, 1e9)  # the norm from the clip: no pass more
            before = [p.detach().clone() for p in model.parameters()]
            state = [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
            scaler.step(opt)
            scaler.update()
        syncs.append(counted.count)
        if step == spike_at:
            unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            unchanged_state = all(
                torch.equal(a, b)
                for a, b in zip(state, [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)])
            )
        scaler.step_scheduler(sched)
        lrs.append(opt.param_groups[0]["lr"])
    return scaler, seen, lrs, syncs, unchanged, unchanged_state


@pytest.mark.parametrize("fused_clip", [False, True], ids=["norm pass", "clip's norm"])
def test_a_gradient_spike_is_skipped_on_gpt2_with_fused_adamw_and_the_schedule_holds(fused_clip):
    spike_at = 11
    scaler, seen, lrs, syncs, unchanged, unchanged_state = _gpt2_run(
        fused_clip, spike_at, SkipIf(grad_norm_zscore=4.0, min_steps=6)
    )
    assert [bool(t) for t in seen] == [step != spike_at for step in range(14)]
    assert unchanged and unchanged_state  # the weights and the optimizer state: bitwise as before
    assert syncs == [0] * 14  # fused AdamW: the spike skips on device
    assert lrs[spike_at] == lrs[spike_at - 1]  # the LR held on the skipped step
    counters = scaler.counters()
    assert counters["spike_steps"] == 1 and counters["skipped_steps"] == 0  # not an overflow
    assert scaler.get_scale() == 2.0**8  # not backed off
    report = scaler.health()
    assert report.spike_steps == 1 and "1 spike" in report.text
    assert scaler.metrics()["spike_steps"] == 1


def test_on_the_synced_path_the_spike_rides_in_the_checks_one_read():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = lossscale.GradScaler(skip_if=SkipIf(grad_norm_above=50.0, loss_zscore=3.0, min_steps=4))
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    skipped = []
    for step in range(10):
        opt.zero_grad()
        mult = 500.0 if step == 7 else 1.0
        scaler.scale(((model(x) * mult - y) ** 2).mean()).backward()
        with count_host_syncs() as syncs:
            scaler.step(opt)
            scaler.update()
        assert syncs.count == 1  # the skip decision, as torch's, a spike included
        skipped.append(scaler.last_step_skipped)
        if step == 7:
            report = scaler.overflow_report()
    assert skipped == [step == 7 for step in range(10)]
    assert report["spike"] and report["inf"] == [] and report["loss"] == "finite"
    assert "skipped by skip_if: a spike" in report["cause"]
    assert scaler.counters()["skipped_steps"] == 0 and scaler.counters()["spike_steps"] == 1


def test_passthrough_skips_spikes_for_bf16_with_the_same_account():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    scaler = lossscale.GradScaler.passthrough(skip_if=dict(loss_zscore=3.0, min_steps=4))
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    for step in range(8):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ((model(x).float() - y) ** 2).mean() * (100.0 if step == 6 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.counters()["spike_steps"] == 1 and scaler.get_scale() == 1.0


def test_the_windows_survive_a_checkpoint():
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.0)
    rule = SkipIf(grad_norm_zscore=3.0, min_steps=3)
    scaler = lossscale.GradScaler(skip_if=rule)
    for step in range(5):
        scaler.scale((p * (1.0 + 0.01 * step)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    saved = scaler.state_dict()
    resumed = lossscale.GradScaler(skip_if=rule)
    resumed.load_state_dict(saved)
    for s in (scaler, resumed):
        s.scale((p * 1000.0).sum()).backward()
        s.step(opt)
        s.update()
        opt.zero_grad()
    assert scaler.counters()["spike_steps"] == resumed.counters()["spike_steps"] == 1
    assert resumed.state_dict()["skip_if"] == scaler.state_dict()["skip_if"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(), "no rule"),
        (dict(grad_norm_above=0.0), "grad_norm_above"),
        (dict(loss_zscore=-1.0), "loss_zscore"),
        (dict(loss_zscore=3.0, window=1), "window"),
        (dict(loss_zscore=3.0, window=4, min_steps=8), "min_steps"),
        (dict(loss_zscore=math.inf), "loss_zscore"),
        (dict(loss_zscore=True), "loss_zscore"),
        (dict(loss_zscore=3.0, window=200.0), "window"),
    ],
)
def test_a_rule_that_cannot_work_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SkipIf(**kwargs)
    with pytest.raises(ValueError, match="skip_if=3"):
        lossscale.GradScaler(skip_if=3)


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused_adamw"])
def test_a_spike_that_overflows_is_an_overflow_not_a_spike(fused):
    # spike_steps counts the finite steps skipped as spikes: a loss spike whose gradients overflow FP16
    # is an overflow (skipped, the scale halved, in skipped_steps), and not counted as a spike as well.
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = (
        torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
        if fused
        else torch.optim.SGD(model.parameters(), lr=0.01)
    )
    scaler = lossscale.GradScaler(init_scale=2.0**8, skip_if=SkipIf(loss_zscore=3.0, min_steps=4))
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    for step in range(8):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean() * (100.0 if step in (5, 6) else 1.0)
        if step == 6:
            loss = loss * 1e36  # a spike whose scaled gradients are inf
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    c = scaler.counters()
    overflows = c["inf_steps"] + c["nan_steps"]
    assert (c["spike_steps"], c["skipped_steps"], overflows) == (1, 1, 1), c  # step 5 a spike, 6 an overflow
    assert scaler.get_scale() == 2.0**7
    assert scaler.health().spike_steps == 1


def _skipped_by_loss(losses, fused, rule):
    """Which steps of a run whose loss (before scaling) is each of ``losses`` in turn the scaler skips:
    a linear model whose loss is its weights times zero plus the value (finite zero gradients, any loss)."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), fused=True) if fused else torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = lossscale.GradScaler("cpu", skip_if=rule)
    skipped = []
    for value in losses:
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 4)).sum() * 0.0 + value).backward()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.last_step_skipped)
    return skipped


CLEAN = [1.0, 1.2] * 4  # mean 1.1, population std 0.1


@pytest.mark.parametrize("fused", [False, True])
def test_a_nan_loss_stays_out_of_the_window_and_a_later_spike_is_still_skipped(fused):
    # A NaN loss is a bad loss (skipped, not a spike); a NaN in the window would make every later
    # z-score test false, so no spike would ever be skipped again.
    rule = SkipIf(loss_zscore=3.0, window=16, min_steps=4)
    losses = CLEAN + [math.nan] + CLEAN[:2] + [50.0] + CLEAN[:2] + [60.0]
    skipped = _skipped_by_loss(losses, fused, rule)
    assert skipped == [not 1.0 <= x <= 1.2 for x in losses], skipped  # the NaN and both spikes


@pytest.mark.parametrize("fused", [False, True])
def test_a_skipped_spike_stays_out_of_the_window(fused):
    # Eight clean losses fill the window (mean 1.1, std 0.1: the threshold at z = 3 is 1.4). A spike
    # of 100 is skipped; if it joined the window its mean and std would let 1.45 through. With only
    # the clean losses in it, 1.45 is skipped too and 1.35 is taken (after which the window moves).
    rule = SkipIf(loss_zscore=3.0, window=16, min_steps=4)
    losses = CLEAN + [100.0, 1.45, 1.35]
    assert _skipped_by_loss(losses, fused, rule) == [False] * 8 + [True, True, False]
    # The same with the window full (a ring of 8 clean losses) and the spike landing where the next
    # value would be written.
    rule = SkipIf(loss_zscore=3.0, window=8, min_steps=4)
    losses = CLEAN + CLEAN + [100.0, 1.45, 1.35]
    assert _skipped_by_loss(losses, fused, rule) == [False] * 16 + [True, True, False]


def test_the_smallest_rules_are_accepted():
    # Every bound is the documented one: a z-score or norm bound above 0 (below 1 too), window and
    # min_steps of 2.
    assert SkipIf(loss_zscore=0.5, window=2, min_steps=2).window == 2
    assert SkipIf(grad_norm_above=0.25).grad_norm_above == 0.25


def test_the_windows_statistics_are_float64():
    # Four losses of 1 and four of its float32 neighbour 1 + 2**-23: in float64 the mean is 1 + 2**-24 and
    # the std 2**-24, so at z = 1 the threshold is 1 + 2**-23 exactly and that loss is not above it.
    # (Summed in float32, the mean rounds to 1 and the same loss would be a spike.)
    up = 1.0 + 2.0**-23
    rule = SkipIf(loss_zscore=1.0, window=8, min_steps=8)
    assert _skipped_by_loss([1.0, up] * 4 + [up, 1.0 + 2.0**-22], True, rule) == [False] * 9 + [True]


def test_a_constant_loss_is_never_a_spike():
    # A plateau: the window's std is 0 and every loss equals the mean, which is not above it.
    assert _skipped_by_loss([1.0] * 12, True, SkipIf(loss_zscore=3.0, min_steps=4)) == [False] * 12


def _skipped_by_norm(grads, fused, rule, clip=None):
    """Which steps the scaler skips when the true gradient of a 2-element parameter is each of ``grads``
    in turn (the loss is the parameter times it): the host path with unscale_ (SGD), or the fused
    path without it (the norm of the scaled gradients over the scale); ``clip``: through clip_grad_norm_."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], fused=True) if fused else torch.optim.SGD([p], lr=0.1)
    scaler = lossscale.GradScaler("cpu", skip_if=rule)
    skipped = []
    for g in grads:
        opt.zero_grad()
        scaler.scale((p * torch.tensor(g)).sum()).backward()
        if clip is not None:
            scaler.clip_grad_norm_(opt, clip)
        elif not fused:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.last_step_skipped)
    return skipped


@pytest.mark.parametrize("fused", [False, True])
def test_the_norm_bound_is_on_the_true_two_norm_and_a_norm_on_it_is_not_a_spike(fused):
    # |(3, 4)| = 5 exactly; just above 5 is a spike. The scaled gradients carry 2**16: the bound is on
    # the true norm, the scale divided out, whichever path judged it.
    rule = SkipIf(grad_norm_above=5.0)
    grads = [[3.0, 4.0], [3.0, 4.001], [0.3, 0.4], [300.0, 400.0]]
    assert _skipped_by_norm(grads, fused, rule) == [False, True, False, True]


def test_through_the_clip_the_norm_bound_is_on_the_norm_before_clipping():
    rule = SkipIf(grad_norm_above=4.0)
    assert _skipped_by_norm([[3.0, 4.0], [0.3, 0.4]], False, rule, clip=1.0) == [True, False]


def test_a_norm_rule_with_no_gradient_skips_nothing():
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))  # q never gets a gradient
    opt = torch.optim.SGD([q], lr=0.1)
    scaler = lossscale.GradScaler("cpu", skip_if=SkipIf(grad_norm_above=1.0))
    for _ in range(3):
        scaler.scale(p.sum()).backward()
        scaler.step(opt)
        scaler.update()
        assert not scaler.last_step_skipped
    assert scaler.counters()["skipped_steps"] == 0


def _spiky_scaler(rule):
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = lossscale.GradScaler("cpu", skip_if=rule)
    for g in [1.0, 1.1, 0.9, 1.0, 1.1, 0.9, 50.0]:
        opt.zero_grad()
        scaler.scale((p * g).sum()).backward()
        scaler.step(opt)
        scaler.update()
    return p, opt, scaler


def test_a_loaded_checkpoints_spike_count_is_there_before_the_first_step():
    rule = SkipIf(grad_norm_zscore=3.0, min_steps=4)
    _, _, scaler = _spiky_scaler(rule)
    assert scaler.last_step_skipped
    resumed = lossscale.GradScaler("cpu", skip_if=rule)
    resumed.load_state_dict(scaler.state_dict())
    assert resumed.counters()["spike_steps"] == scaler.counters()["spike_steps"] >= 1


@pytest.mark.parametrize(
    "entry",
    [
        {"norms": [0.0] * 128},  # keys missing
        {"norms": [0.0] * 3, "losses": [0.0] * 128, "count": 0, "spikes": 0},  # one window's length
        {"norms": [0.0] * 128, "losses": [0.0] * 3, "count": 0, "spikes": 0},
    ],
)
def test_a_checkpoints_windows_that_do_not_fit_are_refused_at_load(entry):
    rule = SkipIf(loss_zscore=3.0)
    scaler = lossscale.GradScaler("cpu", skip_if=rule)
    saved = scaler.state_dict()
    saved["skip_if"] = [entry]
    before = scaler.state_dict()
    with pytest.raises(ValueError, match="skip_if"):
        scaler.load_state_dict(saved)
    assert scaler.state_dict() == before


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_copied_scaler_keeps_the_windows(how):
    import copy
    import pickle

    rule = SkipIf(grad_norm_zscore=3.0, min_steps=4)
    p, opt, scaler = _spiky_scaler(rule)
    twin = pickle.loads(pickle.dumps(scaler)) if how == "pickle" else copy.deepcopy(scaler)
    assert twin.state_dict()["skip_if"] == scaler.state_dict()["skip_if"]
    assert twin.counters()["spike_steps"] == scaler.counters()["spike_steps"]
    for g, spike in ((1.0, False), (40.0, True)):  # the copy judges against the clean window
        opt.zero_grad()
        twin.scale((p * g).sum()).backward()
        twin.step(opt)
        twin.update()
        assert twin.last_step_skipped is spike


def test_a_discarded_iteration_leaves_the_spike_rule_working():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = lossscale.GradScaler("cpu", skip_if=SkipIf(grad_norm_above=10.0))
    scaler.scale((p * 100.0).sum()).backward()
    scaler.unscale_(opt)  # judged a spike, then dropped
    scaler.discard_iteration()
    for g, spike in ((1.0, False), (100.0, True)):
        opt.zero_grad()
        scaler.scale((p * g).sum()).backward()
        scaler.step(opt)
        scaler.update()
        assert scaler.last_step_skipped is spike


def test_without_skip_if_no_step_is_a_spike():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = lossscale.GradScaler("cpu")
    for g in (1.0, 1e4):
        opt.zero_grad()
        scaler.scale((p * g).sum()).backward()
        scaler.step(opt)
        scaler.update()
        assert not scaler.last_step_skipped
    assert "spike_steps" not in scaler.counters()
