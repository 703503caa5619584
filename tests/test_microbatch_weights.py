"""Token-weighted micro-batches: ``scaler.scale(loss, weight=n_tokens)`` with ``bad_microbatch="drop"``.

A loop that takes the token-mean over the step (each micro-batch's summed token loss divided by the
step's token count) gives each micro-batch's token count; dropping a bad one renormalises by the kept
tokens. Each test runs the accumulated step twice with torch's real optimizers: through the drop, and as
the reference, a plain step over the good micro-batches alone (their token-mean), and requires the same
weights to rounding (the kept share is not a power of two).
"""

import math

import pytest
import torch
from _sync import count_host_syncs

import lossscale

OPTIMIZERS = {
    "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
}

TOKENS = [3, 9, 1, 6]  # tokens per micro-batch: they differ, so a mean over micro-batches is not the token-mean
BAD = 1  # the micro-batch with a NaN (9 of the 19 tokens)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _batches(bad=(BAD,)):
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, 8, generator=g) for n in TOKENS]
    for i in bad:
        xs[i][0, 3] = math.nan
    return xs


def _token_loss_sum(model, x):
    return model(x).float().pow(2).sum()  # summed over the micro-batch's tokens


def _run(optimizer, xs, steps=3, weights=True, mode="drop"):
    """``steps`` accumulated steps over ``xs``, each loss divided by the step's token count."""
    model = _model()
    opt = OPTIMIZERS[optimizer](model.parameters())
    scaler = lossscale.GradScaler(bad_microbatch=mode, init_scale=2.0**10)
    tokens = sum(len(x) for x in xs)
    for _ in range(steps):
        opt.zero_grad()
        for x in xs:
            loss = _token_loss_sum(model, x) / tokens
            scaler.scale(loss, weight=len(x) if weights else None).backward()
        scaler.step(opt)
        scaler.update()
    return model, scaler


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_dropped_micro_batch_leaves_the_token_mean_over_the_others(optimizer):
    xs = _batches()
    dropped, scaler = _run(optimizer, xs)
    reference, ref_scaler = _run(optimizer, [x for i, x in enumerate(xs) if i != BAD], weights=False, mode="skip")
    for a, b in zip(dropped.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)  # the kept share 10/19 rounds once more
    counters = scaler.counters()
    assert counters["skipped_steps"] == 0 and counters["dropped_microbatches"] == 3
    assert counters["dropped_weight"] == 3 * TOKENS[BAD]
    assert scaler.get_scale() == ref_scaler.get_scale()
    if optimizer.startswith("Adam"):
        return  # Adam's step is nearly blind to a constant factor on the gradient; SGD's is not:
    # renormalised by micro-batches (3 of 4 kept) instead of tokens (10 of 19), the step is another one.
    by_count, _ = _run(optimizer, xs, weights=False)
    assert max((a - b).abs().max().item() for a, b in zip(by_count.parameters(), reference.parameters())) > 1e-4


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_kept_micro_batches_of_weight_0_give_a_taken_step_of_zero_gradients(optimizer):
    # The kept micro-batches hold no tokens (weight 0, gradients zeros), the dropped one holds them all:
    # nothing is left to renormalise, so the step is taken on zero gradients, as torch's optimizer takes it.
    model = _model()
    opt = OPTIMIZERS[optimizer](model.parameters())
    scaler = lossscale.GradScaler(bad_microbatch="drop", init_scale=2.0**10)
    xs = [torch.empty(0, 8), _batches()[BAD], torch.empty(0, 8)]
    for x in xs:
        scaler.scale(_token_loss_sum(model, x) / TOKENS[BAD], weight=len(x)).backward()
    scaler.step(opt)
    scaler.update()
    reference = _model()
    ref_opt = OPTIMIZERS[optimizer](reference.parameters())
    for p in reference.parameters():
        p.grad = torch.zeros_like(p)
    ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    assert not scaler.last_step_skipped and scaler.get_scale() == 2.0**10
    assert scaler.counters()["dropped_weight"] == TOKENS[BAD] and scaler.counters()["dropped_microbatches"] == 1


def test_a_weight_is_any_finite_share_at_least_0_and_an_integer_one_stays_exact():
    model = _model()
    scaler = lossscale.GradScaler(bad_microbatch="drop")
    nan_loss = _token_loss_sum(model, _batches()[BAD])
    for weight in (0, 2**53 + 1, torch.tensor(2**53 + 1)):
        scaler.scale(nan_loss, weight=weight)  # accepted, and dropped
    state = scaler.state_dict()
    assert state["dropped_weight"] == 2**54 + 2 and type(state["dropped_weight"]) is int  # exact past 2**53
    halves = lossscale.GradScaler(bad_microbatch="drop")
    halves.scale(nan_loss, weight=0.5)  # a share below 1 is a share too
    assert halves.counters()["dropped_weight"] == 0.5
    for saved in (0, 0.5, 2**53 + 1):
        fresh = lossscale.GradScaler(bad_microbatch="drop")
        fresh.load_state_dict(dict(state, dropped_weight=saved))
        value = fresh.counters()["dropped_weight"]
        assert value == saved and type(value) is type(saved)
    for saved in (True, math.inf, math.nan, -0.5, "3"):
        with pytest.raises(ValueError, match="dropped_weight"):
            fresh.load_state_dict(dict(state, dropped_weight=saved))
        assert fresh.counters()["dropped_weight"] == 2**53 + 1  # refused before anything changed


def test_nothing_dropped_leaves_the_arithmetic_untouched():
    xs = _batches(bad=())
    weighted, _ = _run("AdamW fused", xs)
    plain, _ = _run("AdamW fused", xs, weights=False, mode="skip")
    assert all(torch.equal(a, b) for a, b in zip(weighted.parameters(), plain.parameters()))


def test_the_dropped_weight_is_counted_reported_and_checkpointed():
    _, scaler = _run("SGD momentum", _batches(), steps=2)
    assert scaler.metrics()["dropped_weight"] == 18 and scaler.counters()["dropped_weight"] == 18
    report = scaler.health()
    assert report.dropped_weight == 18 and "renormalised by their weights (18 of it dropped)" in report.text
    state = scaler.state_dict()
    assert state["dropped_weight"] == 18 and state["dropped_microbatches"] == 2
    fresh = lossscale.GradScaler(bad_microbatch="drop", init_scale=2.0**10)  # the saved run's settings
    fresh.load_state_dict(state)
    assert fresh.counters()["dropped_weight"] == 18
    del state["dropped_weight"]  # a checkpoint from before weights: its micro-batches are its weight
    fresh.load_state_dict(state)
    assert fresh.counters()["dropped_weight"] == 2
    with pytest.raises(ValueError, match="dropped_weight"):
        fresh.load_state_dict(dict(state, dropped_weight=-1))
    assert fresh.counters()["dropped_weight"] == 2  # validated before anything changed
    # Without weights the weight is the micro-batch count, and the text says nothing more.
    _, plain = _run("SGD momentum", _batches(), steps=1, weights=False)
    assert plain.counters()["dropped_weight"] == 1 and "renormalised" not in plain.health().text


def test_bad_weights_name_themselves_and_change_nothing():
    loss = _model()(torch.randn(2, 8)).sum()
    with pytest.raises(ValueError, match="bad_microbatch='drop'"):
        lossscale.GradScaler().scale(loss, weight=3)
    scaler = lossscale.GradScaler(bad_microbatch="drop")
    for weight in (-1, math.nan, math.inf, True, "3", torch.ones(2)):
        with pytest.raises(ValueError, match="weight"):
            scaler.scale(loss, weight=weight)
    with pytest.raises(ValueError, match="one loss tensor"):
        scaler.scale([loss], weight=3)
    scaler.scale(loss, weight=torch.tensor(3))  # a 1-element tensor is read
    with pytest.raises(ValueError, match="every micro-batch of an iteration gives a weight, or none does"):
        scaler.scale(loss)
    assert scaler._microbatches.total == 1  # the refused call counted nothing
    assert lossscale.GradScaler(enabled=False).scale(loss, weight=3) is loss


def test_a_weight_costs_no_host_read_beyond_the_drops_own():
    model = _model()
    scaler = lossscale.GradScaler(bad_microbatch="drop")
    xs = _batches(bad=())
    losses = [_token_loss_sum(model, x) for x in xs]
    with count_host_syncs() as syncs:
        for loss, x in zip(losses, xs):
            scaler.scale(loss, weight=len(x))
    assert syncs.count == len(xs)  # the drop's one read per micro-batch, as without weights
