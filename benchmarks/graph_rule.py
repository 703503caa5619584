"""Each policy's tensor rule replayed from one CUDA graph: the measurement issue 22's open budgets wait for.

In eager mode every decision of a tensor rule is a kernel launch, so three of issue 22's launch budgets
are out of reach on the fused-optimizer path (fused Adam, launches per clean iteration, torch's 12):
adaptive 53 and LogMax 61 (budget 28), ``hysteresis=2`` 23 (budget 20). Capturing the rule once in a
CUDA graph and replaying it would make it one graph launch, plus one copy per input into the graph's
static buffers. The library can (``lossscale._device.GraphedCall``, used by ``TensorState.run_rule``),
but only where the environment sets ``LOSSSCALE_GRAPHED_RULES=1``: no GPU has verified it. This
script is the measurement that decides whether it should be on, run on the first GPU a session is lent
(``benchmarks/gpu_check.py`` runs it as its ``graph_rule`` step)::

    PYTHONPATH=src python benchmarks/graph_rule.py --out DIR     # a CUDA device: the measurement
    python benchmarks/graph_rule.py --twin --quick --out DIR     # CPU: the plumbing only (CI)

For each policy configuration in :data:`CONFIGS`:

1. ``agree``: the same random iterations (clean, inf, NaN and bad-loss steps; amax over many binades,
   zero, inf and NaN) through the eager rule on one device state and the replayed graph on another,
   started from the same state; the two state buffers must be ``torch.equal`` after every iteration.
   ``events`` counts the scale moves and skips the run went through, so a run that never moved the
   scale shows.
2. ``launches``: per update, eager against replay, as the CUDA profiler records the runtime calls
   (``cudaLaunchKernel``, ``cudaGraphLaunch``, ``cudaMemcpyAsync``, ...), and the eager launches as
   ``lossscale._sync.count_device_work`` counts them (what the budget tests count).
3. ``host_us``: the host time per update (median), eager against replay.

Counted launches (``count_device_work``, the budget tests' counter) see torch operators; a graph's
replay is not one, and ``GraphedCall`` reports its one ``cudaGraphLaunch`` to the counter (the twin
does the same, its rule's operators out of the counter's sight). The profiler's runtime calls are the
figures to judge by.

Then ``iteration``: one clean fused-Adam iteration of ``lossscale.GradScaler`` (``tests/_iterations.py``,
as the budget tests run it), with the scaler's device rule as it is and with the rule replayed from a
graph (the library's switch on), beside torch's ``GradScaler``, counted by the profiler's runtime
calls; and the same ten iterations (two with a NaN batch) through both scalers must leave the same
state and bitwise the same weights. Every replay here is the library's own: ``TensorState.run_rule``
with the switch on (:func:`replayed_rules`), as ``GradScaler.update()`` runs it.

The twin (``--twin``, any device; ``tests/_fake_cuda.TwinGraphedCall``): no CUDA graph; its "replay"
copies the inputs into the static buffers and calls the rule on them. It checks this script's plumbing
(static buffers, states, the agreement loop), not graph replay: its verdicts are not a result.
Results: ``graph_rule.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import statistics
import sys
import time
import warnings
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (os.path.join(ROOT, "src"), os.path.join(ROOT, "tests")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import lossscale  # noqa: E402
from lossscale import AdaptivePolicy, DynamicPolicy, LogMaxPolicy, StaticPolicy  # noqa: E402
from lossscale._state import TensorState  # noqa: E402
from lossscale._sync import count_device_work  # noqa: E402
from lossscale.policy import FLAG_LAYOUT  # noqa: E402
from _fake_cuda import twin_graphed_rules  # noqa: E402

def _quietly(make, **kwargs):
    """``make(**kwargs)`` without its warning (a backoff off the powers of two rounds every backoff: wanted here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make(**kwargs)


#: (name, policy, GradScaler keywords for the iteration row or None). Short growth intervals, so a run
#: of a few hundred iterations grows, backs off, refills and (adaptive) closes windows many times.
CONFIGS: List[Tuple[str, Any, Optional[dict]]] = [
    ("dynamic", DynamicPolicy(growth_interval=7), {}),
    ("dynamic hysteresis=2", DynamicPolicy(growth_interval=7, hysteresis=2), dict(hysteresis=2)),
    ("dynamic hysteresis=3 consecutive", DynamicPolicy(growth_interval=5, hysteresis=3, consecutive_hysteresis=True),
     None),
    ("static", StaticPolicy(scale=2.0**12), None),
    ("adaptive", AdaptivePolicy(growth_interval=6), dict(policy="adaptive")),
    ("adaptive hysteresis=2, backoff 0.7",
     _quietly(AdaptivePolicy, growth_interval=4, hysteresis=2, backoff_factor=0.7), None),
    ("logmax", LogMaxPolicy(), dict(policy="logmax")),
]

#: The CUDA runtime calls that put work on a stream (the profiler's names for them).
RUNTIME_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                    "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")


# ------------------------------------------------------------------------------------ the inputs
def flag_vector(overflow: bool, nan: bool, bad_loss: bool) -> torch.Tensor:
    """The flags as the scaler's check lays them out (``FLAG_LAYOUT``, float32 0/1) from their sources
    ``(1, overflow, nan, bad_loss, overflow and not a bad loss, clean)``."""
    sources = [1.0, overflow, nan, bad_loss, overflow and not bad_loss, not overflow]
    return torch.tensor([float(sources[i]) for i in FLAG_LAYOUT], dtype=torch.float32)


def random_iterations(policy, n: int, seed: int) -> List[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """``n`` iterations as the scaler's check hands them to a tensor rule (host tensors): the flag
    vector (``FLAG_LAYOUT``) and, for a policy that measures, the scaled amax. About 70% clean, 12% inf,
    8% NaN, 10% a bad loss (LogMax: a tenth of those overflows, or its variance pins the scale at
    ``min_scale`` and the run never moves it). A clean amax wanders: its binade takes a random walk
    over 2**-40..2**15 (a step of one binade a third of the time, a jump of up to 12 one time in
    fifty), and it is 0 one time in twenty. An overflow's amax is inf or NaN, a bad loss's finite:
    as the check makes them."""
    rng = random.Random(seed)
    binade = -10
    overflows = 0.03 if isinstance(policy, LogMaxPolicy) else 0.3  # the share of inf, NaN and bad-loss steps
    out = []
    for _ in range(n):
        r = rng.random() / overflows  # below 1: an overflow, split 12 : 8 : 10 as inf, NaN, bad loss
        kind = "inf" if r < 0.4 else "nan" if r < 2 / 3 else "bad" if r < 1 else "clean"
        flags = flag_vector(overflow=kind != "clean", nan=kind == "nan", bad_loss=kind == "bad")
        amax = None
        if policy.needs_amax:
            step = rng.randint(-12, 12) if rng.random() < 0.02 else rng.choice([-1, 0, 0, 0, 0, 1])
            binade = max(-40, min(15, binade + step))
            finite = math.ldexp(rng.uniform(0.5, 1.0), binade)
            zero = rng.random() < 0.05
            value = {"clean": 0.0 if zero else finite, "inf": math.inf, "nan": math.nan}.get(kind, finite)
            amax = torch.tensor(value, dtype=torch.float32)
        out.append((flags, amax))
    return out


def _on(device, flags, amax):
    return flags.to(device), None if amax is None else amax.to(device)


# ------------------------------------------------------------------------------------ the measures
def agreement(policy, twin: bool, device: torch.device, n: int, seed: int = 0,
              replay_policy=None) -> Dict[str, Any]:
    """The eager rule on one state, the library's replay (``TensorState.run_rule`` with the switch on,
    :func:`replayed_rules`) on another, the same ``n`` iterations: equal after each? ``replay_policy``:
    what the replay runs, when it is not ``policy`` (a check that this loop can fail)."""
    with replayed_rules(twin):  # the eager side calls the rule itself: the switch does not reach it
        return _agreement(policy, replay_policy or policy, device, n, seed)


def _agreement(policy, replay_policy, device: torch.device, n: int, seed: int) -> Dict[str, Any]:
    start = policy.init_state()
    eager, replayed = TensorState(start, device), TensorState(start, device)
    inputs = [_on(device, f, a) for f, a in random_iterations(policy, n, seed)]
    scale, moves = start.scale, 0
    for i, (flags, amax) in enumerate(inputs):
        policy.tensor_update(eager, flags, amax)
        replayed.run_rule(replay_policy, flags, amax)  # the first call captures: its warm-up must not show
        if not torch.equal(eager.buffer, replayed.buffer):
            return {"agree": False, "iterations": i + 1, "first_difference": i,
                    "eager": repr(eager.to_state()), "replayed": repr(replayed.to_state())}
        now = float(eager.scale)  # a sync per iteration: this is a correctness run, not a timed one
        moves, scale = moves + (now != scale), now
    final = eager.to_state()
    return {"agree": True, "iterations": n,
            "events": {"scale moves": moves, "skipped": final.skipped_steps, "nan": final.nan_steps,
                       "bad loss": final.bad_loss_steps}}


@contextlib.contextmanager
def runtime_calls(tally: Counter):
    """Add the CUDA runtime calls that queue work (:data:`RUNTIME_LAUNCHES`) made inside the block to ``tally``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield
        torch.cuda.synchronize()
    tally.update(e.name for e in prof.events() if e.name in RUNTIME_LAUNCHES)


def per_update(policy, twin: bool, device: torch.device, real_gpu: bool, repeats: int) -> Dict[str, Any]:
    """Launches and host time of one update, eager and replayed (a clean iteration's inputs)."""
    with replayed_rules(twin):
        return _per_update(policy, device, real_gpu, repeats)


def _per_update(policy, device: torch.device, real_gpu: bool, repeats: int) -> Dict[str, Any]:
    flags = flag_vector(overflow=False, nan=False, bad_loss=False).to(device)
    amax = torch.tensor(2.0**-3, dtype=torch.float32, device=device) if policy.needs_amax else None
    eager_t, replay_t = TensorState(policy.init_state(), device), TensorState(policy.init_state(), device)
    eager = lambda: policy.tensor_update(eager_t, flags, amax)  # noqa: E731
    replayed = lambda: replay_t.run_rule(policy, flags, amax)  # noqa: E731
    replayed()  # the first call captures
    out: Dict[str, Any] = {}
    eager()  # the first call makes the state's constants (TensorState.constant): not counted
    with count_device_work() as work:
        eager()
    out["eager_counted"] = work.launches
    if real_gpu:
        for name, fn in (("eager", eager), ("replay", replayed)):
            tally: Counter = Counter()
            with runtime_calls(tally):
                for _ in range(10):
                    fn()
            out[f"{name}_runtime_calls"] = {k: v / 10 for k, v in sorted(tally.items())}
    for name, fn in (("eager", eager), ("replay", replayed)):
        out[f"{name}_host_us"] = round(host_time(fn, device, repeats) * 1e6, 1)
    return out


def host_time(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median seconds of host time per call (the queue is drained every 20 calls, outside the timing)."""
    times = []
    for i in range(repeats):
        if i % 20 == 0 and device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[repeats // 10:])


# ------------------------------------------------------------------------------------ the iteration
@contextlib.contextmanager
def replayed_rules(twin: bool):
    """Within the block, tensor rules are replayed (``TensorState.run_rule``, as in
    ``GradScaler.update()``): on a GPU through the library's switch (``LOSSSCALE_GRAPHED_RULES=1``), in
    the twin through ``tests/_fake_cuda.twin_graphed_rules``."""
    if twin:
        with twin_graphed_rules():
            yield
        return
    before = os.environ.get("LOSSSCALE_GRAPHED_RULES")
    os.environ["LOSSSCALE_GRAPHED_RULES"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["LOSSSCALE_GRAPHED_RULES"]
        else:
            os.environ["LOSSSCALE_GRAPHED_RULES"] = before


def iteration_row(kwargs: dict, twin: bool, device: torch.device, real_gpu: bool) -> Dict[str, Any]:
    """One clean fused-Adam iteration, eager and replayed, beside torch's; and ten iterations (two
    with a NaN batch) through both scalers: the same state, bitwise the same weights."""
    from _iterations import make_iteration

    out: Dict[str, Any] = {}
    its = {"torch": make_iteration("torch", "fused_adam", device=str(device)),
           "eager": make_iteration("lossscale", "fused_adam", device=str(device), **kwargs),
           "replay": make_iteration("lossscale", "fused_adam", device=str(device), **kwargs)}
    for side, it in its.items():
        with replayed_rules(twin) if side == "replay" else contextlib.nullcontext():
            for step in range(10):
                it.run(bad="nan" if step in (3, 7) else None)
            work = it.counted()  # a replay counts as one launch (GraphedCall reports it to the counter)
            out[f"{side}_counted"] = work.launches
            if real_gpu:
                tally: Counter = Counter()
                it.counted(watch=lambda: runtime_calls(tally))
                out[f"{side}_runtime_calls"] = sum(tally.values())
    eager, replay = its["eager"], its["replay"]
    same_weights = all(torch.equal(a, b) for a, b in zip(eager.model.parameters(), replay.model.parameters()))
    out["same_state"] = eager.scaler.state() == replay.scaler.state()
    out["same_weights"] = same_weights
    out["skipped"] = eager.scaler.state().skipped_steps
    return out


# ------------------------------------------------------------------------------------ the run
def run(device: torch.device, twin: bool, quick: bool, out_dir: Optional[str]) -> Dict[str, Any]:
    """Every measurement; returns (and writes, where ``out_dir``) the results."""
    real_gpu = device.type == "cuda" and not twin and torch.cuda.is_available()
    n, repeats = (60, 40) if quick else (600, 400)
    results: Dict[str, Any] = {
        "meta": {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__, "device": str(device),
                 "twin": twin, "quick": quick, "iterations": n, "lossscale": lossscale.__version__},
        "policies": {}, "iterations": {}}
    start = time.time()
    for name, policy, kwargs in CONFIGS:
        row: Dict[str, Any] = {}
        for key, fn in (("agree", lambda: agreement(policy, twin, device, n)),
                        ("update", lambda: per_update(policy, twin, device, real_gpu, repeats))):
            try:
                row[key] = fn()
            except Exception as e:  # a failure is a result: the next configuration still runs
                row[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
        results["policies"][name] = row
        if kwargs is not None:
            try:
                results["iterations"][name] = iteration_row(kwargs, twin, device, real_gpu)
            except Exception as e:
                results["iterations"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    results["meta"]["wall_s"] = round(time.time() - start, 1)
    results["ok"] = verdict(results)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "graph_rule.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    return results


def verdict(results: Dict[str, Any]) -> bool:
    """Every agreement held and every iteration pair matched (errors count as failures)."""
    ok = all(r.get("agree", {}).get("agree") is True and "error" not in r.get("update", {})
             for r in results["policies"].values())
    return ok and all(r.get("same_state") is True and r.get("same_weights") is True
                      for r in results["iterations"].values())


def summary(results: Dict[str, Any]) -> str:
    """One screen."""
    meta = results["meta"]
    lines = [f"graph_rule on {meta['device']}{' (twin: plumbing only)' if meta['twin'] else ''}, "
             f"{meta['iterations']} iterations per policy, {meta['wall_s']} s: {'OK' if results['ok'] else 'FAILED'}"]
    lines.append("  policy                                agree  counted  runtime eager -> replay"
                 "   host us eager -> replay")
    for name, r in results["policies"].items():
        a, u = r.get("agree", {}), r.get("update", {})
        calls = {k: sum(u.get(f"{k}_runtime_calls", {}).values()) for k in ("eager", "replay")
                 if f"{k}_runtime_calls" in u}
        runtime = f"{calls['eager']:g} -> {calls['replay']:g}" if len(calls) == 2 else "-"
        agree = a.get("agree") if "error" not in a else "error"
        lines.append(f"  {name:<37} {str(agree):<6} {u.get('eager_counted', '-')!s:>7}  {runtime:>22}   "
                     f"{u.get('eager_host_us', '-')} -> {u.get('replay_host_us', '-')}"
                     + (f"  {a.get('error') or u.get('error')}" if "error" in a or "error" in u else ""))
    for name, r in results["iterations"].items():
        if "error" in r:
            lines.append(f"  iteration, {name}: {r['error']}")
            continue
        runtime = (f", runtime calls eager {r['eager_runtime_calls']} replay {r['replay_runtime_calls']} "
                   f"torch {r['torch_runtime_calls']}" if "torch_runtime_calls" in r else "")
        lines.append(f"  iteration, fused Adam, {name}: counted eager {r['eager_counted']} "
                     f"replay {r['replay_counted']} torch {r['torch_counted']}{runtime}; same state "
                     f"{r['same_state']}, same weights {r['same_weights']} ({r['skipped']} skipped)")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Parse the arguments, run, print the summary; 1 when an agreement failed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="where graph_rule.json goes (default: not written)")
    ap.add_argument("--twin", action="store_true", help="no CUDA graph: the plumbing, on any device")
    ap.add_argument("--device", default=None, help="default: cuda when available (else the twin on cpu)")
    ap.add_argument("--quick", action="store_true", help="60 iterations per policy, 40 timed calls")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    twin = args.twin or device.type != "cuda"
    results = run(device, twin, args.quick, args.out)
    print(summary(results))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
