"""lossscale.stats: every figure against a direct float64 + torch-cast computation."""

import dataclasses
import doctest
import json
import math
import random
from fractions import Fraction

import numpy as np
import pytest
import torch
from _rules import f32
from _sync import count_host_syncs
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lossscale import formats, stats
from lossscale.formats import BF16, FP8_E4M3, FP8_E5M2, FP16, FP32
from lossscale.stats import NUM_BINS, GradStats, grad_stats, recommend_scale

pytestmark = pytest.mark.filterwarnings("error")  # e.g. torch's "output was resized" on a bad out= slice

COUNTS = ("zeros", "flushed", "subnormal", "normal", "overflow", "inf", "nan")
FMTS = [FP16, BF16, FP8_E4M3, FP8_E5M2, FP32]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SCALES = [1.0, 2.0**12, 2.0**-9, 1000.0, 0.3]  # powers of two and two that are not


# ----- the reference: what a real cast does, element by element ---------------------------------


def reference(tensors, scale, fmt):
    """Every figure from ``(x.double() * scale).to(dtype)``, the definition grad_stats promises."""
    fmt = formats.get(fmt)
    out = dict.fromkeys(COUNTS, 0)
    amax = 0.0
    for t in tensors:
        if t is None:
            continue
        x = t.detach().double().reshape(-1)
        scaled = x * scale
        stored = scaled.to(fmt.torch_dtype()).double()
        nan, inf, zero = x.isnan(), x.isinf(), x == 0
        finite_nonzero = ~(nan | inf | zero)
        if fmt.has_inf:
            over = finite_nonzero & stored.isinf()
        else:
            # A saturating cast hides overflow (it stores 448), so apply the documented definition
            # to the float32 value the cast starts from: |y| rounds past max.
            y = scaled.float().double().abs()
            t_ = fmt.overflow_threshold
            over = finite_nonzero & ((y > t_) | ((y == t_) & fmt.overflow_tie_overflows))
        flushed = finite_nonzero & (stored == 0)
        sub = finite_nonzero & ~over & ~flushed & (stored.abs() < fmt.smallest_normal)
        normal = finite_nonzero & ~over & ~flushed & ~sub
        for name, mask in zip(COUNTS, (zero, flushed, sub, normal, over, inf, nan)):
            out[name] += int(mask.sum())
        finite = x[~(nan | inf)].abs()
        if finite.numel():
            amax = max(amax, finite.max().item())
    out["amax"] = amax
    out["numel"] = sum(out[c] for c in COUNTS)
    return out


def figures(s: GradStats):
    d = {name: getattr(s, name) for name in COUNTS}
    d["amax"] = s.amax
    d["numel"] = s.numel
    return d


# ----- test data: random gradients plus values planted at every boundary -----------------------


def _f32_around(values, k=2):
    t = torch.tensor(values, dtype=torch.float64).float()
    t = t[torch.isfinite(t) & (t > 0)]
    out = [t]
    up = down = t
    for _ in range(k):
        up = torch.nextafter(up, torch.full_like(up, math.inf))
        down = torch.nextafter(down, torch.zeros_like(down))
        out += [up, down]
    return torch.cat(out)


def planted(fmt, scale):
    """Each boundary of ``fmt`` (and of fp16, bf16 and e4m3/e5m2, which the brief names) divided
    by ``scale``, with float32 neighbours, both signs."""
    bounds = []
    for f in {fmt, FP16, BF16, FP8_E4M3, FP8_E5M2}:
        bounds += [
            f.smallest_subnormal,
            f.flush_threshold,
            1.5 * f.smallest_subnormal,
            f.smallest_normal - f.smallest_subnormal,
            f.normal_threshold,
            f.smallest_normal,
            f.max,
            f.overflow_threshold,
            2 * f.max,
        ]
    x = _f32_around([b / scale for b in bounds])
    return torch.cat([x, -x])


def random_grads(n, gen, lo=-160.0, hi=130.0):
    """Log-uniform magnitudes over (almost) all of float32, subnormals included, both signs,
    sprinkled with zeros, infs and NaNs."""
    e = torch.empty(n, dtype=torch.float64).uniform_(lo, hi, generator=gen)
    sign = torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1
    x = (torch.exp2(e) * sign).float()
    x[torch.randint(0, n, (n // 50,), generator=gen)] = 0.0
    x[torch.randint(0, n, (5,), generator=gen)] = math.inf
    x[torch.randint(0, n, (5,), generator=gen)] = -math.inf
    x[torch.randint(0, n, (5,), generator=gen)] = math.nan
    return x


def gradient_list(fmt, scale, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        random_grads(3000, gen).to(dtype),
        planted(fmt, scale).to(dtype),
        random_grads(600, gen).to(dtype).reshape(20, 30)[:, ::3],  # strided 2-D view
        None,
        random_grads(1, gen)[0].to(dtype),  # 0-dim
        torch.empty(0, dtype=dtype),
    ]


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_every_figure_matches_a_real_cast(fmt, dtype, scale):
    ts = gradient_list(fmt, scale, dtype)
    s = grad_stats(ts, scale=scale, fmt=fmt)
    assert figures(s) == reference(ts, scale, fmt)
    assert s.error_bound == 0
    assert s.fmt is fmt and s.scale == scale


def test_mixed_dtypes_in_one_call():
    gen = torch.Generator().manual_seed(5)
    ts = [
        random_grads(2000, gen),
        random_grads(2000, gen).half(),
        random_grads(2000, gen).bfloat16(),
        planted(FP16, 64.0),
        planted(FP16, 64.0).half(),
        planted(FP16, 64.0).bfloat16(),
    ]
    assert figures(grad_stats(ts, scale=64.0)) == reference(ts, 64.0, FP16)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    # The chunking policy differs with one intra-op thread and with several (see _chunk_size).
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("method", ["auto", "bincount", "index_add"])
def test_chunking_packing_and_the_count_paths(monkeypatch, method, threads):
    _check_chunking(monkeypatch, method)


@pytest.mark.parametrize("method", ["histc", "sort"])
def test_chunking_packing_with_the_accelerator_alternatives(monkeypatch, method):
    # One thread: these cost O(bins) per call (32,768 on the 16-bit path), nothing next to a GPU's
    # 4M-element chunks but seconds with this test's 100-element ones on two busy threads.
    _check_chunking(monkeypatch, method)


def _check_chunking(monkeypatch, method):
    # Tiny chunks exercise packing many small tensors, splitting big ones and strided copies;
    # every counting method (index_add_, histc and sort are the accelerator candidates) runs on CPU.
    monkeypatch.setattr(stats, "_CPU_CHUNK", 256)
    monkeypatch.setattr(stats, "_CPU_SERIAL_CHUNK", 100)
    gen = torch.Generator().manual_seed(7)
    ts = [random_grads(n, gen) for n in (1, 7, 63, 64, 65, 200, 256, 257, 1000)]
    ts += [random_grads(2000, gen).reshape(40, 50).t()]  # large and strided
    ts += [t.half() for t in ts[:5]] + [t.bfloat16() for t in ts[4:]]
    for scale in (1.0, 2.0**20, 777.0):
        assert figures(grad_stats(ts, scale=scale, method=method)) == reference(ts, scale, FP16)


def _hot_bins(gen):
    """Gradients as a GPU sees them: most values in a few binades (hot bins), plus every pattern
    class (zeros, subnormals, inf, NaN) in all three dtypes."""
    hot = (torch.randn(20000, generator=gen) * 1e-3).float()
    return [
        hot,
        hot.half(),
        hot.bfloat16(),
        random_grads(5000, gen),
        random_grads(3000, gen).half(),
        random_grads(3000, gen).bfloat16(),
        torch.zeros(500),
        torch.full((300,), 2.0**-20),
    ]


@pytest.mark.parametrize("method", [m for m in stats.METHODS if m != "bincount"])
def test_every_method_gives_bitwise_the_same_histogram(method):
    """The accelerator alternatives of issue 14 (item 13) count exactly what bincount counts."""
    ts = _hot_bins(torch.Generator().manual_seed(13))
    for fmt, scale in ((FP16, 1.0), (FP16, 2.0**16), (BF16, 3.0), (FP8_E4M3, 2.0**-5)):
        want = grad_stats(ts, scale=scale, fmt=fmt, method="bincount")
        got = grad_stats(ts, scale=scale, fmt=fmt, method=method)
        assert torch.equal(got.hist, want.hist), (method, fmt.name, scale)
        assert torch.equal(got.amax_tensor, want.amax_tensor)


def test_method_is_validated_before_any_work():
    with pytest.raises(ValueError, match=r"method='atomic' must be one of \('auto', 'bincount'"):
        grad_stats([torch.ones(2)], method="atomic")
    with pytest.raises(ValueError, match=r"method='bincount' on \['meta'\].*sync"):
        grad_stats([torch.ones(2), torch.ones(2, device="meta")], method="bincount")


def test_empty_inputs():
    for empty in ([], [None], [torch.empty(0)], (t for t in [])):
        s = grad_stats(empty)
        assert figures(s) == dict(dict.fromkeys(COUNTS, 0), amax=0.0, numel=0)
        assert s.flushed_frac == 0.0 and s.headroom_bits == math.inf


def test_empty_stats_on_a_chosen_device():
    s = grad_stats([], scale=8.0, fmt="bf16", device="cpu")
    assert s.hist.device.type == "cpu" and s.amax_tensor.device.type == "cpu" and s.numel == 0
    # device= is where the result lives; the tensors are measured where they are.
    moved = grad_stats([torch.ones(2)], device="meta")
    assert moved.hist.device.type == "meta" and moved.amax_tensor.device.type == "meta"


# ----- several devices in one call (model parallelism in one process; issue 14, item 3) ----------


def test_tensors_on_several_devices_are_measured_and_gathered_on_one():
    """A real second device: ``meta`` (every op runs, shape-only; it takes the accelerator code path).

    Before the fix grad_stats raised "tensors are on several devices" and merge refused stats on
    two devices, which broke telemetry for one optimizer over several GPUs.
    """
    cpu = random_grads(300, torch.Generator().manual_seed(21))
    meta = torch.empty(500, device="meta")
    for ts, device, where in (
        ([meta, cpu], None, "meta"),
        ([cpu, meta.half()], "meta", "meta"),
        ([meta, cpu.bfloat16(), meta], torch.device("meta"), "meta"),
    ):
        s = grad_stats(ts, device=device)
        assert s.hist.device.type == where and s.amax_tensor.device.type == where
        assert s.hist.shape == (NUM_BINS,) and s.hist.dtype == torch.int64 and s.amax_tensor.dim() == 0
    # Merging moves the other side's histogram to self's device.
    merged = grad_stats([meta]) + grad_stats([cpu])
    assert merged.hist.device.type == "meta" and merged.amax_tensor.device.type == "meta"
    assert merged.counts_tensor().device.type == "meta"


def test_several_devices_give_bitwise_the_single_device_figures(monkeypatch):
    """The values, on a simulated second device.

    CPU-only torch has no second device that holds data (``meta`` holds none), so the split is
    staged: ``_device_of`` -- the one function grad_stats groups tensors by -- is patched to put
    the tensors tagged below on ``cpu:0``, a device key that compares unequal to ``cpu``.  The
    per-device measurement and the gathering (sum of histograms, max of amax) then run exactly as
    for two devices; only the final copy is a no-op, since both groups' results live on the CPU
    (the copy itself is covered by the meta test above).
    """
    gen = torch.Generator().manual_seed(22)
    ts = [
        random_grads(3000, gen),
        random_grads(800, gen).half(),
        planted(FP16, 8.0),
        random_grads(900, gen).bfloat16(),
        random_grads(40, gen, lo=-3, hi=3),
    ]
    second = {id(ts[1]), id(ts[2]), id(ts[4])}
    groups = []
    real_measure = stats._measure
    monkeypatch.setattr(
        stats, "_device_of", lambda t: torch.device("cpu", 0) if id(t) in second else torch.device("cpu")
    )
    monkeypatch.setattr(stats, "_measure", lambda group, *a: groups.append(len(group)) or real_measure(group, *a))
    split = grad_stats(ts, scale=8.0)
    assert sorted(groups) == [2, 3]  # measured per device, not as one list
    monkeypatch.undo()
    whole = grad_stats(ts, scale=8.0)
    assert torch.equal(split.hist, whole.hist) and torch.equal(split.amax_tensor, whole.amax_tensor)
    assert figures(split) == reference(ts, 8.0, FP16)


# ----- device tables are built on the device (issue 14, item 8) ---------------------------------


def _category_matrix_reference(thresholds, bounds):
    """The pure-Python definition of the bin -> category matrix (the code before issue 14)."""
    import bisect

    edges = (0, *thresholds, stats._MANT_ONE)
    rows = [[0] * NUM_BINS for _ in range(8)]
    for f in range(256):
        for c in range(5):
            b = 5 * f + c
            if f == 255:
                rows[5 if c == 0 else 6][b] = 1
                continue
            if b == 0:
                rows[0][b] = 1
                continue
            lo, hi = (f << 23) + edges[c], (f << 23) + edges[c + 1]
            r_lo = bisect.bisect_right(bounds, lo)
            rows[1 + r_lo][b] = 1
            if hi > lo and bisect.bisect_right(bounds, hi - 1) != r_lo:
                rows[7][b] = 1
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_category_matrix_is_the_python_definition_bit_for_bit(fmt):
    for scale in (1.0, 2.0**16, 2.0**-9, 1000.0, 0.3, 2.0**100):
        bounds = stats._boundaries(fmt, scale)
        for thresholds in {stats._thresholds_for(bounds), stats._thresholds_for(stats._boundaries(fmt, 1.0))}:
            got = stats._category_matrix(thresholds, bounds, torch.device("cpu"))
            assert torch.equal(got, _category_matrix_reference(thresholds, bounds)), (scale, thresholds)


def test_device_tables_are_built_by_ops_on_the_device():
    """No table reaches the device by a host-to-device copy.

    On CUDA, ``torch.tensor(list, device=...)`` and ``.to(device)`` from pageable host memory wait
    for the stream (a sync the sync counter does not see; an error inside CUDA-graph capture).
    Staged on ``meta``: with the caches cleared, every op of a measurement and of reading its
    counts is recorded, and none may take a CPU tensor of any size.  (Python numbers in ops such as
    ``torch.add(t, 3)`` reach the kernel as scalars and do not show up here.)
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    host_inputs = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            flat = list(args) + list(kwargs.values())
            flat += [x for a in flat if isinstance(a, (list, tuple)) for x in a]
            if any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in flat):
                host_inputs.append(str(func))
            return func(*args, **kwargs)

    meta = torch.empty(1000, device="meta")
    stats._device_tables.clear()
    with Watch():
        for method in ("auto", "index_add", "histc", "sort"):
            s = grad_stats([meta, meta.half(), meta.bfloat16()], scale=3.0, fmt="fp16", method=method)
            s.counts_tensor()
            s.at(2.0**20, "bf16").counts_tensor()
    assert host_inputs == []
    assert any(k[2] == "meta" for k in stats._device_tables)  # the tables were built, on meta


def test_to_dict_reads_once():
    s = grad_stats(torch.randn(100))
    calls = []
    real = torch.Tensor.tolist
    try:
        torch.Tensor.tolist = lambda self: calls.append(1) or real(self)
        s.to_dict()
        s.flushed, s.amax  # noqa: B018  the reads are what is counted
    finally:
        torch.Tensor.tolist = real
    assert len(calls) == 1


def test_single_tensor_and_requires_grad():
    x = torch.tensor([2.0**-26, 2.0**-25, 2.0**-24, 1.0, 70000.0, 0.0], requires_grad=True)
    s = grad_stats(x)
    assert (s.zeros, s.flushed, s.subnormal, s.normal, s.overflow) == (1, 2, 1, 1, 1)
    assert s.amax == 70000.0
    assert s.flushed_frac == 2 / 6 and s.overflow_frac == 1 / 6 and s.zeros_frac == 1 / 6
    assert s.subnormal_frac == 1 / 6 and s.normal_frac == 1 / 6 and s.nonfinite_frac == 0.0
    assert s.headroom_bits == pytest.approx(math.log2(65504 / 70000))


def test_headroom_bits():
    s = grad_stats(torch.tensor([0.5, -2.0, math.inf]), scale=8.0)
    assert s.amax == 2.0
    assert s.headroom_bits == pytest.approx(math.log2(65504.0 / 16.0))


# ----- views: shares of the nonzero values, binades ----------------------------------------------


def test_frac_of_nonzero_ignores_zeros_and_nonfinite_inputs():
    s = grad_stats([torch.tensor([2.0**-30, 1.5 * 2.0**-30, 1.0, 0.0, math.inf])], scale=1.0)
    assert s.frac_of_nonzero("flushed") == pytest.approx(2 / 3)  # both 2^-30 values flush, 1.0 does not
    assert s.frac_of_nonzero("normal") == pytest.approx(1 / 3)
    assert s.flushed_frac == pytest.approx(2 / 5)  # the per-slot share, for contrast
    g = random_grads(3000, torch.Generator().manual_seed(0))
    for scale in (1.0, 2.0**20, 2.0**-9):
        at = grad_stats([g], scale=scale)
        shares = [at.frac_of_nonzero(name) for name in ("flushed", "subnormal", "normal", "overflow")]
        assert sum(shares) == pytest.approx(1.0)
        n = int(((g != 0) & g.isfinite()).sum())
        assert at.frac_of_nonzero("overflow") == at.overflow / n
    assert grad_stats([torch.zeros(3)]).frac_of_nonzero("flushed") == 0.0
    assert grad_stats([]).frac_of_nonzero("flushed") == 0.0
    with pytest.raises(ValueError, match=r"name='zeros' must be one of"):
        s.frac_of_nonzero("zeros")


def _binades_reference(x: torch.Tensor, scale: float) -> dict:
    """``{e: count}`` by frexp: ``|x| = m * 2**k`` with ``m`` in [0.5, 1), so ``x``'s binade is ``k - 1``."""
    x = x.float().flatten()
    x = x[(x != 0) & x.isfinite()]
    k = torch.frexp(x).exponent.to(torch.int64) - 1
    k = k.clamp(min=-127)  # float32 subnormals are counted in one binade below the normal range
    e = k + int(math.log2(scale))
    values, counts = torch.unique(e, return_counts=True)
    return dict(zip(values.tolist(), counts.tolist()))


def test_binades_read_the_exponent_histogram_and_shift_with_the_scale():
    s = grad_stats([torch.tensor([2.0**-30, 1.5 * 2.0**-30, 1.0, 0.0, float("inf")])], scale=1.0)
    assert s.binades() == {-30: 2, 0: 1}
    assert s.at(2.0**10).binades() == {-20: 2, 10: 1}
    edges = torch.tensor([2.0**-126, 2.0**-127, 2.0**-149, -(2.0**127), 3.4e38, math.nan, -math.inf])
    for dtype in DTYPES:
        g = torch.cat([random_grads(3000, torch.Generator().manual_seed(1)), edges]).to(dtype)
        for scale in (1.0, 2.0**16, 2.0**-9):
            measured = grad_stats([g], scale=scale, fmt="fp16")
            expect = _binades_reference(g, scale)
            assert measured.binades() == expect
            assert grad_stats([g], fmt="fp16").at(scale).binades() == expect
            assert sum(expect.values()) == measured.numel - measured.zeros - measured.inf - measured.nan
            assert list(measured.binades()) == sorted(expect)  # ascending binades


def test_binades_refuse_a_scale_that_is_not_a_power_of_two():
    s = grad_stats([torch.ones(3)])
    with pytest.raises(ValueError, match=r"scale=1000.0 is not a power of two"):
        s.at(1000.0).binades()


# ----- at(): the same histogram at another scale ------------------------------------------------


@pytest.mark.parametrize("fmt", [FP16, FP8_E4M3, FP8_E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("base", [1.0, 2.0**10, 3.0])
def test_at_is_exact_for_power_of_two_ratios(fmt, base):
    gen = torch.Generator().manual_seed(11)
    ts = [random_grads(20000, gen), planted(fmt, base)]
    s = grad_stats(ts, scale=base, fmt=fmt)
    for k in range(-40, 41, 3):
        scale = base * 2.0**k
        moved = s.at(scale)
        assert moved.error_bound == 0, k
        assert figures(moved) == figures(grad_stats(ts, scale=scale, fmt=fmt)), k


@pytest.mark.parametrize(
    "fmt, base, ks",
    [(BF16, 2.0**-20, range(-40, 13)), (FP32, 2.0**-30, range(-40, 7))],
    ids=["bf16", "fp32"],
)
def test_at_is_exact_for_power_of_two_ratios_while_boundaries_stay_normal(fmt, base, ks):
    # bf16 and fp32 share float32's exponent range, so their flush/subnormal boundaries sit in
    # float32's subnormal range unless the scale is small; the ranges here keep them normal.
    gen = torch.Generator().manual_seed(12)
    ts = [random_grads(20000, gen), planted(fmt, base)]
    s = grad_stats(ts, scale=base, fmt=fmt)
    for k in ks:
        scale = base * 2.0**k
        moved = s.at(scale)
        assert moved.error_bound == 0, k
        assert figures(moved) == figures(grad_stats(ts, scale=scale, fmt=fmt)), k


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_at_stays_within_its_error_bound(fmt):
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    ts = [random_grads(20000, gen, lo=-60, hi=30), planted(fmt, 1.0)]
    s = grad_stats(ts, scale=1.0, fmt=fmt)
    for _ in range(25):
        scale = 2.0 ** rng.uniform(-30, 40)
        other = rng.choice([None, *FMTS])
        moved = s.at(scale, other)
        fresh = grad_stats(ts, scale=scale, fmt=other or fmt)
        for name in COUNTS:
            assert abs(getattr(moved, name) - getattr(fresh, name)) <= moved.error_bound, (name, scale)
        assert moved.numel == fresh.numel and moved.amax == fresh.amax
        assert moved.error_bound <= 0.2 * fresh.numel  # a bound, and a useful one


def test_at_does_not_touch_the_tensors():
    x = torch.tensor([2.0**-30, 1.0])
    s = grad_stats(x)
    x.fill_(math.nan)
    assert (s.at(2.0**10).flushed, s.at(2.0**10).nan) == (0, 0)


# ----- no host sync -----------------------------------------------------------------------------


def test_grad_stats_does_not_sync():
    gen = torch.Generator().manual_seed(1)
    ts = [random_grads(5000, gen), random_grads(300, gen).half(), None, random_grads(70, gen).bfloat16()]
    s0 = grad_stats(ts, scale=3.0)  # warm the per-(fmt, scale) caches outside the count
    with count_host_syncs() as syncs:
        s = grad_stats(ts, scale=3.0)
        moved = s.at(2.0**20)
        merged = s.merge(s)
        moved.counts_tensor()
    assert syncs.count == 0, syncs.ops
    assert merged.numel == 2 * s0.numel  # reading afterwards is fine


def test_sync_counter_counts_reads():
    x = torch.ones(4)
    with count_host_syncs() as syncs:
        y = x * 3
        assert float(y.sum()) == 12.0
        _ = y.max().item()
        _ = x[x > 0]  # boolean-mask indexing needs the mask's count on the host
        if y.any():
            pass
    assert syncs.count == 4, syncs.ops


# ----- combining and plain data ------------------------------------------------------------------


def test_merge_equals_stats_of_the_concatenation():
    gen = torch.Generator().manual_seed(2)
    a = [random_grads(3000, gen), random_grads(10, gen).half()]
    b = [random_grads(5000, gen, lo=-20, hi=10).bfloat16()]
    merged = grad_stats(a, scale=512.0).merge(grad_stats(b, scale=512.0))
    together = grad_stats(a + b, scale=512.0)
    assert figures(merged) == figures(together)
    assert torch.equal(merged.hist, together.hist)
    assert figures(grad_stats(a, scale=512.0) + grad_stats(b, scale=512.0)) == figures(together)


def test_merge_refuses_different_scales_or_formats():
    x = torch.ones(3)
    with pytest.raises(ValueError, match="same fmt and scale"):
        grad_stats(x, scale=2.0).merge(grad_stats(x, scale=4.0))
    with pytest.raises(ValueError, match="same fmt and scale"):
        grad_stats(x, fmt="fp16").merge(grad_stats(x, fmt="bf16"))
    with pytest.raises(ValueError, match="not a GradStats"):
        grad_stats(x).merge(3)


def test_reduced_tensors_rebuild_with_replace():
    # What the distributed code does: sum hist, max amax, then rebuild.
    gen = torch.Generator().manual_seed(4)
    a, b = random_grads(1000, gen), random_grads(1000, gen)
    sa, sb = grad_stats(a), grad_stats(b)
    _ = sa.numel  # fill sa's cache: replace() must not carry it over
    rebuilt = dataclasses.replace(sa, hist=sa.hist + sb.hist, amax_tensor=torch.maximum(sa.amax_tensor, sb.amax_tensor))
    assert figures(rebuilt) == figures(grad_stats([a, b]))


def test_to_dict_round_trip_covers_every_field():
    gen = torch.Generator().manual_seed(6)
    s = grad_stats([random_grads(4000, gen), planted(FP8_E5M2, 3.0)], scale=3.0, fmt="e5m2").at(12.0)
    d = s.to_dict()
    assert all(isinstance(v, (int, float, str, list, dict)) for v in d.values())
    back = GradStats.from_dict(json.loads(json.dumps(d)))
    assert back.to_dict() == d
    assert (back.fmt, back.scale, back.thresholds) == (s.fmt, s.scale, s.thresholds)
    assert torch.equal(back.hist, s.hist) and torch.equal(back.amax_tensor, s.amax_tensor)
    for name in GradStats._FIGURE_NAMES:
        assert d[name] == getattr(s, name)
    assert d["numel"] == sum(d[c] for c in COUNTS)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda d: d.clear(), r"missing key\(s\) \['fmt', 'scale', 'amax', 'thresholds', 'hist'\]"),
        (lambda d: d.pop("hist"), r"missing key\(s\) \['hist'\]"),
        (lambda d: d.update(fmt="fp17"), r"key 'fmt'.*fp17"),
        (lambda d: d.update(scale=0.0), r"key 'scale'"),
        (lambda d: d.update(scale="2"), r"key 'scale'"),
        (lambda d: d.update(amax=math.nan), r"key 'amax'=nan"),
        (lambda d: d.update(amax=-1.0), r"key 'amax'=-1.0"),
        (lambda d: d.update(amax=True), r"key 'amax'=True"),
        (lambda d: d.update(thresholds=[1, 2]), r"key 'thresholds'=\[1, 2\]"),
        (lambda d: d.update(thresholds=[5, 1, 2, 3]), r"key 'thresholds'"),
        (lambda d: d.update(hist=[1, 2]), r"key 'hist' must be a dict"),
        (lambda d: d.update(hist={"9999": 1}), r"key 'hist' has bin index '9999'"),
        (lambda d: d.update(hist={"x": 1}), r"key 'hist' has bin index 'x'"),
        (lambda d: d.update(hist={"3": -1}), r"key 'hist' bin '3' has count -1"),
        (lambda d: d.update(hist={"3": 1.5}), r"key 'hist' bin '3' has count 1.5"),
    ],
)
def test_from_dict_names_the_bad_key(change, match):
    """Issue 12, bug 5: ``GradStats.from_dict({})`` raised ``KeyError: 'hist'``."""
    d = json.loads(json.dumps(grad_stats(torch.tensor([1e-9, 1.0, 0.0])).to_dict()))
    change(d)
    with pytest.raises(ValueError, match=match):
        GradStats.from_dict(d)


def test_from_dict_refuses_a_non_dict():
    with pytest.raises(ValueError, match=r"d=\[\] must be a dict"):
        GradStats.from_dict([])


def test_repr_is_readable():
    text = repr(grad_stats(torch.tensor([2.0**-30, 1.0, 0.0]), scale=2.0))
    assert text.startswith("GradStats(fp16 at scale=2: numel=3")
    assert "flushed=1 (33.333%)" in text and "amax=1" in text


def test_hist_is_one_int64_tensor():
    s = grad_stats(torch.randn(100))
    assert s.hist.dtype == torch.int64 and s.hist.shape == (NUM_BINS,)
    assert s.amax_tensor.dtype == torch.float32 and s.amax_tensor.dim() == 0
    assert int(s.hist.sum()) == s.numel == 100


def test_first_measurement_on_a_device_counts_no_sync():
    """The sync counter counts pageable host-to-device copies: a cold first call on a device is sync-free."""
    meta = torch.empty(700, device="meta")
    stats._device_tables.clear()
    with count_host_syncs() as syncs:
        s = grad_stats([meta, meta.half(), meta.bfloat16()], scale=5.0)
        s.counts_tensor()
        s.at(2.0**-7).counts_tensor()
    assert syncs.count == 0, syncs.ops


# ----- recommend_scale ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [FP16, FP8_E4M3, FP8_E5M2, BF16], ids=lambda f: f.name)
@pytest.mark.parametrize("margin", [0, 1, 3])
def test_recommend_scale(fmt, margin):
    gen = torch.Generator().manual_seed(8)
    x = random_grads(5000, gen, lo=-50, hi=-5)
    x = x[torch.isfinite(x)]
    s = grad_stats(x, scale=1.0, fmt=fmt)
    rec = recommend_scale(s, margin_bits=margin)
    k = math.log2(rec.scale)
    assert k == int(k)  # a power of two
    limit = fmt.max / 2.0**margin
    assert s.amax * rec.scale <= limit < s.amax * rec.scale * 2
    fresh = grad_stats(x, scale=rec.scale, fmt=fmt)
    assert (rec.flushed, rec.flushed_frac) == (fresh.flushed, fresh.flushed_frac)
    assert rec.error_bound == 0 and fresh.overflow == 0
    assert rec.headroom_bits >= margin


@pytest.mark.parametrize("bad", [[math.inf], [-math.inf], [math.nan]], ids=["inf", "-inf", "nan"])
def test_recommend_scale_refuses_nonfinite_statistics(bad):
    """Issue 12, bug 4: an overflowed step's finite values do not bound its gradients."""
    s = grad_stats(torch.tensor([1e-6, 2e-5, *bad]))
    with pytest.raises(ValueError, match=r"count [01] inf and [01] NaN.*ignore_nonfinite=True"):
        recommend_scale(s)
    rec = recommend_scale(s, ignore_nonfinite=True)  # asked for explicitly: fit the finite values
    assert rec.scale == recommend_scale(grad_stats(torch.tensor([1e-6, 2e-5]))).scale
    only_bad = grad_stats(torch.tensor(bad * 3))
    with pytest.raises(ValueError, match="NaN"):
        recommend_scale(only_bad)
    assert recommend_scale(only_bad, ignore_nonfinite=True).scale is None
    with pytest.raises(ValueError, match="ignore_nonfinite=1"):
        recommend_scale(s, ignore_nonfinite=1)


def test_recommend_scale_for_another_format_and_edge_cases():
    s = grad_stats(torch.tensor([3.0, -0.25, 1e-9]), fmt="fp16")
    rec = recommend_scale(s, fmt="e4m3", margin_bits=0)
    assert rec.scale == 128.0  # 3 * 128 = 384 <= 448 < 768
    assert recommend_scale(grad_stats([torch.zeros(5)])).scale is None
    assert recommend_scale(grad_stats([])).flushed == 0
    with pytest.raises(ValueError, match="margin_bits"):
        recommend_scale(s, margin_bits=-1)


# At the exact tie (issue 15; "Kills: ..." names the change a test was seen to fail on, docs/testing.md).
def test_recommend_scale_at_the_exact_tie():
    """Kills an off-by-one in the floor of log2(fmt.max / amax) (e.g. ``m_max <= m_a`` for
    ``m_max < m_a`` in stats.recommend_scale): at amax * S == fmt.max / 2**margin the answer is S."""
    amax = 65504.0 * 2.0**-10
    assert recommend_scale(grad_stats(torch.tensor([amax, -1e-3]), fmt="fp16"), margin_bits=0).scale == 2.0**10
    assert recommend_scale(grad_stats(torch.tensor([amax]), fmt="fp16"), margin_bits=2).scale == 2.0**8
    above = float(np.nextafter(np.float32(amax), np.float32(math.inf)))
    assert recommend_scale(grad_stats(torch.tensor([above]), fmt="fp16"), margin_bits=0).scale == 2.0**9


def _largest_power_of_two_scale(amax, fmt_max, margin):
    """Exact: the largest k with amax * 2**k * 2**margin <= fmt_max (fractions, no rounding)."""
    ratio = Fraction(fmt_max) / (Fraction(amax) * 2**margin)
    k = ratio.numerator.bit_length() - ratio.denominator.bit_length()
    while Fraction(2) ** k > ratio:
        k -= 1
    while Fraction(2) ** (k + 1) <= ratio:
        k += 1
    return k


#: The formats a scale is recommended for.
tie_fmts = st.sampled_from([formats.FP16, formats.BF16, formats.FP8_E4M3, formats.FP8_E5M2])


@st.composite
def amax_near_a_tie(draw, fmt):
    """A float32 amax at ``fmt.max * 2**-k`` exactly, one float32 step either side, or anywhere."""
    tie = fmt.max * 2.0 ** -draw(st.integers(0, 60))
    step = draw(st.sampled_from([0, 1, -1, None]))
    if step is None:
        return f32(draw(st.floats(2.0**-100, 2.0**60)))
    return float(np.nextafter(np.float32(tie), np.float32(step * math.inf))) if step else f32(tie)


@settings(max_examples=150, deadline=None)
@example(fmt=formats.FP16, margin=0, data=None)
@given(tie_fmts, st.integers(0, 3), st.data())
def test_recommend_scale_is_the_largest_power_of_two_that_fits_ties_included(fmt, margin, data):
    amax = 65504.0 * 2.0**-10 if data is None else data.draw(amax_near_a_tie(fmt))
    if amax == 0 or not math.isfinite(amax):
        return
    rec = recommend_scale(grad_stats(torch.tensor([amax]), fmt=fmt), margin_bits=margin)
    assert rec.scale == 2.0 ** _largest_power_of_two_scale(amax, fmt.max, margin)


# ----- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(fmt="fp64"), r"fmt='fp64'.*fp16"),
        (dict(scale=0.0), r"scale=0.0 must be positive"),
        (dict(scale=-2.0), r"scale=-2.0 must be positive"),
        (dict(scale=math.nan), r"scale=nan"),
        (dict(scale=math.inf), r"scale=inf"),
        (dict(scale=True), r"scale=True"),
        (dict(scale="2"), r"scale='2'"),
        (dict(scale=torch.tensor(2.0)), r"pass float\(scale\)"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        grad_stats([torch.ones(2)], **kwargs)


@pytest.mark.parametrize(
    "tensors, match",
    [
        (3.0, r"tensors=3.0 must be a tensor or an iterable"),
        ("grads", r"tensors='grads'"),
        ([torch.ones(2), [1.0]], r"tensors\[1\]=\[1.0\] is not a tensor"),
        ([torch.ones(2, dtype=torch.float64)], r"tensors\[0\] has dtype torch.float64"),
        ([torch.ones(2, dtype=torch.int32)], r"float32, float16 and bfloat16"),
        ([torch.ones(2).to_sparse()], r"dense"),
    ],
)
def test_bad_tensors(tensors, match):
    with pytest.raises(ValueError, match=match):
        grad_stats(tensors)


def test_at_validates_too():
    s = grad_stats(torch.ones(2))
    with pytest.raises(ValueError, match="scale"):
        s.at(0.0)
    with pytest.raises(ValueError, match="fmt"):
        s.at(1.0, "int8")


def test_docstring_examples_run():
    for module in (stats, formats):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0
