"""lossscale.formats: derived range facts vs torch.finfo, and round_to vs real torch casts."""

import math
import pathlib
import random
import subprocess
import sys

import pytest
import torch

from lossscale import formats
from lossscale.formats import BF16, FORMATS, FP8_E4M3, FP8_E5M2, FP16, FP32

pytestmark = pytest.mark.filterwarnings("error")

ALL = list(FORMATS.values())


def _same(a: float, b: float) -> bool:
    """Equal as floats, NaN equal to NaN, and the sign of zero respected."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def _torch_cast(fmt, values, source_dtype=torch.float32):
    """What torch stores: cast a source-dtype tensor to fmt, read back as Python floats."""
    t = torch.tensor(values, dtype=torch.float64).to(source_dtype)
    return t.to(fmt.torch_dtype()).to(torch.float64).tolist()


def _saturates(fmt) -> bool:
    return fmt is FP8_E4M3 and formats.TORCH_E4M3FN_CAST_SATURATES


def _f32_neighbours(v: float, k: int = 2):
    """v rounded to float32 and its k float32 neighbours on each side (positive v)."""
    t = torch.tensor([v], dtype=torch.float32)
    out = [t.item()]
    up, down = t.clone(), t.clone()
    for _ in range(k):
        up = torch.nextafter(up, torch.tensor([math.inf]))
        down = torch.nextafter(down, torch.tensor([0.0]))
        out += [up.item(), down.item()]
    return out


# ----- derived figures ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_derived_figures_match_torch_finfo(fmt):
    fi = torch.finfo(fmt.torch_dtype())
    assert fmt.bits == fi.bits
    assert fmt.max == fi.max
    assert -fmt.max == fi.min
    assert fmt.smallest_normal == fi.smallest_normal == fi.tiny
    assert fmt.eps == fi.eps


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_smallest_subnormal_is_the_smallest_value_torch_keeps(fmt):
    sub = fmt.smallest_subnormal
    src = torch.float64 if fmt is FP32 else torch.float32
    kept, tie, twice = _torch_cast(fmt, [sub, sub / 2, sub * 2], src)
    assert kept == sub
    assert tie == 0.0  # half of it is the flush tie, which goes to even (0)
    assert twice == 2 * sub


def test_layout_facts_from_the_specs():
    assert (FP16.bias, FP16.emin, FP16.emax) == (15, -14, 15)
    assert (BF16.bias, BF16.emin, BF16.emax) == (127, -126, 127)
    assert (FP8_E4M3.bias, FP8_E4M3.emin, FP8_E4M3.emax) == (7, -6, 8)
    assert (FP8_E5M2.bias, FP8_E5M2.emin, FP8_E5M2.emax) == (15, -14, 15)
    assert (FP8_E4M3.max, FP8_E5M2.max) == (448.0, 57344.0)
    assert not FP8_E4M3.has_inf and FP8_E5M2.has_inf


def test_cliff_thresholds():
    assert FP16.flush_threshold == 2.0**-25
    assert FP16.normal_threshold == 2.0**-14 - 2.0**-25
    assert FP16.overflow_threshold == 65520.0 and FP16.overflow_tie_overflows
    assert FP8_E4M3.flush_threshold == 2.0**-10
    assert FP8_E4M3.overflow_threshold == 464.0 and not FP8_E4M3.overflow_tie_overflows
    assert FP8_E5M2.overflow_threshold == 61440.0
    assert BF16.flush_threshold == 2.0**-134
    assert FP16.overflows(65520.0) and not FP16.overflows(65519.99)
    assert FP8_E4M3.overflows(464.0001) and not FP8_E4M3.overflows(464.0)


def test_torch_e4m3_cast_behaviour_is_what_we_document():
    out = _torch_cast(FP8_E4M3, [1e6, -1e6, math.inf, 465.0, math.nan])
    if formats.TORCH_E4M3FN_CAST_SATURATES:
        assert out[:4] == [448.0, -448.0, 448.0, 448.0]
    else:
        assert all(math.isnan(v) for v in out[:4])
    assert math.isnan(out[4])


# ----- lookup and table -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, fmt",
    [
        ("fp16", FP16),
        ("float16", FP16),
        ("half", FP16),
        ("FP16", FP16),
        (" Half ", FP16),
        ("bf16", BF16),
        ("bfloat16", BF16),
        ("fp32", FP32),
        ("float32", FP32),
        ("fp8_e4m3", FP8_E4M3),
        ("e4m3", FP8_E4M3),
        ("float8_e4m3fn", FP8_E4M3),
        ("fp8_e4m3fn", FP8_E4M3),
        ("fp8_e5m2", FP8_E5M2),
        ("e5m2", FP8_E5M2),
        (torch.float16, FP16),
        (torch.bfloat16, BF16),
        (torch.float32, FP32),
        (torch.float8_e4m3fn, FP8_E4M3),
        (torch.float8_e5m2, FP8_E5M2),
        (FP16, FP16),
    ],
)
def test_get_accepts_names_aliases_and_dtypes(name, fmt):
    assert formats.get(name) is fmt


@pytest.mark.parametrize("bad", ["fp64", "", "float8", torch.float64, 16, None])
def test_get_rejects_with_the_valid_names(bad):
    with pytest.raises(ValueError, match=r"fmt=.*fp16.*bf16|fmt=.*bf16.*fp16") as e:
        formats.get(bad)
    assert "fp8_e4m3" in str(e.value)


def test_formats_mapping_is_canonical():
    assert list(FORMATS) == ["fp16", "bf16", "fp32", "fp8_e4m3", "fp8_e5m2"]
    for name, f in FORMATS.items():
        assert f.name == name and formats.get(name) is f
        assert str(f) == name


def test_table_lists_every_format_with_powers_of_two():
    text = formats.table()
    lines = text.splitlines()
    assert len(lines) == 2 + len(FORMATS)
    for name in FORMATS:
        assert any(line.startswith(name) for line in lines)
    for fact in ("65504 = 2^15*1.9990234375", "2^-24", "<= 2.98e-08 = 2^-25", ">= 65520", "> 464", "448"):
        assert fact in text


def test_formats_module_does_not_import_torch():
    # Load the file on its own (the package __init__ may import torch for other reasons).
    path = pathlib.Path(formats.__file__)
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('fmts', r'{path}')\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['fmts'] = m\n"
        "spec.loader.exec_module(m)\n"
        "m.table(); m.round_to('fp16', 1e-8)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ----- named edge cases (checked against round_to AND a real torch cast) ------------------------

_F32_ULP_UP = lambda v: torch.nextafter(torch.tensor([v]), torch.tensor([math.inf])).item()  # noqa: E731
_F32_ULP_DOWN = lambda v: torch.nextafter(torch.tensor([v]), torch.tensor([0.0])).item()  # noqa: E731
_F32 = lambda v: torch.tensor([v], dtype=torch.float32).item()  # noqa: E731  (nearest float32)
NAN, INF = math.nan, math.inf

EDGE_CASES = [
    # name, format, input (exact in float32 unless fp32), rounded value (non-saturating), category
    ("fp16 smallest positive subnormal", FP16, 2.0**-24, 2.0**-24, "subnormal"),
    ("fp16 flush tie 2^-25 -> 0", FP16, 2.0**-25, 0.0, "flushed"),
    ("fp16 just above 2^-25 -> 2^-24", FP16, _F32_ULP_UP(2.0**-25), 2.0**-24, "subnormal"),
    ("fp16 just below 2^-25 -> 0", FP16, _F32_ULP_DOWN(2.0**-25), 0.0, "flushed"),
    ("fp16 negative flush tie keeps the sign of zero", FP16, -(2.0**-25), -0.0, "flushed"),
    ("fp16 tie 1.5*2^-24 -> 2^-23 (even)", FP16, 1.5 * 2.0**-24, 2.0**-23, "subnormal"),
    ("fp16 tie 2.5*2^-24 -> 2^-23 (even)", FP16, 2.5 * 2.0**-24, 2.0**-23, "subnormal"),
    ("fp16 largest subnormal", FP16, 2.0**-14 - 2.0**-24, 2.0**-14 - 2.0**-24, "subnormal"),
    ("fp16 normal tie 2^-14 - 2^-25 -> 2^-14", FP16, 2.0**-14 - 2.0**-25, 2.0**-14, "normal"),
    (
        "fp16 just below the normal tie -> largest subnormal",
        FP16,
        _F32_ULP_DOWN(2.0**-14 - 2.0**-25),
        2.0**-14 - 2.0**-24,
        "subnormal",
    ),
    ("fp16 smallest normal", FP16, 2.0**-14, 2.0**-14, "normal"),
    ("fp16 tie 1 + 2^-11 -> 1 (even)", FP16, 1.0 + 2.0**-11, 1.0, "normal"),
    ("fp16 largest finite", FP16, 65504.0, 65504.0, "normal"),
    ("fp16 65519.99 -> 65504", FP16, _F32(65519.99), 65504.0, "normal"),
    ("fp16 just below 65520 -> 65504", FP16, _F32_ULP_DOWN(65520.0), 65504.0, "normal"),
    ("fp16 overflow tie 65520 -> inf", FP16, 65520.0, INF, "overflow"),
    ("fp16 negative overflow tie -> -inf", FP16, -65520.0, -INF, "overflow"),
    ("fp16 1e6 -> inf", FP16, 1e6, INF, "overflow"),
    ("fp16 inf stays inf", FP16, INF, INF, "inf"),
    ("fp16 nan stays nan", FP16, NAN, NAN, "nan"),
    ("fp16 zero", FP16, 0.0, 0.0, "zero"),
    ("bf16 smallest positive subnormal", BF16, 2.0**-133, 2.0**-133, "subnormal"),
    ("bf16 flush tie 2^-134 -> 0", BF16, 2.0**-134, 0.0, "flushed"),
    ("bf16 just above 2^-134 -> 2^-133", BF16, _F32_ULP_UP(2.0**-134), 2.0**-133, "subnormal"),
    ("bf16 normal tie 2^-126 - 2^-134 -> 2^-126", BF16, 2.0**-126 - 2.0**-134, 2.0**-126, "normal"),
    ("bf16 smallest normal", BF16, 2.0**-126, 2.0**-126, "normal"),
    ("bf16 tie 1 + 2^-8 -> 1 (even)", BF16, 1.0 + 2.0**-8, 1.0, "normal"),
    ("bf16 tie 1 + 3*2^-8 -> 1 + 2^-6 (even)", BF16, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-6, "normal"),
    ("bf16 largest finite", BF16, BF16.max, BF16.max, "normal"),
    ("bf16 overflow tie -> inf", BF16, BF16.overflow_threshold, INF, "overflow"),
    ("bf16 just below the overflow tie -> max", BF16, _F32_ULP_DOWN(BF16.overflow_threshold), BF16.max, "normal"),
    ("e4m3 smallest positive subnormal", FP8_E4M3, 2.0**-9, 2.0**-9, "subnormal"),
    ("e4m3 flush tie 2^-10 -> 0", FP8_E4M3, 2.0**-10, 0.0, "flushed"),
    ("e4m3 just above 2^-10 -> 2^-9", FP8_E4M3, _F32_ULP_UP(2.0**-10), 2.0**-9, "subnormal"),
    ("e4m3 normal tie 2^-6 - 2^-10 -> 2^-6", FP8_E4M3, 2.0**-6 - 2.0**-10, 2.0**-6, "normal"),
    ("e4m3 largest finite 448", FP8_E4M3, 448.0, 448.0, "normal"),
    ("e4m3 overflow tie 464 -> 448 (even)", FP8_E4M3, 464.0, 448.0, "normal"),
    ("e4m3 just above 464 overflows", FP8_E4M3, _F32_ULP_UP(464.0), NAN, "overflow"),
    ("e4m3 480 overflows", FP8_E4M3, 480.0, NAN, "overflow"),
    ("e4m3 1e6 overflows", FP8_E4M3, 1e6, NAN, "overflow"),
    ("e4m3 inf has no encoding", FP8_E4M3, INF, NAN, "inf"),
    ("e5m2 smallest positive subnormal", FP8_E5M2, 2.0**-16, 2.0**-16, "subnormal"),
    ("e5m2 flush tie 2^-17 -> 0", FP8_E5M2, 2.0**-17, 0.0, "flushed"),
    ("e5m2 just above 2^-17 -> 2^-16", FP8_E5M2, _F32_ULP_UP(2.0**-17), 2.0**-16, "subnormal"),
    ("e5m2 largest finite 57344", FP8_E5M2, 57344.0, 57344.0, "normal"),
    ("e5m2 just below 61440 -> 57344", FP8_E5M2, _F32_ULP_DOWN(61440.0), 57344.0, "normal"),
    ("e5m2 overflow tie 61440 -> inf", FP8_E5M2, 61440.0, INF, "overflow"),
    ("fp32 smallest positive subnormal", FP32, 2.0**-149, 2.0**-149, "subnormal"),
    ("fp32 flush tie 2^-150 -> 0", FP32, 2.0**-150, 0.0, "flushed"),
    ("fp32 just above 2^-150 -> 2^-149", FP32, 2.0**-150 * (1 + 2.0**-52), 2.0**-149, "subnormal"),
    ("fp32 largest finite", FP32, FP32.max, FP32.max, "normal"),
    ("fp32 overflow tie -> inf", FP32, FP32.overflow_threshold, INF, "overflow"),
    ("fp32 just below the overflow tie -> max", FP32, FP32.overflow_threshold * (1 - 2.0**-53), FP32.max, "normal"),
]


@pytest.mark.parametrize("name, fmt, x, expected, category", EDGE_CASES, ids=[c[0] for c in EDGE_CASES])
def test_edge_case(name, fmt, x, expected, category):
    assert _same(formats.round_to(fmt, x), expected)
    assert formats.classify(fmt, x) == category
    # The real cast.  fp32 cases start from float64 (a single rounding); the others from float32.
    source = torch.float64 if fmt is FP32 else torch.float32
    assert torch.tensor([x], dtype=torch.float64).to(source).item() == x or math.isnan(x)
    (stored,) = _torch_cast(fmt, [x], source)
    assert _same(stored, formats.round_to(fmt, x, saturate=_saturates(fmt)))
    assert _same(stored, formats.round_like_torch(fmt, x))


def test_saturate_clamps_overflow_and_inf():
    assert formats.round_to(FP16, 1e6, saturate=True) == 65504.0
    assert formats.round_to(FP16, -math.inf, saturate=True) == -65504.0
    assert formats.round_to(FP8_E4M3, 470.0, saturate=True) == 448.0
    assert math.isnan(formats.round_to(FP8_E4M3, math.nan, saturate=True))


# ----- round_to against torch on many values ----------------------------------------------------


def _sample(fmt, rng: random.Random, n: int):
    """Log-uniform magnitudes from below the flush threshold to beyond overflow, both signs,
    plus every boundary and its float32 neighbours."""
    lo = math.log2(fmt.smallest_subnormal) - 3
    hi = math.log2(fmt.max) + 2
    values = [rng.choice((-1.0, 1.0)) * 2.0 ** rng.uniform(lo, hi) for _ in range(n)]
    for b in (
        fmt.smallest_subnormal,
        fmt.flush_threshold,
        1.5 * fmt.smallest_subnormal,
        fmt.smallest_normal,
        fmt.normal_threshold,
        fmt.max,
        fmt.overflow_threshold,
        1.0,
        1.0 + fmt.eps / 2,
    ):
        values += _f32_neighbours(b, 3) if fmt is not FP32 else [b, b * (1 + 2.0**-52), b * (1 - 2.0**-53)]
    values += [0.0, -0.0, math.inf, -math.inf, math.nan]
    return values


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_round_to_matches_torch_casts(fmt):
    rng = random.Random(1234)
    source = torch.float64 if fmt is FP32 else torch.float32
    values = torch.tensor(_sample(fmt, rng, 4000), dtype=torch.float64).to(source).double().tolist()
    stored = _torch_cast(fmt, values, source)
    sat = _saturates(fmt)
    bad = [
        (v, s, formats.round_to(fmt, v, saturate=sat))
        for v, s in zip(values, stored)
        if not _same(s, formats.round_to(fmt, v, saturate=sat))
    ]
    assert not bad, bad[:5]


@pytest.mark.parametrize("fmt", [FP16, BF16, FP8_E4M3, FP8_E5M2], ids=lambda f: f.name)
def test_float64_casts_round_via_float32(fmt):
    # torch casts float64 to 16/8-bit formats through float32: values a hair above a tie land on
    # the tie first and then go to even.  round_like_torch models that; round_to rounds once.
    rng = random.Random(99)
    ties = [fmt.flush_threshold, 1.5 * fmt.smallest_subnormal, fmt.overflow_threshold, 1.0 + fmt.eps / 2]
    values = [t * (1 + s * 2.0**-40) for t in ties for s in (-1, 1)]
    values += [2.0 ** rng.uniform(math.log2(fmt.smallest_subnormal) - 2, math.log2(fmt.max) + 1) for _ in range(2000)]
    stored = _torch_cast(fmt, values, torch.float64)
    assert all(_same(s, formats.round_like_torch(fmt, v)) for v, s in zip(values, stored))
    # ...and the double rounding really differs from a single rounding at the flush tie:
    x = fmt.flush_threshold * (1 + 2.0**-40)
    assert formats.round_like_torch(fmt, x) == 0.0 and formats.round_to(fmt, x) == fmt.smallest_subnormal


def test_classify_via_fp32():
    x = 2.0**-25 * (1 + 2.0**-40)
    assert formats.classify(FP16, x) == "subnormal"
    assert formats.classify(FP16, x, via_fp32=True) == "flushed"
    assert formats.classify(FP16, 1e300, via_fp32=True) == "overflow"
    assert formats.CATEGORIES[:5] == ("zero", "flushed", "subnormal", "normal", "overflow")


def test_formats_torch_lacks_are_described_by_their_encoding():
    # OCP MX fp6: every bit pattern is a number (no inf, no NaN), so the top exponent field holds
    # numbers with any mantissa. Figures from the OCP Microscaling spec v1.0, table 3.
    from lossscale.formats import FP6_E2M3, FP6_E3M2

    assert (FP6_E2M3.max, FP6_E2M3.smallest_normal, FP6_E2M3.smallest_subnormal) == (7.5, 1.0, 0.125)
    assert (FP6_E3M2.max, FP6_E3M2.smallest_normal, FP6_E3M2.smallest_subnormal) == (28.0, 0.25, 0.0625)
    assert not FP6_E2M3.has_inf and not FP6_E2M3.has_nan and FP6_E2M3.encoding == "finite"
    assert formats.get("e3m2") is FP6_E3M2 and formats.get("fp6_e2m3") is FP6_E2M3
    with pytest.raises(ValueError, match="no torch dtype"):
        FP6_E3M2.torch_dtype()
    assert FP8_E4M3.encoding == "fn" and FP16.encoding == "ieee" and FP8_E4M3.has_nan


def test_a_bad_encoding_is_refused():
    with pytest.raises(ValueError, match="encoding"):
        formats.FloatFormat("x", exponent_bits=3, mantissa_bits=2, encoding="fnuz")
