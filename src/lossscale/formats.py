"""Floating-point number formats: exact range facts and rounding what-ifs.

Every figure on a ``FloatFormat`` is *derived* from three layout facts (exponent
bits, mantissa bits, and how the all-ones exponent is used); nothing numeric is typed
in.  The tests check the derived figures against ``torch.finfo`` and check
``round_to`` against real torch casts, value by value.

Pure Python: importing this module does not import torch (only
``FloatFormat.torch_dtype`` does, lazily), so a CLI can print ``table``
without paying for torch.

The facts at the two cliffs, for fp16 (p = 10 mantissa bits, emin = -14, emax = 15):

```text
|x| <= 2^-25                 -> 0        (2^-25 is the tie between 0 and 2^-24; ties go to even: 0)
2^-25 < |x| <= 2^-24         -> 2^-24    (the smallest subnormal)
|x| <  65520                 -> finite   (65519.99 -> 65504, the largest finite value)
|x| >= 65520                 -> inf      (65520 is the tie between 65504 and 2^16; 65504's
                                          mantissa is odd, so the tie goes up, out of range)
```

Examples:
    >>> from lossscale import formats
    >>> fp16 = formats.get("fp16")
    >>> fp16.max, fp16.flush_threshold == 2.0**-25, fp16.overflow_threshold
    (65504.0, True, 65520.0)
    >>> formats.round_to(fp16, 2.0**-25), formats.round_to(fp16, 65520.0)
    (0.0, inf)
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Optional

__all__ = [
    "FloatFormat",
    "FP16",
    "BF16",
    "FP32",
    "FP8_E4M3",
    "FP8_E5M2",
    "FP6_E3M2",
    "FP6_E2M3",
    "FORMATS",
    "ENCODINGS",
    "TORCH_E4M3FN_CAST_SATURATES",
    "get",
    "round_to",
    "round_like_torch",
    "classify",
    "table",
]

# What torch's cast to float8_e4m3fn does with magnitudes beyond 448, measured on torch 2.13
# (CPU): it *saturates* -- finite values past 448 and +-inf become +-448, NaN stays NaN.
# Older releases (c10's scalar fp8e4m3fn_from_fp32_value) produced NaN instead, which is also
# what the OCP spec calls the non-saturating mode.  tests/test_formats.py checks this constant
# against the installed torch, so a behaviour change shows up as a test failure.
TORCH_E4M3FN_CAST_SATURATES = True

#: How a format uses its all-ones exponent field: see ``FloatFormat``.
ENCODINGS = ("ieee", "fn", "finite")


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format, described by its bit layout only.

    Args:
        name: canonical name (``"fp16"``, ``"bf16"``, ``"fp32"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``).
        exponent_bits: width of the exponent field.
        mantissa_bits: width of the stored mantissa (fraction) field, ``p``.
        encoding: how the all-ones exponent field is used (see ``ENCODINGS``).
            ``"ieee"``: reserved for inf and NaN (fp16, bf16, fp32, fp8 e5m2).
            ``"fn"``: the OCP "finite" variant (fp8 e4m3fn): the all-ones exponent holds ordinary
            numbers and only the all-ones bit pattern is NaN, so the largest finite value has
            mantissa ``1...10`` (e4m3: 448) and there is no inf.
            ``"finite"``: every bit pattern is a number, no inf and no NaN (the OCP MX fp6
            formats e3m2 and e2m3): the top exponent field holds numbers with any mantissa.
        torch_name: name of the matching ``torch`` dtype attribute, or None for a format torch
            does not have (then ``torch_dtype`` raises).

    Every other figure is a property derived from these.  All figures are exact Python floats
    (every one of them is representable in float64).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    encoding: str = "ieee"
    torch_name: Optional[str] = None

    def __post_init__(self):
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding={self.encoding!r} must be one of {ENCODINGS}.")
        for name in ("exponent_bits", "mantissa_bits"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1.")

    @property
    def has_inf(self) -> bool:
        """Whether the format has infinities (only the IEEE encoding does)."""
        return self.encoding == "ieee"

    @property
    def has_nan(self) -> bool:
        """Whether the format has a NaN ("finite" formats such as fp6 have none)."""
        return self.encoding != "finite"

    # ----- layout -------------------------------------------------------------------------
    @property
    def bits(self) -> int:
        """Total storage width: sign + exponent + mantissa."""
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        """Exponent bias: a stored exponent field ``e`` means ``2^(e - bias)``."""
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number (field value 1)."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite number.

        IEEE formats reserve the all-ones field for inf/NaN, so the top finite field is
        ``2^E - 2``; the "fn" and "finite" encodings use the all-ones field for numbers too.
        """
        top_field = 2**self.exponent_bits - (2 if self.encoding == "ieee" else 1)
        return top_field - self.bias

    # ----- range --------------------------------------------------------------------------
    @property
    def max(self) -> float:
        """Largest finite value.

        IEEE: mantissa all ones, ``2^emax * (2 - 2^-p)`` (fp16: 65504).  "fn": the all-ones
        mantissa at the top exponent is NaN, so the largest is ``2^emax * (2 - 2^(1-p))``
        (e4m3: 448).
        """
        p = self.mantissa_bits
        # "fn" spends the all-ones mantissa at the top exponent on NaN; the others keep it.
        ulps_below_two = 2 if self.encoding == "fn" else 1
        return math.ldexp(2.0 - math.ldexp(ulps_below_two, -p), self.emax)

    @property
    def smallest_normal(self) -> float:
        """``2^emin``: below it numbers are subnormal and lose precision (``torch.finfo.tiny``)."""
        return math.ldexp(1.0, self.emin)

    @property
    def smallest_subnormal(self) -> float:
        """``2^(emin - p)``: the smallest positive value the format can hold."""
        return math.ldexp(1.0, self.emin - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """``2^-p``: distance from 1.0 to the next larger value (``torch.finfo.eps``)."""
        return math.ldexp(1.0, -self.mantissa_bits)

    # ----- the cliffs ---------------------------------------------------------------------
    @property
    def flush_threshold(self) -> float:
        """Largest magnitude that rounds to zero: ``2^(emin - p - 1)`` (fp16: 2^-25).

        It is the exact midpoint between 0 and the smallest subnormal; round-to-nearest-even
        sends the tie to 0 (zero's mantissa is even), so ``|x| <= flush_threshold`` gives 0
        and anything larger gives at least the smallest subnormal.
        """
        return math.ldexp(1.0, self.emin - self.mantissa_bits - 1)

    @property
    def normal_threshold(self) -> float:
        """Smallest magnitude that rounds to a normal number: ``2^emin * (1 - 2^-(p+1))``.

        The midpoint between the largest subnormal (mantissa all ones, odd) and
        ``smallest_normal`` (even); the tie goes up, so it is included (fp16: 2^-14 - 2^-25).
        """
        p = self.mantissa_bits
        return math.ldexp(1.0 - math.ldexp(1.0, -(p + 1)), self.emin)

    @property
    def overflow_threshold(self) -> float:
        """The midpoint between ``max`` and the next value the exponent range cannot hold.

        ``|x| > overflow_threshold`` always overflows; whether ``|x| == overflow_threshold``
        does is ``overflow_tie_overflows``.  fp16: 65520 (and the tie overflows, to inf);
        e4m3: 464 (the tie rounds back to 448).  "Overflow" here is a property of rounding: the
        magnitude rounds past ``max``.  What a cast then stores differs: IEEE formats store
        inf; for e4m3 a non-saturating cast stores NaN and a saturating cast clamps to 448
        (torch 2.13's CPU cast saturates, see ``TORCH_E4M3FN_CAST_SATURATES``).
        """
        half_ulp_at_max = math.ldexp(1.0, self.emax - self.mantissa_bits - 1)
        return self.max + half_ulp_at_max

    @property
    def overflow_tie_overflows(self) -> bool:
        """Whether exactly ``overflow_threshold`` overflows.

        Round-half-to-even: the tie goes to whichever neighbour has an even mantissa.  IEEE
        ``max`` has an all-ones (odd) mantissa, so the tie goes up and overflows; the "fn"
        ``max`` ends in 0 (even), so the tie stays at ``max``; a "finite" format's ``max`` has
        an all-ones mantissa again, so its tie overflows (to NaN or saturation: it has no inf).
        """
        return self.encoding != "fn"

    # ----- helpers ------------------------------------------------------------------------
    def torch_dtype(self) -> Any:
        """The matching ``torch.dtype`` (imports torch lazily).

        Raises:
            ValueError: the format has no torch dtype (``torch_name`` is None).
        """
        if self.torch_name is None:
            raise ValueError(f"format {self.name!r} has no torch dtype; it can be described, not cast to.")
        import torch

        return getattr(torch, self.torch_name)

    def overflows(self, x: float) -> bool:
        """Whether the finite magnitude ``|x|`` rounds past ``max`` in this format."""
        a = abs(x)
        t = self.overflow_threshold
        return a > t or (a == t and self.overflow_tie_overflows)

    def __str__(self) -> str:
        return self.name


FP16 = FloatFormat("fp16", exponent_bits=5, mantissa_bits=10, torch_name="float16")
BF16 = FloatFormat("bf16", exponent_bits=8, mantissa_bits=7, torch_name="bfloat16")
FP32 = FloatFormat("fp32", exponent_bits=8, mantissa_bits=23, torch_name="float32")
FP8_E4M3 = FloatFormat("fp8_e4m3", exponent_bits=4, mantissa_bits=3, encoding="fn", torch_name="float8_e4m3fn")
FP8_E5M2 = FloatFormat("fp8_e5m2", exponent_bits=5, mantissa_bits=2, torch_name="float8_e5m2")

# The OCP Microscaling (MX) spec's 6-bit element formats. torch has no dtype for them; they are
# described here so their cliffs can be compared with fp16's (e.g. ``lossscale formats``).
FP6_E3M2 = FloatFormat("fp6_e3m2", exponent_bits=3, mantissa_bits=2, encoding="finite")
FP6_E2M3 = FloatFormat("fp6_e2m3", exponent_bits=2, mantissa_bits=3, encoding="finite")

#: Formats without a torch dtype, by canonical name (``get`` finds them; ``FORMATS`` holds torch's).
DESCRIBED_ONLY: Mapping[str, FloatFormat] = {f.name: f for f in (FP6_E3M2, FP6_E2M3)}

#: Canonical name -> format.
FORMATS: Mapping[str, FloatFormat] = {f.name: f for f in (FP16, BF16, FP32, FP8_E4M3, FP8_E5M2)}

_ALIASES: Mapping[str, FloatFormat] = {
    **FORMATS,
    **DESCRIBED_ONLY,
    "e3m2": FP6_E3M2,
    "e2m3": FP6_E2M3,
    "float16": FP16,
    "half": FP16,
    "f16": FP16,
    "bfloat16": BF16,
    "float32": FP32,
    "float": FP32,
    "single": FP32,
    "f32": FP32,
    "fp8_e4m3fn": FP8_E4M3,
    "e4m3": FP8_E4M3,
    "e4m3fn": FP8_E4M3,
    "float8_e4m3fn": FP8_E4M3,
    "e5m2": FP8_E5M2,
    "float8_e5m2": FP8_E5M2,
}


def dtype_name(fmt: "str | FloatFormat") -> Optional[str]:
    """The torch dtype name of a format given by name or alias (``"half"`` -> ``"float16"``), or None."""
    return get(fmt).torch_name


def get(fmt: "str | FloatFormat | Any") -> FloatFormat:
    """Look a format up by name, alias, ``torch.dtype`` or pass a ``FloatFormat`` through.

    Names are case-insensitive; ``"fp16"``, ``"float16"``, ``"half"``, ``"bf16"``,
    ``"bfloat16"``, ``"fp32"``, ``"float32"``, ``"fp8_e4m3"``, ``"e4m3"``, ``"float8_e4m3fn"``,
    ``"fp8_e5m2"``, ``"e5m2"`` and a few more are accepted.

    Raises:
        ValueError: for anything else, listing the valid names.
    """
    if isinstance(fmt, FloatFormat):
        return fmt
    key = None
    if isinstance(fmt, str):
        key = fmt.strip().lower()
    elif type(fmt).__name__ == "dtype" and type(fmt).__module__ == "torch":
        # A torch.dtype, recognised without importing torch: str(torch.float16) == "torch.float16".
        key = str(fmt).rsplit(".", 1)[-1]
    if key is not None and key in _ALIASES:
        return _ALIASES[key]
    valid = ", ".join(sorted(_ALIASES))
    raise ValueError(
        f"fmt={fmt!r} is not a known number format; use one of: {valid} "
        "(or the matching torch dtype, e.g. torch.float16)"
    )


# ----- rounding ---------------------------------------------------------------------------


def round_to(fmt: "str | FloatFormat", x: float, *, saturate: bool = False) -> float:
    """``x`` rounded to ``fmt`` with round-to-nearest-even, subnormals and overflow.

    A pure-Python reference (single rounding of the float64 ``x``), checked against real torch
    casts from float32 in the tests.

    Overflow (``|x|`` rounds past ``fmt.max``) and infinite inputs give ``+-inf`` for formats
    with inf and NaN for the "fn" format (e4m3), unless ``saturate=True``, which clamps both to
    ``+-fmt.max`` -- what torch 2.13's cast to ``float8_e4m3fn`` does (and what CUDA's
    ``satfinite`` conversions do).  NaN stays NaN.  The sign of zero is kept.
    """
    f = get(fmt)
    x = float(x)
    if math.isnan(x):
        return math.nan
    if math.isinf(x):
        return _overflowed(f, x, saturate)
    if x == 0.0:
        return x
    a = abs(x)
    # Quantum (spacing of representable values) at |x|: 2^(e - p) in the binade 2^e <= |x| < 2^(e+1),
    # floored at the subnormal spacing 2^(emin - p).  math.frexp is exact: a = m * 2^k, m in [0.5, 1).
    binade = math.frexp(a)[1] - 1
    if binade > f.emax:
        # Already a whole binade past the largest finite value (and keeps ldexp below from
        # overflowing float64 for magnitudes near 2^1024).
        return _overflowed(f, x, saturate)
    quantum_exp = max(binade, f.emin) - f.mantissa_bits
    # a / 2^q is exact (a power-of-two rescale of a float64, no underflow since it is >= 0.5 here or
    # a is a float64 subnormal only when quantum_exp is far below -1022, which no format reaches).
    # round() on a float is round-half-to-even, i.e. exactly IEEE RNE on the integer count of quanta.
    n = round(math.ldexp(a, -quantum_exp))
    r = math.ldexp(float(n), quantum_exp)
    if r > f.max:
        return _overflowed(f, x, saturate)
    return math.copysign(r, x)


def _overflowed(f: FloatFormat, x: float, saturate: bool) -> float:
    if saturate:
        return math.copysign(f.max, x)
    return math.copysign(math.inf, x) if f.has_inf else math.nan


def _fp32_round(x: float) -> float:
    """float64 -> float32 -> float64 via struct: IEEE RNE by the C library, inf on overflow."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        # struct refuses finite values beyond float32 range instead of rounding them to inf.
        return round_to(FP32, x)


def round_like_torch(fmt: "str | FloatFormat", x: float) -> float:
    """What ``torch.tensor([x], dtype=torch.float64).to(fmt.torch_dtype())`` stores.

    torch converts float64 to fp16/bf16/fp8 *through float32* (c10's Half/BFloat16/Float8
    constructors take a float), so the value is rounded twice: first to float32, then to
    ``fmt``.  The two can differ from a single rounding when the first lands exactly on a tie
    of the second, e.g. fp16: ``2^-25 * (1 + 2^-40)`` rounds to 2^-24 once but to 0 via float32.
    For e4m3 the cast saturates (``TORCH_E4M3FN_CAST_SATURATES``).
    """
    f = get(fmt)
    y = _fp32_round(float(x))
    if f is FP32:
        return y
    return round_to(f, y, saturate=(f is FP8_E4M3 and TORCH_E4M3FN_CAST_SATURATES))


#: The categories ``classify`` returns, in order of magnitude (non-finite inputs last).
CATEGORIES = ("zero", "flushed", "subnormal", "normal", "overflow", "inf", "nan")


def classify(fmt: "str | FloatFormat", x: float, *, via_fp32: bool = False) -> str:
    """Which of ``CATEGORIES`` the float64 ``x`` falls in when stored in ``fmt``.

    ``"zero"``: x is exactly 0.  ``"flushed"``: nonzero, rounds to 0.  ``"subnormal"``: rounds
    to a nonzero value below ``fmt.smallest_normal``.  ``"normal"``: rounds to a normal finite
    value.  ``"overflow"``: finite, but rounds past ``fmt.max`` (whatever the cast then stores:
    inf, NaN or a saturated max).  ``"inf"``/``"nan"``: x itself is not finite.

    With ``via_fp32=True`` x is first rounded to float32 as torch's float64 casts do (see
    ``round_like_torch``); a float32 overflow then counts as ``"overflow"``.
    """
    f = get(fmt)
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf"
    if x == 0.0:
        return "zero"
    if via_fp32:
        x = _fp32_round(x)
        if math.isinf(x):
            return "overflow"
    r = round_to(f, x)
    if not math.isfinite(r):
        return "overflow"
    if r == 0.0:
        return "flushed"
    return "subnormal" if abs(r) < f.smallest_normal else "normal"


# ----- the table --------------------------------------------------------------------------


def pow2_label(v: float) -> str:
    """``2^k`` for an exact power of two, else ``2^k*m`` with the exact mantissa ``m`` in [1, 2); 0, inf
    and NaN as Python writes them (a scale that ``min_scale=None`` let back off to 0 is shown as 0.0)."""
    if v == 0 or not math.isfinite(v):
        return repr(float(v))
    m, k = math.frexp(v)
    m, k = m * 2.0, k - 1
    return f"2^{k}" if m == 1.0 else f"2^{k}*{m!r}"


def table() -> str:
    """A plain-text table of every format's range facts, each value also as a power of two.

    Columns: layout, largest finite value, smallest normal, smallest subnormal, flush threshold
    (``|x| <=`` it rounds to 0), overflow threshold (the midpoint past ``max``; ``>=`` when the
    tie overflows, ``>`` when it does not) and machine epsilon.
    """
    header = (
        "format",
        "layout",
        "max",
        "smallest normal",
        "smallest subnormal",
        "flush to 0 if |x|",
        "overflow if |x|",
        "eps",
    )
    rows = [header]
    for f in FORMATS.values():
        op = ">=" if f.overflow_tie_overflows else ">"
        layout = f"e{f.exponent_bits}m{f.mantissa_bits}" + ("" if f.has_inf else " fn (no inf)")
        rows.append(
            (
                f.name,
                layout,
                f"{f.max:.6g} = {pow2_label(f.max)}",
                f"{f.smallest_normal:.4g} = {pow2_label(f.smallest_normal)}",
                f"{f.smallest_subnormal:.4g} = {pow2_label(f.smallest_subnormal)}",
                f"<= {f.flush_threshold:.4g} = {pow2_label(f.flush_threshold)}",
                f"{op} {f.overflow_threshold:.6g} = {pow2_label(f.overflow_threshold)}",
                f"{f.eps:.4g} = {pow2_label(f.eps)}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def f32(x: float) -> float:
    """Round a Python float to the nearest float32, as a device scale tensor stores it (inf beyond
    float32's range, as the cast on device gives).

    Why: torch keeps the scale in a float32 tensor and multiplies in double before storing
    (``static_cast<float>(scale * growth_factor)``); mirroring that rounding keeps a pure rule
    bitwise equal to its tensor form for any factor, not only powers of two.
    """
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # beyond float32's range: the cast gives inf, as on device
        return math.copysign(math.inf, x)


def is_power_of_two(x: float) -> bool:
    """True when ``x`` is a positive, finite power of two (2**k for any integer k, negative included)."""
    return (
        isinstance(x, (int, float))
        and not isinstance(x, bool)
        and math.isfinite(x)
        and x > 0
        and math.frexp(x)[0] == 0.5
    )
