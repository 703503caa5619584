"""Graph breaks of one iteration's scaler calls under torch.compile, lossscale beside torch, per path.

    python benchmarks/graph_breaks.py            # writes benchmarks/results/graph_breaks.{json,md}

For each optimizer path (SGD, AdamW foreach, AdamW fused; each without and with clipping: torch's
``unscale_`` + ``torch.nn.utils.clip_grad_norm_``, lossscale's own ``clip_grad_norm_``) it compiles the
calls after the backward (``unscale_``/clip, ``step``, ``update``) with ``torch.compile`` on the CPU and
records, for one compiled iteration, the graph breaks dynamo counts (``torch._dynamo.utils.counters
["graph_break"]``) with their reasons, what ``torch._dynamo.explain`` reports (graphs; its breaks are
graphs - 1, so -1 where nothing compiled), and whether ``fullgraph=True`` compiles (else its error's
first line). The iteration is also run eagerly from the same start and the weights compared with
``torch.equal`` (inductor compiles the non-fused optimizers' own steps, whose roundings differ from
eager, torch's scaler as lossscale's).

torch's scaler is on dynamo's skip list: each of its calls is a break and nothing inside compiles (the
optimizer step it calls is compiled as a frame of its own). The fused optimizers' steps break in torch
itself: ``torch.optim`` calls ``torch._dynamo.graph_break()`` around every step and wraps its fused
kernels in ``torch.compiler.disable``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch
import torch._dynamo
from torch._dynamo.utils import counters

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
import lossscale  # noqa: E402

PATHS = [("sgd", False), ("sgd", True), ("adamw foreach", False), ("adamw foreach", True)]
PATHS += [("adamw fused", False), ("adamw fused", True)]


def _setup(kind, ours):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    if kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    elif kind == "adamw foreach":
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), fused=True)
    scaler = lossscale.GradScaler("cpu") if ours else torch.amp.GradScaler("cpu")
    return model, opt, scaler


def _after_backward(model, opt, scaler, clip, ours):
    if clip and ours:
        scaler.clip_grad_norm_(opt, 1.0)
    elif clip:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()


def _run(kind, clip, ours, compiled, iterations=3):
    model, opt, scaler = _setup(kind, ours)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    fn = _after_backward
    if compiled is not None:
        fn = torch.compile(_after_backward, fullgraph=compiled)
    for i in range(iterations):
        opt.zero_grad()
        scaler.scale(model(x).sum()).backward()
        (fn if i else _after_backward)(model, opt, scaler, clip, ours)  # the first (state-creating) one eager
    return [p.detach().clone() for p in model.parameters()]


def _explain(kind, clip, ours):
    """``torch._dynamo.explain`` over the calls after one backward (its ``graph_break_count`` is its
    ``graph_count - 1``: -1 where nothing was compiled)."""
    model, opt, scaler = _setup(kind, ours)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    scaler.scale(model(x).sum()).backward()
    _after_backward(model, opt, scaler, clip, ours)
    opt.zero_grad()
    scaler.scale(model(x).sum()).backward()
    torch._dynamo.reset()
    return torch._dynamo.explain(_after_backward)(model, opt, scaler, clip, ours)


def measure(kind, clip, ours):
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        weights = _run(kind, clip, ours, compiled=False, iterations=2)  # one compiled call: one trace
        reasons = {}
        for k, v in counters["graph_break"].items():
            reasons[k.splitlines()[0][:120]] = reasons.get(k.splitlines()[0][:120], 0) + v
        eager = _run(kind, clip, ours, compiled=None, iterations=2)
        explained = _explain(kind, clip, ours)
        torch._dynamo.reset()
        try:
            _run(kind, clip, ours, compiled=True, iterations=2)
            fullgraph = "compiles"
        except Exception as error:  # noqa: BLE001 - the error is the result
            fullgraph = str(error).strip().splitlines()[0][:160]
    return dict(
        graph_breaks=sum(reasons.values()),
        explain_graphs=explained.graph_count,
        explain_graph_breaks=explained.graph_break_count,
        reasons=reasons,
        fullgraph=fullgraph,
        bitwise_eager=all(torch.equal(a, b) for a, b in zip(weights, eager)),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for kind, clip in PATHS:
        for ours in (False, True):
            row = dict(path=kind + (" + clip" if clip else ""), scaler="lossscale" if ours else "torch")
            row.update(measure(kind, clip, ours))
            rows.append(row)
            print(row["path"], row["scaler"], row["graph_breaks"], row["explain_graphs"], row["fullgraph"], flush=True)
    result = dict(torch=torch.__version__, device="cpu", rows=rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "graph_breaks.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [
        "Graph breaks per iteration (unscale_/clip, step, update under torch.compile; "
        f"torch {torch.__version__}, CPU).",
        "Regenerate: python benchmarks/graph_breaks.py",
        "",
        "| path | scaler | graph breaks (dynamo's counter) | explain: graphs, breaks | fullgraph=True "
        "| bitwise eager | reasons |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        why = "; ".join(f"{k} (x{v})" for k, v in r["reasons"].items()) or "-"
        lines.append(
            f"| {r['path']} | {r['scaler']} | {r['graph_breaks']} | {r['explain_graphs']}, {r['explain_graph_breaks']} "
            f"| {r['fullgraph']} | {r['bitwise_eager']} | {why} |"
        )
    with open(os.path.join(args.out, "graph_breaks.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
