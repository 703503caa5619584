"""What a GradScaler tells about the run, as a mixin: skips, counters, metrics, health and diagnoses.

:class:`lossscale.GradScaler` inherits these methods. The scaler computes what they report as it
trains (the iteration's records ``_it``, the last update ``_last``, the state keeper ``_s``, the
health account ``_health``, the stuck check ``_stuck``, the telemetry, the first-cause evidence);
reading it never changes training. Each method says whether it may sync host and device.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Union

import torch

from . import _overflow
from . import distributed as _distributed
from ._iteration import OptState
from .health import HealthReport, disabled as health_disabled

__all__ = ["Readouts"]


class Readouts:
    """Skip-awareness, counters, metrics, the health report and the overflow diagnosis of a
    :class:`lossscale.GradScaler` (which inherits them; see the module docstring)."""

    def _describe(self, evidence, scale_before: Optional[float]) -> str:
        return _overflow.report(evidence, self._names, self._tracer, scale_before)["cause"]

    def health(self) -> HealthReport:
        """The run's health: every skip classified (the scale calibrating, an overflow in steady
        training, a bad batch, persistent NaN), the steps since the last overflow, how long the scale
        has held, the flushed share (telemetry on), and a verdict with what to do (:mod:`lossscale.health`).

        Built from what :meth:`update` already computes: training pays no sync for it. Reading it syncs
        once for the state where the host does not know it (fused optimizers), once more with telemetry
        on (the last sampled figures, this rank's own: never a collective), once per kept first cause
        (``trace=True``). Not inside a CUDA-graph capture.
        """
        if not self._enabled:
            return health_disabled()
        known = self._s.mirror is not None and self._s.mirror.steps == self._health.seen
        state, before = (self._s.state(), None) if known else self._s.t.decode(self._s.t.buffer.cpu())
        sampled = self._telemetry is not None and self._telemetry.overall is not None
        return self._health.report(self._policy, state, before,
                                   self._telemetry.overall.flushed_frac if sampled else None,
                                   self._telemetry.step_collected if sampled else None, self._describe)

    def check_stuck(self) -> None:
        """Run the stuck check on the state now (warn or raise per ``on_stuck``). Syncs host and device.

        :meth:`update` runs it by itself; inside a CUDA-graph capture or ``torch.compile`` it cannot
        (the host reads nothing there), so a loop that replays graphs or runs a compiled step calls
        this eagerly now and then. It describes the current streak, not where it began.
        """
        if self._enabled and self._s.t is not None:
            self._stuck.now(self._policy, self._s.t, self._describe, self._tracer is not None)

    def overflow_report(self) -> Dict[str, Any]:
        """Why the last step was skipped: which parameters held inf and NaN, and where it began.

        A dict: ``"inf"``, ``"nan"`` (names of the parameters whose gradients held inf / NaN);
        ``"loss"`` ("finite", "inf" or "nan": the loss before scaling, with ``loss_check``);
        ``"forward"``, ``"backward"`` (the first module whose output / input gradient was non-finite,
        with ``trace=True``, else None); ``"scale"`` (the scale the step ran with); ``"cause"`` (a
        one-line diagnosis). Empty lists and None when the last step was not skipped. Syncs.
        """
        if not self._skipped_at_update():
            return dict(_overflow.NOT_SKIPPED)
        if self._last_report is None:
            scale = None if self._s.t is None else float(self._s.t.scale_before.item())
            self._last_report = _overflow.report(self._evidence or {}, self._names, self._tracer, scale)
        return self._last_report

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last :meth:`step` was skipped: between :meth:`step` and :meth:`update` this
        iteration's (any optimizer stepped so far), otherwise the last iteration's.

        Free when the host decided the step; for fused optimizers the first read syncs and later
        reads reuse it (after an update captured in a CUDA graph, every read syncs).
        """
        stepped = [r for r in self._it.records.values() if r.stage is OptState.STEPPED]
        if stepped:
            return any(r.read_skipped() for r in stepped)
        return self._skipped_at_update()

    def step_was_skipped(self, optimizer=None) -> bool:
        """Whether ``optimizer``'s last step was skipped, for code that acts on it (an LR scheduler).

        Between :meth:`step` and :meth:`update` this iteration's decision for ``optimizer`` (each
        optimizer skips on its own gradients, as in torch), or for the iteration so far; after
        :meth:`update` the last iteration's. RuntimeError when gradients were checked this iteration
        but no optimizer has stepped yet (nothing is decided). May sync: see :attr:`last_step_skipped`.
        """
        skipped = self._it.skipped(optimizer)
        return self._skipped_at_update() if skipped is None else skipped

    def skip_flag(self, optimizer=None) -> Union[bool, torch.Tensor]:
        """:meth:`step_was_skipped` without a host sync: a Python bool where the host decided the step,
        else a bool 0-dim tensor on the scaler's device (fused optimizers), for gating device work such
        as an EMA update with ``torch.where``."""
        if not self._enabled:
            return False
        flag = self._it.skip_flag(optimizer, self._s.device)
        return self._last.flag(self._s.t) if flag is None else flag

    def _skipped_at_update(self) -> bool:
        if self._last.skipped is None and self._s.mirror is not None:  # the host learned the state since
            return self._s.mirror.overflow_streak > 0
        return self._last.was_skipped(self._s.t, self._s.graphed)

    @property
    def skipped_steps(self) -> int:
        """Skipped iterations so far. May sync: see :meth:`state`."""
        return self.state().skipped_steps if self._enabled else 0

    def step_scheduler(self, scheduler, *args, **kwargs) -> bool:
        """``scheduler.step()`` unless the step of its optimizer was skipped; returns whether it stepped.

        A skipped step did not train, so an LR schedule that advanced anyway would drift ahead of the
        weights. Call it after :meth:`step`, before or after :meth:`update`: either way it reads this
        iteration's decision for ``scheduler.optimizer``. May sync: see :attr:`last_step_skipped`.
        """
        if self._enabled and self.step_was_skipped(getattr(scheduler, "optimizer", None)):
            return False
        scheduler.step(*args, **kwargs)
        return True

    def counters(self) -> Dict[str, int]:
        """Every counter as plain ints: steps, skipped, inf, NaN and bad-loss steps, current streak.
        May sync: see :meth:`state`."""
        s = self.state()
        return {"steps": s.steps, "skipped_steps": s.skipped_steps, "inf_steps": s.inf_steps,
                "nan_steps": s.nan_steps, "bad_loss_steps": s.bad_loss_steps, "overflow_streak": s.overflow_streak}

    def metrics(self) -> Dict[str, Union[int, float, bool]]:
        """A flat dict of numbers for any logger: ``loss_scale``, the :meth:`counters`,
        ``last_step_skipped``, and with telemetry the figures of the last sampled iteration
        (``grad/flushed_frac``, ..., see :meth:`metric_labels`). Syncs at most once (the state, where
        only the device knows it, rides in the telemetry's transfer); with telemetry reducing across
        ranks, a collective.
        """
        figures: Dict[str, Any] = {}
        if self._telemetry is not None:
            group = _distributed.resolve_group(self.process_group) if self._telemetry.wants_reduction() else None
            # The state rides along in the telemetry's one transfer where only the device knows it.
            also = [self._s.t.buffer] if self._enabled and self._s.mirror is None and self._s.t is not None else []
            figures, riding = self._telemetry.metrics_with(group=group, device=self.device, also=also)
            if riding:
                self._s.take(riding[0])
        out: Dict[str, Any] = {"loss_scale": self.get_scale()}
        if self._enabled:
            out.update(self.counters())
        out["last_step_skipped"] = bool(self._enabled and self.last_step_skipped)
        out.update(figures)
        return out

    def metric_labels(self) -> Dict[str, str]:
        """Text that goes with :meth:`metrics` (``grad/measured``: e.g. "float32 as fp16"). No sync."""
        return {} if self._telemetry is None else self._telemetry.labels()
