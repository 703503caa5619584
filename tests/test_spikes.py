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
    ],
)
def test_a_rule_that_cannot_work_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SkipIf(**kwargs)
    with pytest.raises(ValueError, match="skip_if=3"):
        lossscale.GradScaler(skip_if=3)


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
