"""Megatron-core: `GradScaler`, a `MegatronGradScaler` backed by a lossscale policy.

Megatron-core's fp16 optimizers (`Float16OptimizerWithFloat16Params`, `DistributedOptimizer`,
`ChainedOptimizer`; NeMo, verl's Megatron backend and slime build on them) take a grad scaler with
`scale`, `inv_scale`, `update(found_inf)`, `state_dict` and `load_state_dict`. They unscale and check
the gradients themselves and call `update(found_inf)` with a host bool. This one is a drop-in for
their `DynamicGradScaler`:

```python
from lossscale.integrations import megatron as ls_megatron

optimizer = get_megatron_optimizer(config, model_chunks)          # fp16=True
scaler = ls_megatron.attach(optimizer)                             # or GradScaler(...) by hand
model_config.grad_scale_func = scaler.scale_loss                   # optional: the loss check
...
ls_megatron.log_health(optimizer)                                  # after training
```

``GradScaler(initial_scale=2**32, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=1000, hysteresis=2, *, policy=None, device=None, loss_check=True, on_stuck="warn", max_consecutive_skips=None)``
: Built on first access (it subclasses Megatron-core's `MegatronGradScaler`, and importing this module
  must not import Megatron). The six numbers are `DynamicGradScaler`'s, in its order, with the defaults
  of Megatron-core's `OptimizerConfig`. `policy`: a lossscale policy object instead of the six numbers
  (`lossscale.DynamicPolicy(..., consecutive_hysteresis=True)`, `lossscale.StaticPolicy(scale=...)`).
  `device`: where `scale` lives (Megatron: "cuda"); default CUDA when available, else CPU.
  `loss_check`: skip a step whose loss was non-finite before scaling without backing off, where the
  loss goes through `scale_loss`. `on_stuck`, `max_consecutive_skips`: as in `lossscale.DynamicPolicy`.
  Besides Megatron's interface it has `scale_loss(loss)`, `update(found_inf, found_nan=None)`,
  `health()`, `counters()`, `metrics()` and `get_scale()`.

Configured the same, it is bitwise Megatron's `DynamicGradScaler`: the same float32 scale after every
update, hysteresis included. What it adds:

- the health account (`scaler.health()`) and `scaler.counters()`;
- inf told from NaN: `attach` lets the scaler look at the optimizer's main gradients on an overflow
  step (one pass, on overflow steps only), or pass `update(found_inf, found_nan=...)`;
- a bad-loss skip: with `grad_scale_func = scaler.scale_loss` (Megatron's pipeline schedules scale the
  loss through it) a loss already inf/NaN before scaling skips the step without backing the scale off;
- a diagnosis (`lossscale.diagnose`) when an overflow comes at `min_scale`, per `on_stuck`, where
  Megatron halves on at the floor without a word.

`state_dict()` is Megatron's three keys (`scale` a 1-element tensor, `growth_tracker`,
`hysteresis_tracker`) plus lossscale's complete state under `"lossscale"`; `load_state_dict` takes
either (a Megatron checkpoint continues exactly as Megatron's scaler would).

Tested with megatron-core 0.16.1 and 0.16.0 on CPU (Megatron's own classes put their tensors on CUDA;
the tests run them on CPU through a test-only function mode).
"""  # noqa: E501  the GradScaler signature above is a Markdown definition-list term: one line

from __future__ import annotations

from typing import Any, Dict

from . import _require

__all__ = ["GradScaler", "attach", "log_health"]  # noqa: F822  GradScaler: built on first access (__getattr__)

_CLASS = "GradScaler"
_KEY = "lossscale"


def _require_megatron() -> None:
    """``lossscale.integrations._require`` for megatron-core, whose pip name is not its import name."""
    try:
        _require("megatron")
    except ModuleNotFoundError as error:
        if error.name != "megatron":
            raise
        raise ModuleNotFoundError(
            "lossscale.integrations.megatron needs megatron-core, which is not installed: pip install "
            'megatron-core, or, in a lossscale checkout, pip install -c constraints.txt -e ".[integrations]".',
            name="megatron",
        ) from error


def _build_class():
    """The ``MegatronGradScaler`` subclass (built on first use: importing megatron takes seconds)."""
    _require_megatron()
    import torch
    from megatron.core.optimizer.grad_scaler import MegatronGradScaler

    from ..dynamic import DynamicPolicy
    from ._host import HostPolicy

    class GradScaler(MegatronGradScaler):
        """Megatron-core's ``DynamicGradScaler``, as a lossscale policy with a health account.

        Args:
            initial_scale: the first scale (Megatron-core passes ``OptimizerConfig.initial_loss_scale``).
                Default 2**32. These six numbers are Megatron's ``DynamicGradScaler``'s, in its order
                (Megatron-core builds it in optimizer/__init__.py:436-443), with that config's defaults.
            min_scale: the lower bound (``min_loss_scale``). Default 1.0.
            growth_factor: the multiplier after ``growth_interval`` clean steps. Default 2.0.
            backoff_factor: the multiplier on overflow once ``hysteresis`` is spent. Default 0.5.
            growth_interval: clean steps before a growth (``loss_scale_window``). Default 1000.
            hysteresis: overflows tolerated before backing off (``hysteresis``). Default 2.
            policy: a lossscale policy object instead of the six numbers (e.g.
                ``lossscale.DynamicPolicy(..., consecutive_hysteresis=True)`` or
                ``lossscale.StaticPolicy(scale=...)``); then none of them may be given.
            device: where ``scale`` lives (Megatron: "cuda"); default CUDA when available, else CPU.
            loss_check: skip a step whose loss was non-finite before scaling without backing off,
                where the loss goes through ``scale_loss``.
            on_stuck: as in ``lossscale.DynamicPolicy`` ("warn" by default: a diagnosis when an
                overflow comes at ``min_scale``; "raise" stops training).
            max_consecutive_skips: as in ``lossscale.DynamicPolicy``.
        """

        def __init__(
            self,
            initial_scale: float = 2.0**32,
            min_scale: float = 1.0,
            growth_factor: float = 2.0,
            backoff_factor: float = 0.5,
            growth_interval: int = 1000,
            hysteresis: int = 2,
            *,
            policy=None,
            device=None,
            loss_check: bool = True,
            on_stuck: str = "warn",
            max_consecutive_skips=None,
        ) -> None:
            # MegatronGradScaler.__init__ makes its tensor on 'cuda' (grad_scaler.py:15): not called.
            numbers = dict(
                initial_scale=initial_scale,
                min_scale=min_scale,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
                hysteresis=hysteresis,
            )
            if policy is None:
                # Megatron's rule is DynamicPolicy's with hysteresis refilled only by a growth, no cap.
                policy = DynamicPolicy(
                    init_scale=float(initial_scale),
                    growth_factor=growth_factor,
                    backoff_factor=backoff_factor,
                    growth_interval=growth_interval,
                    hysteresis=hysteresis,
                    consecutive_hysteresis=False,
                    min_scale=min_scale,
                    max_scale=None,
                    on_stuck=on_stuck,
                    max_consecutive_skips=max_consecutive_skips,
                )
            elif numbers != dict(
                initial_scale=2.0**32,
                min_scale=1.0,
                growth_factor=2.0,
                backoff_factor=0.5,
                growth_interval=1000,
                hysteresis=2,
            ):
                raise ValueError(
                    "policy= was given, so the scale numbers (initial_scale, min_scale, ...) must be set "
                    "on the policy object, not passed to GradScaler as well."
                )
            if device is None:
                device = "cuda" if torch.cuda.is_available() else "cpu"
            self._host = HostPolicy(policy, loss_check=loss_check)
            self._optimizers = []  # Megatron optimizers whose main gradients tell NaN from inf (attach)
            self._scale = torch.tensor([self._host.state.scale], dtype=torch.float, device=device)

        # Megatron's `scale` and `inv_scale` properties read self._scale (grad_scaler.py:17-23): kept.

        def scale_loss(self, loss):
            """``scale * loss``, as ``MegatronOptimizer.scale_loss`` (optimizer.py:246-248), after noting
            whether ``loss`` is already non-finite (a device flag, no sync). Set
            ``model_config.grad_scale_func = scaler.scale_loss`` to use the loss check."""
            self._host.check_loss(loss)
            return self.scale * loss

        def update(self, found_inf: bool, found_nan=None) -> None:
            """One iteration: ``found_inf`` as Megatron's optimizer passes it (optimizer.py:553).
            ``found_nan``: whether NaN was among the non-finite gradients; None: look at the main
            gradients of the optimizers ``attach`` linked (on overflow steps only), else inf.
            One host-to-device copy of the scale when it moves."""
            found_inf = bool(found_inf)
            if found_nan is None:
                found_nan = found_inf and self._main_grads_hold_nan()
            before = self._host.state.scale
            state = self._host.update(found_inf, bool(found_nan))
            if state.scale != before:
                self._scale.fill_(state.scale)

        def _main_grads_hold_nan(self) -> bool:
            for optimizer in self._optimizers:
                # Megatron's list of main gradients for the norm (optimizer.py:136); unscaled in place
                # by then, and an inf stays inf, a NaN NaN.
                grads = optimizer.get_main_grads_for_grad_norm()
                if grads and bool(torch.stack([g.isnan().any() for g in grads]).any()):
                    return True
            return False

        # ------------------------------------------------------------------ readouts
        @property
        def policy(self):
            """The lossscale policy (a frozen config object)."""
            return self._host.policy

        def state(self):
            """The policy's state (a frozen dataclass of plain values). No sync."""
            return self._host.state

        def get_scale(self) -> float:
            """The current scale as a Python float. No sync."""
            return self._host.state.scale

        @property
        def last_step_skipped(self) -> bool:
            """Whether the last update was an overflow (its step skipped). No sync."""
            return self._host.state.overflow_streak > 0

        def health(self):
            """The run's health account (``lossscale.HealthReport``; see lossscale.health). No sync."""
            return self._host.health()

        def counters(self) -> Dict[str, int]:
            """Steps, skipped, inf, NaN and bad-loss steps, and the current streak. No sync."""
            return self._host.counters()

        def metrics(self) -> Dict[str, Any]:
            """``loss_scale``, the counters and ``last_step_skipped``, for any logger. No sync."""
            return self._host.metrics()

        # ------------------------------------------------------------------ checkpoints
        def state_dict(self) -> Dict[str, Any]:
            """Megatron's keys (grad_scaler.py:132-137) and lossscale's complete state under "lossscale"."""
            s = self._host.state
            return {
                "scale": self._scale.detach().clone(),
                "growth_tracker": int(getattr(s, "growth_tracker", 0)),
                "hysteresis_tracker": int(getattr(s, "hysteresis_tracker", 1)),
                _KEY: self._host.state_dict(),
            }

        def load_state_dict(self, state_dict: Dict) -> None:
            """Load ``state_dict``'s, Megatron's ``DynamicGradScaler``'s or a ``lossscale.GradScaler``'s
            state dict. Megatron's continues as Megatron would: its scale and trackers (a spent hysteresis,
            <= 0 in Megatron, is 1 here: the next overflow backs off), this scaler's counters at zero."""
            if not isinstance(state_dict, dict):
                raise ValueError(f"state_dict must be a dict, got {type(state_dict).__name__}.")
            if _KEY in state_dict:
                self._host.load_state_dict(state_dict[_KEY])
            elif "lossscale_version" in state_dict or "_growth_tracker" in state_dict:
                self._host.load_state_dict(state_dict)  # a lossscale.GradScaler's (or torch's) state dict
            else:
                self._host.set_state(*_from_megatron(self._host.policy, state_dict))
            self._scale.fill_(self._host.state.scale)

        def __repr__(self) -> str:
            return f"lossscale.integrations.megatron.GradScaler({self._host.policy!r}, scale={self.get_scale():g})"

    GradScaler.__module__ = __name__
    GradScaler.__qualname__ = _CLASS  # pickle finds it by name (module __getattr__ builds it)
    globals()[_CLASS] = GradScaler
    return GradScaler


def _from_megatron(policy, sd: Dict) -> tuple:
    """``(policy, state)`` from a Megatron ``DynamicGradScaler.state_dict()`` (grad_scaler.py:132-142)."""
    import math

    from ..formats import f32

    missing = [k for k in ("scale", "growth_tracker", "hysteresis_tracker") if k not in sd]
    if missing:
        raise ValueError(
            f"state_dict lacks {missing}: pass a Megatron DynamicGradScaler's state_dict "
            "(scale, growth_tracker, hysteresis_tracker) or this scaler's."
        )
    scale = sd["scale"]
    scale = float(scale.reshape(-1)[0]) if hasattr(scale, "reshape") else float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"state_dict['scale']={scale!r} must be a finite number > 0.")
    growth, hyst = int(sd["growth_tracker"]), int(sd["hysteresis_tracker"])
    hysteresis = getattr(policy, "hysteresis", 1)
    state = policy.init_state().replace(scale=f32(scale))
    if hasattr(state, "growth_tracker"):
        state = state.replace(
            growth_tracker=min(max(growth, 0), policy.growth_interval - 1),
            hysteresis_tracker=min(max(hyst, 1), hysteresis),
        )
    policy.check_state(state)
    return policy, state


def attach(optimizer, scaler=None, **scaler_kwargs):
    """Give a Megatron-core fp16 optimizer a lossscale ``GradScaler``; returns the scaler.

    ``optimizer`` is what ``get_megatron_optimizer`` returns: a ``MixedPrecisionOptimizer``
    (``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer``) or a ``ChainedOptimizer`` of
    them (every one with a grad scaler gets the same scaler). Without ``scaler``, it is built from
    the scaler the optimizer holds (Megatron's ``DynamicGradScaler``: its numbers and current state,
    or a ``ConstantGradScaler``: a static policy) and ``scaler_kwargs``. On an overflow step the
    scaler looks at these optimizers' main gradients to tell NaN from inf.

    Megatron's ``ChainedOptimizer`` calls ``update`` once per chained optimizer per iteration
    (optimizer.py:1233-1239), so a scaler shared by N of them advances N times per iteration, as
    Megatron's own shared scaler does.
    """
    _require_megatron()
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler

    cls = globals().get(_CLASS) or _build_class()
    inner = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    holders = [o for o in inner if getattr(o, "grad_scaler", None) is not None]
    if not holders:
        raise ValueError(
            f"optimizer={type(optimizer).__name__}(...) has no grad scaler: build it with "
            "OptimizerConfig(fp16=True) (bf16 needs no loss scaler)."
        )
    if scaler is None:
        scaler = _from_holder(cls, holders[0].grad_scaler, ConstantGradScaler, DynamicGradScaler, scaler_kwargs)
    elif scaler_kwargs:
        raise ValueError(f"pass either scaler= or GradScaler keywords ({', '.join(scaler_kwargs)}), not both.")
    elif not isinstance(scaler, cls):
        raise ValueError(f"scaler={scaler!r} must be a lossscale.integrations.megatron.GradScaler.")
    for holder in holders:
        if not isinstance(holder.grad_scaler, MegatronGradScaler):
            raise ValueError(
                f"{type(holder).__name__}.grad_scaler is {holder.grad_scaler!r}, not a MegatronGradScaler."
            )
        holder.grad_scaler = scaler
    scaler._optimizers = holders
    return scaler


def _from_holder(cls, old, constant_cls, dynamic_cls, kwargs):
    """A ``GradScaler`` with the numbers and the state of Megatron's ``old`` scaler."""
    from ..static import StaticPolicy

    device = kwargs.pop("device", old.scale.device)
    if isinstance(old, cls):
        return old if not kwargs else cls(policy=old.policy, device=device, **kwargs)
    if isinstance(old, constant_cls):
        stuck = {k: kwargs.pop(k) for k in ("on_stuck", "max_consecutive_skips") if k in kwargs}
        return cls(policy=StaticPolicy(scale=float(old.scale.reshape(-1)[0]), **stuck), device=device, **kwargs)
    if not isinstance(old, dynamic_cls):
        raise ValueError(
            f"optimizer.grad_scaler is a {type(old).__name__}; attach() knows Megatron's "
            "DynamicGradScaler and ConstantGradScaler. Build a GradScaler(...) and pass scaler=."
        )
    numbers = dict(
        initial_scale=float(old.scale.reshape(-1)[0]),
        min_scale=float(old.min_scale.reshape(-1)[0]),
        growth_factor=float(old.growth_factor.reshape(-1)[0]),
        backoff_factor=float(old.backoff_factor.reshape(-1)[0]),
        growth_interval=old.growth_interval,
        hysteresis=old.hysteresis,
    )
    numbers.update(kwargs)
    scaler = cls(device=device, **numbers)
    scaler.load_state_dict(old.state_dict())  # its trackers: a scaler replaced mid-run continues
    return scaler


def log_health(optimizer_or_scaler, logger=None):
    """Report the run's health after training; returns the ``lossscale.HealthReport``.

    Takes the optimizer ``attach`` prepared (or the scaler). Logs the paragraph on the
    ``lossscale`` logger (or ``logger``): INFO when healthy, WARNING otherwise. No sync.
    """
    import logging

    scaler = optimizer_or_scaler
    cls = globals().get(_CLASS)
    if cls is None or not isinstance(scaler, cls):
        inner = list(getattr(optimizer_or_scaler, "chained_optimizers", None) or [optimizer_or_scaler])
        scaler = next(
            (o.grad_scaler for o in inner if cls is not None and isinstance(getattr(o, "grad_scaler", None), cls)), None
        )
    if scaler is None:
        raise ValueError(
            f"{optimizer_or_scaler!r} has no lossscale scaler: call "
            "lossscale.integrations.megatron.attach(optimizer) first."
        )
    report = scaler.health()
    log = logger or logging.getLogger("lossscale")
    log.log(logging.INFO if report.verdict == "healthy" else logging.WARNING, report.text)
    return report


def __getattr__(name: str):
    # The class subclasses Megatron's ABC: build it (importing megatron) on first lookup, not at import.
    if name == _CLASS:
        return _build_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
