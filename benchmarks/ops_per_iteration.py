"""The torch operations and host syncs of one steady-state iteration, per loop: a count, not a time.

Run it against two source trees to show that a change adds no tensor operation and no sync to a loop
(the opt-in features off: their cost when off must be nothing). Counting is deterministic, so it can be
done on a loaded machine::

    git archive <base commit> src | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base/src python benchmarks/ops_per_iteration.py > /tmp/base.json
    python benchmarks/ops_per_iteration.py > /tmp/this.json
    python benchmarks/ops_per_iteration.py --compare /tmp/base.json /tmp/this.json

Each loop is a tiny MLP under CPU FP16 autocast (the CPU stands for the device: ``tests/_sync``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import lossscale  # noqa: E402
from _sync import count_device_work  # noqa: E402

#: loop name -> (optimizer, GradScaler keywords ("trace": model= and trace=True), clip, micro-batches)
LOOPS = {
    "SGD momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {}, False, 1),
    "AdamW fused, scaler.clip_grad_norm_": (lambda ps: torch.optim.AdamW(ps, fused=True), {}, True, 1),
    "AdamW foreach, trace=True": (lambda ps: torch.optim.AdamW(ps, foreach=True), "trace", False, 1),
    "SGD, bad_microbatch='drop', 3 micro-batches": (lambda ps: torch.optim.SGD(ps, lr=0.1),
                                                    {"bad_microbatch": "drop"}, False, 3),
}


def _iteration(model, opt, scaler, clip: bool, micro: int) -> None:
    opt.zero_grad()
    for k in range(micro):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(k))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().square().mean() / micro
        scaler.scale(loss).backward()
    if clip:
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()


def count() -> dict:
    torch.set_num_threads(1)
    out = {"lossscale": os.path.dirname(lossscale.__file__)}
    for name, (make, keywords, clip, micro) in LOOPS.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        opt = make(model.parameters())
        scaler = lossscale.GradScaler(**(dict(model=model, trace=True) if keywords == "trace" else keywords))
        for _ in range(3):  # past the first steps' one-time work
            _iteration(model, opt, scaler, clip, micro)
        with count_device_work() as work:
            _iteration(model, opt, scaler, clip, micro)
        out[name] = {"ops": [call[0] for call in work._calls], "syncs": work.syncs}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compare", nargs=2, metavar=("BASE", "THIS"), help="two outputs of this script")
    args = parser.parse_args(argv)
    if not args.compare:
        print(json.dumps(count()))
        return 0
    base, this = (json.load(open(path)) for path in args.compare)
    same = True
    for name in LOOPS:
        a, b = base[name], this[name]
        equal = a == b
        same &= equal
        print(f"{name}: ops {len(a['ops'])} -> {len(b['ops'])}, syncs {a['syncs']} -> {b['syncs']}, "
              f"{'identical' if equal else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
