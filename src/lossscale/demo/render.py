"""Turn a :class:`~lossscale.demo.run.DemoResult` into plots, ``index.html``, ``summary.json`` and a
terminal table. Every number written here was measured by the run; nothing is computed from
assumptions.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict
from typing import Any, Dict, List, Optional

from ..report import plots
from ..report.html import Section, write_html
from ..report.schema import _clean, write_jsonl
from ..stats import grad_stats
from . import bad_batches as B
from .claims import ClaimResult, overflow_envelope, overflow_line, p2, pct
from .workload import RunResult

__all__ = ["render", "write_summary", "terminal_summary", "bad_batch_summary", "SUMMARY_VERSION"]

SUMMARY_VERSION = 1
_CURVE_RUNS = ("fp32", "fp16_noscale", "static", "dynamic", "adaptive", "torch_default")
_STEP_KEYS = (
    "loss",
    "loss_scale",
    "skipped",
    "injected",
    "grad/headroom_bits",
    "act/flushed_frac",
    "clip_fired",
    "true_norm",
    "applied_norm",
)


def _run_dict(run: RunResult) -> Dict[str, Any]:
    per_step: Dict[str, List[Any]] = {}
    for key in _STEP_KEYS:
        vals = run.series(key)
        if any(v is not None for v in vals):
            per_step[key] = vals
    layer_keys = sorted({k for s in run.steps for k in s if k.startswith("act/") and k.count("/") == 2})
    for key in layer_keys:
        per_step[key] = run.series(key)
    return {
        "label": run.label,
        "final_acc": run.final_acc,
        "steps": len(run.steps),
        "skipped_steps": run.skipped_steps,
        "final_scale": run.steps[-1]["loss_scale"] if run.steps else None,
        "unchanged_frac": run.unchanged_frac,
        "wall_s": round(run.wall_s, 3),
        "epochs": {k: [e[k] for e in run.epochs] for k in ("epoch", "step", "train_loss", "test_acc")},
        "per_step": per_step,
    }


def _fmt_value(key: str, v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        k = key.lower()
        if k.endswith("log2"):
            return f"2^{v:.2f}"
        if k.startswith("shift") and v > 0:
            return f"2^{math.log2(v):g}"
        if k.endswith(("frac", "acc")) or k.startswith("frac"):
            return pct(v, 3 if 0 < v < 0.001 else 2 if v < 0.1 else 1)
        if (
            "scale" in k
            or "threshold" in k
            or "smallest" in k
            or k.startswith("cast_")
            or k.endswith("max")
            or k.startswith("torch_finfo")
        ):
            if v > 0 and math.log2(v) == int(math.log2(v)) and abs(math.log2(v)) >= 4:
                return f"{v:.6g} = 2^{int(math.log2(v))}"
            return f"{v:.6g}"
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_fmt_value(k, x)}" for k, x in v.items())
    return str(v)


_RUN_ROWS = (
    ("first_scale", "first scale"),
    ("max_scale", "largest scale"),
    ("final_scale", "final scale"),
    ("growths", "growths"),
    ("backoffs", "backoffs"),
    ("skipped_steps", "skipped steps"),
    ("first_overflow_step", "first overflow at step"),
    ("mean_flushed_frac", "activation gradients flushed (mean of the probes)"),
    ("final_acc", "test accuracy"),
)
_DYNAMIC_ONLY = (
    ("median_gap_bits_after_first_overflow", "median gap to the per-step line after the first overflow (binades)"),
    ("median_envelope_gap_bits_after_first_overflow", "median gap to the growth-interval line (binades)"),
    ("frac_within_2_bits_of_envelope_after_first_overflow", "steps within 2 binades of it"),
    ("line_first_quarter_log2", "overflow line, first quarter of training (median)"),
    ("line_last_quarter_log2", "overflow line, last quarter of training (median)"),
)


def _claim_section(cr: ClaimResult) -> Section:
    rows = [(cr.labels[k], _fmt_value(k, cr.figures[k])) for k in cr.labels if k in cr.figures]
    grid = None
    f = cr.figures
    if cr.id == "C6":
        keys = [k for k in ("dynamic", "torch_default", "adaptive") if isinstance(f.get(k), dict)]
        header = ["measured"] + [cr.labels.get(f"{k}.summary", k) for k in keys]
        grid = (header, [[label] + [_fmt_value(sub, f[k].get(sub)) for k in keys] for sub, label in _RUN_ROWS])
        rows += [
            (f"lossscale dynamic: {label}", _fmt_value(sub, f["dynamic"][sub]))
            for sub, label in _DYNAMIC_ONLY
            if sub in f.get("dynamic", {})
        ]
    if cr.id == "C5" and "log2_scales" in f:
        header = ["static scale", "test accuracy", "steps skipped"]
        header += ["true gradients flushed", "true gradients overflowing"]
        body = [
            [
                f"S = 2^{k}",
                pct(f["acc"][i]),
                pct(f["skipped_frac"][i]),
                pct(f["flushed_frac"][i], 2),
                pct(f["overflow_frac"][i], 3),
            ]
            for i, k in enumerate(f["log2_scales"])
        ]
        grid = (header, body)
    text = [cr.method] if cr.method else []
    pre, wrap = None, False
    if cr.id == "C1" and f.get("table"):
        # The formats table is ~200 characters wide: as preformatted text it ran off the page.
        # As an HTML table its cells wrap ("65504 =" over "2^15*1.999...") and it fits.
        parsed = text_table_grid(f["table"])
        if parsed is not None and grid is None:
            grid, wrap = parsed, True
        else:
            pre = f["table"]
    return Section(
        f"{cr.id} · {cr.title}",
        verdict=cr.verdict,
        claim=cr.claim,
        text=text,
        figures=rows,
        checks=[(c.name, c.passed, c.detail) for c in cr.checks],
        images=list(cr.images),
        grid=grid,
        grid_wrap=wrap,
        pre=pre,
        anchor=cr.id,
    )


def text_table_grid(text: str):
    """``(header, rows)`` of a plain-text table laid out as ``lossscale.formats.table()`` does it, or None.

    The layout: a header line, a line of dashes with one run of ``-`` per column, then the rows,
    every column starting where its dashes start.
    """
    lines = text.splitlines()
    if len(lines) < 3 or not lines[1].strip() or set(lines[1]) - {"-", " "}:
        return None
    starts = [m.start() for m in re.finditer(r"-+", lines[1])]
    bounds = list(zip(starts, starts[1:] + [None]))

    def cells(line: str) -> List[str]:
        return [line[a:b].strip() for a, b in bounds]

    return cells(lines[0]), [cells(line) for line in lines[2:] if line.strip()]


def _make_plots(result, out_dir: str, by_id: Dict[str, ClaimResult]) -> Dict[str, Any]:
    """Draw every plot the data allows; attach images to claims; return the plotted data for summary.json."""
    cfg = result.config
    runs = result.runs
    data: Dict[str, Any] = {}
    img = lambda name: os.path.join(out_dir, name)  # noqa: E731

    # Training curves: the overview.
    curve_runs = {
        n: {
            "label": runs[n].label,
            "epoch": [e["epoch"] for e in runs[n].epochs],
            "train_loss": [e["train_loss"] for e in runs[n].epochs],
            "test_acc": [e["test_acc"] for e in runs[n].epochs],
        }
        for n in _CURVE_RUNS
        if n in runs
    }
    plots.plot_curves(
        img("curves.png"),
        curve_runs,
        chance=result.chance,
        title=f"Digits MLP, loss x 2^-{cfg.shift_log2} and lr x 2^{cfg.shift_log2} on purpose: "
        "identical in FP32, lost in FP16 without scaling",
    )
    data["curves"] = {
        "caption": "Training loss and test accuracy per epoch. FP32 (dashed) is the reference; every "
        "FP16 run uses FP32 master weights under autocast. Compare FP16 without scaling (red) with "
        "the scaled runs."
    }

    # Number line (C1) and the gradients on it (C2 before scaling, C3 before and after).
    c1 = by_id["C1"].figures
    fmt = {
        "name": "fp16",
        "max": c1["max"],
        "smallest_normal": c1["smallest_normal"],
        "smallest_subnormal": c1["smallest_subnormal"],
        "flush_threshold": c1["flush_threshold"],
    }
    plots.plot_number_line(
        img("fp16_number_line.png"),
        fmt,
        {},
        None,
        band=None,
        title="FP16's number line (lossscale.formats, checked by torch casts)",
    )
    by_id["C1"].images.append(
        (
            "fp16_number_line.png",
            "FP16's range: flushed to 0 at or below 2^-25, subnormal "
            "from 2^-24 to 2^-14, normal up to 65504, inf from 65520.",
        )
    )
    gs = grad_stats(list(result.grads["fp32"].values()), scale=1.0, fmt="fp16")
    before = gs.binades()
    after = gs.at(2.0**cfg.static_log2).binades()
    data["number_line"] = {"format": fmt, "hist_before": before, "hist_after": after, "scale_log2": cfg.static_log2}
    plots.plot_number_line(
        img("gradients_unscaled.png"),
        fmt,
        before,
        None,
        title=f"The first batch's exact gradients under the shift 2^-{cfg.shift_log2}, on FP16's number line",
    )
    by_id["C2"].images.append(
        (
            "gradients_unscaled.png",
            "Exponent histogram (lossscale.stats) of the first "
            "batch's exact FP32 gradients: almost all of them sit left of the cliff.",
        )
    )
    plots.plot_number_line(
        img("gradients_scaled.png"),
        fmt,
        before,
        after,
        scale_log2=cfg.static_log2,
        title=f"The same gradients scaled by 2^{cfg.static_log2}: the whole distribution slides right, unchanged",
    )
    by_id["C3"].images.append(
        (
            "gradients_scaled.png",
            f"Grey: the exact gradients; blue: the same gradients "
            f"times 2^{cfg.static_log2}, a shift by {cfg.static_log2} binades with the "
            "shape intact (histograms from lossscale.stats, .at(S) for the scaled one).",
        )
    )

    # Per-layer activation gradients flushed (C3).
    layers = sorted(
        {layer for d in result.layer_probe.values() for layer in d},
        key=lambda n: (
            list(next(iter(result.layer_probe.values()))).index(n)
            if n in next(iter(result.layer_probe.values()))
            else 99
        ),
    )
    series = {label: [d.get(layer) for layer in layers] for label, d in result.layer_probe.items()}
    plots.plot_layer_flush(img("layer_flush.png"), layers, series)
    data["layer_flush"] = {"layers": layers, "series": series}
    by_id["C3"].images.append(
        (
            "layer_flush.png",
            "Per layer: share of the exact activation gradients (first "
            "batch, fresh model) that FP16 flushes to 0 at each scale "
            "(lossscale.hooks.activation_grad_probe).",
        )
    )

    # Clip order (C4).
    clip = {}
    for name in ("clip_right", "clip_wrong"):
        r = runs[name]
        clip[name] = {
            "label": r.label,
            "epoch": [e["epoch"] for e in r.epochs],
            "test_acc": [e["test_acc"] for e in r.epochs],
            "step": [s["step"] for s in r.steps],
            "norm_ratio": [s["applied_norm"] / s["true_norm"] if s.get("true_norm") else None for s in r.steps],
        }
    plots.plot_clip_order(
        img("clip_order.png"),
        clip,
        clip_norm=cfg.clip_norm,
        title=f"Clip after unscaling, not before (static S=2^{cfg.static_log2})",
    )
    by_id["C4"].images.append(
        (
            "clip_order.png",
            "Left: test accuracy. Right: norm of the update the optimizer "
            "received over the norm of the true gradient, per step.",
        )
    )

    # Static sweep (C5).
    c5 = by_id["C5"].figures
    plots.plot_sweep(
        img("static_sweep.png"),
        c5["log2_scales"],
        c5["acc"],
        c5["skipped_frac"],
        fp32_acc=c5["fp32_acc"],
        flushed_frac=c5["flushed_frac"],
        overflow_frac=c5["overflow_frac"],
        window=c5.get("window_log2"),
        chance=result.chance,
        title=f"Static loss scale sweep ({cfg.sweep_epochs} epochs each)",
    )
    by_id["C5"].images.append(
        (
            "static_sweep.png",
            "Top: final accuracy per static scale (green: the measured "
            "window). Bottom: steps skipped for inf/NaN, and the share of the first batch's true "
            "gradients FP16 flushes or overflows at that scale.",
        )
    )

    # Scale trajectories (C6).
    traj = {}
    for name in ("dynamic", "adaptive", "torch_default"):
        r = runs[name]
        line = overflow_line(r) if name == "dynamic" else None
        traj[name] = {
            "label": r.label,
            "step": [s["step"] for s in r.steps],
            "loss_scale": r.series("loss_scale"),
            "skipped": r.series("skipped"),
            "line": line,
            "envelope": overflow_envelope(line, cfg.growth_interval) if line else None,
        }
    plots.plot_scale_trajectory(img("scale_trajectory.png"), traj)
    by_id["C6"].images.append(
        (
            "scale_trajectory.png",
            "Loss scale per step; x marks a skipped step (inf/NaN). "
            "Dashed: the measured overflow line, the scale at which that step's largest gradient "
            "would have reached 65504 (S x 2^headroom, from the scaler's telemetry). Dotted: its "
            f"lowest value over the last {cfg.growth_interval} steps (the growth interval), the "
            "line the dynamic scale has to stay under.",
        )
    )
    dyn = runs["dynamic"]
    act = (
        {"activation gradients (exact FP32 probe at the scale in use)": dyn.series("act/flushed_frac")}
        if any(v is not None for v in dyn.series("act/flushed_frac"))
        else None
    )
    head = (
        {"gradients (scaler telemetry)": dyn.series("grad/headroom_bits")}
        if any(v is not None for v in dyn.series("grad/headroom_bits"))
        else None
    )
    plots.plot_telemetry(
        img("telemetry_dynamic.png"),
        dyn.series("step"),
        dyn.series("loss_scale"),
        dyn.series("skipped"),
        flushed=act,
        headroom=head,
        title="The dynamic run as lossscale's telemetry records it",
    )
    by_id["C6"].images.append(
        (
            "telemetry_dynamic.png",
            "The dynamic run's telemetry (written to dynamic.jsonl; "
            "`lossscale report dynamic.jsonl` draws the same): scale and skips, share of exact "
            "activation gradients flushed at the scale in use, headroom of the gradients.",
        )
    )

    # Bad batches (a section of its own, not a claim).
    bb = result.bad_batches
    if bb is not None:
        plots.plot_bad_batches(
            img("bad_batches.png"),
            {
                n: {
                    "label": r.label,
                    "step": r.series("step"),
                    "loss_scale": r.series("loss_scale"),
                    "skipped": r.series("skipped"),
                    "final_scale": r.final_scale,
                    "epoch": [e["epoch"] for e in r.epochs],
                    "test_acc": [e["test_acc"] for e in r.epochs],
                }
                for n, r in bb.runs.items()
            },
            chance=result.chance,
            title=f"{bb.figures['n_bad']} of {bb.figures['n_steps']} batches with a NaN input row: torch's "
            "scale against lossscale's",
        )
        data["bad_batches"] = {
            "caption": "Left: the loss scale each step ran with (x: a skipped step); the line ends "
            "with the scale after the last update. The wide grey line is the clean run, under "
            "lossscale's where they agree. Right: test accuracy per epoch."
        }
    return data


def _write_dynamic_jsonl(run: RunResult, path: str) -> None:
    records = [{"meta": {"run": run.name, "label": run.label, "format": "fp16", "source": "lossscale demo"}}]
    for s in run.steps:
        rec = {
            k: v
            for k, v in s.items()
            if k in ("step", "loss_scale", "skipped", "loss", "grad/headroom_bits", "grad/amax") or k.startswith("act/")
        }
        records.append(rec)
    with open(path, "w", encoding="utf-8") as fh:
        write_jsonl(fh, records)


def render(result, out_dir: str) -> Dict[str, Any]:
    """Write the PNGs, ``dynamic.jsonl`` and ``index.html`` into ``out_dir``; return the summary dict."""
    os.makedirs(out_dir, exist_ok=True)
    by_id = {c.id: c for c in result.claims}
    plotted = _make_plots(result, out_dir, by_id)
    _write_dynamic_jsonl(result.runs["dynamic"], os.path.join(out_dir, "dynamic.jsonl"))
    cfg = result.config
    summary = {
        "lossscale_demo_summary": SUMMARY_VERSION,
        "config": asdict(cfg),
        "environment": result.environment,
        "timings": dict(result.timings),
        "chance_acc": result.chance,
        "shift_c": 2.0**-cfg.shift_log2,
        "verdicts": {c.id: c.verdict for c in result.claims},
        "claims": {c.id: c.to_dict() for c in result.claims},
        "runs": {name: _run_dict(r) for name, r in result.runs.items()},
        "sweep": [
            {"log2_scale": k, **{x: y for x, y in _run_dict(r).items() if x != "per_step"}} for k, r in result.sweep
        ],
        "layer_probe": result.layer_probe,
        "plots": plotted,
    }
    if result.bad_batches is not None:
        summary["bad_batches"] = bad_batch_summary(result.bad_batches)
    _write_html(result, summary, out_dir)
    write_summary(summary, out_dir)
    return summary


def _scale_path(run: Dict[str, Any]) -> str:
    """``"2^16 -> 2^-19"``, or ``"2^16 throughout"`` when the scale never moved."""
    first, final, low = run["first_scale"], run["final_scale"], run["min_scale"]
    if first == final == low == run["max_scale"]:
        return f"{p2(first)} throughout"
    return f"{p2(first)} -> {p2(final)}" + ("" if low == final else f" (lowest {p2(low)})")


def bad_batch_summary(bb: "B.BadBatches") -> Dict[str, Any]:
    """The bad-batch section's entry in ``summary.json`` (key ``"bad_batches"``)."""
    return {
        "what": "bad batches: a share of the batches carry a NaN input row (a NaN loss before scaling); "
        "torch.amp.GradScaler against lossscale.GradScaler(trace=True), and a clean run",
        "frac": bb.frac,
        "epochs": bb.epochs,
        "wall_s": round(bb.wall_s, 3),
        "headline": _bad_headline(bb.figures),
        # final_scale: after the last update here (the main runs' is the scale the last step ran with).
        "figures": bb.figures,
        "runs": {name: {**_run_dict(r), "final_scale": r.final_scale} for name, r in bb.runs.items()},
    }


def _bad_headline(f: Dict[str, Any]) -> str:
    r = f["runs"]
    return (
        f"torch's scale {_scale_path(r['bad_torch'])}, acc {pct(r['bad_torch']['final_acc'])}; lossscale's "
        f"{_scale_path(r['bad_lossscale'])}, acc {pct(r['bad_lossscale']['final_acc'])} "
        f"(clean run {pct(r['bad_clean']['final_acc'])})"
    )


def _bad_batch_section(bb: "B.BadBatches", caption: str) -> Section:
    f = bb.figures
    r = f["runs"]
    tor, ls, clean = r["bad_torch"], r["bad_lossscale"], r["bad_clean"]
    bad = f["bad_steps"]
    if f["skipped_steps"]["bad_torch"] == bad and f["skipped_steps"]["bad_lossscale"] == bad:
        skips = f"Both scalers skip exactly the {f['n_bad']} corrupt steps."
    else:
        skips = (
            f"torch's scaler skips {tor['skipped_steps']} steps and lossscale's {ls['skipped_steps']}, for "
            f"{f['n_bad']} corrupt ones."
        )
    off = f["lossscale_steps_off_clean_scale"]
    same = (
        "the clean run's scale at every step"
        if off == 0
        else f"off the clean run's scale at {off} of {f['n_steps'] + 1} points"
    )
    text = [
        f"{f['n_bad']} of the {f['n_steps']} batches ({pct(f['n_bad'] / max(f['n_steps'], 1))}) of a run of "
        f"{bb.epochs} epochs each carry one corrupt example: its input row is set to NaN, so the batch's loss is "
        "NaN before any scaling. Data, model init, batch order, loss shift and FP16 autocast are those of the runs "
        'above. Both scalers are used as shipped, torch.amp.GradScaler("cpu") and '
        "lossscale.GradScaler(model=model, trace=True), on the same batches; the clean run is the lossscale run "
        "without the corrupt batches.",
        "The loss scale multiplies only the backward: it neither causes nor cures a NaN loss. "
        + skips
        + f" torch's scaler also backs off, {tor['backoffs']} times: its scale goes {_scale_path(tor)}, and its test "
        f"accuracy ends at {pct(tor['final_acc'])}. lossscale counts them as bad_loss_steps ({ls['bad_loss_steps']}) "
        f"and {'does not back off' if ls['backoffs'] == 0 else 'backs off ' + str(ls['backoffs']) + ' times'}: "
        f"its scale is {_scale_path(ls)}, {same}, and its test accuracy ends at {pct(ls['final_acc'])} (clean run: "
        f"{pct(clean['final_acc'])}).",
    ]
    rows = []
    diag = f.get("first_diagnosis")
    if diag:
        causes = f["causes"]
        same_cause = (
            f" All {sum(causes.values())} skipped steps got this diagnosis."
            if len(causes) == 1
            else f" The {sum(causes.values())} skipped steps got {len(causes)} different diagnoses "
            "(summary.json counts them)."
        )
        text.append(
            f"lossscale's diagnosis of the first corrupt batch (step {f['first_bad_step']}), "
            f'overflow_report()["cause"]: \u201c{diag["cause"]}\u201d' + same_cause
        )
        rows = [
            ("the first corrupt batch", f"step {f['first_bad_step']}"),
            ('overflow_report()["loss"]: the loss before scaling', str(diag.get("loss"))),
            ('["forward"]: the first module whose forward output was non-finite', str(diag.get("forward"))),
            (
                '["backward"]: the first module, in backward order, with a non-finite gradient',
                str(diag.get("backward")),
            ),
            ('["scale"]: the scale the step ran with', p2(diag.get("scale"))),
            ('["nan"]: parameters with NaN gradients', str(len(diag.get("nan") or []))),
        ]
    grid = (
        ["run", "test accuracy", "skipped steps", "bad_loss_steps", "loss scale", "backoffs", "seconds"],
        [
            [
                bb.runs[n].label,
                pct(x["final_acc"]),
                f"{x['skipped_steps']} of {x['steps']}",
                "n/a" if x["bad_loss_steps"] is None else str(x["bad_loss_steps"]),
                _scale_path(x),
                str(x["backoffs"]),
                f"{bb.runs[n].wall_s:.1f}",
            ]
            for n, x in ((n, r[n]) for n in B.NAMES)
        ],
    )
    return Section(
        "Bad batches: a NaN loss is not the scale's fault",
        text=text,
        figures=rows,
        grid=grid,
        images=[("bad_batches.png", caption)],
        anchor="bad-batches",
    )


def write_summary(summary: Dict[str, Any], out_dir: str) -> str:
    """Write ``out_dir/summary.json`` (strict JSON: inf/NaN become null)."""
    path = os.path.join(out_dir, "summary.json")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(_dumps(_clean(summary)) + "\n")
    return path


def _dumps(obj: Any, indent: int = 0) -> str:
    """JSON with nested objects indented and lists of plain values on one line (per-step series stay short)."""
    pad = " " * (indent + 1)
    if isinstance(obj, dict) and obj:
        items = [f"{pad}{json.dumps(str(k))}: {_dumps(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    if isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in obj):
        return "[\n" + ",\n".join(pad + _dumps(v, indent + 1) for v in obj) + "\n" + " " * indent + "]"
    return json.dumps(obj, allow_nan=False, default=str, separators=(", ", ": "))


def _write_html(result, summary: Dict[str, Any], out_dir: str) -> None:
    cfg = result.config
    runs = result.runs
    grid = (
        ["run", "test accuracy", "skipped steps", "final scale", "seconds"],
        [
            [
                r.label,
                pct(r.final_acc),
                f"{r.skipped_steps} of {len(r.steps)}",
                p2(r.steps[-1]["loss_scale"]),
                f"{r.wall_s:.1f}",
            ]
            for r in runs.values()
        ],
    )
    intro = Section(
        "The experiment",
        anchor="experiment",
        text=[
            f"Data: scikit-learn's 8x8 digits ({len(result.runs['fp32'].steps) // max(cfg.epochs, 1)} steps of 64 per "
            f"epoch; nothing downloaded). Model: an MLP 64-{'-'.join(map(str, cfg.hidden))}-10 trained with SGD "
            "(momentum 0.9) under FP16 autocast with FP32 master weights.",
            f"The controlled shift: the loss is multiplied by c = 2^-{cfg.shift_log2} and the learning rate divided "
            "by c. A power of two only moves the exponent, so FP32 training is identical for every c, while every "
            f"FP16 gradient moves down {cfg.shift_log2} binades, into the 1e-8..1e-10 range deep networks "
            "produce.",
            "Every figure on this page was measured by this run; each claim's verdict is computed from its checks.",
        ],
        grid=grid,
        images=[("curves.png", summary["plots"]["curves"]["caption"])],
    )
    sections = [intro] + [_claim_section(c) for c in result.claims]
    summary_rows = [(c.id, f"{c.id} {c.title}", c.verdict, c.headline) for c in result.claims]
    if result.bad_batches is not None:  # a section, not a claim: no verdict
        sections.append(_bad_batch_section(result.bad_batches, summary["plots"]["bad_batches"]["caption"]))
        summary_rows.append(("bad-batches", "Bad batches (NaN loss)", None, summary["bad_batches"]["headline"]))
    foot = (
        f"lossscale demo{' --quick' if cfg.quick else ''} --seed {cfg.seed}; torch {result.environment.get('torch')}"
        f", Python {result.environment.get('python')}; {summary['timings'].get('total_train_and_measure', 0):.0f}s "
        "of training and measurement. summary.json holds every figure shown here."
    )
    held = sum(1 for c in result.claims if c.verdict == "HELD")
    write_html(
        os.path.join(out_dir, "index.html"),
        "lossscale demo: FP16 underflow and loss scaling, measured",
        sections,
        subtitle=f"{held} of {len(result.claims)} claims held" + (" (quick run)" if cfg.quick else ""),
        summary=summary_rows,
        footer=foot,
    )


def uncapped_note(shift_log2: int, reached: Optional[float] = None) -> str:
    """Why the dynamic run has no ``max_scale`` (the terminal says it under the run table)."""
    got = "" if reached is None or not reached > 0 else f" (this run reached 2^{math.log2(reached):g})"
    return (
        "dynamic: uncapped (max_scale=None), unlike GradScaler's default cap of 2^24. C6 checks that the\n"
        f"  scale finds FP16's overflow line by itself; under the 2^-{shift_log2} loss shift that line lies above\n"
        f"  2^24{got}."
    )


def terminal_summary(summary: Dict[str, Any], out_dir: str) -> str:
    """The table printed at the end of ``lossscale demo``."""
    lines = ["", "claim  verdict    measured", "-----  ---------  " + "-" * 60]
    for cid, c in summary["claims"].items():
        lines.append(f"{cid:<5}  {c['verdict']:<9}  {c['title']}: {c['headline']}")
    lines.append("")
    lines.append(f"{'run':<16} {'accuracy':>8} {'skipped':>8} {'final S':>9} {'time':>6}")
    for name, r in summary["runs"].items():
        fs = r["final_scale"]
        lines.append(f"{name:<16} {pct(r['final_acc']):>8} {r['skipped_steps']:>8} {p2(fs):>9} {r['wall_s']:>5.1f}s")
    if "dynamic" in summary["runs"]:
        dyn = summary["claims"].get("C6", {}).get("figures", {}).get("dynamic", {})
        reached = dyn.get("max_scale") if isinstance(dyn, dict) else None
        lines.append(
            uncapped_note(summary["config"]["shift_log2"], reached if isinstance(reached, (int, float)) else None)
        )
    if "bad_batches" in summary:
        import textwrap

        bb = summary["bad_batches"]
        f = bb["figures"]
        diag = f.get("first_diagnosis") or {}
        text = f"bad batches ({f['n_bad']} of {f['n_steps']} with a NaN input row): {bb['headline']}. " + (
            f"lossscale's diagnosis: {diag['cause']}" if diag.get("cause") else ""
        )
        lines.append("")
        lines.extend(textwrap.wrap(text, 108, subsequent_indent="  "))
    t = summary["timings"]
    lines.append("")
    lines.append(
        f"report: {os.path.join(out_dir, 'index.html')}   figures: {os.path.join(out_dir, 'summary.json')}"
        f"   ({t.get('total', t.get('total_train_and_measure', 0)):.0f}s)"
    )
    return "\n".join(lines)
