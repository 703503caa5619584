"""What to tell the user when training is stuck (the policies' ``is_stuck`` says when: ``lossscale.policy``).

Pure Python: the diagnosis is built from the counters alone, no tensors needed.
"""

from __future__ import annotations

import math
from typing import Optional

from .formats import FP16, pow2_label
from .policy import MIN_SCALE, SMALLEST_SCALE, ScaleState

__all__ = ["diagnose", "backward_fixes"]

#: A line of every diagnosis: where the whole run's account is.
#: What a NaN that outlasted the backoff may still be, while the scale is above FP16's smallest subnormal
#: (the diagnosis and the health advice both say it).
MAYBE_BACKWARD_OVERFLOW = (
    "It may be a backward that overflows FP16 at every scale the floor allows (an inf that meets a zero or "
    "an opposite inf becomes NaN)"
)
#: Where a NaN that no scale cures comes from (the diagnosis and the health advice both list them).
NAN_SOURCES = (
    "0/0, log or sqrt of a negative or zero, inf - inf (e.g. an overflowed fp16 activation), NaN already in "
    "the weights or inputs"
)

#: The scaled iterations a scaler watches for FP16 work before it says the run does not train in FP16
#: (lossscale._hints.Fp16Watch): an FP16 run shows it on its first one; a hundred are seconds of a CPU
#: loop and leave no doubt.
NO_FP16_STEPS = 100
#: What the no-FP16 warning and the health report say, and what to do about it.
NO_FP16 = (
    f"in its first {NO_FP16_STEPS} steps this GradScaler saw no FP16 work (no loss scaled under FP16 autocast, "
    "no FP16 loss, activation or parameter in the loss's backward graph), so this run trains in FP32 (or "
    "bf16) while the loss is multiplied by the scale for nothing"
)
NO_FP16_FIX = (
    "For FP16, autocast's device type must be the model's (torch.autocast('cuda') on a machine without CUDA "
    "is disabled): torch.autocast(device_type=x.device.type, dtype=torch.float16), or model.half(). For "
    "FP32 or bf16 no loss scale is needed: GradScaler(enabled=False), or GradScaler.passthrough() to keep "
    "skipping non-finite steps."
)

HEALTH_POINTER = (
    "scaler.health() tells the run's skips apart (the scale calibrating, overflows, bad batches, "
    "persistent NaN) and says whether training is healthy now."
)


def diagnose(policy, state: ScaleState, tracing: bool = False, backward: Optional[str] = None) -> str:
    """A plain-language diagnosis of a stuck run, from the counters alone (no tensors needed).

    ``tracing``: the scaler traces first causes (``trace=True``), so its caller names the module
    and this text does not suggest turning tracing on. ``backward``: the module the trace named as the
    first backward overflow of the step that tripped the check (its forward and its loss finite), if any."""
    streak, nan = state.overflow_streak, state.streak_nan_steps
    lo = policy.scale_bounds()[0]
    if state.streak_bad_loss_steps == streak:
        return (
            f"lossscale: the loss was non-finite before any scaling in {streak} consecutive step(s) "
            f"({nan} with NaN gradients); every one was skipped and the scale kept at {state.scale:g}: the "
            "scale is not the cause (it only multiplies the backward). This is a data or model problem: a "
            "bad batch (NaN/inf inputs or labels), a log or sqrt of zero or a negative, a division by zero, "
            "an fp16 activation that overflowed in the forward, or weights that are already NaN."
            + (
                ""
                if tracing
                else " GradScaler(model=model, trace=True) names the first module whose output was "
                "non-finite (overflow_report()['forward'])."
            )
            + "\n"
            + HEALTH_POINTER
        )
    lines = [
        f"lossscale: {streak} consecutive skipped step(s) ({nan} with NaN, {streak - nan} with inf only); "
        f"the scale went from {state.streak_start_scale:g} to {state.scale:g}"
        + (f" (min_scale={pow2_label(lo)})." if lo is not None else ".")
    ]
    if not (math.isfinite(state.scale) and state.scale >= SMALLEST_SCALE):
        lines.append(
            f"The scale itself is {state.scale:g}, so every step overflows and is skipped (below float32's "
            "smallest normal, 2**-126, 1/scale is inf: a step taken there writes inf or NaN into the weights). "
            "lossscale never sets such a scale (update(new_scale=...) ignores one) unless min_scale=None "
            "(torch's rule, no floor) let the backoff go there, as torch's does; otherwise something wrote it "
            "into the scale tensor (scaler._get_scale_async()). Set a good one with "
            "scaler.update(new_scale=2.0**16) after a step, and keep a floor (the default min_scale=2**-24)."
        )
    elif backward is not None:
        lines.append(
            f"The backward of `{backward}` overflows FP16 (a gradient above 65504) at every scale the floor "
            f"allows, down to {pow2_label(state.scale)}, while its forward and the loss are finite"
            + (": the NaN is the overflow's (an inf that meets a zero or an opposite inf)." if nan else ".")
            + " Fixes: "
            + backward_fixes(lo, state.scale, backward)
        )
    elif nan:
        if streak > 1 and state.streak_start_scale != state.scale:
            fell = state.streak_start_scale / state.scale
            head = f"NaN persisted while the scale fell {fell:g}x, to {pow2_label(state.scale)}."
        else:
            head = f"NaN at the smallest scale the policy allows, {pow2_label(state.scale)}."
        model_or_data = (
            f"comes from the model or data: {NAN_SOURCES}, or a learning rate that diverged. Find it with "
            "torch.autograd.set_detect_anomaly(True)."
        )
        if state.scale > MIN_SCALE:  # it may still be an FP16 backward overflow, which a lower scale fits
            lines.append(
                f"{head} {MAYBE_BACKWARD_OVERFLOW}: "
                + (
                    ""
                    if tracing
                    else "GradScaler(model=model, trace=True) names the first module whose backward "
                    "overflowed (overflow_report()['backward']); "
                )
                + "then "
                + backward_fixes(lo, state.scale)
                + " Otherwise the scale is not the cause: the NaN "
                + model_or_data
            )
        else:
            lines.append(
                f"{head} The scale is not the cause: a smaller scale cures an overflow, and at this scale an "
                f"FP16 backward overflows only past a gradient of {FP16.max / state.scale:.3g}. The NaN "
                + model_or_data
            )
    else:
        lines.append(
            "Gradients overflow even at the smallest scale allowed while the loss is finite: the backward "
            "overflows FP16 (a gradient above 65504) at every scale the floor allows. "
            + (
                ""
                if tracing
                else "GradScaler(model=model, trace=True) names the first module whose backward overflowed "
                "(overflow_report()['backward']). "
            )
            + "Fixes: "
            + backward_fixes(lo, state.scale)
            + " Or lower the learning rate or clip gradients, check the inputs for extreme values, or train "
            "in bf16 (GradScaler.passthrough())."
        )
    lines.append(HEALTH_POINTER)
    lines.append("scaler.overflow_report() names the parameters that held inf and NaN on the last skipped step.")
    return "\n".join(lines)


def backward_fixes(lo: Optional[float], scale: float, name: Optional[str] = None) -> str:
    """What to do about a backward that overflows FP16 at every scale down to ``scale``, the policy's
    lowest being ``lo`` (None: no floor, or a static scale): keep the module in FP32, by the scaler or by
    hand, or a lower scale where one can still carry gradients (down to
    :data:`~lossscale.policy.MIN_SCALE`)."""
    module = f"`{name}`" if name is not None else "the module the trace names"
    by_hand = f'["{name}"]' if name is not None else "[name]"
    fixes = (
        f'keep {module} in FP32: GradScaler(model=model, trace=True, on_backward_overflow="upcast") does '
        f"it when this happens, or lossscale.keep_fp32(model, {by_hand}) before training"
    )
    if scale <= MIN_SCALE:
        fixes += (
            f"; no lower scale helps: below {pow2_label(MIN_SCALE)} (FP16's smallest subnormal) even a "
            "gradient of 1 flushes to zero"
        )
    elif lo is not None and scale <= lo:  # the floor stopped the backoff
        fixes += (
            f"; or lower min_scale (the default {pow2_label(MIN_SCALE)}, FP16's smallest subnormal, or None "
            "as torch) so that the scale can shrink the gradient into FP16's range, as torch's backoff does"
        )
    else:
        fixes += f"; or a scale below {pow2_label(scale)}, which may shrink the gradient into FP16's range"
    return fixes + "."
