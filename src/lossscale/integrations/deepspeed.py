"""DeepSpeed: `attach(engine)` puts lossscale where a `DeepSpeedEngine` keeps its loss scale.

```python
engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
scaler = lossscale.integrations.deepspeed.attach(engine)     # right after initialize()
# the loop is unchanged: loss = engine(batch); engine.backward(loss); engine.step()
# engine.save_checkpoint(dir) / engine.load_checkpoint(dir) carry the scaler's state
lossscale.integrations.deepspeed.log_health(engine)          # after the loop
```

DeepSpeed has two fp16 modes, and both work, with ZeRO stages 0 to 3:

- `"torch_autocast": {"enabled": true, "dtype": "torch.float16"}`: the engine builds a
  `torch.amp.GradScaler`; `attach` replaces it with a `lossscale.GradScaler` and returns it. Two
  DeepSpeed gaps are closed on the way: ZeRO-1/2/3 check the gradients themselves and return before
  their scaler's `step`/`update` on an overflow, so a stock scaler never backs off (here the overflow
  reaches the scaler); ZeRO-0 decides a skipped step from `optimizer.overflow`, which a torch optimizer
  lacks (here the optimizer reports the scaler's decision: one host sync per step for a fused
  optimizer, none otherwise).
- `"fp16": {"enabled": true, ...}` (classic): DeepSpeed keeps the scale itself; `attach` replaces it
  with a `LossScaler` and returns that.

``LossScaler(policy, loss_check=True)``
: Built on first access (it subclasses DeepSpeed's `LossScalerBase`; importing this module must not
  import DeepSpeed); `attach(engine)` builds it from the engine's fp16 config
  (`LossScaler.from_engine(engine, **overrides)`: `initial_scale_power`, `loss_scale_window`,
  `hysteresis`, `consecutive_hysteresis`, `min_loss_scale`, or `loss_scale` for a static scale;
  `overrides` are `lossscale.DynamicPolicy` fields and `loss_check`). Its arithmetic is DeepSpeed's
  `DynamicLossScaler`'s, bitwise, including DeepSpeed's growth timing (the first growth after the
  start or an overflow takes `loss_scale_window + 1` clean steps), plus the loss check, the health
  account (`health()`, `counters()`, `metrics()`, `get_scale()`, `state()`, `last_step_skipped`) and,
  where DeepSpeed raised "Current loss scale already at minimum", a diagnosis (`on_stuck="raise"` by
  default). `cur_scale` (what DeepSpeed logs as the loss scale) is the scale the gradients in flight
  carry; `get_scale()` is the policy's scale now.

In classic mode two DeepSpeed bugs are fixed: DeepSpeed updates the scale before it unscales, so on a
growth step the gradients were divided by twice the scale backward used (here they are divided by the
scale they carry); and without ZeRO `engine.backward` did not scale the loss for the FP16 optimizers,
whose `step` still divided the gradients by the scale (here the engine scales the loss). DeepSpeed's
ZeRO-0 optimizers also ignore `hysteresis`; lossscale follows the config.

Checkpoints: DeepSpeed does not save a torch_autocast scaler (a resumed run restarts at 2**16).
`attach` adds the scaler's `state_dict()` to the checkpoint's `client_state` under
`"lossscale_scaler"` in `engine.save_checkpoint` and loads it back in `engine.load_checkpoint`
(removing it from the client state returned), in every mode and stage.

Tested with deepspeed 0.19.8 on CPU (`DS_ACCELERATOR=cpu`, one rank on gloo), and classic fp16 with
0.19.6 too (the release OpenRLHF pins; ZeRO torch_autocast needs 0.19.8, see `ZERO_AUTOCAST_MIN`).
"""

from __future__ import annotations

import math
from typing import Any, Dict

from . import _require

__all__ = ["attach", "log_health", "LossScaler"]

#: The key of the scaler's state in the checkpoint's client_state.
CLIENT_STATE_KEY = "lossscale_scaler"
_ATTR = "_lossscale_scaler"
_CLASS = "LossScaler"


def attach(engine, scaler=None, **scaler_kwargs):
    """Make ``engine`` scale FP16 losses with lossscale; returns the scaler.

    Call it right after ``deepspeed.initialize(...)``, before training. In ``torch_autocast`` mode it
    installs a ``lossscale.GradScaler`` (``scaler``, or one built from ``scaler_kwargs``: GradScaler's
    keywords, the device defaulting to DeepSpeed's accelerator) and returns it. In classic ``fp16``
    mode it installs and returns a ``LossScaler`` whose numbers are the config's
    (``initial_scale_power``, ``loss_scale_window``, ``hysteresis``, ``consecutive_hysteresis``,
    ``min_loss_scale``, or ``loss_scale`` for a static scale); ``scaler_kwargs`` are
    ``lossscale.DynamicPolicy`` fields that override them (``on_stuck="warn"``, ...) and
    ``loss_check``.

    Called again on the same engine, it returns the scaler installed first (other arguments then
    raise ValueError). ValueError for an engine without fp16 (bf16 and fp32 need no loss scaler).
    """
    _require("deepspeed")
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine

    if not isinstance(engine, DeepSpeedEngine):
        raise ValueError(f"engine={type(engine).__name__}(...) must be the DeepSpeedEngine deepspeed.initialize() returned.")
    attached = engine.__dict__.get(_ATTR)
    if attached is not None:
        if scaler is None and not scaler_kwargs or scaler is attached:
            return attached
        raise ValueError("a lossscale scaler is already attached to this engine (attach(engine) returns it); a second "
                         "one would leave the first out of training.")
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    optimizer = engine.optimizer
    zero = isinstance(optimizer, ZeROOptimizer)
    if engine.torch_autocast_enabled() and engine.torch_autocast_dtype() == torch.float16:
        installed = _attach_autocast(engine, optimizer, zero, scaler, scaler_kwargs)
    elif engine.fp16_enabled():
        if scaler is not None:
            raise ValueError("scaler= is for torch_autocast mode; in classic fp16 mode attach() builds a LossScaler "
                             "from the config (pass its keywords instead).")
        installed = _attach_classic(engine, optimizer, zero, scaler_kwargs)
    else:
        raise ValueError("the engine trains without fp16 (config 'fp16.enabled' is false and 'torch_autocast' is not "
                         "float16): bf16 and fp32 need no loss scaler. For bf16, lossscale.GradScaler.passthrough() "
                         "still skips non-finite steps in your own loop.")
    engine.__dict__[_ATTR] = installed
    engine.save_checkpoint = _saving(engine.save_checkpoint, installed)
    engine.load_checkpoint = _loading(engine, engine.load_checkpoint, installed)
    return installed


def log_health(engine, step=None):
    """Report the run's health after training; returns the ``lossscale.HealthReport``.

    Logs the paragraph on rank 0 (DeepSpeed's logger: INFO when healthy, WARNING otherwise) and, when
    the engine has monitors (``tensorboard``, ``wandb``, ``csv_monitor`` in the config), writes its
    numbers as ``scaler/health/...`` events at ``step`` (default: ``engine.global_steps``).
    """
    _require("deepspeed")
    import logging

    from deepspeed.utils import log_dist

    from .loggers import scalars

    scaler = getattr(engine, "__dict__", {}).get(_ATTR)
    if scaler is None:
        raise ValueError(f"engine={type(engine).__name__}(...) has no lossscale scaler: call "
                         "lossscale.integrations.deepspeed.attach(engine) after deepspeed.initialize().")
    report = scaler.health()
    log_dist(report.text, ranks=[0], level=logging.INFO if report.verdict == "healthy" else logging.WARNING)
    monitor = getattr(engine, "monitor", None)
    if monitor is not None and getattr(monitor, "enabled", False):
        at = engine.global_steps if step is None else step
        values = scalars(report.metrics(prefix=""), prefix="scaler/health/")
        monitor.write_events([(name, value, at) for name, value in values.items()])
    return report


# ------------------------------------------------------------------------------ torch_autocast mode
def _attach_autocast(engine, optimizer, zero, scaler, kwargs):
    from deepspeed.accelerator import get_accelerator

    from ..scaler import GradScaler

    if scaler is None:
        kwargs.setdefault("device", get_accelerator().device_name())
        scaler = GradScaler(**kwargs)
    elif kwargs:
        raise ValueError(f"pass either scaler= or GradScaler keywords ({', '.join(kwargs)}), not both.")
    elif not isinstance(scaler, GradScaler):
        raise ValueError(f"scaler={scaler!r} must be a lossscale.GradScaler (or None to build one).")
    if zero:
        _require_zero_autocast_overflow_check()
        # zero/stage_1_and_2.py:2976-2978, stage3.py:1240-1242 step and update it, once per group.
        groups = optimizer.torch_autocast_gradscaler = _GroupSteps(scaler)
        zero_step = optimizer.step

        def step(*args, **kwargs):
            out = zero_step(*args, **kwargs)
            if groups.finish():  # the iteration ends with ZeRO's step, not with each group's
                # A skip ZeRO's own check did not see (a skip_if spike): the engine reads this after the
                # step to count it and hold the LR scheduler (engine.py:3535-3551). One sync if fused.
                optimizer.overflow = optimizer.overflow or bool(scaler.last_step_skipped)
            return out

        optimizer.step = step  # engine.py:3516 calls it
        # On an overflow, ZeRO returns before the scaler's step (stage_1_and_2.py:3046-3064) and
        # calls only loss_scaler.update_scale(True): a reporter there tells the scaler.
        optimizer.loss_scaler = _overflow_reporter_class()(scaler)
    else:
        engine.torch_autocast_z0_gradscaler = scaler  # engine.py:3374, 3420, 3509-3514 use it
        _report_skips(optimizer, scaler)
    return scaler


class _GroupSteps:
    """What ZeRO-1/2/3 hold as ``torch_autocast_gradscaler``: the lossscale scaler, stepped for each
    parameter (sub)group and updated once per ZeRO step.

    ZeRO steps one (sub)group at a time, calling ``step(optimizer)`` then ``update()`` for each
    (stage_1_and_2.py:2967-2984, stage3.py:1235-1262). With a stock GradScaler and two groups
    (transformers' Trainer makes two: decay and no decay) every iteration counts twice towards growth,
    and on a growth step the later groups are unscaled by twice the scale their gradients carry
    (measured here: the scale grew after 2 clean steps of 3). Here each group is one more optimizer of
    the iteration, as in torch's several-optimizers recipe, all unscaled by the scale backward used;
    ``update()`` waits for ZeRO's ``step()`` to return (``finish``). Other attributes (``scale``,
    ``get_scale``, ...) are the scaler's."""

    def __init__(self, scaler):
        self.scaler = scaler
        self._views = []   # one per (sub)group, in the order ZeRO steps them, kept from step to step
        self._stepped = 0  # the groups stepped this iteration

    def step(self, optimizer, *args, **kwargs):
        """Step the group ZeRO put in ``optimizer.param_groups`` (unscale, check, step or skip)."""
        # The k-th group's view: a second object of the optimizer's class over the same __dict__. To the
        # scaler another optimizer, whose identity keys its record of the iteration and its skip_if
        # windows, so it is the same object every step; to everything else the optimizer itself (its
        # state, its step, the grad_scale/found_inf a fused kernel reads).
        k = self._stepped
        if k == len(self._views) or self._views[k].__dict__ is not optimizer.__dict__:
            view = object.__new__(type(optimizer))
            view.__dict__ = optimizer.__dict__
            self._views[k:k + 1] = [view]
        self._stepped += 1
        return self.scaler.step(self._views[k], *args, **kwargs)

    def update(self):
        """Nothing yet: ZeRO calls it after each group; ``finish`` updates once, after the last."""

    def finish(self) -> bool:
        """End the iteration (``scaler.update()``) if ZeRO stepped any group (not after an overflow:
        ZeRO reported it through ``loss_scaler`` and stepped none); returns whether it did."""
        if not self._stepped:
            return False
        self._stepped = 0
        self.scaler.update()
        return True

    def __getattr__(self, name: str):
        return getattr(self.scaler, name)

    def __repr__(self) -> str:
        return f"_GroupSteps({self.scaler!r})"


#: The first deepspeed whose ZeRO-1/2/3 torch_autocast path checks the gradients for overflow itself
#: (``check_grad_overflow``) and reports it through ``optimizer.loss_scaler``, which attach() relies on.
#: Before it (0.19.0-0.19.7, measured with benchmarks/compat.py and each release's tests), ZeRO clips and
#: steps without that check, and with lossscale attached a ZeRO-2 step with an inf gradient moved the
#: weights: refused rather than half-working.
ZERO_AUTOCAST_MIN = "0.19.8"


def _require_zero_autocast_overflow_check() -> None:
    import deepspeed
    from packaging.version import Version

    if Version(deepspeed.__version__) < Version(ZERO_AUTOCAST_MIN):
        raise RuntimeError(
            f"lossscale.integrations.deepspeed.attach: ZeRO with torch_autocast float16 needs deepspeed>="
            f"{ZERO_AUTOCAST_MIN} (this is {deepspeed.__version__}, whose ZeRO steps without checking the gradients "
            f"for overflow in that mode). Upgrade (pip install 'deepspeed>={ZERO_AUTOCAST_MIN}'), or use the classic "
            "'fp16' config, or ZeRO stage 0.")


def _report_skips(optimizer, scaler) -> None:
    """Give the (torch) optimizer an ``overflow`` that is the scaler's decision: the engine reads it
    after every step to count skipped steps and to hold the LR scheduler (engine.py:3535-3551)."""
    base = getattr(type(optimizer), "_lossscale_base", type(optimizer))
    optimizer.__class__ = type(base.__name__, (base,), {
        "__module__": base.__module__,
        "__doc__": base.__doc__,
        "_lossscale_base": base,
        "_lossscale_scaler": scaler,
        "overflow": property(lambda self: bool(type(self)._lossscale_scaler.last_step_skipped),
                             doc="Whether the last step was skipped (the lossscale scaler's decision)."),
        "__reduce_ex__": _reduce_optimizer,
    })


def _rebuild_optimizer(base, scaler, state):
    obj = base.__new__(base)
    obj.__setstate__(state)
    _report_skips(obj, scaler)
    return obj


def _reduce_optimizer(self, protocol):
    cls = type(self)
    return _rebuild_optimizer, (cls._lossscale_base, cls._lossscale_scaler, self.__getstate__())


def _overflow_reporter_class():
    cls = globals().get("_OverflowReporter")
    if cls is not None:
        return cls
    from deepspeed.runtime.fp16.loss_scaler import LossScalerBase

    class _OverflowReporter(LossScalerBase):
        """ZeRO's ``loss_scaler`` in torch_autocast mode: scale 1 (the lossscale scaler scales and
        unscales), and the overflows ZeRO decides itself passed on to the scaler."""

        def __init__(self, scaler):
            super().__init__(1.0)
            self.scaler = scaler

        def update_scale(self, overflow):
            """On an overflow, tell the scaler, which answers it as one of its own checks' (counted as
            inf: ZeRO does not say whether it was NaN). ZeRO then skips the scaler's step() and update()."""
            if overflow:
                self.scaler.record_overflow()

        def __repr__(self) -> str:
            return f"_OverflowReporter({self.scaler!r})"

    _OverflowReporter.__module__ = __name__
    _OverflowReporter.__qualname__ = "_OverflowReporter"  # pickled into ZeRO checkpoints (stage_1_and_2.py:3370)
    globals()["_OverflowReporter"] = _OverflowReporter
    return _OverflowReporter


# ------------------------------------------------------------------------------ classic fp16 mode
def _attach_classic(engine, optimizer, zero, kwargs):
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    scaler = _loss_scaler_class().from_engine(engine, **kwargs)
    if zero:
        optimizer.loss_scaler = scaler  # zero/stage_1_and_2.py:722, stage3: every use goes through it
        return scaler
    if not isinstance(optimizer, (FP16_Optimizer, FP16_UnfusedOptimizer)):
        raise ValueError(f"engine.optimizer is a {type(optimizer).__name__}; attach() knows DeepSpeed's fp16 optimizers "
                         "(ZeRO-1/2/3, FP16_Optimizer, FP16_UnfusedOptimizer).")
    if optimizer.custom_loss_scaler:
        raise ValueError("engine.optimizer has an external loss scale (override_loss_scale()); attach() would replace "
                         "it. Drop the override to use lossscale's scale.")
    # The FP16 optimizer's own rule (fused_optimizer.py:404-430, unfused_optimizer.py:277-302) becomes
    # lossscale's; its unscale reads loss_scale_config.cur_scale, kept at the scale backward used.
    optimizer._update_scale = _fp16_update_scale(optimizer, scaler)
    # engine.backward scales the loss only through this hook for a non-ZeRO optimizer
    # (engine.py:3417-3420); its step() and update() calls then run the FP16 optimizer's step.
    engine.torch_autocast_z0_gradscaler = _Fp16Hook(optimizer, scaler)
    return scaler


def _fp16_update_scale(optimizer, scaler):
    def update_scale(skip):
        scaler.update_scale(bool(skip))
        optimizer.loss_scale_config.cur_iter += 1  # DeepSpeed's own count, saved in its state_dict

    return update_scale


class _Fp16Hook:
    """What ``engine.torch_autocast_z0_gradscaler`` is asked for, for ``FP16_Optimizer``: scale the loss
    (the engine does not otherwise, engine.py:3417-3420); its step is the FP16 optimizer's own."""

    def __init__(self, optimizer, scaler):
        self.optimizer, self.scaler = optimizer, scaler

    def scale(self, loss):
        """The loss times the scale; the FP16 optimizer unscales by the same scale."""
        scaled = self.scaler.scale_loss(loss)
        self.optimizer.loss_scale_config.cur_scale = self.scaler.cur_scale
        return scaled

    def unscale_(self, optimizer):
        """Nothing: the FP16 optimizer unscales and clips inside its step (fused_optimizer.py:374)."""

    def step(self, optimizer):
        """The FP16 optimizer's step: its overflow check, the scale update, unscale, clip, step."""
        return optimizer.step()

    def update(self):
        """Nothing: the FP16 optimizer's step updated the scale."""

    def __bool__(self) -> bool:
        return True


def _loss_scaler_class():
    cls = globals().get(_CLASS)
    if cls is not None:
        return cls
    _require("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import LossScalerBase

    from ..dynamic import DynamicPolicy
    from ..static import StaticPolicy
    from ._host import HostPolicy

    class LossScaler(LossScalerBase):
        """DeepSpeed's ``DynamicLossScaler`` as a lossscale policy, with a health account.

        The rule is ``lossscale.DynamicPolicy``'s with the config's numbers (``growth_interval`` =
        ``loss_scale_window``, ``hysteresis``, ``consecutive_hysteresis``, ``min_scale`` =
        ``min_loss_scale``, factor 2, no cap), with DeepSpeed's growth timing: its window counts from
        the overflow's iteration (loss_scaler.py:283 ``stable_interval = cur_iter - last_overflow_iter
        - 1``), so the first growth after the start or an overflow needs ``loss_scale_window + 1``
        clean steps, later ones ``loss_scale_window``. ``on_stuck="raise"`` by default where
        DeepSpeed raised at the minimum (``raise_error_at_min_scale``): a RuntimeError with a
        diagnosis.

        ``cur_scale`` (and ``loss_scale``) is the scale of the gradients in flight: what the last
        ``scale_loss`` multiplied by. ``update_scale(overflow)`` advances the policy; its new scale
        applies from the next ``scale_loss``, so an unscale after the update divides by the scale
        backward used. ``scaler.get_scale()`` is the policy's scale now.

        Build it with ``attach(engine)``, or ``LossScaler(policy)``.
        """

        def __init__(self, policy, loss_check: bool = True) -> None:
            # LossScalerBase.__init__ only sets cur_scale and dynamic (loss_scaler.py:139-141); cur_scale
            # is a property here, so it is not called.
            self._host = HostPolicy(policy, loss_check=loss_check)
            self.dynamic = not isinstance(policy, StaticPolicy)
            self._in_flight = self._host.state.scale
            self._window_pending = True  # DeepSpeed's window starts one clean step late (see the class doc)

        @classmethod
        def from_engine(cls, engine, **overrides):
            """The scaler DeepSpeed would build from ``engine``'s fp16 config, with ``overrides``
            (``lossscale.DynamicPolicy`` fields, or ``loss_check``)."""
            loss_check = overrides.pop("loss_check", True)
            stuck = {k: overrides.pop(k) for k in ("on_stuck", "max_consecutive_skips") if k in overrides}
            if not engine.dynamic_loss_scale():
                if overrides:
                    raise ValueError(f"the config sets a static loss_scale, so {', '.join(overrides)} do(es) not "
                                     "apply; remove fp16.loss_scale for a dynamic scale.")
                return cls(StaticPolicy(scale=float(engine.loss_scale()), **stuck), loss_check=loss_check)
            # precision_config.py:202-209: what DeepSpeed builds its DynamicLossScaler from.
            args = engine.dynamic_loss_scale_args()
            numbers = dict(init_scale=float(args["init_scale"]), growth_factor=2.0, backoff_factor=0.5,
                           growth_interval=int(args["scale_window"]), hysteresis=int(args["delayed_shift"]),
                           consecutive_hysteresis=bool(args["consecutive_hysteresis"]),
                           min_scale=float(args["min_scale"]), max_scale=None, on_stuck="raise")
            numbers.update(stuck)
            numbers.update(overrides)
            return cls(DynamicPolicy(**numbers), loss_check=loss_check)

        # ---------------------------------------------------------------- what DeepSpeed calls
        @property
        def cur_scale(self) -> float:
            """The scale the gradients in flight carry (the last ``scale_loss``'s)."""
            return self._in_flight

        @cur_scale.setter
        def cur_scale(self, value) -> None:
            # DeepSpeed's loss_scale setter (stage_1_and_2.py:3319): a new scale from now on.
            value = float(value)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"cur_scale={value!r} must be a finite number > 0.")
            self._host.set_state(self._host.policy, self._host.state.replace(scale=value))
            self._in_flight = self._host.state.scale

        def scale_loss(self, loss):
            """``loss * scale`` (loss_scaler.py:157-161), noting first whether ``loss`` is non-finite
            (a device flag, no sync). The policy's current scale becomes the in-flight one."""
            self._host.check_loss(loss)
            self._in_flight = self._host.state.scale
            return loss * self._in_flight

        def update_scale(self, overflow) -> None:
            """One iteration: ``overflow`` as DeepSpeed decided it. Raises or warns per ``on_stuck``."""
            overflow = bool(overflow)
            host = self._host
            if not overflow and self._window_pending:
                # DeepSpeed does not count the first clean step after the start or an overflow.
                host.state = host.state.replace(growth_tracker=-1) if hasattr(host.state, "growth_tracker") else host.state
                self._window_pending = False
            bad_before = host.state.bad_loss_steps
            state = host.update(overflow)
            if overflow and state.bad_loss_steps == bad_before:  # a bad loss keeps the trackers (and the window)
                self._window_pending = True

        # ---------------------------------------------------------------- readouts
        @property
        def policy(self):
            """The lossscale policy (a frozen config object)."""
            return self._host.policy

        def state(self):
            """The policy's state (a frozen dataclass of plain values). No sync."""
            return self._host.state

        def get_scale(self) -> float:
            """The policy's scale now (the next backward's). No sync."""
            return self._host.state.scale

        @property
        def last_step_skipped(self) -> bool:
            """Whether the last update was an overflow (its step skipped). No sync."""
            return self._host.state.overflow_streak > 0

        @property
        def cur_hysteresis(self) -> int:
            """Overflows left before the scale backs off (DeepSpeed's name)."""
            return getattr(self._host.state, "hysteresis_tracker", 1)

        def health(self):
            """The run's health account (``lossscale.HealthReport``; see lossscale.health). No sync."""
            return self._host.health()

        def counters(self) -> Dict[str, int]:
            """Steps, skipped, inf, NaN and bad-loss steps, and the current streak. No sync."""
            return self._host.counters()

        def metrics(self) -> Dict[str, Any]:
            """``loss_scale``, the counters and ``last_step_skipped``, for any logger. No sync."""
            return self._host.metrics()

        def state_dict(self) -> Dict[str, Any]:
            """lossscale's complete state (``lossscale.GradScaler.state_dict()``'s format) and the window flag."""
            return {"lossscale": self._host.state_dict(), "window_pending": self._window_pending}

        def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
            """Load ``state_dict``'s format, or a ``lossscale.GradScaler``'s. ValueError naming the key."""
            if not isinstance(state_dict, dict):
                raise ValueError(f"state_dict must be a dict, got {type(state_dict).__name__}.")
            inner = state_dict.get("lossscale", state_dict)
            self._host.load_state_dict(inner)
            self._window_pending = bool(state_dict.get("window_pending", False))
            self._in_flight = self._host.state.scale

        def __repr__(self) -> str:
            return f"lossscale.integrations.deepspeed.LossScaler({self._host.policy!r}, scale={self.get_scale():g})"

    LossScaler.__module__ = __name__
    LossScaler.__qualname__ = _CLASS  # pickle finds it by name (DeepSpeed pickles ZeRO's loss_scaler)
    globals()[_CLASS] = LossScaler
    return LossScaler


# ------------------------------------------------------------------------------ checkpoints
def _saving(save_checkpoint, scaler):
    """``engine.save_checkpoint`` with the scaler's state in ``client_state`` (engine.py:4869)."""

    def wrapped(save_dir, tag=None, client_state=None, *args, **kwargs):
        client_state = dict(client_state or {})
        client_state[CLIENT_STATE_KEY] = scaler.state_dict()
        return save_checkpoint(save_dir, tag, client_state, *args, **kwargs)

    wrapped.__doc__ = save_checkpoint.__doc__
    return wrapped


def _loading(engine, load_checkpoint, scaler):
    """``engine.load_checkpoint`` that loads the scaler's state from the client state (engine.py:4395)
    and keeps the attached scaler in place: ZeRO replaces ``optimizer.loss_scaler`` with the pickled
    one it saved (stage_1_and_2.py:3668)."""

    def wrapped(*args, **kwargs):
        optimizer = engine.optimizer
        kept = getattr(optimizer, "loss_scaler", None)
        load_path, client_state = load_checkpoint(*args, **kwargs)
        if kept is not None and getattr(optimizer, "loss_scaler", None) is not kept:
            optimizer.loss_scaler = kept
        if client_state and CLIENT_STATE_KEY in client_state:
            scaler.load_state_dict(client_state.pop(CLIENT_STATE_KEY))
        hook = engine.torch_autocast_z0_gradscaler
        if isinstance(hook, _Fp16Hook):  # FP16_Optimizer.load_state_dict set its own cur_scale
            hook.optimizer.loss_scale_config.cur_scale = scaler.cur_scale
        return load_path, client_state

    wrapped.__doc__ = load_checkpoint.__doc__
    return wrapped


def __getattr__(name: str):
    # LossScaler subclasses DeepSpeed's LossScalerBase: build it (importing deepspeed) on first lookup.
    if name == _CLASS:
        return _loss_scaler_class()
    if name == "_OverflowReporter":
        return _overflow_reporter_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
