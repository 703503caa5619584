"""A lossscale policy run on the host, for frameworks that check gradients and decide the step themselves.

DeepSpeed's classic fp16 optimizers and Megatron-core's optimizers unscale, check for inf/NaN and
skip on their own, then hand the decision to their loss scaler as one host bool
(``update_scale(overflow)``, ``update(found_inf)``); they already synced to get it. What lossscale
adds there is the rule and the account, not the gradient pass: ``HostPolicy`` keeps a pure
policy's state (``lossscale.DynamicPolicy`` and friends: ``policy.update(state, found_inf, ...)``),
feeds every update to the run-health account (``lossscale.health.Health``), reacts to a stuck run
with the policy's ``on_stuck`` and ``lossscale.diagnose``'s text, and skips a step whose loss was
already non-finite before scaling without backing off (the loss check, as ``lossscale.GradScaler``'s).

Host syncs: none of its own on a clean step. The loss check keeps a device flag (no sync); it is
read only on an overflow step (the framework synced already, so the read does not wait).
"""

from __future__ import annotations

from typing import Any, Dict

from .._warnings import warn

__all__ = ["HostPolicy"]


class HostPolicy:
    """A pure lossscale policy's state, advanced by a framework's own overflow decisions.

    Args:
        policy: a lossscale policy object (``lossscale.DynamicPolicy(...)``, ``StaticPolicy``, ...).
        loss_check: keep a flag per ``check_loss`` call and, on an overflow step whose loss was
            non-finite before scaling, skip without backing off (``bad_loss``). False: every overflow
            is the scale's (torch's and the frameworks' behaviour).
    """

    def __init__(self, policy, loss_check: bool = True) -> None:
        from ..health import Health
        from ..policy import Policy

        if not isinstance(policy, Policy):
            raise ValueError(
                f"policy={policy!r} must be a lossscale policy object (lossscale.DynamicPolicy(...), ...)."
            )
        if not isinstance(loss_check, bool):
            raise ValueError(f"loss_check={loss_check!r} must be True or False.")
        self.policy = policy
        self.loss_check = loss_check
        self.state = policy.init_state()
        self.scale_before = self.state.scale  # the scale the last update ran with
        self._health = Health(self.state)
        self._bad_loss = None  # device flag: some checked loss of this iteration was non-finite
        self._warned_streak = False

    def check_loss(self, loss) -> None:
        """Remember whether ``loss`` (before scaling) is non-finite: a device flag, no host sync."""
        if not self.loss_check:
            return
        import torch

        bad = ~torch.isfinite(loss.detach()).all()
        self._bad_loss = bad if self._bad_loss is None else self._bad_loss | bad.to(self._bad_loss.device)

    def update(self, found_inf: bool, found_nan: bool = False):
        """Advance the policy by one iteration whose step the framework skipped (``found_inf``) or took;
        returns the new state. Reads the loss flag on an overflow only; reacts per ``on_stuck``."""
        if not isinstance(found_inf, bool) or not isinstance(found_nan, bool):
            raise ValueError(
                f"found_inf={found_inf!r} and found_nan={found_nan!r} must be bools (the framework's "
                "decision, already on the host)."
            )
        bad_loss = bool(found_inf and self._bad_loss is not None and self._bad_loss.item())
        self._bad_loss = None
        before = self.state
        self.state = self.policy.update(
            before, found_inf=found_inf, found_nan=found_nan and found_inf, bad_loss=bad_loss
        )
        self.scale_before = before.scale
        self._health.record(self.policy, self.state, before.scale)
        self._react(before.scale)
        return self.state

    def _react(self, scale_before: float) -> None:
        if not self.state.overflow_streak:
            self._warned_streak = False
            return
        if not self.policy.is_stuck(self.state, scale_before):
            return
        from ..diagnosis import diagnose

        if self.policy.on_stuck == "raise":
            raise RuntimeError(diagnose(self.policy, self.state))
        if self.policy.on_stuck == "warn" and not self._warned_streak:
            self._warned_streak = True
            warn(diagnose(self.policy, self.state), RuntimeWarning)

    def set_state(self, policy, state) -> None:
        """Continue from a loaded ``policy`` and ``state`` (the health account starts again from it)."""
        self.policy, self.state, self.scale_before = policy, state, state.scale
        self._health.reset(state)
        self._bad_loss, self._warned_streak = None, False

    def health(self):
        """The run's health account (``lossscale.HealthReport``). No sync."""
        return self._health.report(self.policy, self.state, self.scale_before)

    def counters(self) -> Dict[str, int]:
        """Steps, skipped, inf, NaN and bad-loss steps and the current streak, as plain ints. No sync."""
        s = self.state
        return {
            "steps": s.steps,
            "skipped_steps": s.skipped_steps,
            "inf_steps": s.inf_steps,
            "nan_steps": s.nan_steps,
            "bad_loss_steps": s.bad_loss_steps,
            "overflow_streak": s.overflow_streak,
        }

    def metrics(self) -> Dict[str, Any]:
        """``loss_scale``, the ``counters`` and ``last_step_skipped``: numbers for any logger. No sync."""
        return {"loss_scale": self.state.scale, **self.counters(), "last_step_skipped": self.state.overflow_streak > 0}

    def state_dict(self) -> Dict[str, Any]:
        """The policy and its state, in ``lossscale.GradScaler.state_dict()``'s format."""
        from .. import checkpoint

        return checkpoint.to_dict(self.policy, self.state)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load ``state_dict``'s format (a ``lossscale.GradScaler``'s or torch's too); ValueError
        naming the key when it does not validate. The checkpoint's policy wins, as in GradScaler."""
        from .. import checkpoint

        policy, state = checkpoint.load(state_dict, self.policy)
        self.set_state(policy, state)

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        state["_bad_loss"] = None  # a device flag of the iteration in flight: meaningful in this process only
        return state

    def __repr__(self) -> str:
        return f"HostPolicy({self.policy!r}, scale={self.state.scale:g}, steps={self.state.steps})"
