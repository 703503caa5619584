"""What one README-loop iteration runs, counted (deterministic: fine to run on a loaded machine).

    python benchmarks/count_iteration.py            # prints a table; --json for the raw figures
    python benchmarks/count_iteration.py --src DIR  # count another checkout's src/ (e.g. an older commit)

The loop is the README's: ``scale(loss).backward()``, ``unscale_(opt)``, ``clip_grad_norm_``,
``step(opt)``, ``update()``, on a small MLP under FP16 autocast with ``lossscale.GradScaler()`` at its
defaults, for SGD (momentum) and AdamW(fused=True). Per iteration it reports:

* **functions / files**: the distinct lossscale functions (file, name) one iteration calls, traced
  with ``sys.setprofile`` (lambdas and nested functions included; comprehensions apart, since Python
  3.12 inlines them), and the files they live in; at steady state (iteration 60) and while warming
  up (iteration 2: the bf16 hint, the health account's calibration);
* **tensor ops**: the tensor operations (kernel launches, as ``tests/_sync.count_device_work``
  models a device; the CPU stands for it) of the scaler-and-optimizer part (unscale, clip, step,
  update), lossscale's against ``torch.amp.GradScaler``'s recipe on a twin model;
* **lines**: physical and code lines (no docstrings, comments, blank lines) of the scaler's own
  modules (:data:`CORE`; the ones present in the checkout counted).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

#: The scaler's own modules: the iteration's path, the state, the policies, the checkpoint, health.
CORE = (
    "scaler",
    "_check",
    "_state",
    "_features",
    "_keywords",
    "_validate",
    "_names",
    "_hints",
    "_warnings",
    "_overflow",
    "checkpoint",
    "policy",
    "dynamic",
    "static",
    "adaptive",
    "logmax",
    "hysteresis",
    "health",
    "_health_text",
    "diagnosis",
)


def _loop(kind: str, scaler_cls):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if kind == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    )
    scaler = scaler_cls() if scaler_cls.__module__.startswith("lossscale") else scaler_cls("cpu")
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))

    def forward_backward():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()

    def optimizer_side():
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()

    return forward_backward, optimizer_side


def functions(kind: str, warm_iterations: int):
    """``(functions, files)`` of lossscale one iteration runs after ``warm_iterations`` iterations."""
    import lossscale

    root = os.path.dirname(lossscale.__file__)
    fb, side = _loop(kind, lossscale.GradScaler)
    for _ in range(warm_iterations):
        fb()
        side()
    calls = set()

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(root) and not code.co_name.endswith("comp>"):
            calls.add((os.path.relpath(code.co_filename, root), code.co_name))

    sys.setprofile(profile)
    try:
        fb()
        side()
    finally:
        sys.setprofile(None)
    return sorted(calls), sorted({f for f, _ in calls})


def tensor_ops(kind: str):
    """Tensor operations of the optimizer side (unscale, clip, step, update) at steady state:
    ``{"lossscale": n, "torch": n}``."""
    import torch
    from _sync import count_device_work

    import lossscale

    out = {}
    for name, cls in (("lossscale", lossscale.GradScaler), ("torch", torch.amp.GradScaler)):
        fb, side = _loop(kind, cls)
        for _ in range(59):
            fb()
            side()
        fb()
        with count_device_work() as work:
            side()
        out[name] = work.launches
    return out


def lines(src: str):
    """``{module: (physical lines, code lines)}`` of the :data:`CORE` modules present under ``src``."""
    out = {}
    for name in CORE:
        path = os.path.join(src, "lossscale", f"{name}.py")
        if not os.path.exists(path):
            continue
        text = open(path, encoding="utf-8").read()
        docs = set()
        for node in ast.walk(ast.parse(text)):
            body = getattr(node, "body", None)
            if (
                isinstance(body, list)
                and body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                docs.update(range(body[0].lineno, body[0].end_lineno + 1))
        code = sum(
            1
            for i, line in enumerate(text.splitlines(), 1)
            if line.strip() and not line.strip().startswith("#") and i not in docs
        )
        out[name] = (len(text.splitlines()), code)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", default=os.path.join(HERE, "..", "src"), help="the src/ directory to count")
    parser.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.src))
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the launch counter (a test instrument)
    import warnings

    import torch

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    result = {"functions": {}, "tensor_ops": {}, "lines": lines(os.path.abspath(args.src))}
    for kind in ("sgd", "fused_adamw"):
        for phase, warm in (("steady", 59), ("warm-up", 1)):
            calls, files = functions(kind, warm)
            result["functions"][f"{kind} {phase}"] = {"functions": len(calls), "files": files, "calls": calls}
        result["tensor_ops"][kind] = tensor_ops(kind)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    import lossscale

    print(f"counted: {os.path.dirname(lossscale.__file__)}")
    for key, r in result["functions"].items():
        print(f"{key:20s} {r['functions']:3d} functions in {len(r['files'])} files: {', '.join(r['files'])}")
    for kind, r in result["tensor_ops"].items():
        print(f"{kind:20s} tensor ops (unscale, clip, step, update): lossscale {r['lossscale']}, torch {r['torch']}")
    physical = sum(p for p, _ in result["lines"].values())
    code = sum(c for _, c in result["lines"].values())
    print(f"core modules ({len(result['lines'])}): {physical} lines, {code} code lines")
    for name, (p, c) in result["lines"].items():
        print(f"  {name:14s} {p:5d} {c:5d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
