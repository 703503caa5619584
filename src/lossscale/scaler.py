"""``lossscale.GradScaler``: a drop-in for ``torch.amp.GradScaler``, a thin adapter around a pure policy.

Configured like torch (``hysteresis=1, min_scale=None, max_scale=None, loss_check=False``) it is bitwise torch: the same
float32 scale, the same fused check+unscale kernel with an inverse scale computed in float64, the same
update arithmetic, the same skip decisions. Beyond torch it adds hysteresis and bounds, inf told from
NaN, skip-awareness, a diagnosis when training is stuck, complete versioned checkpoints, a read-only
check for fused optimizers, and a process-group reduction of the skip decision.

The parts (``docs/architecture.md``): the policy's rules (``lossscale.policy`` and one module per
policy), its state on device (``_state``), the gradient check (``_check``: gather, check, unscale,
clip, reduce), the deferred stuck check (``_observe``), checkpoints (``checkpoint``) and what differs
between devices (``_device``). The same operations run on every device.

Host-device syncs, per iteration (torch pays the same or more):

* optimizers without amp-scaling support (SGD, Adam(foreach)): one sync, to decide whether to call
  ``optimizer.step()``. It happens in :meth:`unscale_` (or :meth:`step` when ``unscale_`` was not
  called) so that an overflow is classified and localised before user code (clipping) touches the
  gradients.
* optimizers with ``_step_supports_amp_scaling`` (``Adam(fused=True)``): none. The optimizer gets
  ``grad_scale``/``found_inf`` tensors and skips on device.

The stuck check never adds one: it reads a snapshot of the state copied without blocking, at the
next :meth:`update` (``lossscale._observe``).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import inspect
import math
import warnings
import weakref
from collections import abc
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from . import _device, _hints, _kernels, checkpoint, formats
from . import distributed as _distributed
from ._check import Flags, GradientCheck, any_flag, names_of
from ._observe import Observer
from ._state import TensorState
from ._keywords import policy_from_keywords
from .diagnosis import diagnose
from .policy import SMALLEST_SCALE, Policy, ScaleState, count, count_tensor, f32, policy_class
from ._validate import plain_bool, plain_number
from .static import StaticPolicy

__all__ = ["GradScaler", "OptState", "STATE_DICT_VERSION"]

STATE_DICT_VERSION = checkpoint.STATE_DICT_VERSION
#: The state dict key of the telemetry's iteration count (its sampling phase), present with telemetry on.
_TELEMETRY_KEY = "telemetry_iteration"


class OptState(enum.Enum):
    """Per-optimizer stage within one iteration, as in torch."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


class _Record:
    """One optimizer's stage and what the gradient check learned in this iteration."""

    __slots__ = ("stage", "flags", "skipped")

    def __init__(self):
        self.stage = OptState.READY
        self.flags: Optional[Flags] = None
        self.skipped: Optional[bool] = None  # this optimizer's skip, once read on the host

    def read_skipped(self) -> bool:
        """Whether this optimizer's step was skipped: the host's decision, or the device flag read
        once (a sync, on the fused path only)."""
        if self.skipped is None:
            if self.flags is None:  # an optimizer stepped through grad_scaler=: it checked itself
                self.skipped = False
            elif self.flags.host_found is not None:
                self.skipped = self.flags.host_found
            else:
                self.skipped = bool(self.flags.found_inf.item())
        return self.skipped


class _Default:
    """The default of torch's positional scale keywords: "not given", so the policy's own default
    applies (the defaults are spelled once, on the policy dataclasses)."""

    def __repr__(self) -> str:
        return "<policy default>"


_DEFAULT = _Default()

# Optimizer step functions (a handful per process, alive as long as their classes): a plain dict, which
# torch.compile traces (a WeakKeyDictionary lookup does not survive tracing).
_GRAD_SCALER_KWARG: Dict[Any, bool] = {}


def _takes_grad_scaler(step) -> bool:
    """Whether ``step`` takes ``grad_scaler=`` (torch's deprecated contract), cached per function:
    ``inspect.signature`` costs ~100 us, more than the rest of a small fused step."""
    func = getattr(step, "__func__", step)
    found = _GRAD_SCALER_KWARG.get(func)
    if found is None:
        found = _GRAD_SCALER_KWARG[func] = "grad_scaler" in inspect.signature(step).parameters
    return found


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


def _refuse_unscalable(outputs) -> None:
    """ValueError, before anything changes, for what :meth:`GradScaler.scale` cannot scale: a value
    that is not a tensor or a list, tuple or dict of them (other iterables are scaled lazily, as torch
    does, and checked as they are consumed), or a tensor on the meta device (it holds no values: the
    scale would have to live there too, and no later step could read it)."""
    if isinstance(outputs, torch.Tensor):
        if outputs.device.type == "meta":
            raise ValueError("scale() got a tensor on the meta device, which holds no values; scale the loss of a "
                             "real forward (the scaler's state lives on the loss's device).")
        return
    if isinstance(outputs, dict):
        values = outputs.values()
    elif isinstance(outputs, (list, tuple)):
        values = outputs
    elif isinstance(outputs, abc.Iterable) and not isinstance(outputs, (str, bytes)):
        return
    else:
        raise ValueError(
            f"scale() takes a tensor or (nested) lists, tuples or dicts of tensors, got {type(outputs).__name__}."
        )
    for value in values:
        _refuse_unscalable(value)


def _scale_label(report: Dict[str, Any]) -> str:
    return "?" if report["scale"] is None else formats.pow2_label(report["scale"])


def _explain(report: Dict[str, Any]) -> str:
    """A one-line diagnosis of a skipped step from :meth:`GradScaler.overflow_report`'s fields."""
    kind = "NaN" if report["nan"] or report["loss"] == "nan" else "inf"
    if report["forward"] is not None:
        return (f"inf/NaN first appeared in the forward output of `{report['forward']}` (before any scaling): "
                "a model or data problem, not the loss scale (kept).")
    if report["loss"] != "finite":
        return (f"the loss itself was {report['loss']} before scaling: a data or model problem (a bad batch, "
                "log of 0, an overflowed fp16 activation), not the loss scale (kept).")
    if report["backward"] is not None:
        return (f"the backward of `{report['backward']}` overflowed fp16 at scale {_scale_label(report)}: "
                "the loss scale (backed off).")
    where = ", ".join(report["nan"] + report["inf"])[:200] or "some gradient"
    return f"{kind} in the gradients ({where}) at scale {_scale_label(report)}: the loss scale (backed off)."


class GradScaler:
    """Loss scaling for FP16 training: torch's ``GradScaler`` contract, exact arithmetic, and more.

    Args:
        device: "cpu", "cuda", a ``torch.device``, or None (default) to take the device of the first
            tensor passed to :meth:`scale`. Unlike torch there is no "cuda" default.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as in torch; left out,
            the policy's own defaults apply (the dynamic policy's are torch's).
        policy: "dynamic" (default, :class:`lossscale.DynamicPolicy`), "static" (a fixed
            ``init_scale``), "adaptive" (:class:`lossscale.AdaptivePolicy`), "logmax"
            (:class:`lossscale.LogMaxPolicy`), or a policy object (then no scale keyword may be given).
        model: an ``nn.Module`` or an iterable of ``(name, parameter)`` pairs, to name parameters in
            :meth:`overflow_report` and in error messages.
        process_group: the group over which the skip decision (and an amax-measuring policy's amax, in
            the same collective) is all-reduced (MAX), so every rank skips or steps together.
            "default" (the default): the default group when torch.distributed is initialised with more
            than one rank. None: no reduction.
        telemetry: None (off, the default), an int N (gradient statistics of the scaled gradients
            every N iterations), a dict of :class:`lossscale.Telemetry` arguments (``every``, ``per``,
            ``fmt``, ``reduce``) or a ``Telemetry``. Collecting adds no host sync; :meth:`metrics`
            reads them.
        **policy_keywords: the chosen policy's other fields, e.g. for "dynamic": ``hysteresis=1``
            (overflows tolerated before backing off; 1 = torch), ``consecutive_hysteresis=False``
            (DeepSpeed's), ``min_scale=1.0`` and ``max_scale=2**24`` (None: unbounded, as torch),
            ``on_stuck="warn"`` ("raise", "warn" once per streak, or "ignore", when an overflow
            happens at ``min_scale`` or ``max_consecutive_skips`` steps in a row are skipped),
            ``max_consecutive_skips=None``; for "adaptive" also ``margin_bits``, ``search_bits``,
            ``fmt``. A keyword of another policy is validated and warned about (it changes nothing);
            an unknown one raises.

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

    Gradient accumulation: call ``scaler.scale(loss / accum_steps).backward()`` for every micro-batch
    and ``step``/``update`` once per ``accum_steps``; the scale only changes in :meth:`update`, so
    every micro-batch of one optimizer step is scaled alike.
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
        self._device_type = None if device is None else torch.device(device).type
        self._enabled = plain_bool("enabled", enabled)
        if self._enabled and self._device_type == "cuda" and not torch.cuda.is_available():
            warnings.warn("lossscale.GradScaler: device='cuda' but CUDA is not available; disabling scaling.",
                          stacklevel=2)
            self._enabled = False
        torch_named = dict(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                           growth_interval=growth_interval)
        given = {k: v for k, v in torch_named.items() if v is not _DEFAULT}
        given.update(policy_keywords)
        self._policy = _make_policy(policy, given)
        # The state as the host knows it: always before the device state exists, and after updates
        # whose flags the host knew; None once a tensor rule has moved the device state.
        self._mirror: Optional[ScaleState] = self._policy.init_state()
        self._graphed = False  # update() ran under CUDA-graph capture or torch.compile: the device may move alone
        self._t: Optional[TensorState] = None
        self._records: Dict[int, _Record] = {}
        self._names: Dict[int, Tuple[weakref.ref, str]] = {}  # id(param) -> (the param, weakly; its name)
        if model is not None:
            self.name_parameters(model)
        self._check = GradientCheck(self._name_of, _distributed.validate_group(process_group))
        self._observer = Observer()
        self._last_skipped: Optional[bool] = None  # a host decision; None: read the device state
        self._evidence: Optional[Dict[str, Any]] = None  # the last possibly skipped iteration's, for reports
        self._last_report: Optional[Dict[str, List[str]]] = None
        self._warned_streak = False
        self._telemetry = self._make_telemetry(telemetry)
        for name, value in (("loss_check", loss_check), ("trace", trace)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be True or False.")
        self._loss_check = loss_check
        self._tracer = None
        if trace:
            if not isinstance(model, torch.nn.Module):
                raise ValueError("trace=True hooks the model's modules: pass model=<the nn.Module> as well.")
            from .trace import Tracer

            self._tracer = Tracer(model)
        self._loss_bad: Optional[torch.Tensor] = None  # this iteration's losses: some non-finite
        self._losses: List[torch.Tensor] = []  # this iteration's losses, detached (the report's "loss")
        self._warned_capture = False  # the stuck check is off under capture/compile: said once
        self._in_iteration = False  # scale() was called since the last update(): gradients in flight
        self._skip_read: Optional[bool] = None  # the device's skip flag, read once per update()
        self._skip_cacheable = True  # False after an update() captured in a CUDA graph

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def passthrough(cls, device=None, **kwargs) -> "GradScaler":
        """A scaler for bf16 or fp32 training: scale fixed at 1, no unscale pass, non-finite steps skipped.

        bf16 and fp32 have fp32's exponent range, so nothing underflows that scaling would save; what
        is still worth having is a step that is skipped (and counted, and diagnosed) rather than
        written into the weights when a gradient is inf or NaN. Takes ``on_stuck``,
        ``max_consecutive_skips`` and the scaler's other keywords (``model``, ``process_group``,
        ``telemetry``, ``enabled``); the scale is not configurable.
        """
        stuck = {k: kwargs.pop(k) for k in ("on_stuck", "max_consecutive_skips") if k in kwargs}
        scale_keys = [k for k in kwargs if k not in ("enabled", "model", "process_group", "telemetry")]
        if scale_keys:
            raise ValueError(
                f"passthrough() fixes the scale at 1 (bf16 and fp32 need no scaling), so {', '.join(scale_keys)} "
                "do(es) not apply. For a fixed scale S use GradScaler(policy='static', init_scale=S); for FP16 "
                "use GradScaler()."
            )
        return cls(device, policy=StaticPolicy(scale=1.0, **stuck), **kwargs)

    def name_parameters(self, model_or_named_parameters) -> None:
        """Learn parameter names (from an ``nn.Module`` or ``(name, param)`` pairs) for reports.

        The names survive pickling or deep-copying the model and the scaler, together or apart: each
        parameter also carries its name as the attribute ``_lossscale_name`` (pickled with the
        parameter), and a deep copy maps the copied parameters. Pickling the scaler alone pickles no
        parameter.
        """
        named = (model_or_named_parameters.named_parameters()
                 if isinstance(model_or_named_parameters, torch.nn.Module) else model_or_named_parameters)
        try:
            pairs = [(str(n), p) for n, p in named]
        except (TypeError, ValueError):
            raise ValueError("model must be an nn.Module or an iterable of (name, parameter) pairs.") from None
        bad = [n for n, p in pairs if not isinstance(p, torch.Tensor)]
        if bad:
            raise ValueError(f"model: {bad[0]!r} is paired with a {type(dict(pairs)[bad[0]]).__name__}, not a "
                             "parameter; pass an nn.Module or (name, parameter) pairs.")
        for name, param in pairs:
            self._remember(param, name)

    def _remember(self, param: torch.Tensor, name: str) -> None:
        # Keyed by id for speed, with a weak reference to tell a reused id from the parameter itself.
        self._names[id(param)] = (weakref.ref(param), name)
        try:
            param._lossscale_name = name  # travels with the parameter through pickle and torch.save
        except (AttributeError, TypeError):  # a tensor type without a __dict__: the id map still names it
            pass

    def _name_of(self, param) -> Optional[str]:
        entry = self._names.get(id(param))
        if entry is not None and entry[0]() is param:
            return entry[1]
        return getattr(param, "_lossscale_name", None)  # a parameter named, then pickled (a new id)

    @staticmethod
    def _make_telemetry(telemetry):
        if telemetry is None or telemetry is False:
            return None
        from .telemetry import Telemetry  # lazy: the stats code is only needed when telemetry is on

        if isinstance(telemetry, Telemetry):
            return telemetry
        if isinstance(telemetry, int) and not isinstance(telemetry, bool):
            return Telemetry(every=telemetry)
        if isinstance(telemetry, dict):
            return Telemetry(**telemetry)
        raise ValueError(
            f"telemetry={telemetry!r} must be None, an int (collect every N iterations), a dict of "
            "Telemetry arguments, or a lossscale.Telemetry."
        )

    # ------------------------------------------------------------------ properties
    @property
    def policy(self):
        """The scale policy (a frozen config object)."""
        return self._policy

    @property
    def device(self) -> Optional[torch.device]:
        """Where the scaler's state lives (None before the first :meth:`scale` or :meth:`init_device`)."""
        return None if self._t is None else self._t.device

    @property
    def process_group(self) -> Any:
        """The ``process_group`` setting ("default", None or a group); see :func:`lossscale.distributed.reduction_group`."""
        return self._check.process_group

    @property
    def telemetry(self):
        """The :class:`lossscale.Telemetry` collecting gradient statistics, or None."""
        return self._telemetry

    # ------------------------------------------------------------------ state
    def init_device(self, device: Union[str, torch.device]) -> None:
        """Start the state on ``device`` now (the first :meth:`scale` does it otherwise). No sync.

        For ranks that never call :meth:`scale` (pipeline stages before the last) and for frameworks
        that restore a checkpoint before the first iteration. Raises ValueError if the scaler already
        runs on another device.
        """
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self._t is not None and self._t.device != device:
            raise ValueError(f"the scaler already runs on {self._t.device}; init_device got device={device}.")
        self._ensure_state(device)

    @property
    def _device(self) -> str:
        """torch's private attribute (a device string), which accelerate's FSDP2 ``load_state`` passes
        back to :meth:`_lazy_init_scale_growth_tracker`: where the state lives, else the device given
        to the constructor, else "cuda" when available (torch's default), else "cpu"."""
        if self._t is not None:
            return str(self._t.device)
        if self._device_type is not None:
            return self._device_type
        return "cuda" if torch.cuda.is_available() else "cpu"

    def _lazy_init_scale_growth_tracker(self, device) -> None:
        """torch's private name for :meth:`init_device` (accelerate's FSDP2 ``load_state`` calls it)."""
        if self._enabled:
            self.init_device(device)

    def _ensure_state(self, device: torch.device) -> TensorState:
        if self._t is None:
            if self._device_type is not None and device.type != self._device_type:
                raise ValueError(
                    f"GradScaler(device={self._device_type!r}) was given a tensor on {device}; pass "
                    f"device={device.type!r} or device=None to infer it."
                )
            self._t = TensorState(self._mirror, device)
        return self._t

    def _require_state(self, call: str) -> TensorState:
        if self._t is None:
            raise RuntimeError(
                f"{call} was called before scale(): call scaler.scale(loss).backward() first in the iteration."
            )
        return self._t

    def state(self) -> ScaleState:
        """The policy's state now (a frozen dataclass of plain Python values).

        Free where the host knows it (before the first step, and after updates whose checks synced:
        optimizers without amp-scaling support); otherwise it syncs host and device once.
        """
        if self._mirror is not None:
            return self._mirror
        state = self._t.to_state()
        if not self._graphed:  # the device state moves only through update(): the host knows it again
            self._mirror = state
        return state

    # ------------------------------------------------------------------ torch's API
    def scale(self, outputs):
        """Multiply a tensor, or nested lists/tuples/dicts of tensors, by the scale factor.

        Returns the outputs unchanged when disabled. The first call fixes the scaler's device (from
        the first tensor). No host sync. Warns once if the loss is bf16 or bf16 autocast is active:
        bf16 needs no loss scale (see :meth:`passthrough`).
        """
        if not self._enabled:
            return outputs
        _refuse_unscalable(outputs)  # before anything changes: a failed call leaves no trace
        _hints.warn_if_bf16(outputs, self._passthrough())
        if self._tracer is not None:
            self._tracer.end_forward()  # the forward that produced these outputs is over
        self._in_iteration = True
        if isinstance(outputs, torch.Tensor):
            t = self._ensure_state(outputs.device)
            self._check_loss(outputs, t)
            return outputs * _kernels.to_device(t.scale, outputs.device)
        per_device: Dict[torch.device, torch.Tensor] = {}

        def apply(value):
            if isinstance(value, torch.Tensor):
                t = self._ensure_state(value.device)
                self._check_loss(value, t)
                scale = per_device.get(value.device)
                if scale is None:
                    scale = per_device[value.device] = _kernels.to_device(t.scale, value.device)
                return value * scale
            if isinstance(value, dict):
                out = copy.copy(value)  # keeps the mapping's type (a defaultdict keeps its factory)
                for k, v in value.items():
                    out[k] = apply(v)
                return out
            if isinstance(value, (list, tuple)):
                mapped = [apply(v) for v in value]
                return type(value)(*mapped) if hasattr(value, "_fields") else type(value)(mapped)
            if isinstance(value, abc.Iterable) and not isinstance(value, (str, bytes)):
                return map(apply, value)
            raise ValueError(
                f"scale() takes a tensor or (nested) lists, tuples or dicts of tensors, got {type(value).__name__}."
            )

        return apply(outputs)

    def _check_loss(self, loss: torch.Tensor, t: TensorState) -> None:
        """Remember, on device, whether ``loss`` is non-finite *before* scaling (two small kernels, no
        sync): then the scale did not cause it, and the step is skipped without backing off.

        An FP16 loss that overflows only once multiplied by the scale is finite here: that one is
        the scale's doing, and the policy backs off as usual.
        """
        if not self._loss_check:
            return
        x = loss.detach()
        # x - x is NaN exactly where x is inf or NaN, else 0: one subtraction. The check turns the
        # iteration's sum of them into its flags (lossscale._kernels.flag_vector).
        bad = x - x
        bad = _kernels.to_device((bad if bad.dim() == 0 else bad.sum()).float(), t.device)
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad + bad
        self._losses.append(x)  # for overflow_report()'s "loss" (inf or NaN), read only if asked

    def _bad_loss(self) -> Optional[torch.Tensor]:
        """This iteration's loss check (and the traced forward), a float32 0-dim tensor on the state's
        device: NaN where something was non-finite before scaling, else 0; None when neither is on. A
        rank that never called :meth:`scale` (a pipeline stage) sends 0, so every rank joins the same
        collective."""
        if not self._loss_check and self._tracer is None:
            return None
        device = self._t.device
        bad = torch.zeros((), dtype=torch.float32, device=device) if self._loss_bad is None else self._loss_bad
        if self._tracer is not None:
            forward = self._tracer.forward_flag()
            if forward is not None:
                bad = bad + torch.where(_kernels.to_device(forward, device), math.nan, 0.0)
        return bad

    def _record(self, optimizer, call: str) -> _Record:
        """This iteration's record of ``optimizer``; a new one is kept only by :meth:`_keep`, once the
        call that made it has succeeded (a failed call leaves no stale record behind)."""
        if not hasattr(optimizer, "param_groups"):
            raise ValueError(f"{call}: optimizer={optimizer!r} is not an optimizer (no param_groups); pass the "
                             "torch.optim optimizer whose gradients were scaled.")
        rec = self._records.get(id(optimizer))
        return _Record() if rec is None else rec

    def _keep(self, optimizer, rec: _Record) -> None:
        self._records[id(optimizer)] = rec

    def _passthrough(self) -> bool:
        return isinstance(self._policy, StaticPolicy) and self._policy.scale == 1.0

    def _run_check(self, optimizer, rec: _Record, unscale: bool, sync: bool) -> Flags:
        gathered = self._check.gather(optimizer, allow_half=not unscale or self._passthrough())
        if self._telemetry is not None:
            self._telemetry.observe(gathered.params, gathered.grads, self._name_of, self._t.scale,
                                    all_params=gathered.all_params, sharded=gathered.sharded)
        if self._tracer is not None:
            self._tracer.end_backward()
        flags = self._check.check_(gathered, self._t.scale, unscale=unscale and not self._passthrough(), sync=sync,
                                   needs_amax=self._policy.needs_amax, bad_loss=self._bad_loss())
        rec.flags = flags
        self._keep(optimizer, rec)  # checked (and maybe unscaled): from here on the record holds
        return flags

    def unscale_(self, optimizer) -> None:
        """Divide the optimizer's gradients by the scale (in place) and check them for inf/NaN.

        Optional, as in torch: call it before anything that reads gradient magnitudes (clipping,
        norm logging). At most once per optimizer per iteration, before :meth:`step`. Unscaling the
        same gradients twice in one iteration (through an optimizer wrapper) raises RuntimeError.

        Syncs host and device once for optimizers without amp-scaling support (the sync torch pays in
        ``step()``; here it moves earlier so an overflow is classified before clipping can turn inf
        into NaN); none for fused optimizers.
        """
        if not self._enabled:
            return
        self._require_state("unscale_()")
        rec = self._record(optimizer, "unscale_()")
        if rec.stage is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if rec.stage is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step(); call it before step() in the iteration.")
        self._run_check(optimizer, rec, unscale=True,
                        sync=not getattr(optimizer, "_step_supports_amp_scaling", False))
        rec.stage = OptState.UNSCALED

    def clip_grad_norm_(self, optimizer, max_norm: float, norm_type: float = 2.0, *, norm_group: Any = None
                        ) -> torch.Tensor:
        """Unscale and clip the optimizer's gradients by their true total norm; return that norm.

        Replaces ``unscale_(optimizer)`` + ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` with
        two passes over the gradients instead of five: the norm of the scaled gradients (which is
        also the inf/NaN check), then one multiply by ``clip_coef / scale``. With a power-of-two scale
        the gradients and the returned norm are bitwise torch's two-step result, as long as no value
        leaves float32's normal range (details in ``lossscale._clip``). A non-finite norm is an
        overflow: the step is skipped, the gradients are only unscaled (an inf stays inf, not NaN).

        Once per optimizer per iteration, instead of :meth:`unscale_` and before :meth:`step`. The
        norm is over this optimizer's parameters (torch's recipe takes whatever it is given), over
        every rank's part of them: DTensor gradients (FSDP2, tensor parallel, both) are reduced over
        their mesh, pipeline stages over ``norm_group`` (``lossscale.distributed.norm_reduction``),
        in one all-reduce; every rank gets the same norm, a plain tensor (torch's is a DTensor).
        DDP's gradients are copies: nothing is reduced.
        Syncs like :meth:`unscale_`: once for optimizers without amp-scaling support, never for
        fused ones (the norm stays a device tensor).
        """
        from . import _clip

        max_norm = plain_number("max_norm", max_norm)
        norm_type = _clip.validate(max_norm, norm_type)
        if not self._enabled:
            gathered = self._check.gather(optimizer, allow_half=True, coalesce=True)
            reduce_norm, counted = _distributed.norm_reduction(gathered.all_params, gathered.params, norm_type,
                                                               norm_group)
            if reduce_norm is None:
                return torch.nn.utils.clip_grad_norm_(gathered.all_params, max_norm, norm_type)
            # Spread over ranks: the same reduced norm as when enabled, at scale 1 (exact).
            one = torch.ones((), device=gathered.all_params[0].grad.device if gathered.all_params else "cpu")
            return _clip.clip_scaled_(gathered.grads, one, max_norm, norm_type, counted, reduce_norm)[0]
        t = self._require_state("clip_grad_norm_()")
        rec = self._record(optimizer, "clip_grad_norm_()")
        if rec.stage is OptState.UNSCALED:
            raise RuntimeError(
                "clip_grad_norm_() unscales the gradients itself, and unscale_() (or clip_grad_norm_()) was "
                "already called on this optimizer since the last update(); call only one of them per iteration."
            )
        if rec.stage is OptState.STEPPED:
            raise RuntimeError("clip_grad_norm_() is being called after step(); call it before step() in the iteration.")
        sync = not getattr(optimizer, "_step_supports_amp_scaling", False)
        with torch.no_grad():
            gathered = self._check.gather(optimizer, allow_half=self._passthrough(), coalesce=True)
            if self._telemetry is not None:
                self._telemetry.observe(gathered.params, gathered.grads, self._name_of, t.scale,
                                        all_params=gathered.all_params, sharded=gathered.sharded)
            if self._tracer is not None:
                self._tracer.end_backward()
            true_norm, rec.flags = self._check.clip_(gathered, t.scale, max_norm, norm_type, sync=sync,
                                                     needs_amax=self._policy.needs_amax, bad_loss=self._bad_loss(),
                                                     norm_group=norm_group)
        self._keep(optimizer, rec)
        rec.stage = OptState.UNSCALED
        return true_norm

    def step(self, optimizer, *args, **kwargs):
        """Unscale (unless :meth:`unscale_` was called) and run ``optimizer.step()`` unless inf/NaN.

        Returns what ``optimizer.step`` returns (None when skipped). Syncs host and device once for
        optimizers without amp-scaling support, unless :meth:`unscale_` already did; never for fused
        optimizers (they get ``grad_scale`` and ``found_inf`` and skip on device).
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not supported if GradScaler is enabled (as in torch).")
        t = self._require_state("step()")
        rec = self._record(optimizer, "step()")
        if rec.stage is OptState.STEPPED:
            raise RuntimeError("step() has already been called on this optimizer since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            if _takes_grad_scaler(optimizer.step):
                warnings.warn("lossscale.GradScaler passes itself as grad_scaler=, a contract torch is "
                              "deprecating; prefer optimizers that read grad_scale/found_inf.",
                              FutureWarning, stacklevel=2)
                retval = optimizer.step(*args, grad_scaler=self, **kwargs)
                self._keep(optimizer, rec)
                rec.stage = OptState.STEPPED
                return retval
            if rec.stage is OptState.READY:
                self._run_check(optimizer, rec, unscale=False, sync=False)
            # Multiply by a grad_scale the user set on the optimizer, as torch does.
            user_scale = getattr(optimizer, "grad_scale", None)
            optimizer.grad_scale = (user_scale if rec.stage is OptState.UNSCALED
                                    else t.scale if user_scale is None else t.scale * user_scale)
            optimizer.found_inf = rec.flags.found_inf
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale
                del optimizer.found_inf
            rec.stage = OptState.STEPPED
            return retval
        if rec.stage is OptState.READY:
            self._run_check(optimizer, rec, unscale=True, sync=True)
        retval = None
        if not rec.flags.host_found:
            retval = optimizer.step(*args, **kwargs)
        rec.stage = OptState.STEPPED
        return retval

    def update(self, new_scale: Union[float, torch.Tensor, None] = None) -> None:
        """Advance the policy by one iteration (or set ``new_scale``), at the end of the iteration.

        Call after :meth:`step` for every optimizer of the iteration. A float ``new_scale`` must lie
        within the bounds; a tensor one is copied on device, ignored when it is not finite or below
        2**-126 (float32's smallest normal; checking it on the host would sync), then clamped to the
        bounds. The step counters still count the iteration. No host sync.

        Where every check of the iteration synced (optimizers without amp-scaling support), the host
        knows the flags: it runs the policy's pure rule on its copy of the state and sends the result
        in one host-to-device copy, and a stuck run is reported now. Otherwise (fused optimizers,
        CUDA graphs, torch.compile) the policy's tensor rule runs on device, and a stuck run is
        reported at a later update, when a snapshot of the state has reached the host.
        """
        if not self._enabled:
            return
        t = self._require_state("update()")
        if new_scale is not None:
            new_scale = self._validate_new_scale(new_scale)
        flags = [r.flags for r in self._records.values() if r.flags is not None]
        if not flags and new_scale is None:
            raise RuntimeError(
                "update() found no inf checks since the last update(): call scaler.step(optimizer) "
                "(or unscale_) for each optimizer before update()."
            )
        host_known = all(f.host_found is not None for f in flags)
        skipped = any(f.host_found for f in flags) if host_known else None
        capturing = _device.capturing(t.device)
        if skipped is not False:  # possibly skipped: keep what the report needs (no sync)
            self._evidence = dict(loss_bad=self._loss_bad, losses=self._losses, scale=self.state_scale(t),
                                  trace=None if self._tracer is None else self._tracer.snapshot(),
                                  source=[(f.params, f.amax_vectors) for f in flags if f.amax_vectors])
            self._last_report = None
        elif self._tracer is not None:
            self._tracer.snapshot()  # a clean iteration: start the next one afresh
        self._graphed = self._graphed or capturing
        host = (host_known and self._mirror is not None and not self._graphed
                and not isinstance(new_scale, torch.Tensor))
        if host:
            before, after = self._host_update(t, flags, new_scale)
        else:
            self._device_update(t, flags, new_scale)
        self._loss_bad, self._losses = None, []
        self._last_skipped = skipped
        self._skip_read, self._skip_cacheable = None, not capturing
        self._records = {}
        self._in_iteration = False
        self._check.new_iteration()
        if self._telemetry is not None:
            self._telemetry.iteration += 1
        if host:
            self._react(after, before.scale, self._evidence if skipped else None, stacklevel=3)
        elif not capturing:
            self._observe(t, skipped is False)
        elif not self._warned_capture:
            # Under torch.compile the warning breaks the graph of this first trace only: the flag is
            # then True, dynamo's guard on it recompiles once, and later traces have no break.
            self._warned_capture = True
            warnings.warn(
                "lossscale: update() runs inside a CUDA-graph capture or torch.compile, where the host cannot "
                "read the device, so the stuck check (on_stuck) is off for these updates. Call "
                "scaler.check_stuck() eagerly now and then (e.g. every few hundred steps; one sync) to run it.",
                RuntimeWarning, stacklevel=2)

    def state_scale(self, t: TensorState):
        """The scale this iteration ran with, for a report: a float where the host knows it, else None
        (the device path's update writes it to ``scale_before``, which the report reads)."""
        return self._mirror.scale if self._mirror is not None else None

    def _host_update(self, t: TensorState, flags: List[Flags], new_scale) -> Tuple[ScaleState, ScaleState]:
        """The pure rule on the host's copy of the state, then one copy to the device (no sync: the
        check synced this iteration already, so the staging buffer's last copy has landed)."""
        before = self._mirror
        found_inf = any(f.host_found for f in flags)
        found_nan = any(f.host_nan for f in flags)
        bad_loss = any(f.host_bad for f in flags)
        amaxes = [f.host_amax for f in flags if f.host_amax is not None]
        if new_scale is None:
            after = self._policy.update(before, found_inf, found_nan, max(amaxes) if amaxes else None, bad_loss)
        else:  # the iteration still happened: count it; torch leaves the trackers alone
            counted = count(before, found_inf, found_nan, bad_loss) if flags else before
            after = counted.replace(scale=f32(new_scale))
        t.load_(after, staging_free=bool(flags))
        self._mirror = after
        return before, after

    def _device_update(self, t: TensorState, flags: List[Flags], new_scale) -> None:
        """The tensor rule on device, in place, no sync; the host's copy of the state is then unknown."""
        vectors = [f.vector() for f in flags]
        vector = vectors[0] if len(vectors) == 1 else torch.stack(vectors).amax(0) if vectors else None
        if new_scale is not None:
            if vector is not None:  # the iteration still happened: count it; torch leaves the trackers alone
                count_tensor(t, vector)
            self._set_scale(t, new_scale)
        else:
            amaxes = [f.amax for f in flags if f.amax is not None]
            amax = None if not amaxes else amaxes[0] if len(amaxes) == 1 else torch.stack(amaxes).max()
            self._policy.tensor_update(t, vector, amax)
        self._mirror = None

    def _set_scale(self, t: TensorState, new_scale) -> None:
        lo, hi = self._policy.scale_bounds()
        if isinstance(new_scale, torch.Tensor):
            value = new_scale.detach().reshape(()).to(t.scale)
            # A non-finite or non-positive scale would poison every later step: keep the old one,
            # decided on device (a host check would sync) and before the clamp, which would turn
            # inf into max_scale and 0 into min_scale as if they had been asked for.
            ok = torch.isfinite(value) & (value >= SMALLEST_SCALE)
            if lo is not None or hi is not None:
                value = value.clamp(lo, hi)
            t.scale.copy_(torch.where(ok, value, t.scale))
        else:
            t.scale.fill_(new_scale)

    def _validate_new_scale(self, new_scale):
        """``new_scale`` checked, as a Python float (or the tensor); ValueError naming it otherwise."""
        if isinstance(new_scale, torch.Tensor):
            if new_scale.numel() != 1 or new_scale.requires_grad or not new_scale.is_floating_point():
                raise ValueError("new_scale must be a float or a 1-element floating-point tensor with "
                                 f"requires_grad=False; got a {new_scale.dtype} tensor of shape {tuple(new_scale.shape)}.")
            if self._t is not None and new_scale.device.type != self._t.device.type:
                raise ValueError(f"new_scale is on {new_scale.device} but the scaler's state is on {self._t.device}.")
            return new_scale
        new_scale = plain_number("new_scale", new_scale)
        if isinstance(new_scale, bool) or not isinstance(new_scale, (int, float)):
            raise ValueError(f"new_scale={new_scale!r} must be a float or a 1-element tensor.")
        if not math.isfinite(new_scale) or new_scale <= 0:
            raise ValueError(f"new_scale={new_scale!r} must be finite and > 0.")
        if not SMALLEST_SCALE <= f32(new_scale) < math.inf:
            raise ValueError(f"new_scale={new_scale!r} is outside float32's normal range [2**-126, 3.4e38], where "
                             "the scale is kept.")
        lo, hi = self._policy.scale_bounds()
        if (lo is not None and new_scale < lo) or (hi is not None and new_scale > hi):
            raise ValueError(f"new_scale={new_scale!r} is outside [min_scale={lo}, max_scale={hi}].")
        return new_scale

    # ------------------------------------------------------------------ observation (stuck check)
    def _observe(self, t: TensorState, clean: bool) -> None:
        """React to every landed snapshot of earlier updates, then queue one of this update's state.

        ``clean``: the host knows this iteration stepped, so nothing can be stuck now (no snapshot).
        A snapshot carries the evidence of its own iteration (the first cause), so a reaction one
        update late still describes the step that tripped it. Not called while a CUDA graph is
        captured or torch.compile traces: the host reads nothing there (see :meth:`check_stuck`).
        """
        for state, scale_before, evidence in self._observer.poll():
            self._react(state, scale_before, evidence)
        if clean:
            self._warned_streak = False
            return
        self._observer.push(t, self._evidence)

    def check_stuck(self) -> None:
        """Run the stuck check on the state now (warn or raise per ``on_stuck``). Syncs host and device.

        :meth:`update` runs it by itself, without a sync, one update late; inside a CUDA-graph
        capture or ``torch.compile`` it cannot (the host reads nothing there), so a loop that replays
        graphs or runs a compiled step calls this eagerly now and then. It describes the current
        streak; the evidence of where it began is kept only for eager updates.
        """
        if not self._enabled or self._t is None:
            return
        state, scale_before = self._t.decode(self._t.buffer.cpu())
        self._react(state, scale_before, None, stacklevel=3)

    def _react(self, state: ScaleState, scale_before: float, evidence, stacklevel: int = 4) -> None:
        if state.overflow_streak == 0:
            self._warned_streak = False
            return
        if not self._policy.is_stuck(state, scale_before) or self._policy.on_stuck == "ignore":
            return
        message = diagnose(self._policy, state, tracing=self._tracer is not None)
        if evidence is not None:
            # Rare (the run is stuck): one sync to say where the stuck step's trouble began.
            message += "\nThe step that tripped this check: " + self._report_from(evidence, scale_before)["cause"]
        if self._policy.on_stuck == "raise":
            raise RuntimeError(message)
        if not self._warned_streak:
            warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)
            self._warned_streak = True

    # ------------------------------------------------------------------ overflow report
    def overflow_report(self) -> Dict[str, Any]:
        """Why the last step was skipped: which parameters held inf and NaN, and where it began.

        Returns a dict:

        * ``"inf"``, ``"nan"``: names of the parameters whose gradients held inf / NaN (as given by
          ``model=`` or :meth:`name_parameters`, else ``param (shape)``);
        * ``"loss"``: ``"finite"``, ``"inf"`` or ``"nan"``: the loss before scaling (``loss_check``);
        * ``"forward"``: the first module, in execution order, whose output was non-finite, or None;
        * ``"backward"``: the first module, in backward order, whose input gradient was non-finite, or
          None (both need ``trace=True``);
        * ``"scale"``: the scale the step ran with;
        * ``"cause"``: a one-line diagnosis from the above.

        Empty lists and None when the last step was not skipped. Reading it syncs host and device.
        """
        empty = {"inf": [], "nan": [], "loss": "finite", "forward": None, "backward": None, "scale": None,
                 "cause": "the last step was not skipped."}
        if not self._skipped_at_update():
            return empty
        if self._last_report is None:
            self._last_report = self._report_from(self._evidence)
        return self._last_report

    def _report_from(self, evidence: Optional[Dict[str, Any]], scale_before: Optional[float] = None) -> Dict[str, Any]:
        """:meth:`overflow_report`'s dict from one iteration's evidence (its device tensors). Syncs."""
        report = {"inf": [], "nan": [], "loss": "finite", "forward": None, "backward": None, "scale": None}
        evidence = evidence or {}
        for params, vectors in evidence.get("source") or []:
            values = torch.cat([v.cpu() for v in vectors]).tolist() if vectors else []
            for key, names in names_of(values, params, self._name_of).items():
                report[key].extend(names)
        if evidence.get("loss_bad") is not None and bool(torch.isnan(evidence["loss_bad"]).item()):
            report["loss"] = "nan" if any(bool(torch.isnan(x).any()) for x in evidence["losses"]) else "inf"
        if evidence.get("trace") is not None and self._tracer is not None:
            report.update(self._tracer.names_of(evidence["trace"]))
        if evidence.get("scale") is not None:
            report["scale"] = float(evidence["scale"])
        elif scale_before is not None:
            report["scale"] = scale_before
        elif evidence and self._t is not None:  # the device path's last update wrote it
            report["scale"] = float(self._t.scale_before.item())
        report["cause"] = _explain(report)
        return report

    def close(self) -> None:
        """Remove the tracing hooks (``trace=True``); the scaler keeps working without them. Idempotent."""
        if self._tracer is not None:
            self._tracer.close()

    def __enter__(self) -> "GradScaler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ skip-awareness
    @property
    def last_step_skipped(self) -> bool:
        """Whether the last :meth:`step` was skipped: between :meth:`step` and :meth:`update`, this
        iteration's (any optimizer stepped so far); otherwise the last iteration's.

        Free when the host already decided the step (optimizers without amp-scaling support); for
        fused optimizers, whose skip happened on device, the first read syncs host and device and
        later reads reuse it. When the last update was captured in a CUDA graph, every read after it
        syncs: replays change the device state without calling :meth:`update`.
        """
        stepped = self._stepped_records()
        if stepped:
            return any(r.read_skipped() for r in stepped)
        return self._skipped_at_update()

    def _stepped_records(self) -> List[_Record]:
        return [r for r in self._records.values() if r.stage is OptState.STEPPED]

    def step_was_skipped(self, optimizer=None) -> bool:
        """Whether ``optimizer``'s last step was skipped, for code that acts on it (an LR scheduler).

        Between :meth:`step` and :meth:`update` it is this iteration's decision for ``optimizer``
        (each optimizer skips on its own gradients, as in torch), or for the iteration so far when
        ``optimizer`` is None or not stepped by this scaler; after :meth:`update` the last
        iteration's. Raises RuntimeError when this iteration has begun to check gradients but no
        optimizer has stepped yet: its decision is not made, and the previous one is stale.
        May sync: see :attr:`last_step_skipped`.
        """
        rec = self._records.get(id(optimizer)) if optimizer is not None else None
        if rec is not None and rec.stage is OptState.STEPPED:
            return rec.read_skipped()
        if self._records and not self._stepped_records():
            raise RuntimeError(
                "The optimizer step of this iteration has not happened yet (unscale_()/clip_grad_norm_() ran, "
                "step() did not), so whether it is skipped is not known. Step schedulers (and anything that "
                "asks whether the step was skipped) after scaler.step(optimizer): either scaler.step(o); "
                "scaler.step_scheduler(s); scaler.update(), or scaler.step(o); scaler.update(); "
                "scaler.step_scheduler(s)."
            )
        return self.last_step_skipped

    def skip_flag(self, optimizer=None) -> Union[bool, torch.Tensor]:
        """:meth:`step_was_skipped` without a host sync: a Python bool where the host decided the step
        (optimizers without amp-scaling support), else a bool 0-dim tensor on the scaler's device (fused
        optimizers, which skip on device), for gating device work such as an EMA update with
        ``torch.where``. Raises like :meth:`step_was_skipped` when called before the iteration's step.
        """
        rec = self._records.get(id(optimizer)) if optimizer is not None else None
        stepped = [rec] if rec is not None and rec.stage is OptState.STEPPED else self._stepped_records()
        if self._records and not stepped:
            self.step_was_skipped(optimizer)  # raises, with what to do
        if not self._enabled:
            return False
        if stepped:
            if all(r.skipped is not None or r.flags is None or r.flags.host_found is not None for r in stepped):
                return any(r.read_skipped() for r in stepped)
            return any_flag([r.flags.found_inf for r in stepped if r.flags is not None], self._t.device) > 0
        if self._last_skipped is not None or self._t is None:
            return bool(self._last_skipped)
        return self._t.overflow_streak > 0

    def _skipped_at_update(self) -> bool:
        """Whether the iteration that the last :meth:`update` closed was skipped."""
        if self._last_skipped is not None:
            return self._last_skipped
        if self._t is None:
            return False
        if self._skip_read is not None:
            return self._skip_read
        skipped = bool(self._t.overflow_streak.item() > 0)
        if self._skip_cacheable:
            self._skip_read = skipped
        return skipped

    @property
    def skipped_steps(self) -> int:
        """Skipped iterations so far. Syncs host and device."""
        return self.state().skipped_steps if self._enabled else 0

    def step_scheduler(self, scheduler, *args, **kwargs) -> bool:
        """``scheduler.step()`` unless the step of its optimizer was skipped; returns whether it stepped.

        A skipped step did not train, so an LR schedule that advanced anyway would drift ahead of
        the weights (torch warns "Detected call of lr_scheduler.step() before optimizer.step()").
        Call it after :meth:`step`, before or after :meth:`update`: either way it reads this
        iteration's decision (:meth:`step_was_skipped`, for ``scheduler.optimizer`` when the
        scheduler has one). May sync: see :attr:`last_step_skipped`.
        """
        if self._enabled and self.step_was_skipped(getattr(scheduler, "optimizer", None)):
            return False
        scheduler.step(*args, **kwargs)
        return True

    def counters(self) -> Dict[str, int]:
        """Every counter as plain ints: steps, skipped, inf and NaN steps, current streak. Syncs."""
        s = self.state()
        return {"steps": s.steps, "skipped_steps": s.skipped_steps, "inf_steps": s.inf_steps,
                "nan_steps": s.nan_steps, "bad_loss_steps": s.bad_loss_steps, "overflow_streak": s.overflow_streak}

    def metrics(self) -> Dict[str, Union[int, float, bool]]:
        """A flat dict of numbers for any logger (TensorBoard's ``add_scalar``, W&B). Syncs host and device.

        Always: ``loss_scale``, ``steps``, ``skipped_steps``, ``inf_steps``, ``nan_steps``,
        ``overflow_streak``, ``last_step_skipped``. With telemetry on, the figures of the last sampled
        iteration: ``grad/flushed_frac``, ``grad/subnormal_frac``, ``grad/headroom_bits``, ``grad/amax``,
        ... (and ``grad/<name>/...`` per parameter or module); what they measure is in
        :meth:`metric_labels`. With telemetry reducing across ranks, a collective.
        """
        out: Dict[str, Any] = {"loss_scale": self.get_scale()}
        if self._enabled:
            out.update(self.counters())
        out["last_step_skipped"] = bool(self._enabled and self.last_step_skipped)
        if self._telemetry is not None:
            group = (_distributed.resolve_group(self.process_group) if self._telemetry.wants_reduction() else None)
            out.update(self._telemetry.metrics(group=group, device=self.device))
        return out

    def metric_labels(self) -> Dict[str, str]:
        """Text that goes with :meth:`metrics` (``grad/measured``: e.g. "float32 as fp16"). No sync."""
        return {} if self._telemetry is None else self._telemetry.labels()

    # ------------------------------------------------------------------ getters / setters
    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). May sync: see :meth:`state`."""
        if not self._enabled:
            return 1.0
        return self.state().scale

    def _get_scale_async(self) -> Optional[torch.Tensor]:
        """The scale tensor without a sync (None before the first :meth:`scale`), as in torch."""
        return None if self._t is None else self._t.scale

    def _config_value(self, name: str, default):
        return self._policy.config().get(name, default)

    def _replace_policy(self, **changes) -> None:
        fields = self._policy.config()
        missing = [k for k in changes if k not in fields]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} do(es) not apply to the {type(self._policy).__name__}.")
        self._policy = dataclasses.replace(self._policy, **changes)  # validates the new value

    def get_growth_factor(self) -> float:
        """The growth factor (1.0 for a policy without one)."""
        return self._config_value("growth_factor", 1.0)

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (validated: > 1)."""
        self._replace_policy(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The backoff factor (1.0 for a policy without one)."""
        return self._config_value("backoff_factor", 1.0)

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (validated: in (0, 1))."""
        self._replace_policy(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """The growth interval (0 for a policy without one)."""
        return self._config_value("growth_interval", 0)

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (validated: int >= 1).

        Lowering it below the current clean streak makes the next clean step grow the scale (torch
        would then never grow again until an overflow reset its tracker).
        """
        self._replace_policy(growth_interval=new_interval)
        if self._t is not None:
            self._t.growth_tracker.clamp_(max=new_interval - 1)
        if self._mirror is not None:
            self._mirror = self._mirror.replace(growth_tracker=min(self._mirror.growth_tracker, new_interval - 1))

    def _get_growth_tracker(self) -> int:
        """torch's private getter (used by some trainers). Syncs."""
        return getattr(self.state(), "growth_tracker", 0) if self._enabled else 0

    def is_enabled(self) -> bool:
        """Whether scaling is enabled."""
        return self._enabled

    def _found_inf_per_device(self, optimizer) -> Dict[torch.device, torch.Tensor]:
        """torch's private accessor, used by some trainers: this iteration's found_inf per device."""
        rec = self._records.get(id(optimizer))
        flags = None if rec is None else rec.flags
        return {} if flags is None else {flags.found_inf.device: flags.found_inf}

    def _check_inf_per_device(self, optimizer) -> Dict[torch.device, torch.Tensor]:
        """torch's private read-only check, used by some trainers."""
        self._require_state("_check_inf_per_device()")
        self._run_check(optimizer, self._record(optimizer, "_check_inf_per_device()"), unscale=False, sync=False)
        return self._found_inf_per_device(optimizer)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """The complete, versioned state: config, scale, every tracker and counter (``lossscale.checkpoint``).

        It holds torch's five keys too, so ``torch.amp.GradScaler.load_state_dict`` accepts it, and
        with telemetry on the telemetry's iteration count (so a resumed run samples the same
        iterations). Empty when disabled (as torch). Syncs host and device. Call it after :meth:`update`.
        """
        if not self._enabled:
            return {}
        out = checkpoint.to_dict(self._policy, self.state())
        if self._telemetry is not None:
            out[_TELEMETRY_KEY] = self._telemetry.iteration
        return out

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict`, or from ``torch.amp.GradScaler.state_dict()``.

        A torch state continues exactly as torch would: its scale, growth tracker and factors, with
        this scaler's hysteresis refilled and counters at zero. Works before the first :meth:`scale`.
        Validates everything before changing anything (ValueError naming the key); the state tensors
        are filled in place, so a CUDA graph captured before the load keeps reading the live scale.
        The checkpoint's policy wins over the constructor's (with a warning when they differ).

        Call it between iterations (after :meth:`update`, before the next :meth:`scale`): gradients
        in flight carry the old scale, and unscaling them by the loaded one would be silently wrong,
        so a load in mid-iteration raises RuntimeError (:meth:`discard_iteration` drops the iteration).
        """
        if not self._enabled:
            return
        if self._in_iteration or self._records:
            raise RuntimeError(
                "load_state_dict() was called in mid-iteration (after scale(), before update()): the gradients "
                "in flight were scaled by the current scale, and unscaling them by the loaded one would be "
                "wrong. Load between iterations (after update(), before the next scale()); to drop the "
                "iteration in flight, call optimizer.zero_grad() and scaler.discard_iteration() first."
            )
        policy, state = checkpoint.load(state_dict, self._policy)
        telemetry_iteration = state_dict.get(_TELEMETRY_KEY, None)
        if telemetry_iteration is not None:
            telemetry_iteration = plain_number(_TELEMETRY_KEY, telemetry_iteration, integral=True)
            if isinstance(telemetry_iteration, bool) or not isinstance(telemetry_iteration, int) or telemetry_iteration < 0:
                raise ValueError(f"state dict '{_TELEMETRY_KEY}'={state_dict[_TELEMETRY_KEY]!r} must be an int >= 0.")
        # Everything is validated: now swap.
        if telemetry_iteration is not None and self._telemetry is not None:
            self._telemetry.iteration = telemetry_iteration
        if self._t is not None:
            if self._t.state_type is type(state):
                self._t.load_(state)
            else:
                self._t = TensorState(state, self._t.device)
        self._policy, self._mirror = policy, (None if self._graphed else state)
        self._records = {}
        self._check.new_iteration()
        self._observer.reset()
        self._last_skipped, self._evidence, self._last_report = None, None, None
        self._skip_read, self._loss_bad, self._losses = None, None, []
        self._warned_streak = False

    def discard_iteration(self) -> None:
        """Forget the iteration in flight (after an exception in it, or to drop a batch by hand).

        What :meth:`scale`, :meth:`unscale_`, :meth:`clip_grad_norm_` and :meth:`step` recorded since
        the last :meth:`update` is dropped, and nothing is counted: the scale, trackers and counters
        stay as the last update left them. The gradients are not touched: zero them
        (``optimizer.zero_grad()``), since they may still carry the scale. An optimizer step that
        already ran is not undone. No host sync.
        """
        self._records = {}
        self._in_iteration = False
        self._check.new_iteration()
        self._loss_bad, self._losses = None, []
        if self._tracer is not None:
            self._tracer.snapshot()  # the traced passes of the dropped iteration

    def __getstate__(self) -> Dict[str, Any]:
        if self._records:
            raise RuntimeError("A GradScaler can be pickled only between iterations (after update()).")
        state = self.__dict__.copy()
        state["_mirror"] = self.state()
        state["_graphed"] = False  # the copy's tensors are new: no graph reads them
        state["_t"] = None
        state["_observer"] = None
        state["_evidence"], state["_last_report"] = None, None
        # Parameter names: ids mean nothing elsewhere and the parameters are not ours to pickle; each
        # named parameter carries its name (``_lossscale_name``), and __deepcopy__ maps copied ones.
        state["_names"] = {}
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._observer = Observer()

    def __deepcopy__(self, memo: Dict[int, Any]) -> "GradScaler":
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin  # first, so copied references to this scaler (bound methods) reach the twin
        twin.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        # torch's Parameter.__deepcopy__ drops attributes: name the copies of our parameters that
        # were deep-copied before the scaler (memo maps id(original) -> copy), and keep the originals.
        for key, (ref, name) in self._names.items():
            param = ref()
            if param is not None:
                twin._names[key] = (ref, name)
                copied = memo.get(id(param))
                if isinstance(copied, torch.Tensor):
                    twin._remember(copied, name)
        return twin

    def __repr__(self) -> str:
        where = "not started" if self._t is None else str(self._t.device)
        return f"lossscale.GradScaler(enabled={self._enabled}, policy={self._policy!r}, {where})"
