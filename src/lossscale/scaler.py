"""``lossscale.GradScaler``: a drop-in for ``torch.amp.GradScaler`` around a pure scale policy.

Configured like torch (``hysteresis=1, min_scale=None, max_scale=None``) it is bitwise torch: the same
float32 scale, the same fused check+unscale kernel with an inverse scale computed in float64, the same
update kernel, the same skip decisions. Beyond torch it adds hysteresis and bounds, inf told from NaN,
skip-awareness, a diagnosis when training is stuck, complete versioned checkpoints, a read-only check
for fused optimizers, and a process-group reduction of the skip decision.

Host-device syncs, per iteration (torch pays the same or more):

* optimizers without amp-scaling support (SGD, Adam(foreach)): one sync, to decide whether to call
  ``optimizer.step()``. It happens in :meth:`unscale_` (or :meth:`step` when ``unscale_`` was not
  called) so that an overflow is classified and localised before user code (clipping) touches the
  gradients. On an overflow, reading the state for the stuck check costs one more.
* optimizers with ``_step_supports_amp_scaling`` (``Adam(fused=True)``): none. The optimizer gets
  ``grad_scale``/``found_inf`` tensors and skips on device.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import math
import warnings
import weakref
from collections import abc
from typing import Any, Dict, Iterable, List, Optional, Union

import torch

from . import _kernels
from . import distributed as _distributed
from ._device_rules import STREAK, DeviceState, count_, device_update_
from .policy import DynamicPolicy, ScaleState, StaticPolicy, diagnose

__all__ = ["GradScaler", "OptState", "STATE_DICT_VERSION"]

STATE_DICT_VERSION = 1
_TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_DEFAULT_GROUP = _distributed.DEFAULT_GROUP


class OptState(enum.Enum):
    """Per-optimizer stage within one iteration, as in torch."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


class _OptimizerRecord:
    """What one iteration learned about one optimizer's gradients."""

    __slots__ = ("stage", "found_inf", "found_nan", "host_found", "amax_vectors", "params", "amax")

    def __init__(self):
        self.stage = OptState.READY
        self.found_inf: Dict[torch.device, torch.Tensor] = {}
        self.found_nan: Optional[torch.Tensor] = None  # on the scale's device
        self.host_found: Optional[bool] = None  # known on the host only where a sync already happened
        self.amax_vectors: List[torch.Tensor] = []  # per-parameter max|g|, only on the overflow path
        self.params: List[torch.Tensor] = []
        self.amax: Optional[torch.Tensor] = None  # max|g| of the scaled gradients, for needs_amax policies


def _policy_from_kwargs(policy, init_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
                        consecutive_hysteresis, min_scale, max_scale, on_stuck, max_consecutive_skips):
    if isinstance(policy, str):
        if policy == "dynamic":
            return DynamicPolicy(
                init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                growth_interval=growth_interval, hysteresis=hysteresis,
                consecutive_hysteresis=consecutive_hysteresis, min_scale=min_scale, max_scale=max_scale,
                on_stuck=on_stuck, max_consecutive_skips=max_consecutive_skips,
            )
        if policy == "static":
            return StaticPolicy(scale=init_scale, on_stuck=on_stuck, max_consecutive_skips=max_consecutive_skips)
        from . import _policy_registry

        factory = _policy_registry.get(policy)
        if factory is None:
            raise ValueError(
                f"policy={policy!r} is not known; use 'dynamic', 'static', "
                + "".join(f"{n!r}, " for n in _policy_registry.names())
                + "or a policy object such as lossscale.DynamicPolicy(...)."
            )
        return factory(
            init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
            growth_interval=growth_interval, hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis, min_scale=min_scale, max_scale=max_scale,
            on_stuck=on_stuck, max_consecutive_skips=max_consecutive_skips,
        )
    if not hasattr(policy, "update") or not hasattr(policy, "init_state"):
        raise ValueError(f"policy={policy!r} is neither a name nor a policy object with init_state()/update().")
    given = dict(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                 growth_interval=growth_interval, hysteresis=hysteresis,
                 consecutive_hysteresis=consecutive_hysteresis, min_scale=min_scale, max_scale=max_scale,
                 on_stuck=on_stuck, max_consecutive_skips=max_consecutive_skips)
    clashing = [k for k, v in given.items() if v != _KWARG_DEFAULTS[k]]
    if clashing:
        raise ValueError(
            f"policy is a policy object, so {', '.join(clashing)} must be set on the object, not passed "
            "to GradScaler as well."
        )
    return policy


_GRAD_SCALER_KWARG: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _takes_grad_scaler(step) -> bool:
    """Whether ``step`` takes ``grad_scaler=`` (torch's deprecated contract), cached per function:
    ``inspect.signature`` costs ~100 us, more than the rest of a small fused step."""
    func = getattr(step, "__func__", step)
    try:
        return _GRAD_SCALER_KWARG[func]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable
        return "grad_scaler" in inspect.signature(step).parameters
    found = _GRAD_SCALER_KWARG[func] = "grad_scaler" in inspect.signature(step).parameters
    return found


_KWARG_DEFAULTS = dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                       hysteresis=1, consecutive_hysteresis=False, min_scale=1.0, max_scale=2.0**24,
                       on_stuck="warn", max_consecutive_skips=None)


class GradScaler:
    """Loss scaling for FP16 training: torch's ``GradScaler`` contract, exact arithmetic, and more.

    Args:
        device: "cpu", "cuda", a ``torch.device``, or None (default) to take the device of the first
            tensor passed to :meth:`scale`. Unlike torch there is no "cuda" default.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as in torch.
        hysteresis: overflows tolerated before the scale backs off (1 = torch).
        consecutive_hysteresis: only consecutive overflows spend the hysteresis (DeepSpeed).
        min_scale: lower bound (default 1.0; None = unbounded, as torch).
        max_scale: upper bound (default 2**24; None = unbounded, as torch). At the cap a growth clamps
            to ``max_scale``. See :class:`lossscale.DynamicPolicy` for why these defaults.
        policy: "dynamic" (default), "static" (a fixed ``init_scale``), "adaptive" (:class:`lossscale.AdaptivePolicy`), or
            a policy object (then the scale keywords above must stay at their defaults).
        on_stuck: "warn" (default, once per streak), "raise" (RuntimeError with a diagnosis) or
            "ignore", when an overflow happens at ``min_scale`` or ``max_consecutive_skips`` steps in a
            row are skipped.
        max_consecutive_skips: the streak that counts as stuck; None reacts only at ``min_scale``.
        model: an ``nn.Module`` or an iterable of ``(name, parameter)`` pairs, to name parameters in
            :meth:`overflow_report` and in error messages.
        process_group: the group over which the skip decision (and an adaptive policy's amax, in the
            same collective) is all-reduced (MAX), so every rank skips or steps together. "default" (the default): the default group when
            torch.distributed is initialised with more than one rank. None: no reduction.
        telemetry: None (off, the default), an int N (gradient statistics of the scaled gradients
            every N iterations), a dict of :class:`lossscale.Telemetry` arguments (``every``, ``per``,
            ``fmt``) or a ``Telemetry``. Collecting adds no host sync; :meth:`metrics` reads them.

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
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        min_scale: Optional[float] = 1.0,
        max_scale: Optional[float] = 2.0**24,
        policy: Any = "dynamic",
        on_stuck: str = "warn",
        max_consecutive_skips: Optional[int] = None,
        model: Any = None,
        process_group: Any = _DEFAULT_GROUP,
        telemetry: Any = None,
    ) -> None:
        if device is not None and not isinstance(device, (str, torch.device)):
            raise ValueError(f"device={device!r} must be None, a string such as 'cpu'/'cuda', or a torch.device.")
        self._device_type = None if device is None else torch.device(device).type
        self._enabled = bool(enabled)
        if self._enabled and self._device_type == "cuda" and not torch.cuda.is_available():
            warnings.warn("lossscale.GradScaler: device='cuda' but CUDA is not available; disabling scaling.",
                          stacklevel=2)
            self._enabled = False
        self._policy = _policy_from_kwargs(policy, init_scale, growth_factor, backoff_factor, growth_interval,
                                           hysteresis, consecutive_hysteresis, min_scale, max_scale, on_stuck,
                                           max_consecutive_skips)
        self._pending: ScaleState = self._policy.init_state()  # the state until the device is known
        self._state: Optional[DeviceState] = None
        self._records: Dict[int, _OptimizerRecord] = {}
        self._names: Dict[int, str] = {}
        if model is not None:
            self.name_parameters(model)
        self._process_group = _distributed._validate_group(process_group)
        self._last_skipped: Union[bool, torch.Tensor, None] = None
        self._last_report: Optional[Dict[str, List[str]]] = None
        self._report_source = None
        self._warned_streak = False
        self._host_obs: Optional[torch.Tensor] = None
        self._obs_event = None
        self._obs_ready = False
        self._telemetry = self._make_telemetry(telemetry)

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def passthrough(cls, device=None, **kwargs) -> "GradScaler":
        """A scaler for bf16 or fp32 training: scale fixed at 1, no unscale pass, non-finite steps skipped.

        bf16 and fp32 have fp32's exponent range, so nothing underflows that scaling would save; what
        is still worth having is a step that is skipped (and counted, and diagnosed) rather than
        written into the weights when a gradient is inf or NaN.
        """
        return cls(device, policy=StaticPolicy(scale=1.0, on_stuck=kwargs.pop("on_stuck", "warn"),
                                               max_consecutive_skips=kwargs.pop("max_consecutive_skips", None)),
                   **kwargs)

    def name_parameters(self, model_or_named_parameters) -> None:
        """Learn parameter names (from an ``nn.Module`` or ``(name, param)`` pairs) for reports."""
        named = (model_or_named_parameters.named_parameters()
                 if isinstance(model_or_named_parameters, torch.nn.Module) else model_or_named_parameters)
        try:
            pairs = [(str(n), p) for n, p in named]
        except (TypeError, ValueError):
            raise ValueError("model must be an nn.Module or an iterable of (name, parameter) pairs.") from None
        self._names.update({id(p): n for n, p in pairs})

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

    def metrics(self) -> Dict[str, Any]:
        """A flat dict for TensorBoard's ``add_scalar`` or any logger. Syncs host and device (once).

        Always: ``loss_scale``, ``steps``, ``skipped_steps``, ``inf_steps``, ``nan_steps``,
        ``overflow_streak``, ``last_step_skipped``. With telemetry on, the figures of the last sampled
        iteration: ``grad/flushed_frac``, ``grad/subnormal_frac``, ``grad/headroom_bits``, ``grad/amax``,
        ... (and ``grad/<name>/...`` per parameter or module), labelled by ``grad/measured``.
        """
        out: Dict[str, Any] = {"loss_scale": self.get_scale()}
        if self._enabled:
            out.update(self.counters())
        out["last_step_skipped"] = bool(self._last_skipped is not None and self.last_step_skipped)
        if self._telemetry is not None:
            figures = self._telemetry.metrics()
            if figures:
                figures["grad/measured"] = self._telemetry.measured
            out.update(figures)
        return out

    @property
    def policy(self):
        """The scale policy (a frozen config object)."""
        return self._policy

    # ------------------------------------------------------------------ state
    def _ensure_state(self, device: torch.device) -> DeviceState:
        if self._state is None:
            if self._device_type is not None and device.type != self._device_type:
                raise ValueError(
                    f"GradScaler(device={self._device_type!r}) was given a tensor on {device}; pass "
                    f"device={device.type!r} or device=None to infer it."
                )
            self._state = DeviceState(self._pending, device)
        return self._state

    def _require_state(self, call: str) -> DeviceState:
        if self._state is None:
            raise RuntimeError(
                f"{call} was called before scale(): call scaler.scale(loss).backward() first in the iteration."
            )
        return self._state

    def _scale_state(self) -> ScaleState:
        """The pure state. Syncs host and device once the state lives on a device."""
        return self._pending if self._state is None else self._state.to_state()

    # ------------------------------------------------------------------ torch's API
    def scale(self, outputs):
        """Multiply a tensor, or nested lists/tuples/dicts of tensors, by the scale factor.

        Returns the outputs unchanged when disabled. The first call fixes the scaler's device (from
        the first tensor). No host sync.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            st = self._ensure_state(outputs.device)
            return outputs * st.scale.to(device=outputs.device, non_blocking=True)
        per_device: Dict[torch.device, torch.Tensor] = {}

        def apply(value):
            if isinstance(value, torch.Tensor):
                st = self._ensure_state(value.device)
                scale = per_device.get(value.device)
                if scale is None:
                    scale = per_device[value.device] = st.scale.to(device=value.device, non_blocking=True)
                return value * scale
            if isinstance(value, dict):
                return type(value)((k, apply(v)) for k, v in value.items())
            if isinstance(value, (list, tuple)):
                mapped = [apply(v) for v in value]
                return type(value)(*mapped) if hasattr(value, "_fields") else type(value)(mapped)
            if isinstance(value, abc.Iterable) and not isinstance(value, (str, bytes)):
                return map(apply, value)
            raise ValueError(
                f"scale() takes a tensor or (nested) lists, tuples or dicts of tensors, got {type(value).__name__}."
            )

        return apply(outputs)

    def _record(self, optimizer) -> _OptimizerRecord:
        rec = self._records.get(id(optimizer))
        if rec is None:
            rec = self._records[id(optimizer)] = _OptimizerRecord()
        return rec

    def _gather(self, optimizer, allow_half: bool) -> List[torch.Tensor]:
        """The gradients to check, with torch's FP16-gradient error made actionable."""
        grads, params, half = [], [], []
        fp16 = torch.float16
        dense = torch.Tensor
        has_sparse = False
        for gi, group in enumerate(optimizer.param_groups):
            for pi, param in enumerate(group["params"]):
                if not isinstance(param, torch.Tensor):
                    raise ValueError(f"optimizer.param_groups[{gi}]['params'][{pi}] is not a tensor.")
                grad = param.grad  # read once: a property, and this loop runs per parameter per step
                if grad is None:
                    continue
                if not allow_half and grad.dtype == fp16:
                    half.append(self._names.get(id(param), f"param_groups[{gi}][{pi}] {tuple(param.shape)}"))
                    continue
                if type(grad) is not dense or grad.is_sparse:  # plain dense gradients are checked as they are
                    has_sparse = has_sparse or grad.is_sparse
                    grad = _kernels.grad_to_check(param)
                if grad.numel() == 0:
                    # Nothing to check, and the inf-norm of an empty tensor raises. FSDP2 gives a rank
                    # an empty local shard when a parameter's dim 0 is smaller than the world size.
                    continue
                grads.append(grad)
                params.append(param)
        if half:
            raise ValueError(
                f"{len(half)} parameter(s) have FP16 gradients ({', '.join(half[:5])}"
                f"{', ...' if len(half) > 5 else ''}): unscaling them in FP16 would flush the small ones, "
                "the very values loss scaling protects. Keep the parameters in FP32 and run the forward "
                "under torch.autocast(device_type, dtype=torch.float16) (FP32 master weights), or use an "
                "optimizer that unscales itself (e.g. torch.optim.Adam(fused=True))."
            )
        self._record(optimizer).params = params
        self._gathered_sparse = has_sparse  # read by clip_grad_norm_ (sparse norms need coalesced values)
        return grads

    def _reduce_flags(self, found_inf: torch.Tensor, found_nan: torch.Tensor, amax: Optional[torch.Tensor] = None):
        """All-reduce (MAX) the two flags, and ``amax`` when given, over the process group in ONE
        collective, so every rank decides alike. Returns ``(found_inf, found_nan)``, or
        ``(found_inf, found_nan, amax)`` when ``amax`` is given.

        A collective: every rank of the group must make the same sequence of calls, so whether it
        is called, and whether with ``amax``, may depend only on values that are already reduced or
        the same on every rank (the policy's ``needs_amax``), never on local gradients.

        ``amax`` (a needs_amax policy's max |g|) is sent as 0 where it is inf or NaN: a MAX over a
        NaN is not reliably NaN on gloo or NCCL (gloo keeps or drops it by rank order), and it need
        not be. A non-finite amax has set this rank's flags, which reduce exactly, and a needs_amax
        policy ignores the amax of an overflow step.
        Without a group nothing is reduced and ``amax`` is returned as it is (bitwise one process).
        """
        group = _distributed._resolve(self._process_group)
        if group is None:
            return (found_inf, found_nan) if amax is None else (found_inf, found_nan, amax)
        if amax is None:
            flags = torch.stack([found_inf, found_nan])
        else:
            flags = torch.stack([found_inf, found_nan, amax.nan_to_num(0.0, 0.0, 0.0)])
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=group)
        return tuple(flags.unbind(0))

    def _check(self, optimizer, unscale: bool, sync: bool) -> None:
        """Check (and optionally unscale) one optimizer's gradients and record the flags.

        ``sync``: decide on the host now (one sync) and, on overflow only, classify inf vs NaN and
        localise it. Without ``sync`` the flags stay on device (read-only amax pass).
        """
        st = self._state
        rec = self._record(optimizer)
        passthrough = isinstance(self._policy, StaticPolicy) and self._policy.scale == 1.0
        grads = self._gather(optimizer, allow_half=not unscale or passthrough)
        groups = _kernels.group_grads(grads)
        needs_amax = getattr(self._policy, "needs_amax", False)  # e.g. AdaptivePolicy
        nan_pending = False  # found_nan is not known yet (the sync unscale path learns it on overflow only)
        if self._telemetry is not None:
            self._telemetry.observe(self, optimizer, rec.params, grads)
        if len(groups) > 1 or any(len(per_dtype) > 1 for per_dtype in groups.values()):
            # The amax vectors come per (device, dtype) group: line the parameters up with them, or
            # overflow_report() names the wrong ones when dtypes interleave.
            owner = {id(g): p for g, p in zip(grads, rec.params)}
            rec.params = [owner[id(g)] for per_dtype in groups.values() for gs in per_dtype.values() for g in gs]
        if unscale and not passthrough:
            # Inverse in float64, like torch: a float32 reciprocal could be off by one ulp for a
            # non-power-of-two scale on some compilers.
            inv_scale = st.scale.double().reciprocal().float()
            if sync and not needs_amax:
                found = torch.zeros((), dtype=torch.float32, device=st.device)
                per_device = _kernels.check_and_unscale_(groups, inv_scale, found)
                found_inf = self._combine(per_device.values(), st.device)
                found_nan = found_inf  # a placeholder: 0 when clean, learned below on an overflow
                nan_pending = True
            else:
                # No sync allowed, or the policy needs the amax: learn inf vs NaN (and the amax) from a
                # read-only amax pass, then torch's kernel.
                vectors, amax = _kernels.amax_per_tensor(groups, st.device)
                found_inf, found_nan = _kernels.flags_from_amax(amax)
                _kernels.check_and_unscale_(groups, inv_scale, torch.zeros_like(found_inf))
                rec.amax_vectors = vectors
        else:
            vectors, amax = _kernels.amax_per_tensor(groups, st.device)
            found_inf, found_nan = _kernels.flags_from_amax(amax)
            rec.amax_vectors = vectors
        if needs_amax:
            # Every rank must feed the policy the same amax, or their scales drift apart: the global
            # max rides in the flags' collective (one all-reduce per check, not two).
            found_inf, found_nan, rec.amax = self._reduce_flags(found_inf, found_nan, amax)
        else:
            found_inf, found_nan = self._reduce_flags(found_inf, found_nan)
        rec.found_inf = {st.device: found_inf}
        rec.found_nan = found_nan
        if sync:
            rec.host_found = bool(found_inf.item())  # THE sync of this optimizer's iteration
            # Decided on reduced values only: a local condition (say, "this rank has amax vectors")
            # would make ranks disagree on whether the second collective below happens.
            if rec.host_found and nan_pending:
                # Overflow path only: one read pass to tell inf from NaN and name the parameters.
                vectors, amax = _kernels.amax_per_tensor(groups, st.device)
                rec.amax_vectors = vectors
                local_nan = torch.isnan(amax).float()
                _, rec.found_nan = self._reduce_flags(found_inf, local_nan)

    @staticmethod
    def _combine(flags, device) -> torch.Tensor:
        flags = [f.to(device, non_blocking=True) for f in flags]
        if not flags:
            return torch.zeros((), dtype=torch.float32, device=device)
        total = flags[0]
        for f in flags[1:]:
            total = total + f
        return total

    def unscale_(self, optimizer) -> None:
        """Divide the optimizer's gradients by the scale (in place) and check them for inf/NaN.

        Optional, as in torch: call it before anything that reads gradient magnitudes (clipping,
        norm logging). At most once per optimizer per iteration, before :meth:`step`.

        Syncs host and device once for optimizers without amp-scaling support (the sync torch pays in
        ``step()``; here it moves earlier so an overflow is classified before clipping can turn inf
        into NaN); none for fused optimizers.
        """
        if not self._enabled:
            return
        self._require_state("unscale_()")
        rec = self._record(optimizer)
        if rec.stage is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if rec.stage is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step(); call it before step() in the iteration.")
        self._check(optimizer, unscale=True, sync=not getattr(optimizer, "_step_supports_amp_scaling", False))
        rec.stage = OptState.UNSCALED

    def clip_grad_norm_(self, optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Unscale and clip the optimizer's gradients by their true total norm; return that norm.

        Replaces ``unscale_(optimizer)`` + ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` with
        two passes over the gradients instead of five: the norm of the scaled gradients (which is
        also the inf/NaN check), then one multiply by ``clip_coef / scale``. With a power-of-two scale
        the gradients and the returned norm are bitwise torch's two-step result, as long as no value
        leaves float32's normal range (details in ``lossscale._clip``). A non-finite norm is an
        overflow: the step is skipped, the gradients are only unscaled (an inf stays inf, not NaN).

        Once per optimizer per iteration, instead of :meth:`unscale_` and before :meth:`step`. The
        norm is over this optimizer's parameters (torch's recipe takes whatever it is given), and
        over this rank's gradients (DDP's replicated ones: the total; FSDP shards: not the total).
        Syncs like :meth:`unscale_`: once for optimizers without amp-scaling support, never for
        fused ones (the norm stays a device tensor).
        """
        from ._clip import clip_grad_norm_

        return clip_grad_norm_(self, optimizer, max_norm, norm_type)

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
        st = self._require_state("step()")
        rec = self._record(optimizer)
        if rec.stage is OptState.STEPPED:
            raise RuntimeError("step() has already been called on this optimizer since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            if _takes_grad_scaler(optimizer.step):
                warnings.warn("lossscale.GradScaler passes itself as grad_scaler=, a contract torch is "
                              "deprecating; prefer optimizers that read grad_scale/found_inf.",
                              FutureWarning, stacklevel=2)
                retval = optimizer.step(*args, grad_scaler=self, **kwargs)
                rec.stage = OptState.STEPPED
                return retval
            if rec.stage is OptState.READY:
                self._check(optimizer, unscale=False, sync=False)
            found_inf = self._combine(rec.found_inf.values(), st.device)
            # Multiply by a grad_scale the user set on the optimizer, as torch does.
            user_scale = getattr(optimizer, "grad_scale", None)
            optimizer.grad_scale = (user_scale if rec.stage is OptState.UNSCALED
                                    else st.scale if user_scale is None else st.scale * user_scale)
            optimizer.found_inf = found_inf
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale
                del optimizer.found_inf
            rec.stage = OptState.STEPPED
            return retval
        if rec.stage is OptState.READY:
            self._check(optimizer, unscale=True, sync=True)
        retval = None
        if not rec.host_found:
            retval = optimizer.step(*args, **kwargs)
        rec.stage = OptState.STEPPED
        return retval

    def update(self, new_scale: Union[float, torch.Tensor, None] = None) -> None:
        """Advance the policy by one iteration (or set ``new_scale``), at the end of the iteration.

        Call after :meth:`step` for every optimizer of the iteration. A float ``new_scale`` must lie
        within the bounds; a tensor one is copied and clamped to them (checking it would sync). The
        step counters still count the iteration. No host sync, except on an overflow found on the
        host (one, to check whether training is stuck).
        """
        if not self._enabled:
            return
        st = self._require_state("update()")
        if new_scale is not None:
            self._validate_new_scale(new_scale)
        if not self._records or not any(r.found_inf for r in self._records.values()):
            if new_scale is None:
                raise RuntimeError(
                    "update() found no inf checks since the last update(): call scaler.step(optimizer) "
                    "(or unscale_) for each optimizer before update()."
                )
        records = list(self._records.values())
        found_inf = self._combine([f for r in records for f in r.found_inf.values()], st.device)
        host_known = all(r.host_found is not None for r in records) if records else True
        known_clean = host_known and not any(r.host_found for r in records)
        if not known_clean and st.device.type == "cpu":
            # A CPU "device" is host memory: read the device-decided flag in place (no copy, no
            # kernel, no sync) and take the same shortcut as a host-decided clean step.
            known_clean = not found_inf.numpy().item()
        # A clean step known on the host has found_nan = 0 = found_inf (a zero tensor already at hand).
        found_nan = found_inf if known_clean else self._combine(
            [r.found_nan for r in records if r.found_nan is not None], st.device)
        # The scale before this update, for the stuck check of an iteration that may have overflowed:
        # read in place on CPU (host memory, no kernel), a device copy elsewhere.
        scale_before = (None if known_clean
                        else float(st.scale.numpy()) if st.device.type == "cpu" else st.scale.clone())
        if new_scale is not None:
            if records:  # the iteration still happened: count it; torch leaves the trackers alone
                count_(st, found_inf, found_nan)
            if isinstance(new_scale, torch.Tensor):
                st.scale.copy_(new_scale.detach().reshape(()).to(st.scale))
                lo, hi = getattr(self._policy, "min_scale", None), getattr(self._policy, "max_scale", None)
                if lo is not None or hi is not None:
                    st.scale.clamp_(lo, hi)
            else:
                st.scale.fill_(new_scale)
        elif getattr(self._policy, "needs_amax", False):
            amaxes = [r.amax for r in records if r.amax is not None]
            amax = None if not amaxes else amaxes[0] if len(amaxes) == 1 else torch.stack(amaxes).max()
            device_update_(self._policy, st, found_inf, found_nan, amax=amax)
        else:
            # A clean step the host already decided (it synced) takes the rule's shortcut, if it has one.
            device_update_(self._policy, st, found_inf, found_nan, known_clean=known_clean)
        any_host_overflow = any(r.host_found for r in records)
        # Device-decided: found_inf itself (> 0 means skipped), read only if asked.
        self._last_skipped = any_host_overflow if host_known else found_inf
        if any_host_overflow or not host_known:
            self._remember_overflow(records)
        self._records = {}
        if self._telemetry is not None:
            self._telemetry.iteration += 1
        self._observe(st, scale_before, now=any_host_overflow, skip=host_known and not any_host_overflow)

    def _validate_new_scale(self, new_scale) -> None:
        if isinstance(new_scale, torch.Tensor):
            if new_scale.numel() != 1 or new_scale.requires_grad:
                raise ValueError("new_scale must be a float or a 1-element tensor with requires_grad=False.")
            if self._state is not None and new_scale.device.type != self._state.device.type:
                raise ValueError(f"new_scale is on {new_scale.device} but the scaler's state is on {self._state.device}.")
            return
        if isinstance(new_scale, bool) or not isinstance(new_scale, (int, float)):
            raise ValueError(f"new_scale={new_scale!r} must be a float or a 1-element tensor.")
        if not math.isfinite(new_scale) or new_scale <= 0:
            raise ValueError(f"new_scale={new_scale!r} must be finite and > 0.")
        lo, hi = getattr(self._policy, "min_scale", None), getattr(self._policy, "max_scale", None)
        if (lo is not None and new_scale < lo) or (hi is not None and new_scale > hi):
            raise ValueError(f"new_scale={new_scale!r} is outside [min_scale={lo}, max_scale={hi}].")

    # ------------------------------------------------------------------ observation (stuck check)
    def _observe(self, st: DeviceState, scale_before, now: bool, skip: bool) -> None:
        """Look at the state after an update, without a sync where possible, and react if stuck.

        ``skip``: the host knows this iteration was clean (nothing can be stuck). ``now``: the host
        knows it overflowed, read the state now (one sync on the overflow path). Otherwise copy a
        snapshot to a host buffer without blocking and look at it once it has arrived (at once on
        CPU; on CUDA at a later update, when its event has completed).
        """
        if skip:
            self._warned_streak = False
            return
        if st.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return  # inside a CUDA graph: no host reads, no events (replays update the state on device)
        if st.device.type == "cpu":
            # The state is host memory: read it in place, no copy, no kernel unless a streak is on.
            if not now and st.counters.numpy()[STREAK] == 0:
                self._warned_streak = False
                return
            self._react([scale_before] + st.snapshot().numpy().tolist())
            return
        if self._host_obs is not None and self._obs_ready and (self._obs_event is None or self._obs_event.query()):
            self._react(self._host_obs.tolist())
            self._obs_ready = False
        snap = torch.cat([scale_before.double().reshape(1), st.snapshot()])
        if now:
            self._react(snap.tolist())
            return
        if self._host_obs is None:
            self._host_obs = torch.empty(snap.shape, dtype=torch.float64, pin_memory=torch.cuda.is_available())
        self._host_obs.copy_(snap, non_blocking=True)
        self._obs_event = torch.cuda.Event() if st.device.type == "cuda" else None
        if self._obs_event is not None:
            self._obs_event.record()
        self._obs_ready = True

    def _react(self, values: List[float]) -> None:
        scale_before, state = values[0], DeviceState.from_snapshot(values[1:])
        if state.overflow_streak == 0:
            self._warned_streak = False
            return
        if not self._policy.is_stuck(state, scale_before) or self._policy.on_stuck == "ignore":
            return
        message = diagnose(self._policy, state)
        if self._policy.on_stuck == "raise":
            raise RuntimeError(message)
        if not self._warned_streak:
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            self._warned_streak = True

    # ------------------------------------------------------------------ overflow report
    def _remember_overflow(self, records) -> None:
        self._report_source = [(r.params, r.amax_vectors) for r in records if r.amax_vectors]
        self._last_report = None

    def overflow_report(self) -> Dict[str, List[str]]:
        """Which parameters held inf and which held NaN on the last skipped step.

        Returns ``{"inf": [...], "nan": [...]}`` of parameter names (as given by ``model=`` or
        :meth:`name_parameters`, else ``param_groups[g][i] shape``). Empty lists when the last step
        was not skipped. Reading it syncs host and device when the overflow was found on device.
        """
        if not self.last_step_skipped or not self._report_source:
            return {"inf": [], "nan": []}
        if self._last_report is None:
            inf, nan = [], []
            for params, vectors in self._report_source:
                values = torch.cat([v.cpu() for v in vectors]).tolist() if vectors else []
                for p, v in zip(params, values):
                    name = self._names.get(id(p), f"param {tuple(p.shape)}")
                    if math.isnan(v):
                        nan.append(name)
                    elif math.isinf(v):
                        inf.append(name)
            self._last_report = {"inf": inf, "nan": nan}
        return self._last_report

    # ------------------------------------------------------------------ skip-awareness
    @property
    def last_step_skipped(self) -> bool:
        """Whether the last iteration's optimizer step(s) were skipped (read after :meth:`update`).

        Free when the host already decided the step (optimizers without amp-scaling support); syncs
        host and device for fused optimizers, whose skip happened on device.
        """
        value = self._last_skipped
        if isinstance(value, torch.Tensor):
            value = self._last_skipped = bool(value.item())
        return bool(value)

    @property
    def skipped_steps(self) -> int:
        """Skipped iterations so far. Syncs host and device."""
        return self._scale_state().skipped_steps if self._enabled else 0

    def step_scheduler(self, scheduler, *args, **kwargs) -> bool:
        """``scheduler.step()`` unless the last step was skipped; returns whether it stepped.

        A skipped step did not train, so an LR schedule that advanced anyway would drift ahead of
        the weights (torch warns "Detected call of lr_scheduler.step() before optimizer.step()").
        May sync: see :attr:`last_step_skipped`.
        """
        if self._enabled and self._last_skipped is not None and self.last_step_skipped:
            return False
        scheduler.step(*args, **kwargs)
        return True

    def counters(self) -> Dict[str, int]:
        """Every counter as plain ints: steps, skipped, inf and NaN steps, current streak. Syncs."""
        s = self._scale_state()
        return {"steps": s.steps, "skipped_steps": s.skipped_steps, "inf_steps": s.inf_steps,
                "nan_steps": s.nan_steps, "overflow_streak": s.overflow_streak}

    # ------------------------------------------------------------------ getters / setters
    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Syncs host and device."""
        if not self._enabled:
            return 1.0
        return self._pending.scale if self._state is None else float(self._state.scale.item())

    def _get_scale_async(self) -> Optional[torch.Tensor]:
        """The scale tensor without a sync (None before the first :meth:`scale`), as in torch."""
        return None if self._state is None else self._state.scale

    def _replace_policy(self, **changes) -> None:
        if not isinstance(self._policy, DynamicPolicy):
            raise RuntimeError(f"{', '.join(changes)} apply to the dynamic policy, not {type(self._policy).__name__}.")
        self._policy = dataclasses.replace(self._policy, **changes)  # validates the new value

    def get_growth_factor(self) -> float:
        """The growth factor."""
        return getattr(self._policy, "growth_factor", 1.0)

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (validated: > 1)."""
        self._replace_policy(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The backoff factor."""
        return getattr(self._policy, "backoff_factor", 1.0)

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (validated: in (0, 1))."""
        self._replace_policy(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """The growth interval."""
        return getattr(self._policy, "growth_interval", 0)

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (validated: int >= 1).

        Lowering it below the current clean streak makes the next clean step grow the scale (torch
        would then never grow again until an overflow reset its tracker).
        """
        self._replace_policy(growth_interval=new_interval)
        if self._state is not None:
            self._state.growth_tracker.clamp_(max=new_interval - 1)
        else:
            self._pending = self._pending.replace(growth_tracker=min(self._pending.growth_tracker, new_interval - 1))

    def _get_growth_tracker(self) -> int:
        """torch's private getter (used by some trainers). Syncs."""
        return self._scale_state().growth_tracker if self._enabled else 0

    def is_enabled(self) -> bool:
        """Whether scaling is enabled."""
        return self._enabled

    def _found_inf_per_device(self, optimizer) -> Dict[torch.device, torch.Tensor]:
        """torch's private accessor, used by some trainers: this iteration's found_inf per device."""
        return self._record(optimizer).found_inf

    def _check_inf_per_device(self, optimizer) -> Dict[torch.device, torch.Tensor]:
        """torch's private read-only check, used by some trainers."""
        self._require_state("_check_inf_per_device()")
        self._check(optimizer, unscale=False, sync=False)
        return self._record(optimizer).found_inf

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """The complete, versioned state: config, scale, every tracker and counter.

        It holds torch's five keys too, so ``torch.amp.GradScaler.load_state_dict`` accepts it.
        Empty when disabled (as torch). Syncs host and device. Call it after :meth:`update`.
        """
        if not self._enabled:
            return {}
        s = self._scale_state()
        policy = self._policy
        config = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
        return {
            "scale": s.scale,
            "growth_factor": self.get_growth_factor(),
            "backoff_factor": self.get_backoff_factor(),
            "growth_interval": self.get_growth_interval(),
            "_growth_tracker": s.growth_tracker,
            "lossscale_version": STATE_DICT_VERSION,
            "policy_type": type(policy).__name__,
            "policy": config,
            "state": dataclasses.asdict(s),
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict`, or from ``torch.amp.GradScaler.state_dict()``.

        A torch state continues exactly as torch would: its scale, growth tracker and factors, with
        this scaler's hysteresis refilled and counters at zero. Works before the first :meth:`scale`.
        Validates everything before changing anything.
        """
        if not self._enabled:
            return
        if not isinstance(state_dict, dict):
            raise ValueError(f"load_state_dict takes a dict, got {type(state_dict).__name__}.")
        if len(state_dict) == 0:
            raise RuntimeError("The state dict is empty, possibly because it was saved from a disabled scaler.")
        if "lossscale_version" in state_dict:
            version = state_dict["lossscale_version"]
            if version != STATE_DICT_VERSION:
                raise ValueError(f"state dict version {version!r} is not supported (this lossscale reads {STATE_DICT_VERSION}).")
            missing = [k for k in ("policy_type", "policy", "state") if k not in state_dict]
            if missing:
                raise ValueError(f"state dict is missing {missing}.")
            policy = self._policy_from_state(state_dict["policy_type"], state_dict["policy"])
            try:
                state = ScaleState(**state_dict["state"])
            except TypeError as e:
                raise ValueError(f"state dict 'state' entry is malformed: {e}") from None
        else:
            missing = [k for k in _TORCH_KEYS if k not in state_dict]
            if missing:
                raise ValueError(f"state dict is missing {missing} (expected a lossscale or torch GradScaler state).")
            if not isinstance(self._policy, DynamicPolicy):
                raise ValueError("a torch GradScaler state dict needs a dynamic policy; this scaler's is "
                                 f"{type(self._policy).__name__}.")
            policy = dataclasses.replace(self._policy, init_scale=float(state_dict["scale"]),
                                         growth_factor=float(state_dict["growth_factor"]),
                                         backoff_factor=float(state_dict["backoff_factor"]),
                                         growth_interval=int(state_dict["growth_interval"]))
            state = policy.init_state().replace(growth_tracker=int(state_dict["_growth_tracker"]))
        self._policy, self._pending = policy, state
        if self._state is not None:
            self._state = DeviceState(state, self._state.device)
        self._records = {}

    @staticmethod
    def _policy_from_state(type_name: str, config: Dict[str, Any]):
        from . import _policy_registry

        cls = {"DynamicPolicy": DynamicPolicy, "StaticPolicy": StaticPolicy, **_policy_registry.types()}.get(type_name)
        if cls is None:
            raise ValueError(f"state dict policy_type={type_name!r} is unknown.")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the power-of-two warning was given when it was created
            try:
                return cls(**config)
            except TypeError as e:
                raise ValueError(f"state dict policy config does not fit {type_name}: {e}") from None

    def __getstate__(self) -> Dict[str, Any]:
        if self._records:
            raise RuntimeError("A GradScaler can be pickled only between iterations (after update()).")
        state = self.__dict__.copy()
        state["_pending"] = self._scale_state()
        state["_state"] = None
        state["_host_obs"], state["_obs_event"], state["_obs_ready"] = None, None, False
        state["_last_skipped"] = None if isinstance(self._last_skipped, torch.Tensor) else self._last_skipped
        state["_report_source"] = None
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        where = "not started" if self._state is None else str(self._state.device)
        return f"lossscale.GradScaler(enabled={self._enabled}, policy={self._policy!r}, {where})"
