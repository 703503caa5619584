"""Fault-injection benchmark for the first-cause diagnosis (issue 13), and the cost of tracing.

    python benchmarks/bench_diagnosis.py            # 50 injections per fault class, ~1-2 min on 2 cores
    python benchmarks/bench_diagnosis.py --quick    # 5 per class (a smoke run)

Fault classes, each injected at a random step into a random layer of a small MLP trained in FP16
autocast on CPU with ``GradScaler(model=model, trace=True)``:

* (a) ``nan_input``: a NaN in one input row, so the loss is NaN (no layer is at fault: the expected
  answer is the first layer, where the NaN enters, and "loss: nan");
* (b) ``forward_inf``: an inf in one layer's forward output (a forward hook);
* (c) ``backward_overflow``: the gradient arriving at one layer's output is amplified 2**20x (an
  identity autograd function; the forward is untouched), so that layer's backward is the first to
  overflow FP16; any layer but the first, whose input (the data) has no gradient to check;
* (d) ``nan_weight``: a NaN written into one layer's weight.

Per class: how often the reported first module is the injected one (forward for a, b, d; backward
for c), whether the scale was kept (a, b, d) or backed off (c), and the steps from injection to the
report (0: the report of the very step). Also: 100 NaN-loss batches among 1,000 steps, the scale at
the end with lossscale and with torch's GradScaler; and the iteration time with tracing on vs off
(median of interleaved repeats), on the digits-sized MLP and on a small transformer block.

Writes ``benchmarks/results/diagnosis.json`` and ``diagnosis.md``. Nothing is asserted here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import lossscale  # noqa: E402

CLASSES = ("nan_input", "forward_inf", "backward_overflow", "nan_weight")
WIDTH, DEPTH = 32, 6  # Linear layers; a ReLU after each but the last


def make_mlp(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for i in range(DEPTH):
        layers.append(torch.nn.Linear(WIDTH, WIDTH if i < DEPTH - 1 else 10))
        if i < DEPTH - 1:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def linear_names(model):
    return [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def step(model, opt, scaler, x, y):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


class _Amplify(torch.autograd.Function):
    """Identity forward; the backward multiplies the incoming gradient by 2**20 (an fp16 one overflows)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * 2.0**20


def one_injection(kind: str, rng: random.Random, seed: int) -> dict:
    """Train a few clean steps, inject ``kind`` at a random step into a random layer, read the report."""
    model = make_mlp(seed)
    names = linear_names(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = lossscale.GradScaler(model=model, trace=True, growth_interval=10**6)
    g = torch.Generator().manual_seed(seed)
    at = rng.randrange(2, 6)
    # A backward overflow is an input gradient that overflows, and the first layer's input (the data)
    # has none: that class picks from the other layers.
    layer = 0 if kind == "nan_input" else rng.randrange(1 if kind == "backward_overflow" else 0, len(names))
    target = dict(model.named_modules())[names[layer]]
    out = dict(kind=kind, layer=names[layer], at=at)
    for k in range(at + 1):
        x, y = torch.randn(16, WIDTH, generator=g), torch.randint(0, 10, (16,), generator=g)
        handle = None
        if k == at:
            if kind == "nan_input":
                x[rng.randrange(16)] = math.nan
            elif kind == "forward_inf":
                col = rng.randrange(target.out_features)
                # prepend: the injection runs before the tracer's hook, as if the layer made the inf
                handle = target.register_forward_hook(
                    lambda m, a, o, c=col: o.index_fill(1, torch.tensor([c]), math.inf), prepend=True
                )
            elif kind == "backward_overflow":
                # The gradient reaching this layer's output is amplified 2**20x on its way in (the
                # forward is untouched), so this layer's backward is the first to overflow fp16.
                handle = target.register_forward_hook(lambda m, a, o: _Amplify.apply(o), prepend=True)
            elif kind == "nan_weight":
                with torch.no_grad():
                    target.weight[rng.randrange(target.out_features), 0] = math.nan
        before = scaler.get_scale()
        step(model, opt, scaler, x, y)
        if handle is not None:
            handle.remove()
    report = scaler.overflow_report()
    expected_where = "backward" if kind == "backward_overflow" else "forward"
    out.update(
        skipped=scaler.last_step_skipped,
        reported=report[expected_where],
        found=report[expected_where] == names[layer],
        scale_before=before,
        scale_after=scaler.get_scale(),
        kept=scaler.get_scale() == before,
        backed_off=scaler.get_scale() < before,
        loss=report["loss"],
        cause=report["cause"],
        steps_to_diagnosis=0 if scaler.last_step_skipped else None,
    )
    scaler.close()
    return out


def bad_batches(steps=1000, bad=100, seed=0) -> dict:
    """Scales after ``bad`` NaN-loss batches spread over ``steps``: a clean run, lossscale, torch."""
    out = {}
    bad_steps = set(random.Random(seed).sample(range(steps), bad))
    for name, make, bads in (
        ("clean", lambda: lossscale.GradScaler(growth_interval=2000), set()),
        ("lossscale", lambda: lossscale.GradScaler(growth_interval=2000), bad_steps),
        ("torch", lambda: torch.amp.GradScaler("cpu", growth_interval=2000), bad_steps),
    ):
        torch.manual_seed(seed)
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = make()
        for k in range(steps):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(k))
            if k in bads:
                x[0, 0] = math.nan
            opt.zero_grad()
            scaler.scale(model(x).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
        out[name] = scaler.get_scale()
    return out


class Block(torch.nn.Module):
    """A small pre-norm transformer block (attention + MLP), d=64, 4 heads."""

    def __init__(self, d=64, heads=4):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.head = torch.nn.Linear(d, 10)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))
        return self.head(x.mean(1))


def overhead(make_model, make_batch, repeats: int) -> dict:
    """Iteration time with tracing on / off, interleaved; median of per-pair ratios."""
    sides = {}
    for trace in (False, True):
        model = make_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
        sides[trace] = (model, opt, lossscale.GradScaler(model=model, trace=trace))
    x, y = make_batch()
    times = {False: [], True: []}
    ratios = []
    for r in range(repeats):
        this = {}
        for trace in (False, True) if r % 2 == 0 else (True, False):
            model, opt, scaler = sides[trace]
            t0 = time.perf_counter()
            step(model, opt, scaler, x, y)
            this[trace] = time.perf_counter() - t0
        if r >= 3:  # warm-up
            for k, v in this.items():
                times[k].append(v)
            ratios.append(this[True] / this[False])
    return {
        "off_ms": statistics.median(times[False]) * 1e3,
        "on_ms": statistics.median(times[True]) * 1e3,
        "ratio": statistics.median(ratios),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    n = 5 if args.quick else 50
    rng = random.Random(0)
    runs = [one_injection(kind, rng, seed) for kind in CLASSES for seed in range(n)]
    table = {}
    for kind in CLASSES:
        rs = [r for r in runs if r["kind"] == kind]
        should_keep = kind != "backward_overflow"
        table[kind] = {
            "n": len(rs),
            "skipped": sum(r["skipped"] for r in rs) / len(rs),
            "first_module_right": sum(r["found"] for r in rs) / len(rs),
            "scale_right": sum((r["kept"] if should_keep else r["backed_off"]) for r in rs) / len(rs),
            "steps_to_diagnosis": statistics.median(
                [r["steps_to_diagnosis"] for r in rs if r["steps_to_diagnosis"] is not None] or [math.nan]
            ),
            "example": rs[0]["cause"],
        }
    batches = bad_batches(steps=200 if args.quick else 1000, bad=20 if args.quick else 100)
    reps = 10 if args.quick else 60
    cost = {
        "mlp (digits-sized, 6 Linear)": overhead(
            lambda: make_mlp(0), lambda: (torch.randn(64, WIDTH), torch.randint(0, 10, (64,))), reps
        ),
        "transformer block (d=64, 16 tokens)": overhead(
            lambda: Block(), lambda: (torch.randn(16, 16, 64), torch.randint(0, 10, (16,))), reps
        ),
    }
    results = {
        "classes": table,
        "bad_batches": batches,
        "tracing_overhead": cost,
        "runs": runs,
        "seconds": round(time.perf_counter() - t0, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, 1 thread",
        "command": "python benchmarks/bench_diagnosis.py" + (" --quick" if args.quick else ""),
    }
    lines = [
        f"Measured on {results['machine']}. Command: `{results['command']}` ({results['seconds']} s).",
        "",
        "| fault | n | skipped | first module right | scale right (kept a,b,d / backed off c) | steps to diagnosis |",
        "|---|---|---|---|---|---|",
    ]
    for kind, r in table.items():
        lines.append(
            f"| {kind} | {r['n']} | {r['skipped']:.0%} | {r['first_module_right']:.0%} | "
            f"{r['scale_right']:.0%} | {r['steps_to_diagnosis']:g} |"
        )
    lines += ["", "Examples of the diagnosis:", ""] + [f"- {k}: {r['example']}" for k, r in table.items()]
    lines += [
        "",
        f"NaN-loss batches ({'20 of 200' if args.quick else '100 of 1000'}), final scale: clean run "
        f"{batches['clean']:g}, lossscale {batches['lossscale']:g}, torch {batches['torch']:g} "
        f"(2^{math.log2(batches['torch']):.0f}).",
        "",
        "Tracing cost (iteration time, fused Adam, median of interleaved repeats):",
        "",
        "| model | off ms | on ms | on / off |",
        "|---|---|---|---|",
    ]
    for k, r in cost.items():
        lines.append(f"| {k} | {r['off_ms']:.2f} | {r['on_ms']:.2f} | {r['ratio']:.2f} |")
    os.makedirs(args.out, exist_ok=True)
    stem = "diagnosis_quick" if args.quick else "diagnosis"
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
