"""``lossscale.GradScaler``: a drop-in for ``torch.amp.GradScaler``, a thin adapter around a pure policy.

Configured like torch (``hysteresis=1, min_scale=None, max_scale=None, loss_check=False``) it is bitwise
torch: the same float32 scale, the same fused check+unscale kernel with an inverse scale computed in
float64, the same update arithmetic, the same skip decisions. Beyond torch it adds hysteresis and
bounds, inf told from NaN, a loss check, skip-awareness, a diagnosis when training is stuck, complete
versioned checkpoints, a read-only check for fused optimizers, and a process-group reduction of the
skip decision.

The parts (``docs/architecture.md``): the policies (``policy`` and one module each), their state on
device (``_state``), this iteration's bookkeeping (``_iteration``), the gradient check (``_check``),
the stuck check (``_observe``), the first-cause report (``_overflow``), parameter names (``_names``),
checkpoints (``checkpoint``) and what differs between devices (``_device``). Two mixins hold the rest
of the class: what it tells about the run (``_readouts``: skips, counters, metrics, health, the
overflow report) and torch's getters and setters (``_torch_api``). The same operations run on every
device.

Host-device syncs, per iteration (torch pays the same):

* optimizers without amp-scaling support (SGD, Adam(foreach)): one, to decide whether to call
  ``optimizer.step()``, in :meth:`GradScaler.unscale_` (or :meth:`GradScaler.step`) so an overflow is
  classified before user code (clipping) touches the gradients, an overflow included: the decision and
  the bad-loss flag ride in one read. Whether an overflow was inf or NaN is learned on device and
  reaches the host's copy by the next sync (``StateKeeper.resolve``). The host then knows the
  iteration's flags and runs the policy's pure rule itself: the update is one host-to-device copy.
* optimizers with ``_step_supports_amp_scaling`` (``Adam(fused=True)``): none (except
  ``SGD(fused=True)`` with momentum, once, on its first step). The optimizer gets
  ``grad_scale``/``found_inf`` tensors and skips on device; the policy's tensor rule runs on device,
  and the stuck check reads a snapshot of the state copied without blocking, at a later update.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Dict, Optional, Union

import torch

from . import _device, _hints, _kernels, _overflow, checkpoint
from . import distributed as _distributed
from ._check import Flags, GradientCheck
from ._iteration import Iteration, LastUpdate, OptState, Record
from ._keywords import policy_from_keywords
from ._names import ParamNames
from ._observe import StuckCheck
from ._optimizers import (
    first_step_needs_the_host,
    step_with_flags,
    supports_amp_scaling,
    takes_grad_scaler,
    warn_grad_scaler_contract,
)
from ._outputs import map_tensors, refuse_unscalable
from ._readouts import Readouts
from ._state import StateKeeper
from ._torch_api import TorchAPI
from ._update import device_rule, host_rule, pending_nan, validate_new_scale
from ._validate import plain_bool, plain_number
from .health import Health
from .policy import Policy, ScaleState
from .static import StaticPolicy
from .telemetry import Telemetry

__all__ = ["GradScaler", "OptState", "STATE_DICT_VERSION"]

STATE_DICT_VERSION = checkpoint.STATE_DICT_VERSION


class _Default:
    """The default of torch's positional scale keywords: "not given", so the policy's own default
    applies (the defaults are spelled once, on the policy dataclasses)."""

    def __repr__(self) -> str:
        return "<policy default>"


_DEFAULT = _Default()

def _make_policy(policy, given: Dict[str, Any]):
    if isinstance(policy, str):
        return policy_from_keywords(policy, **given)
    if not isinstance(policy, Policy):
        raise ValueError(f"policy={policy!r} is neither a policy name nor a policy object (lossscale.policy.Policy).")
    if given:
        raise ValueError(
            f"policy is a policy object, so {', '.join(given)} must be set on the object, not passed "
            "to GradScaler as well."
        )
    return policy


class GradScaler(Readouts, TorchAPI):
    """Loss scaling for FP16 training: torch's ``GradScaler`` contract, exact arithmetic, and more.

    Args:
        device: "cpu", "cuda", a ``torch.device``, or None (default) to take the device of the first
            tensor passed to :meth:`scale`. Unlike torch there is no "cuda" default.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as in torch; left out,
            the policy's own defaults apply (the dynamic policy's are torch's).
        policy: "dynamic" (default, :class:`lossscale.DynamicPolicy`), "static" (a fixed
            ``init_scale``), "adaptive", "logmax", or a policy object (then no scale keyword may be given).
        model: an ``nn.Module`` or ``(name, parameter)`` pairs, to name parameters in reports and errors.
        process_group: the group over which the skip decision (and an amax-measuring policy's amax) is
            all-reduced (MAX), so every rank skips or steps together. "default": the default group when
            torch.distributed runs with more than one rank. None: no reduction.
        telemetry: None (off), an int N (statistics of the scaled gradients every N iterations), a dict
            of :class:`lossscale.Telemetry` arguments or a ``Telemetry``; :meth:`metrics` reads them.
        loss_check: skip a step whose loss is already non-finite before scaling *without* backing off
            (the scale did not cause it). False: torch's behaviour (it halves the scale).
        trace: hook the model's modules to name the first one whose output or gradient was non-finite
            (needs ``model=`` an ``nn.Module``; see :meth:`overflow_report`).
        **policy_keywords: the policy's other fields, e.g. for "dynamic": ``hysteresis=1``,
            ``consecutive_hysteresis=False``, ``min_scale=1.0``, ``max_scale=2**24`` (None: unbounded,
            as torch), ``on_stuck="warn"`` ("raise", "warn" once per streak, "ignore"),
            ``max_consecutive_skips=None``. A keyword of another policy is validated and warned about
            (it changes nothing); an unknown one raises.

    The same training loop as torch::

        scaler = lossscale.GradScaler()
        for x, y in data:
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)                      # optional: to clip true gradients
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)                          # skipped on inf/NaN
            scaler.update()
            scaler.step_scheduler(lr_scheduler)             # does not advance on skipped steps

    Gradient accumulation: ``scaler.scale(loss / accum_steps).backward()`` for every micro-batch and
    ``step``/``update`` once per ``accum_steps``; the scale only changes in :meth:`update`.
    """

    def __init__(
        self,
        device: Union[str, torch.device, None] = None,
        init_scale: float = _DEFAULT,
        growth_factor: float = _DEFAULT,
        backoff_factor: float = _DEFAULT,
        growth_interval: int = _DEFAULT,
        enabled: bool = True,
        *,
        policy: Any = "dynamic",
        model: Any = None,
        process_group: Any = _distributed.DEFAULT_GROUP,
        telemetry: Any = None,
        loss_check: bool = True,
        trace: bool = False,
        **policy_keywords: Any,
    ) -> None:
        if device is not None and not isinstance(device, (str, torch.device)):
            raise ValueError(f"device={device!r} must be None, a string such as 'cpu'/'cuda', or a torch.device.")
        device_type = None if device is None else torch.device(device).type
        self._enabled = plain_bool("enabled", enabled)
        if self._enabled and device_type == "cuda" and not torch.cuda.is_available():
            warnings.warn("lossscale.GradScaler: device='cuda' but CUDA is not available; disabling scaling.",
                          stacklevel=2)
            self._enabled = False
        given = {k: v for k, v in dict(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                                       growth_interval=growth_interval).items() if v is not _DEFAULT}
        self._policy = _make_policy(policy, {**given, **policy_keywords})
        for name, value in (("loss_check", loss_check), ("trace", trace)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be True or False.")
        if trace and not isinstance(model, torch.nn.Module):
            raise ValueError("trace=True hooks the model's modules: pass model=<the nn.Module> as well.")
        self._loss_check = loss_check
        self._telemetry = Telemetry.from_arg(telemetry)
        self._s = StateKeeper(self._policy.init_state(), device_type)
        self._names = ParamNames()
        if model is not None:
            self._names.add(model)
        self._check = GradientCheck(self._names, _distributed.validate_group(process_group))
        self._it = Iteration()
        self._stuck = StuckCheck()
        self._health = Health(self._s.state())  # the run-health account (lossscale.health), fed by update()
        self._last = LastUpdate()
        self._evidence: Optional[Dict[str, Any]] = None  # the last possibly skipped iteration's, for reports
        self._last_report: Optional[Dict[str, Any]] = None
        self._hint_checks = _hints.CALLS_CHECKED
        self._tracer = None
        if trace:
            from .trace import Tracer

            self._tracer = Tracer(model)

    @classmethod
    def passthrough(cls, device=None, **kwargs) -> "GradScaler":
        """A scaler for bf16 or fp32 training: scale fixed at 1, no unscale pass, non-finite steps skipped.

        bf16 and fp32 have fp32's exponent range, so nothing underflows that scaling would save; what
        is still worth having is a step that is skipped (and counted, and diagnosed) rather than
        written into the weights when a gradient is inf or NaN. Takes ``on_stuck``,
        ``max_consecutive_skips`` and the scaler's other keywords; the scale is not configurable.
        """
        stuck = {k: kwargs.pop(k) for k in ("on_stuck", "max_consecutive_skips") if k in kwargs}
        scale_keys = [k for k in kwargs if k not in ("enabled", "model", "process_group", "telemetry", "loss_check",
                                                     "trace")]
        if scale_keys:
            raise ValueError(
                f"passthrough() fixes the scale at 1 (bf16 and fp32 need no scaling), so {', '.join(scale_keys)} "
                "do(es) not apply. For a fixed scale S use GradScaler(policy='static', init_scale=S); for FP16 "
                "use GradScaler()."
            )
        return cls(device, policy=StaticPolicy(scale=1.0, **stuck), **kwargs)

    def name_parameters(self, model_or_named_parameters) -> None:
        """Learn parameter names (from an ``nn.Module`` or ``(name, param)`` pairs) for reports. The
        names survive pickling or deep-copying the model and the scaler (``lossscale._names``)."""
        self._names.add(model_or_named_parameters)

    # ------------------------------------------------------------------ properties and state
    @property
    def policy(self):
        """The scale policy (a frozen config object)."""
        return self._policy

    @property
    def device(self) -> Optional[torch.device]:
        """Where the scaler's state lives (None before the first :meth:`scale` or :meth:`init_device`)."""
        return self._s.device

    @property
    def process_group(self) -> Any:
        """The ``process_group`` setting ("default", None or a group)."""
        return self._check.process_group

    @property
    def telemetry(self) -> Optional[Telemetry]:
        """The :class:`lossscale.Telemetry` collecting gradient statistics, or None."""
        return self._telemetry

    def init_device(self, device: Union[str, torch.device]) -> None:
        """Start the state on ``device`` now (the first :meth:`scale` does it otherwise). No sync.

        For ranks that never call :meth:`scale` (pipeline stages before the last) and for frameworks
        that restore a checkpoint before the first iteration. ValueError if it runs on another device.
        """
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self._s.t is not None and self._s.device != device:
            raise ValueError(f"the scaler already runs on {self._s.device}; init_device got device={device}.")
        self._s.ensure(device)



    def state(self) -> ScaleState:
        """The policy's state now (a frozen dataclass of plain Python values).

        Free where the host knows it (before the first step, and after updates whose checks synced);
        otherwise one sync, after which the host knows it again (unless an update was captured in a
        CUDA graph or compiled: replays move the device state alone).
        """
        return self._s.state()

    # ------------------------------------------------------------------ torch's API
    def scale(self, outputs):
        """Multiply a tensor, or nested lists/tuples/dicts of tensors, by the scale factor.

        Returns the outputs unchanged when disabled. The first call fixes the scaler's device. No host
        sync. Warns once if the loss is bf16 or bf16 autocast is active (see :meth:`passthrough`).
        """
        if not self._enabled:
            return outputs
        refuse_unscalable(outputs)  # before anything changes: a failed call leaves no trace
        if self._hint_checks:  # a bf16 set-up shows in the first calls; later ones cost nothing
            self._hint_checks -= 1
            _hints.warn_if_bf16(outputs, self._passthrough())
        if self._tracer is not None:
            self._tracer.end_forward()  # the forward that produced these outputs is over
        self._it.begun = True

        def scaled(x: torch.Tensor) -> torch.Tensor:
            t = self._s.ensure(x.device)
            if self._loss_check:
                self._it.check_loss(x)
            return x * _kernels.to_device(t.scale, x.device)

        return map_tensors(scaled, outputs)

    def _passthrough(self) -> bool:
        return isinstance(self._policy, StaticPolicy) and self._policy.scale == 1.0

    def _loss_check_value(self) -> Optional[torch.Tensor]:
        if not self._loss_check and self._tracer is None:
            return None
        return self._it.loss_check_value(self._s.device, self._tracer)

    def _observe_grads(self, gathered) -> None:
        if self._telemetry is not None:
            self._telemetry.observe(gathered.params, gathered.grads, self._names, self._s.t.scale,
                                    all_params=gathered.all_params, sharded=gathered.sharded)
        if self._tracer is not None:
            self._tracer.end_backward()

    def _run_check(self, optimizer, rec: Record, unscale: bool, sync: bool) -> Flags:
        gathered = self._check.gather(optimizer, allow_half=not unscale or self._passthrough())
        self._observe_grads(gathered)
        unscale = unscale and not self._passthrough()
        rec.flags = self._check.check_(gathered, self._s.t.scale, self._s.inverse() if unscale else None,
                                       sync=sync, needs_amax=self._policy.needs_amax,
                                       bad_loss=self._loss_check_value())
        self._it.keep(optimizer, rec)  # checked (and maybe unscaled): from here on the record holds
        return rec.flags

    def _record(self, optimizer, call: str) -> Record:
        rec = self._it.record(optimizer, call)
        if rec.stage is OptState.STEPPED:
            raise RuntimeError(f"{call} is being called after step(); call it before step() in the iteration.")
        return rec

    def unscale_(self, optimizer) -> None:
        """Divide the optimizer's gradients by the scale (in place) and check them for inf/NaN.

        Optional, as in torch: call it before anything that reads gradient magnitudes (clipping, norm
        logging), at most once per optimizer per iteration, before :meth:`step`. Unscaling the same
        gradients twice in one iteration (through an optimizer wrapper) raises RuntimeError. Syncs once
        for optimizers without amp-scaling support (the sync torch pays in ``step()``), never for fused ones.
        """
        if not self._enabled:
            return
        self._s.require("unscale_()")
        rec = self._record(optimizer, "unscale_()")
        if rec.stage is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        self._run_check(optimizer, rec, unscale=True, sync=not supports_amp_scaling(optimizer))
        rec.stage = OptState.UNSCALED

    def clip_grad_norm_(self, optimizer, max_norm: float, norm_type: float = 2.0, *, norm_group: Any = None
                        ) -> torch.Tensor:
        """Unscale and clip the optimizer's gradients by their true total norm; return that norm.

        Replaces ``unscale_(optimizer)`` + ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` with two
        passes over the gradients instead of three (three reads and writes of every gradient instead of
        five): the norm of the scaled gradients (also the inf/NaN check), then one multiply by
        ``clip_coef / scale``; bitwise torch's two steps for a power-of-two
        scale while values stay in float32's normal range (``lossscale._clip``). A non-finite norm is
        an overflow: the step is skipped and the gradients are only unscaled.

        Once per optimizer per iteration, instead of :meth:`unscale_`. The norm is over this
        optimizer's parameters, over every rank's part of them: DTensor gradients (FSDP2, tensor
        parallel, both) are reduced over their mesh, pipeline stages over ``norm_group``
        (``lossscale.distributed.norm_reduction``), in one all-reduce: every rank gets the same norm
        (to rounding torch's; a plain tensor). Syncs like :meth:`unscale_`.
        """
        from . import _clip

        max_norm = plain_number("max_norm", max_norm)
        norm_type = _clip.validate(max_norm, norm_type)
        if not self._enabled:
            return self._check.clip_unscaled_(optimizer, max_norm, norm_type, norm_group)
        t = self._s.require("clip_grad_norm_()")
        rec = self._record(optimizer, "clip_grad_norm_()")
        if rec.stage is OptState.UNSCALED:
            raise RuntimeError(
                "clip_grad_norm_() unscales the gradients itself, and unscale_() (or clip_grad_norm_()) was "
                "already called on this optimizer since the last update(); call only one of them per iteration."
            )
        with torch.no_grad():
            gathered = self._check.gather(optimizer, allow_half=self._passthrough(), coalesce=True)
            self._observe_grads(gathered)
            true_norm, rec.flags = self._check.clip_(gathered, t.scale, self._s.inverse(), max_norm, norm_type,
                                                     sync=not supports_amp_scaling(optimizer),
                                                     needs_amax=self._policy.needs_amax,
                                                     bad_loss=self._loss_check_value(), norm_group=norm_group)
        self._it.keep(optimizer, rec)
        rec.stage = OptState.UNSCALED
        return true_norm

    def step(self, optimizer, *args, **kwargs):
        """Unscale (unless :meth:`unscale_` was called) and run ``optimizer.step()`` unless inf/NaN.

        Returns what ``optimizer.step`` returns (None when skipped). Syncs once for optimizers without
        amp-scaling support, unless :meth:`unscale_` already did; never for fused optimizers (they get
        ``grad_scale`` and ``found_inf``, exactly 0.0 or 1.0, and skip on device).
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not supported if GradScaler is enabled (as in torch).")
        t = self._s.require("step()")
        rec = self._it.record(optimizer, "step()")
        if rec.stage is OptState.STEPPED:
            raise RuntimeError("step() has already been called on this optimizer since the last update().")
        if not supports_amp_scaling(optimizer):
            if rec.stage is OptState.READY:
                self._run_check(optimizer, rec, unscale=True, sync=True)
            retval = None if rec.flags.host_found else optimizer.step(*args, **kwargs)
        elif takes_grad_scaler(optimizer.step):
            warn_grad_scaler_contract()
            retval = optimizer.step(*args, grad_scaler=self, **kwargs)
            self._it.keep(optimizer, rec)
        else:
            host = first_step_needs_the_host(optimizer)  # a skip decided on device would leave garbage
            if rec.stage is OptState.READY:
                self._run_check(optimizer, rec, unscale=False, sync=host)
            if host and rec.read_skipped():  # one sync, on the first step of such an optimizer only
                retval = None
            else:
                retval = step_with_flags(optimizer, t.scale, rec.flags.fold().found_inf, rec.stage is OptState.UNSCALED,
                                         args, kwargs)
        rec.stage = OptState.STEPPED
        return retval

    def update(self, new_scale: Union[float, torch.Tensor, None] = None) -> None:
        """Advance the policy by one iteration (or set ``new_scale``), at the end of the iteration.

        Call after :meth:`step` for every optimizer of the iteration. A float ``new_scale`` must lie
        within the bounds; a tensor one is copied on device, ignored when it is not finite or below
        2**-126 (a host check would sync), then clamped to the bounds. The counters still count the
        iteration. No host sync.

        Where every check of the iteration synced, the host knows the flags: it runs the policy's pure
        rule on its copy of the state, sends the result in one host-to-device copy, and reports a stuck
        run now. Otherwise (fused optimizers, CUDA graphs, torch.compile) the policy's tensor rule runs
        on device, and a stuck run is reported once a snapshot of the state reaches the host.
        """
        if not self._enabled:
            return
        t = self._s.require("update()")
        if new_scale is not None:
            new_scale = validate_new_scale(self._policy, new_scale, self.device)
        flags = self._it.flags()
        if not flags and new_scale is None:
            raise RuntimeError("update() found no inf checks since the last update(): call scaler.step(optimizer) "
                               "(or unscale_) for each optimizer before update().")
        skipped = any(f.host_found for f in flags) if all(f.host_found is not None for f in flags) else None
        capturing = _device.capturing(t.device)
        self._s.graphed = self._s.graphed or capturing
        trace = None if self._tracer is None else self._tracer.snapshot()  # the next iteration starts afresh
        if skipped is not False:  # possibly skipped: keep what the report needs (no sync)
            scale = None if self._s.mirror is None else self._s.mirror.scale
            self._evidence = _overflow.keep_evidence(self._it, flags, trace, scale)
            self._last_report = None
        evidence = self._evidence if skipped is not False else None
        host = (skipped is not None and self._s.mirror is not None and not self._s.graphed
                and not isinstance(new_scale, torch.Tensor))
        if host:
            # The pure rule on the host's copy, sent in one copy. The iteration synced, so the staging
            # buffer is free, and a NaN flag pending from an earlier overflow has landed.
            before = self._s.state()
            self._s.set(host_rule(self._policy, before, flags, new_scale), synced=bool(flags),
                        nan=pending_nan(flags))
        else:
            device_rule(self._policy, t, flags, new_scale)
            keeps = getattr(self._policy, "keeps_powers_of_two", None)  # optional (PolicyBase has it)
            self._s.moved_on_device(keeps is not None and keeps())
        self._last, self._it = LastUpdate(skipped), Iteration()
        self._check.new_iteration()
        if self._telemetry is not None:
            self._telemetry.iteration += 1
        if host:
            self._learn(self._s.mirror, before.scale, evidence if skipped else None)
        elif not capturing:  # snapshots of earlier device updates that have landed
            for state, scale_before, kept in self._stuck.after_device_update(
                    t, skipped is False, evidence, self._policy, self._describe, self._tracer is not None):
                self._health.record(self._policy, state, scale_before, kept if self._tracer is not None else None)
        else:
            self._stuck.capture_warning()

    def _learn(self, state: ScaleState, scale_before: float, evidence) -> None:
        """What the host learns from a state it computed itself: the health account, the stuck check
        (a stuck state is read whole: a NaN flag still on its way is part of its diagnosis)."""
        if state.overflow_streak and self._policy.is_stuck(state, scale_before):
            state = self._s.state()
        tracing = self._tracer is not None
        self._health.record(self._policy, state, scale_before, evidence if tracing else None)
        self._stuck.react(self._policy, state, scale_before, evidence, self._describe, tracing, stacklevel=4)

    # ------------------------------------------------------------------ tracing hooks
    def close(self) -> None:
        """Remove the tracing hooks (``trace=True``); the scaler keeps working without them. Idempotent."""
        if self._tracer is not None:
            self._tracer.close()

    def __enter__(self) -> "GradScaler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ checkpoints and copies
    def state_dict(self) -> Dict[str, Any]:
        """The complete, versioned state: config, scale, every tracker and counter (``lossscale.checkpoint``),
        torch's five keys (``torch.amp.GradScaler.load_state_dict`` accepts it) and, with telemetry, its
        iteration count (a resumed run samples the same iterations). Empty when disabled (as torch).
        May sync: see :meth:`state`. Call it after :meth:`update`.
        """
        if not self._enabled:
            return {}
        out = checkpoint.to_dict(self._policy, self.state())
        if self._telemetry is not None:
            out[checkpoint.TELEMETRY_KEY] = self._telemetry.iteration
        return out

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict`, or from ``torch.amp.GradScaler.state_dict()``.

        A torch state continues exactly as torch would (its scale, tracker and factors; this scaler's
        hysteresis refilled, counters at zero). Works before the first :meth:`scale`. Validates
        everything before changing anything (ValueError naming the key); the state tensors are filled
        in place (a CUDA graph captured before keeps reading the live scale). The checkpoint's policy
        wins over the constructor's (with a warning when they differ). Call it between iterations:
        in mid-iteration it raises RuntimeError (:meth:`discard_iteration` drops the iteration).
        """
        if not self._enabled:
            return
        if self._it.begun or self._it.records:
            raise RuntimeError(
                "load_state_dict() was called in mid-iteration (after scale(), before update()): the gradients "
                "in flight were scaled by the current scale, and unscaling them by the loaded one would be "
                "wrong. Load between iterations (after update(), before the next scale()); to drop the "
                "iteration in flight, call optimizer.zero_grad() and scaler.discard_iteration() first."
            )
        policy, state = checkpoint.load(state_dict, self._policy)
        telemetry_iteration = checkpoint.telemetry_iteration(state_dict)
        # Everything is validated: now swap.
        if telemetry_iteration is not None and self._telemetry is not None:
            self._telemetry.iteration = telemetry_iteration
        self._policy = policy
        self._s.set(state)
        self.discard_iteration()
        self._stuck.reset()
        self._health.reset(state)
        self._last, self._evidence, self._last_report = LastUpdate(), None, None

    def discard_iteration(self) -> None:
        """Forget the iteration in flight (after an exception in it, or to drop a batch by hand).

        What :meth:`scale`, :meth:`unscale_`, :meth:`clip_grad_norm_` and :meth:`step` recorded since
        the last :meth:`update` is dropped and nothing is counted. The gradients are not touched: zero
        them, since they may still carry the scale. A step that already ran is not undone. No sync.
        """
        self._it = Iteration()
        self._check.new_iteration()
        if self._tracer is not None:
            self._tracer.snapshot()  # the traced passes of the dropped iteration

    def __getstate__(self) -> Dict[str, Any]:
        if self._it.records:
            raise RuntimeError("A GradScaler can be pickled only between iterations (after update()).")
        state = self.__dict__.copy()
        keeper = StateKeeper(self.state(), self._s.device_type)  # the copy's tensors are made afresh
        state.update(_s=keeper, _stuck=None, _evidence=None, _last_report=None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._stuck = StuckCheck()

    def __deepcopy__(self, memo: Dict[int, Any]) -> "GradScaler":
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin  # first, so copied references to this scaler (bound methods) reach the twin
        twin.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return twin

    def __repr__(self) -> str:
        where = "not started" if self._s.t is None else str(self._s.device)
        return f"lossscale.GradScaler(enabled={self._enabled}, policy={self._policy!r}, {where})"
