"""The sentences of :class:`lossscale.health.HealthReport`: its paragraph and what to do.

Plain text from the report's numbers, the policy's bounds and the open streak; no torch. The account
itself (what each skip was) is :mod:`lossscale.health`.
"""

from __future__ import annotations

from typing import Optional

from .diagnosis import MAYBE_BACKWARD_OVERFLOW, NAN_SOURCES, NO_FP16, NO_FP16_FIX, backward_fixes
from .formats import pow2_label
from .policy import BAD_LOSS_STREAK, MIN_SCALE, ScaleState

__all__ = ["paragraph", "FLUSHED_WARN"]

#: A flushed share above this (1%) gets advice in the report.
FLUSHED_WARN = 0.01


def _number(x) -> str:
    """An int as it is (a token count of millions stays exact), a float short."""
    return str(x) if isinstance(x, int) else f"{x:g}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _namer(tracing: bool) -> str:
    """Who names the first module at fault: the trace when it is on, else how to turn it on."""
    return "the trace (scaler.overflow_report())" if tracing else "GradScaler(model=model, trace=True)"


def paragraph(r, policy, state: ScaleState, streak, stuck_ended: Optional[int], tracing: bool = False) -> str:
    """The paragraph of the :class:`~lossscale.health.HealthReport` ``r``: the counts, the state now, what to
    do (``streak``: the account's open streak; ``stuck_ended``: the last skip of a recent stuck streak;
    ``tracing``: the scaler traces first causes)."""
    parts = [f"lossscale health: {r.verdict}."]
    if r.steps == 0:
        parts.append("No step yet.")
    else:
        counts = f"{_plural(r.steps, 'step')}, " + (
            "none skipped" if not r.skipped else f"{r.skipped} skipped ({r.skipped / r.steps:.1%})"
        )
        kinds = []
        if r.calibration:
            kinds.append(
                f"{r.calibration} while the scale calibrated (expected after the start or a checkpoint load: "
                "it backs off until the gradients fit FP16)"
            )
        if r.overflow:
            probes = (
                f", {r.overflow_after_growth} right after the scale grew (the policy probing for a larger "
                "scale: expected)"
                if r.overflow_after_growth
                else ""
            )
            kinds.append(
                f"{_plural(r.overflow, 'overflow')} in steady training (not calibration: the scale had held) "
                f"or while stuck{probes}"
            )
        if r.bad_batch:
            kinds.append(
                f"{r.bad_batch} bad batch{'' if r.bad_batch == 1 else 'es'} (the loss was inf/NaN "
                "before scaling: the data or the model, not the scale, which was kept)"
            )
        if r.persistent_nan:
            kinds.append(
                f"{r.persistent_nan} with NaN that persisted although the scale fell or could not fall further"
            )
        if r.earlier:
            kinds.append(f"{r.earlier} before the last checkpoint load (of unknown kind)")
        parts.append(counts + (": " + "; ".join(kinds) if kinds else "") + ".")
        if r.streak:
            parts.append(f"The last {_plural(r.streak, 'step')} {'was' if r.streak == 1 else 'were'} skipped.")
        elif r.steps_since_overflow is not None:
            parts.append(f"No overflow in the last {_plural(r.steps_since_overflow, 'step')}.")
        parts.append(f"The scale is {pow2_label(r.scale)}, unchanged for {_plural(r.scale_held, 'step')}.")
        if r.overflow_cause is not None:
            parts.append(
                f"First cause of the last overflow in steady training, at step {r.overflow_cause[0]}: "
                f"{r.overflow_cause[1].rstrip('.')}."
            )
    if r.no_fp16:
        parts.append(f"Not FP16: {NO_FP16}.")
    if r.spike_steps:
        parts.append(
            f"{_plural(r.spike_steps, 'spike')} (a gradient norm or loss far above its recent run) "
            "skipped by skip_if, the scale kept."
        )
    forward_upcasts = [m for m in r.upcast_modules or () if m not in (r.backward_upcasts or ())]
    if forward_upcasts:
        parts.append(
            f"Kept in FP32 after repeated forward overflows (on_forward_overflow='upcast'): "
            f"{', '.join(forward_upcasts)}."
        )
    if r.backward_upcasts:
        parts.append(
            f"Kept in FP32 after their backward overflowed FP16 with the scale at 1 or below, or at its "
            f"floor (on_backward_overflow='upcast'): {', '.join(r.backward_upcasts)}."
        )
    if r.dropped_microbatches:
        one = r.dropped_microbatches == 1
        parts.append(
            f"{r.dropped_microbatches} micro-batch{'' if one else 'es'} with a non-finite loss "
            f"{'was' if one else 'were'} left out of {'its step' if one else 'their steps'} "
            "(bad_microbatch); the other micro-batches stepped"
            + (
                "."
                if r.dropped_weight in (None, r.dropped_microbatches)
                else f", renormalised by their weights ({_number(r.dropped_weight)} of it dropped)."
            )
        )
    if r.fp16_flushed:
        parts.append(f"The unscale of FP16 gradients (allow_fp16=True) flushed {r.fp16_flushed} value(s) to zero.")
    if r.flushed is not None:
        parts.append(
            f"{r.flushed:.2%} of the gradients sampled at step {r.flushed_step + 1} flush to zero in "
            "FP16 at their scale."
        )
    if r.causes:
        parts.append(
            "First causes of the last bad batches: "
            + "; ".join(f"step {s}: {c.rstrip('.')}" for s, c in r.causes)
            + "."
        )
    advice = _advice(r, policy, state, streak, stuck_ended, tracing)
    if r.no_fp16:
        fix = NO_FP16_FIX[0].lower() + NO_FP16_FIX[1:]
        advice = fix if advice == "nothing." else f"{advice} Also {fix}"
    parts.append("What to do: " + advice)
    if r.flushed is not None and r.flushed > FLUSHED_WARN:
        parts.append(
            f"More than {FLUSHED_WARN:.0%} of the gradients flush: a larger scale keeps them (raise "
            "max_scale, or policy='adaptive'), or train in bf16."
        )
    if r.causes or r.overflow_cause is not None or stuck_ended is not None or r.flushed is not None:
        parts.append("(Steps count from 1: step 1 is the first update.)")
    return " ".join(parts)


def _advice(r, policy, state: ScaleState, streak, stuck_ended: Optional[int], tracing: bool) -> str:
    lowest = policy.scale_bounds()[0]
    if r.verdict == "stuck":
        if state.streak_bad_loss_steps == r.streak:
            return (
                "the loss was inf/NaN before scaling in every one of them: a data or model problem (NaN/inf in "
                "inputs or labels, a log or division by zero, an fp16 activation that overflowed in the "
                "forward, weights already NaN); the scale cannot fix it. "
                f"{_namer(tracing)} names the first module whose output was non-finite."
            )
        model_or_data = (
            f"look in the model or the data ({NAN_SOURCES}; torch.autograd.set_detect_anomaly(True) finds the "
            "op). scaler.overflow_report() names the parameters."
        )
        if streak.nan >= 2:
            went = (
                f"NaN kept coming while the scale went from {pow2_label(state.streak_start_scale)} to "
                f"{pow2_label(state.scale)}"
            )
            if state.scale > MIN_SCALE:  # it may still be an FP16 backward overflow, which a lower scale fits
                return (
                    f"{went}. {MAYBE_BACKWARD_OVERFLOW}: "
                    f"{_namer(tracing)} names the first module whose backward overflowed; then "
                    + backward_fixes(lowest, state.scale)
                    + " Otherwise the scale is not the cause: "
                    + model_or_data
                )
            return f"{went}: a smaller scale cures an overflow, not this NaN, so " + model_or_data
        if policy.settle_steps() == 0:  # a scale that never searches: a fixed one
            return (
                "a static scale cannot back off: lower init_scale, or use the default dynamic policy. "
                "scaler.overflow_report() names the parameters."
            )
        floor = "" if lowest is None else f" ({pow2_label(lowest)})"
        return (
            f"gradients overflow even at the lowest scale allowed{floor} with the loss finite: the backward "
            "overflows FP16 (a value above 65504) at every scale the floor allows. "
            f"{_namer(tracing)} names the first module whose backward overflowed; then "
            + backward_fixes(lowest, state.scale)
            + " Or lower the learning rate or clip gradients, or train in bf16 (GradScaler.passthrough()). "
            "scaler.overflow_report() names the parameters."
        )
    if r.verdict == "recovering":
        if r.streak and state.streak_bad_loss_steps == r.streak:
            limit = policy.max_consecutive_skips or BAD_LOSS_STREAK
            return (
                f"the loss was inf/NaN before scaling in the last {r.streak} steps: check the data; after "
                f"{limit} in a row lossscale warns that training is stuck."
            )
        if r.streak and streak.calibration and not streak.steady:
            return (
                "nothing: the scale is still calibrating (backing off until the gradients fit FP16). Only "
                "if it reaches its lowest scale and still overflows does lossscale warn that training is stuck."
            )
        if r.streak:
            return (
                f"nothing yet: the scale is backing off after {r.streak} skipped steps in a row and recovers by "
                "itself; if it overflows at its lowest scale, lossscale warns that training is stuck."
            )
        return (
            f"nothing now: training steps again after being stuck until step {stuck_ended}. If it gets "
            "stuck again, the stuck warning's diagnosis says why."
        )
    if r.bad_batch:
        return "nothing for the scale. Look at the data of the bad batches" + (
            " (their first causes are above)."
            if r.causes
            else f" ({_namer(tracing)} names the first module whose output was non-finite)."
        )
    return "nothing."
