"""The seed's claims, one function each: the claim, what was measured, and whether it held.

Every function takes measurements (training runs, gradients, APIs) and returns a
:class:`ClaimResult`: named figures (all measured in this process) and checks computed from them.
The verdict is HELD when every check passes and NOT HELD when one fails (a figure a check needs but
could not measure fails it). The thresholds in the checks are the claims' words made testable ("stops
learning": ends within 10 points of chance while FP32 learns); they are criteria, never results.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .. import formats
from ..stats import GradStats, grad_stats
from .workload import RunResult, TrainConfig

__all__ = [
    "Check",
    "ClaimResult",
    "c1_fp16_facts",
    "c2_underflow_stalls",
    "c3_power_of_two_scaling",
    "c4_clip_order",
    "c5_static_sweep",
    "c6_dynamic_scaling",
    "lost_fraction",
    "scale_moves",
]

HELD, NOT_HELD = "HELD", "NOT HELD"

#: The seed's statements, verbatim in substance.
CLAIMS = {
    "C1": (
        "FP16 facts",
        "FP16's largest value is 65504, its smallest normal 2^-14, its smallest subnormal "
        "2^-24, and anything at or below 2^-25 rounds to exactly 0.",
    ),
    "C2": (
        "Underflow stalls FP16 training",
        "Gradients of 1e-8..1e-10 are lost in FP16 (rounded to 0), and "
        "a model whose gradients live there stops learning.",
    ),
    "C3": (
        "Power-of-two loss scaling lifts every gradient exactly",
        "Multiplying the loss by a power of two S multiplies every gradient by S exactly (only the "
        "exponent changes), lifting the small ones off the cliff; unscaling is exact too, and training "
        "recovers FP32 accuracy.",
    ),
    "C4": (
        "Unscale before you clip",
        "Clipping the scaled gradients sees a norm S times too large, so the "
        "clip fires on every step and crushes every update; the right order is unscale, clip, step.",
    ),
    "C5": (
        "Static scaling is a tightrope",
        "A fixed S that is too low leaves gradients underflowing; one "
        "that is too high overflows (inf, skipped or diverged steps); only a window in between trains.",
    ),
    "C6": (
        "Dynamic scaling finds itself",
        "Backing off on overflow and growing after a clean streak, the "
        "scale climbs to just below the overflow line, hovers there and re-adapts as gradients change.",
    ),
}


@dataclass
class Check:
    """One testable part of a claim."""

    name: str
    passed: bool
    detail: str


@dataclass
class ClaimResult:
    """A claim, its measured figures and the checks computed from them.

    Attributes:
        id: which claim ("C1".."C6").
        title: its short name.
        claim: its statement.
        method: how it was measured, in a few sentences.
        figures: ``{name: measured value}`` (numbers, lists, dicts; all JSON-able).
        labels: ``{name: human label}`` for the report's table (figures without one are data only).
        checks: the checks deciding the verdict.
        headline: one line of the key figures, for the summary tables.
        images: ``(png name, caption)`` filled in by the orchestrator.
    """

    id: str
    title: str
    claim: str
    method: str = ""
    figures: Dict[str, Any] = field(default_factory=dict)
    labels: Dict[str, str] = field(default_factory=dict)
    checks: List[Check] = field(default_factory=list)
    headline: str = ""
    images: List[Tuple[str, str]] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        """HELD if there are checks and every one passed, else NOT HELD (nothing checked, nothing shown)."""
        return HELD if self.checks and all(c.passed for c in self.checks) else NOT_HELD

    def add(self, key: str, value: Any, label: Optional[str] = None) -> Any:
        """Record a figure (and its label for the report); returns the value."""
        self.figures[key] = value
        if label:
            self.labels[key] = label
        return value

    def check(self, name: str, passed: bool, detail: str) -> None:
        """Add a check: what was tested, whether it passed, and the measured figures behind it."""
        self.checks.append(Check(name, bool(passed), detail))

    def to_dict(self) -> Dict[str, Any]:
        """JSON-able form for summary.json."""
        return {
            "id": self.id,
            "title": self.title,
            "claim": self.claim,
            "method": self.method,
            "verdict": self.verdict,
            "headline": self.headline,
            "figures": self.figures,
            "checks": [{"name": c.name, "passed": c.passed, "detail": c.detail} for c in self.checks],
            "images": [name for name, _ in self.images],
        }


def _new(cid: str) -> ClaimResult:
    title, claim = CLAIMS[cid]
    return ClaimResult(cid, title, claim)


def pct(x: Optional[float], digits: int = 1) -> str:
    """``0.123 -> '12.3%'`` (n/a for None/NaN)."""
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{100 * x:.{digits}f}%"


def p2(x: Optional[float]) -> str:
    """A positive number as a power of two, ``2^k`` (or ``2^k.kk``)."""
    if x is None or not math.isfinite(x) or x <= 0:
        return "n/a"
    k = math.log2(x)
    return f"2^{int(k)}" if k == int(k) else f"2^{k:.2f}"


# ---------------------------------------------------------------------------------------------- helpers
def _flat(grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.detach().reshape(-1).float() for g in grads.values()])


def lost_fraction(reference: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]) -> float:
    """Of the gradient entries that are nonzero in ``reference`` (FP32), the share that are 0 in ``got``.

    ``got`` is the same backward run another way (FP16, scaled or not): this is what was lost there,
    measured against the exact gradients rather than inferred.
    """
    ref, out = _flat(reference), _flat(got)
    nz = ref != 0
    n = int(nz.sum())
    return float(((out == 0) & nz).sum()) / n if n else 0.0


def scale_moves(scales: Sequence[float]) -> Tuple[int, int]:
    """``(backoffs, growths)``: how often a scale trajectory went down and up."""
    pairs = list(zip(scales, scales[1:]))
    return sum(1 for a, b in pairs if b < a), sum(1 for a, b in pairs if b > a)


def _grad_stats(tensors, scale: float = 1.0) -> GradStats:
    return grad_stats(list(tensors), scale=scale, fmt="fp16")


def _cast16(x: float) -> float:
    return float(torch.tensor([x], dtype=torch.float32).to(torch.float16).float().item())


def _next32(x: float, toward: float) -> float:
    return float(torch.nextafter(torch.tensor([x], dtype=torch.float32), torch.tensor([toward])).item())


# ---------------------------------------------------------------------------------------------- C1
def c1_fp16_facts() -> ClaimResult:
    """C1: the FP16 range facts from :mod:`lossscale.formats`, each checked against real torch casts."""
    r = _new("C1")
    f = formats.get("fp16")
    r.method = (
        "The facts come from lossscale.formats, which derives them from FP16's bit layout (1 sign, 5 "
        "exponent, 10 mantissa bits). Each is then checked against torch: torch.finfo, and real float32 to "
        "float16 casts of the values at and next to each edge."
    )
    mx = r.add("max", f.max, "largest finite value (lossscale.formats)")
    sn = r.add("smallest_normal", f.smallest_normal, "smallest normal")
    ss = r.add("smallest_subnormal", f.smallest_subnormal, "smallest subnormal")
    ft = r.add("flush_threshold", f.flush_threshold, "flush threshold (|x| <= it rounds to 0)")
    fi = torch.finfo(torch.float16)
    r.add("torch_finfo_max", float(fi.max), "torch.finfo(float16).max")
    r.add("torch_finfo_smallest_normal", float(fi.smallest_normal), "torch.finfo(float16).smallest_normal")
    cast = {
        "cast_max": _cast16(mx),
        "cast_overflow_threshold": _cast16(f.overflow_threshold),
        "cast_below_overflow_threshold": _cast16(_next32(f.overflow_threshold, 0.0)),
        "cast_smallest_normal": _cast16(sn),
        "cast_largest_subnormal": _cast16(sn - ss),
        "cast_smallest_subnormal": _cast16(ss),
        "cast_flush_threshold": _cast16(ft),
        "cast_above_flush_threshold": _cast16(_next32(ft, 1.0)),
    }
    r.figures.update(cast)
    r.labels.update(
        {
            "cast_max": "torch cast of max",
            "cast_overflow_threshold": f"torch cast of {f.overflow_threshold:g}",
            "cast_below_overflow_threshold": f"torch cast of the float32 just below {f.overflow_threshold:g}",
            "cast_smallest_normal": "torch cast of 2^-14",
            "cast_largest_subnormal": "torch cast of 2^-14 - 2^-24 (largest subnormal)",
            "cast_smallest_subnormal": "torch cast of 2^-24",
            "cast_flush_threshold": "torch cast of 2^-25",
            "cast_above_flush_threshold": "torch cast of the float32 just above 2^-25",
        }
    )
    r.check(
        "max = 65504, finite in a real cast; the next tie overflows to inf",
        mx == 65504.0
        and fi.max == mx
        and cast["cast_max"] == mx
        and math.isinf(cast["cast_overflow_threshold"])
        and cast["cast_below_overflow_threshold"] == mx,
        f"formats: {mx:g}; torch.finfo: {fi.max:g}; cast({mx:g}) = {cast['cast_max']:g}; "
        f"cast({f.overflow_threshold:g}) = {cast['cast_overflow_threshold']}",
    )
    largest_sub = sn - ss
    r.check(
        "smallest normal = 2^-14; the value just below it is subnormal",
        sn == 2.0**-14
        and fi.smallest_normal == sn
        and cast["cast_smallest_normal"] == sn
        and cast["cast_largest_subnormal"] == largest_sub < sn,
        f"formats: {p2(sn)}; torch.finfo: {p2(fi.smallest_normal)}; cast(2^-14 - 2^-24) = "
        f"{cast['cast_largest_subnormal']:.8g} (kept, below {sn:.8g})",
    )
    r.check(
        "smallest subnormal = 2^-24, kept exactly by a cast",
        ss == 2.0**-24 and cast["cast_smallest_subnormal"] == ss,
        f"formats: {p2(ss)}; cast(2^-24) = {p2(cast['cast_smallest_subnormal'])}",
    )
    r.check(
        "<= 2^-25 flushes to 0 (anything above rounds up to 2^-24)",
        ft == 2.0**-25 and cast["cast_flush_threshold"] == 0.0 and cast["cast_above_flush_threshold"] == ss,
        f"formats: {p2(ft)}; cast(2^-25) = {cast['cast_flush_threshold']:g}; "
        f"cast(float32 above 2^-25) = {p2(cast['cast_above_flush_threshold'])}",
    )
    r.add("table", formats.table())
    r.headline = f"max {mx:g}, normal {p2(sn)}, subnormal {p2(ss)}, flush <= {p2(ft)} (torch casts agree)"
    return r


# ---------------------------------------------------------------------------------------------- C2
def c2_underflow_stalls(
    cfg: TrainConfig,
    fp32: RunResult,
    noscale: RunResult,
    ref_grads: Mapping[str, torch.Tensor],
    fp16_grads: Mapping[str, torch.Tensor],
    chance: float,
) -> ClaimResult:
    """C2: the true gradients' share in 1e-10..1e-8, what FP16 does to them, and the stalled run.

    ``ref_grads``: the exact FP32 gradients of the first batch; ``fp16_grads``: the same backward
    under FP16 autocast without scaling.
    """
    r = _new("C2")
    r.method = (
        "The first batch's exact gradients come from an FP32 backward of the freshly initialised model under "
        "the shift; the same backward under FP16 autocast shows what FP16 keeps of them. The two training "
        "runs start from the same weights and see the same batches."
    )
    g = _flat(ref_grads).abs()
    nz = g[g != 0]
    band = nz[(nz >= 1e-10) & (nz <= 1e-8)]
    r.add("shift_c", cfg.c, "loss shift c (lr / c keeps FP32 identical)")
    r.add("true_grad_min", float(nz.min()) if nz.numel() else None, "smallest nonzero true gradient")
    r.add("true_grad_max", float(nz.max()) if nz.numel() else None, "largest true gradient")
    band_frac = r.add("band_frac", band.numel() / max(nz.numel(), 1), "share of nonzero true gradients in 1e-10..1e-8")
    band_lost = r.add(
        "band_lost_frac",
        float((band.to(torch.float16) == 0).float().mean()) if band.numel() else None,
        "of those, share a real FP16 cast turns into 0",
    )
    lost = r.add(
        "fp16_backward_lost_frac",
        lost_fraction(ref_grads, fp16_grads),
        "nonzero FP32 gradients that are 0 after the FP16 backward (no scaling)",
    )
    gs = _grad_stats(ref_grads.values())
    r.add(
        "stats_flushed_frac", gs.frac_of_nonzero("flushed"), "grad_stats: share of nonzero true gradients FP16 flushes"
    )
    acc32, acc16 = (
        r.add("fp32_acc", fp32.final_acc, "FP32 test accuracy"),
        r.add("fp16_noscale_acc", noscale.final_acc, "FP16 no-scale test accuracy"),
    )
    r.add("chance_acc", chance, "chance (most frequent class)")
    r.add("fp16_noscale_unchanged_frac", noscale.unchanged_frac, "FP16 no-scale: weights never moved")
    r.add("fp32_unchanged_frac", fp32.unchanged_frac, "FP32: weights never moved")
    r.check(
        "gradients of 1e-10..1e-8 are lost in a real FP16 cast",
        band.numel() > 0 and band_lost == 1.0,
        f"{band.numel()} of the first batch's nonzero true gradients lie in 1e-10..1e-8 ({pct(band_frac)}); "
        f"{pct(band_lost)} of them cast to 0",
    )
    r.check(
        "most gradient signal is lost in the FP16 backward",
        lost > 0.5,
        f"{pct(lost)} of the nonzero FP32 gradients are exactly 0 in the FP16 backward",
    )
    # "Stops learning", relative to what FP32 learns: the FP16 run gains less than a fifth of FP32's
    # accuracy gain over chance. (It is not frozen outright: the rare gradient that survives is applied
    # with the lr / c learning rate, so a few coarse updates still happen.)
    gain = (acc16 - chance) / (acc32 - chance) if acc32 > chance else float("nan")
    r.add("fp16_noscale_gain_frac", gain, "FP16 no-scale: share of FP32's accuracy gain over chance")
    r.check(
        "the FP16 model stops learning while FP32 learns",
        acc32 - chance >= 0.5 and gain <= 0.2,
        f"FP16 no-scale {pct(acc16)} vs FP32 {pct(acc32)} (chance {pct(chance)}): {pct(gain)} of FP32's gain; "
        f"{pct(noscale.unchanged_frac)} of FP16 weights never moved",
    )
    r.headline = f"{pct(lost)} of gradients lost; FP16 no-scale {pct(acc16)} vs FP32 {pct(acc32)}"
    return r


# ---------------------------------------------------------------------------------------------- C3
def _roundtrip_mismatch(g: torch.Tensor, scale: float) -> float:
    """Share of values whose scale/unscale round trip (the scaler's float32 arithmetic) is not bitwise exact."""
    s = torch.tensor(scale, dtype=torch.float32)
    inv = s.double().reciprocal().float()  # the scaler's inverse, computed in float64
    back = (g * s) * inv
    return float((back.view(torch.int32) != g.view(torch.int32)).float().mean()) if g.numel() else 0.0


def c3_power_of_two_scaling(
    fp32: RunResult,
    static: RunResult,
    scale: float,
    ref_grads: Mapping[str, torch.Tensor],
    fp16_scaled_grads: Mapping[str, torch.Tensor],
    fp16_grads: Mapping[str, torch.Tensor],
    non_pow2_scale: float,
) -> ClaimResult:
    """C3: bitwise round trips (power of two vs not), gradients rescued by S, accuracy recovered."""
    r = _new("C3")
    r.method = (
        "The bitwise test multiplies the first batch's exact gradients by S, then by the float32 1/S the "
        "scaler uses (computed in float64, as GradScaler does), and compares bit patterns with the "
        "originals. The FP16 backward of the first batch is repeated with the loss scaled by S and the "
        "gradients unscaled after, and the static run trains with GradScaler(policy='static')."
    )
    g = _flat(ref_grads)
    g = g[g != 0]
    r.add("scale", scale, "static loss scale S")
    exact = r.add(
        "pow2_roundtrip_mismatch_frac",
        _roundtrip_mismatch(g, scale),
        f"gradients changed by x{p2(scale)} then x1/{p2(scale)} (bitwise)",
    )
    r.add("non_pow2_scale", non_pow2_scale, "a non-power-of-two scale for contrast")
    inexact = r.add(
        "non_pow2_roundtrip_mismatch_frac",
        _roundtrip_mismatch(g, non_pow2_scale),
        f"gradients changed by x{non_pow2_scale:g} then x1/{non_pow2_scale:g} (bitwise)",
    )
    # "Lifts every gradient exactly": the FP16 backward of S*L, unscaled, vs S times nothing else.
    lost_before = r.add(
        "unscaled_lost_frac",
        lost_fraction(ref_grads, fp16_grads),
        "nonzero gradients lost in the FP16 backward, no scaling",
    )
    lost_after = r.add(
        "scaled_lost_frac", lost_fraction(ref_grads, fp16_scaled_grads), f"... with the loss scaled by {p2(scale)}"
    )
    gs = _grad_stats(ref_grads.values())
    r.add(
        "stats_unscaled_flushed_frac",
        gs.frac_of_nonzero("flushed"),
        "grad_stats: nonzero true gradients FP16 flushes, unscaled",
    )
    r.add(
        "stats_scaled_flushed_frac", gs.at(scale).frac_of_nonzero("flushed"), f"... at S={p2(scale)} (grad_stats .at)"
    )
    acc32, accs = (
        r.add("fp32_acc", fp32.final_acc, "FP32 test accuracy"),
        r.add("static_acc", static.final_acc, f"FP16 static S={p2(scale)} test accuracy"),
    )
    r.add("static_skipped_steps", static.skipped_steps, "skipped steps (static run)")
    r.check(
        "a power-of-two scale and unscale is bitwise exact for every gradient",
        exact == 0.0,
        f"{pct(exact, 3)} of {g.numel()} nonzero gradients changed by the {p2(scale)} round trip",
    )
    r.check(
        "a non-power-of-two scale is not exact",
        inexact > 0.0,
        f"{pct(inexact)} changed by the x{non_pow2_scale:g} round trip (rounding error in every step)",
    )
    r.check(
        "scaling lifts the gradients FP16 lost",
        lost_after < lost_before and lost_after <= 0.05,
        f"lost in the FP16 backward: {pct(lost_before)} without scaling, {pct(lost_after, 2)} with S={p2(scale)}",
    )
    r.check(
        "FP16 with static scaling recovers FP32 accuracy",
        accs >= acc32 - 0.02,
        f"static {pct(accs)} vs FP32 {pct(acc32)} (tolerance 2 points)",
    )
    r.headline = (
        f"round trip exact ({pct(exact, 0)} changed vs {pct(inexact)} at x{non_pow2_scale:g}); "
        f"lost {pct(lost_before)} -> {pct(lost_after, 2)}; acc {pct(accs)} vs FP32 {pct(acc32)}"
    )
    return r


# ---------------------------------------------------------------------------------------------- C4
def c4_clip_order(fp32: RunResult, right: RunResult, wrong: RunResult, scale: float, clip_norm: float) -> ClaimResult:
    """C4: the clip fires on every step and crushes the update when it sees the scaled gradients."""
    r = _new("C4")

    def ratios(run: RunResult) -> List[float]:
        return [
            s["applied_norm"] / s["true_norm"]
            for s in run.steps
            if s.get("true_norm") and not s["skipped"] and math.isfinite(s["true_norm"])
        ]

    r.method = (
        f"Both runs use GradScaler(policy='static', init_scale={p2(scale)}) and clip_grad_norm_ with "
        f"max_norm={clip_norm:g} for the true gradients. Right: unscale_, clip, step. Wrong: clip the scaled "
        "gradients, then step (which unscales). The applied norm is read from the gradients after step(), "
        "the true norm from the clip's own report."
    )
    r.add("scale", scale, "loss scale S (static)")
    r.add("clip_norm", clip_norm, "clip_grad_norm_ max_norm (of the true gradients)")
    fired_r = r.add(
        "right_clip_fired_frac",
        statistics.fmean(float(s["clip_fired"]) for s in right.steps),
        "unscale -> clip: steps the clip fired",
    )
    fired_w = r.add(
        "wrong_clip_fired_frac",
        statistics.fmean(float(s["clip_fired"]) for s in wrong.steps),
        "clip scaled: steps the clip fired",
    )
    rr, rw = ratios(right), ratios(wrong)
    med_r = r.add(
        "right_median_norm_ratio",
        statistics.median(rr) if rr else None,
        "unscale -> clip: median applied/true gradient norm",
    )
    med_w = r.add(
        "wrong_median_norm_ratio",
        statistics.median(rw) if rw else None,
        "clip scaled: median applied/true gradient norm",
    )
    max_w = r.add("wrong_max_norm_ratio", max(rw) if rw else None, "clip scaled: largest applied/true norm")
    acc32 = r.add("fp32_acc", fp32.final_acc, "FP32 test accuracy")
    acc_r = r.add("right_acc", right.final_acc, "unscale -> clip: test accuracy")
    acc_w = r.add("wrong_acc", wrong.final_acc, "clip scaled: test accuracy")
    r.check(
        "clipping the scaled gradients fires on every step",
        fired_w == 1.0,
        f"fired on {pct(fired_w)} of steps (right order: {pct(fired_r)})",
    )
    r.check(
        "and crushes every update",
        max_w is not None and max_w < 0.01,
        f"applied/true norm: median {med_w:.3g}, largest {max_w:.3g} (right order: median {med_r:.3g})"
        if max_w is not None
        else "no steps",
    )
    r.check(
        "the right order trains, the wrong one does not",
        acc_r >= acc32 - 0.03 and acc_w <= acc_r - 0.2,
        f"unscale -> clip {pct(acc_r)}, clip scaled {pct(acc_w)}, FP32 {pct(acc32)}",
    )
    r.headline = (
        (f"clip scaled fired {pct(fired_w, 0)}, update x{med_w:.2g}: {pct(acc_w)}; unscale->clip {pct(acc_r)}")
        if med_w is not None
        else ""
    )
    return r


# ---------------------------------------------------------------------------------------------- C5
def c5_static_sweep(
    fp32: RunResult, sweep: Sequence[Tuple[int, RunResult]], ref_grads: Mapping[str, torch.Tensor]
) -> ClaimResult:
    """C5: one training run per static scale 2^k, plus what FP16 does to the true gradients at each.

    The sweep's runs are shorter than the FP32 run; since every run shares init and batch order, the
    FP32 run's accuracy after the same number of epochs is the FP32 result of a run that long.
    """
    r = _new("C5")
    n_ep = len(sweep[0][1].epochs)
    r.method = (
        f"One training run per static scale 2^k (GradScaler(policy='static'): a step with inf/NaN is skipped), "
        f"{n_ep} epochs each, same init and batches. The flushed and overflowing shares are what grad_stats "
        "says FP16 does to the first batch's exact gradients at each scale: one histogram, read at every "
        "scale with .at(S)."
    )
    acc32 = r.add(
        "fp32_acc",
        fp32.epochs[min(n_ep, len(fp32.epochs)) - 1]["test_acc"],
        f"FP32 test accuracy after the sweep's {n_ep} epochs",
    )
    ks = [k for k, _ in sweep]
    acc = [run.final_acc for _, run in sweep]
    skipped = [run.skipped_steps / max(len(run.steps), 1) for _, run in sweep]
    nonfinite = [sum(1 for s in run.steps if not math.isfinite(s["loss"])) for _, run in sweep]
    r.add("log2_scales", ks)
    r.add("acc", acc)
    r.add("skipped_frac", skipped)
    r.add("nonfinite_loss_steps", nonfinite)
    gs = _grad_stats(ref_grads.values())
    at = [gs.at(2.0**k) for k in ks]
    flushed = r.add("flushed_frac", [a.frac_of_nonzero("flushed") for a in at])
    r.add("overflow_frac", [a.frac_of_nonzero("overflow") for a in at])
    good = [k for k, a, s in zip(ks, acc, skipped) if a >= acc32 - 0.02 and s < 0.05]
    window = r.add("window_log2", [min(good), max(good)] if good else None)
    if window:
        r.add(
            "window",
            f"2^{window[0]} .. 2^{window[1]}",
            "scales that reach FP32 accuracy (within 2 points), < 5% skipped",
        )
    lo_k, hi_k = ks[0], ks[-1]
    r.add("low_acc", acc[0], f"accuracy at S={p2(2.0**lo_k)}")
    r.add("high_acc", acc[-1], f"accuracy at S={p2(2.0**hi_k)}")
    r.add("high_skipped_frac", skipped[-1], f"steps skipped at S={p2(2.0**hi_k)}")
    fl_lo = flushed[0]
    r.check(
        f"too low (S={p2(2.0**lo_k)}): gradients underflow and training fails",
        acc[0] <= acc32 - 0.3 and fl_lo > 0.5,
        f"accuracy {pct(acc[0])} vs FP32 {pct(acc32)}; {pct(fl_lo)} of true gradients flush",
    )
    r.check(
        f"too high (S={p2(2.0**hi_k)}): gradients overflow, steps are skipped",
        skipped[-1] >= 0.5 and acc[-1] <= acc32 - 0.3,
        f"{pct(skipped[-1])} of steps skipped, accuracy {pct(acc[-1])}",
    )
    r.check(
        "a window in between trains like FP32",
        window is not None and lo_k < window[0] and window[1] < hi_k,
        f"S in {p2(2.0 ** window[0])}..{p2(2.0 ** window[1])} reaches FP32 accuracy with < 5% skipped"
        if window
        else "no scale reached FP32 accuracy",
    )
    r.headline = (
        f"window {p2(2.0 ** window[0])}..{p2(2.0 ** window[1])}; {p2(2.0**lo_k)}: {pct(acc[0])}, "
        f"{p2(2.0**hi_k)}: {pct(skipped[-1], 0)} skipped"
        if window
        else "no window"
    )
    return r


# ---------------------------------------------------------------------------------------------- C6
def overflow_line(run: RunResult) -> List[Optional[float]]:
    """Per step, the largest scale that would not have overflowed: ``S * 2**headroom_bits`` (None if unknown)."""
    out: List[Optional[float]] = []
    for s in run.steps:
        h = s.get("grad/headroom_bits")
        ok = h is not None and isinstance(h, (int, float)) and math.isfinite(h) and not s["skipped"]
        out.append(s["loss_scale"] * 2.0**h if ok else None)
    return out


def overflow_envelope(line: Sequence[Optional[float]], window: int) -> List[Optional[float]]:
    """Per step, the lowest overflow line of the last ``window`` steps: the largest scale that would
    have come through all of them without an overflow (None where none of them measured one).

    A dynamic scale only grows after ``growth_interval`` clean steps, so this envelope, not the noisy
    per-step line, is the line it can hover under.
    """
    out: List[Optional[float]] = []
    for t in range(len(line)):
        seen = [v for v in line[max(0, t - window + 1) : t + 1] if v is not None]
        out.append(min(seen) if seen else None)
    return out


def _trajectory_figures(r: ClaimResult, key: str, run: RunResult, window: int) -> Dict[str, Any]:
    scales = run.series("loss_scale")
    backoffs, growths = scale_moves(scales)
    first = next((i for i, s in enumerate(run.steps) if s["skipped"]), None)
    d = {
        "backoffs": backoffs,
        "growths": growths,
        "skipped_steps": run.skipped_steps,
        "skipped_frac": run.skipped_steps / max(len(run.steps), 1),
        "first_scale": scales[0],
        "final_scale": scales[-1],
        "max_scale": max(scales),
        "first_overflow_step": first,
        "final_acc": run.final_acc,
    }
    if first is not None:
        d["growths_after_first_overflow"] = scale_moves(scales[first:])[1]
    fl = [s.get("act/flushed_frac") for s in run.steps]  # sampled by the activation probe
    fl = [v for v in fl if isinstance(v, (int, float)) and math.isfinite(v)]
    if fl:
        d["mean_flushed_frac"] = statistics.fmean(fl)
    line = overflow_line(run)
    if first is not None:
        gaps = [math.log2(l_) - math.log2(s) for l_, s in zip(line[first:], scales[first:]) if l_]
        env = overflow_envelope(line, window)
        env_gaps = [math.log2(e) - math.log2(s) for e, s in zip(env[first:], scales[first:]) if e]
        if gaps:
            d["median_gap_bits_after_first_overflow"] = statistics.median(gaps)
        if env_gaps:
            d["envelope_window_steps"] = window
            d["median_envelope_gap_bits_after_first_overflow"] = statistics.median(env_gaps)
            d["frac_within_2_bits_of_envelope_after_first_overflow"] = sum(1 for x in env_gaps if 0 <= x < 2) / len(
                env_gaps
            )
    lines = [l_ for l_ in line if l_]
    if len(lines) >= 4:
        q = max(len(lines) // 4, 1)
        d["line_first_quarter_log2"] = statistics.median(math.log2(v) for v in lines[:q])
        d["line_last_quarter_log2"] = statistics.median(math.log2(v) for v in lines[-q:])
    r.add(key, d)
    return d


def c6_dynamic_scaling(
    fp32: RunResult, dynamic: RunResult, torch_default: RunResult, adaptive: RunResult, growth_interval: int
) -> ClaimResult:
    """C6: the dynamic scale's trajectory against the measured overflow line; adaptive vs torch's default."""
    r = _new("C6")
    r.method = (
        f"The dynamic run is lossscale's dynamic rule (backoff x0.5, growth x2) from torch's initial 2^16 with "
        f"a growth interval of {growth_interval} steps and no cap, so one short run shows the whole climb. "
        "The scaler's telemetry gives each step's headroom, hence the overflow line S x 2^headroom. "
        "torch.amp.GradScaler() runs as shipped (2^16, growth after 2000 clean steps), the adaptive policy "
        "with lossscale's defaults. The flushed share is sampled every few steps by an exact FP32 probe of "
        "the activation gradients (lossscale.hooks) at the scale in use."
    )
    acc32 = r.add("fp32_acc", fp32.final_acc, "FP32 test accuracy")
    r.add("growth_interval", growth_interval, "dynamic run: growth_interval")
    d = _trajectory_figures(r, "dynamic", dynamic, growth_interval)
    t = _trajectory_figures(r, "torch_default", torch_default, growth_interval)
    a = _trajectory_figures(r, "adaptive", adaptive, growth_interval)
    labels = {
        "dynamic": "lossscale dynamic",
        "torch_default": "torch.amp.GradScaler()",
        "adaptive": "lossscale adaptive",
    }
    for key, label in labels.items():
        r.labels[f"{key}.summary"] = label
    first = d["first_overflow_step"]
    r.check(
        "the scale finds the overflow line by itself",
        first is not None and d["growths"] >= 1 and d["max_scale"] > d["first_scale"],
        f"from {p2(d['first_scale'])} it grew {d['growths']} times to {p2(d['max_scale'])}; first overflow at "
        f"step {first}"
        if first is not None
        else f"no overflow in {len(dynamic.steps)} steps (max {p2(d['max_scale'])})",
    )
    if "median_envelope_gap_bits_after_first_overflow" in d:
        gap = d["median_envelope_gap_bits_after_first_overflow"]
        within = d["frac_within_2_bits_of_envelope_after_first_overflow"]
        # The line is measured per step (S x 2^headroom of that step's gradients) and is noisy; the
        # scale grows only after growth_interval clean steps, so the line it must stay under is the
        # lowest of the last growth_interval steps. The rule's steady state is a sawtooth 0..1 binade
        # under it: "just below" is a median gap under 2 binades, against a climb of tens of binades.
        r.check(
            "and hovers just below it",
            0 <= gap < 2,
            f"after the first overflow the scale sits a median {gap:.2f} binades below the overflow line "
            f"(the lowest of the last {growth_interval} steps; {pct(within)} of steps within 2 binades), "
            f"{d['median_gap_bits_after_first_overflow']:.2f} below the per-step line",
        )
    else:
        # Not measurable means not shown: a run without an overflow never found the line, and a
        # missing line after one means the scaler's telemetry recorded no headroom.
        r.check(
            "and hovers just below it",
            False,
            f"no overflow in {len(dynamic.steps)} steps: no line to hover under"
            if first is None
            else "no overflow line measured after the first overflow (no grad/headroom_bits from the scaler's "
            "telemetry)",
        )
    after = d.get("growths_after_first_overflow", 0)
    drift = ""
    if "line_first_quarter_log2" in d and first is not None:
        drift = (
            f"; the line moved from 2^{d['line_first_quarter_log2']:.1f} (first quarter) to "
            f"2^{d['line_last_quarter_log2']:.1f} (last quarter) and the scale went from "
            f"{p2(dynamic.steps[first]['loss_scale'])} at the first overflow to {p2(d['final_scale'])}"
        )
    r.check(
        "backing off and growing again, it re-adapts",
        d["backoffs"] >= 2 and after >= 1,
        f"{d['backoffs']} backoffs, {after} growths after the first overflow; {d['skipped_steps']} skipped steps "
        f"({pct(d['skipped_frac'])}){drift}",
    )
    r.check(
        "dynamic scaling trains like FP32",
        d["final_acc"] >= acc32 - 0.02,
        f"dynamic {pct(d['final_acc'])} vs FP32 {pct(acc32)}",
    )
    unprobed = [name for name, fig in (("adaptive", a), ("torch default", t)) if "mean_flushed_frac" not in fig]
    if unprobed:
        r.check(
            "the adaptive policy beats torch's default",
            False,
            f"no activation-gradient probe figures (act/flushed_frac) for the {' and '.join(unprobed)} run",
        )
    else:
        # "Beats": fewer gradients flushed, at no cost in accuracy (1 point) or in skipped steps (1%).
        n = max(len(adaptive.steps), 1)
        r.check(
            "the adaptive policy beats torch's default",
            a["mean_flushed_frac"] < t["mean_flushed_frac"]
            and a["final_acc"] >= t["final_acc"] - 0.01
            and a["skipped_steps"] <= t["skipped_steps"] + 0.01 * n,
            f"activation gradients flushed {pct(a['mean_flushed_frac'], 2)} vs {pct(t['mean_flushed_frac'], 2)}, "
            f"skipped {a['skipped_steps']} vs {t['skipped_steps']}, accuracy {pct(a['final_acc'])} vs "
            f"{pct(t['final_acc'])} (adaptive vs torch)",
        )
    r.headline = (
        f"{p2(d['first_scale'])} -> {p2(d['max_scale'])}, {d['backoffs']} backoffs / {d['growths']} growths, "
        f"{d['skipped_steps']} skipped, acc {pct(d['final_acc'])}"
    )
    return r
