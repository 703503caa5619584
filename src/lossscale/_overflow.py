"""Why a step was skipped: the first-cause report (``GradScaler.overflow_report``) from one iteration's evidence.

The scaler keeps, for every iteration that may have been skipped, what the report needs as device
tensors (no sync while training): the losses, the trace's snapshot and the per-parameter amax vectors.
:func:`report` reads them (it syncs), names what held inf and NaN, and says in one line whether the
scale or the model and data were the cause."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional

import torch

from . import formats

__all__ = ["NOT_SKIPPED", "report", "explain", "names_of"]

#: The report of a step that was not skipped.
NOT_SKIPPED = {
    "inf": [],
    "nan": [],
    "loss": "finite",
    "forward": None,
    "backward": None,
    "scale": None,
    "spike": False,
    "upcast": None,
    "cause": "the last step was not skipped.",
}


def names_of(values: List[float], params: List[torch.Tensor], name_of: Callable) -> Dict[str, List[str]]:
    """``{"inf": [...], "nan": [...]}``: the parameters whose value is inf / NaN."""
    inf, nan = [], []
    for p, v in zip(params, values):
        name = name_of(p) or f"param {tuple(p.shape)}"
        if math.isnan(v):
            nan.append(name)
        elif math.isinf(v):
            inf.append(name)
    return {"inf": inf, "nan": nan}


def report(
    evidence: Dict[str, Any], name_of: Callable, tracer, scale: Optional[float], floor: Optional[float] = None
) -> Dict[str, Any]:
    """The report dict (see ``GradScaler.overflow_report``) from one iteration's ``evidence``; ``scale``:
    the scale the step ran with where the evidence does not hold it; ``floor``: the policy's lowest
    scale (None: none). Syncs host and device."""
    out = dict(NOT_SKIPPED, inf=[], nan=[])
    for params, vectors in evidence.get("source") or []:
        values = torch.cat([v.cpu() for v in vectors]).tolist() if vectors else []
        for key, names in names_of(values, params, name_of).items():
            out[key].extend(names)
    losses = evidence.get("losses") or []  # the losses alone (bad_loss also holds the trace's forward flag)
    if any(not bool(torch.isfinite(x).all()) for x in losses):
        out["loss"] = "nan" if any(bool(torch.isnan(x).any()) for x in losses) else "inf"
    if evidence.get("trace") is not None and tracer is not None:
        out.update(tracer.names_of(evidence["trace"]))
    out["scale"] = evidence["scale"] if evidence.get("scale") is not None else scale
    out["spike"] = any(bool(s.item()) for s in evidence.get("spikes") or [])
    out["upcast"] = evidence.get(
        "upcast"
    )  # on_forward/backward_overflow="upcast" kept this module in FP32 on this step
    out["cause"] = explain(out, floor)
    return out


def explain(rep: Dict[str, Any], floor: Optional[float] = None) -> str:
    """A one-line diagnosis of a skipped step from the report's fields; ``floor``: the policy's lowest
    scale, where the scale cannot back off (None: none)."""
    kind = "NaN" if rep["nan"] or rep["loss"] == "nan" else "inf"
    scale = "?" if rep["scale"] is None else formats.pow2_label(rep["scale"])
    at_floor = floor is not None and rep["scale"] is not None and rep["scale"] <= formats.f32(floor)
    answer = (
        "the loss scale, at its floor (min_scale): it cannot back off" if at_floor else "the loss scale (backed off)"
    )
    if rep.get("spike") and not (rep["inf"] or rep["nan"]) and rep["loss"] == "finite":
        return (
            "skipped by skip_if: a spike (the gradient norm or the loss far above its recent run; every "
            "value finite), not the loss scale (kept)."
        )
    if rep["forward"] is not None:
        upcast = f" `{rep['upcast']}` now runs in FP32 (on_forward_overflow='upcast')." if rep.get("upcast") else ""
        return (
            f"inf/NaN first appeared in the forward output of `{rep['forward']}` (before any scaling): "
            f"a model or data problem, not the loss scale (kept).{upcast}"
        )
    if rep["loss"] != "finite":
        return (
            f"the loss itself was {rep['loss']} before scaling: a data or model problem (a bad batch, "
            "log of 0, an overflowed fp16 activation), not the loss scale (kept)."
        )
    if rep["backward"] is not None:
        upcast = f" `{rep['upcast']}` now runs in FP32 (on_backward_overflow='upcast')." if rep.get("upcast") else ""
        return f"the backward of `{rep['backward']}` overflowed fp16 at scale {scale}: {answer}.{upcast}"
    where = ", ".join(rep["nan"] + rep["inf"])[:200] or "some gradient"
    return f"{kind} in the gradients ({where}) at scale {scale}: {answer}."
