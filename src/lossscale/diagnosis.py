"""What to tell the user when training is stuck (the policies' ``is_stuck`` says when: ``lossscale.policy``).

Pure Python: the diagnosis is built from the counters alone, no tensors needed.
"""

from __future__ import annotations

import math

from .policy import ScaleState

__all__ = ["diagnose"]

#: A line of every diagnosis: where the whole run's account is.
HEALTH_POINTER = (
    "scaler.health() tells the run's skips apart (the scale calibrating, overflows, bad batches, "
    "persistent NaN) and says whether training is healthy now."
)


def diagnose(policy, state: ScaleState, tracing: bool = False) -> str:
    """A plain-language diagnosis of a stuck run, from the counters alone (no tensors needed).

    ``tracing``: the scaler traces first causes (``trace=True``), so its caller names the module
    and this text does not suggest turning tracing on."""
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
        + (f" (min_scale={lo:g})." if lo is not None else ".")
    ]
    if not (math.isfinite(state.scale) and state.scale > 0):
        lines.append(
            f"The scale itself is {state.scale:g}, so every step overflows and is skipped. lossscale never "
            "sets such a scale (update(new_scale=...) ignores one); something wrote it into the scale tensor "
            "(scaler._get_scale_async()), or min_scale=None let the backoff reach 0. Set a good one with "
            "scaler.update(new_scale=2.0**16) after a step."
        )
    elif nan and streak > 1 and state.streak_start_scale != state.scale:
        lines.append(
            f"NaN persisted while the scale fell {state.streak_start_scale / state.scale:g}x: the scale is "
            "not the cause (a smaller scale cures inf, never NaN). NaN comes from the model or data: 0/0, "
            "log or sqrt of a negative or zero, inf - inf (e.g. an overflowed fp16 activation), NaN "
            "already in the weights or inputs, or a learning rate that diverged. Find it with "
            "torch.autograd.set_detect_anomaly(True)."
        )
    elif nan:
        lines.append(
            "NaN at the smallest scale the policy allows: lowering the scale cannot cure a NaN. Look for "
            "0/0, log or sqrt of a negative or zero, inf - inf (an overflowed fp16 activation), or NaN "
            "already in the weights or inputs (torch.autograd.set_detect_anomaly(True) finds the op)."
        )
    else:
        lines.append(
            "Gradients overflow even at the smallest scale allowed: the overflow is in the fp16 "
            "forward/backward itself (an activation or gradient above 65504), not in the scaling. Fixes: "
            "keep that layer in fp32 (autocast(enabled=False) around it, or a softmax/norm in fp32), "
            "lower the learning rate or clip gradients, check the inputs for extreme values, or train in "
            "bf16 (GradScaler.passthrough()). If the overflows are rare and isolated, lower min_scale."
        )
    lines.append(HEALTH_POINTER)
    lines.append("scaler.overflow_report() names the parameters that held inf and NaN on the last skipped step.")
    return "\n".join(lines)
