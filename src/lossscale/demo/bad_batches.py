"""Bad batches: a NaN loss is not the loss scale's fault, so it should not cost the scale.

A fraction of the batches (``frac``, picked per seed) each carry one corrupt example, its input row
set to NaN, so the step's loss is NaN before any scaling. Three runs on the main runs' data, model
init and batch order, under the same shift and FP16 autocast, with both scalers as shipped:

============= =======================================================================================
bad_clean     ``lossscale.GradScaler(model=model, trace=True)``, no corrupt batch: the reference
bad_torch     ``torch.amp.GradScaler("cpu")``, the corrupt batches: it halves the scale on every one
bad_lossscale ``lossscale.GradScaler(model=model, trace=True)``, the same batches: skipped, scale kept
============= =======================================================================================

Both scalers skip the corrupt steps (their gradients are NaN); the runs differ only in the scale the
other steps run with. Under the demo's shift a scale halved often enough drops the gradients off
FP16's underflow cliff, and training stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence

import torch

from ..scaler import GradScaler
from .workload import RunResult, RunSpec

__all__ = ["BadBatches", "pick_bad_steps", "plan", "figures", "NAMES"]

#: The runs of this section, in the order they are trained and shown.
NAMES = ("bad_clean", "bad_torch", "bad_lossscale")


@dataclass
class BadBatches:
    """What the section measured: its runs (keyed by :data:`NAMES`), its :func:`figures`, its settings."""

    runs: Dict[str, RunResult]
    figures: Dict[str, Any]
    epochs: int
    frac: float
    wall_s: float = 0.0


def pick_bad_steps(n_steps: int, frac: float, seed: int) -> List[int]:
    """``round(frac * n_steps)`` distinct steps out of ``range(n_steps)``, sorted; the same for the same seed.

    Raises:
        ValueError: ``frac`` is not in [0, 1].
    """
    if not 0.0 <= frac <= 1.0:
        raise ValueError(f"frac={frac!r} must be in [0, 1] (the share of batches to corrupt).")
    k = round(frac * n_steps)
    gen = torch.Generator().manual_seed(10_007 + seed)  # not the batch-order stream: its own
    return sorted(torch.randperm(n_steps, generator=gen)[:k].tolist())


def _traced(model: torch.nn.Module) -> GradScaler:
    # As shipped (loss_check=True by default), plus trace=True for the diagnosis. on_stuck="ignore":
    # a streak of bad batches would warn; the section reports the streak itself.
    return GradScaler("cpu", model=model, trace=True, on_stuck="ignore")


def _torch(model: torch.nn.Module) -> Any:
    return torch.amp.GradScaler("cpu")


def plan(bad_steps: Sequence[int], epochs: int) -> List[RunSpec]:
    """The three runs (see the module doc), ``epochs`` each."""
    return [
        RunSpec("bad_clean", "no bad batch, lossscale (clean)", make_scaler=_traced, epochs=epochs, diagnose=True),
        RunSpec(
            "bad_torch", "bad batches, torch.amp.GradScaler()", make_scaler=_torch, epochs=epochs, bad_steps=bad_steps
        ),
        RunSpec(
            "bad_lossscale",
            "bad batches, lossscale GradScaler()",
            make_scaler=_traced,
            epochs=epochs,
            bad_steps=bad_steps,
            diagnose=True,
        ),
    ]


def _run_figures(run: RunResult) -> Dict[str, Any]:
    # The scale each step ran with, then the one the last update left.
    scales = run.series("loss_scale") + [run.final_scale]
    return {
        "final_acc": run.final_acc,
        "steps": len(run.steps),
        "skipped_steps": run.skipped_steps,
        "first_scale": scales[0],
        "final_scale": run.final_scale,
        "min_scale": min(scales),
        "max_scale": max(scales),
        "backoffs": sum(1 for a, b in zip(scales, scales[1:]) if b < a),
        "bad_loss_steps": run.counters.get("bad_loss_steps"),  # lossscale's own count; torch has none
    }


def figures(runs: Dict[str, RunResult], bad_steps: Sequence[int]) -> Dict[str, Any]:
    """Every figure the section and ``summary.json`` show, measured from the three runs."""
    clean, ls = runs["bad_clean"], runs["bad_lossscale"]
    first = next((s for s in ls.steps if s.get("injected")), None)
    causes: Dict[str, int] = {}
    for s in ls.steps:
        if "diagnosis" in s:
            causes[s["diagnosis"]["cause"]] = causes.get(s["diagnosis"]["cause"], 0) + 1
    return {
        "n_steps": len(ls.steps),
        "bad_steps": list(bad_steps),
        "n_bad": len(bad_steps),
        "runs": {n: _run_figures(runs[n]) for n in NAMES},
        # Which steps each run skipped, to hold against bad_steps.
        "skipped_steps": {n: [s["step"] for s in runs[n].steps if s["skipped"]] for n in NAMES},
        # lossscale's scale, step by step, against the clean run's.
        "lossscale_steps_off_clean_scale": sum(
            1 for a, b in zip(ls.series("loss_scale"), clean.series("loss_scale")) if a != b
        )
        + (ls.final_scale != clean.final_scale),
        "first_bad_step": None if first is None else first["step"],
        "first_diagnosis": None if first is None else first.get("diagnosis"),
        "causes": causes,  # overflow_report()["cause"] of every skipped step, counted
    }
