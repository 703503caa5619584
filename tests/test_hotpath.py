"""The hot-path shortcuts agree with the pure policy: the hysteresis-1 device rule in its general form
(what a fused optimizer's device-decided step runs) and in its host-known-clean form, and the read-only
check's flags."""

import math
import random

import pytest
import torch

from lossscale import DynamicPolicy, GradScaler
from lossscale import _kernels
from lossscale._device_rules import DeviceState, _dynamic_h1_update_, _h1, device_update_


@pytest.mark.parametrize("host_view", [True, False], ids=["cpu-in-place", "kernels"])
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("bounds", [(None, None), (2.0**-2, 2.0**6)])
@pytest.mark.parametrize("interval", [1, 2, 5])
def test_h1_general_and_known_clean_forms_agree_with_pure_rule(consecutive, bounds, interval, host_view):
    policy = DynamicPolicy(init_scale=2.0**2, growth_interval=interval, hysteresis=1,
                           consecutive_hysteresis=consecutive, min_scale=bounds[0], max_scale=bounds[1])
    rng = random.Random(interval * 7 + consecutive)
    pure = policy.init_state()
    general = DeviceState(pure, torch.device("cpu"))
    shortcut = DeviceState(pure, torch.device("cpu"))
    if not host_view:  # the tensor-kernel form, which accelerators run
        h = _h1(shortcut, consecutive)
        h.host = h.tracker_host = None
    for _ in range(300):
        overflow = rng.random() < 0.3
        nan = overflow and rng.random() < 0.5
        pure = policy.update(pure, found_inf=overflow, found_nan=nan)
        fi, fn = torch.tensor(float(overflow)), torch.tensor(float(nan))
        _dynamic_h1_update_(policy, general, fi, fn)  # the device-decided form, on every step
        device_update_(policy, shortcut, fi, fn, known_clean=not overflow)  # as a host-decided loop runs it
        for st in (general, shortcut):
            got = st.to_state()
            assert got.replace(streak_start_scale=pure.streak_start_scale) == pure
            assert pure.overflow_streak == 0 or got.streak_start_scale == pure.streak_start_scale


def test_found_inf_as_a_sum_of_device_flags_counts_once():
    # torch's convention: found_inf is a sum over devices (2.0 here); the rule must count one overflow.
    policy = DynamicPolicy(init_scale=2.0**4, growth_interval=3, hysteresis=1, min_scale=None, max_scale=None)
    st = DeviceState(policy.init_state(), torch.device("cpu"))
    _dynamic_h1_update_(policy, st, torch.tensor(2.0), torch.tensor(1.0))
    s = st.to_state()
    assert (s.skipped_steps, s.nan_steps, s.inf_steps, s.overflow_streak, s.scale) == (1, 1, 0, 1, 8.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_read_only_check_flags_and_amax_per_tensor(dtype):
    grads = [torch.randn(n).to(dtype) for n in (1, 7, 1000, 4099)]
    before = [g.clone() for g in grads]
    grads[1][3] = -math.inf
    grads[2][999] = math.nan
    grads[3][0] = math.inf
    grads[3][1] = -math.inf
    vectors, amax = _kernels.amax_per_tensor(_kernels.group_grads(grads), torch.device("cpu"))
    values = torch.cat(vectors).tolist()
    assert values[0] == before[0].abs().max().float().item()
    assert values[1] == math.inf and math.isnan(values[2]) and values[3] == math.inf
    found_inf, found_nan = _kernels.flags_from_amax(amax)
    assert (found_inf.item(), found_nan.item()) == (1.0, 1.0)
    found_inf, found_nan = _kernels.flags_from_amax(torch.cat(vectors)[[0, 1, 3]].max())
    assert (found_inf.item(), found_nan.item()) == (1.0, 0.0)
    found_inf, found_nan = _kernels.flags_from_amax(torch.tensor(3.0e38))
    assert (found_inf.item(), found_nan.item()) == (0.0, 0.0)
    # Nothing was written.
    assert torch.equal(grads[0], before[0])


def test_a_copied_state_does_not_write_through_the_originals_views():
    import copy

    policy = DynamicPolicy(init_scale=2.0**4, growth_interval=2, hysteresis=1, min_scale=None, max_scale=None)
    st = DeviceState(policy.init_state(), torch.device("cpu"))
    zero = torch.zeros(())
    device_update_(policy, st, zero, zero, known_clean=True)
    twin = copy.deepcopy(st)
    device_update_(policy, twin, zero, zero, known_clean=True)
    assert st.to_state().steps == 1 and twin.to_state().steps == 2


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
    assert scaler.overflow_report() == {"inf": ["p2"], "nan": ["p1"]}
