"""A forward that overflows FP16 in the residual stream: clamp, FP32 upcast and ``lossscale.rescale`` side by side.

Tiny transformers models built from their configs (2 layers, 64 wide, nothing downloaded; the models of
``tests/test_rescale.py``): Gemma 3 with large post-norm weights (its residual stream reaches about 1.3e5,
Gemma-style), Llama and GPT-2 with large residual writers. Under FP16 autocast their forward overflows; no loss
scale helps. The remedies, each on the same initial weights:

* ``fp16``: the model as it is (autocast, ``lossscale.GradScaler()``): the forward overflows, every step skips.
* ``clamp``: every residual writer's FP16 output clamped to +-(65504 - 1000), as transformers once did for
  Gemma 3 in FP16 (a forward hook; what overflowed saturates).
* ``upcast``: ``lossscale.keep_fp32(model, report.keep_fp32)`` from ``lossscale.audit`` (what
  ``on_forward_overflow="upcast"`` reaches after the skips).
* ``rescale``: ``lossscale.rescale(model, c)``, ``c`` from ``lossscale.choose_rescale`` (one binade of headroom).
* ``fp32``: no autocast (the reference).

Measured, per model:

* FP32 exactness of the rescaling (max |difference| of the logits and of every parameter's gradient against the
  original, FP32): 0.0 when bitwise.
* FP16 accuracy of one forward: ``max|logits - logits_fp32| / max|logits_fp32|``.
* Training: ``--steps`` AdamW steps with the scaler; steps taken, the scale at the end, the largest relative
  loss difference from the FP32 run; and the audit's largest safe scale (the interplay of ``c`` with the loss
  scale: the writers' output gradients grow by ``c``).
* Speed: the time of one training iteration (forward, backward, scaler step) against ``fp16``, the median of
  ``--pairs`` interleaved pairs (CPU; the tiny models' figures, not a GPU's).
* Memory: the bytes autograd saves for the backward in one iteration (``saved_tensors_hooks``), against ``fp16``.
* Inference export: ``Rescaling.export`` loaded by plain transformers, in FP32 (difference from the original) and
  in float16 (the original in float16 overflows).

Usage::

    python benchmarks/bench_rescale.py               # 3 models, 20 steps, 30 pairs: a minute or two on one core

Writes ``benchmarks/results/rescale.json`` and ``rescale.md``. Nothing here is asserted by a test's timing.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Dict, List

import torch

import lossscale

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import transformers  # noqa: E402
from test_rescale import overflowing  # noqa: E402  (the tests' tiny models)

VARIANTS = ("fp16", "clamp", "upcast", "rescale", "rescale_2^12", "fp32")
CLAMP = 65504.0 - 1000.0


def batch(seq: int, size: int) -> torch.Tensor:
    return torch.randint(0, 128, (size, seq), generator=torch.Generator().manual_seed(0))


def loss_fn(model, ids):
    return model(ids, labels=ids).loss


def prepare(family: str, variant: str, ids: torch.Tensor):
    """The model of ``variant``, and a note (the factor, the kept modules)."""
    m = overflowing(family)
    note: Dict[str, object] = {}
    if variant == "clamp":
        r = lossscale.rescaling
        writers, _readers, _base, _layers = r._plan(m, r._family_of(m))
        for w in writers:
            m.get_submodule(w.name).register_forward_hook(lambda mod, i, out: out.clamp(-CLAMP, CLAMP))
        note["clamped"] = len(writers)
    elif variant == "upcast":
        report = lossscale.audit(m, loss_fn, ids)
        lossscale.keep_fp32(m, report.keep_fp32)
        note["flushed_frac_at_2^16"] = lossscale.audit(m, loss_fn, ids, scale=2.0**16).flushed_frac
        note["kept_fp32"] = list(report.keep_fp32)
        note["safe_scale"] = report.safe_scale
        note["kept_params"] = sum(p.numel() for n in report.keep_fp32 for p in m.get_submodule(n).parameters()) / sum(
            p.numel() for p in m.parameters()
        )
    elif variant.startswith("rescale"):
        report = lossscale.audit(m, loss_fn, ids)
        choice = lossscale.choose_rescale(m, report)
        r = lossscale.rescale(m, choice.factor if variant == "rescale" else 2.0**12)
        after = lossscale.audit(m, loss_fn, ids)
        note["factor"] = r.factor
        note["per_layer"] = [(n.name, n.amax, n.factor) for n in choice.layers]
        note["safe_scale"] = after.safe_scale
        # The interplay with the loss scale: the writers' output gradients (exact, from the FP32 shadow) grow by c.
        # Those stored in FP16 (the embedding's output is float32 under autocast).
        names = [w.name for w in r.writers if after.modules[w.name].grad_fp16]
        note["writer_grad_amax"] = max(after.modules[n].grad_amax for n in names)
        note["writer_grad_amax_original"] = max(report.modules[n].grad_amax for n in names)
        note["flushed_frac_at_2^16"] = lossscale.audit(m, loss_fn, ids, scale=2.0**16).flushed_frac
    return m, note


def forward_error(m, variant, ids, ref) -> float:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16, enabled=variant != "fp32"):
        y = m(ids).logits.float()
    if not y.isfinite().all():
        return math.inf
    return ((y - ref).abs().max() / ref.abs().max()).item()


def iteration(m, opt, scaler, variant, ids):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16, enabled=variant != "fp32"):
        loss = loss_fn(m, ids)
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return loss


def train(m, variant, ids, steps):
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    scaler = None if variant == "fp32" else lossscale.GradScaler("cpu")
    losses, taken = [], 0
    for _ in range(steps):
        before = [p.detach().clone() for p in list(m.parameters())[:1]]
        losses.append(iteration(m, opt, scaler, variant, ids).item())
        taken += not torch.equal(before[0], next(iter(m.parameters())).detach())
    end_scale = None if scaler is None else scaler.get_scale()
    return losses, taken, end_scale


def saved_bytes(m, variant, ids) -> int:
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.float16, enabled=variant != "fp32"):
            loss = loss_fn(m, ids)
    loss.backward()
    m.zero_grad(set_to_none=True)
    return total[0]


def timing(prepared, ids, pairs) -> Dict[str, float]:
    """Median over interleaved pairs of ``t(variant) / t(fp16)``, each variant against a run of ``fp16``."""
    models = {}
    for v, m in prepared.items():
        scaler = None if v == "fp32" else lossscale.GradScaler("cpu")
        models[v] = (m, torch.optim.AdamW(m.parameters(), lr=1e-3), scaler)
    # The noise floor: fp16 against a second copy of itself (an A/A pair).
    twin = copy.deepcopy(prepared["fp16"])
    models["fp16_twin"] = (twin, torch.optim.AdamW(twin.parameters(), lr=1e-3), lossscale.GradScaler("cpu"))
    for v in models:  # warm-up
        for _ in range(2):
            iteration(*models[v], v, ids)
    ratios: Dict[str, List[float]] = {v: [] for v in models if v != "fp16"}
    for _ in range(pairs):
        for v in ratios:
            t = []
            for w in ("fp16", v):
                start = time.perf_counter()
                iteration(*models[w], w, ids)
                t.append(time.perf_counter() - start)
            ratios[v].append(t[1] / t[0])
    return {v: statistics.median(r) for v, r in ratios.items()}


def fp32_exactness(family, ids) -> Dict[str, float]:
    from test_rescale import tiny

    m = tiny(family)
    out = m(ids, labels=ids)
    out.loss.backward()
    g0 = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    lossscale.rescale(m, 64)
    out2 = m(ids, labels=ids)
    out2.loss.backward()
    return {
        "logits_max_abs_diff": (out.logits - out2.logits).abs().max().item(),
        "grads_max_abs_diff": max((g0[n] - p.grad).abs().max().item() for n, p in m.named_parameters()),
    }


def export_errors(family, ids) -> Dict[str, float]:
    m = overflowing(family)
    with torch.no_grad():
        ref = m(ids).logits
        half = copy.deepcopy(m).half()(ids).logits
    out = {"original_float16_finite": bool(half.isfinite().all())}
    with tempfile.TemporaryDirectory() as d:
        lossscale.rescale(m, 64).export(d)
        for dtype in (torch.float32, torch.float16):
            e = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation="eager").eval()
            with torch.no_grad():
                y = e(ids).logits.float()
            out[f"export_{str(dtype)[6:]}_rel_diff"] = (
                ((y - ref).abs().max() / ref.abs().max()).item() if y.isfinite().all() else math.inf
            )
    # The tests' tiny model with random norm weights (Gemma's post-norms: (1 + w) / c - 1 rounds).
    from test_rescale import tiny

    m = tiny(family)
    with torch.no_grad():
        ref = m(ids).logits
    with tempfile.TemporaryDirectory() as d:
        lossscale.rescale(m, 64).export(d)
        e = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
        with torch.no_grad():
            y = e(ids).logits
    out["export_random_norms_float32_rel_diff"] = ((y - ref).abs().max() / ref.abs().max()).item()
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=["gemma3", "llama", "gpt2"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    ids = batch(args.seq, args.batch)
    results = {
        "command": "python benchmarks/bench_rescale.py" + ("" if argv is None or not argv else " " + " ".join(argv)),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "threads": 1,
        "batch": [args.batch, args.seq],
        "steps": args.steps,
        "pairs": args.pairs,
        "models": {},
    }
    for family in args.families:
        row: Dict[str, object] = {"fp32_exactness": fp32_exactness(family, ids)}
        ref_model = overflowing(family)
        with torch.no_grad():
            ref = ref_model(ids).logits
        ref_losses = train(ref_model, "fp32", ids, args.steps)[0]
        variants, prepared = {}, {}
        for v in VARIANTS:
            m, note = prepare(family, v, ids)
            prepared[v] = m
            err = forward_error(m, v, ids, ref)
            mem = saved_bytes(m, v, ids)
            losses, taken, end_scale = train(m, v, ids, args.steps)
            finite = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses) if math.isfinite(a)]
            variants[v] = {
                "forward_rel_error": err,
                "steps_taken": taken,
                "end_scale": end_scale,
                "loss_first": losses[0],
                "loss_last": losses[-1],
                "max_loss_rel_diff": max(finite) if len(finite) == len(losses) else math.inf,
                "saved_bytes": mem,
                **note,
            }
        times = timing(prepared, ids, args.pairs)  # the trained models
        row["time_noise_fp16_vs_fp16"] = times.pop("fp16_twin")
        for v, ratio in times.items():
            variants[v]["time_ratio_vs_fp16"] = ratio
        for v in VARIANTS:
            variants[v]["saved_bytes_ratio_vs_fp16"] = variants[v]["saved_bytes"] / variants["fp16"]["saved_bytes"]
        row["variants"] = variants
        row["ref_losses"] = ref_losses
        row["export"] = export_errors(family, ids)
        results["models"][family] = row
        print(family, json.dumps({v: {k: x for k, x in d.items() if k != "per_layer"} for v, d in variants.items()}))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "rescale.json"), "w") as fh:
        json.dump(results, fh, indent=1, default=str)
    with open(os.path.join(args.out, "rescale.md"), "w") as fh:
        fh.write(markdown(results))
    return results


def _g(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return "not finite"
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def _pow2(s) -> str:
    if s is None:
        return "-"
    m, e = math.frexp(s)
    return f"2^{e - 1}" if m == 0.5 else f"{s:g}"


def markdown(r: dict) -> str:
    out = [
        "# A forward that overflows FP16: clamp, FP32 upcast, rescale",
        "",
        f"`{r['command']}` (torch {r['torch']}, transformers {r['transformers']}, CPU {r['machine']}, "
        f"{r['threads']} thread; FP16 autocast; tiny models from their configs, 2 layers, 64 wide; batch "
        f"{r['batch'][0]} x {r['batch'][1]} tokens; {r['steps']} AdamW steps with `lossscale.GradScaler()`; "
        f"time: median of {r['pairs']} interleaved pairs against `fp16`).",
        "",
    ]
    for family, row in r["models"].items():
        v = row["variants"]
        resc = v["rescale"]
        out += [
            f"## {family}",
            "",
            f"Rescale factor (choose_rescale, one binade of headroom): {_pow2(resc['factor'])}; per place: "
            + ", ".join(f"{n} amax {a:.3g} -> {_pow2(c)}" for n, a, c in resc["per_layer"])
            + ".",
            f"FP32, the rescaling at 2^6 against the original: logits max |diff| "
            f"{row['fp32_exactness']['logits_max_abs_diff']:g}, every gradient max |diff| "
            f"{row['fp32_exactness']['grads_max_abs_diff']:g}.",
            f"Kept in FP32 by `upcast`: {len(v['upcast']['kept_fp32'])} modules, "
            f"{v['upcast']['kept_params']:.1%} of the parameters.",
            f"The loss scale: the largest FP16-stored output gradient of a residual writer (audit, FP32 shadow, "
            f"unscaled) is {resc['writer_grad_amax_original']:.3g} in the original, {resc['writer_grad_amax']:.3g} "
            f"rescaled by {_pow2(resc['factor'])} and {v['rescale_2^12']['writer_grad_amax']:.3g} by 2^12. Largest "
            f"safe loss scale (audit): upcast {_pow2(v['upcast']['safe_scale'])}, rescale "
            f"{_pow2(resc['safe_scale'])}, rescale by 2^12 {_pow2(v['rescale_2^12']['safe_scale'])}. Share of the "
            f"nonzero FP16-stored activation-gradient values flushed to zero at scale 2^16: upcast "
            f"{v['upcast']['flushed_frac_at_2^16']:.3%}, rescale {resc['flushed_frac_at_2^16']:.3%}, rescale by "
            f"2^12 {v['rescale_2^12']['flushed_frac_at_2^16']:.3%}.",
            "",
            "| remedy | forward rel. error | steps taken | scale at the end | max loss rel. diff from fp32 "
            "| time / fp16 | saved activations / fp16 |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, d in v.items():
            out.append(
                f"| {name} | {_g(d['forward_rel_error'])} | {d['steps_taken']} of {r['steps']} | "
                f"{_pow2(d['end_scale'])} | {_g(d['max_loss_rel_diff'])} | "
                f"{_g(d.get('time_ratio_vs_fp16', 1.0))} | {d['saved_bytes_ratio_vs_fp16']:.3g} |"
            )
        e = row["export"]
        out += [
            "",
            f"Time noise: fp16 against a second copy of itself (the same pairs): {row['time_noise_fp16_vs_fp16']:.3g}.",
            f"Export (`Rescaling.export`, loaded by `AutoModelForCausalLM.from_pretrained`): float32 rel. diff "
            f"{_g(e['export_float32_rel_diff'])}; float16 rel. diff {_g(e['export_float16_rel_diff'])} (the "
            f"original in float16: {'finite' if e['original_float16_finite'] else 'not finite'}); the tiny model "
            f"with random norm weights, at 2^6, float32 rel. diff {_g(e['export_random_norms_float32_rel_diff'])}.",
            "",
        ]
    return "\n".join(out)


if __name__ == "__main__":
    main()
