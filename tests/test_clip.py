"""GradScaler.clip_grad_norm_: bitwise torch's unscale_ + clip_grad_norm_, and where that ends.

The contract (lossscale._check.clip_scaled_): with a power-of-two scale S, the gradients after clipping, the returned
norm, the parameters and the optimizer state equal torch's two-step recipe bit for bit, as long as no
value on either path leaves float32's normal range. The planted cases below show both sides of each
limit, so the condition in the docs is a measured one.
"""

import math
import warnings

import pytest
import torch
from _models import TORCH_LIKE, backward, inject, make_optimizer, params_equal, states_equal, tiny_mlp, twins

import lossscale

S = 2.0**16


# ---------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("kind", ["sgd", "adam", "fused_adam"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
def test_training_run_is_bitwise_torch_two_step(kind, norm_type):
    model_t, model_l = twins(1)
    opt_t, opt_l = make_optimizer(kind, model_t.parameters()), make_optimizer(kind, model_l.parameters())
    cfg = dict(init_scale=S, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ref = torch.amp.GradScaler("cpu", **cfg)
    ours = lossscale.GradScaler("cpu", **cfg, **TORCH_LIKE)
    skipped = 0
    for step in range(25):
        norms = []
        for model, opt, scaler in ((model_t, opt_t, ref), (model_l, opt_l, ours)):
            opt.zero_grad(set_to_none=True)
            backward(model, scaler, step, loss_mult=4.0)
            bad = inject(model, step, rate=0.2, seed=2)
            if scaler is ref:
                scaler.unscale_(opt)
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type))
            else:
                norms.append(scaler.clip_grad_norm_(opt, 0.5, norm_type))
            grads = [p.grad.clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            if scaler is ref:
                ref_grads = grads
        if math.isfinite(norms[0].item()) and not bad:
            assert torch.equal(norms[0], norms[1]), step
            assert all(torch.equal(a, b) for a, b in zip(ref_grads, grads)), step
        else:
            skipped += 1
            assert not math.isfinite(norms[1].item())
        assert ref.get_scale() == ours.get_scale(), step
        assert params_equal(model_t, model_l), step
        assert states_equal(opt_t, opt_l), step
    assert skipped > 0 and ours.skipped_steps == skipped


def _after_a_scaled_backward(optimizer: str):
    """A tiny model, its ``optimizer`` and a default scaler, one scaled backward done."""
    model = tiny_mlp()
    opt = make_optimizer(optimizer, model.parameters())
    scaler = lossscale.GradScaler()
    backward(model, scaler, 0)
    return model, opt, scaler


def test_stage_becomes_unscaled_and_step_uses_unscaled_gradients():
    model, opt, scaler = _after_a_scaled_backward("fused_adam")
    scaler.clip_grad_norm_(opt, 1.0)
    assert scaler._per_optimizer_states[id(opt)]["stage"] is lossscale.OptState.UNSCALED
    with pytest.raises(RuntimeError, match="already"):
        scaler.clip_grad_norm_(opt, 1.0)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.update()
    backward(model, scaler, 1)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscales the gradients itself"):
        scaler.clip_grad_norm_(opt, 1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_norm=-1.0), "max_norm"),
        (dict(max_norm=float("nan")), "max_norm"),
        (dict(max_norm=True), "max_norm"),
        (dict(max_norm=1.0, norm_type=0), "norm_type"),
        (dict(max_norm=1.0, norm_type=-2.0), "norm_type"),
        (dict(max_norm=1.0, norm_type=-math.inf), "norm_type"),
        (dict(max_norm=1.0, norm_type=True), "norm_type"),
        (dict(max_norm=1.0, norm_type="2"), "norm_type"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    model, opt, scaler = _after_a_scaled_backward("sgd")
    with pytest.raises(ValueError, match=match):
        scaler.clip_grad_norm_(opt, **kwargs)


def test_max_norm_zero_is_accepted_and_zeroes_every_gradient_as_torchs():
    """Kills: the max_norm check refusing 0 (torch clips everything to zero then)."""
    model, opt, scaler = _after_a_scaled_backward("sgd")
    scaler.clip_grad_norm_(opt, 0.0)
    assert all(torch.equal(p.grad, torch.zeros_like(p.grad)) for p in model.parameters())


def test_before_scale_raises_and_disabled_is_torch_clip():
    model = tiny_mlp()
    opt = make_optimizer("sgd", model.parameters())
    with pytest.raises(RuntimeError, match="before scale"):
        lossscale.GradScaler().clip_grad_norm_(opt, 1.0)
    twin = tiny_mlp()
    for m in (model, twin):
        torch.nn.functional.mse_loss(m(torch.ones(2, 8)), torch.zeros(2, 4)).backward()
    off = lossscale.GradScaler(enabled=False)
    got = off.clip_grad_norm_(opt, 0.1)
    want = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.1)
    assert torch.equal(got, want) and params_equal(model, twin)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), twin.parameters()))


# ---------------------------------------------------------------------------------------------- overflow
@pytest.mark.parametrize("kind", ["sgd", "fused_adam"])
@pytest.mark.parametrize("bad", ["inf", "-inf", "nan"])
def test_non_finite_norm_skips_counts_and_keeps_inf_as_inf(kind, bad):
    model = tiny_mlp()
    opt = make_optimizer(kind, model.parameters())
    scaler = lossscale.GradScaler(model=model)
    backward(model, scaler, 0)
    before = [p.detach().clone() for p in model.parameters()]
    w = model[0].weight
    w.grad[0, 0] = float(bad)
    norm = scaler.clip_grad_norm_(opt, 1.0)
    assert math.isnan(norm.item()) if bad == "nan" else norm.item() == math.inf
    # Unscaled, not clipped: the planted value keeps its kind, finite ones are g / S.
    assert math.isnan(w.grad[0, 0].item()) if bad == "nan" else w.grad[0, 0].item() == float(bad)
    assert math.isfinite(w.grad[0, 1].item())
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    kind_counted = "nan_steps" if bad == "nan" else "inf_steps"
    assert scaler.counters()[kind_counted] == 1 and scaler.counters()["skipped_steps"] == 1
    report = scaler.overflow_report()
    assert report["nan" if bad == "nan" else "inf"] == ["0.weight"]


# ---------------------------------------------------------------------------------------------- planted values
def _both(values, max_norm=1.0, scale=S, norm_type=2.0):
    """One clip of the same scaled gradient vector by torch's two steps and by ours."""
    pt, pl = torch.nn.Parameter(torch.zeros(len(values))), torch.nn.Parameter(torch.zeros(len(values)))
    ot, ol = torch.optim.SGD([pt], lr=1.0), torch.optim.SGD([pl], lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the non-power-of-two warning
        ref = torch.amp.GradScaler("cpu", init_scale=scale)
        ours = lossscale.GradScaler("cpu", init_scale=scale, **TORCH_LIKE)
    ref.scale(torch.ones(()))
    ours.scale(torch.ones(()))
    g = torch.tensor(values, dtype=torch.float32)
    pt.grad, pl.grad = g.clone(), g.clone()
    ref.unscale_(ot)
    n_t = torch.nn.utils.clip_grad_norm_([pt], max_norm, norm_type)
    n_l = ours.clip_grad_norm_(ol, max_norm, norm_type)
    return n_t, n_l, pt.grad, pl.grad


def test_planted_normal_range_values_are_bitwise_equal():
    # Every unscaled value, square and clipped product stays normal: equal bit for bit, whatever the
    # mix of magnitudes (the tiny one's square, 1.5e-40... is not: see the next test; 1e-15 is fine).
    for values in ([1e3 * S, 1.2345e-15 * S, -7.5 * S], [3.0 * S] * 5, [0.0, -(2.0**-100) * S, 1e-3 * S]):
        for norm_type in (2.0, 1.0, math.inf, 3.0):
            n_t, n_l, g_t, g_l = _both(values, norm_type=norm_type)
            assert torch.equal(n_t, n_l) and torch.equal(g_t, g_l), (values, norm_type)


def test_planted_subnormal_unscaled_gradient_can_differ_by_an_ulp():
    # g/S = 1.56e-36 * 2**-16... is subnormal (below 2**-126): torch rounds it there, then multiplies by
    # clip_coef and rounds again; we round once. The results can differ in the last subnormal bit
    # (ours is the correctly rounded g * coef / S).
    n_t, n_l, g_t, g_l = _both([189501.78224135004, 1.5658160631212768e-36], max_norm=1.0)
    assert torch.equal(n_t, n_l)  # the norm is dominated by the normal value
    assert g_t[0] == g_l[0] and g_t[1] != g_l[1]
    exact = 1.5658160631212768e-36 / S * (1.0 / (n_t.item() + 1e-6))
    assert abs(g_l[1].item() - exact) <= abs(g_t[1].item() - exact)


def test_planted_subnormal_squares_change_the_norm_in_the_last_bit():
    # Every unscaled gradient ~1e-20: its square (1e-40) is subnormal on torch's side, normal on ours.
    values = [(1 + i * 2**-15) * 1e-20 * S for i in range(50)]
    n_t, n_l, g_t, g_l = _both(values)
    assert n_t != n_l and math.isclose(n_t.item(), n_l.item(), rel_tol=1e-6)
    assert torch.equal(g_t, g_l)  # the coefficient clamps to 1 either way


def test_planted_scaled_norm_overflow_is_an_overflow_here_not_in_torch():
    # Finite gradients whose *scaled* squares overflow float32 (S * |g| > 1.8e19): torch's unscaled norm
    # is finite, ours is inf and the step is skipped. With max_scale=2**24 this needs ||g|| > 1e12.
    n_t, n_l, _, g_l = _both([2e15 * S] * 3)
    assert math.isfinite(n_t.item()) and n_l.item() == math.inf
    assert torch.equal(g_l, torch.full((3,), 2e15))  # unscaled, not clipped


def test_non_power_of_two_scale_agrees_to_rounding_only():
    n_t, n_l, g_t, g_l = _both([1.1e3, 2.3e3, -0.7e3], scale=1000.0)
    assert torch.allclose(g_t, g_l, rtol=2e-7, atol=0) and not torch.equal(g_t, g_l)
    assert math.isclose(n_t.item(), n_l.item(), rel_tol=2e-7)


def test_mixed_dtypes_group_like_torch_passthrough():
    # Scale 1 (passthrough): ours must be torch's clip_grad_norm_ exactly, including the order in which
    # per-(device, dtype) group norms are stacked (bf16 and fp32 parameters interleaved).
    torch.manual_seed(0)
    shapes = [(7,), (3, 5), (11,), (2, 2)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    ps_t = [torch.nn.Parameter(torch.zeros(s, dtype=d)) for s, d in zip(shapes, dtypes)]
    ps_l = [torch.nn.Parameter(torch.zeros(s, dtype=d)) for s, d in zip(shapes, dtypes)]
    for a, b in zip(ps_t, ps_l):
        a.grad = torch.randn(a.shape).to(a.dtype) * 3
        b.grad = a.grad.clone()
    scaler = lossscale.GradScaler.passthrough(on_stuck="ignore")
    scaler.name_parameters([(f"p{i}", p) for i, p in enumerate(ps_l)])
    scaler.scale(torch.ones(()))
    opt = torch.optim.SGD(ps_l, lr=0.1)
    got = scaler.clip_grad_norm_(opt, 0.5)
    want = torch.nn.utils.clip_grad_norm_(ps_t, 0.5)
    assert torch.equal(got, want)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ps_t, ps_l))
    scaler.step(opt)
    scaler.update()
    # The overflow report lines parameters up with their norms whatever the grouping order.
    ps_l[3].grad[0, 0] = float("nan")
    ps_l[2].grad[0] = float("inf")
    scaler.clip_grad_norm_(opt, 0.5)
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped
    report = scaler.overflow_report()
    assert (report["inf"], report["nan"]) == (["p2"], ["p3"])


def test_sparse_gradients_are_clipped_by_the_norm_of_their_coalesced_values():
    # torch's clip_grad_norm_ rejects sparse gradients; ours coalesces them first (duplicate indices add
    # up), so the norm is the dense gradient's. Compared with a dense twin under torch's two steps.
    torch.manual_seed(0)
    emb_l = torch.nn.Embedding(10, 3, sparse=True)
    emb_t = torch.nn.Embedding(10, 3)
    emb_t.load_state_dict(emb_l.state_dict())
    idx = torch.tensor([1, 1, 4, 7, 1, 4])
    w = torch.randn(6, 3)
    ref, ours = torch.amp.GradScaler("cpu"), lossscale.GradScaler("cpu", **TORCH_LIKE)
    opt_t, opt_l = torch.optim.SGD(emb_t.parameters(), lr=0.1), torch.optim.SGD(emb_l.parameters(), lr=0.1)
    ref.scale((emb_t(idx) * w).sum()).backward()
    ours.scale((emb_l(idx) * w).sum()).backward()
    assert emb_l.weight.grad.is_sparse and not emb_l.weight.grad.is_coalesced()
    ref.unscale_(opt_t)
    n_t = torch.nn.utils.clip_grad_norm_(emb_t.parameters(), 0.5)
    n_l = ours.clip_grad_norm_(opt_l, 0.5)
    assert torch.equal(n_t, n_l)
    assert torch.equal(emb_t.weight.grad, emb_l.weight.grad.to_dense())


def test_adaptive_policy_learns_through_the_clip_path():
    # The clip path must feed the policy the scaled-gradient amax, as unscale_ does: the same run
    # with scaler.clip_grad_norm_ and with unscale_ + torch's clip gives the same scales and weights.
    a, b = twins(5)
    oa, ob = make_optimizer("sgd", a.parameters()), make_optimizer("sgd", b.parameters())
    sa = lossscale.GradScaler(policy="adaptive", growth_interval=3)
    sb = lossscale.GradScaler(policy="adaptive", growth_interval=3)
    scales = []
    for step in range(12):
        for model, opt, scaler, fused in ((a, oa, sa, True), (b, ob, sb, False)):
            opt.zero_grad()
            backward(model, scaler, step)
            if fused:
                scaler.clip_grad_norm_(opt, 1.0)
            else:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        assert sa.get_scale() == sb.get_scale(), step
        scales.append(sa.get_scale())
    assert scales[0] != 2.0**16 or len(set(scales)) > 1  # the policy calibrated / moved
    assert params_equal(a, b)


# ------------------------------------------------------------------------- sharded: what a rank counts
def _grads(seed=5):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(6, 4, generator=g) * S, torch.randn(5, generator=g) * S
    return a, b


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
def test_a_copy_another_rank_counts_is_left_out_of_the_norm_and_clipped_alike(norm_type):
    # [a, b, copy of a] with the copy not counted, "reduced" by the identity: the norm of [a, b],
    # bit for bit, and all three clipped by its coefficient (one all-reduce would add other ranks).
    from lossscale._check import clip_scaled_, inverse

    a, b = _grads()
    grads = [a.clone(), b.clone(), a.clone()]
    pair = [a.clone(), b.clone()]
    scale = torch.tensor(S)
    seen = []
    norm, total, _, _ = clip_scaled_(
        grads, scale, inverse(scale), 1.0, norm_type, [True, True, False], lambda local: seen.append(local) or local
    )
    ref_norm, ref_total, _, _ = clip_scaled_(pair, scale, inverse(scale), 1.0, norm_type)
    assert len(seen) == 1 and torch.equal(norm, ref_norm) and torch.equal(total, ref_total)
    assert torch.isfinite(total)  # the check: no overflow
    assert torch.equal(grads[0], pair[0]) and torch.equal(grads[1], pair[1]) and torch.equal(grads[2], pair[0])
    # Every tensor counted: the reduction sees this rank's whole norm, the unsharded path's bits.
    again = [a.clone(), b.clone()]
    assert torch.equal(
        clip_scaled_(again, scale, inverse(scale), 1.0, norm_type, [True, True], lambda t: t)[0], ref_norm
    )
    assert all(torch.equal(x, y) for x, y in zip(again, pair))


@pytest.mark.parametrize("bad", ["inf", "nan"])
def test_a_non_finite_value_in_an_uncounted_copy_still_reaches_the_norm(bad):
    # Copies should agree; one that does not is a fault, and the total says so on every rank (as
    # torch's DTensor norm does), while this rank's flags skip the step.
    from lossscale._check import clip_scaled_, inverse

    a, b = _grads()
    copy = a.clone()
    copy[1, 2] = float(bad)
    grads = [a.clone(), b.clone(), copy]
    scale = torch.tensor(S)
    norm, total, _, _ = clip_scaled_(grads, scale, inverse(scale), 1.0, 2.0, [True, True, False], lambda t: t)
    assert math.isnan(norm.item()) if bad == "nan" else math.isinf(norm.item())
    assert math.isnan(total.item()) == (bad == "nan") and not math.isfinite(total.item())  # the check's flags
    assert torch.equal(grads[0], a / S) and torch.equal(grads[1], b / S)  # unscaled, not clipped


def test_clipping_no_gradients_gives_a_zero_norm_and_changes_nothing():
    """A rank or an optimizer without gradients: the norm is 0 (torch's too), on the scale's device, and
    nothing is multiplied; the zeros are float32 under any default dtype. Kills: torch's grouping asked of an
    empty list (it raises), the zeros' dtype left to the default."""
    from lossscale._check import clip_scaled_

    scale = torch.tensor(2.0**16)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the zeros are float32 whatever the default (the flag contract)
    try:
        true_norm, total, per_tensor, order = clip_scaled_([], scale, scale.reciprocal(), 1.0, 2.0)
    finally:
        torch.set_default_dtype(default)
    assert true_norm.item() == 0.0 and total.item() == 0.0 and per_tensor.numel() == 0 and order == []
    assert total.dtype == per_tensor.dtype == torch.float32
    assert torch.nn.utils.clip_grad_norm_([], 1.0).item() == 0.0
