"""The fused passes over gradients (``lossscale._kernels``): the read-only check's flags and per-tensor
amax with every device type's kernel, a flag that is a sum of per-device flags. (The device state they
feed is tested in test_state.py.)"""

import itertools
import math

import pytest
import torch

from lossscale import GradScaler
from lossscale import _kernels


def test_flags_of_several_devices_combine_to_one_not_a_sum():
    # The flag contract (lossscale._check): 0.0 or 1.0 whatever is combined; torch's fused kernels
    # skip only on found_inf == 1.0.
    from lossscale._check import any_flag

    one, zero = torch.ones(()), torch.zeros(())
    assert any_flag([one, one, zero], torch.device("cpu")).item() == 1.0
    assert any_flag([zero, zero], torch.device("cpu")).item() == 0.0
    assert any_flag([], torch.device("cpu")).item() == 0.0


KERNELS = sorted({*_kernels.AMAX_KERNELS.values(), _kernels.DEFAULT_AMAX_KERNEL}, key=lambda k: k.__name__)


def _flags_from_amax(amax):
    """(found_inf, found_nan) as the fused check makes them from one max|g| (``flags_of``)."""
    flags, _ = _kernels.flags_of([amax.reshape(1)], 1, None, torch.device("cpu"))
    return flags[1], flags[2]


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_read_only_check_flags_and_amax_per_tensor(dtype, kernel, monkeypatch):
    # Every device type's kernel, run here on CPU tensors: the same values, NaN and -inf included.
    monkeypatch.setitem(_kernels.AMAX_KERNELS, "cpu", kernel)
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
    found_inf, found_nan = _flags_from_amax(amax)
    assert (found_inf.item(), found_nan.item()) == (1.0, 1.0)
    found_inf, found_nan = _flags_from_amax(torch.cat(vectors)[[0, 1, 3]].max())
    assert (found_inf.item(), found_nan.item()) == (1.0, 0.0)
    found_inf, found_nan = _flags_from_amax(torch.tensor(3.0e38))
    assert (found_inf.item(), found_nan.item()) == (0.0, 0.0)
    # Nothing was written.
    assert torch.equal(grads[0], before[0])


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


def _ops(kernel, n_tensors):
    """The launches one read-only pass makes over ``n_tensors`` gradients, as a device would see them
    (``lossscale._sync``'s counter, with the CPU standing for the device: views launch nothing)."""
    from lossscale._sync import count_device_work

    grads = [torch.randn(5) for _ in range(n_tensors)]
    with count_device_work() as work:
        kernel(grads)
    return work.launches


def test_the_accelerator_kernel_launches_a_constant_number_of_ops():
    # The kernel CUDA uses must not launch per parameter (hundreds of launches per step); CPU's does,
    # where per-tensor aminmax was measured fastest (docs/performance.md).
    cuda_kernel = _kernels.amax_kernel(torch.device("cuda"))
    assert cuda_kernel is _kernels.DEFAULT_AMAX_KERNEL
    assert _ops(cuda_kernel, 4) == _ops(cuda_kernel, 400)
    assert _ops(_kernels.AMAX_KERNELS["cpu"], 400) > _ops(_kernels.AMAX_KERNELS["cpu"], 4)


def test_a_copy_to_the_cpu_that_is_read_at_once_is_blocking(monkeypatch):
    # A non_blocking device-to-CPU copy fills a pinned buffer asynchronously; a CPU kernel reading it
    # at once would race (CPU-offloaded gradients with CUDA state). to_device() blocks on copies to
    # the CPU and queues copies to an accelerator. "meta" stands in for the accelerator here.
    seen = []

    def spy(self, device, non_blocking=False):
        seen.append((str(device), non_blocking))
        return self

    monkeypatch.setattr(torch.Tensor, "to", spy)
    _kernels.to_device(torch.ones(3), torch.device("meta"))
    _kernels.to_device(torch.ones(3, device="meta"), torch.device("cpu"))
    y = torch.ones(3)
    assert _kernels.to_device(y, torch.device("cpu")) is y  # same device: no copy at all
    assert seen == [("meta", True), ("cpu", False)]


def test_a_device_without_float64_unscales_by_the_exact_float32_reciprocal(monkeypatch):
    # MPS has no float64: the reciprocal is taken in float32 there, which is exact for a power of two
    # (and equal to the float64 route torch takes elsewhere). CPU stands in for such a device here.
    from lossscale import _device

    scales = [torch.tensor(2.0**k) for k in (-20, 0, 16, 24)]
    via64 = [_device.reciprocal(s) for s in scales]
    monkeypatch.setattr(_device, "_NO_FLOAT64", ("cpu",))
    direct = [_device.reciprocal(s) for s in scales]
    assert all(torch.equal(a, b) and a.dtype == torch.float32 for a, b in zip(via64, direct))


def test_snapshots_from_a_device_without_events_are_blocking_copies(monkeypatch):
    # Only CUDA copies are queued and waited for with an event; elsewhere (XPU, MPS, ...) the copy
    # blocks and its "event" is complete, so the host never reads a buffer still being filled.
    from lossscale import _device

    seen = []

    class Src:
        device = torch.device("xpu")

    class Dst:
        def copy_(self, src, non_blocking=False):
            seen.append(non_blocking)

    _device.copy_to_host_(Dst(), Src())
    assert seen == [False] and _device.record_event(torch.device("xpu")).query()
    assert not _device.capturing(torch.device("xpu"))


def test_four_bools_are_read_in_one_item_and_no_kernel():
    """Kills: the bytes of the int32 word taken in the wrong order (overflow read as the bad loss),
    and a read that launches a kernel (the synced clip path's budget)."""
    from lossscale._kernels import read_four_bools
    from lossscale._sync import count_device_work

    for bits in itertools.product([False, True], repeat=4):
        v = torch.tensor(bits)
        with count_device_work() as work:
            got = read_four_bools(v)
        assert got == list(bits) and work.launches == 0 and work.syncs == 1
    with pytest.raises(ValueError, match="bool vector of 4"):
        read_four_bools(torch.zeros(4))


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("grad_value", [0.5, math.inf, -math.inf, math.nan, None])
@pytest.mark.parametrize("loss", [2.0, math.inf, -math.inf, math.nan, None])
def test_the_read_only_check_lays_out_every_flag(kernel, grad_value, loss, monkeypatch):
    """``read_only_check`` against the flags written out by hand (``FLAG_LAYOUT`` of ``(1, overflow,
    nan, bad_loss, scale_overflow, clean)``), for each kind of gradient value and loss, with fp32 and fp16
    groups side by side: bitwise, as the tensor rules and torch's fused optimizers read them."""
    from lossscale.policy import FLAG_LAYOUT

    monkeypatch.setitem(_kernels.AMAX_KERNELS, "cpu", kernel)
    grads = [torch.randn(9), torch.randn(4).half(), torch.randn(3)]
    if grad_value is not None:  # None: no gradients at all
        grads[1][2] = grads[2][0] = grad_value  # two tensors: a flag is a count of tests, clamped to 1
    else:
        grads = []
    loss_check = None if loss is None else torch.tensor(loss)
    flags, amax, vectors = _kernels.read_only_check(_kernels.group_grads(grads), torch.device("cpu"),
                                                    loss_check, needs_amax=True)
    grad_bad = grad_value is not None and not math.isfinite(grad_value)
    bad = loss is not None and not math.isfinite(loss)
    nan = grad_value is not None and math.isnan(grad_value)
    sources = [1.0, float(grad_bad or bad), float(nan), float(bad), float(grad_bad and not bad),
               float(not (grad_bad or bad))]
    assert torch.equal(flags, torch.tensor([sources[i] for i in FLAG_LAYOUT]))
    expected = max((g.float().abs().max() for g in grads), default=torch.tensor(0.0),
                   key=lambda a: math.inf if math.isnan(a) else float(a))
    assert torch.equal(amax, expected) or (math.isnan(amax) and math.isnan(expected))
    assert [len(v) for v in vectors] == ([2, 1] if grads else [])  # per group: fp32 (two), fp16 (one)
    _, no_amax, _ = _kernels.read_only_check(_kernels.group_grads(grads), torch.device("cpu"), loss_check,
                                             needs_amax=False)
    assert no_amax is None


@pytest.mark.parametrize("grad_value", [0.5, math.inf, math.nan])
@pytest.mark.parametrize("loss", [2.0, math.inf, None])
def test_every_way_of_making_the_flags_gives_the_same_vector(grad_value, loss):
    """The tensor rules read one layout however the flags were made: the read-only check's matrix,
    the clip's bools converted by ``Flags.fold``, ``laid_out`` from the four flags (the synced path's
    device flags, and the flags reduced across ranks), and two optimizers' vectors combined. Kills:
    "scale_overflow" or "clean" made from the wrong entries in any of them (a MAX of two optimizers'
    "clean" says clean where one overflowed)."""
    from lossscale._check import Flags

    loss_check = None if loss is None else torch.tensor(loss)
    grads = [torch.ones(3), torch.full((2,), grad_value)]
    matrix, _, _ = _kernels.read_only_check(_kernels.group_grads(grads), torch.device("cpu"), loss_check, False)
    amax = torch.stack([g.abs().max() for g in grads]).max()
    folded = Flags.from_vector(_kernels.flag_bools(amax, loss_check), None).fold().flag_vector
    one, overflow, nan, bad = (matrix[i] for i in range(4))
    assert torch.equal(folded, matrix) and torch.equal(_kernels.laid_out([one, overflow, nan, bad]), matrix)
    clean, _, _ = _kernels.read_only_check(_kernels.group_grads([torch.ones(3)]), torch.device("cpu"), loss_check,
                                           False)
    assert torch.equal(_kernels.combined([clean, matrix]), matrix)
    assert torch.equal(_kernels.combined([matrix, clean]), matrix)
