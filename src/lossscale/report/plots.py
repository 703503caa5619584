"""The report's plots: headless matplotlib (Agg), plain data in, one PNG out.

Every function takes plain Python data (lists, dicts of lists), draws with ``matplotlib.figure.Figure``
(no pyplot, so no global backend state and no display is ever touched) and returns the path it wrote.
matplotlib is imported inside the functions: importing this module, like importing lossscale, stays
light.
"""

from __future__ import annotations

import math
import os
from typing import List, Mapping, Optional, Sequence

__all__ = [
    "COLORS",
    "color_for",
    "plot_number_line",
    "plot_layer_flush",
    "plot_curves",
    "plot_scale_trajectory",
    "plot_sweep",
    "plot_clip_order",
    "plot_telemetry",
    "plot_bad_batches",
]

#: One colour per run kind, the same in every plot.
COLORS = {
    "fp32": "#222222",
    "fp16_noscale": "#d62728",
    "static": "#ff7f0e",
    "dynamic": "#1f77b4",
    "adaptive": "#2ca02c",
    "torch_default": "#9467bd",
    "clip_right": "#1f77b4",
    "clip_wrong": "#d62728",
    "bad_clean": "#bbbbbb",
    "bad_torch": "#9467bd",
    "bad_lossscale": "#1f77b4",
}
_CYCLE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
_DPI = 110


def color_for(name: str, i: int = 0) -> str:
    """The colour of run ``name`` (a cycle colour for unknown names)."""
    return COLORS.get(name, _CYCLE[i % len(_CYCLE)])


def _figure(w: float, h: float, rows: int = 1, cols: int = 1, **kw):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), layout="constrained")
    axes = fig.subplots(rows, cols, **kw)
    return fig, axes


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=_DPI)
    return path


def _finite(values: Sequence[Optional[float]]) -> List[float]:
    return [float("nan") if v is None or not math.isfinite(v) else float(v) for v in values]


def _log2(values: Sequence[Optional[float]]) -> List[float]:
    return [math.log2(v) if v is not None and math.isfinite(v) and v > 0 else float("nan") for v in values]


def _pow2_ticks(ax, axis: str = "y", step: Optional[int] = None) -> None:
    """Label a log2 axis as powers of two."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator, MultipleLocator

    target = ax.yaxis if axis == "y" else ax.xaxis
    target.set_major_locator(MaxNLocator(integer=True, nbins=10) if step is None else MultipleLocator(step))
    target.set_major_formatter(FuncFormatter(lambda v, _: f"$2^{{{int(round(v))}}}$"))


# ---------------------------------------------------------------------------------------------- C1-C3
def plot_number_line(
    path: str,
    fmt: Mapping[str, float],
    hist_before: Mapping[int, int],
    hist_after: Optional[Mapping[int, int]] = None,
    *,
    scale_log2: Optional[float] = None,
    band: Optional[Sequence[float]] = (1e-10, 1e-8),
    title: str = "",
) -> str:
    """The FP16 number line with its cliff, and gradient exponent histograms on it.

    Args:
        fmt: ``max``, ``smallest_normal``, ``smallest_subnormal``, ``flush_threshold`` (values), and
            optionally ``name``.
        hist_before: ``{binade e: count}`` of nonzero gradients with ``2**e <= |g| < 2**(e+1)``, unscaled.
        hist_after: the same after multiplying by ``2**scale_log2``.
        band: a value range to mark on the line (the seed's 1e-10..1e-8), or None.
    """
    name = str(fmt.get("name", "fp16"))
    top = math.log2(fmt["max"])
    normal = math.log2(fmt["smallest_normal"])
    sub = math.log2(fmt["smallest_subnormal"])
    flush = math.log2(fmt["flush_threshold"])
    keys = [k for k in list(hist_before) + list(hist_after or {})]
    lo = min([flush - 12, *keys]) - 1
    hi = max([top + 3, *keys]) + 2
    fig, ax = _figure(10.5, 4.3)
    ax.axvspan(lo, flush, color="#d62728", alpha=0.10, lw=0)
    ax.axvspan(flush, normal, color="#ff7f0e", alpha=0.12, lw=0)
    ax.axvspan(normal, top, color="#2ca02c", alpha=0.08, lw=0)
    ax.axvspan(top, hi, color="#d62728", alpha=0.10, lw=0)
    if hist_before:
        total_b = sum(hist_before.values()) or 1
        eb = sorted(hist_before)
        ax.bar(
            [e + 0.5 for e in eb],
            [hist_before[e] / total_b for e in eb],
            width=0.9,
            color="#7f7f7f",
            alpha=0.85,
            label="true FP32 gradients (unscaled)",
        )
    if hist_after:
        total_a = sum(hist_after.values()) or 1
        ea = sorted(hist_after)
        label = "after loss scaling" + (f" by $2^{{{scale_log2:g}}}$" if scale_log2 is not None else "")
        ax.bar(
            [e + 0.5 for e in ea],
            [hist_after[e] / total_a for e in ea],
            width=0.9,
            color="#1f77b4",
            alpha=0.75,
            label=label,
        )
    ymax = ax.get_ylim()[1] if (hist_before or hist_after) else 0.75
    ax.set_ylim(0, ymax * 1.35)
    y_txt = ymax * 1.25
    ax.axvline(flush, color="#d62728", lw=2)
    ax.axvline(sub, color="#ff7f0e", lw=1, ls=":")
    ax.axvline(normal, color="#2ca02c", lw=1, ls=":")
    ax.axvline(top, color="#d62728", lw=2)
    ax.text(
        (lo + flush) / 2,
        y_txt,
        f"flushed to 0\n(|x| ≤ $2^{{{flush:g}}}$)",
        ha="center",
        va="top",
        fontsize=9,
        color="#a00",
    )
    ax.text(
        (flush + normal) / 2,
        y_txt,
        f"subnormal\n$2^{{{sub:g}}}$..$2^{{{normal:g}}}$",
        ha="center",
        va="top",
        fontsize=9,
        color="#a50",
    )
    ax.text(
        (normal + top) / 2,
        y_txt,
        f"normal {name}\n$2^{{{normal:g}}}$ .. {fmt['max']:g}",
        ha="center",
        va="top",
        fontsize=9,
        color="#060",
    )
    ax.text(min(top + 0.3, hi - 0.5), y_txt, "→ inf", ha="left", va="top", fontsize=9, color="#a00")
    if band:
        b0, b1 = math.log2(band[0]), math.log2(band[1])
        ax.annotate("", xy=(b0, ymax * 1.02), xytext=(b1, ymax * 1.02), arrowprops=dict(arrowstyle="<->", color="#444"))
        ax.text(
            (b0 + b1) / 2,
            ymax * 1.04,
            f"{band[0]:.0e} .. {band[1]:.0e}",
            ha="center",
            va="bottom",
            fontsize=8,
            color="#444",
        )
    ax.set_xlim(lo, hi)
    _pow2_ticks(ax, "x", step=4)
    ax.set_xlabel("|value| (binade)")
    ax.set_title(title or f"The {name} number line and the underflow cliff")
    if hist_before or hist_after:
        ax.set_ylabel("fraction of nonzero gradients")
        ax.legend(loc="center left", fontsize=9)
    else:
        ax.set_yticks([])
    return _save(fig, path)


def plot_layer_flush(
    path: str,
    layers: Sequence[str],
    series: Mapping[str, Sequence[Optional[float]]],
    *,
    title: str = "Activation gradients flushed to zero, per layer",
) -> str:
    """Grouped bars: per layer, the flushed fraction of its activation gradients for each run.

    ``series``: ``{run label: [fraction per layer]}`` (None for a layer a run did not measure).

    The axis is logarithmic: the shares of interest span 100% (no scaling) down to fractions of a
    percent (scaled runs), and on a linear 0-100 axis a 0.3% bar is a two-pixel sliver.  The axis
    starts a decade below the smallest nonzero share (at 0.01% or lower); a share of exactly 0
    has no bar and is labelled "0%" at the axis' left end.
    """
    from matplotlib.ticker import FuncFormatter, LogLocator

    fig, ax = _figure(8.5, 0.75 * max(len(layers), 3) + 1.9)
    n = max(len(series), 1)
    h = 0.8 / n
    shares = [100.0 * f for fr in series.values() for f in fr if f is not None and math.isfinite(f) and f > 0]
    lo = min(1e-2, 10.0 ** (math.floor(math.log10(min(shares))) - 1)) if shares else 1e-2
    for i, (label, fracs) in enumerate(series.items()):
        ys = [j + (i - (n - 1) / 2) * h for j in range(len(layers))]
        vals = [float("nan") if f is None or not math.isfinite(f) else 100.0 * f for f in fracs]
        widths = [v - lo if v > lo else 0.0 for v in vals]  # NaN > lo is False: no bar
        ax.barh(ys, widths, left=lo, height=h * 0.95, color=_CYCLE[[3, 0, 2, 1, 4][i % 5]], label=label)
        for y, v in zip(ys, vals):
            if not math.isfinite(v):
                continue
            text = "0%" if v == 0 else (f"{v:.1f}%" if v >= 1 else f"{v:.2g}%")
            ax.text(max(v, lo) * 1.15, y, text, va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(lo, 800.0)  # room right of 100% for the labels
    ax.xaxis.set_major_locator(LogLocator(base=10))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}%" if v <= 100 else ""))
    ax.set_yticks(range(len(layers)), layers)
    ax.invert_yaxis()
    ax.set_xlabel("nonzero activation gradients flushed in FP16 (%, log scale)")
    ax.set_title(title)
    ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=max(n, 1), frameon=False)
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------- curves
def plot_curves(
    path: str,
    runs: Mapping[str, Mapping[str, Sequence[float]]],
    *,
    chance: Optional[float] = None,
    title: str = "Training under the controlled shift",
) -> str:
    """Loss (left, log scale) and test accuracy (right) per epoch, one line per run.

    ``runs``: ``{name: {"label", "epoch": [...], "train_loss": [...], "test_acc": [...]}}``.
    """
    fig, (ax_l, ax_a) = _figure(11, 4.2, 1, 2)
    for i, (name, r) in enumerate(runs.items()):
        col = color_for(name, i)
        ep = [e + 1 for e in r["epoch"]]
        # FP32 is drawn last-on-top and dashed: the scaled FP16 runs lie right under it.
        ls, z = ("--", 10) if name == "fp32" else ("-", 2)
        ax_l.plot(ep, _finite(r["train_loss"]), ls, color=col, lw=1.8, label=r.get("label", name), zorder=z)
        ax_a.plot(
            ep,
            [100 * a for a in _finite(r["test_acc"])],
            ls,
            color=col,
            lw=1.8,
            marker="o",
            ms=2.5,
            label=r.get("label", name),
            zorder=z,
        )
    ax_l.set_yscale("log")
    ax_l.set_xlabel("epoch")
    ax_l.set_ylabel("training loss (unshifted, mean per epoch)")
    ax_a.set_xlabel("epoch")
    ax_a.set_ylabel("test accuracy (%)")
    ax_a.set_ylim(0, 100)
    if chance is not None:
        ax_a.axhline(100 * chance, color="#999", lw=1, ls=":")
        ax_a.text(
            0.99,
            100 * chance - 1.5,
            "chance",
            fontsize=8,
            color="#777",
            ha="right",
            va="top",
            transform=ax_a.get_yaxis_transform(),
        )
    ax_a.legend(fontsize=8, loc="center right")
    fig.suptitle(title)
    return _save(fig, path)


def plot_scale_trajectory(
    path: str, runs: Mapping[str, Mapping[str, Sequence]], *, title: str = "Loss scale per step (x = skipped step)"
) -> str:
    """log2 of the loss scale per step for each run, skipped steps marked, and the overflow line.

    ``runs``: ``{name: {"label", "step", "loss_scale", "skipped", optional "line", "envelope"}}`` where
    ``line`` is the largest safe scale per step (``loss_scale * 2**headroom_bits``, None where unknown)
    and ``envelope`` its running minimum.
    """
    fig, ax = _figure(10.5, 5.0)
    marked = False
    for i, (name, r) in enumerate(runs.items()):
        col = color_for(name, i)
        steps = list(r["step"])
        ls2 = _log2(r["loss_scale"])
        ax.step(steps, ls2, where="post", color=col, lw=1.6, label=r.get("label", name))
        line = r.get("line")
        if line is not None and any(v is not None for v in line):
            ax.plot(steps, _log2(line), color=col, lw=0.8, alpha=0.45, ls="--", label="overflow line, per step")
        env = r.get("envelope")
        if env is not None and any(v is not None for v in env):
            ax.plot(
                steps,
                _log2(env),
                color="#444",
                lw=1.1,
                alpha=0.9,
                ls=":",
                label="overflow line, lowest of the growth interval",
            )
        sk = [(s, y) for s, y, k in zip(steps, ls2, r["skipped"]) if k]
        if sk:
            ax.scatter(
                [s for s, _ in sk],
                [y for _, y in sk],
                marker="x",
                color="#d62728",
                s=28,
                zorder=5,
                label=None if marked else "skipped step (inf/NaN)",
            )
            marked = True
    _pow2_ticks(ax, "y")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss scale S")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)
    return _save(fig, path)


def plot_sweep(
    path: str,
    log2_scales: Sequence[float],
    acc: Sequence[float],
    skipped_frac: Sequence[float],
    *,
    fp32_acc: Optional[float] = None,
    flushed_frac: Optional[Sequence[Optional[float]]] = None,
    overflow_frac: Optional[Sequence[Optional[float]]] = None,
    window: Optional[Sequence[float]] = None,
    chance: Optional[float] = None,
    title: str = "Static loss scale sweep: the tightrope",
) -> str:
    """Final accuracy (top) and failure fractions (bottom) against a static scale ``2**k``.

    ``flushed_frac``/``overflow_frac``: the fraction of true gradients that flush / overflow at each
    scale (None where not measured). ``window``: ``(lo, hi)`` log2 scales of the measured safe window.
    """
    fig, (ax_a, ax_f) = _figure(9.5, 6.0, 2, 1, sharex=True)
    x = list(log2_scales)
    if window:
        for ax in (ax_a, ax_f):
            ax.axvspan(window[0] - 0.5, window[1] + 0.5, color="#2ca02c", alpha=0.08, lw=0)
    ax_a.plot(x, [100 * a for a in _finite(acc)], "o-", color="#ff7f0e", lw=2, label="static scale S")
    if fp32_acc is not None:
        ax_a.axhline(100 * fp32_acc, color="#222", ls="--", lw=1.2, label=f"FP32 ({100 * fp32_acc:.1f}%)")
    if chance is not None:
        ax_a.axhline(100 * chance, color="#999", ls=":", lw=1, label="chance")
    ax_a.set_ylabel("final test accuracy (%)")
    ax_a.set_ylim(0, 100)
    ax_a.legend(fontsize=8, loc="center right")
    ax_f.plot(x, [100 * v for v in _finite(skipped_frac)], "s-", color="#d62728", label="steps skipped (overflow)")
    if flushed_frac is not None:
        ax_f.plot(
            x,
            [100 * v for v in _finite(flushed_frac)],
            "v-",
            color="#7f7f7f",
            label="gradients flushed to 0 (underflow)",
        )
    if overflow_frac is not None:
        ax_f.plot(
            x, [100 * v for v in _finite(overflow_frac)], "^:", color="#9467bd", label="gradients overflowing to inf"
        )
    ax_f.set_ylabel("% of steps / gradients")
    ax_f.set_ylim(-3, 103)
    ax_f.set_xlabel("loss scale S")
    _pow2_ticks(ax_f, "x", step=4)
    ax_f.legend(fontsize=8, loc="center right")
    fig.suptitle(title)
    return _save(fig, path)


def plot_clip_order(
    path: str,
    runs: Mapping[str, Mapping[str, Sequence]],
    *,
    clip_norm: float = 1.0,
    title: str = "Clip after unscaling, not before",
) -> str:
    """Accuracy per epoch (left) and applied/true gradient norm per step (right) for two clip orders.

    ``runs``: ``{name: {"label", "epoch", "test_acc", "step", "norm_ratio"}}``.
    """
    fig, (ax_a, ax_r) = _figure(11, 4.2, 1, 2)
    for i, (name, r) in enumerate(runs.items()):
        col = color_for(name, i)
        ax_a.plot(
            [e + 1 for e in r["epoch"]],
            [100 * a for a in _finite(r["test_acc"])],
            "-o",
            ms=2.5,
            color=col,
            label=r.get("label", name),
        )
        ax_r.plot(r["step"], _finite(r["norm_ratio"]), ".", ms=3, color=col, label=r.get("label", name))
    ax_a.set_ylim(0, 100)
    ax_a.set_xlabel("epoch")
    ax_a.set_ylabel("test accuracy (%)")
    ax_a.legend(fontsize=8)
    ax_r.set_yscale("log", base=2)
    ax_r.axhline(1.0, color="#999", lw=1, ls=":")
    ax_r.set_xlabel("optimizer step")
    ax_r.set_ylabel("applied / true gradient norm")
    ax_r.set_title(f"clip_grad_norm_(max_norm={clip_norm:g})", fontsize=10)
    ax_r.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------- telemetry
def plot_telemetry(
    path: str,
    step: Sequence[int],
    loss_scale: Sequence[float],
    skipped: Sequence[bool],
    *,
    flushed: Optional[Mapping[str, Sequence[Optional[float]]]] = None,
    headroom: Optional[Mapping[str, Sequence[Optional[float]]]] = None,
    title: str = "Loss-scale telemetry",
) -> str:
    """A recorded run: scale with skipped steps and overflow line, flushed fractions, headroom.

    ``flushed``/``headroom``: ``{series label: per-step values}`` (None where a step lacks the figure;
    sampled series are joined up). The first series of each is the overall figure, drawn thicker;
    the first headroom series also draws the overflow line ``loss_scale * 2**headroom``.
    """
    panels = 1 + bool(flushed) + bool(headroom)
    fig, axes = _figure(10.5, 2.7 * panels + 0.6, panels, 1, sharex=True, squeeze=False)
    axes = [a[0] for a in axes]
    ax = axes[0]
    ls2 = _log2(loss_scale)
    ax.step(step, ls2, where="post", color="#1f77b4", lw=1.6, label="loss scale")
    if headroom:
        first_label, first = next(iter(headroom.items()))
        line = [
            s + h if h is not None and math.isfinite(s) and math.isfinite(h) else float("nan")
            for s, h in zip(ls2, first)
        ]
        pts = [(s, v) for s, v in zip(step, line) if math.isfinite(v)]
        if pts:
            ax.plot(
                [s for s, _ in pts],
                [v for _, v in pts],
                "--",
                color="#1f77b4",
                alpha=0.5,
                lw=0.9,
                label=f"overflow line: scale × 2^headroom of {first_label}",
            )  # which series it rests on
    sk = [(s, y) for s, y, k in zip(step, ls2, skipped) if k]
    if sk:
        ax.scatter(
            [s for s, _ in sk],
            [y for _, y in sk],
            marker="x",
            color="#d62728",
            s=28,
            zorder=5,
            label=f"skipped step ({len(sk)})",
        )
    _pow2_ticks(ax, "y")
    ax.set_ylabel("loss scale")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title)
    i = 1
    for data, ylabel, pct in ((flushed, "flushed to 0 (%)", True), (headroom, "headroom (binades)", False)):
        if not data:
            continue
        ax = axes[i]
        i += 1
        for j, (label, vals) in enumerate(data.items()):
            # Sampled series (every few steps) leave gaps: draw the measured points joined up.
            pts = [(s, 100 * v if pct else v) for s, v in zip(step, _finite(vals)) if math.isfinite(v)]
            ax.plot(
                [s for s, _ in pts],
                [v for _, v in pts],
                color="#222" if j == 0 else _CYCLE[(j - 1) % len(_CYCLE)],
                lw=1.8 if j == 0 else 1.0,
                label=label,
            )
        if not pct:
            ax.axhline(0, color="#d62728", lw=1, ls=":")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7, loc="best", ncol=2)
    axes[-1].set_xlabel("step")
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------- bad batches
def plot_bad_batches(
    path: str,
    runs: Mapping[str, Mapping[str, Sequence]],
    *,
    chance: Optional[float] = None,
    title: str = "Bad batches: the loss scale per step, and what it did to training",
) -> str:
    """Loss scale per step (left, log2) and test accuracy per epoch (right) of runs fed the same bad batches.

    ``runs``: ``{name: {"label", "step", "loss_scale", "skipped", "final_scale", "epoch", "test_acc"}}``;
    a run named with "clean" is drawn wide and light, under the others (it may coincide with one).
    Skipped steps are marked x; each scale line ends with its final value. One legend, below both panels.
    """
    fig, (ax_s, ax_a) = _figure(11, 4.6, 1, 2, gridspec_kw={"width_ratios": [1.6, 1]})
    handles, skip_handle = [], None
    for i, (name, r) in enumerate(runs.items()):
        col = color_for(name, i)
        clean = "clean" in name
        style = dict(lw=5, alpha=0.8, zorder=1) if clean else dict(lw=1.6, zorder=3)
        # The scale each step ran with, then the one the last update left: the line ends where the run did.
        steps = list(r["step"]) + [len(r["step"])]
        ls2 = _log2(list(r["loss_scale"]) + [r["final_scale"]])
        handles += ax_s.step(steps, ls2, where="post", color=col, label=r.get("label", name), **style)
        if math.isfinite(ls2[-1]):
            ax_s.annotate(
                f"$2^{{{ls2[-1]:g}}}$",
                (steps[-1], ls2[-1]),
                xytext=(4, 0),
                textcoords="offset points",
                va="center",
                fontsize=9,
                color="#666" if clean else col,
            )
        sk = [(s, y) for s, y, k in zip(steps, ls2, r["skipped"]) if k]
        if sk:
            skip_handle = ax_s.scatter(
                [s for s, _ in sk],
                [y for _, y in sk],
                marker="x",
                color="#d62728",
                s=22,
                zorder=5,
                label="skipped step (a bad batch)",
            )
        ax_a.plot(
            [e + 1 for e in r["epoch"]],
            [100 * a for a in _finite(r["test_acc"])],
            "-",
            color=col,
            marker="o",
            ms=2.5,
            **style,
        )
    _pow2_ticks(ax_s, "y")
    ax_s.set_xlim(right=ax_s.get_xlim()[1] * 1.06)  # room for the end labels
    ax_s.set_xlabel("optimizer step")
    ax_s.set_ylabel("loss scale S")
    ax_s.set_title("loss scale per step", fontsize=10)
    from matplotlib.ticker import MaxNLocator

    ax_a.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_a.set_ylim(0, 100)
    ax_a.set_xlabel("epoch")
    ax_a.set_ylabel("test accuracy (%)")
    ax_a.set_title("test accuracy after each epoch", fontsize=10)
    if chance is not None:
        ax_a.axhline(100 * chance, color="#999", lw=1, ls=":")
        ax_a.text(
            0.01,
            100 * chance + 1.5,
            "chance",
            fontsize=8,
            color="#777",
            ha="left",
            va="bottom",
            transform=ax_a.get_yaxis_transform(),
        )
    handles += [skip_handle] if skip_handle is not None else []
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8.5, frameon=False)
    fig.suptitle(title)
    return _save(fig, path)
