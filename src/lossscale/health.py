"""The run-health account: which skipped steps were the scale calibrating, which were overflows in
steady training, bad batches or persistent NaN, and whether training is healthy now.

It answers the question every scaler's "Gradient overflow, skipping step" message raises (apex #864,
DeepSpeed #931): *is this normal?* ``scaler.health()`` returns a :class:`HealthReport`: plain numbers,
a verdict (healthy, recovering or stuck) and one short paragraph that says what to do.

Pure Python, like the policies (no torch): :class:`Health` is fed the states the scaler already
computes, in order, once per update whose outcome the host learns. On the synced path (optimizers
without amp-scaling support) that is every update, at once; on the fused path it is the snapshots
of the deferred stuck check (``lossscale._observe``), one or more updates late, some possibly
dropped. Nothing is added to an iteration but a few integer operations on the host.

**How each skip is classified.** A skip is an update whose optimizer step was skipped
(``found_inf``). Each belongs to exactly one kind, and the kinds add up to ``skipped``:

* **bad batch**: the loss (or, with ``trace=True``, a forward output) was inf/NaN before scaling
  (``bad_loss``): the data or the model, not the scale, which is kept. Exact, from the counters.
* **persistent NaN**: NaN gradients (with a finite loss) in a streak of consecutive skips that the
  policy judged stuck (``policy.is_stuck``: an overflow at the lowest scale, a static scale, or
  ``max_consecutive_skips`` in a row) and that held NaN at least twice: NaN kept coming although
  the scale fell, or could not fall. All the streak's NaN skips count, the ones before it got stuck
  too. A NaN that stops once the scale is lower was an overflow (inf - inf is NaN), and counts as one
  of the next two kinds; one that a floor above FP16's smallest subnormal stopped the scale from
  curing counts here, and the report's advice says so.
* **calibration**: any other skip (a finite loss) that came while the scale was still searching: after
  the start or a checkpoint load, before the first *clean stretch*, ``settle`` consecutive steps
  without an overflow (skipped bad batches do not break a stretch), and before the scale first *held*:
  :data:`HELD` steps without an overflow or a change of scale. An overflow at a scale that had held
  (the loss times 10**6 at step 20 of a clean run) is not the search's: the gradients or the data
  outgrew a scale that fit them, so it ends calibration and counts as an overflow in steady training.
  ``settle`` is the policy's ``settle_steps()``, a method of the policy protocol:

  - ``dynamic``: ``min(growth_interval, SETTLE)`` (50 with torch's 2000): the backoffs from
    ``init_scale`` down to the level the gradients fit;
  - ``adaptive``: the search while its state is ``searching`` (before the first measured amax), then
    the same stretch,
    ``min(growth_interval, SETTLE)``, counted from the update that calibrated;
  - ``logmax`` and policies lossscale does not know: ``SETTLE`` steps (LogMax's averages warm up);
  - ``static``: 0: the scale never searches, so no skip is calibration.

  A streak that ends stuck is not calibration: its skips are persistent NaN or overflows.
* **overflow**: a skip with a finite loss in steady training (after the first clean stretch, or at a
  scale that had held), or in a stuck streak. ``overflow_after_growth`` counts those that came at most
  ``SETTLE`` steps after the scale grew, at the grown scale: the dynamic policy probing for a larger
  scale (one every ``growth_interval`` clean steps when the gradients sit near the top of FP16's range),
  expected.

A streak's skips are classified when it ends; the report counts the streak in progress as if it
ended now (a streak that gets stuck later turns its calibration skips into persistent NaN or overflows).

**The verdict**, from the latest state:

* ``"stuck"``: the last update was skipped and its streak is stuck (``policy.is_stuck``, the condition
  of the ``on_stuck`` warning): the scale cannot answer, training makes no progress.
* ``"recovering"``: not stuck, and either the last 2 or more updates were skipped (the scale is
  backing off, or bad batches in a row), or the last one was skipped while the scale is still
  calibrating, or fewer than ``SETTLE`` steps have passed since the last skip of a stuck streak.
* ``"healthy"``: otherwise. One skip in steady training (a growth probe, a spike) or an isolated bad
  batch leaves training healthy: the scale answered it, or it was not the scale's.

**Gaps.** Where snapshots were dropped (more than 4 in flight on a lagging device, or updates under
CUDA-graph capture or torch.compile, which read nothing), the counters' deltas still count every
step and skip exactly; only the split of a gap's skips between streaks and phases is inferred: a
gap's skips before its last clean step go to the streak open before it, in the phase known before
it, bad batches are taken to be the NaN ones, and the last overflow and scale change are placed at
the latest step they can have happened (so ``steps_since_overflow`` and ``scale_held`` are lower
bounds). The scaler also records the state it reads in ``health()`` itself, so the report is never
behind.

**After a checkpoint load** (:meth:`Health.reset`) calibration starts again: the run may resume on
other data, or from a torch checkpoint's scale. The checkpoint's counters carry its steps and skips,
but not their kinds: its skips (bad batches apart, which the counters keep) are reported as
``earlier``.

**First causes.** With ``trace=True`` the scaler passes each update's evidence; the account keeps it
for the last :data:`KEEP_CAUSES` bad batches and the last overflow in steady training whose own update
it saw (device tensors, no read) and the report turns it into text (the scaler's ``overflow_report()``
cause, one host read each, in ``health()`` only).

**Step numbers** count updates from 1: step 1 is the first update after the scaler was built (the
report's text says so where it names a step).

Example, a scripted run (the scale overflows above 2**10)::

    >>> from lossscale import DynamicPolicy
    >>> p, h = DynamicPolicy(), Health(DynamicPolicy().init_state())
    >>> s = p.init_state()
    >>> for _ in range(100):
    ...     before = s.scale
    ...     s = p.update(s, found_inf=before > 2.0**10)
    ...     h.record(p, s, before)
    >>> r = h.report(p, s)
    >>> r.verdict, r.skipped, r.calibration, r.steps_since_overflow
    ('healthy', 6, 6, 94)
"""

from __future__ import annotations

import copy
import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from ._health_text import paragraph
from .policy import SETTLE, ScaleState

__all__ = ["Health", "HealthReport", "disabled", "SETTLE", "HELD", "KEEP_CAUSES", "VERDICTS"]

# SETTLE (lossscale.policy): the consecutive steps without an overflow that end calibration (a
# policy's settle_steps() may cap it), and that end "recovering" after a stuck streak.
#: The bad batches whose first cause (with ``trace=True``) a report gives: the last few.
KEEP_CAUSES = 3
#: Steps without an overflow or a change of scale after which the scale has *held*: it fits the
#: gradients, so a later overflow is not calibration. The descent from the initial scale backs off on
#: overflows a step or a few apart; ten clean steps at one scale are past it.
HELD = 10
#: The verdicts, in order of concern; :meth:`HealthReport.metrics` gives the index as ``verdict``.
VERDICTS = ("healthy", "recovering", "stuck")
#: The report's fields that are not numbers (left out of :meth:`HealthReport.metrics`).
_TEXT_FIELDS = ("verdict", "text", "causes", "overflow_cause", "upcast_modules", "backward_upcasts", "rescaling")


@dataclass(frozen=True)
class HealthReport:
    """How training went, in plain numbers, a verdict and a paragraph (``str(report)`` is the paragraph).

    Attributes:
        verdict: "healthy", "recovering" or "stuck" (see :mod:`lossscale.health`); "disabled" when
            the scaler is disabled.
        text: one short paragraph: the counts, the state now, and what to do.
        steps: updates counted (skipped ones included).
        skipped: skipped updates; ``calibration + overflow + bad_batch + persistent_nan + earlier``.
        calibration: skips while the scale was still searching after the start or a load.
        overflow: skips with a finite loss in steady training (or in a stuck streak).
        overflow_after_growth: of ``overflow``, those right after the scale grew (a growth probe).
        bad_batch: skips whose loss was non-finite before scaling (the scale kept).
        persistent_nan: NaN skips of streaks that got stuck: NaN that a lower scale did not cure, or that
            the floor kept a lower scale from curing (an FP16 backward overflow shows as NaN too).
        earlier: skips before the last checkpoint load other than bad batches (kind unknown).
        streak: consecutive skipped updates up to now (0: the last step was taken).
        steps_since_overflow: updates since the last overflow (a skip with a finite loss) since the
            start or the last load; None if there was none.
        scale: the scale now.
        scale_held: updates since the scale last changed (since the start or the last load).
        calibrating: whether the scale is still calibrating (no clean stretch yet).
        flushed: with telemetry on, the share of the gradients of the last sampled iteration that
            FP16 flushes to zero at their scale (``grad/flushed_frac``); else None.
        flushed_step: the iteration ``flushed`` was sampled at, or None.
        fp16_flushed: with ``allow_fp16``, the gradient values the unscale of FP16 (and bf16) gradients
            flushed to zero so far; else None.
        spike_steps: with ``skip_if``, the finite steps skipped as spikes (not counted in ``skipped``,
            which counts the steps the scale answered or the loss spoiled); else None.
        dropped_microbatches: with ``bad_microbatch="drop"`` (or "zero"), the micro-batches whose loss
            was non-finite and that were left out of their step; else None.
        dropped_weight: their weight (``scale(loss, weight=...)``: tokens, with token counts; without
            weights, equal to ``dropped_microbatches``); else None.
        upcasts: with ``on_forward_overflow="upcast"`` (or ``on_backward_overflow``), how many modules
            the scaler kept in FP32 after repeated overflows; else None.
        upcast_modules: the names of those modules; else None.
        backward_upcasts: with ``on_backward_overflow="upcast"``, those of them kept for a backward that
            overflowed with the scale at 1 or below (or at its floor, if higher); else None.
        causes: ``(step, first cause)`` of the last few bad batches, with ``trace=True``.
        overflow_cause: ``(step, first cause)`` of the last overflow in steady training, with
            ``trace=True``; else None.
        no_fp16: the scaler saw no FP16 work (an FP16 loss, activation or parameter, or FP16 autocast at
            ``scale()``) in its first ``lossscale.diagnosis.NO_FP16_STEPS`` (100) scaled steps, and warned:
            the run trains in FP32 or bf16.
        rescaling: the residual-stream rescalings in force in this process (``lossscale.rescale``), one
            line each; None when none is.
    """

    verdict: str
    text: str
    steps: int = 0
    skipped: int = 0
    calibration: int = 0
    overflow: int = 0
    overflow_after_growth: int = 0
    bad_batch: int = 0
    persistent_nan: int = 0
    earlier: int = 0
    streak: int = 0
    steps_since_overflow: Optional[int] = None
    scale: float = 1.0
    scale_held: int = 0
    calibrating: bool = False
    flushed: Optional[float] = None
    flushed_step: Optional[int] = None
    fp16_flushed: Optional[int] = None
    spike_steps: Optional[int] = None
    dropped_microbatches: Optional[int] = None
    dropped_weight: Optional[float] = None
    upcasts: Optional[int] = None
    upcast_modules: Optional[Tuple[str, ...]] = None
    backward_upcasts: Optional[Tuple[str, ...]] = None
    causes: Tuple[Tuple[int, str], ...] = ()
    overflow_cause: Optional[Tuple[int, str]] = None
    no_fp16: bool = False
    rescaling: Optional[Tuple[str, ...]] = None

    def __str__(self) -> str:
        return self.text

    def metrics(self, prefix: str = "health/") -> Dict[str, Any]:
        """The numbers as a flat dict for any logger (int, float, bool; no text): ``verdict`` is the
        index in :data:`VERDICTS` (0 healthy, 1 recovering, 2 stuck; -1 disabled); ``steps_since_overflow``,
        ``flushed``, ``flushed_step`` and ``fp16_flushed`` are left out while None."""
        out: Dict[str, Any] = {"verdict": VERDICTS.index(self.verdict) if self.verdict in VERDICTS else -1}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in _TEXT_FIELDS and value is not None:
                out[f.name] = value
        return {prefix + k: v for k, v in out.items()}


def disabled() -> HealthReport:
    """The report of a disabled scaler: nothing was counted."""
    return HealthReport(
        "disabled", "lossscale health: loss scaling is disabled (GradScaler(enabled=False)); no step was counted."
    )


class _Streak:
    """The skips of the streak in progress, kept apart until it ends: whether its overflows were
    calibration, steady overflows or persistent NaN depends on how it ends."""

    __slots__ = ("skips", "calibration", "steady", "nan", "probe", "stuck")

    def __init__(self):
        self.skips = 0  # every skip, bad batches included
        self.calibration = 0  # overflows (finite loss) while calibrating
        self.steady = 0  # overflows after calibration
        self.nan = 0  # of the overflows, those with NaN
        self.probe = 0  # 1 when its first steady overflow came right after a growth
        self.stuck = False  # the policy judged some update of it stuck

    def kinds(self) -> Tuple[int, int, int, int]:
        """``(calibration, overflow, overflow_after_growth, persistent_nan)`` if it ended now."""
        overflows = self.calibration + self.steady
        if self.stuck:
            nan = self.nan if self.nan >= 2 else 0
            return 0, overflows - nan, 0, nan
        return self.calibration, self.steady, self.probe, 0


class Health:
    """The run-health accumulator (see :mod:`lossscale.health` for every definition).

    Args:
        state: the state training starts from (``policy.init_state()``, or a loaded one).

    Call :meth:`record` once per update whose state the host learns, in order (later calls with an
    older state are ignored; gaps are allowed), :meth:`reset` after a checkpoint load, and
    :meth:`report` for the account. Pickling keeps the counts and drops the kept causes (device
    evidence).
    """

    def __init__(self, state: ScaleState):
        self.reset(state)

    def reset(self, state: ScaleState) -> None:
        """Start the account again from ``state`` (after a checkpoint load): calibration starts again,
        and the state's own skips (bad batches apart) become ``earlier``."""
        self._seen = state  # the last state recorded: its counters are read, the deltas taken from them
        self._earlier = state.skipped_steps - state.bad_loss_steps
        self._base = state.steps
        self._calibration = self._overflow = self._after_growth = self._persistent = 0
        self._open = _Streak()
        self._calibrating = True
        # A policy that searches for its first scale by a rule of its own (``state.searching``: adaptive,
        # before its first measurement) starts its clean stretch where the search ended.
        self._search_pending = state.searching
        self._search_ended: Optional[int] = None
        self._last_overflow: Optional[int] = None
        self._scale_since = state.steps
        self._grown_at: Optional[int] = None
        self._stuck_ended: Optional[int] = None  # the last skip of the last stuck streak
        self._causes: deque = deque(maxlen=KEEP_CAUSES)
        self._overflow_cause: Optional[Tuple[int, Any, float]] = None  # the last steady overflow's evidence

    @property
    def seen(self) -> int:
        """The step count of the last state recorded (or reset to)."""
        return self._seen.steps

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        state["_causes"] = deque(maxlen=KEEP_CAUSES)  # device evidence: meaningful in this process only
        state["_overflow_cause"] = None
        return state

    # ------------------------------------------------------------------------------------ record
    def record(self, policy, state: ScaleState, scale_before: float, cause: Any = None) -> None:
        """Account for the updates up to ``state`` (an update's result; ``scale_before``: the scale that
        update ran with). ``cause``: that update's evidence of a first cause, kept if it was a bad batch."""
        seen = self._seen
        k = state.steps - seen.steps
        if k < 0:
            return  # a snapshot older than what was seen (the host path got ahead of the ring)
        # k == 0: no step, but news of the last one (a NaN learned after the host counted the overflow
        # as inf), or update(new_scale=...) without a check, which moves only the scale.
        if self._calibrating and policy.settle_steps() == 0:
            self._calibrating = False
        skips = state.skipped_steps - seen.skipped_steps
        nan = state.nan_steps - seen.nan_steps
        bad = state.bad_loss_steps - seen.bad_loss_steps
        steady = self._open.steady
        if skips < k:  # a clean step in between: the streak open before it has ended
            streak = min(state.overflow_streak, skips)
            cur_nan = min(state.streak_nan_steps, nan)
            cur_bad = min(state.streak_bad_loss_steps, bad)
            clean_at = state.steps - streak  # the last clean step
            self._add(skips - streak, nan - cur_nan, bad - cur_bad, clean_at - 1, seen.steps + 1)
            self._close(clean_at)
            self._settle(policy, state, clean_at)
            self._add(streak, cur_nan, cur_bad, state.steps, state.steps - streak + 1)
        else:
            self._add(skips, nan, bad, state.steps, seen.steps + 1)
        if k and state.overflow_streak and not self._open.stuck:
            self._open.stuck = bool(policy.is_stuck(state, scale_before))
        if state.scale != seen.scale:
            self._grown_at = state.steps if state.scale > seen.scale else None
            self._scale_since = state.steps  # (in a gap: the latest update it can have been)
        if k == 1 and bad == 1 and cause is not None:
            self._causes.append((state.steps, cause, scale_before))
        elif k == 1 and skips == 1 and cause is not None and self._open.steady > steady:
            self._overflow_cause = (state.steps, cause, scale_before)
        self._seen = state

    def _add(self, skips: int, nan: int, bad: int, last: int, first: int) -> None:
        """``skips`` more skips in the open streak (``bad`` of them bad batches), the last at step
        ``last``, none before step ``first`` (in a gap the steps are not known: ``first`` is the earliest
        they can have been, ``last`` the latest); ``nan``: NaN steps counted since the last record, these
        skips' and any learned late for the streak's earlier ones (bad batches are taken to be the NaN ones)."""
        streak = self._open
        overflows = skips - bad
        if skips > 0:
            streak.skips += skips
        if overflows > 0:
            # The scale had held (even if these skips came as early as they can have): it fit the gradients,
            # which (or the data) outgrew it: not the search.
            held = self._scale_since if self._last_overflow is None else max(self._scale_since, self._last_overflow)
            if self._calibrating and first - 1 - held >= HELD:
                self._calibrating = False
            if self._calibrating:
                streak.calibration += overflows
            else:
                if self._grown_at is not None and last - self._grown_at <= SETTLE and not streak.steady:
                    streak.probe = 1
                streak.steady += overflows
            self._grown_at = None
            self._last_overflow = last
        streak.nan = min(streak.calibration + streak.steady, streak.nan + max(0, nan - bad))

    def _close(self, clean_at: int) -> None:
        """The open streak ended with a clean step at ``clean_at``: classify its skips."""
        streak = self._open
        if not streak.skips:
            return
        calibration, overflow, after_growth, persistent = streak.kinds()
        self._calibration += calibration
        self._overflow += overflow
        self._after_growth += after_growth
        self._persistent += persistent
        if streak.stuck:
            self._stuck_ended = clean_at - 1  # its last skip
        self._open = _Streak()

    def _settle(self, policy, state: ScaleState, at: int) -> None:
        """End calibration at step ``at`` (a clean step) once a clean stretch is complete."""
        if not self._calibrating:
            return
        settle = policy.settle_steps()
        if settle == 0:
            self._calibrating = False
            return
        start = self._base if self._last_overflow is None else self._last_overflow
        if state.searching:
            return
        if self._search_pending:  # the search ended by this step (in a gap: the latest it can have)
            self._search_pending, self._search_ended = False, at
        if self._search_ended is not None:
            start = max(start, self._search_ended)
        if at - start >= settle:
            self._calibrating = False

    # ------------------------------------------------------------------------------------ report
    def report(
        self,
        policy,
        state: ScaleState,
        scale_before: Optional[float] = None,
        flushed: Optional[float] = None,
        flushed_step: Optional[int] = None,
        describe: Optional[Callable[[Any, float], str]] = None,
        fp16_flushed: Optional[int] = None,
        spike_steps: Optional[int] = None,
        dropped_microbatches: Optional[int] = None,
        dropped_weight: Optional[float] = None,
        upcasts: Optional[int] = None,
        upcast_modules: Optional[Tuple[str, ...]] = None,
        backward_upcasts: Optional[Tuple[str, ...]] = None,
        tracing: bool = False,
        no_fp16: bool = False,
    ) -> HealthReport:
        """The account up to ``state`` (the current state; recorded first if newer than the last one).

        Args:
            policy: the scaler's policy.
            state: the state now.
            scale_before: the scale the update that produced ``state`` ran with, if known.
            flushed: the telemetry's flushed share, if sampled.
            flushed_step: the iteration it was sampled at.
            describe: ``(cause, scale_before) -> text`` for the kept causes (default ``str``).
            tracing: the scaler traces first causes (``trace=True``): the advice points at them rather
                than telling the user to turn tracing on.
            no_fp16: the scaler saw no FP16 work in its first steps (see :class:`HealthReport`).
        """
        if state.steps < self._seen.steps:
            raise ValueError(
                f"state.steps={state.steps} is older than the last state recorded ({self._seen.steps}); "
                "report() takes the current state."
            )
        h = copy.copy(self)
        h._open = copy.copy(self._open)
        h._causes = deque(self._causes, maxlen=KEEP_CAUSES)  # (the copy's __getstate__ dropped the evidence)
        h._overflow_cause = self._overflow_cause
        h.record(policy, state, self._seen.scale if scale_before is None else scale_before)
        calibration, overflow, after_growth, persistent = h._open.kinds()
        streak = state.overflow_streak
        recent_stuck = h._stuck_ended is not None and state.steps - h._stuck_ended < SETTLE
        if streak and h._open.stuck:
            verdict = "stuck"
        elif streak >= 2 or (streak == 1 and h._open.calibration == 1) or recent_stuck:
            verdict = "recovering"
        else:
            verdict = "healthy"
        describe = describe or (lambda cause, scale: str(cause))
        report = HealthReport(
            verdict=verdict,
            text="",
            steps=state.steps,
            skipped=state.skipped_steps,
            calibration=h._calibration + calibration,
            overflow=h._overflow + overflow,
            overflow_after_growth=h._after_growth + after_growth,
            bad_batch=state.bad_loss_steps,
            persistent_nan=h._persistent + persistent,
            earlier=h._earlier,
            streak=streak,
            steps_since_overflow=None if h._last_overflow is None else state.steps - h._last_overflow,
            scale=state.scale,
            scale_held=state.steps - h._scale_since,
            calibrating=h._calibrating and policy.settle_steps() > 0,
            flushed=flushed,
            flushed_step=flushed_step,
            fp16_flushed=fp16_flushed,
            spike_steps=spike_steps,
            dropped_microbatches=dropped_microbatches,
            dropped_weight=dropped_weight,
            upcasts=upcasts,
            upcast_modules=upcast_modules,
            backward_upcasts=backward_upcasts,
            causes=tuple((step, describe(cause, before)) for step, cause, before in h._causes),
            overflow_cause=None
            if h._overflow_cause is None
            else (h._overflow_cause[0], describe(h._overflow_cause[1], h._overflow_cause[2])),
            no_fp16=no_fp16,
        )
        text = paragraph(report, policy, state, h._open, h._stuck_ended if recent_stuck else None, tracing)
        return dataclasses.replace(report, text=text)
