"""torch.amp.GradScaler's getters, setters and the private names trainers reach for, as a mixin.

:class:`lossscale.GradScaler` inherits them, so ``scaler.get_scale()``, ``set_growth_factor()``,
``_get_growth_tracker()``, ``_found_inf_per_device()`` and ``_lazy_init_scale_growth_tracker()`` work
where code written for torch's scaler calls them (accelerate, Lightning, transformers and user
loops do). They hold no state of their own: they read and write the scaler's policy (``_policy``),
its state keeper (``_s``), this iteration's records (``_it``) and its check (``_run_check``).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch

__all__ = ["TorchAPI"]


class TorchAPI:
    """The part of torch's ``GradScaler`` API that is about reading and setting its configuration and
    state; :class:`lossscale.GradScaler` inherits it (see the module docstring for what it reads)."""

    @property
    def _device(self) -> str:
        """torch's private attribute (a device string), which accelerate's FSDP2 ``load_state`` passes
        back to :meth:`_lazy_init_scale_growth_tracker`."""
        if self._s.t is not None:
            return str(self._s.device)
        return self._s.device_type or ("cuda" if torch.cuda.is_available() else "cpu")

    def _lazy_init_scale_growth_tracker(self, device) -> None:
        """torch's private name for :meth:`init_device` (accelerate's FSDP2 ``load_state`` calls it)."""
        if self._enabled:
            self.init_device(device)

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). May sync: see :meth:`state`."""
        return self.state().scale if self._enabled else 1.0

    def _get_scale_async(self) -> Optional[torch.Tensor]:
        """The scale tensor without a sync (None before the first :meth:`scale`), as in torch."""
        return None if self._s.t is None else self._s.t.scale

    def _replace_policy(self, **changes) -> None:
        missing = [k for k in changes if k not in self._policy.config()]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} do(es) not apply to the {type(self._policy).__name__}.")
        self._policy = dataclasses.replace(self._policy, **changes)  # validates the new value

    def get_growth_factor(self) -> float:
        """The growth factor (1.0 for a policy without one)."""
        return self._policy.config().get("growth_factor", 1.0)

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (validated: > 1)."""
        self._replace_policy(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The backoff factor (1.0 for a policy without one)."""
        return self._policy.config().get("backoff_factor", 1.0)

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (validated: in (0, 1))."""
        self._replace_policy(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """The growth interval (0 for a policy without one)."""
        return self._policy.config().get("growth_interval", 0)

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (validated: int >= 1). Lowering it below the current clean streak makes
        the next clean step grow the scale (torch would never grow again until an overflow)."""
        self._replace_policy(growth_interval=new_interval)
        self._s.cap_growth_tracker(new_interval)

    def _get_growth_tracker(self) -> int:
        """torch's private getter (used by some trainers). May sync."""
        return getattr(self.state(), "growth_tracker", 0) if self._enabled else 0

    def is_enabled(self) -> bool:
        """Whether scaling is enabled."""
        return self._enabled

    def _found_inf_per_device(self, optimizer) -> Dict[torch.device, torch.Tensor]:
        """torch's private accessor, used by some trainers: this iteration's found_inf per device."""
        rec = self._it.records.get(id(optimizer))
        flags = None if rec is None or rec.flags is None else rec.flags.fold()
        return {} if flags is None else {flags.found_inf.device: flags.found_inf}

    def _check_inf_per_device(self, optimizer) -> Dict[torch.device, torch.Tensor]:
        """torch's private read-only check, used by some trainers."""
        self._s.require("_check_inf_per_device()")
        self._run_check(optimizer, self._it.record(optimizer, "_check_inf_per_device()"), unscale=False, sync=False)
        return self._found_inf_per_device(optimizer)
