"""``lossscale report RUN.jsonl --out DIR``: the demo's telemetry plots for a user's own recorded run."""

from __future__ import annotations

import json
import math
import os
import statistics
from typing import Any, Dict, List, Optional

from .html import Section, check_out_dir, write_html
from .schema import Telemetry, _clean, read_jsonl

__all__ = ["summarize", "describe", "steps_text", "render_run_report"]


def _finite(vals) -> List[float]:
    return [v for v in vals if v is not None and math.isfinite(v)]


def _stat(vals, fn) -> Optional[float]:
    vals = _finite(vals)
    return fn(vals) if vals else None


def _log_every(steps: List[int]) -> Optional[int]:
    """The most common gap between consecutive logged step numbers (None with fewer than two records)."""
    gaps = [b - a for a, b in zip(steps, steps[1:]) if b > a]
    return statistics.mode(gaps) if gaps else None


def _skipped_steps(tel: Telemetry) -> int:
    """Skipped steps from the first logged step to the last, logged or not.

    The scaler's cumulative ``skipped_steps`` counter counts the steps between records too; without it
    only the records' own ``skipped`` flags can be counted.
    """
    first, last = tel.skipped_steps[0], tel.skipped_steps[-1]
    if first is not None and last is not None and last >= first:
        return last - first + int(tel.skipped[0])  # the first record's own skip lies inside the span
    return sum(tel.skipped)


def summarize(tel: Telemetry) -> Dict[str, Any]:
    """The figures of a recorded run: steps, skips, scale moves, flushed fraction, headroom, per layer.

    ``steps`` is read from the logged step numbers (``last_step - first_step + 1``), so a run logged
    every 10 steps counts its steps, not its ``records``; ``log_every`` is the usual gap between
    records. ``skipped_steps`` comes from the cumulative ``skipped_steps`` counter when the records
    carry it (it sees the steps between records too), else from the records' ``skipped`` flags
    (``skipped_records``). ``backoffs``/``growths`` compare consecutive records.
    ``scale_min``/``scale_max`` are over the finite scales; ``nonfinite_scales`` counts the NaN/inf
    ones (a broken scale, logged as such); ``bad_lines`` counts the lines the reader skipped.
    ``<kind>_flushed_frac_mean``/``_max`` are over the overall series ``<kind>/flushed_frac``;
    ``<kind>_flushed_frac_mean_per_layer`` maps each layer to the mean of ``<kind>/<layer>/flushed_frac``.
    """
    n = len(tel)
    scales = tel.loss_scale
    moves = list(zip(scales, scales[1:]))
    steps = max(tel.step) - min(tel.step) + 1 if n else 0
    skipped = _skipped_steps(tel) if n else 0
    out: Dict[str, Any] = {
        "steps": steps,
        "records": n,
        "log_every": _log_every(tel.step),
        "first_step": min(tel.step) if n else None,
        "last_step": max(tel.step) if n else None,
        "skipped_steps": skipped,
        "skipped_records": sum(tel.skipped),
        "skipped_frac": skipped / steps if steps else 0.0,
        "scale_first": scales[0] if n else None,
        "scale_last": scales[-1] if n else None,
        "scale_min": _stat(scales, min),
        "scale_max": _stat(scales, max),
        "nonfinite_scales": sum(1 for v in scales if not math.isfinite(v)),
        "backoffs": sum(1 for a, b in moves if b < a),  # comparisons with NaN are False: not a move
        "growths": sum(1 for a, b in moves if b > a),
        "bad_lines": len(tel.bad_lines),
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
            # Its own key: it once shared "act_flushed_frac_mean" and replaced the overall mean.
            out[f"{kind}_flushed_frac_mean_per_layer"] = {layer: _stat(v, statistics.fmean) for layer, v in per.items()}
    return out


_WHAT = {
    "grad": "all parameter gradients together",
    "act": "all watched modules together",
    "param": "parameter gradients",
}

_PLAIN = {
    "steps": "optimizer steps from the first logged step to the last (last_step - first_step + 1)",
    "records": "step records read",
    "log_every": "usual gap between the step numbers of consecutive records",
    "first_step": "first logged step",
    "last_step": "last logged step",
    "skipped_steps": "steps skipped (inf/NaN gradients), from the skipped_steps counter when logged",
    "skipped_records": "records whose own step was skipped",
    "skipped_frac": "share of steps skipped",
    "scale_first": "loss_scale of the first record",
    "scale_last": "loss_scale of the last record",
    "scale_min": "smallest finite loss_scale",
    "scale_max": "largest finite loss_scale",
    "nonfinite_scales": "records whose loss_scale is NaN or inf",
    "backoffs": "loss_scale decreases (backoffs) from one record to the next",
    "growths": "loss_scale increases (growths) from one record to the next",
    "bad_lines": "lines skipped (not a valid record)",
}


def steps_text(summary: Dict[str, Any]) -> str:
    """``"431 steps (0..430, 44 records, one every 10)"``: the run's length as the report states it."""
    span = f"{summary['first_step']}..{summary['last_step']}"
    every = summary.get("log_every")
    if summary["records"] != summary["steps"]:
        span += f", {summary['records']} records" + (f", one every {every}" if every and every > 1 else "")
    return f"{summary['steps']} steps ({span})"


def _plain(label: str) -> str:
    """A name from the run as matplotlib text: a ``$`` would start mathtext (``$\\foo$`` in a layer's
    name made the whole report fail), so each one is escaped to print as it is."""
    return label.replace("$", r"\$")


def describe(key: str, layer: Optional[str] = None, logged: Optional[str] = None) -> str:
    """What a summary figure is, naming the JSONL series it is computed over.

    E.g. ``act_flushed_frac_max`` is the max over steps of ``act/flushed_frac`` (all watched modules
    together), while ``act_flushed_frac_mean_per_layer[fc1]`` is the mean of ``act/fc1/flushed_frac``
    (one module): the two are over different series, so a layer's mean can exceed the overall max.
    ``logged`` is a layer's key as the file holds it (:meth:`Telemetry.layer_key`), e.g.
    ``grad/fc1.weight/flushed_frac`` for a ``param_...`` figure.
    """
    if layer is not None:  # {kind}_flushed_frac_mean_per_layer[layer]
        kind = key.split("_", 1)[0]
        return f"{key}[{layer}]: mean over steps of {logged or f'{kind}/{layer}/flushed_frac'} ({layer} alone)"
    for stat, words in (
        ("_flushed_frac_mean", "mean over steps of {k}/flushed_frac"),
        ("_flushed_frac_max", "max over steps of {k}/flushed_frac"),
        ("_headroom_bits_median_clean", "median over unskipped steps of {k}/headroom_bits"),
        ("_headroom_bits_min_clean", "min over unskipped steps of {k}/headroom_bits"),
    ):
        if key.endswith(stat):
            k = key[: -len(stat)]
            return f"{key}: {words.format(k=k)} ({_WHAT.get(k, k)})"
    return f"{key}: {_PLAIN[key]}" if key in _PLAIN else key


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

    ``out_dir`` is checked (created, writable) before the file is read.  Bad lines of the file are
    skipped with a warning (see :func:`lossscale.report.schema.read_jsonl`).

    Raises:
        ValueError: ``out_dir`` cannot be used, or the file holds no valid step record.
        OSError: the file cannot be read.
    """
    from . import plots

    check_out_dir(out_dir)
    tel = read_jsonl(jsonl_path)
    summary = summarize(tel)
    # Legends name the series they draw, as the figure table does.
    pairs = (("grad/{}", "gradients, all together"), ("act/{}", "activation gradients, all watched modules"))
    flushed = {
        f"{label} ({key.format('flushed_frac')})": tel.metrics[key.format("flushed_frac")]
        for key, label in pairs
        if key.format("flushed_frac") in tel.metrics
    }
    headroom = {
        f"{label} ({key.format('headroom_bits')})": tel.metrics[key.format("headroom_bits")]
        for key, label in pairs
        if key.format("headroom_bits") in tel.metrics
    }
    images = []
    plots.plot_telemetry(
        os.path.join(out_dir, "telemetry.png"),
        tel.step,
        tel.loss_scale,
        tel.skipped,
        flushed=flushed or None,
        headroom=headroom or None,
        title=f"{os.path.basename(jsonl_path)}: loss scale, skipped steps, underflow, headroom",
    )
    first_hr = next(iter(headroom), None)
    images.append(
        (
            "telemetry.png",
            "Top: loss scale per step (x: skipped steps"
            + (f"; dashed: the overflow line, loss_scale·2^headroom of {first_hr}" if first_hr else "")
            + "). Below: share flushed to 0 and headroom in binades, each line one JSONL series as logged "
            "(its key in the legend).",
        )
    )
    for kind, overall, what in (("act", "act", "activation gradients"), ("param", "grad", "parameter gradients")):
        fl = tel.layer_series(kind, "flushed_frac")
        hr = tel.layer_series(kind, "headroom_bits")
        if not (fl or hr):
            continue
        # The overall series first: drawn thick, and the one the overflow line is drawn from.
        fl = {_plain(f"{layer} ({tel.layer_key(kind, layer, 'flushed_frac')})"): v for layer, v in fl.items()}
        hr = {_plain(f"{layer} ({tel.layer_key(kind, layer, 'headroom_bits')})"): v for layer, v in hr.items()}
        prefixes = sorted({key.split("/", 1)[0] for (k, _, _), key in tel.layer_keys.items() if k == kind})
        thick = []
        if fl and f"{overall}/flushed_frac" in tel.metrics:
            fl = {f"all together ({overall}/flushed_frac)": tel.metrics[f"{overall}/flushed_frac"], **fl}
            thick.append(f"{overall}/flushed_frac")
        if hr and f"{overall}/headroom_bits" in tel.metrics:
            hr = {f"all together ({overall}/headroom_bits)": tel.metrics[f"{overall}/headroom_bits"], **hr}
            thick.append(f"{overall}/headroom_bits")
        name = f"layers_{kind}.png"
        plots.plot_telemetry(
            os.path.join(out_dir, name),
            tel.step,
            tel.loss_scale,
            tel.skipped,
            flushed=fl or None,
            headroom=hr or None,
            title=f"Per layer: {what}",
        )
        images.append(
            (
                name,
                f"Per-layer {what}: flushed fraction and headroom per step. Thin lines: one "
                f"layer each ({' and '.join(f'{p}/<layer>/...' for p in prefixes)})"
                + (f"; thick black: {' and '.join(thick)}, over all layers together." if thick else "."),
            )
        )
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as fh:
        # Strict JSON: a NaN scale (as logged) is written as null.
        json.dump(
            _clean(
                {
                    "source": os.path.abspath(jsonl_path),
                    "meta": tel.meta,
                    "figures": summary,
                    "bad_lines": [{"line": i, "reason": why} for i, why in tel.bad_lines],
                }
            ),
            fh,
            indent=2,
            default=str,
            allow_nan=False,
        )
    rows = [(describe(k), _fmt(v)) for k, v in summary.items() if not isinstance(v, dict)]
    for k, v in summary.items():
        if isinstance(v, dict):
            kind = k.split("_", 1)[0]
            rows.extend(
                (describe(k, layer, tel.layer_key(kind, layer, "flushed_frac")), _fmt(x)) for layer, x in v.items()
            )
    text = [
        "Every figure below is read from the JSONL file; nothing is recomputed. Each row names the series "
        "(JSONL key) it is computed over.",
        "Missing panels mean the file has no such keys (see lossscale.report.schema for the record format).",
    ]
    if any(isinstance(v, dict) for v in summary.values()):
        text.append(
            "An overall series (e.g. act/flushed_frac) counts the values of all layers together, so "
            "layers with many values weigh more in it; a per-layer series (act/<layer>/flushed_frac) "
            "counts one layer. A small layer's mean can therefore exceed the overall max."
        )
    if tel.bad_lines:
        text.append(
            f"{len(tel.bad_lines)} line(s) of the file were skipped as not valid records: "
            + "; ".join(f"line {i}: {why}" for i, why in tel.bad_lines[:5])
            + ("; ..." if len(tel.bad_lines) > 5 else "")
        )
    sec = Section("Telemetry", text=text, figures=rows, images=images, anchor="telemetry")
    meta = "; ".join(f"{k}={v}" for k, v in tel.meta.items())
    write_html(
        os.path.join(out_dir, "index.html"),
        f"lossscale report: {os.path.basename(jsonl_path)}",
        [sec],
        subtitle=steps_text(summary) + (f" — {meta}" if meta else ""),
        footer="Written by `lossscale report`.",
    )
    return summary
