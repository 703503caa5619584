"""The gradient check (``lossscale._check``): the read-only pass's per-tensor max|g| with every device
type's kernel, the flags it gives, flags combined by a maximum (never a sum), and the report's names
where gradients of several dtypes interleave. (The clip is tested in test_clip.py, the state the flags
feed in test_state.py.)"""

import math

import pytest
import torch

from lossscale import GradScaler, _check
from lossscale._check import combine, found_inf

CPU = torch.device("cpu")
KERNELS = [_check._amax_aminmax, _check._amax_foreach_norm]


def test_flags_of_several_checks_combine_to_one_not_a_sum():
    # The flag contract: 0.0 or 1.0 whatever is combined; torch's fused kernels skip only on found_inf == 1.0.
    def flags(inf, nan=False, bad=False, amax=None, spike=None):
        return _check.Flags(
            torch.tensor(bool(inf)),
            torch.tensor(nan),
            torch.tensor(bad),
            None if spike is None else torch.tensor(spike),
            None if amax is None else torch.tensor(amax),
        )

    f = combine([flags(1, True), flags(1), flags(0, amax=3.0), flags(0, amax=5.0)], CPU)
    assert (found_inf(f).item(), f.nan.item(), f.bad_loss.item(), f.amax.item()) == (1.0, True, False, 5.0)
    f = combine([flags(0), flags(0, bad=True)], CPU)
    assert (found_inf(f).item(), f.overflow.item(), f.bad_loss.item(), f.amax) == (1.0, False, True, None)
    f = combine([flags(0, spike=True), flags(0, spike=True)], CPU)
    assert (found_inf(f).item(), f.overflow.item(), f.spike.item()) == (1.0, False, True)
    assert found_inf(f).dtype == torch.float32


def test_a_finite_spike_skips_without_being_an_overflow():
    # One notion of a skip, with its reason: a spike skips the step, and it is no overflow for the scale.
    check = _check.GradientCheck(lambda p: None, None)
    no = torch.tensor(False)
    flags = check.flags(no, no, no, spike=torch.tensor(True), sync=True)
    assert flags.skipped is True and flags.skip.item() and not flags.overflow.item()
    assert found_inf(flags).item() == 1.0  # what a fused optimizer reads: it skips


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_read_only_pass_gives_max_abs_per_tensor_nan_and_negative_inf_included(dtype, kernel, monkeypatch):
    # Every device type's kernel, run here on CPU tensors: the same values, NaN and -inf included. The
    # last tensor stays finite: its max|g| is no other norm of it (kills a kernel taking the 2-norm).
    monkeypatch.setitem(_check.AMAX_KERNELS, "cpu", kernel)
    grads = [torch.randn(n).to(dtype) for n in (1, 7, 1000, 4099, 300)]
    before = [g.clone() for g in grads]
    grads[1][3] = -math.inf
    grads[2][999] = math.nan
    grads[3][0] = math.inf
    grads[3][1] = -math.inf
    vectors, amax, order = _check.largest_magnitudes(grads, CPU)
    assert order == [0, 1, 2, 3, 4]
    values = torch.cat(vectors).tolist()
    assert values[0] == before[0].abs().max().float().item()
    assert values[4] == before[4].abs().max().float().item()
    assert values[1] == math.inf and math.isnan(values[2]) and values[3] == math.inf
    assert math.isnan(amax.item())  # the overall max keeps the NaN
    assert torch.cat(vectors)[[0, 1, 3]].max().item() == math.inf
    assert torch.equal(grads[0], before[0])  # nothing was written


@pytest.mark.parametrize(
    "worst, bad_loss, expected",
    [
        (3.0e38, False, (0.0, False)),
        (math.inf, False, (1.0, False)),
        (math.nan, False, (1.0, True)),
        (1.0, True, (1.0, False)),
        (math.nan, True, (1.0, True)),
    ],
    ids=["clean, near float32's max", "inf", "nan", "bad loss", "bad loss and nan"],
)
def test_the_flags_from_the_worst_value_and_the_loss_check(worst, bad_loss, expected):
    check = _check.GradientCheck(lambda p: None, None)
    worst = torch.tensor(worst)
    flags = check.flags(~torch.isfinite(worst), torch.isnan(worst), torch.tensor(bad_loss), sync=True)
    assert (found_inf(flags).item(), flags.nan.item()) == expected
    assert found_inf(flags).dtype == torch.float32 and flags.skipped == bool(expected[0])


def test_the_accelerator_kernel_launches_a_constant_number_of_ops():
    # The kernel CUDA uses must not launch per parameter (hundreds of launches per step); CPU's does,
    # where per-tensor aminmax was measured fastest. Counted as a device would see them (the CPU
    # standing for it: views launch nothing).
    from _sync import count_device_work

    def launches(kernel, n):
        grads = [torch.randn(5) for _ in range(n)]
        with count_device_work() as work:
            kernel(grads)
        return work.launches

    assert _check.AMAX_KERNELS.get("cuda", _check._amax_foreach_norm) is _check._amax_foreach_norm
    assert launches(_check._amax_foreach_norm, 4) == launches(_check._amax_foreach_norm, 400)
    assert launches(_check._amax_aminmax, 400) > launches(_check._amax_aminmax, 4)


@pytest.mark.parametrize("kind", ["sgd", "fused_adam"])
def test_overflow_report_names_the_right_parameter_when_dtypes_interleave(kind):
    # Gradients are checked per (device, dtype) group; the report must map each amax back to its
    # parameter (fp32, bf16, fp32: the bf16 one sits between the two fp32 ones in parameter order).
    ps = [torch.nn.Parameter(torch.zeros(3, dtype=d)) for d in (torch.float32, torch.bfloat16, torch.float32)]
    for p in ps:
        p.grad = torch.ones_like(p)
    opt = torch.optim.SGD(ps, lr=0.1) if kind == "sgd" else torch.optim.Adam(ps, fused=True)
    scaler = GradScaler.passthrough(on_stuck="ignore")  # bf16 gradients: scale 1, no unscale pass
    scaler.name_parameters([(f"p{i}", p) for i, p in enumerate(ps)])
    scaler.scale(torch.ones(()))
    ps[1].grad[0] = math.nan
    ps[2].grad[1] = math.inf
    scaler.step(opt)
    scaler.update()
    report = scaler.overflow_report()
    assert (report["inf"], report["nan"]) == (["p2"], ["p1"])


def test_the_read_only_pass_of_no_gradients_is_a_float32_zero():
    """No gradients (a rank holding only empty shards): no vectors, and an amax of 0.0 as a float32 0-dim
    tensor, the flag contract's dtype, whatever torch's default dtype. Kills: that zero's shape, its
    dtype left to the default."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        vectors, amax, order = _check.largest_magnitudes([], CPU)
    finally:
        torch.set_default_dtype(default)
    assert vectors == [] and order == []
    assert amax.shape == () and amax.dtype == torch.float32 and amax.item() == 0.0


def test_the_overall_max_spans_every_dtype_group():
    """Kills: the overall maximum taken of the first (device, dtype) group alone."""
    grads = [torch.tensor([1.0, -2.0]), torch.tensor([3.0, -8.0], dtype=torch.bfloat16)]
    vectors, amax, order = _check.largest_magnitudes(grads, CPU)
    assert len(vectors) == 2 and order == [0, 1] and amax.item() == 8.0


def test_gradients_unscaled_twice_are_refused_naming_them():
    """Two optimizer objects over the same parameters (a wrapper and its inner optimizer): the second
    unscale is refused before anything changes, naming the parameters (by name where the scaler knows
    it, else by shape). Kills: the overlap lost, the names or shapes dropped from the message."""
    named, unnamed, other = torch.zeros(2, 3), torch.zeros(4), torch.zeros(1)
    check = _check.GradientCheck(lambda p: "encoder.weight" if p is named else None, None)
    gathered = _check.Gathered([named, unnamed, other], [torch.ones(2, 3), torch.ones(4), torch.ones(1)])
    unscaled = {id(named), id(unnamed)}
    with pytest.raises(
        RuntimeError,
        match=r"^2 gradient\(s\) were already unscaled in this iteration \(encoder\.weight, param \(4,\)\)",
    ):
        check.claim(gathered, unscaled)
    assert unscaled == {id(named), id(unnamed)}
    fresh = set()
    check.claim(gathered, fresh)
    assert fresh == {id(named), id(unnamed), id(other)}


def test_combined_flags_know_the_host_decision_when_every_check_does():
    """Kills: the combined host decision dropped (it would then be read from the device again: a sync)."""

    def flags(skip, skipped):
        return _check.Flags(torch.tensor(skip), torch.tensor(False), torch.tensor(False), skipped=skipped)

    assert combine([flags(False, False), flags(True, True)], CPU).skipped is True
    assert combine([flags(False, False), flags(False, False)], CPU).skipped is False
    assert combine([flags(False, False), flags(True, None)], CPU).skipped is None


def test_fp16_gradients_are_refused_all_named_and_counted():
    """Every FP16 gradient of a group is counted and named in the refusal, not the first one alone."""
    params = [torch.nn.Parameter(torch.zeros(2, dtype=torch.float16)) for _ in range(3)]
    for p in params:
        p.grad = torch.ones(2, dtype=torch.float16)
    opt = torch.optim.SGD(params, lr=1.0)
    check = _check.GradientCheck(lambda p: None, process_group=None)
    with pytest.raises(ValueError, match=r"^3 parameter\(s\) have FP16 gradients \(param_groups\[0\]\[0\].*\[0\]\[2\]"):
        check.gather(opt, allow_half=False)


@pytest.mark.parametrize("bad_in", ["first", "last"])
@pytest.mark.parametrize("unscale_first", [False, True])
def test_two_host_decided_optimizers_an_overflow_in_either_skips_the_iteration(bad_in, unscale_first):
    # Two optimizers at torch's defaults (for-loop on CPU: the host decides each skip). An inf in
    # either one's gradients makes the iteration a skipped one for what asks after update():
    # last_step_skipped, on_step's callback, and step_scheduler of the optimizer that overflowed (its
    # LR stays). (Whether the other optimizer's scheduler steps is not what this test is about.)
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.full((2,), 2.0))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.1), torch.optim.AdamW([b], lr=0.1)
    bad_opt = opt_a if bad_in == "first" else opt_b
    sched = torch.optim.lr_scheduler.StepLR(bad_opt, step_size=1, gamma=0.5)
    scaler = GradScaler("cpu")
    taken = []
    scaler.on_step(taken.append)
    for step in range(3):
        opt_a.zero_grad()
        opt_b.zero_grad()
        scaler.scale(a.sum() * 2 + b.sum() * 3).backward()
        if step == 1:
            bad_opt.param_groups[0]["params"][0].grad[0] = math.inf
        if unscale_first:
            scaler.unscale_(opt_a)
        scaler.step(opt_a)
        scaler.step(opt_b)
        scaler.update()
        assert scaler.last_step_skipped is (step == 1), step
        assert scaler.step_scheduler(sched) is (step != 1), step
    assert taken == [True, False, True]
    assert bad_opt.param_groups[0]["lr"] == 0.1 * 0.25
    assert scaler.counters()["skipped_steps"] == 1
