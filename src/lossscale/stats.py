"""Gradient statistics: how many values a format would flush, keep, or overflow, at any scale.

``grad_stats`` reads a list of gradients once and returns a ``GradStats``: exact counts
of what storing ``x * scale`` in a format (fp16 by default) would do to every element, plus a
histogram from which ``GradStats.at`` answers the same question for another scale without
touching the gradients again.  ``recommend_scale`` turns that into a loss scale.

How it works (the whole algorithm):

```python
# Every input is a float32 value (fp16 and bf16 values are float32 values too), and the
# order of non-negative float32 values is the order of their bit patterns read as integers.
# So "what does the cast of x * scale do" is decided by where A = bits(|x|) falls among
# three integer boundaries, found once per (format, scale) by binary search with an exact
# pure-Python model of torch's cast:
#     B1 = first A that survives (not flushed), B2 = first A that rounds to a normal number,
#     B3 = first A that overflows.
# Each A is binned by (exponent field, class), class = how many of four mantissa
# thresholds T its mantissa reaches, with T = {1} + the mantissas of B1, B2, B3:
for x in gradients:
    A = bits(x) & 0x7FFFFFFF                      # |x|
    field, mantissa = A >> 23, A & 0x7FFFFF
    hist[5 * field + sum(mantissa >= t for t in T)] += 1
# Every boundary is the start of a bin, so each bin lies wholly inside one category and
# summing bins per category gives exact counts.  The threshold 1 separates 0 from fp32
# subnormals, inf from NaN, and exact powers of two from the rest (the fp16 flush tie).
# Fewer than four distinct thresholds leave some classes empty (the slot holds 2^23).
```

At another scale ``s2`` the boundaries move; ``GradStats.at`` recomputes them and sums the
bins again.  A bin that a new boundary cuts in two ("straddles") cannot be split without the
data: its count goes to the side of its lower end and into ``error_bound``, so every count
figure of ``stats.at(s2)`` is within ``error_bound`` of a fresh measurement at ``s2``.  When
``s2 / scale`` is a power of two, the boundaries move by whole binades and stay on bin edges,
so ``error_bound`` is 0 and ``at`` is exact, for every format, as long as the boundaries stay
inside float32's normal range (``|x| >= 2^-126``; for fp16 and fp8 that means scales up to
about 2^100; bf16 and fp32 share float32's exponent range, so their underflow boundaries are
float32 subnormals at scales near 1 and exactness there holds only when no input lands in a
cut bin).  ``error_bound`` says which case you are in.

Cost: one read of the gradients.  They are processed in chunks small enough to stay in cache
(on CPU, 2^19 elements with one thread; 2^15 with more, see ``_chunk_size``), a dozen cheap
integer operations and one histogram per chunk; fp16
and bf16 inputs are histogrammed by their 16-bit pattern directly (one mask and one count per
chunk, the per-pattern counts mapped to bins at the end).  Many small tensors are packed into
one chunk by ``torch._foreach_copy_`` instead of a Python loop of kernels each.  Nothing is
read back to the host: the histogram and ``amax`` stay device tensors inside the
``GradStats``, and **reading a figure syncs host and device** (once; the figures are
then cached).

Examples:
    >>> import torch
    >>> from lossscale.stats import grad_stats, recommend_scale
    >>> g = torch.tensor([2.0**-26, 2.0**-25, 2.0**-24, 1.0, 70000.0, 0.0])
    >>> s = grad_stats([g], scale=1.0, fmt="fp16")
    >>> (s.zeros, s.flushed, s.subnormal, s.overflow)
    (1, 2, 1, 1)
    >>> s.at(2.0**10).flushed      # scaled by 1024, the tiny ones survive...
    0
    >>> s.at(2.0**10).overflow     # ...and 1.0 * 1024 still fits, 70000 * 1024 does not
    1
"""

from __future__ import annotations

import functools
import math
import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from . import formats
from .formats import FloatFormat

__all__ = ["GradStats", "ScaleRecommendation", "grad_stats", "recommend_scale", "NUM_BINS", "METHODS"]

# ----- binning --------------------------------------------------------------------------------

_MANT_BITS = 23
_MANT_ONE = 1 << _MANT_BITS  # one binade in bit-pattern units
_F32_INF_BITS = 0x7F800000
_F32_MAX = 3.4028234663852886e38  # largest finite float32
_NUM_FIELDS = 256  # float32 exponent field values; 255 holds inf and NaN
_NUM_THRESHOLDS = 4
_NUM_CLASSES = _NUM_THRESHOLDS + 1
#: Length of ``GradStats.hist``: (exponent field, mantissa class) pairs.
NUM_BINS = _NUM_FIELDS * _NUM_CLASSES

# Category rows of the bin -> category matrix, in magnitude order, plus the straddle row.
_ZERO, _FLUSHED, _SUBNORMAL, _NORMAL, _OVERFLOW, _INF, _NAN, _STRADDLE = range(8)
_NUM_ROWS = 8
_RANK = {"zero": 0, "flushed": 0, "subnormal": 1, "normal": 2, "overflow": 3}
#: The categories that partition the nonzero finite inputs (see GradStats.frac_of_nonzero).
_NONZERO_FINITE = ("flushed", "subnormal", "normal", "overflow")

_CPU_CHUNK = 1 << 19  # 2 MiB of float32: the working buffers stay in L2/L3 between operations
# torch's intra-op grain (at::internal::GRAIN_SIZE): CPU operators on at most this many elements
# run on the calling thread without opening an OpenMP parallel region.
_CPU_SERIAL_CHUNK = 1 << 15
_DEVICE_CHUNK = 1 << 22  # accelerators: large enough that kernel launches are negligible


def _chunk_size(device: torch.device) -> int:
    """Elements per chunk.

    With one intra-op thread, large chunks (fewest Python calls).  With several, chunks at torch's
    grain, so that none of the ~16 operators per chunk opens a parallel region: each region ends
    in a barrier that waits for the slowest thread, and on a machine where other processes hold
    the cores that wait is a scheduler time slice -- measured on 2 shared cores, 10M elements took
    a median of 470 ms (worst 2.7 s) with large chunks and 58 ms (worst 118 ms) with grain-sized
    ones.  The histogram itself is serial either way.
    """
    if device.type != "cpu":
        return _DEVICE_CHUNK
    if torch.get_num_threads() == 1:
        return _CPU_CHUNK
    return min(_CPU_CHUNK, _CPU_SERIAL_CHUNK)


_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


def _f32_from_bits(a: int) -> float:
    return struct.unpack("<f", struct.pack("<I", a))[0]


@functools.lru_cache(maxsize=1024)
def _boundaries(fmt: FloatFormat, scale: float) -> Tuple[int, int, int]:
    """``(B1, B2, B3)``: the first float32 bit patterns |x| that survive / are normal / overflow.

    Exact by construction: a binary search over all positive float32 patterns, judged by
    ``lossscale.formats.classify`` of ``x * scale`` in float64 rounded via float32 -- the
    path ``(x.double() * scale).to(dtype)`` takes in torch.  The category only ever grows with
    |x| (multiplication by a positive scale and rounding are monotone), so the search is valid.
    A boundary no finite input reaches is reported as the inf pattern.
    """

    def rank(a: int) -> int:
        return _RANK[formats.classify(fmt, _f32_from_bits(a) * scale, via_fp32=True)]

    out = []
    for level in (1, 2, 3):
        lo, hi = 1, _F32_INF_BITS
        while lo < hi:
            mid = (lo + hi) // 2
            if rank(mid) >= level:
                hi = mid
            else:
                lo = mid + 1
        out.append(lo)
    return tuple(out)  # type: ignore[return-value]


def _thresholds_for(bounds: Sequence[int]) -> Tuple[int, ...]:
    """The four mantissa thresholds that put every boundary on a bin edge.

    1 is always one of them (it separates 0, inf and exact powers of two from their bin-mates).
    A boundary at a binade start (mantissa 0) is already an edge and needs no threshold.
    Unused slots hold ``2^23``, which no mantissa reaches: their classes stay empty and the
    kernel skips them (3 fewer passes over the chunk each).  For fp16 at a power-of-two scale
    only three are used: 1, ``2^23 - 2^13`` and ``2^23 - 2^12``.
    """
    ts = sorted({1} | {b & (_MANT_ONE - 1) for b in bounds if b & (_MANT_ONE - 1)})
    return tuple(ts + [_MANT_ONE] * (_NUM_THRESHOLDS - len(ts)))


def _category_matrix(thresholds: Tuple[int, ...], bounds: Tuple[int, int, int], device: torch.device) -> torch.Tensor:
    """``W[row, bin]`` on ``device``: 1 where bin belongs to category ``row``; row 7 marks straddling bins.

    Bin ``5 * field + c`` holds the patterns ``[field * 2^23 + e_c, field * 2^23 + e_(c+1))``
    with ``e = (0, *thresholds, 2^23)``.  Its category is ``flushed + rank(first pattern)``, where
    ``rank(a)`` counts the boundaries at or below ``a``; it straddles when its last pattern has
    another rank.  Two special cases come from threshold 1: bin 0 is the pattern 0 alone (zero),
    and the top field splits into inf (mantissa 0) and NaN.

    Built by elementwise ops on the device itself, from ``arange`` and Python scalars: on CUDA a
    ``torch.tensor(list, device=...)`` or a ``.to(device)`` from pageable host memory waits for the
    stream (a hidden sync, and an error inside CUDA-graph capture).  All integer arithmetic, so it is
    the same matrix on every device; ``tests/test_stats.py`` checks it bit for bit against the
    pure-Python definition.  Cached per device by ``_cached_on``.
    """
    i64 = torch.int64
    edges = (0, *thresholds, _MANT_ONE)
    starts = torch.arange(_NUM_FIELDS, dtype=i64, device=device).mul_(_MANT_ONE)  # field << 23
    lo = torch.empty((_NUM_FIELDS, _NUM_CLASSES), dtype=i64, device=device)
    hi = torch.empty_like(lo)
    for c in range(_NUM_CLASSES):
        torch.add(starts, edges[c], out=lo[:, c])
        torch.add(starts, edges[c + 1], out=hi[:, c])
    lo, hi = lo.reshape(-1), hi.reshape(-1)  # row-major: index 5 * field + c, the kernel's bin numbering

    def rank(a: torch.Tensor) -> torch.Tensor:  # boundaries at or below each pattern
        r = torch.zeros_like(a)
        for b in bounds:
            r.add_(torch.ge(a, b))
        return r

    r_lo = rank(lo)
    straddle = torch.gt(hi, lo) & torch.ne(rank(hi - 1), r_lo)  # hi - 1: the bin's last pattern
    category = r_lo + _FLUSHED
    top = _NUM_CLASSES * (_NUM_FIELDS - 1)
    # fill_ on slices, not ``t[i] = v``: on CUDA, item assignment goes through a CPU scalar tensor.
    category[:1].fill_(_ZERO)  # the pattern 0 alone (threshold 1 again)
    category[top : top + 1].fill_(_INF)  # top field, mantissa 0
    category[top + 1 :].fill_(_NAN)  # top field, any other mantissa
    straddle[:1].fill_(False)
    straddle[top:].fill_(False)
    rows = torch.arange(_NUM_ROWS, dtype=i64, device=device).unsqueeze(1)
    w = torch.eq(category.unsqueeze(0), rows).to(i64)  # category <= 6: row 7 stays 0 here
    w[_STRADDLE].copy_(straddle)  # device to device
    return w


# Device tables, cached per (builder, arguments, device).  Bounded: a long run that asks for many
# (format, scale) pairs rebuilds tables now and then instead of growing without limit.
_device_tables: Dict[Tuple[Any, ...], Any] = {}
_device_lock = threading.Lock()


def _cached_on(make, args: Tuple[Any, ...], device: torch.device):
    """``make(*args, device)``, cached per device.

    ``make`` builds its tensors on ``device`` with device ops (no host-to-device copy; see
    ``_category_matrix``), so a first call costs a few small kernels and no sync.
    """
    key = (make.__name__, args, str(device))
    value = _device_tables.get(key)
    if value is None:
        value = make(*args, device)
        with _device_lock:
            if len(_device_tables) > 256:
                _device_tables.clear()
            _device_tables[key] = value
    return value


# ----- the result -----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class GradStats:
    """What storing ``x * scale`` in ``fmt`` would do to a set of gradients.

    Made by ``grad_stats`` (a measurement) or ``at`` (the same histogram judged at another
    scale or format).  The raw data are two device tensors; every figure below is a read-only
    property computed from them.  **Reading a figure syncs host and device** -- once: all
    figures are fetched together and cached.

    Fields:
        fmt: the storage format judged.
        scale: the scale multiplied into every value before storing.
        hist: int64 tensor of ``NUM_BINS`` counts, bin ``5 * exponent_field + class`` of
            ``|x|``'s float32 bits (see the module docstring).  Sum it across ranks to combine.
        amax_tensor: 0-dim float32 tensor, max ``|x|`` over finite inputs (0 if none); unscaled.
            Max-reduce it across ranks.
        thresholds: the four mantissa thresholds that define the classes of ``hist``.

    Figures (plain Python numbers; counts are ints):
        numel: elements seen (including zeros, inf and NaN).
        zeros: inputs exactly 0.
        flushed: nonzero finite inputs whose stored value is 0.
        subnormal: inputs stored as a nonzero subnormal (below ``fmt.smallest_normal``).
        normal: inputs stored as a normal finite value.
        overflow: finite inputs whose magnitude rounds past ``fmt.max`` (stored as inf, or as
            NaN / a saturated ``max`` for e4m3 -- see ``FloatFormat.overflow_threshold``).
        inf: inputs already infinite (not counted as overflow).
        nan: inputs already NaN (not counted as overflow).
        amax: max ``|x|`` over finite inputs, unscaled.
        headroom_bits: ``log2(fmt.max / (amax * scale))``; negative means the largest value
            overflows; ``inf`` when ``amax == 0``.
        error_bound: 0 for a measurement; for ``at``, the number of elements in bins that a
            boundary cuts, which bounds the error of every count figure.
        zeros_frac: ``zeros / numel`` (0.0 when ``numel == 0``, as every fraction below).
        flushed_frac: ``flushed / numel``.
        subnormal_frac: ``subnormal / numel``.
        normal_frac: ``normal / numel``.
        overflow_frac: ``overflow / numel``.
        nonfinite_frac: ``(inf + nan) / numel``.

    Views: ``frac_of_nonzero`` (a count over the nonzero finite inputs, so exact zeros do not
    dilute it) and ``binades`` (the exponent histogram of ``x * scale``).

    ``numel == zeros + flushed + subnormal + normal + overflow + inf + nan`` always.

    To rebuild from reduced tensors use ``dataclasses.replace(stats, hist=..., amax_tensor=...)``
    (the cache of figures is not copied).
    """

    fmt: FloatFormat
    scale: float
    hist: torch.Tensor
    amax_tensor: torch.Tensor
    thresholds: Tuple[int, ...]
    _cache: Dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    # ----- device-side ------------------------------------------------------------------------
    def counts_tensor(self) -> torch.Tensor:
        """int64 device tensor of the 8 counts (zero, flushed, subnormal, normal, overflow, inf,
        nan, straddling), computed without a sync."""
        t = self._cache.get("counts_tensor")
        if t is None:
            bounds = _boundaries(self.fmt, self.scale)
            w = _cached_on(_category_matrix, (self.thresholds, bounds), self.hist.device)
            t = (w * self.hist).sum(dim=1)
            self._cache["counts_tensor"] = t
        return t

    def _packed(self) -> torch.Tensor:
        """Everything the figures need in one float64 vector (the histogram too, for to_dict): float64
        holds every count exactly (< 2^53) and the float32 amax exactly. No sync."""
        return torch.cat(
            [
                self.counts_tensor().to(torch.float64),
                self.amax_tensor.reshape(1).to(torch.float64),
                self.hist.to(torch.float64),
            ]
        )

    def _take(self, values: List[float]) -> None:
        """Cache the figures from a host copy of ``_packed``."""
        counts = [int(v) for v in values[:_NUM_ROWS]]
        names = ("zeros", "flushed", "subnormal", "normal", "overflow", "inf", "nan", "error_bound")
        fig = dict(zip(names, counts))
        fig["numel"] = sum(counts[:_STRADDLE])
        fig["amax"] = float(values[_NUM_ROWS])
        fig["hist"] = {i: int(c) for i, c in enumerate(values[_NUM_ROWS + 1 :]) if c}
        self._cache["figures"] = fig

    def _figures(self) -> Dict[str, Any]:
        if "figures" not in self._cache:
            self._take(self._packed().tolist())  # the one host sync
        return self._cache["figures"]

    @property
    def numel(self) -> int:
        """Elements seen, zeros and non-finite ones included."""
        return self._figures()["numel"]

    @property
    def zeros(self) -> int:
        """Inputs exactly 0."""
        return self._figures()["zeros"]

    @property
    def flushed(self) -> int:
        """Nonzero finite inputs stored as 0 (lost to underflow)."""
        return self._figures()["flushed"]

    @property
    def subnormal(self) -> int:
        """Inputs stored as a nonzero subnormal (kept, with fewer significant bits)."""
        return self._figures()["subnormal"]

    @property
    def normal(self) -> int:
        """Inputs stored as a normal finite number."""
        return self._figures()["normal"]

    @property
    def overflow(self) -> int:
        """Finite inputs whose magnitude rounds past ``fmt.max``."""
        return self._figures()["overflow"]

    @property
    def inf(self) -> int:
        """Inputs that are +-inf already."""
        return self._figures()["inf"]

    @property
    def nan(self) -> int:
        """Inputs that are NaN already."""
        return self._figures()["nan"]

    @property
    def error_bound(self) -> int:
        """Largest possible error of any count figure (0: exact)."""
        return self._figures()["error_bound"]

    @property
    def amax(self) -> float:
        """Max ``|x|`` over finite inputs, before scaling (0.0 if there are none)."""
        return self._figures()["amax"]

    @property
    def headroom_bits(self) -> float:
        """``log2(fmt.max / (amax * scale))``: binades to spare above the largest value."""
        amax = self.amax
        if amax == 0.0:
            return math.inf
        # Sum of logs: amax * scale itself may overflow float64 for absurd scales.
        return math.log2(self.fmt.max) - math.log2(amax) - math.log2(self.scale)

    def _frac(self, name: str) -> float:
        n = self.numel
        return self._figures()[name] / n if n else 0.0

    @property
    def zeros_frac(self) -> float:
        """``zeros / numel``."""
        return self._frac("zeros")

    @property
    def flushed_frac(self) -> float:
        """``flushed / numel``."""
        return self._frac("flushed")

    @property
    def subnormal_frac(self) -> float:
        """``subnormal / numel``."""
        return self._frac("subnormal")

    @property
    def normal_frac(self) -> float:
        """``normal / numel``."""
        return self._frac("normal")

    @property
    def overflow_frac(self) -> float:
        """``overflow / numel``."""
        return self._frac("overflow")

    @property
    def nonfinite_frac(self) -> float:
        """``(inf + nan) / numel``."""
        n = self.numel
        return (self.inf + self.nan) / n if n else 0.0

    def frac_of_nonzero(self, name: str) -> float:
        """``<name> / (numel - zeros - inf - nan)``: a count's share of the nonzero finite inputs.

        ``name`` is one of "flushed", "subnormal", "normal", "overflow" (the four add up to the
        nonzero finite inputs).  Unlike ``flushed_frac`` and friends, exact zeros (ReLU's, say)
        do not dilute it: ``frac_of_nonzero("flushed")`` is the share of gradient *signal* lost.
        0.0 when there are no nonzero finite inputs.
        """
        if name not in _NONZERO_FINITE:
            raise ValueError(f"name={name!r} must be one of {_NONZERO_FINITE}")
        f = self._figures()
        n = f["numel"] - f["zeros"] - f["inf"] - f["nan"]
        return f[name] / n if n else 0.0

    def binades(self) -> Dict[int, int]:
        """``{e: count}`` of the nonzero finite inputs with ``2**e <= |x * scale| < 2**(e+1)``.

        Read from ``hist`` (no pass over the gradients): a binade is one exponent field, its
        five mantissa classes summed.  Exact only when ``scale`` is a power of two, which shifts
        every binade by ``log2(scale)`` without moving any value across a binade edge; any other
        scale raises ValueError.  Float32 subnormal inputs (``|x| < 2^-126``) all land in the
        binade ``-127 + log2(scale)``, far below any format's underflow cliff.  Syncs (once, as
        reading any figure).

        >>> grad_stats([torch.tensor([2.0**-30, 1.5 * 2.0**-30, 1.0, 0.0])]).at(2.0**10).binades()
        {-20: 2, 10: 1}
        """
        shift = math.log2(self.scale)
        if shift != int(shift):
            raise ValueError(
                f"binades(): scale={self.scale!r} is not a power of two, so the binades of x * scale "
                "are not exact; read them at a power of two with .at(2.0**k).binades()"
            )
        out: Dict[int, int] = {}
        for i, count in sorted(self._figures()["hist"].items()):
            field_, cls = divmod(i, _NUM_CLASSES)
            if (field_ == 0 and cls == 0) or field_ == _NUM_FIELDS - 1:  # exact zeros; inf and NaN
                continue
            e = field_ - 127 + int(shift)  # float32's exponent bias
            out[e] = out.get(e, 0) + count
        return out

    # ----- what-ifs and combination ------------------------------------------------------------
    def at(self, scale: float, fmt: "str | FloatFormat | None" = None) -> "GradStats":
        """The same gradients judged at another ``scale`` (and optionally another ``fmt``).

        Uses only the histogram: no pass over the gradients, no sync until a figure is read.
        Exact when ``scale / self.scale`` is a power of two and ``fmt`` is unchanged (boundaries
        inside float32's normal range); otherwise each count figure is within ``error_bound``
        of a fresh ``grad_stats`` at that scale.
        """
        f = self.fmt if fmt is None else _check_fmt(fmt)
        s = _check_scale(scale)
        return GradStats(f, s, self.hist, self.amax_tensor, self.thresholds)

    def merge(self, other: "GradStats") -> "GradStats":
        """Statistics of the union of both groups of tensors (histograms add, ``amax`` max).

        Both must have been measured with the same ``fmt`` and ``scale``.  The result lives on
        ``self``'s device: ``other``'s histogram and ``amax`` are moved there first (no sync
        between accelerators; onto the CPU the copy waits for the accelerator, as in
        ``grad_stats``).
        """
        if not isinstance(other, GradStats):
            raise ValueError(f"other={other!r} is not a GradStats; merge two grad_stats() results")
        if (self.fmt, self.scale, self.thresholds) != (other.fmt, other.scale, other.thresholds):
            raise ValueError(
                f"cannot merge stats of fmt={self.fmt.name}, scale={self.scale!r} with stats of "
                f"fmt={other.fmt.name}, scale={other.scale!r}; measure both groups with the same "
                "fmt and scale (use .at() on the merged result for other scales)"
            )
        device = self.hist.device
        return GradStats(
            self.fmt,
            self.scale,
            self.hist + _move(other.hist, device),
            torch.maximum(self.amax_tensor, _move(other.amax_tensor, device)),
            self.thresholds,
        )

    __add__ = merge

    # ----- plain data ---------------------------------------------------------------------------
    _FIGURE_NAMES = (
        "numel",
        "zeros",
        "flushed",
        "subnormal",
        "normal",
        "overflow",
        "inf",
        "nan",
        "amax",
        "headroom_bits",
        "error_bound",
        "zeros_frac",
        "flushed_frac",
        "subnormal_frac",
        "normal_frac",
        "overflow_frac",
        "nonfinite_frac",
    )

    def to_dict(self) -> Dict[str, Any]:
        """Every figure as plain Python numbers, plus what ``from_dict`` needs to rebuild.

        Keys: ``fmt`` (name), ``scale``, the figures above, ``thresholds`` and ``hist`` (the
        nonzero bins as ``{bin_index: count}``).  Syncs once (it reads the figures).
        """
        d: Dict[str, Any] = {"fmt": self.fmt.name, "scale": self.scale}
        for name in self._FIGURE_NAMES:
            d[name] = getattr(self, name)
        d["thresholds"] = list(self.thresholds)
        d["hist"] = dict(self._figures()["hist"])
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any], device: "str | torch.device" = "cpu") -> "GradStats":
        """Rebuild a ``GradStats`` from ``to_dict`` output (JSON keys may be strings).

        Reads the keys ``fmt``, ``scale``, ``amax``, ``thresholds`` and ``hist``; the figures in
        ``d`` are recomputed from them, not read.  Raises ValueError naming the key that is
        missing or malformed.
        """
        where = "GradStats.from_dict"
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}: d={d!r} must be a dict, as GradStats.to_dict() returns")
        missing = [k for k in ("fmt", "scale", "amax", "thresholds", "hist") if k not in d]
        if missing:
            raise ValueError(
                f"{where}: missing key(s) {missing}; pass a dict from GradStats.to_dict() "
                "(it has 'fmt', 'scale', 'amax', 'thresholds' and 'hist')"
            )
        try:
            fmt = formats.get(d["fmt"])
        except ValueError as e:
            raise ValueError(f"{where}: key 'fmt': {e}") from None
        try:
            scale = _check_scale(d["scale"])
        except ValueError as e:
            raise ValueError(f"{where}: key 'scale': {e}") from None
        amax = d["amax"]
        if (
            isinstance(amax, bool)
            or not isinstance(amax, (int, float))
            or not (math.isfinite(amax) and 0 <= amax <= _F32_MAX)
        ):
            raise ValueError(f"{where}: key 'amax'={amax!r} must be a finite number >= 0 (a float32 value)")
        ts = d["thresholds"]
        if (
            not isinstance(ts, (list, tuple))
            or len(ts) != _NUM_THRESHOLDS
            or any(isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= _MANT_ONE for t in ts)
            or list(ts) != sorted(ts)
        ):
            raise ValueError(
                f"{where}: key 'thresholds'={ts!r} must be {_NUM_THRESHOLDS} ascending ints in "
                f"[1, 2^23], as to_dict() writes them"
            )
        hist_d = d["hist"]
        if not isinstance(hist_d, Mapping):
            raise ValueError(f"{where}: key 'hist' must be a dict {{bin index: count}}, got {type(hist_d).__name__}")
        counts = [0] * NUM_BINS
        for k, c in hist_d.items():
            try:
                i = int(k)
            except (TypeError, ValueError):
                i = -1
            if isinstance(k, bool) or not 0 <= i < NUM_BINS:
                raise ValueError(f"{where}: key 'hist' has bin index {k!r}; bins are 0..{NUM_BINS - 1}")
            if isinstance(c, bool) or not isinstance(c, int) or c < 0:
                raise ValueError(f"{where}: key 'hist' bin {k!r} has count {c!r}; counts are ints >= 0")
            counts[i] = c
        device = torch.device(device)
        return cls(
            fmt,
            scale,
            # Host data must travel once here (a load, not a training step).
            torch.tensor(counts, dtype=torch.int64).to(device),
            # A fill on the device: no host-to-device copy for the scalar.
            torch.full((), float(amax), dtype=torch.float32, device=device),
            tuple(ts),
        )

    def __repr__(self) -> str:
        # Reading the figures syncs; a repr is a read.
        f = self._figures()
        bound = f" +-{f['error_bound']}" if f["error_bound"] else ""
        return (
            f"GradStats({self.fmt.name} at scale={self.scale:g}: numel={f['numel']}, "
            f"zeros={f['zeros']}, flushed={f['flushed']} ({self.flushed_frac:.3%}), "
            f"subnormal={f['subnormal']}, overflow={f['overflow']}, inf={f['inf']}, "
            f"nan={f['nan']}, amax={f['amax']:.6g}, headroom_bits={self.headroom_bits:.2f}{bound})"
        )


# ----- validation -------------------------------------------------------------------------------


def _check_fmt(fmt: Any) -> FloatFormat:
    return formats.get(fmt)  # raises ValueError listing the valid names


def _check_scale(scale: Any) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        hint = " (a tensor: pass float(scale) -- reading it syncs)" if isinstance(scale, torch.Tensor) else ""
        raise ValueError(f"scale={scale!r} must be a positive finite Python number{hint}")
    s = float(scale)
    if not (math.isfinite(s) and s > 0.0):
        raise ValueError(f"scale={scale!r} must be positive and finite, e.g. 1.0 or 2.0**16")
    return s


def _collect(tensors: Any) -> List[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        items: Iterable[Any] = [tensors]
    elif isinstance(tensors, (str, bytes)) or not isinstance(tensors, Iterable):
        raise ValueError(
            f"tensors={tensors!r} must be a tensor or an iterable of tensors "
            "(e.g. [p.grad for p in model.parameters()])"
        )
    else:
        items = tensors
    out = []
    for i, t in enumerate(items):
        if t is None:  # parameters without a gradient
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"tensors[{i}]={t!r} is not a tensor; pass tensors (None entries are skipped)")
        if t.dtype not in _SUPPORTED:
            raise ValueError(
                f"tensors[{i}] has dtype {t.dtype}; grad_stats measures float32, float16 and "
                "bfloat16 tensors -- convert it first (e.g. .float(), which rounds float64 values)"
            )
        if t.layout != torch.strided:
            raise ValueError(f"tensors[{i}] has layout {t.layout}; pass a dense tensor (.to_dense())")
        out.append(t)
    return out


def _device_of(t: torch.Tensor) -> torch.device:
    """The device whose kernels measure ``t`` (one group of work per device)."""
    return t.device


def _move(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (itself when it is there already).

    Only small tensors travel here (a histogram, an ``amax``).  Onto an accelerator the copy is
    ordered on the streams and the host does not wait.  Onto the CPU it is a blocking copy, which
    waits for the source device: a ``non_blocking`` one would land in pinned memory that the CPU
    code reading it next could read before the copy has finished.
    """
    if t.device == device:
        return t
    return t.to(device, non_blocking=device.type != "cpu")


# ----- the kernels ------------------------------------------------------------------------------


#: The histogram methods ``grad_stats`` accepts (see its ``method`` argument).
METHODS = ("auto", "bincount", "index_add", "histc", "sort")


def _resolve_method(method: Any, devices: Sequence[torch.device]) -> str:
    """The concrete counting method for ``method`` on these devices (ValueError when unusable)."""
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method={method!r} must be one of {METHODS}; 'auto' picks per device")
    if method == "bincount":
        other = sorted({str(d) for d in devices if d.type != "cpu"})
        if other:
            raise ValueError(
                f"method='bincount' on {other}: torch.bincount reads the largest key on the host there "
                "(a sync); use method='auto' (index_add on accelerators), 'histc' or 'sort'"
            )
    return method


def _count_into(hist: torch.Tensor, keys: torch.Tensor, method: str, ones: torch.Tensor) -> None:
    """``hist[k] += 1`` for every key in ``keys`` (integers in ``[0, hist.numel())``); no host sync.

    All methods give the same int64 histogram bit for bit (they only count):

    * ``bincount`` -- CPU only: the fastest CPU histogram (one plain loop).  On CUDA it reads the
      keys' max on the host (a sync), so ``grad_stats`` refuses it there.
    * ``index_add`` -- ``hist.index_add_(keys, 1)``: one int64 atomic add per element in global
      memory.  The accelerator default; exact, but gradients crowd into a few dozen hot bins, so
      the atomics contend (not measured on a GPU yet).
    * ``histc`` -- ``torch.histc`` over the keys as float32 with ``min=0, max=nbins``: on CUDA a
      kernel that counts per thread block in shared memory and merges the partial histograms
      (when ``nbins`` floats fit in shared memory: the 1,280 bins of the float32 path do, the
      32,768 patterns of the 16-bit path do not and fall back to global atomics).  Exact: a key
      ``k < 2^15`` is a float32 integer, ``k * nbins`` stays exact (below 2^24, or ``nbins`` is a
      power of two) and dividing it by ``nbins`` gives ``k`` back, so every key lands in its own
      bin; the float32 counts are exact below 2^24, and one call sees at most one chunk
      (<= 2^22 elements), so they convert to int64 exactly.
    * ``sort`` -- sort the keys, then ``searchsorted`` the bin edges ``0..nbins`` and take the
      differences: no atomics at all (a radix sort on CUDA), at the cost of sorting every chunk.
    """
    nbins = hist.numel()
    if method == "bincount":
        hist.add_(torch.bincount(keys, minlength=nbins))
    elif method == "index_add":
        if keys.dtype not in (torch.int32, torch.int64):
            keys = keys.int()  # index_add_ takes int32/int64 indices
        hist.index_add_(0, keys, ones.expand(keys.numel()))
    elif method == "histc":
        counts = torch.histc(keys.float(), bins=nbins, min=0, max=nbins)
        hist.add_(counts.to(torch.int64))
    else:  # "sort"
        if keys.dtype != torch.int32:
            keys = keys.int()  # the edges below go up to nbins, which int16 cannot hold
        ordered = torch.sort(keys).values
        edges = torch.arange(nbins + 1, dtype=torch.int32, device=keys.device)
        hist.add_(torch.searchsorted(ordered, edges).diff())


def _chunks(tensors: List[torch.Tensor], staging: torch.Tensor):
    """Yield 1-D tensors (of ``staging``'s dtype) covering every element of ``tensors`` once.

    Large contiguous tensors are yielded as slices (no copy).  Small or strided ones are packed
    into ``staging`` with one ``_foreach_copy_`` per chunk, so a model with hundreds of small
    gradients costs a handful of kernels rather than hundreds (and one Python call per tensor).
    """
    cap = staging.numel()
    batch: List[torch.Tensor] = []
    sizes: List[int] = []
    filled = 0
    for t in tensors:
        n = t.numel()
        if n == 0:
            continue
        contiguous = t.is_contiguous()
        if (n >= cap // 4 and contiguous) or n > cap:
            flat = t.view(-1) if contiguous else t.reshape(-1)  # large and strided: one copy
            for i in range(0, n, cap):
                yield flat[i : i + cap]
            continue
        if filled + n > cap:
            yield _pack(staging, batch, sizes, filled)
            batch, sizes, filled = [], [], 0
        batch.append(t)
        sizes.append(n)
        filled += n
    if filled:
        yield _pack(staging, batch, sizes, filled)


def _pack(staging: torch.Tensor, batch: List[torch.Tensor], sizes: List[int], filled: int) -> torch.Tensor:
    dsts = [d.view(t.shape) for d, t in zip(staging[:filled].split(sizes), batch)]
    torch._foreach_copy_(dsts, batch)  # handles strided sources; one call for the whole batch
    return staging[:filled]


def _bin_keys(a: torch.Tensor, out: torch.Tensor, tmp: torch.Tensor, thresholds: Tuple[int, ...]) -> torch.Tensor:
    """``out = 5 * (a >> 23) + #{t in thresholds : (a & 0x7FFFFF) >= t}`` for int32 ``a >= 0``.

    Integer arithmetic only, so it is exact: ``(a - t) >> 23`` is ``field - 1`` plus 1 exactly
    when the mantissa reaches ``t`` (arithmetic shift = floor division; ``a - t`` cannot
    overflow since ``0 < t < 2^23``).  Summing that over the thresholds and the field itself
    counts the thresholds reached without a comparison (which would materialise bool tensors).
    Thresholds equal to ``2^23`` are never reached and are skipped.
    """
    active = [t for t in thresholds if t < _MANT_ONE]
    torch.bitwise_right_shift(a, _MANT_BITS, out=out)
    if len(active) < _NUM_THRESHOLDS:
        # Each skipped threshold would have contributed "field - 1 + 0"; keep the stride of 5.
        out.mul_(_NUM_CLASSES - len(active))
    for t in active:
        torch.sub(a, t, out=tmp)
        tmp.bitwise_right_shift_(_MANT_BITS)
        out.add_(tmp)
    out.add_(len(active))
    return out


def _accumulate_f32(ts, thresholds, hist, amax_parts, chunk, method, ones) -> None:
    """float32: per chunk, bin keys by integer arithmetic on the bits, one count, one finite max."""
    device = hist.device
    n_total = sum(t.numel() for t in ts)
    c = min(chunk, n_total)
    staging = torch.empty(c, dtype=torch.float32, device=device)
    a_buf = torch.empty(c, dtype=torch.int32, device=device)
    k_buf = torch.empty(c, dtype=torch.int32, device=device)
    t_buf = torch.empty(c, dtype=torch.int32, device=device)
    for chunk_values in _chunks(ts, staging):
        bits = chunk_values.view(torch.int32)  # same size: a reinterpretation, never a copy
        n = bits.numel()
        # |x| as bits: clearing the sign bit makes integer order equal magnitude order.
        a = torch.bitwise_and(bits, 0x7FFFFFFF, out=a_buf[:n])
        # amax over finite inputs only: inf and NaN patterns become 0 before the max.
        finite = torch.nan_to_num(a.view(torch.float32), 0.0, 0.0, 0.0, out=t_buf[:n].view(torch.float32))
        amax_parts.append(torch.amax(finite))
        keys = _bin_keys(a, k_buf[:n], t_buf[:n], thresholds)
        _count_into(hist, keys, method, ones)


def _pattern_tables(
    dtype: torch.dtype, thresholds: Tuple[int, ...], device: torch.device
) -> Tuple[torch.Tensor, torch.Tensor]:
    """For every 15-bit magnitude pattern of a 16-bit float dtype: its bin and its value, on ``device``.

    The value is 0 for inf/NaN patterns, so a max over present patterns is the finite amax.  Built
    on the device from an ``arange`` (no host-to-device copy, see ``_category_matrix``); cached
    per device by ``_cached_on``.
    """
    # arange in int32 (every backend has it), narrowed on the device: the values are < 2^15.
    patterns = torch.arange(1 << 15, dtype=torch.int32, device=device).to(torch.int16)
    values = patterns.view(dtype).float()  # exact: fp16 and bf16 widen to float32 losslessly
    a = values.view(torch.int32)
    bins = _bin_keys(a, torch.empty_like(a), torch.empty_like(a), thresholds).long()
    finite_values = torch.nan_to_num(values, 0.0, 0.0, 0.0)
    return bins, finite_values


def _accumulate_16bit(ts, dtype, thresholds, hist, amax_parts, chunk, method, ones) -> None:
    """fp16/bf16: count each 15-bit magnitude pattern, then map the 32768 counts to bins.

    Cheaper than widening to float32 (one mask and one count per chunk) and exact, because a
    16-bit pattern *is* the value: every figure follows from the per-pattern counts.  Chunks
    stay large (fewer packing copies); with several CPU threads the mask and the count run on
    grain-sized pieces, since bincount's own min/max passes would otherwise open parallel
    regions (see ``_chunk_size``).
    """
    device = hist.device
    piece = chunk
    if device.type == "cpu":
        chunk = max(chunk, _CPU_CHUNK)
    n_total = sum(t.numel() for t in ts)
    c = min(chunk, n_total)
    staging = torch.empty(c, dtype=dtype, device=device)
    m_buf = torch.empty(c, dtype=torch.int16, device=device)
    per_pattern = torch.zeros(1 << 15, dtype=torch.int64, device=device)
    for chunk_values in _chunks(ts, staging):
        bits = chunk_values.view(torch.int16)
        n = bits.numel()
        masked = m_buf[:n]
        for i in range(0, n, piece):
            m = torch.bitwise_and(bits[i : i + piece], 0x7FFF, out=masked[i : i + piece])  # drop the sign
            _count_into(per_pattern, m, method, ones)
    bins, values = _cached_on(_pattern_tables, (dtype, thresholds), device)
    # 32,768 adds whatever the method: small next to the chunks (and exact, int64).
    hist.index_add_(0, bins, per_pattern)
    amax_parts.append(torch.amax(values * (per_pattern > 0)))


def grad_stats(
    tensors: Union[torch.Tensor, Iterable[Optional[torch.Tensor]]],
    *,
    scale: float = 1.0,
    fmt: "str | FloatFormat" = "fp16",
    device: "str | torch.device | None" = None,
    method: str = "auto",
) -> GradStats:
    """Measure what storing ``x * scale`` in ``fmt`` would do to every element of ``tensors``.

    Args:
        tensors: a tensor or an iterable of tensors (float32, float16 or bfloat16, any shapes,
            on any devices; ``None`` entries are skipped; an empty iterable gives empty stats).
        scale: positive finite multiplier applied before storing (the loss scale).
        fmt: the storage format: a name such as ``"fp16"``, ``"bf16"``, ``"fp8_e4m3"``,
            ``"fp8_e5m2"``, ``"fp32"``, a ``torch.dtype`` or a ``FloatFormat``.
        device: where the result's tensors live.  Default: the first tensor's device, or the CPU
            when ``tensors`` holds none (pass it so that a rank with nothing to measure can still
            join a NCCL all-reduce).
        method: how the histogram is counted; every method gives the same histogram bit for bit
            (the tests check it), they differ only in speed.  ``"auto"`` (default): ``"bincount"``
            on the CPU, ``"index_add"`` on accelerators.  The alternatives for accelerators are
            ``"histc"`` (per-block partial histograms in shared memory) and ``"sort"`` (no atomic
            adds); see below.

    Returns:
        A ``GradStats``.  Its counts are exactly what a real cast
        ``(x.double() * scale).to(dtype)`` gives element by element (torch rounds float64 via
        float32; overflow for e4m3 is "rounds past 448" whatever the cast stores).

    Tensors on several devices (model parallelism in one process) are measured on their own
    devices, each device's histogram and ``amax`` are moved to the result's device (a few KiB)
    and summed there.  Moving them between accelerators does not sync; moving them onto the CPU
    waits for the accelerator, so keep the first tensor (or ``device``) on an accelerator.

    No host sync happens here otherwise: the result holds device tensors, and **reading a figure
    syncs**.

    Choosing ``method`` on a GPU (not measured yet; what the first GPU run should measure):
    ``index_add`` does one int64 atomic add per element into 1,280 bins (float32 gradients) or
    32,768 pattern counts (fp16/bf16), and real gradients crowd into a few dozen binades, so
    the hot bins contend.  Time ``grad_stats`` per method on 4M-element chunks (one chunk) and on
    a realistic list (e.g. 200 tensors, 50M elements), for float32 and for fp16 gradients, with
    (a) log-normal magnitudes spanning ~10 binades (hot bins) and (b) uniform bit patterns (no
    contention); check that each method's histogram is ``torch.equal`` to ``index_add``'s, and
    that none syncs (``torch.cuda.set_sync_debug_mode("error")``).  Make the fastest exact one
    the CUDA choice of ``"auto"``.

    Raises:
        ValueError: for an unknown ``fmt`` or ``method``, ``method="bincount"`` with tensors off
            the CPU, a non-positive or non-finite ``scale``, a non-tensor entry, or an unsupported
            dtype or layout.
    """
    f = _check_fmt(fmt)
    s = _check_scale(scale)
    ts = _collect(tensors)
    target = torch.device(device) if device is not None else (ts[0].device if ts else torch.device("cpu"))
    by_device: Dict[torch.device, List[torch.Tensor]] = {}
    for t in ts:
        by_device.setdefault(_device_of(t), []).append(t)
    chosen = _resolve_method(method, list(by_device))
    thresholds = _thresholds_for(_boundaries(f, s))
    hist: Optional[torch.Tensor] = None
    amax: Optional[torch.Tensor] = None
    with torch.no_grad():
        for group in by_device.values():
            part_hist, part_amax = _measure(group, thresholds, chosen)
            part_hist, part_amax = _move(part_hist, target), _move(part_amax, target)
            # Integer counts add exactly in any order, and max is order-free: the result does not
            # depend on how the tensors were spread over devices.
            hist = part_hist if hist is None else hist.add_(part_hist)
            amax = part_amax if amax is None else torch.maximum(amax, part_amax)
        if hist is None:
            hist = torch.zeros(NUM_BINS, dtype=torch.int64, device=target)
            amax = torch.zeros((), dtype=torch.float32, device=target)
    return GradStats(f, s, hist, amax, thresholds)


def _measure(ts: List[torch.Tensor], thresholds: Tuple[int, ...], method: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(hist, amax)`` of tensors that all live on one device, computed there."""
    device = ts[0].device
    if method == "auto":
        method = "bincount" if device.type == "cpu" else "index_add"
    hist = torch.zeros(NUM_BINS, dtype=torch.int64, device=device)
    amax_parts: List[torch.Tensor] = []
    chunk = _chunk_size(device)
    ones = torch.ones((), dtype=torch.int64, device=device)
    groups: Dict[torch.dtype, List[torch.Tensor]] = {}
    for t in ts:
        groups.setdefault(t.dtype, []).append(t)
    for dtype, group in groups.items():
        if sum(t.numel() for t in group) == 0:
            continue
        if dtype == torch.float32:
            _accumulate_f32(group, thresholds, hist, amax_parts, chunk, method, ones)
        else:
            _accumulate_16bit(group, dtype, thresholds, hist, amax_parts, chunk, method, ones)
    if amax_parts:
        amax = torch.stack(amax_parts).amax()
    else:
        amax = torch.zeros((), dtype=torch.float32, device=device)
    return hist, amax


# ----- advice -----------------------------------------------------------------------------------


class ScaleRecommendation(NamedTuple):
    """What ``recommend_scale`` suggests.

    Attributes:
        scale: the largest power of two ``S`` with ``amax * S <= fmt.max / 2^margin_bits``;
            ``None`` when there is no finite nonzero gradient to base it on.
        flushed: nonzero gradients still flushed to 0 at ``scale``.
        flushed_frac: ``flushed / numel``.
        headroom_bits: ``log2(fmt.max / (amax * scale))``, at least ``margin_bits``.
        error_bound: bound on the error of ``flushed`` (0 when exact; see ``GradStats.at``).
    """

    scale: Optional[float]
    flushed: int
    flushed_frac: float
    headroom_bits: float
    error_bound: int


def recommend_scale(
    stats: GradStats,
    fmt: "str | FloatFormat | None" = None,
    margin_bits: int = 1,
    *,
    ignore_nonfinite: bool = False,
) -> ScaleRecommendation:
    """The loss scale that lifts gradients furthest off the underflow cliff without overflow.

    Args:
        stats: a ``GradStats`` (any scale; only its histogram and ``amax`` are used).
        fmt: the format to fit; defaults to ``stats.fmt``.
        margin_bits: binades to keep free above the largest gradient (>= 0), so that growth
            until the next measurement does not overflow at once.
        ignore_nonfinite: base the advice on the finite values even when ``stats`` counts inf
            or NaN inputs.  By default such statistics are refused (see Raises).

    Returns:
        A ``ScaleRecommendation``: the largest power of two ``S`` with
        ``amax * S * 2^margin_bits <= fmt.max`` and the flushed count/fraction at ``S``
        (from ``GradStats.at``, exact when ``S / stats.scale`` is a power of two).
        The scale may exceed what a float32 loss-scale tensor holds for tiny ``amax``; clamp
        it to your scaler's bounds.

    Raises:
        ValueError: ``stats`` counts inf or NaN inputs and ``ignore_nonfinite`` is False.  The
            advice rests on ``amax``, the largest *finite* value: when some values are already
            inf or NaN (an overflowed step, or a NaN loss) the true largest gradient is unknown,
            and a scale fitted to the finite rest would be too large -- e.g. ``2^24`` for
            gradients that just overflowed.  Measure a clean step, or pass
            ``ignore_nonfinite=True`` to fit the finite values anyway.
        ValueError: for a bad ``fmt`` or ``margin_bits``.

    Syncs (it reads the figures).
    """
    f = stats.fmt if fmt is None else _check_fmt(fmt)
    if isinstance(margin_bits, bool) or not isinstance(margin_bits, int) or margin_bits < 0:
        raise ValueError(f"margin_bits={margin_bits!r} must be an int >= 0, e.g. 1")
    if not isinstance(ignore_nonfinite, bool):
        raise ValueError(f"ignore_nonfinite={ignore_nonfinite!r} must be True or False")
    if not ignore_nonfinite and (stats.inf or stats.nan):
        raise ValueError(
            f"recommend_scale: the statistics count {stats.inf} inf and {stats.nan} NaN values, so the "
            f"largest gradient is unknown (amax={stats.amax:g} is the largest finite one) and any scale "
            "fitted to it may overflow; measure a step without inf/NaN gradients, or pass "
            "ignore_nonfinite=True to fit the finite values anyway"
        )
    amax = stats.amax
    if amax == 0.0:
        return ScaleRecommendation(None, 0, 0.0, math.inf, 0)
    # Exact floor(log2(fmt.max / amax)) from the binary exponents (no rounding of the ratio):
    # with x = m * 2^e, m in [0.5, 1), the ratio is (m_max / m_a) * 2^(e_max - e_a) and the
    # mantissa quotient lies in (0.5, 2), so the floor is e_max - e_a, minus 1 if m_max < m_a.
    m_max, e_max = math.frexp(f.max)
    m_a, e_a = math.frexp(amax)
    k = e_max - e_a - (1 if m_max < m_a else 0) - margin_bits
    scale = math.ldexp(1.0, k)
    at = stats.at(scale, f)
    return ScaleRecommendation(scale, at.flushed, at.flushed_frac, at.headroom_bits, at.error_bound)


def fetch_figures(stats: "Iterable[GradStats]", extras: Sequence[torch.Tensor] = ()) -> List[List[float]]:
    """Read the figures of several statistics in one transfer (one sync where they share a device), for
    a logger that reads them all (``Telemetry.metrics``: the overall figures and every group's), with
    ``extras`` (small tensors on the statistics' device: the scale, the scaler's state) riding along;
    returns the extras' values, each flattened to a list of floats. Statistics whose figures were read
    already are left alone."""
    pending: Dict[Any, List[GradStats]] = {}
    for st in stats:
        if "figures" not in st._cache:
            pending.setdefault(st.hist.device, []).append(st)
    extras = [e.reshape(-1).to(torch.float64) for e in extras]
    ride = {id(e): None for e in extras}
    for device, group in pending.items():
        riding = [e for e in extras if ride[id(e)] is None and e.device == device]
        packed = [st._packed() for st in group] + riding
        values = torch.cat(packed).tolist()  # the one host sync for the device
        offset = 0
        for i, part in enumerate(packed):
            chunk, offset = values[offset : offset + part.numel()], offset + part.numel()
            if i < len(group):
                group[i]._take(chunk)
            else:
                ride[id(part)] = chunk
    return [ride[id(e)] if ride[id(e)] is not None else e.tolist() for e in extras]
