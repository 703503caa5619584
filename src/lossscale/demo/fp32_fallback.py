"""``lossscale audit-demo``: a forward overflow no loss scale can fix, found by ``audit``, fixed by ``keep_fp32``.

The workload is a GPT-2-shaped model written here in a few lines of torch (the demo extras do not include
transformers): token and position embeddings, two pre-norm blocks of causal self-attention and an MLP
(``c_fc`` -> GELU -> ``c_proj``) on a float32 residual stream, a final layer norm and an LM head. The
module names follow GPT-2's (``h.0.mlp.c_proj``). It learns a synthetic language: each token is followed by
one of two tokens (3:1), so the best loss is about 0.56 nats against ``ln 64 = 4.16`` for a guess.

The first block's MLP down-projection has its weight multiplied by 2^22 (as an outlier feature does in
real models; unsloth-zoo PR #600 found ``layers.0.mlp.down_proj`` by hand): its output, about 2e5, is
finite in FP32 and overflows FP16's 65504. Three runs from the same initial weights and batches:

* ``fp32`` -- no autocast: the reference;
* ``fp16`` -- FP16 autocast with ``lossscale.GradScaler``: every loss is NaN, every step is skipped
  (no scale helps: the scale only touches the backward);
* ``fp16_keep_fp32`` -- the same after ``lossscale.keep_fp32(model, report.keep_fp32)``, with the
  module that :func:`lossscale.audit` named: it trains, and follows FP32's curve;
* ``fp16_upcast`` -- FP16 with ``GradScaler(model=model, trace=True, on_forward_overflow="upcast")`` and
  no audit: the trace names the module on the first two skipped steps, the scaler keeps it in FP32 by
  itself, and from the third step on it trains like the run above.

Then the other case: a backward that overflows FP16 at any scale >= 1 while the forward stays finite
(:mod:`lossscale.demo.backward_overflow`, a small model built from a config). Torch's ``GradScaler``
backs its scale off below 1 and trains; so does ``lossscale.GradScaler()`` (its floor is 2**-24), and
``on_backward_overflow="upcast"`` keeps the overflowing module in FP32; a floor at 1
(``min_scale=1.0``) skips every step. The section prints each run's steps taken and a loss table, and
plots the loss curves beside FP32's.

Writes ``DIR/index.html``, ``fp32_fallback_loss.png`` (the three loss curves), ``fp32_fallback_amax.png``
(each module's forward amax in FP16 and FP32 against FP16's largest value), ``backward_overflow_loss.png``
(the backward section's loss curves) and ``summary.json`` (every figure, the audit's ``to_dict()``, the
backward section under ``"backward"``). Needs matplotlib (the demo extras).
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from typing import Any, Dict, List

import torch
import torch.nn.functional as F

from .. import formats
from ..auditing import audit
from ..fp32 import keep_fp32
from ..scaler import GradScaler
from . import backward_overflow

__all__ = ["MiniGPT", "injected_model", "markov_batches", "train_run", "run_audit_demo", "INJECTED", "FACTOR"]

#: The module the demo makes overflow, and by how much its weight is scaled.
INJECTED = "h.0.mlp.c_proj"
FACTOR = 2.0**22

VOCAB, SEQ, WIDTH, HEADS, LAYERS = 64, 32, 64, 4, 2

#: Training steps of each run (``--quick``: QUICK_STEPS).
STEPS, QUICK_STEPS = 80, 30


class _Attention(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = torch.nn.Linear(d, 3 * d)
        self.c_proj = torch.nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.c_attn(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class _MLP(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.c_fc = torch.nn.Linear(d, 4 * d)
        self.act = torch.nn.GELU(approximate="tanh")
        self.c_proj = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class _Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1, self.attn = torch.nn.LayerNorm(d), _Attention(d, heads)
        self.ln_2, self.mlp = torch.nn.LayerNorm(d), _MLP(d)

    def forward(self, x):
        # Under autocast the Linear outputs are FP16 and the residual (from the FP32 embeddings) adds
        # them in float32: the stream stays float32, as in GPT-2.
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class MiniGPT(torch.nn.Module):
    """A GPT-2-shaped language model (pre-norm blocks, causal attention, GELU MLP), GPT-2's module names."""

    def __init__(self, vocab: int = VOCAB, seq: int = SEQ, d: int = WIDTH, heads: int = HEADS, layers: int = LAYERS):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, d), torch.nn.Embedding(seq, d)
        self.h = torch.nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                torch.nn.init.zeros_(m.bias)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(model, batch):
    """Next-token cross-entropy (``loss_fn(model, batch)`` as :func:`lossscale.audit` calls it)."""
    logits = model(batch)[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def injected_model(seed: int = 0) -> MiniGPT:
    """:class:`MiniGPT` under ``seed``, with :data:`INJECTED`'s weight multiplied by :data:`FACTOR`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MiniGPT()
    with torch.no_grad():
        model.get_submodule(INJECTED).weight.mul_(FACTOR)
    return model


def markov_batches(steps: int, seed: int = 0, batch_size: int = 16) -> List[torch.Tensor]:
    """``steps`` batches of the synthetic language: token ``i`` is followed by ``a[i]`` (p = 3/4) or ``b[i]``."""
    g = torch.Generator().manual_seed(seed)
    follow = torch.randint(0, VOCAB, (2, VOCAB), generator=g)
    out = []
    for _ in range(steps):
        seq = torch.empty(batch_size, SEQ, dtype=torch.long)
        seq[:, 0] = torch.randint(0, VOCAB, (batch_size,), generator=g)
        second = torch.rand(batch_size, SEQ, generator=g) < 0.25
        for t in range(1, SEQ):
            seq[:, t] = follow[second[:, t].long(), seq[:, t - 1]]
        out.append(seq)
    return out


def train_run(
    model: torch.nn.Module, batches: List[torch.Tensor], *, fp16: bool, lr: float = 3e-3, upcast: bool = False
) -> Dict[str, Any]:
    """Train ``model`` on ``batches`` with AdamW; with ``fp16``, under FP16 autocast with lossscale's
    ``GradScaler`` (with ``upcast``: tracing, ``on_forward_overflow="upcast"``). Returns the per-step
    losses, which steps were skipped (no weight moved), the scales and the modules the scaler upcast."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = (
        None
        if not fp16
        else GradScaler("cpu", model=model, trace=True, on_forward_overflow="upcast")
        if upcast
        else GradScaler("cpu")
    )
    probe = model.lm_head.weight
    losses, skipped, scales = [], [], []
    for batch in batches:
        before = probe.detach().clone()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = lm_loss(model, batch)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scales.append(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        losses.append(float(loss.detach()))
        skipped.append(bool(torch.equal(before, probe.detach())))
    upcast_modules = list(scaler.health().upcast_modules or ()) if scaler is not None else []
    if scaler is not None:
        scaler.close()
    return {"loss": losses, "skipped": skipped, "scale": scales, "upcast": upcast_modules}


def _tail(values: List[float], n: int = 5) -> float:
    tail = values[-n:]
    return sum(tail) / len(tail)


def run_audit_demo(out_dir: str, *, quick: bool = False, seed: int = 0) -> Dict[str, Any]:
    """Audit the injected model, train the three runs, write the report; returns the summary (also in
    ``DIR/summary.json``) with ``checks`` and ``verdict`` ("HELD" when every check passes).

    Raises:
        ValueError: ``out_dir`` is not a folder this process can write into (checked first).

    Runs torch on one thread, as ``lossscale demo`` does: the matrices are 64 wide, and a second
    thread only adds synchronisation (on a busy machine OpenMP's spinning makes it several times slower).
    """
    from ..report.html import check_out_dir

    check_out_dir(out_dir)  # before the training, not after it
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(out_dir, quick, seed)
    finally:
        torch.set_num_threads(threads)


def _run(out_dir: str, quick: bool, seed: int) -> Dict[str, Any]:
    t0 = time.perf_counter()
    steps = QUICK_STEPS if quick else STEPS
    batches = markov_batches(steps, seed)

    model = injected_model(seed)
    report = audit(model, lm_loss, batches[0])
    print(report)
    print()

    runs: Dict[str, Dict[str, Any]] = {}
    for name, fp16, keep, upcast in (
        ("fp32", False, False, False),
        ("fp16", True, False, False),
        ("fp16_keep_fp32", True, True, False),
        ("fp16_upcast", True, False, True),
    ):
        m = injected_model(seed)
        if keep:
            keep_fp32(m, report.keep_fp32)
        t = time.perf_counter()
        with warnings.catch_warnings(record=True) as said:  # the scaler's warnings: kept for the report
            warnings.simplefilter("always")
            runs[name] = train_run(m, batches, fp16=fp16, upcast=upcast)
        runs[name]["seconds"] = time.perf_counter() - t
        runs[name]["warnings"] = sorted({str(w.message).split("\n")[0] for w in said})
        r = runs[name]
        print(
            f"{name:15s} loss {r['loss'][0]:.3f} -> {r['loss'][-1]:.3f}, {sum(r['skipped'])}/{steps} steps skipped "
            f"({r['seconds']:.1f}s)"
        )

    fp32_end, kept_end = _tail(runs["fp32"]["loss"]), _tail(runs["fp16_keep_fp32"]["loss"])
    up = runs["fp16_upcast"]
    up_end, up_skipped = _tail(up["loss"]), [i for i, s in enumerate(up["skipped"]) if s]
    checks = [
        ("audit names the injected module", report.keep_fp32 == [INJECTED], f"report.keep_fp32 = {report.keep_fp32}"),
        (
            "without keep_fp32, FP16 never trains",
            all(not math.isfinite(v) for v in runs["fp16"]["loss"]) and all(runs["fp16"]["skipped"]),
            f"{sum(runs['fp16']['skipped'])}/{steps} steps skipped, every loss NaN",
        ),
        (
            "with keep_fp32, FP16 trains like FP32",
            all(math.isfinite(v) for v in runs["fp16_keep_fp32"]["loss"])
            and abs(kept_end - fp32_end) <= 0.1 * fp32_end
            and kept_end < runs["fp32"]["loss"][0] - 1.0,
            f"mean loss of the last 5 steps {kept_end:.3f} against FP32's {fp32_end:.3f} "
            f"(from {runs['fp32']['loss'][0]:.3f})",
        ),
        (
            "on_forward_overflow='upcast' gets there by itself",
            up["upcast"] == [INJECTED]
            and up_skipped == [0, 1]
            and all(math.isfinite(v) for v in up["loss"][2:])
            and up_end < up["loss"][2] - 1.0,
            f"upcast {up['upcast']} after steps {up_skipped} were skipped; then from {up['loss'][2]:.3f} to a mean of "
            f"{up_end:.3f} over the last 5 steps (FP32: {fp32_end:.3f}, two steps more)",
        ),
        ("this device's FP16 agrees with FP32", report.hardware.verdict == "ok", report.hardware.detail),
    ]
    print()
    backward = backward_overflow.run_section()  # the same for every seed and size: its own config
    print("\n".join(backward["lines"]))
    print()
    held = all(ok for _, ok, _ in checks) and all(c["passed"] for c in backward["checks"])
    summary = {
        "quick": quick,
        "seed": seed,
        "steps": steps,
        "injected": INJECTED,
        "factor": FACTOR,
        "audit": report.to_dict(),
        "runs": runs,
        "checks": [{"check": c, "passed": bool(ok), "detail": d} for c, ok, d in checks],
        "backward": backward,
        "verdict": "HELD" if held else "NOT HELD",
    }
    _render(summary, report, out_dir)
    summary["seconds"] = time.perf_counter() - t0
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=1, allow_nan=True)
    for c, ok, d in checks + [(c["check"], c["passed"], c["detail"]) for c in backward["checks"]]:
        print(f"  {'pass' if ok else 'FAIL'}  {c}: {d}")
    print(f"report: {os.path.join(out_dir, 'index.html')}")
    return summary


# ------------------------------------------------------------------ the plots and the page
def _figure(w: float, h: float):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), layout="constrained")
    return fig, fig.subplots()


def plot_losses(runs: Dict[str, Dict[str, Any]], path: str, amax: float) -> str:
    """The three loss curves; a non-finite loss is an x on the top edge. ``amax``: the injected module's
    FP32 output amax, for the title."""
    fig, ax = _figure(7.5, 3.8)
    # FP32 drawn wide and pale underneath: FP16 + keep_fp32 lies on it.
    style = {
        "fp32": ("#bbbbbb", "FP32", 4.0),
        "fp16": ("#d62728", "FP16 + GradScaler", 1.8),
        "fp16_keep_fp32": ("#1f77b4", "FP16 + GradScaler + keep_fp32", 1.6),
        "fp16_upcast": ("#2ca02c", "FP16 + GradScaler(on_forward_overflow='upcast')", 1.2),
    }
    finite_all = [v for r in runs.values() for v in r["loss"] if math.isfinite(v)]
    top = max(finite_all) * 1.08 if finite_all else 1.0
    for name, r in runs.items():
        color, label, width = style.get(name, ("#7f7f7f", name, 1.8))
        steps = list(range(len(r["loss"])))
        ys = [v if math.isfinite(v) else math.nan for v in r["loss"]]
        ax.plot(steps, ys, color=color, label=label, lw=width)
        bad = [s for s, v in zip(steps, r["loss"]) if not math.isfinite(v)]
        if bad:
            ax.plot(bad, [top] * len(bad), "x", color=color, ms=5, label=f"{label}: loss NaN, step skipped")
    ax.set_ylim(0, top * 1.04)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats)")
    ax.set_title(
        f"{INJECTED} outputs {amax:.2g}: FP16 overflows in the forward; kept in FP32 (by hand or by "
        "the scaler) it trains",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="center right")
    fig.savefig(path, dpi=110)
    return path


def plot_amax(modules: List[Dict[str, Any]], path: str) -> str:
    """Each module's forward amax, FP16 autocast and FP32, in execution order, against FP16's max."""
    fig, ax = _figure(9.0, 4.2)
    names = [m["name"] or "(model)" for m in modules]
    xs = list(range(len(names)))
    finite32 = [m["fp32_amax"] for m in modules if math.isfinite(m["fp32_amax"]) and m["fp32_amax"] > 0]
    top = max(finite32 + [formats.FP16.max]) * 8
    ax.semilogy(xs, [m["fp32_amax"] or math.nan for m in modules], "o", color="#222222", ms=5, label="FP32 shadow")
    fp16 = [m["fwd_amax"] if math.isfinite(m["fwd_amax"]) and m["fwd_amax"] > 0 else math.nan for m in modules]
    ax.semilogy(xs, fp16, "s", color="#1f77b4", ms=4, mfc="none", label="FP16 autocast")
    bad = [x for x, m in zip(xs, modules) if not math.isfinite(m["fwd_amax"])]
    ax.semilogy(bad, [top] * len(bad), "x", color="#d62728", ms=6, label="FP16 autocast: inf/NaN")
    ax.axhline(formats.FP16.max, color="#d62728", lw=1, ls="--", label="FP16 max 65504")
    for x, m in zip(xs, modules):
        if m["verdict"].startswith("KEEP FP32"):
            ax.annotate(
                "keep in FP32",
                (x, m["fp32_amax"]),
                textcoords="offset points",
                xytext=(6, 6),
                fontsize=8,
                color="#d62728",
            )
    ax.set_xticks(xs, names, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("forward output amax")
    ax.set_title("lossscale.audit: where the forward leaves FP16's range")
    ax.legend(fontsize=8, loc="center right")
    fig.savefig(path, dpi=110)
    return path


def _render(summary: Dict[str, Any], report, out_dir: str) -> str:
    from ..report.html import Section, write_html

    injected = next(m for m in summary["audit"]["modules"] if m["name"] == INJECTED)
    plot_losses(summary["runs"], os.path.join(out_dir, "fp32_fallback_loss.png"), injected["fp32_amax"])
    plot_amax(summary["audit"]["modules"], os.path.join(out_dir, "fp32_fallback_amax.png"))
    runs = summary["runs"]
    audit_section = Section(
        "1. lossscale.audit names the module",
        verdict=None,
        anchor="audit",
        text=[
            f"One batch under FP16 autocast against an FP32 shadow. {INJECTED}'s weight was multiplied by "
            f"2^{int(math.log2(FACTOR))}: its own output is finite in FP32 and past FP16's 65504, so the forward "
            "overflows and no loss scale can help (the scale only touches the backward).",
            "Every module after it sees inf as input; the audit names the first cause, keeps it in FP32, runs "
            "the forward again and checks it is finite.",
        ]
        + [f"The scaler, meanwhile, in the FP16 run: \u201c{w}\u201d" for w in runs["fp16"]["warnings"]],
        pre=str(report),
        images=[("fp32_fallback_amax.png", "Per-module forward amax, FP16 and FP32, against FP16's max.")],
    )
    train_section = Section(
        "2. keep_fp32 makes FP16 train",
        verdict=summary["verdict"],
        anchor="train",
        text=[
            f"lossscale.keep_fp32(model, {summary['audit']['keep_fp32']!r}): that module runs outside autocast in "
            "FP32 and returns float32 (the residual stream it joins is float32 already); the rest stays FP16."
        ],
        figures=[
            (f"{name}: loss first -> last 5 steps", f"{r['loss'][0]:.3f} -> {_tail(r['loss']):.3f}")
            for name, r in runs.items()
        ]
        + [(f"{name}: steps skipped", f"{sum(r['skipped'])}/{summary['steps']}") for name, r in runs.items()],
        checks=[(c["check"], c["passed"], c["detail"]) for c in summary["checks"]],
        images=[
            (
                "fp32_fallback_loss.png",
                "Training loss, same weights and batches: FP32, FP16, FP16 + keep_fp32, FP16 + upcast.",
            )
        ],
    )
    up = runs["fp16_upcast"]
    upcast_section = Section(
        "3. on_forward_overflow='upcast' does it by itself",
        verdict=None,
        anchor="upcast",
        text=[
            "GradScaler(model=model, trace=True, on_forward_overflow='upcast'), no audit: the trace names the "
            "first module whose forward output was non-finite on each skipped step; named on 2 steps, the "
            "scaler calls keep_fp32 on it and says so."
        ]
        + [f"The scaler: “{w}”" for w in up["warnings"]],
        figures=[
            ("modules upcast", ", ".join(up["upcast"]) or "none"),
            ("steps skipped", f"{sum(up['skipped'])}/{summary['steps']}"),
        ],
    )
    backward = summary["backward"]
    backward_overflow.plot_losses(backward, os.path.join(out_dir, "backward_overflow_loss.png"))
    n = {name: backward_overflow.taken(r) for name, r in backward["runs"].items()}
    steps = backward["config"]["steps"]
    backward_section = Section(
        "4. A backward that overflows FP16 at any scale >= 1",
        verdict="HELD" if all(c["passed"] for c in backward["checks"]) else "NOT HELD",
        anchor="backward",
        text=[
            "Another model (lossscale.demo.backward_overflow, built from a config): one block divides by "
            f"2^{int(math.log2(backward['config']['gain']))} and multiplies back, so its forward stays in "
            "range while the gradient inside it passes FP16's 65504 at any scale >= 1. A scale below 1 fits it.",
            "Torch's GradScaler backs its scale off below 1 and trains. lossscale.GradScaler()'s floor is "
            "2^-24 (FP16's smallest subnormal), so it does the same; with min_scale=1.0 the scale stops at 1 "
            "and every step is skipped. on_backward_overflow='upcast' keeps the module the trace names in "
            "FP32 once the scale is at 1 or below.",
        ],
        pre="\n".join(backward["lines"]),
        figures=[(label, f"{n[name]}/{steps} steps taken") for name, (_, label) in backward_overflow.DEMO_RUNS.items()],
        checks=[(c["check"], c["passed"], c["detail"]) for c in backward["checks"]],
        images=[
            (
                "backward_overflow_loss.png",
                "Training loss, same weights and batches; dots are skipped steps.",
            )
        ],
    )
    return write_html(
        os.path.join(out_dir, "index.html"),
        "lossscale audit-demo: when loss scaling cannot fix it",
        [audit_section, train_section, upcast_section, backward_section],
        subtitle=f"A GPT-2-shaped model with one overflowing module, {summary['steps']} steps, seed "
        f"{summary['seed']}, on the CPU.",
    )
