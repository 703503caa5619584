"""Loss-scale policies side by side: skipped steps, flushed activation gradients, accuracy vs FP32.

Issue 4's evaluation. The digits MLP (64-64-10, sklearn's 8x8 digits, nothing downloaded) trains under
FP16 autocast with FP32 master weights, the loss multiplied by ``c`` and the SGD learning rate divided
by ``c``: for a power-of-two ``c`` FP32 training is bitwise unchanged (checked below), while every
FP16 gradient moves ``log2(1/c)`` binades down (c < 1, towards FP16's underflow cliff) or up (c > 1,
"large": a 2**16 start overflows).

Configurations:

* ``fp32``: no autocast, no scaler (the reference accuracy).
* ``torch``: ``torch.amp.GradScaler("cpu")`` with its defaults.
* ``dynamic``: ``lossscale.GradScaler()`` (torch's rule and defaults, plus lossscale's bounds [1, 2**24]).
* ``adaptive``: ``lossscale.GradScaler(policy="adaptive")``, the defaults (max_scale 2**24).
* ``adaptive_uncapped``: ``lossscale.GradScaler(policy="adaptive", max_scale=None)``: with measured
  growth the cap is not needed for safety; this shows where the rule goes when let.
* ``adaptive_m<k>`` (not run by default): the adaptive defaults with ``margin_bits=k``, for the margin
  ablation in docs/policies.md (``--configs torch,adaptive_m2,adaptive_m3,... --out <dir>``).
* ``logmax``: OpenSeq2Seq's LogMax as lossscale ships it, ``lossscale.GradScaler(policy="logmax")``
  (``lossscale/logmax.py``: kept to powers of two, and an overflow no longer pins the scale at its
  floor; the results committed before it moved into the library were taken with the published rule).

Figures per run: skipped optimizer steps; the flushed fraction of the activation gradients, i.e. of
the exact (FP32-shadow) gradients at every Linear's output, the share FP16 flushes to zero at the
scale the step ran with (``lossscale.hooks.activation_grad_probe``, pooled over layers, every
``--probe-every`` steps, averaged over the run; both "of all values", GradStats' ``flushed_frac``,
and "of the nonzero values"); the final scale; the test accuracy of the FP32 master weights. Along
the FP32 trajectory it also measures how well the parameter-gradient amax (what the scaler sees)
stands in for the activation-gradient amax (where FP16 overflows): ``log2(act amax / param amax)``.

Usage::

    python benchmarks/bench_policies.py                # 3 seeds x 5 workloads x 6 configs, ~5 min on 2 cores
    python benchmarks/bench_policies.py --quick        # 1 seed, 4 epochs: a smoke run

Writes ``benchmarks/results/policies.json`` (every figure, per seed) and ``policies.md`` (the table);
``--name`` changes the file stem (the margin ablation is ``policies_margin``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections import OrderedDict
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lossscale  # noqa: E402

#: (name, log2 c): the loss is multiplied by c = 2**log2_c.
WORKLOADS = [("c=1", 0), ("c=2^-12", -12), ("c=2^-20", -20), ("c=2^-24", -24), ("large c=2^10", 10)]
CONFIGS = ["fp32", "torch", "dynamic", "adaptive", "adaptive_uncapped", "logmax"]
LABELS = {
    "fp32": "FP32 (no autocast)",
    "torch": "torch.amp.GradScaler",
    "dynamic": "lossscale dynamic",
    "adaptive": "lossscale adaptive",
    "adaptive_uncapped": "lossscale adaptive, max_scale=None",
    "logmax": "LogMax (OpenSeq2Seq)",
}


# ----------------------------------------------------------------------------------------- data
def load_data(seed: int):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(d.data, d.target, test_size=0.25, random_state=seed, stratify=d.target)
    to_x = lambda a: torch.tensor(a, dtype=torch.float32) / 16.0  # noqa: E731  pixels 0..16 -> [0, 1]
    return to_x(x_tr), torch.tensor(y_tr), to_x(x_te), torch.tensor(y_te)


def make_mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        OrderedDict(
            fc1=torch.nn.Linear(64, 64),
            relu1=torch.nn.ReLU(),
            fc2=torch.nn.Linear(64, 64),
            relu2=torch.nn.ReLU(),
            fc3=torch.nn.Linear(64, 10),
        )
    )


# ------------------------------------------------------------------------------ activation probe
def _probe_fn() -> Callable:
    """``probe(model, loss_fn, x, y, scale) -> (flushed, nonzero, numel, act_amax)`` pooled over Linears.

    Uses lossscale.hooks / lossscale.stats when present; otherwise the same definition computed here
    (an FP32 forward/backward whose Linear output gradients are cast as ``fp16(g * scale)``).
    """
    try:
        from lossscale.hooks import activation_grad_probe

        def probe(model, loss_fn, x, y, scale):
            stats = activation_grad_probe(model, loss_fn, x, y, scale=scale, fmt="fp16").values()
            flushed = sum(s.flushed for s in stats)
            numel = sum(s.numel for s in stats)
            nonzero = numel - sum(s.zeros for s in stats)
            return flushed, nonzero, numel, max(float(s.amax) for s in stats)

        probe.source = "lossscale.hooks.activation_grad_probe"
        return probe
    except ImportError:
        pass

    def probe(model, loss_fn, x, y, scale):
        grads: List[torch.Tensor] = []
        mods = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        handles = [m.register_full_backward_hook(lambda mod, gi, go: grads.append(go[0].detach())) for m in mods]
        try:
            with torch.autocast("cpu", enabled=False):
                loss = loss_fn(model(x), y)
            torch.autograd.grad(loss, [p for p in model.parameters()])
        finally:
            for h in handles:
                h.remove()
        g = torch.cat([t.flatten() for t in grads])
        stored = (g.double() * float(scale)).float().half()
        flushed = int(((stored == 0) & (g != 0)).sum())
        return flushed, int((g != 0).sum()), g.numel(), float(g.abs().max())

    probe.source = "local FP32 shadow (lossscale.hooks not available)"
    return probe


# ------------------------------------------------------------------------------------- training
def _make_scaler(config: str):
    if config == "torch":
        return torch.amp.GradScaler("cpu")
    if config == "dynamic":
        return lossscale.GradScaler()
    if config == "adaptive":
        return lossscale.GradScaler(policy="adaptive")
    if config == "adaptive_uncapped":
        return lossscale.GradScaler(policy="adaptive", max_scale=None)
    if config == "logmax":
        return lossscale.GradScaler(policy="logmax")
    if config.startswith("adaptive_m"):
        from lossscale.adaptive import AdaptivePolicy

        return lossscale.GradScaler(policy=AdaptivePolicy(margin_bits=int(config[len("adaptive_m") :])))
    return None


def _label(config: str) -> str:
    if config == "logmax":
        return lossscale.GradScaler(policy="logmax")
    if config.startswith("adaptive_m"):
        return f"lossscale adaptive, margin_bits={config[len('adaptive_m') :]}"
    return LABELS[config]


def train_one(
    config: str,
    log2_c: int,
    seed: int,
    data,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    momentum: float,
    probe,
    probe_every: int,
) -> Dict:
    """One run; returns its figures."""
    t0 = time.perf_counter()
    x_tr, y_tr, x_te, y_te = data
    c = 2.0**log2_c
    model = make_mlp(seed)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr / c, momentum=momentum)  # lr/c * (c*g) == lr*g exactly
    fp16 = config != "fp32"
    scaler = _make_scaler(config)
    loss_fn = lambda out, y: F.cross_entropy(out, y) * c  # noqa: E731
    gen = torch.Generator().manual_seed(seed)
    skipped, step = 0, 0
    flushed_all, flushed_nz, scales, proxy, param_amaxes = [], [], [], [], []
    for _ in range(epochs):
        perm = torch.randperm(len(x_tr), generator=gen)
        for i in range(0, len(x_tr), batch_size):
            idx = perm[i : i + batch_size]
            x, y = x_tr[idx], y_tr[idx]
            if scaler is not None:
                scale = scaler.get_scale()
            else:
                scale = 1.0
            probing = step % probe_every == 0
            if probing and fp16:
                fl, nz, n, _ = probe(model, loss_fn, x, y, scale)
                flushed_all.append(fl / n)
                flushed_nz.append(fl / nz if nz else 0.0)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                loss = loss_fn(model(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                if isinstance(scaler, lossscale.GradScaler):
                    was_skipped = scaler.last_step_skipped
                else:  # torch: a skipped step is exactly one whose update backed the scale off
                    was_skipped = scaler.get_scale() < scale
            else:
                loss.backward()
                param_amax = float(torch.stack([p.grad.abs().max() for p in params]).max())
                param_amaxes.append(param_amax)
                if probing:  # the proxy: parameter-gradient amax vs activation-gradient amax, FP32
                    _, _, _, act_amax = probe(model, loss_fn, x, y, 1.0)
                    if param_amax > 0 and act_amax > 0:
                        proxy.append(math.log2(act_amax / param_amax))
                opt.step()
                was_skipped = False
            skipped += bool(was_skipped)
            scales.append(scale)
            step += 1
    with torch.no_grad():
        acc = float((model(x_te).argmax(1) == y_te).float().mean())
    final_scale = scaler.get_scale() if scaler is not None else 1.0
    out = {
        "config": config,
        "log2_c": log2_c,
        "seed": seed,
        "steps": step,
        "skipped": skipped,
        "flushed_frac": statistics.fmean(flushed_all) if flushed_all else None,
        "flushed_frac_nonzero": statistics.fmean(flushed_nz) if flushed_nz else None,
        "final_log2_scale": math.log2(final_scale),
        "log2_scale_trace": [round(math.log2(s), 3) for s in scales[::5]],
        "test_acc": acc,
        "wall_s": round(time.perf_counter() - t0, 2),
        "params_digest": float(sum(p.detach().double().sum() for p in params)),
    }
    if proxy:
        out["proxy_log2_act_over_param"] = {"max": max(proxy), "mean": statistics.fmean(proxy), "min": min(proxy)}
    if param_amaxes and param_amaxes[0] > 0:
        # How far the gradients rise above the first step's (what a calibration on step 1 must leave room for).
        out["rise_log2_over_first_step"] = math.log2(max(param_amaxes) / param_amaxes[0])
    return out


# -------------------------------------------------------------------------------------- report
def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else float("nan")


def summarise(runs: List[Dict], seeds: List[int]) -> Dict:
    """Per workload and config: means over seeds, and the goal checks against torch and FP32."""
    summary = OrderedDict()
    for wname, log2_c in WORKLOADS:
        w = OrderedDict()
        fp32_acc = {r["seed"]: r["test_acc"] for r in runs if r["log2_c"] == log2_c and r["config"] == "fp32"}
        noise = statistics.pstdev(fp32_acc.values()) if len(fp32_acc) > 1 else float("nan")
        if not fp32_acc:  # a run without FP32: differences are left undefined
            fp32_acc = {r["seed"]: float("nan") for r in runs}
        for cfg in dict.fromkeys(r["config"] for r in runs):
            rs = [r for r in runs if r["log2_c"] == log2_c and r["config"] == cfg]
            if not rs:
                continue
            d_acc = [r["test_acc"] - fp32_acc[r["seed"]] for r in rs]
            w[cfg] = {
                "skipped_mean": _mean([r["skipped"] for r in rs]),
                "skipped_per_seed": [r["skipped"] for r in rs],
                "flushed_frac": _mean([r["flushed_frac"] for r in rs]),
                "flushed_frac_nonzero": _mean([r["flushed_frac_nonzero"] for r in rs]),
                "final_log2_scale": [round(r["final_log2_scale"], 2) for r in rs],
                "test_acc": _mean([r["test_acc"] for r in rs]),
                "delta_acc_vs_fp32": _mean(d_acc),
                "delta_acc_per_seed": d_acc,
            }
            if cfg == "fp32" and all("proxy_log2_act_over_param" in r for r in rs):
                w[cfg]["proxy_log2_act_over_param_max"] = max(r["proxy_log2_act_over_param"]["max"] for r in rs)
                w[cfg]["proxy_log2_act_over_param_mean"] = _mean([r["proxy_log2_act_over_param"]["mean"] for r in rs])
                w[cfg]["fp32_acc_sd_over_seeds"] = noise
                w[cfg]["rise_log2_over_first_step_per_seed"] = [r.get("rise_log2_over_first_step") for r in rs]
        t = w.get("torch")
        for cfg in [k for k in w if k.startswith("adaptive")]:
            a = w.get(cfg)
            if a and t:
                a["goals"] = {
                    "skipped_le_torch_every_seed": all(
                        x <= y for x, y in zip(a["skipped_per_seed"], t["skipped_per_seed"])
                    ),
                    "flushed_le_half_torch": a["flushed_frac"] <= 0.5 * t["flushed_frac"],
                    "flushed_ratio_to_torch": a["flushed_frac"] / t["flushed_frac"] if t["flushed_frac"] else None,
                    "acc_within_noise": abs(a["delta_acc_vs_fp32"]) <= noise
                    if "fp32" in w and noise == noise
                    else None,
                }
        summary[wname] = w
    return summary


def _fmt_pct(x):
    return "n/a" if x is None or x != x else f"{100 * x:.2f}%"


def to_markdown(summary: Dict, meta: Dict) -> str:
    lines = [
        "# Loss-scale policies on the digits MLP",
        "",
        f"Generated by `{meta['command']}` ({meta['seeds']} seeds, {meta['epochs']} epochs of "
        f"{meta['steps_per_run']} steps, batch {meta['batch_size']}, SGD lr {meta['lr']}/c momentum "
        f"{meta['momentum']}; torch {meta['torch']}; {meta['wall_s']:.0f} s on {meta['machine']}).",
        "",
        "Per workload (loss multiplied by c, learning rate divided by c; FP32 is bitwise the same for "
        "every c), means over seeds. *skipped*: optimizer steps skipped for inf/NaN (per seed in "
        "brackets). *flushed*: share of the exact activation gradients (every Linear's output "
        "gradient, FP32 shadow pass every "
        f"{meta['probe_every']} steps, probe: {meta['probe']}) that FP16 flushes to zero at the step's "
        "scale; first of all values (GradStats' `flushed_frac`), then of the nonzero ones. "
        "*final log2 scale*: per seed. *acc*: test accuracy of the FP32 master weights; "
        "*Δ FP32*: mean paired difference to the FP32 run of the same seed.",
        "",
        "| workload | policy | skipped | flushed (all) | flushed (nonzero) | final log2 scale | acc | Δ FP32 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for wname, w in summary.items():
        for cfg, r in w.items():
            skipped = "–" if cfg == "fp32" else f"{r['skipped_mean']:.1f} {r['skipped_per_seed']}"
            scales = "–" if cfg == "fp32" else ", ".join(f"{s:g}" for s in r["final_log2_scale"])
            lines.append(
                f"| {wname} | {_label(cfg)} | {skipped} | {_fmt_pct(r['flushed_frac'])} | "
                f"{_fmt_pct(r['flushed_frac_nonzero'])} | {scales} | {100 * r['test_acc']:.2f}% | "
                + (
                    "n/a |"
                    if r["delta_acc_vs_fp32"] != r["delta_acc_vs_fp32"]
                    else f"{100 * r['delta_acc_vs_fp32']:+.2f} |"
                )
            )
    lines += [
        "",
        "Goals (adaptive against torch, per workload): skipped steps <= torch's on every seed; "
        "mean flushed fraction <= 0.5x torch's; |mean Δ accuracy| <= the seed-to-seed SD of FP32 accuracy.",
        "",
        "| workload | policy | skipped <= torch | flushed / torch | acc within noise (FP32 SD) |",
        "|---|---|---|---|---|",
    ]
    for wname, w in summary.items():
        for cfg in w:
            if "goals" in w[cfg]:
                g = w[cfg]["goals"]
                ratio = g["flushed_ratio_to_torch"]
                lines.append(
                    f"| {wname} | {_label(cfg)} | {'yes' if g['skipped_le_torch_every_seed'] else 'NO'} | "
                    f"{'n/a' if ratio is None else f'{ratio:.2f}'} "
                    f"{'(yes)' if g['flushed_le_half_torch'] else '(NO)'} | "
                    + (
                        "n/a |"
                        if g["acc_within_noise"] is None
                        else f"{'yes' if g['acc_within_noise'] else 'NO'} "
                        f"({100 * w['fp32']['fp32_acc_sd_over_seeds']:.2f} pts) |"
                    )
                )
    proxies = [w["fp32"] for w in summary.values() if "proxy_log2_act_over_param_max" in w.get("fp32", {})]
    if proxies:
        lines += [
            "",
            "The proxy, along the FP32 trajectory (the same for every c: FP32 is bitwise independent of c): "
            "log2(activation-gradient amax / parameter-gradient amax) over the probed steps of every seed: "
            f"max {max(f['proxy_log2_act_over_param_max'] for f in proxies):+.2f}, mean "
            f"{statistics.fmean(f['proxy_log2_act_over_param_mean'] for f in proxies):+.2f} binades. Positive "
            "means an activation gradient was larger than every parameter gradient: it would overflow first, "
            "unseen by the scaler's amax; the margin has to cover it.",
        ]
        rises = [x for f in proxies for x in f.get("rise_log2_over_first_step_per_seed", []) if x is not None]
        if rises:
            first_seed = rises[: len(proxies[0]["rise_log2_over_first_step_per_seed"])]
            lines += [
                "",
                "The rise, along the FP32 trajectory: the largest parameter-gradient amax of the run over "
                f"the first step's, per seed: {', '.join(f'{x:+.2f}' for x in first_seed)} "
                "binades (what a calibration on the first step must leave room for).",
            ]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--probe-every", type=int, default=5)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--quick", action="store_true", help="1 seed, 4 epochs (a smoke run)")
    ap.add_argument("--name", default="policies", help="output file stem: <out>/<name>.json and .md")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.epochs = 1, 4
    configs = [c for c in args.configs.split(",") if c]
    unknown = {c for c in configs if c not in CONFIGS and not (c.startswith("adaptive_m") and c[10:].isdigit())}
    if unknown:
        ap.error(f"unknown configs {sorted(unknown)}; choose from {CONFIGS}")
    # torch's note that fc1's input needs no gradient, from the probe's backward hooks: expected here.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    torch.set_num_threads(1)  # tiny matmuls: threads only add overhead (and the cores are shared)
    probe = _probe_fn()
    t0 = time.perf_counter()
    runs = []
    seeds = list(range(args.seeds))
    for seed in seeds:
        data = load_data(seed)
        for wname, log2_c in WORKLOADS:
            for cfg in configs:
                r = train_one(
                    cfg,
                    log2_c,
                    seed,
                    data,
                    epochs=args.epochs,
                    batch_size=args.batch_size,
                    lr=args.lr,
                    momentum=args.momentum,
                    probe=probe,
                    probe_every=args.probe_every,
                )
                runs.append(r)
                print(
                    f"seed {seed} {wname:13s} {cfg:18s} skipped {r['skipped']:3d}  flushed "
                    f"{_fmt_pct(r['flushed_frac']):>7s}  log2 scale {r['final_log2_scale']:6.2f}  "
                    f"acc {r['test_acc']:.4f}  ({r['wall_s']:.1f} s)",
                    flush=True,
                )
    # FP32 is bitwise independent of c (power-of-two c): check it, it is what makes the comparison fair.
    for seed in seeds:
        digests = {r["params_digest"] for r in runs if r["config"] == "fp32" and r["seed"] == seed}
        if len(digests) > 1:
            print(f"WARNING: FP32 runs of seed {seed} differ across c: {digests}", file=sys.stderr)
    wall = time.perf_counter() - t0
    n_train = len(load_data(0)[0])
    meta = {
        "command": "python benchmarks/bench_policies.py"
        + (" " + " ".join(argv) if argv else (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else "")),
        "seeds": args.seeds,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "momentum": args.momentum,
        "probe_every": args.probe_every,
        "probe": probe.source,
        "steps_per_run": args.epochs * math.ceil(n_train / args.batch_size),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, 1 thread",
        "wall_s": wall,
        "workloads": WORKLOADS,
        "configs": configs,
        "fp32_bitwise_same_across_c": all(
            len({r["params_digest"] for r in runs if r["config"] == "fp32" and r["seed"] == s}) <= 1 for s in seeds
        ),
    }
    summary = summarise(runs, seeds)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, args.name + ".json"), "w") as f:
        json.dump({"meta": meta, "summary": summary, "runs": runs}, f, indent=1)
    md = to_markdown(summary, meta)
    with open(os.path.join(args.out, args.name + ".md"), "w") as f:
        f.write(md)
    print(md)
    print(f"wrote {args.out}/{args.name}.json and {args.name}.md in {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
