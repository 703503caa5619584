"""``lossscale report RUN.jsonl --out DIR``: the demo's telemetry plots for a user's own recorded run."""

from __future__ import annotations

import json
import math
import os
import statistics
from typing import Any, Dict, List, Optional

from .html import Section, write_html
from .schema import Telemetry, read_jsonl

__all__ = ["summarize", "render_run_report"]


def _finite(vals) -> List[float]:
    return [v for v in vals if v is not None and math.isfinite(v)]


def _stat(vals, fn) -> Optional[float]:
    vals = _finite(vals)
    return fn(vals) if vals else None


def summarize(tel: Telemetry) -> Dict[str, Any]:
    """The figures of a recorded run: steps, skips, scale moves, flushed fraction, headroom, per layer."""
    n = len(tel)
    scales = tel.loss_scale
    moves = list(zip(scales, scales[1:]))
    out: Dict[str, Any] = {
        "steps": n,
        "first_step": tel.step[0] if n else None,
        "last_step": tel.step[-1] if n else None,
        "skipped_steps": sum(tel.skipped),
        "skipped_frac": sum(tel.skipped) / n if n else 0.0,
        "scale_first": scales[0] if n else None,
        "scale_last": scales[-1] if n else None,
        "scale_min": min(scales) if n else None,
        "scale_max": max(scales) if n else None,
        "backoffs": sum(1 for a, b in moves if b < a),
        "growths": sum(1 for a, b in moves if b > a),
    }
    for kind in ("grad", "act"):
        fl = tel.metrics.get(f"{kind}/flushed_frac")
        if fl is not None:
            out[f"{kind}_flushed_frac_mean"] = _stat(fl, statistics.fmean)
            out[f"{kind}_flushed_frac_max"] = _stat(fl, max)
        hr = tel.metrics.get(f"{kind}/headroom_bits")
        if hr is not None:
            clean = [h for h, s in zip(hr, tel.skipped) if not s]
            out[f"{kind}_headroom_bits_median_clean"] = _stat(clean, statistics.median)
            out[f"{kind}_headroom_bits_min_clean"] = _stat(clean, min)
    for kind in ("act", "param"):
        per = tel.layer_series(kind, "flushed_frac")
        if per:
            out[f"{kind}_flushed_frac_mean"] = {layer: _stat(v, statistics.fmean) for layer, v in per.items()}
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3g}"
        return f"{v:.4g}"
    return str(v)


def render_run_report(jsonl_path: str, out_dir: str) -> Dict[str, Any]:
    """Read ``jsonl_path``, write ``out_dir/telemetry.png`` (+ per-layer PNGs), ``summary.json`` and
    ``index.html``; return the summary dict.
    """
    from . import plots

    tel = read_jsonl(jsonl_path)
    os.makedirs(out_dir, exist_ok=True)
    summary = summarize(tel)
    pairs = (("grad/{}", "gradients"), ("act/{}", "activation gradients"))
    flushed = {label: tel.metrics[key.format("flushed_frac")] for key, label in pairs
               if key.format("flushed_frac") in tel.metrics}
    headroom = {label: tel.metrics[key.format("headroom_bits")] for key, label in pairs
                if key.format("headroom_bits") in tel.metrics}
    images = []
    plots.plot_telemetry(os.path.join(out_dir, "telemetry.png"), tel.step, tel.loss_scale, tel.skipped,
                         flushed=flushed or None, headroom=headroom or None,
                         title=f"{os.path.basename(jsonl_path)}: loss scale, skipped steps, underflow, headroom")
    images.append(("telemetry.png", "Loss scale per step (skipped steps marked, dashed: the overflow line "
                   "loss_scale·2^headroom), fraction of nonzero gradients flushed to 0, headroom in binades."))
    for kind, overall, what in (("act", "act", "activation gradients"), ("param", "grad", "parameter gradients")):
        fl = tel.layer_series(kind, "flushed_frac")
        hr = tel.layer_series(kind, "headroom_bits")
        if not (fl or hr):
            continue
        # The overall series first: drawn thick, and the one the overflow line is drawn from.
        if fl and f"{overall}/flushed_frac" in tel.metrics:
            fl = {"all": tel.metrics[f"{overall}/flushed_frac"], **fl}
        if hr and f"{overall}/headroom_bits" in tel.metrics:
            hr = {"all": tel.metrics[f"{overall}/headroom_bits"], **hr}
        name = f"layers_{kind}.png"
        plots.plot_telemetry(os.path.join(out_dir, name), tel.step, tel.loss_scale, tel.skipped,
                             flushed=fl or None, headroom=hr or None, title=f"Per layer: {what}")
        images.append((name, f"Per-layer {what}: flushed fraction and headroom per step."))
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump({"source": os.path.abspath(jsonl_path), "meta": tel.meta, "figures": summary}, fh, indent=2,
                  default=str)
    rows = [(k, _fmt(v)) for k, v in summary.items() if not isinstance(v, dict)]
    for k, v in summary.items():
        if isinstance(v, dict):
            rows.extend((f"{k}[{layer}]", _fmt(x)) for layer, x in v.items())
    sec = Section("Telemetry", text=[
        "Every figure below is read from the JSONL file; nothing is recomputed.",
        "Missing panels mean the file has no such keys (see lossscale.report.schema for the record format).",
    ], figures=rows, images=images, anchor="telemetry")
    meta = "; ".join(f"{k}={v}" for k, v in tel.meta.items())
    write_html(os.path.join(out_dir, "index.html"), f"lossscale report: {os.path.basename(jsonl_path)}", [sec],
               subtitle=f"{summary['steps']} steps" + (f" — {meta}" if meta else ""),
               footer="Written by `lossscale report`.")
    return summary
