"""A bad micro-batch costs only itself (issue 33): ``GradScaler(bad_microbatch="drop")``.

Each test runs the accumulated step twice with torch's real optimizers: once with every micro-batch
(some of them bad) through the drop, and once as the reference, a plain step over the good micro-batches
alone, and requires the same weights: to rounding with "drop" (its renormalisation, kept/total, is not a
power of two), bitwise with "zero" (nothing is renormalised).
"""

import copy
import math

import pytest
import torch
from _sync import count_host_syncs

import lossscale

OPTIMIZERS = {
    "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "Adam foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "SGD fused": lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True),
}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _batches(n, bad, kind="nan"):
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 8, generator=g) for _ in range(n)]
    for i in bad:
        xs[i][1, 3] = math.nan if kind == "nan" else 1e5  # finite in FP32, inf once autocast casts it to FP16
    return xs


def _loss(model, x, fp16):
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        return model(x).float().pow(2).mean()


def _step(scaler, model, opt, xs, divide_by, clip=False, fp16=False):
    opt.zero_grad()
    for x in xs:
        scaler.scale(_loss(model, x, fp16) / divide_by).backward()
    if clip:
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()


def _run(mode, optimizer, xs, divide_by, steps=3, clip=False, fp16=False, **kw):
    model = _model()
    opt = OPTIMIZERS[optimizer](model.parameters())
    scaler = lossscale.GradScaler(bad_microbatch=mode, init_scale=2.0**10, **kw)
    for _ in range(steps):
        _step(scaler, model, opt, xs, divide_by, clip, fp16)
    return model, scaler


@pytest.mark.parametrize("clip", [False, True], ids=["step", "clip"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_dropped_micro_batch_leaves_the_step_over_the_others(optimizer, clip):
    xs = _batches(4, bad=[1])
    dropped, scaler = _run("drop", optimizer, xs, divide_by=4, clip=clip)
    good = [x for i, x in enumerate(xs) if i != 1]
    reference, ref_scaler = _run("skip", optimizer, good, divide_by=3, clip=clip)
    for a, b in zip(dropped.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)  # kept/total = 3/4 rounds once more
    assert scaler.counters()["skipped_steps"] == 0 and scaler.counters()["dropped_microbatches"] == 3
    assert scaler.get_scale() == ref_scaler.get_scale()  # the scale never saw the bad micro-batch


@pytest.mark.parametrize("bad", [[0, 1, 3], [0, 2]], ids=["1 of 4 kept", "2 of 4 kept"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_one_or_half_of_the_micro_batches_kept_is_the_step_over_them_bitwise(optimizer, bad):
    # Kept shares of 1/4 and 1/2 are powers of two: the renormalised step is the plain one, bit for bit.
    xs = _batches(4, bad=bad)
    dropped, scaler = _run("drop", optimizer, xs, divide_by=4)
    good = [x for i, x in enumerate(xs) if i not in bad]
    reference, ref_scaler = _run("skip", optimizer, good, divide_by=len(good))
    assert all(torch.equal(a, b) for a, b in zip(dropped.parameters(), reference.parameters()))
    assert scaler.counters()["skipped_steps"] == 0 and scaler.counters()["dropped_microbatches"] == 3 * len(bad)
    assert scaler.get_scale() == ref_scaler.get_scale()


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_zero_drops_without_renormalising_bitwise(optimizer):
    xs = _batches(4, bad=[0, 2])
    dropped, _ = _run("zero", optimizer, xs, divide_by=4)
    reference, _ = _run("skip", optimizer, [xs[1], xs[3]], divide_by=4)
    assert all(torch.equal(a, b) for a, b in zip(dropped.parameters(), reference.parameters()))


def test_without_the_opt_in_one_bad_micro_batch_skips_the_whole_step():
    xs = _batches(4, bad=[3])
    model, scaler = _run("skip", "AdamW fused", xs, divide_by=4, steps=1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), _model().parameters()))
    assert scaler.counters()["bad_loss_steps"] == 1


def test_an_fp16_forward_overflow_in_one_micro_batch_is_dropped_under_autocast():
    xs = _batches(4, bad=[2], kind="overflow")
    dropped, scaler = _run("drop", "AdamW fused", xs, divide_by=4, fp16=True, steps=1)
    reference, _ = _run("skip", "AdamW fused", [xs[0], xs[1], xs[3]], divide_by=3, fp16=True, steps=1)
    # Each backward rounds in FP16, and the two runs' losses differ (/4 against /3): each AdamW update
    # (about lr per value) agrees to 2**-10 of its size (measured: 5e-7 at most).
    for a, b in zip(dropped.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-2 * 2**-10)
    _step(scaler, dropped, torch.optim.AdamW(dropped.parameters(), fused=True), xs, 4, fp16=True)
    report = scaler.health()
    assert report.dropped_microbatches == 2 and "2 micro-batches with a non-finite loss" in report.text
    assert scaler.metrics()["dropped_microbatches"] == 2


def test_every_micro_batch_bad_skips_the_step_and_keeps_the_scale():
    xs = _batches(3, bad=[0, 1, 2])
    model, scaler = _run("drop", "AdamW fused", xs, divide_by=3, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), _model().parameters()))
    counters = scaler.counters()
    assert counters["bad_loss_steps"] == 2 and counters["dropped_microbatches"] == 6
    assert scaler.get_scale() == 2.0**10  # a bad loss is not the scale's doing


@pytest.mark.parametrize("loss_check", [True, False])
def test_with_the_loss_check_off_an_all_bad_step_is_still_skipped(loss_check):
    xs = _batches(2, bad=[0, 1])
    model, scaler = _run("drop", "SGD momentum", xs, divide_by=2, steps=1, loss_check=loss_check)
    assert scaler.last_step_skipped
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), _model().parameters()))


def test_the_cost_is_one_host_read_per_micro_batch_and_none_without_the_opt_in():
    xs = _batches(4, bad=[])
    for mode, expected in (("skip", 0), ("drop", 4)):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = lossscale.GradScaler(bad_microbatch=mode)
        _step(scaler, model, opt, xs, 4)  # warm
        losses = [_loss(model, x, False) / 4 for x in xs]
        with count_host_syncs() as syncs:
            scaled = [scaler.scale(loss) for loss in losses]
        assert syncs.count == expected, mode
        for s in scaled:
            s.backward()
        scaler.step(opt)
        scaler.update()


def test_trace_sees_a_dropped_micro_batch_and_the_step_is_taken():
    xs = _batches(3, bad=[1], kind="overflow")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = lossscale.GradScaler(bad_microbatch="drop", model=model, trace=True)
    _step(scaler, model, opt, xs, 3, fp16=True)
    assert not scaler.last_step_skipped and scaler.counters()["dropped_microbatches"] == 1
    scaler.close()


def test_the_count_survives_a_checkpoint_and_copies():
    xs = _batches(3, bad=[0])
    _, scaler = _run("drop", "Adam foreach", xs, divide_by=3, steps=2)
    fresh = lossscale.GradScaler(bad_microbatch="drop", init_scale=2.0**10)
    fresh.load_state_dict(scaler.state_dict())
    assert fresh.counters()["dropped_microbatches"] == 2
    assert copy.deepcopy(scaler).counters()["dropped_microbatches"] == 2
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(scaler.state_dict())  # still a torch state dict


def test_bad_arguments_name_themselves_and_change_nothing():
    with pytest.raises(ValueError, match="bad_microbatch='dorp'"):
        lossscale.GradScaler(bad_microbatch="dorp")
    scaler = lossscale.GradScaler(bad_microbatch="drop")
    state = scaler.state_dict()
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="dropped_microbatches"):
            scaler.load_state_dict(dict(state, dropped_microbatches=bad))
    assert scaler.counters()["dropped_microbatches"] == 0


def test_passthrough_drops_bad_micro_batches_for_bf16():
    xs = _batches(4, bad=[1])
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = lossscale.GradScaler.passthrough(bad_microbatch="drop")
    _step(scaler, model, opt, xs, 4)
    assert not scaler.last_step_skipped and scaler.counters()["dropped_microbatches"] == 1
