"""``lossscale.GradScaler``: torch's ``GradScaler`` contract around a pure scale policy.

One iteration (``docs/architecture.md`` draws it whole)::

    scale(loss)     loss * _scale; the loss is kept for the loss check      the state: _state.py
    unscale_(opt)   synced optimizers: torch's check+unscale kernel, then ONE read of found_inf (the loss
                    check folded in) decides the step; an overflow gets one more pass for NaN  _check.py
    step(opt)       synced: optimizer.step() unless found_inf. fused: a read-only pass gives the flags on
                    device, and the optimizer skips by itself on found_inf
    update()        the policy's tensor rule on the device state (dynamic.py, policy.py), no sync; a
                    snapshot of the state starts to the host, the landed ones feed health and the stuck check

Configured like torch (``hysteresis=1, min_scale=None, max_scale=None, loss_check=False``) it is bitwise
torch: the same float32 scale, check+unscale kernel, inverse (torch's float64 value, computed in float32),
update kernel and skip decisions.
Syncs per iteration: one with optimizers without amp-scaling support (torch's ``step()`` pays the same),
none with fused ones (but ``SGD(fused=True)`` with momentum, on its first step). Reading the state
(``get_scale()``, ``state()``, ``counters()``, ``health()``, ``state_dict()``) syncs once, as torch's
``get_scale()`` does.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import inspect
from collections import abc
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Literal, Optional, Tuple, Union

import torch
from torch.amp.grad_scaler import OptState

from . import _hints, checkpoint
from ._check import Flags, GradientCheck, combine, found_inf, inverse, largest_magnitudes
from ._features import Feature, Fp16Flushed
from ._keywords import policy_from_keywords
from ._names import ParamNames
from ._state import Snapshot, TensorState
from ._validate import SMALLEST_SCALE, plain_bool, plain_number
from ._warnings import warn
from .formats import f32
from .health import Health, HealthReport
from .microbatches import MicroBatches, valid_weight
from .policy import Policy, ScaleState, count_tensor
from .spikes import SkipIf, SpikeSkipper
from .static import StaticPolicy
from .upcast import Upcast

if TYPE_CHECKING:  # the telemetry's module imports only when asked for
    from .telemetry import Telemetry

__all__ = ["GradScaler", "OptState", "STATE_DICT_VERSION"]

STATE_DICT_VERSION = checkpoint.STATE_DICT_VERSION
DEFAULT_GROUP = "default"  # process_group's default: the default group, when torch.distributed runs
#: Snapshots in flight at most: a device that lags further drops the oldest (the counters still count
#: every step; the health account infers what happened in the gap).
SNAPSHOTS = 4


@dataclasses.dataclass
class _Record:
    """What the scaler knows about one optimizer in the iteration: its stage (torch's) and what its check
    learned (None: not checked yet), the skip decision included. ``written``: the ``found_inf_per_device``
    an optimizer that unscales itself wrote into its record (torch's ``step(grad_scaler=)`` contract),
    kept as written; its flags are derived from it."""

    stage: OptState = OptState.READY
    flags: Optional[Flags] = None
    written: Optional[Dict[Any, torch.Tensor]] = None

    def found_inf_per_device(self) -> Dict[Any, torch.Tensor]:
        """``{device: found_inf}`` as torch's records hold it (empty: not checked yet)."""
        if self.written is not None:
            return dict(self.written)
        return {} if self.flags is None else {self.flags.skip.device: found_inf(self.flags)}

    def torch_view(self) -> Dict[str, Any]:
        """The record as torch's ``_per_optimizer_states`` holds it: its stage and ``{device: found_inf}``."""
        return {"stage": self.stage, "found_inf_per_device": self.found_inf_per_device()}


class _TorchRecord(abc.MutableMapping):
    """One entry of :attr:`GradScaler._per_optimizer_states`: torch's ``{"stage", "found_inf_per_device"}``
    read from, and written into, the scaler's record of that optimizer. Optimizers that unscale themselves
    (``_step_supports_amp_scaling`` with ``step(grad_scaler=)``, as apex's ``DistributedFusedAdam``) read
    the stage and write their ``found_inf_per_device`` here; the scaler's ``update()`` then answers it as
    torch's does. Reading creates nothing (a fresh key reads as torch's fresh record)."""

    KEYS = ("stage", "found_inf_per_device")

    def __init__(self, scaler: "GradScaler", key: Any):
        self._scaler, self._key = scaler, key

    def _rec(self) -> _Record:
        return self._scaler._records.get(self._key) or _Record()

    def __getitem__(self, name: str) -> Any:
        if name == "stage":
            return self._rec().stage
        if name == "found_inf_per_device":
            return _FoundInfPerDevice(self._rec().found_inf_per_device(), self)
        raise KeyError(name)

    def __setitem__(self, name: str, value: Any) -> None:
        rec = self._scaler._records.get(self._key) or _Record()
        if name == "stage":
            if not isinstance(value, OptState):
                raise ValueError(f"_per_optimizer_states[...]['stage'] must be an OptState, got {value!r}.")
            rec.stage = value
        elif name == "found_inf_per_device":
            rec.flags, rec.written = self._scaler._written_flags(value), dict(value)
        else:
            raise KeyError(f"{name!r}: a record holds only {self.KEYS} (torch's)")
        self._scaler._records[self._key] = rec

    def __delitem__(self, name: str) -> None:
        raise TypeError("a record's 'stage' and 'found_inf_per_device' cannot be deleted; set them instead.")

    def __iter__(self):
        return iter(self.KEYS)

    def __len__(self) -> int:
        return len(self.KEYS)

    def __repr__(self) -> str:
        return repr(dict(self))


class _FoundInfPerDevice(dict):
    """A record's ``found_inf_per_device``: a dict, and a write into it (``[device] = found_inf``, as apex's
    ``DistributedFusedLAMB`` does) is a write of the whole into the record."""

    def __init__(self, entries: Dict[Any, torch.Tensor], record: _TorchRecord):
        super().__init__(entries)
        self._record = record

    def __setitem__(self, device: Any, flag: torch.Tensor) -> None:
        super().__setitem__(device, flag)
        self._record["found_inf_per_device"] = dict(self)

    def update(self, *args, **kwargs) -> None:
        super().update(*args, **kwargs)
        self._record["found_inf_per_device"] = dict(self)


class _TorchRecords(collections.defaultdict):
    """:attr:`GradScaler._per_optimizer_states`: torch's defaultdict by ``id(optimizer)``, each entry a
    :class:`_TorchRecord` that reads and writes the scaler's record."""

    def __init__(self, scaler: "GradScaler"):
        super().__init__(None)
        self._scaler = scaler
        for key in scaler._records:
            dict.__setitem__(self, key, _TorchRecord(scaler, key))

    def __missing__(self, key: Any) -> _TorchRecord:
        return _TorchRecord(self._scaler, key)  # not kept: reading a fresh key creates no record


class GradScaler:
    """Loss scaling for FP16 training: torch's ``GradScaler`` contract, exact arithmetic, and more.

    Args:
        device: "cpu", "cuda", a ``torch.device``, or None (default): the device of the first tensor
            passed to :meth:`scale`. Unlike torch there is no "cuda" default.
        init_scale: the first scale (for ``policy="static"``, the scale). None (default): the policy's
            own, 2**16 for "dynamic", as torch.
        growth_factor: the multiplier after ``growth_interval`` clean steps. None (default): the
            policy's own, 2.0 for "dynamic", as torch.
        backoff_factor: the multiplier on overflow. None (default): the policy's own, 0.5 for
            "dynamic", as torch.
        growth_interval: clean steps before a growth. None (default): the policy's own, 2000 for
            "dynamic", as torch.
        enabled: False makes every call a passthrough that changes nothing, as torch.
        policy: "dynamic" (default, :class:`lossscale.DynamicPolicy`), "static", "adaptive", "logmax",
            or a policy object (then no scale keyword may be given).
        min_scale: the scale's floor: 2**-24 (default, FP16's smallest subnormal; "logmax"'s own is 1),
            or None: no floor, as torch (the scale backs off through float32's subnormals to 0, bitwise
            torch's). Passed to the policy only when given, so another policy keeps its own default;
            "static" has none.
        max_scale: the scale's cap: 2**24 (default), or None: unbounded, as torch. Passed on as
            ``min_scale`` is.
        on_stuck: what an overflow the scale cannot answer (at ``min_scale``, or ``max_consecutive_skips``
            skipped steps in a row) does: "warn" (default, once per streak, with a diagnosis), "raise"
            (RuntimeError) or "ignore" (torch's silence).
        model: an ``nn.Module`` or ``(name, parameter)`` pairs, to name parameters in reports and errors.
        process_group: the group the skip decision (and a measuring policy's amax) is all-reduced over
            (MAX), so every rank skips or steps together. "default": the default group when
            torch.distributed runs. None: no reduction.
        telemetry: None (off), an int N (statistics of the scaled gradients every N iterations), a dict
            of :class:`lossscale.Telemetry` arguments or a ``Telemetry``; :meth:`metrics` reads them.
        loss_check: skip a step whose loss is non-finite before scaling *without* backing off (the
            scale did not cause it). False: torch's behaviour (it halves the scale).
        trace: hook the model's modules to name the first one whose output or gradient was non-finite
            (needs ``model=`` an ``nn.Module``; see :meth:`overflow_report`).
        allow_fp16: unscale FP16 (and bf16) gradients in place, as torch's ``ShardedGradScaler`` does,
            counting the values the unscale flushes to zero (``metrics()``, ``health()``). False (torch's
            ``GradScaler``): such gradients raise ValueError with what to do instead. Optimizers that
            unscale themselves (fused) take FP16 gradients either way, in float32 arithmetic: exact.
        skip_if: a :class:`lossscale.SkipIf` (or a dict of its fields): skip finite steps whose gradient
            norm or loss spikes, with the same skip flag, the scale kept (:mod:`lossscale.spikes`).
        bad_microbatch: "skip" (a non-finite loss skips the whole step), "drop" (that micro-batch adds
            nothing, the step renormalised over the others; one host read per ``scale()``) or "zero"
            (dropped, not renormalised): :mod:`lossscale.microbatches`.
        on_forward_overflow: "upcast" (with ``trace=True``): a module the trace names as the first
            forward overflow on ``upcast_after`` skipped steps is kept in FP32 from then on
            (:mod:`lossscale.upcast`). "skip" (default): such steps are skipped, the scale kept.
        upcast_after: how many skipped steps must name the same module before it is kept in FP32
            (``on_forward_overflow`` and ``on_backward_overflow``).
        on_backward_overflow: "upcast" (with ``trace=True``): a module the trace names as the first backward
            overflow on ``upcast_after`` steps skipped at a scale of 1 or below (or at ``min_scale``, if
            higher) is kept in FP32, widened to its enclosing module if that does not end it
            (:mod:`lossscale.upcast`). "skip": no.
        **policy_keywords: the policy's other fields; for "dynamic": ``hysteresis=1``,
            ``consecutive_hysteresis=False``, ``max_consecutive_skips=None``; for "adaptive" and
            "logmax" their own (``margin_bits``, ...). Another policy's keyword is validated and warned
            about; a keyword of no policy raises ValueError naming the nearest one.

    The training loop is torch's::

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
    """

    def __init__(
        self,
        device: Union[str, torch.device, None] = None,
        init_scale: Optional[float] = None,
        growth_factor: Optional[float] = None,
        backoff_factor: Optional[float] = None,
        growth_interval: Optional[int] = None,
        enabled: bool = True,
        *,
        policy: Union[str, Policy] = "dynamic",
        min_scale: Optional[float] = 2.0**-24,
        max_scale: Optional[float] = 2.0**24,
        on_stuck: Literal["warn", "raise", "ignore"] = "warn",
        model: Union[torch.nn.Module, Iterable[Tuple[str, torch.nn.Parameter]], None] = None,
        process_group: Union[Literal["default"], torch.distributed.ProcessGroup, None] = "default",
        telemetry: Union[int, Dict[str, Any], Telemetry, None] = None,
        loss_check: bool = True,
        trace: bool = False,
        allow_fp16: bool = False,
        skip_if: Union[SkipIf, Dict[str, Any], None] = None,
        bad_microbatch: Literal["skip", "drop", "zero"] = "skip",
        on_forward_overflow: Literal["skip", "upcast"] = "skip",
        upcast_after: int = 2,
        on_backward_overflow: Literal["skip", "upcast"] = "skip",
        **policy_keywords: Any,
    ) -> None:
        if device is not None and not isinstance(device, (str, torch.device)):
            raise ValueError(f"device={device!r} must be None, a string such as 'cpu'/'cuda', or a torch.device.")
        self._device_type = None if device is None else torch.device(device).type
        self._enabled = plain_bool("enabled", enabled)
        if self._enabled and self._device_type == "cuda" and not torch.cuda.is_available():
            warn("lossscale.GradScaler: device='cuda' but CUDA is not available; disabling scaling.")
            self._enabled = False
        given = {
            k: v
            for k, v in dict(
                init_scale=init_scale,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
            ).items()
            if v is not None
        }
        # min_scale, max_scale and on_stuck show the default policy's defaults; each goes to the policy
        # only when given (not the signature's default object itself), so another policy keeps its own
        # defaults and a policy object takes no keyword.
        shown = GradScaler.__init__.__kwdefaults__
        bounds = dict(min_scale=min_scale, max_scale=max_scale, on_stuck=on_stuck)
        given.update((k, v) for k, v in bounds.items() if v is not shown[k])
        self._policy = _make_policy(policy, {**given, **policy_keywords})
        for name, value in (("loss_check", loss_check), ("trace", trace), ("allow_fp16", allow_fp16)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be True or False.")
        if trace and not isinstance(model, torch.nn.Module):
            raise ValueError("trace=True hooks the model's modules: pass model=<the nn.Module> as well.")
        self._loss_check, self._allow_fp16 = loss_check, allow_fp16
        # The opt-in features (lossscale._features.Feature), each None when off. Telemetry and the trace
        # import their modules (statistics, hooks) only when asked for.
        self._telemetry = None
        if telemetry is not None:
            from .telemetry import Telemetry

            self._telemetry = Telemetry.from_arg(telemetry)
        self._flushed = Fp16Flushed() if allow_fp16 else None  # the values the FP16 unscale flushed
        self._spikes = SpikeSkipper.of(skip_if)
        self._microbatches = MicroBatches.of(bad_microbatch)
        self._upcast = Upcast.of(on_forward_overflow, upcast_after, trace, model, on_backward_overflow)
        self._tracer = None
        if trace and self._enabled:  # a disabled scaler checks nothing: hooks would only pile up records
            from .trace import Tracer

            self._tracer = Tracer(model)
        self._features: List[Feature] = [
            f
            for f in (self._telemetry, self._tracer, self._flushed, self._spikes, self._microbatches, self._upcast)
            if f is not None
        ]
        self._names = ParamNames()
        if model is not None:
            self._names.add(model)
        _check_process_group(process_group)
        self._check = GradientCheck(self._names, process_group)
        self._t: Optional[TensorState] = None  # the state, once it has a device; until then it is this:
        self._init_state: ScaleState = self._policy.init_state()
        self._health = Health(self._init_state)
        self._hint_checks = _hints.CALLS_CHECKED
        self._fp16_watch = _hints.Fp16Watch()  # warns once if the first scaled steps show no FP16 work
        self._stale_gradients = False  # a mid-iteration load left gradients scaled by the old scale
        self._new_iteration()
        self._last: Optional[Flags] = None  # the last update's flags (None: nothing checked)
        self._graphed = False  # an update ran under CUDA-graph capture or compile: replays move the state
        self._snapshots: collections.deque = collections.deque(maxlen=SNAPSHOTS)
        self._warned_streak = False
        self._step_callbacks: Dict[int, Callable] = collections.OrderedDict()  # on_step (a handle holds it weakly)
        self._evidence: Optional[Dict[str, Any]] = None  # the last possibly skipped iteration's, for reports
        self._last_report: Optional[Dict[str, Any]] = None

    @classmethod
    def passthrough(cls, device=None, **kwargs) -> "GradScaler":
        """A scaler for bf16 or fp32 training: scale fixed at 1, no unscale pass, non-finite steps skipped.

        Nothing underflows in bf16 or fp32 that scaling would save; a step that is skipped (counted,
        diagnosed) instead of written into the weights when a gradient is inf or NaN is still worth
        having. Takes ``on_stuck``, ``max_consecutive_skips`` and the scaler's other keywords.
        """
        stuck = {k: kwargs.pop(k) for k in ("on_stuck", "max_consecutive_skips") if k in kwargs}
        # The scaler's own keywords (keyword-only in its signature, and torch's enabled) apply; the scale's not.
        own = {"enabled"} | {
            name
            for name, p in inspect.signature(cls).parameters.items()
            if p.kind is p.KEYWORD_ONLY and name not in ("policy", "min_scale", "max_scale", "on_stuck")
        }
        scale_keys = sorted(set(kwargs) - own)
        if scale_keys:
            raise ValueError(
                f"passthrough() fixes the scale at 1 (bf16 and fp32 need no scaling), so {', '.join(scale_keys)} "
                "do(es) not apply. For a fixed scale S use GradScaler(policy='static', init_scale=S); for FP16 "
                "use GradScaler()."
            )
        return cls(device, policy=StaticPolicy(scale=1.0, **stuck), **kwargs)

    def name_parameters(self, model_or_named_parameters) -> None:
        """Learn parameter names (an ``nn.Module`` or ``(name, param)`` pairs) for reports; they survive
        pickling or deep-copying the model and the scaler."""
        self._names.add(model_or_named_parameters)

    # ------------------------------------------------------------------ properties and state
    @property
    def policy(self):
        """The scale policy (a frozen config object)."""
        return self._policy

    @property
    def device(self) -> Optional[torch.device]:
        """Where the state lives (None before the first :meth:`scale` or :meth:`init_device`)."""
        return None if self._t is None else self._t.device

    @property
    def process_group(self) -> Any:
        """The ``process_group`` setting ("default", None or a group)."""
        return self._check.process_group

    @property
    def telemetry(self):
        """The :class:`lossscale.Telemetry` collecting gradient statistics, or None."""
        return self._telemetry

    @property
    def _per_optimizer_states(self) -> Dict[Any, abc.MutableMapping]:
        """torch's per-optimizer records, in torch's shape (a defaultdict of ``{"stage", "found_inf_per_device"}``
        by ``id(optimizer)``; a fresh key reads as torch's fresh record), read from and written into this
        iteration's records: an optimizer that unscales itself (``step(grad_scaler=)``, as apex's) writes its
        ``found_inf_per_device`` here, and :meth:`update` answers it as torch's does."""
        return _TorchRecords(self)

    def _written_flags(self, found: Any) -> Flags:
        """The flags of a ``found_inf_per_device`` an optimizer wrote into its record: the step was skipped
        (by the optimizer itself) where any device's ``found_inf`` is nonzero, as torch's update kernel reads
        the sum of them. A non-finite loss before scaling explains such a skip (the scale is kept, with
        ``loss_check``); it cannot skip a step the optimizer took. No reduction across ranks: the
        optimizer decided (apex's reduce their norm themselves). No sync."""
        t = self._t or self._require("writing _per_optimizer_states[...]['found_inf_per_device']")
        if not isinstance(found, abc.Mapping) or not all(isinstance(v, torch.Tensor) for v in found.values()):
            raise ValueError(
                "_per_optimizer_states[...]['found_inf_per_device'] must be a dict of {device: found_inf tensor}, "
                f"as torch's; got {found!r}."
            )
        overflow = t.false
        for flag in found.values():
            overflow = overflow | (flag.to(t.device, non_blocking=True) != 0).reshape(())
        return Flags(overflow=overflow, nan=t.false, bad_loss=self._bad_loss(t.device) & overflow)

    @property
    def _scale(self) -> Optional[torch.Tensor]:
        """torch's name for the scale tensor (float32, 0-dim; None before the first :meth:`scale`): the
        state itself, so code written for torch that reads it reads the live scale."""
        return None if self._t is None else self._t.scale

    @property
    def _growth_tracker(self) -> Optional[torch.Tensor]:
        """torch's name for the growth tracker tensor (the policy's, where it has one), or None."""
        return getattr(self._t, "growth_tracker", None)

    def init_device(self, device: Union[str, torch.device]) -> None:
        """Start the state on ``device`` now (the first :meth:`scale` does it otherwise), for ranks that
        never call :meth:`scale` (pipeline stages) and frameworks that load a checkpoint first. No sync.
        ValueError if the state already lives on another device, or for the meta device."""
        device = torch.device(device)
        if self._t is not None:
            if self._t.device != _indexed(device):
                raise ValueError(f"the scaler already runs on {self._t.device}; init_device got device={device}.")
            return
        if device.type == "meta":
            raise ValueError(
                "init_device got device=meta, which holds no values: the scale and the counters must "
                "live where the gradients are checked; pass the training device ('cpu', 'cuda', ...)."
            )
        self._start(device)

    def _start(self, device: torch.device) -> TensorState:
        if self._t is None:
            device = _indexed(device)
            self._t = TensorState(self._init_state, device)
        return self._t

    def _require(self, call: str) -> TensorState:
        """The device state; RuntimeError naming ``call`` without one (callers write ``self._t or
        self._require(call)``: a TensorState is always true)."""
        if self._t is None:
            raise RuntimeError(
                f"{call} was called before scale(): call scaler.scale(loss).backward() first in the iteration."
            )
        return self._t

    def state(self) -> ScaleState:
        """The policy's state now (a frozen dataclass of Python values). Syncs once, as torch's
        ``get_scale()`` (no sync before the first :meth:`scale`: the state has no device yet)."""
        return self._init_state if self._t is None else self._t.read()[0]

    # ------------------------------------------------------------------ torch's training-loop API
    def scale(self, outputs, weight=None):
        """Multiply a tensor, or nested lists/tuples/dicts of tensors, by the scale. Unchanged when disabled.
        The first call fixes the device. No sync. Warns once about a bf16 loss or bf16 autocast, and once
        if the first ``lossscale.diagnosis.NO_FP16_STEPS`` (100) iterations show no FP16 work (no FP16
        loss, activation or parameter in the loss's graph, no FP16 autocast at this call: an autocast whose
        device type is not the model's, say); it looks at metadata only, until the first FP16 sign.
        ``weight`` (with ``bad_microbatch``): this micro-batch's share of the step, e.g. its token count;
        a dropped micro-batch's share is left out of the renormalisation (:mod:`lossscale.microbatches`).
        A tensor ``weight`` is read on the host (one sync)."""
        if not self._enabled:
            return outputs
        if not isinstance(outputs, torch.Tensor) or outputs.device.type == "meta":
            _refuse_unscalable(outputs)  # before anything changes: a failed call leaves no trace
        if weight is not None:
            if self._microbatches is None:
                raise ValueError(
                    "scale(weight=...) gives a micro-batch's share for dropping bad micro-batches; build "
                    "the scaler with bad_microbatch='drop' (or leave weight out)."
                )
            weight = valid_weight(weight, outputs)
        if self._microbatches is not None:
            self._microbatches.expect(weight)
        if self._hint_checks:  # a bf16 set-up shows in the first calls; later ones cost nothing
            self._hint_checks -= 1
            _hints.warn_if_bf16(outputs, self._passthrough())
        if self._fp16_watch.watching and not self._passthrough():  # an FP16 run ends the watch on its first call
            self._fp16_watch.look(outputs, first_of_iteration=not self._began)
        if self._tracer is not None:
            self._tracer.end_forward()  # the forward that produced these outputs is over
        self._began = True
        self._stale_gradients = False  # a new backward follows
        if isinstance(outputs, torch.Tensor):  # the usual case, a loss
            return self._scale_tensor(outputs, weight)
        return _map_tensors(self._scale_tensor, outputs)

    def _scale_tensor(self, x: torch.Tensor, weight=None) -> torch.Tensor:
        t = self._t if self._t is not None else self._start(x.device)
        if self._microbatches is not None and not self._microbatches.admit(x, weight):  # one host read (opt-in)
            return torch.zeros_like(x).requires_grad_()  # its backward reaches no parameter: dropped
        if self._loss_check or self._spikes is not None:
            self._losses.append(x.detach())  # for the loss check (and a loss rule): no kernel now
        return x * t.scale.to(x.device, non_blocking=True)

    def _passthrough(self) -> bool:
        return isinstance(self._policy, StaticPolicy) and self._policy.scale == 1.0

    def _bad_loss(self, device: torch.device) -> torch.Tensor:
        """Whether a loss of this iteration (or, tracing, a forward output) was non-finite before scaling:
        a bool 0-dim tensor, made once per iteration, no sync. A rank that never called :meth:`scale` (a
        pipeline stage) says False, so every rank joins the same collectives. Also fixes ``_carried``, the
        scale the gradients carry: the loss scale, or over kept/total with dropped micro-batches."""
        if self._bad is None:
            batches = self._microbatches  # with bad_microbatch, the losses judge; every one dropped: bad
            losses = self._losses or ([] if batches is None or batches.kept else batches.dropped_losses)
            # No loss to judge (loss_check=False, or a pipeline stage): the state's constant False (never
            # written: every use below and in the check makes a new tensor), no operation.
            bad = self._t.false if not losses else None
            for loss in losses:
                finite = (torch.isfinite(loss) if loss.dim() == 0 else torch.isfinite(loss).all()).to(device)
                bad = ~finite if bad is None else bad | ~finite
            forward = None if self._tracer is None or batches is not None else self._tracer.forward_flag()
            self._carried = self._t.scale if batches is None else batches.carried(self._t.scale)
            self._bad = bad if forward is None else bad | forward.to(device)
        return self._bad

    def _observe(self, optimizer, gathered=None) -> None:
        """The opt-in features that look at the scaled gradients: telemetry (when due) and the trace."""
        if self._telemetry is not None and self._telemetry.due():
            g = gathered or self._check.gather(optimizer, allow_half=True)
            self._telemetry.observe(
                g.params, g.grads, self._names, self._t.scale, all_params=g.all_params, sharded=g.sharded
            )
        if self._tracer is not None:
            self._tracer.end_backward()

    def _check_optimizer(self, optimizer, rec: _Record, unscale: bool, sync: bool) -> Flags:
        """Check (and with ``unscale``, unscale) ``optimizer``'s gradients; keep the flags in its record.
        ``sync``: read the skip decision on the host now (one sync)."""
        t = self._t
        if self._telemetry is not None or self._tracer is not None:
            self._observe(optimizer)
        bad_loss = self._bad_loss(t.device)
        unscale = unscale and not self._passthrough()
        synced = unscale and sync and not self._policy.needs_amax
        if synced:  # torch's check+unscale kernel, then the one read
            gathered = self._check.gather(optimizer, allow_half=True)
            self._check.claim(gathered, self._unscaled)  # before any unscale
            kernel_flag = torch.zeros((), dtype=torch.float32, device=t.device)  # torch's found_inf, for its kernel
            self._gathered = (optimizer, gathered)  # torch's _unscale_grads_ takes them from here: one gather
            try:
                per_device = self._unscale_grads_(optimizer, inverse(self._carried), kernel_flag, self._allow_fp16)
            finally:
                self._gathered = None
            overflow = kernel_flag > 0  # (another device's flag joins it: rare)
            for flag in per_device.values():
                if flag is not kernel_flag:
                    overflow = overflow | (flag.to(t.device) > 0)
            spike = self._spike(optimizer, gathered.grads, scale=None)  # of the unscaled gradients
            flags = self._check.flags(overflow, t.false, bad_loss, spike, sync=sync)  # NaN: learnt below
            if flags.skipped:  # rare: tell NaN from inf, and which gradients held them
                flags.learn_nan(*self._check.nan_pass(gathered, t.device))
        else:  # the read-only pass first: it measures the *scaled* gradients
            gathered = self._check.gather(optimizer, allow_half=self._allow_fp16 or not unscale)
            vectors, worst, order = largest_magnitudes(gathered.grads, t.device)
            if unscale:
                self._check.multiply_(
                    gathered,
                    inverse(self._carried),
                    self._unscaled,
                    None if self._flushed is None else self._flushed.counter(t.device),
                )
            spike = self._spike(optimizer, gathered.grads, scale=None if unscale else self._carried)
            flags = self._check.flags(
                ~torch.isfinite(worst),
                torch.isnan(worst),
                bad_loss,
                spike,
                worst if self._policy.needs_amax else None,
                sync,
                [gathered.params[i] for i in order],
                vectors,
            )
        rec.flags = flags
        return flags

    def _spike(self, optimizer, grads, scale=None, norm=None) -> Optional[torch.Tensor]:
        """With ``skip_if``: whether this step is a spike on this rank (see lossscale.spikes); else None."""
        if self._spikes is None:
            return None
        return self._spikes.judge(optimizer, self._t.device, self._losses, grads, scale, norm)

    def _unscale_grads_(
        self, optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: Optional[bool] = None
    ):
        """torch's private primitive, with torch's signature and result: unscale ``optimizer``'s gradients
        by ``inv_scale`` in place, set ``found_inf`` where one was inf or NaN, return ``{device:
        found_inf}`` (``allow_fp16`` None: this scaler's setting, as ``ShardedGradScaler``'s default). The
        synced check calls it, so code that wraps or patches it changes what it does, as with torch."""
        allow = self._allow_fp16 if allow_fp16 is None else allow_fp16
        flushed = self._flushed.counter(found_inf.device) if allow and self._flushed is not None else None
        known = self._gathered[1] if self._gathered is not None and self._gathered[0] is optimizer else None
        gathered = self._check.gather(optimizer, allow_half=allow, known=known)
        return self._check.check_and_unscale(gathered, inv_scale, found_inf, flushed)

    def unscale_(self, optimizer) -> None:
        """Divide the optimizer's gradients by the scale (in place) and check them for inf/NaN.

        Optional, as in torch: before anything that reads gradient magnitudes (clipping, norm logging),
        at most once per optimizer per iteration, before :meth:`step`. Unscaling the same gradients twice
        in one iteration (through an optimizer wrapper) raises RuntimeError. Syncs once for optimizers
        without amp-scaling support (the sync torch pays in ``step()``), never for fused ones.
        """
        if not self._enabled:
            return
        self._t or self._require("unscale_()")
        rec = self._record(optimizer, "unscale_()")
        if rec.stage is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update(). Call it once per "
                "optimizer per iteration, between backward() and step() (a framework's clip_grad_norm_ may "
                "already have unscaled), and end every iteration with scaler.update()."
            )
        self._check_optimizer(optimizer, rec, unscale=True, sync=not _fused(optimizer))
        self._keep(optimizer, rec, OptState.UNSCALED)

    def clip_grad_norm_(
        self, optimizer, max_norm: float, norm_type: float = 2.0, *, norm_group: Any = None, expert_parallel: Any = None
    ) -> torch.Tensor:
        """Unscale and clip the optimizer's gradients by their true total norm; return that norm.

        Replaces ``unscale_(optimizer)`` + ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` with two
        passes over the gradients instead of three (``lossscale._check.clip_scaled_``: bitwise torch's
        two steps for a power-of-two scale). A non-finite norm is an overflow: the step is skipped and
        the gradients are only unscaled. Once per optimizer per iteration, instead of :meth:`unscale_`.
        The norm is over every rank's part of the parameters: DTensor gradients (FSDP2, tensor parallel)
        over their mesh, pipeline stages over ``norm_group``, in one all-reduce. Syncs like :meth:`unscale_`.
        Mixture-of-experts: ``expert_parallel=(this rank's expert parameters, the expert-parallel group)``
        (:func:`lossscale.distributed.norm_reduction`).
        """
        from ._check import clip_scaled_, validate_clip
        from .distributed import norm_reduction

        max_norm = plain_number("max_norm", max_norm)
        norm_type = validate_clip(max_norm, norm_type)
        if self._enabled:
            t = self._t or self._require("clip_grad_norm_()")
            rec = self._record(optimizer, "clip_grad_norm_()")
            if rec.stage is OptState.UNSCALED:
                raise RuntimeError(
                    "clip_grad_norm_() unscales the gradients itself, and unscale_() (or clip_grad_norm_()) was "
                    "already called on this optimizer since the last update(); call only one of them per iteration."
                )
        with torch.no_grad():
            gathered = self._check.gather(optimizer, allow_half=not self._enabled or self._passthrough(), coalesce=True)
            reduce_norm, counted = norm_reduction(
                gathered.all_params, gathered.params, norm_type, norm_group, expert_parallel
            )
            if not self._enabled:  # torch's clip, or the same reduced norm as when enabled, at scale 1
                if reduce_norm is None:
                    return torch.nn.utils.clip_grad_norm_(gathered.all_params, max_norm, norm_type)
                one = torch.ones((), device=gathered.grads[0].device if gathered.grads else "cpu")
                return clip_scaled_(gathered.grads, one, one, max_norm, norm_type, counted, reduce_norm)[0]
            self._observe(optimizer, gathered)
            self._check.claim(gathered, self._unscaled)
            amax = None
            if self._policy.needs_amax:  # of the *scaled* gradients, before they are rewritten
                amax = largest_magnitudes(gathered.grads, t.device)[1]
            bad_loss = self._bad_loss(t.device)
            true_norm, total, per_tensor, order = clip_scaled_(
                gathered.grads, self._carried, inverse(self._carried), max_norm, norm_type, counted, reduce_norm
            )
            spike = self._spike(optimizer, gathered.grads, norm=true_norm)  # the clip's true norm: no pass more
            # A per-tensor norm is NaN for a tensor holding a NaN, inf for one holding an inf: it names
            # the parameters in the overflow report as an amax vector does.
            rec.flags = self._check.flags(
                ~torch.isfinite(total),
                torch.isnan(total),
                bad_loss,
                spike,
                amax,
                not _fused(optimizer),
                [gathered.params[i] for i in order],
                [per_tensor] if order else [],
            )
        self._keep(optimizer, rec, OptState.UNSCALED)
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
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._t or self._require("step()")
        rec = self._record(optimizer, "step()")
        if rec.stage is OptState.STEPPED:
            raise RuntimeError(
                "step() has already been called since the last update(). Call scaler.update() once at the end "
                "of every iteration, after scaler.step(optimizer) for each optimizer (a missing update() makes "
                "the next iteration's step() the second)."
            )
        if not getattr(optimizer, "_step_supports_amp_scaling", False):  # see _fused
            flags = rec.flags or self._check_optimizer(optimizer, rec, unscale=True, sync=True)
            retval = None if flags.was_skipped() else optimizer.step(*args, **kwargs)
        elif _takes_grad_scaler(optimizer.step):
            warn(
                "lossscale.GradScaler passes itself as grad_scaler=, a contract torch is deprecating; "
                "prefer optimizers that read grad_scale/found_inf.",
                FutureWarning,
            )
            # torch's contract: the optimizer reads its stage, checks (_check_inf_per_device) or writes its
            # found_inf_per_device into its record, and skips by itself; the record it leaves is the one kept.
            self._records[id(optimizer)] = rec
            retval = optimizer.step(*args, grad_scaler=self, **kwargs)
            rec = self._records.get(id(optimizer), rec)
        else:
            host = _first_step_needs_the_host(optimizer)  # a skip decided on device would leave garbage
            flags = rec.flags or self._check_optimizer(optimizer, rec, unscale=False, sync=host)
            if host and flags.was_skipped():
                retval = None
            else:
                unscaled = rec.stage is OptState.UNSCALED
                retval = _step_with_flags(
                    optimizer, None if unscaled else self._carried, found_inf(flags), args, kwargs
                )
        self._keep(optimizer, rec, OptState.STEPPED)
        return retval

    def _record(self, optimizer, call: str) -> Dict[str, Any]:
        """``optimizer``'s record of this iteration (a fresh one is kept only by :meth:`_keep`, so a call
        that fails leaves nothing behind)."""
        if not hasattr(optimizer, "param_groups"):
            raise ValueError(
                f"{call}: optimizer={optimizer!r} is not an optimizer (no param_groups); pass the "
                "torch.optim optimizer whose gradients were scaled."
            )
        if self._stale_gradients:
            raise RuntimeError(
                f"{call}: load_state_dict() was called in mid-iteration, after the gradients were scaled by the "
                "scale from before the load; unscaled by the loaded one they would take a wrong step. Those "
                "gradients belong to the run before the load: zero the gradients and run a new "
                "scaler.scale(loss).backward() (a rank that calls no scale(), such as a pipeline stage, calls "
                "scaler.discard_iteration() once they are zeroed)."
            )
        rec = self._records.get(id(optimizer))
        if rec is None or (rec.stage is OptState.READY and rec.flags is None):
            return _Record()
        if rec.stage is OptState.STEPPED and call != "step()":
            raise RuntimeError(
                f"{call} is being called after step(); call it before step() in the iteration, and end every "
                "iteration with scaler.update() (a missing update() puts the next iteration's calls after step())."
            )
        return rec

    def _keep(self, optimizer, rec: Dict[str, Any], stage: OptState) -> None:
        rec.stage = stage
        self._records[id(optimizer)] = rec

    def update(self, new_scale: Union[float, torch.Tensor, None] = None) -> None:
        """Advance the policy by one iteration (or set ``new_scale``), after :meth:`step` for every
        optimizer of the iteration. No sync: the policy's tensor rule runs on the device state.

        A float ``new_scale`` must lie within the bounds; a tensor one is copied on device, ignored
        when not finite or below 2**-126 (a host check would sync), clamped to the bounds; the counters
        still count the iteration. Then a snapshot of the state starts to the host; the landed ones (on
        CPU at once, on a GPU usually by the next update) feed the health account and the stuck check
        (``on_stuck``). Under torch.compile or CUDA-graph capture none does: see :meth:`check_stuck`.
        """
        if not self._enabled:
            return
        t = self._t or self._require("update()")
        if new_scale is not None:
            new_scale = _valid_new_scale(self._policy, new_scale, t.device)
        flags = self._iteration_flags(required=new_scale is None)
        self._advance(t, flags, new_scale)
        evidence = self._close_iteration(flags)
        for callback in list(self._step_callbacks.values()):  # on_step: the host's bool, else the device flag
            callback(True if flags is None else not flags.skipped if flags.skipped is not None else ~flags.skip)
        self._send_state(t, evidence)

    def _iteration_flags(self, required: bool) -> Optional[Flags]:
        """The iteration's flags, its optimizers' combined; None when none was checked (``update(new_scale)``
        alone; RuntimeError when ``required``)."""
        checked = [rec.flags for rec in self._records.values() if rec.flags is not None]
        if not checked:
            if required:
                raise RuntimeError(
                    "update() found no inf checks since the last update(): call "
                    "scaler.step(optimizer) (or unscale_) for each optimizer before update()."
                )
            return None
        return combine(checked, self._t.device)

    def _advance(self, t: TensorState, flags: Optional[Flags], new_scale) -> None:
        """The policy's tensor rule on the device state, or ``new_scale`` set (the iteration still counted;
        torch leaves the trackers alone). No sync. The policy's ``found_inf`` is a skip the scale or the
        loss caused: a spike (``skip_if``) is a clean step for the scale."""
        if flags is None:
            found = None
        else:  # overflow | bad_loss: the skip flag itself, unless a spike joined it
            found = flags.skip if flags.spike is None else flags.overflow | flags.bad_loss
        if new_scale is None:
            self._policy.tensor_update(t, found, flags.nan, flags.bad_loss, flags.amax)
            return
        if flags is not None:
            count_tensor(t, found, flags.nan, flags.bad_loss)
        _set_scale(self._policy, t, new_scale)

    def _close_iteration(self, flags: Optional[Flags]) -> Optional[Dict[str, Any]]:
        """Keep the iteration's decision, let the features learn the step, start the next iteration.
        Returns what the first-cause report needs if the step may have been skipped (device tensors)."""
        if self._spikes is not None:
            self._spikes.learn({key: rec.flags for key, rec in self._records.items()})
        self._last, evidence = flags, None
        if flags is not None and flags.skipped is not False:  # possibly skipped: keep what the report needs
            checked = [rec.flags for rec in self._records.values() if rec.flags is not None]
            evidence = dict(
                losses=self._losses,
                source=[(f.params, f.amax_vectors) for f in checked],
                spikes=[f.spike for f in checked if f.spike is not None],
                trace=None if self._tracer is None else self._tracer.snapshot(),
            )
            self._evidence, self._last_report = evidence, None
        elif self._tracer is not None:
            self._tracer.snapshot()  # the next iteration starts afresh
        self._new_iteration()
        if self._telemetry is not None:
            self._telemetry.iteration += 1
        return evidence

    def _send_state(self, t: TensorState, evidence: Optional[Dict[str, Any]]) -> None:
        """Start a snapshot of the state to the host; feed the landed ones to the health account and the
        stuck check. Under CUDA-graph capture or torch.compile nothing reaches the host."""
        if torch.compiler.is_compiling() or (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            self._graphed = True  # replays move the state without update(): never trust a kept decision
            return
        self._snapshots.append(Snapshot(t, evidence))
        self._learn_landed()

    def on_step(self, fn: Callable[[Any], Any]):
        """Call ``fn(taken)`` after every :meth:`update`: whether the iteration's optimizer step was taken.
        ``taken`` is a bool where the host decided the step (no sync), and a bool 0-dim device tensor on
        the fused path (read it, one sync, or gate device work with ``torch.where``). For code that acts on
        a step that really happened (a SCAFFOLD correction, an EMA, a step counter). Returns a handle whose
        ``remove()`` stops the calls; copies of the scaler do not keep them."""
        from torch.utils.hooks import RemovableHandle

        handle = RemovableHandle(self._step_callbacks)
        self._step_callbacks[handle.id] = fn
        return handle

    def record_overflow(self, nan: bool = False) -> None:
        """Close this iteration as an overflow that something else found (a framework that checked the
        gradients itself and skipped its step, as DeepSpeed's ZeRO does): the policy answers it as one of
        its own check's, in place of :meth:`update`; the gradients are not touched. No sync."""
        t = self._t or self._require("record_overflow()")
        flags = Flags(
            overflow=torch.ones((), dtype=torch.bool, device=t.device),
            nan=torch.full((), nan, dtype=torch.bool, device=t.device),
            bad_loss=torch.zeros((), dtype=torch.bool, device=t.device),
            skipped=True,
        )
        self._records = {id(self): _Record(OptState.STEPPED, flags)}
        self.update()

    def _new_iteration(self) -> None:
        self._records: Dict[int, _Record] = {}  # by id(optimizer); torch's shape: _per_optimizer_states
        self._losses, self._bad, self._began, self._carried = [], None, False, None
        if self._microbatches is not None:
            self._microbatches.new_iteration()
        self._unscaled = set()  # ids of the parameters whose gradients this iteration unscaled
        self._gathered = None  # (optimizer, Gathered) while the synced check hands them to _unscale_grads_

    def _learn_landed(self) -> None:
        """Feed every landed snapshot, oldest first, to the health account and the stuck check. Never waits."""
        while self._snapshots and self._snapshots[0].landed():
            snap = self._snapshots.popleft()  # taken off first: a raising reaction does not raise again
            state, scale_before = snap.read()
            self._health.record(self._policy, state, scale_before, snap.evidence if self._tracer else None)
            if self._upcast is not None:  # a skipped step's first forward (at 1 or below: backward) overflow:
                # one read, on skipped steps only
                self._upcast.learn(state, snap.evidence, self._tracer, past_scale=self._past_scale(scale_before))
            if state.overflow_streak or self._warned_streak:
                self._react(state, scale_before, snap.evidence)

    def _past_scale(self, scale_before: float) -> bool:
        """Whether a backward overflow at ``scale_before`` is past what the scale can fix: the scale sat at 1
        or below (below 1 it only shrinks every gradient), or at its floor where that is higher. False
        without a floor (``min_scale=None``: the backoff goes on as torch's)."""
        floor = self._policy.scale_bounds()[0]
        return floor is not None and scale_before <= max(1.0, floor)

    def _react(self, state: ScaleState, scale_before: float, evidence) -> None:
        """Warn (once per streak) or raise, per ``on_stuck``, if ``state`` says training is stuck."""
        if state.overflow_streak == 0:
            self._warned_streak = False
            return
        if self._policy.on_stuck == "ignore" or not self._policy.is_stuck(state, scale_before):
            return
        from .diagnosis import diagnose

        # Rare (the run is stuck): one sync to say where the trouble began, and which module's backward
        # overflowed with its forward and its loss finite (the trace names it).
        tripped = None if evidence is None else self._report(evidence, scale_before)
        backward = None
        if tripped is not None and tripped["forward"] is None and tripped["loss"] == "finite":
            backward = tripped["backward"]
        message = diagnose(self._policy, state, tracing=self._tracer is not None, backward=backward)
        if tripped is not None:
            message += "\nThe step that tripped this check: " + tripped["cause"]
        if self._policy.on_stuck == "raise":
            raise RuntimeError(message)
        if not self._warned_streak:
            self._warned_streak = True
            warn(message, RuntimeWarning)

    def check_stuck(self) -> None:
        """Run the stuck check on the state now (warn or raise per ``on_stuck``); one sync. :meth:`update`
        runs it on every state that reaches the host; under CUDA-graph capture or ``torch.compile`` none
        does, so such a loop calls this eagerly now and then."""
        if self._enabled and self._t is not None:
            self._react(*self._t.read(), None)

    # ------------------------------------------------------------------ what it tells about the run
    def _describe(self, evidence, scale_before: Optional[float]) -> str:
        return self._report(evidence, scale_before)["cause"]

    def _report(self, evidence, scale_before: Optional[float]) -> Dict[str, Any]:
        """The first-cause report of ``evidence`` (:func:`lossscale._overflow.report`). Syncs."""
        from . import _overflow

        floor = self._policy.scale_bounds()[0]
        return _overflow.report(evidence, self._names, self._tracer, scale_before, floor=floor)

    def health(self) -> HealthReport:
        """The run's health (:mod:`lossscale.health`): every skip classified (the scale calibrating, an
        overflow in steady training, a bad batch, persistent NaN), the state now, a verdict and what to
        do. Built from the snapshots :meth:`update` sends; reading it syncs once, once more with
        telemetry, once per kept first cause (``trace=True``)."""
        if not self._enabled:
            from .health import disabled

            return disabled()
        self._learn_landed()
        state, before = (self._init_state, None) if self._t is None else self._t.read()
        sampled = self._telemetry is not None and self._telemetry.overall is not None
        report = self._health.report(
            self._policy,
            state,
            before,
            self._telemetry.overall.flushed_frac if sampled else None,
            self._telemetry.step_collected if sampled else None,
            self._describe,
            upcast_modules=None if self._upcast is None else tuple(self._upcast.kept),
            backward_upcasts=None
            if self._upcast is None or not self._upcast.backward
            else tuple(self._upcast.kept_backward),
            tracing=self._tracer is not None,
            no_fp16=self._fp16_watch.idle,
            **self._opt_in_counts(),
        )
        from .rescaling import with_rescaling

        return with_rescaling(report)  # which residual-stream rescaling is in force (lossscale.rescale), if any

    def overflow_report(self) -> Dict[str, Any]:
        """Why the last step was skipped, as a dict: ``"inf"``, ``"nan"`` (the parameters whose gradients
        held them), ``"loss"`` ("finite", "inf" or "nan" before scaling), ``"forward"``, ``"backward"``
        (with ``trace=True``, the first module whose output / input gradient was non-finite),
        ``"scale"`` (the scale the step ran with), ``"cause"`` (one line). Empty when the last step was
        not skipped. Syncs."""
        from . import _overflow

        if not self._read_skipped(self._last):
            return dict(_overflow.NOT_SKIPPED)
        if self._last_report is None:
            scale = None if self._t is None else float(self._t.scale_before.item())
            self._last_report = self._report(self._evidence or {}, scale)
        return self._last_report

    def _decided(self, optimizer=None) -> List[Optional[Flags]]:
        """The flags that say whether the last step was skipped: this iteration's steps so far
        (``optimizer``'s when it has stepped), else the last update's. RuntimeError between a check and
        the first step: nothing is decided yet."""
        rec = self._records.get(id(optimizer)) if optimizer is not None else None
        if rec is not None and rec.stage is OptState.STEPPED:
            return [rec.flags]
        stepped = [r.flags for r in self._records.values() if r.stage is OptState.STEPPED]
        if not stepped and any(r.flags is not None for r in self._records.values()):
            raise RuntimeError(
                "The optimizer step of this iteration has not happened yet (unscale_()/clip_grad_norm_() ran, "
                "step() did not), so whether it is skipped is not known. Ask after scaler.step(optimizer)."
            )
        return stepped or [self._last]

    def _read_skipped(self, flags: Optional[Flags]) -> bool:
        """Whether ``flags`` skipped their step: the host's decision, or the device flag read once (a
        sync, fused optimizers only; every time for the last update's under CUDA-graph capture, whose
        replays move it)."""
        if flags is None:
            return False
        if flags is self._last and self._graphed:
            return bool(flags.skip.item())
        return flags.was_skipped()

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last :meth:`step` was skipped: this iteration's (any optimizer so far) between
        :meth:`step` and :meth:`update`, otherwise the last iteration's. Free where the host decided the
        step; for fused optimizers the first read syncs."""
        stepped = [r.flags for r in self._records.values() if r.stage is OptState.STEPPED]
        return any(self._read_skipped(f) for f in stepped or [self._last])

    def step_was_skipped(self, optimizer=None) -> bool:
        """Whether ``optimizer``'s last step was skipped (each optimizer skips on its own gradients, as in
        torch; None: the iteration's so far), for code that acts on it. After :meth:`update`, the last
        iteration's. RuntimeError between a check and the first step. May sync: see :attr:`last_step_skipped`."""
        return any(self._read_skipped(f) for f in self._decided(optimizer))

    def skip_flag(self, optimizer=None) -> Union[bool, torch.Tensor]:
        """:meth:`step_was_skipped` without a sync: a bool where the host decided the step, else a bool
        0-dim tensor on the state's device (fused optimizers), to gate device work with ``torch.where``."""
        if not self._enabled:
            return False
        decided = [f for f in self._decided(optimizer) if f is not None]
        if all(f.skipped is not None for f in decided):
            return any(f.skipped for f in decided)
        return combine(decided, self._t.device).skip

    @property
    def skipped_steps(self) -> int:
        """Skipped iterations so far. Syncs: see :meth:`state`."""
        return self.state().skipped_steps if self._enabled else 0

    def step_scheduler(self, scheduler, *args, **kwargs) -> bool:
        """``scheduler.step()`` unless its optimizer's step was skipped (an LR schedule that advanced on
        skipped steps drifts ahead of the weights); returns whether it stepped. After :meth:`step`,
        before or after :meth:`update`. May sync: see :attr:`last_step_skipped`.

        ``scheduler`` is anything with a ``step()`` that is not an optimizer: torch's LR schedulers
        (``ReduceLROnPlateau`` included) or a duck-typed one (transformers', DeepSpeed's). An optimizer
        is refused (TypeError), before anything steps: its ``step()`` here would move the weights a
        second time, unguarded."""
        _refuse_non_scheduler(scheduler)
        if self._enabled and self.step_was_skipped(getattr(scheduler, "optimizer", None)):
            return False
        scheduler.step(*args, **kwargs)
        return True

    def counters(self) -> Dict[str, int]:
        """Every counter: steps, skipped, inf, NaN and bad-loss steps, the current streak; with ``skip_if``
        the spikes skipped (``spike_steps``), with ``allow_fp16`` the values flushed (``fp16_flushed``).
        Syncs once (once more for each of those)."""
        return {**_counters(self.state()), **self._opt_in_counts()}

    def _opt_in_counts(self) -> Dict[str, int]:
        """The opt-in features' counts (``fp16_flushed``, ``spike_steps``, ...); a sync each."""
        return {name: n for feature in self._features for name, n in feature.counts().items()}

    def metrics(self) -> Dict[str, Union[int, float, bool]]:
        """A flat dict of numbers for any logger: ``loss_scale``, the :meth:`counters`,
        ``last_step_skipped``, and with telemetry the last sampled iteration's figures (see
        :meth:`metric_labels`). Syncs once (the state rides in the telemetry's transfer); with telemetry
        reducing across ranks, a collective."""
        state, figures = None, {}
        if self._telemetry is None:
            state = self.state()
        else:
            group = self._check.group() if self._telemetry.wants_reduction() else None
            also = [self._t.values()] if self._enabled and self._t is not None else []
            figures, riding = self._telemetry.metrics_with(group=group, device=self.device, also=also)
            state = self._t.decode(self._t.unpack(riding[0]))[0] if also else self._init_state
        out: Dict[str, Any] = {"loss_scale": state.scale if self._enabled else 1.0}
        if self._enabled:
            out.update(_counters(state), **self._opt_in_counts())
        out["last_step_skipped"] = bool(self._enabled and self.last_step_skipped)
        out.update(figures)
        return out

    def metric_labels(self) -> Dict[str, str]:
        """Text that goes with :meth:`metrics` (``grad/measured``: e.g. "float32 as fp16"). No sync."""
        return {} if self._telemetry is None else self._telemetry.labels()

    # ------------------------------------------------------------------ torch's getters and setters
    @property
    def _device(self) -> str:
        """torch's private attribute: the device string."""
        if self._t is not None:
            return str(self._t.device)
        return self._device_type or ("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def _init_scale(self) -> float:
        """torch's attribute: the scale the state starts at (the policy's ``init_scale``)."""
        return self._policy.config().get("init_scale", self._policy.config().get("scale"))

    @property
    def _init_growth_tracker(self) -> int:
        """torch's attribute: the growth tracker the state starts with (once the state is on a device, its
        tracker now: one sync)."""
        return self._get_growth_tracker() if self._t is not None else getattr(self._init_state, "growth_tracker", 0)

    @_init_growth_tracker.setter
    def _init_growth_tracker(self, value: int) -> None:
        if self._t is None and hasattr(self._init_state, "growth_tracker"):
            self._init_state = self._init_state.replace(growth_tracker=int(value))
        elif hasattr(self._t, "growth_tracker"):
            self._t.growth_tracker.fill_(int(value))

    _growth_factor = property(
        lambda self: self.get_growth_factor(),
        lambda self, v: self.set_growth_factor(v),
        doc="torch's attribute: :meth:`get_growth_factor` / :meth:`set_growth_factor`.",
    )
    _backoff_factor = property(
        lambda self: self.get_backoff_factor(),
        lambda self, v: self.set_backoff_factor(v),
        doc="torch's attribute: :meth:`get_backoff_factor` / :meth:`set_backoff_factor`.",
    )
    _growth_interval = property(
        lambda self: self.get_growth_interval(),
        lambda self, v: self.set_growth_interval(v),
        doc="torch's attribute: :meth:`get_growth_interval` / :meth:`set_growth_interval`.",
    )

    def _lazy_init_scale_growth_tracker(self, device) -> None:
        """torch's private name for :meth:`init_device`."""
        if self._enabled:
            self.init_device(device)

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Syncs once, as torch's."""
        return self.state().scale if self._enabled else 1.0

    def _get_scale_async(self) -> Optional[torch.Tensor]:
        """The scale tensor without a sync (None before the first :meth:`scale`), as in torch."""
        return self._scale

    def _get_growth_tracker(self) -> int:
        """torch's private getter (used by some trainers). Syncs."""
        return getattr(self.state(), "growth_tracker", 0) if self._enabled else 0

    def _set_policy(self, **changes) -> None:
        missing = [k for k in changes if k not in self._policy.config()]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} do(es) not apply to the {type(self._policy).__name__}.")
        self._policy = dataclasses.replace(self._policy, **changes)  # validates the new value

    def get_growth_factor(self) -> float:
        """The growth factor: the one :meth:`state_dict` gives torch (1.0 for a static scale; the policy's
        own, or torch's default where it has none: what a torch scaler loading the state would use)."""
        return self._policy.torch_factors()["growth_factor"]

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (validated: > 1)."""
        self._set_policy(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The backoff factor, as :meth:`state_dict` gives it to torch (see :meth:`get_growth_factor`)."""
        return self._policy.torch_factors()["backoff_factor"]

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (validated: in (0, 1))."""
        self._set_policy(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """The growth interval, as :meth:`state_dict` gives it to torch (2**31 - 1 for a static scale: an
        interval torch's int32 tracker never reaches; see :meth:`get_growth_factor`)."""
        return self._policy.torch_factors()["growth_interval"]

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (validated: int >= 1). Lowered below the current clean streak, the
        next clean step grows the scale (torch's tracker would never meet it again). No sync."""
        self._set_policy(growth_interval=new_interval)
        if self._t is None and hasattr(self._init_state, "growth_tracker"):
            tracker = min(self._init_state.growth_tracker, new_interval - 1)
            self._init_state = self._init_state.replace(growth_tracker=tracker)
        elif hasattr(self._t, "growth_tracker"):
            self._t.growth_tracker.clamp_(max=new_interval - 1)

    def is_enabled(self) -> bool:
        """Whether scaling is enabled."""
        return self._enabled

    def _found_inf_per_device(self, optimizer) -> Dict[torch.device, torch.Tensor]:
        """torch's private accessor, used by some trainers: this iteration's found_inf per device."""
        rec = self._records.get(id(optimizer))
        return {} if rec is None else rec.found_inf_per_device()

    def _check_inf_per_device(self, optimizer) -> Dict[torch.device, torch.Tensor]:
        """torch's private read-only check, used by some trainers."""
        self._t or self._require("_check_inf_per_device()")
        rec = self._record(optimizer, "_check_inf_per_device()")
        self._check_optimizer(optimizer, rec, unscale=False, sync=False)
        rec.written = None  # this check's flags are the record's now
        self._records[id(optimizer)] = rec
        return rec.found_inf_per_device()

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
        """The complete, versioned state (``lossscale.checkpoint``): config, scale, every tracker and
        counter, torch's five keys (a torch ``GradScaler`` loads it) and the opt-in features' entries (the
        telemetry's iteration count, ...). Empty when disabled (as torch). Syncs once (and once per
        feature count). Call it after :meth:`update`."""
        if not self._enabled:
            return {}
        out = checkpoint.to_dict(self._policy, self.state())
        for feature in self._features:
            out.update(feature.entries())
        return out

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict`, or from ``torch.amp.GradScaler.state_dict()`` (which
        continues exactly as torch would). Works before the first :meth:`scale`; validates everything
        before changing anything (ValueError naming the key); fills the state tensors in place (a CUDA
        graph captured before keeps reading the live scale). The checkpoint's policy wins over the
        constructor's, with a warning when they differ.

        In mid-iteration (after :meth:`scale`, before :meth:`update`; torch's own tests load there) it
        loads, warns, and discards the iteration in flight: nothing of it is counted. Its gradients carry
        the scale from before the load, so :meth:`unscale_`, :meth:`clip_grad_norm_` and :meth:`step`
        refuse them (RuntimeError) until a new :meth:`scale` (or :meth:`discard_iteration`, once they are
        zeroed). Refused rather than unscaled by the scale they carry: the checkpoint restores a run at an
        iteration boundary, and a step from gradients of the run before the load, written into the
        loaded run, would belong to neither (torch unscales them by the loaded scale, silently)."""
        if not self._enabled:
            return
        policy, state = checkpoint.load(state_dict, self._policy)
        loaded = [(feature, feature.loadable(state_dict)) for feature in self._features]
        # Everything is validated: now swap.
        in_flight = self._in_flight()
        if in_flight:
            warn(
                "lossscale: load_state_dict() was called in mid-iteration (after scale(), before update()): the "
                "state is loaded and the iteration in flight is discarded (nothing of it is counted). Its "
                "gradients carry the old scale, so unscale_() and step() refuse them: zero the gradients and run "
                "a new scaler.scale(loss).backward().",
                RuntimeWarning,
            )
        for feature, value in loaded:
            feature.load(value)
        self._policy = policy
        if self._t is None:
            self._init_state = state
        elif self._t.state_type is type(state):
            self._t.load_(state)
        else:  # another policy's state: new tensors
            self._t = TensorState(state, self._t.device)
        self.discard_iteration()
        self._stale_gradients = in_flight
        self._snapshots.clear()
        self._warned_streak = False
        self._health.reset(state)
        self._last, self._evidence, self._last_report = None, None, None

    def discard_iteration(self) -> None:
        """Forget the iteration in flight: what :meth:`scale`, :meth:`unscale_`, :meth:`clip_grad_norm_`
        and :meth:`step` recorded since the last :meth:`update`; nothing is counted. The gradients are
        not touched (zero them: they may carry the scale), a step that ran is not undone. After a
        mid-iteration :meth:`load_state_dict`, it says the gradients were zeroed (see there). No sync."""
        self._new_iteration()
        self._stale_gradients = False
        if self._tracer is not None:
            self._tracer.snapshot()  # the traced passes of the dropped iteration

    def _in_flight(self) -> bool:
        """Whether an iteration has begun: scale() or a check ran since the last update()."""
        return self._began or any(r.flags is not None or r.stage is not OptState.READY for r in self._records.values())

    def __getstate__(self) -> Dict[str, Any]:
        # As torch: not once an optimizer was checked (after scale() is fine: the copy starts afresh).
        if any(r.flags is not None or r.stage is not OptState.READY for r in self._records.values()):
            raise RuntimeError(
                "A GradScaler can be pickled only at the beginning of an iteration, before any "
                "unscale_(), clip_grad_norm_() or step() (as torch's), or after update()."
            )
        state = self.__dict__.copy()
        # The state as numbers; the copy makes its tensors afresh on the next scale(), as torch's does.
        state.update(
            _init_state=self.state(),
            _t=None,
            _snapshots=collections.deque(maxlen=SNAPSHOTS),
            _evidence=None,
            _last_report=None,
            _last=_decided_on_host(self._read_skipped(self._last)),
            _step_callbacks=collections.OrderedDict(),
        )
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._new_iteration()

    def __deepcopy__(self, memo: Dict[int, Any]) -> "GradScaler":
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin  # first, so copied references to this scaler (bound methods) reach the twin
        twin.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return twin

    def __repr__(self) -> str:
        where = "not started" if self._t is None else str(self._t.device)
        return f"lossscale.GradScaler(enabled={self._enabled}, policy={self._policy!r}, {where})"


# ------------------------------------------------------------------------------------- helpers
def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index: "cuda" alone means the current CUDA device."""
    return (
        torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None else device
    )


def _check_process_group(group: Any) -> None:
    """ValueError unless ``group`` is what torch.distributed takes as a group: None, "default", a
    ``ProcessGroup``, the ``GroupMember.NON_GROUP_MEMBER`` that ``new_group`` gives the ranks outside it,
    or an object with a group's ``rank()`` and ``size()`` (the stand-in torch's sharded-scaler tests pass)."""
    if group is None or (isinstance(group, str) and group == DEFAULT_GROUP):
        return
    dist = torch.distributed
    if dist.is_available():
        from torch.distributed.distributed_c10d import GroupMember

        if isinstance(group, dist.ProcessGroup) or (type(group) is int and group == GroupMember.NON_GROUP_MEMBER):
            return
    if not isinstance(group, (str, bytes, int, float)) and all(
        callable(getattr(group, m, None)) for m in ("rank", "size")
    ):
        return
    hint = " (a DeviceMesh: pass mesh.get_group(dim))" if type(group).__name__ == "DeviceMesh" else ""
    raise ValueError(
        f"process_group={group!r} is not a process group{hint}; pass 'default' (the default group when "
        "torch.distributed runs), None (no reduction) or a group (a torch.distributed ProcessGroup, such as "
        "dist.new_group(ranks) returns)."
    )


def _make_policy(policy, given: Dict[str, Any]):
    if isinstance(policy, str):
        own = [n for n in inspect.signature(GradScaler).parameters if n != "policy_keywords"]
        return policy_from_keywords(policy, given, own)
    if not isinstance(policy, Policy):
        raise ValueError(f"policy={policy!r} is neither a policy name nor a policy object (lossscale.policy.Policy).")
    if given:
        raise ValueError(
            f"policy is a policy object, so {', '.join(given)} must be set on the object, not passed "
            "to GradScaler as well."
        )
    return policy


def _refuse_non_scheduler(scheduler) -> None:
    """TypeError for what :meth:`GradScaler.step_scheduler` must not step: an optimizer (a
    ``torch.optim.Optimizer``, or an object with ``param_groups`` and no ``optimizer`` of its own, as a
    scheduler has) or something without a ``step()``."""
    is_optimizer = isinstance(scheduler, torch.optim.Optimizer) or (
        hasattr(scheduler, "param_groups") and not hasattr(scheduler, "optimizer")
    )
    if is_optimizer:
        raise TypeError(
            f"step_scheduler() got an optimizer ({type(scheduler).__name__}), whose step() would move the "
            "weights a second time; pass the LR scheduler (scaler.step_scheduler(lr_scheduler)), and step "
            "the optimizer with scaler.step(optimizer)."
        )
    if not callable(getattr(scheduler, "step", None)):
        raise TypeError(
            f"step_scheduler() takes an LR scheduler (an object with a step() method, such as "
            f"torch.optim.lr_scheduler.LambdaLR), got {type(scheduler).__name__}."
        )


def _counters(s: ScaleState) -> Dict[str, int]:
    return {
        "steps": s.steps,
        "skipped_steps": s.skipped_steps,
        "inf_steps": s.inf_steps,
        "nan_steps": s.nan_steps,
        "bad_loss_steps": s.bad_loss_steps,
        "overflow_streak": s.overflow_streak,
    }


def _decided_on_host(skipped: bool) -> Optional[Flags]:
    """Flags that say only whether a step was skipped (a copy of the scaler keeps that, not the device
    flags): None for a step taken."""
    if not skipped:
        return None
    no = torch.zeros((), dtype=torch.bool)
    return Flags(overflow=torch.ones((), dtype=torch.bool), nan=no, bad_loss=no, skipped=True)


def _valid_new_scale(policy, new_scale, device: torch.device):
    """``update(new_scale)``'s argument: a Python float within the policy's bounds, or a 1-element float
    tensor on the state's device type; ValueError naming it otherwise."""
    if isinstance(new_scale, torch.Tensor):
        if new_scale.numel() != 1 or new_scale.requires_grad or not new_scale.is_floating_point():
            raise ValueError(
                "new_scale must be a float or a 1-element floating-point tensor with requires_grad="
                f"False; got a {new_scale.dtype} tensor of shape {tuple(new_scale.shape)}."
            )
        if new_scale.device.type != device.type:
            raise ValueError(f"new_scale is on {new_scale.device} but the scaler's state is on {device}.")
        return new_scale
    new_scale = plain_number("new_scale", new_scale)
    if isinstance(new_scale, bool) or not isinstance(new_scale, (int, float)):
        raise ValueError(f"new_scale={new_scale!r} must be a float or a 1-element tensor.")
    if not SMALLEST_SCALE <= f32(new_scale) < float("inf"):
        raise ValueError(
            f"new_scale={new_scale!r} must be finite and within float32's normal range "
            "[2**-126, 3.4e38], where the scale is kept."
        )
    lo, hi = policy.scale_bounds()
    if (lo is not None and new_scale < lo) or (hi is not None and new_scale > hi):
        raise ValueError(f"new_scale={new_scale!r} is outside [min_scale={lo}, max_scale={hi}].")
    return new_scale


def _set_scale(policy, t: TensorState, new_scale) -> None:
    """Write ``update(new_scale)``'s scale on device. No sync."""
    if not isinstance(new_scale, torch.Tensor):
        t.scale.fill_(new_scale)
        return
    value = new_scale.detach().reshape(()).to(t.scale)
    # A non-finite or too small scale would poison every later step: keep the old one, decided on
    # device and before the clamp (which would turn inf into max_scale as if it had been asked for).
    ok = torch.isfinite(value) & (value >= SMALLEST_SCALE)
    lo, hi = policy.scale_bounds()
    if lo is not None or hi is not None:
        value = value.clamp(lo, hi)
    t.scale.copy_(torch.where(ok, value, t.scale))


def _refuse_unscalable(outputs: Any) -> None:
    """ValueError for what cannot be scaled: not a tensor nor a list, tuple or dict of them (other
    iterables are checked as they are consumed), or a tensor on the meta device (it holds no values)."""
    if isinstance(outputs, torch.Tensor):
        if outputs.device.type == "meta":
            raise ValueError(
                "scale() got a tensor on the meta device, which holds no values; scale the loss of a "
                "real forward (the scaler's state lives on the loss's device)."
            )
        return
    if isinstance(outputs, (dict, list, tuple)):
        for value in outputs.values() if isinstance(outputs, dict) else outputs:
            _refuse_unscalable(value)
    elif not isinstance(outputs, abc.Iterable) or isinstance(outputs, (str, bytes)):
        raise ValueError(
            f"scale() takes a tensor or (nested) lists, tuples or dicts of tensors, got {type(outputs).__name__}."
        )


def _map_tensors(fn: Callable, value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor, keeping the containers' types (a named tuple stays
    one, a defaultdict keeps its factory); other iterables come back as a lazy ``map``, as in torch."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        out = copy.copy(value)
        for k, v in value.items():
            out[k] = _map_tensors(fn, v)
        return out
    if isinstance(value, (list, tuple)):
        mapped = [_map_tensors(fn, v) for v in value]
        return type(value)(*mapped) if hasattr(value, "_fields") else type(value)(mapped)
    return map(lambda v: _map_tensors(fn, v), value)


# ---------------------------------------------------------------------- driving an optimizer's step
def _fused(optimizer) -> bool:
    """Whether the optimizer unscales and skips by itself: torch's ``_step_supports_amp_scaling``
    (fused Adam, AdamW, SGD, Adagrad) reads ``grad_scale`` and ``found_inf`` during ``step()``."""
    return getattr(optimizer, "_step_supports_amp_scaling", False)


_GRAD_SCALER_KWARG: Dict[Any, bool] = {}  # per step function: inspect.signature costs ~100 us


def _takes_grad_scaler(step) -> bool:
    """Whether ``step`` takes the deprecated ``grad_scaler=`` keyword (the optimizer asks the scaler)."""
    func = getattr(step, "__func__", step)
    found = _GRAD_SCALER_KWARG.get(func)
    if found is None:
        found = _GRAD_SCALER_KWARG[func] = "grad_scaler" in inspect.signature(step).parameters
    return found


def _first_step_needs_the_host(optimizer) -> bool:
    """Whether a skip decided on device would leave this optimizer's state garbage, so the host decides
    its step (one sync): torch's ``SGD(fused=True)`` with momentum makes its buffers with ``empty_like`` on
    its first step and lets the kernel fill them; a skipped first step leaves them uninitialised, read as
    momentum next (torch 2.13 ``optim/sgd.py``; measured: weights at 5e27 two steps later)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    for group in optimizer.param_groups:
        if group.get("fused") and group.get("momentum", 0) != 0:
            state = optimizer.state
            if any(p.grad is not None and state.get(p, {}).get("momentum_buffer") is None for p in group["params"]):
                return True
    return False


def _step_with_flags(optimizer, scale, found_inf, args, kwargs):
    """``optimizer.step(*args, **kwargs)`` with ``grad_scale``/``found_inf`` set for its duration.
    ``scale``: what the gradients carry (None: already unscaled); a ``grad_scale`` the user set on the
    optimizer is multiplied in, as torch does."""
    user_scale = getattr(optimizer, "grad_scale", None)
    optimizer.grad_scale = user_scale if scale is None else scale if user_scale is None else scale * user_scale
    optimizer.found_inf = found_inf
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        del optimizer.grad_scale
        del optimizer.found_inf
