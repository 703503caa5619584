"""A whole training iteration with lossscale's defaults against torch.amp.GradScaler, side by side.

    python benchmarks/bench_iteration.py            # every row, one run each
    python benchmarks/bench_iteration.py --quick    # a smoke run (tiny models, a few pairs)
    python benchmarks/bench_iteration.py --models mlp --pairs 200 --runs 4 --control   # the committed results:
    python benchmarks/bench_iteration.py --models gpt2 --pairs 40 --runs 4 --control   #   bench_iteration_*.md

Writes ``benchmarks/results/bench_iteration.json`` and ``bench_iteration.md`` (``--out`` to change); a run of
one model writes ``bench_iteration_<model>.*`` (the committed ones: ``bench_iteration_gpt2.md``, ``..._mlp.md``).

What users feel is the iteration, so that is what is timed: ``zero_grad``, the forward under FP16
autocast, ``scaler.scale(loss).backward()``, the clip if any, ``scaler.step(opt)``, ``scaler.update()``.
Both sides run in this process on twin models (the same initial weights, the same batch every
iteration), each with its own optimizer and scaler: ``lossscale.GradScaler()`` at its defaults, and
``torch.amp.GradScaler("cpu")``. A measurement is a pair: one iteration of each, back to back, which
goes first alternating; a row's ratio is the median of its pairs' ratios (lossscale / torch: below 1
is faster) and its times the medians of each side. One thread (``torch.set_num_threads(1)``): on a
shared 2-core machine that is what can be measured stably.

Models: a GPT-2 built from a config (4 layers, 256 wide, vocabulary 16384: 7.4M parameters; one
sequence of 32 tokens) and an MLP of 8 layers 256 wide on a batch of 32 (host-bound: a few ms per
iteration). Optimizers: AdamW fused, AdamW foreach, SGD with momentum. Clipping: none; torch's
recipe (``scaler.unscale_(opt)`` + ``clip_grad_norm_``) on both sides; and lossscale's own
``scaler.clip_grad_norm_(opt, 1.0)`` against torch's recipe.

Beside the times: the optimizer side alone (clip, ``step``, ``update``, timed inside the same
iterations: where a difference comes from), host syncs per iteration, each side
(``tests/_sync.count_host_syncs``: a CPU run stands for the device), and the launches the scaler and
optimizer calls make (everything but the forward and backward), as a GPU would see them: a model of a
device, reported, not a goal. ``--device cuda`` runs the same rows on a GPU (``gpu_check.py`` does).
Nothing is asserted: CI runs ``--quick`` as a smoke test only.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))  # measure the checkout this file lives in
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the test instruments (the sync and launch counter)
from _sync import count_device_work  # noqa: E402

import lossscale  # noqa: E402

#: The targets (the report marks the rows that miss them; nothing fails on them).
TARGETS = {"gpt2": 1.005, "mlp": 1.05, "own clip": 1.0}
OPTIMIZERS = ("adamw_fused", "adamw_foreach", "sgd")
DEVICE = torch.device("cpu")  # --device


def clock() -> float:
    """``time.perf_counter()`` once the device has done what was queued (CUDA runs asynchronously)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


CLIPS = ("none", "torch recipe", "own clip")


def gpt2(quick: bool):
    """A GPT-2 from a config (nothing downloaded) and a loss on one fixed batch of token ids."""
    import transformers

    transformers.logging.set_verbosity_error()
    size = (
        dict(n_layer=1, n_embd=32, n_head=2, vocab_size=256)
        if quick
        else dict(n_layer=4, n_embd=256, n_head=4, vocab_size=16384)
    )
    config = transformers.GPT2Config(
        n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **size
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(DEVICE)
    ids = torch.randint(0, config.vocab_size, (1, 8 if quick else 32), generator=torch.Generator().manual_seed(1))
    ids = ids.to(DEVICE)
    return model, lambda m: m(ids, labels=ids).loss


def mlp(quick: bool):
    """An MLP of 8 layers, 256 wide (2 x 16 for --quick), and a cross-entropy loss on a fixed batch of 32:
    host-bound (an iteration is a few milliseconds on one thread), so it shows the scaler's own work."""
    width, depth = (16, 2) if quick else (256, 8)
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1]).to(DEVICE)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, width, generator=g).to(DEVICE), torch.randint(0, width, (32,), generator=g).to(DEVICE)
    return model, lambda m: torch.nn.functional.cross_entropy(m(x), y)


def optimizer(kind: str, params):
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    if kind == "adamw_foreach":
        return torch.optim.AdamW(params, lr=1e-4, foreach=True)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


class Side:
    """One side of a row: a model, its optimizer and its scaler, and one iteration of them."""

    def __init__(self, make_model, kind: str, scaler, clip: str):
        self.model, self.loss = make_model()
        self.opt = optimizer(kind, self.model.parameters())
        self.scaler, self.clip = scaler, clip

    def forward_backward(self):
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE.type, dtype=torch.float16):
            loss = self.loss(self.model)
        self.scaler.scale(loss).backward()

    def optimizer_side(self):
        if self.clip == "torch recipe":
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        elif self.clip == "own clip":
            self.scaler.clip_grad_norm_(self.opt, 1.0)
        self.scaler.step(self.opt)
        self.scaler.update()

    def iteration(self):
        """(seconds for the iteration, seconds for its optimizer side: clip, step, update)."""
        start = clock()
        self.forward_backward()
        middle = clock() if DEVICE.type == "cpu" else time.perf_counter()  # (a sync here would distort CUDA)
        self.optimizer_side()
        end = clock()
        return end - start, end - middle

    def counted(self):
        """(syncs of a whole iteration, launches of its scaler and optimizer calls)."""
        with count_device_work() as whole:
            self.forward_backward()
            with count_device_work() as tail:
                self.optimizer_side()
        return whole.syncs, tail.launches


def interleaved(ours, theirs, pairs: int, warmup: int = 3):
    """``pairs`` measurements, each a call of ``ours()`` and of ``theirs()`` back to back, which goes first
    alternating, after ``warmup`` unmeasured calls of each (first-call work, the optimizers' state).
    Returns ``(ours' results, theirs' results)`` in pair order. The benchmarks' one measuring loop."""
    for _ in range(warmup):
        ours()
        theirs()
    mine, others = [], []
    for i in range(pairs):
        if i % 2:
            a, b = ours(), theirs()
        else:
            b, a = theirs(), ours()
        mine.append(a)
        others.append(b)
    return mine, others


def row(model_name: str, kind: str, clip: str, pairs: int, quick: bool, ours_first: bool = True):
    """One row: twin models, ``pairs`` interleaved pairs. ``ours_first``: which side's model is built (and
    so placed in memory) first; :func:`repeated_row` alternates it, since placement moves a run's ratio.
    ``clip="control"``: torch's scaler on both sides, no clip (what a ratio of 1 measures as here)."""
    make_model = (lambda: gpt2(quick)) if model_name == "gpt2" else (lambda: mlp(quick))

    def make_ours():
        if clip == "control":
            return Side(make_model, kind, torch.amp.GradScaler(DEVICE.type), "none")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return Side(make_model, kind, lossscale.GradScaler(), clip)

    def make_theirs():
        their_clip = {"own clip": "torch recipe", "control": "none"}.get(clip, clip)
        return Side(make_model, kind, torch.amp.GradScaler(DEVICE.type), their_clip)

    if ours_first:
        ours, theirs = make_ours(), make_theirs()
    else:
        theirs, ours = make_theirs(), make_ours()
    t_ours, t_theirs = interleaved(ours.iteration, theirs.iteration, pairs)
    ratios = [a[0] / b[0] for a, b in zip(t_ours, t_theirs)]
    tail_ratios = [a[1] / b[1] for a, b in zip(t_ours, t_theirs)]
    (syncs_ours, launches_ours), (syncs_theirs, launches_theirs) = ours.counted(), theirs.counted()
    ratio = statistics.median(ratios)
    target = None if clip == "control" else TARGETS["own clip"] if clip == "own clip" else TARGETS[model_name]
    return dict(
        model=model_name,
        optimizer=kind,
        clip=clip,
        pairs=pairs,
        ratio=ratio,
        target=target,
        meets=_meets(ratio, target, clip),
        lossscale_ms=1e3 * statistics.median(t[0] for t in t_ours),
        torch_ms=1e3 * statistics.median(t[0] for t in t_theirs),
        optimizer_side_ratio=statistics.median(tail_ratios),
        optimizer_side_ms=dict(
            lossscale=1e3 * statistics.median(t[1] for t in t_ours),
            torch=1e3 * statistics.median(t[1] for t in t_theirs),
        ),
        syncs=dict(lossscale=syncs_ours, torch=syncs_theirs),
        launches=dict(lossscale=launches_ours, torch=launches_theirs),
    )


def _meets(ratio: float, target, clip: str):
    """Whether ``ratio`` meets ``target`` (the own clip must beat torch's recipe); None for a control row."""
    if target is None:
        return None
    return ratio < target if clip == "own clip" else ratio <= target


def repeated_row(model_name: str, kind: str, clip: str, pairs: int, quick: bool, runs: int):
    """:func:`row` ``runs`` times, each with fresh twin models, built in alternating order: a run's ratio
    moves by a few percent with where its models' memory lands, more than its pairs' median moves; the
    runs show by how much.
    The row's ratio and times are the medians over the runs."""
    results = [row(model_name, kind, clip, pairs, quick, ours_first=run % 2 == 0) for run in range(runs)]
    middle = sorted(results, key=lambda r: r["ratio"])[(runs - 1) // 2]  # the median run (lower median)
    ratio = statistics.median(r["ratio"] for r in results)
    return dict(
        middle,
        runs=runs,
        ratio=ratio,
        run_ratios=[r["ratio"] for r in results],
        meets=_meets(ratio, middle["target"], clip),
        lossscale_ms=statistics.median(r["lossscale_ms"] for r in results),
        torch_ms=statistics.median(r["torch_ms"] for r in results),
    )


def table(rows) -> str:
    out = [
        "| model | optimizer | clip | ratio | runs' range | target | lossscale ms | torch ms | optimizer side: "
        "ratio, ms (ls/torch) | syncs (ls/torch) | launches (ls/torch) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mark = " **missed**" if r["meets"] is False else ""
        target = "-" if r["target"] is None else f"{'<' if r['clip'] == 'own clip' else '<='} {r['target']}"
        side = r["optimizer_side_ms"]
        out.append(
            f"| {r['model']} | {r['optimizer']} | {r['clip']} | {r['ratio']:.3f}{mark} | "
            f"{min(r['run_ratios']):.3f}-{max(r['run_ratios']):.3f} | "
            f"{target} | {r['lossscale_ms']:.2f} | "
            f"{r['torch_ms']:.2f} | {r['optimizer_side_ratio']:.3f}: {side['lossscale']:.2f}/{side['torch']:.2f} | "
            f"{r['syncs']['lossscale']}/{r['syncs']['torch']} | "
            f"{r['launches']['lossscale']}/{r['launches']['torch']} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models and a few pairs (a smoke run)")
    parser.add_argument("--pairs", type=int, default=None, help="pairs per row (default 12 GPT-2, 60 MLP)")
    parser.add_argument("--models", nargs="*", default=["gpt2", "mlp"], choices=["gpt2", "mlp"])
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="independent runs per row (fresh twin models each); the row's ratio "
        "is the median of the runs' ratios, and the table shows their range",
    )
    parser.add_argument(
        "--control", action="store_true", help="also a control row per optimizer: torch's scaler on both sides"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    torch.set_num_threads(args.threads)
    rows = []
    if "gpt2" in args.models and importlib.util.find_spec("transformers") is None:
        print("bench_iteration: transformers is not installed here: the GPT-2 rows are left out", flush=True)
        args.models = [m for m in args.models if m != "gpt2"]
    for model_name in args.models:
        pairs = args.pairs or (3 if args.quick else 12 if model_name == "gpt2" else 60)
        for kind in OPTIMIZERS:
            for clip in CLIPS + (("control",) if args.control else ()):
                r = repeated_row(model_name, kind, clip, pairs, args.quick, args.runs)
                rows.append(r)
                print(
                    f"{model_name:5s} {kind:13s} {clip:12s} ratio {r['ratio']:.3f} "
                    f"(runs {', '.join(f'{x:.3f}' for x in r['run_ratios'])}; "
                    f"{r['lossscale_ms']:.1f} vs {r['torch_ms']:.1f} ms)",
                    flush=True,
                )
    name = (
        ("bench_iteration_quick" if args.quick else "bench_iteration")
        + ("" if set(args.models) == {"gpt2", "mlp"} else "_" + "_".join(args.models))
        + ("" if DEVICE.type == "cpu" else "_" + DEVICE.type)
    )
    command = "python benchmarks/bench_iteration.py " + " ".join(argv if argv is not None else sys.argv[1:])
    os.makedirs(args.out, exist_ok=True)
    meta = dict(
        torch=torch.__version__,
        python=platform.python_version(),
        threads=args.threads,
        machine=platform.machine(),
        device=str(DEVICE),
        date=time.strftime("%Y-%m-%d"),
        gpu=torch.cuda.get_device_name() if DEVICE.type == "cuda" else None,
        command=command,
    )
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    text = table(rows)
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(
            f"# bench_iteration ({meta['date']}, torch {meta['torch']}, {meta['gpu'] or 'CPU'}, {args.threads} "
            f"thread)\n\n`{command}`\n\n{text}\n"
        )
    print(text)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
