"""What every loss-scale policy shares: the protocol, the common state, the bookkeeping, the registry.

This module imports no torch, and neither does any policy module (``dynamic``, ``static``,
``adaptive``, ``logmax``) nor ``hysteresis``: a tensor rule imports torch inside the function, when the
scaler calls it. So the rules can be read, run and tested with plain Python values::

    state = policy.init_state()
    state = policy.update(state, found_inf=..., found_nan=..., amax=...)

A policy is one file holding, side by side (jmp's shape, plus the device form):

* its frozen config (a dataclass; validation in ``__post_init__``);
* its own immutable state type, a subclass of :class:`ScaleState`;
* ``update``: the readable pure rule, the specification, and a public API that needs no torch;
* ``tensor_update``: the same rule in plain torch ops on the state's device tensors, in place, with no
  host sync. It is what :class:`lossscale.GradScaler` runs, on every path. A hypothesis test drives both
  forms with the same random sequences and requires bitwise agreement.

The bookkeeping every policy shares (:func:`count`, and :func:`count_tensor` on device)::

    steps += 1
    if the streak has not begun (overflow_streak == 0): streak_start_scale = scale
    found_inf = found_inf or bad_loss             # a non-finite loss skips the step too
    if found_inf:                                 # "some gradient was inf or NaN" (torch's naming)
        skipped_steps += 1; overflow_streak += 1  # the optimizer step is skipped
        inf_steps += not found_nan; nan_steps += found_nan; streak_nan_steps += found_nan
        bad_loss_steps += bad_loss; streak_bad_loss_steps += bad_loss
    else:
        overflow_streak = streak_nan_steps = streak_bad_loss_steps = 0

**The cause is an input.** ``bad_loss`` says the loss (or, with tracing, a forward output) was
already non-finite before any scaling: the scale did not cause it and cannot cure it, so every policy
skips such a step *without* backing off and leaves its trackers as they were. A streak of them is
stuck after ``max_consecutive_skips`` steps, or :data:`BAD_LOSS_STREAK` when that is None.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Protocol, Tuple, runtime_checkable

from ._validate import SMALLEST_SCALE, plain_number
from .formats import FP16, f32, is_power_of_two

__all__ = [
    "ScaleState",
    "Policy",
    "PolicyBase",
    "register",
    "policy_class",
    "policy_names",
    "policy_types",
    "count",
    "count_tensor",
    "exact_pow2",
    "stuck_at_bound_or_streak",
    "field_kind",
    "host_type",
    "F32",
    "F64",
    "I64",
    "I32",
    "BOOL",
    "SIGNED",
    "f32",
    "is_power_of_two",
    "SMALLEST_SCALE",
    "MIN_SCALE",
    "BAD_LOSS_STREAK",
    "SETTLE",
]

#: The default ``min_scale`` (of :class:`~lossscale.DynamicPolicy` and :class:`~lossscale.AdaptivePolicy`):
#: FP16's smallest subnormal, 2**-24. A gradient of magnitude 1 times a smaller scale flushes to zero in an
#: FP16 backward, so a scale below it carries nothing; down to it, the backoff follows torch's wherever a
#: lower scale still fits the backward in FP16.
MIN_SCALE = FP16.smallest_subnormal
#: Consecutive non-finite losses that count as stuck when ``max_consecutive_skips`` is None.
BAD_LOSS_STREAK = 10
#: Consecutive steps without an overflow that end the scale's calibration (``settle_steps``), for the
#: health account (lossscale.health).
SETTLE = 50


def exact_pow2(k):
    """``2.0 ** k`` for an int64 tensor ``k`` with |k| <= 1022, as float64: built from its bit pattern, so
    exact (a tensor rule's scale moves by whole binades and must land where ``math.ldexp`` does)."""
    import torch  # here, not at the top: the policies import without torch

    return ((k + 1023) << 52).view(torch.float64)


# ------------------------------------------------------------------------------- field metadata
# How each field of a state dataclass is held on device, declared on the field itself
# (``field(default=0, metadata=I64)``): the device state, the host's read and the checkpoint's
# validation all take it from there, never from the annotation.

#: A float held in float32 on device (the scale: torch's dtype).
F32 = {"dtype": "f32"}
#: A float held in float64 (running averages whose precision matters).
F64 = {"dtype": "f64"}
#: An int held in int64 (a counter; exact through the host's float64 read up to 2**53).
I64 = {"dtype": "i64"}
#: An int held in int32: a tracker torch's own kernels take (``_amp_update_scale_``'s growth tracker).
I32 = {"dtype": "i32"}
#: A bool, held as an int64 0 or 1.
BOOL = {"dtype": "bool"}
#: An int held in int64 that may be negative (the checkpoint's validation allows it).
SIGNED = {"dtype": "i64", "signed": True}
#: The Python type each device kind reads back as on the host.
HOST_TYPES = {"f32": float, "f64": float, "i64": int, "i32": int, "bool": bool}
#: The ints a field of each device dtype holds exactly, as the host reads it (through float64: 2**53).
_INT_LIMIT = {"i64": 2**53, "i32": 2**31 - 1}


def field_kind(f: dataclasses.Field) -> str:
    """How a state field is held on device, as its metadata declares: "f32", "f64", "i64", "i32" or
    "bool". TypeError for a field that declares none."""
    kind = f.metadata.get("dtype")
    if kind not in HOST_TYPES:
        raise TypeError(
            f"state field {f.name} declares no device form: give it field(metadata=F32, F64, I64, I32, "
            "BOOL or SIGNED) from lossscale.policy."
        )
    return kind


def host_type(f: dataclasses.Field) -> type:
    """The Python type of a state field on the host (float, int or bool), from its declared kind."""
    return HOST_TYPES[field_kind(f)]


# ----------------------------------------------------------------------------------------- state
@dataclass(frozen=True)
class ScaleState:
    """The state every policy's state extends: the scale and the shared counters.

    Counters are Python ints: they never wrap (int64 on device).

    Attributes:
        scale: the current loss scale (a float32 value).
        steps: iterations seen by ``update`` (skipped ones included).
        skipped_steps: iterations whose optimizer step was skipped because of inf/NaN gradients.
        inf_steps: skipped iterations whose gradients held inf but no NaN.
        nan_steps: skipped iterations whose gradients held NaN (a NaN dominates an inf).
        bad_loss_steps: skipped iterations whose loss (or, with tracing, a forward output) was
            non-finite before scaling: skipped without backing off (also counted as inf or NaN).
        overflow_streak: consecutive skipped iterations up to now (0 after a clean step).
        streak_nan_steps: how many of the current streak held NaN.
        streak_bad_loss_steps: how many of the current streak had a non-finite loss.
        streak_start_scale: the scale the current streak began at (for the diagnosis); while no
            streak runs, the scale of the last step (where the next streak would begin).
    """

    scale: float = field(metadata=F32)
    steps: int = field(default=0, metadata=I64)
    skipped_steps: int = field(default=0, metadata=I64)
    inf_steps: int = field(default=0, metadata=I64)
    nan_steps: int = field(default=0, metadata=I64)
    bad_loss_steps: int = field(default=0, metadata=I64)
    overflow_streak: int = field(default=0, metadata=I64)
    streak_nan_steps: int = field(default=0, metadata=I64)
    streak_bad_loss_steps: int = field(default=0, metadata=I64)
    streak_start_scale: float = field(default=0.0, metadata=F32)

    def replace(self, **changes) -> "ScaleState":
        """A copy with ``changes`` applied (the state itself is frozen); ``dataclasses.replace``."""
        return dataclasses.replace(self, **changes)

    @property
    def last_step_skipped(self) -> bool:
        """Whether the iteration that produced this state was skipped."""
        return self.overflow_streak > 0

    @property
    def searching(self) -> bool:
        """Whether the policy is still searching for its first scale by a rule of its own (an adaptive
        policy before its first measurement): the health account's calibration lasts until then."""
        return False


#: The counters every state begins with, in order: ScaleState's int64 fields.
COUNTERS = tuple(f.name for f in dataclasses.fields(ScaleState) if field_kind(f) == "i64")
#: The streak counters' place in COUNTERS (they end at a clean step).
STREAKS = slice(COUNTERS.index("overflow_streak"), len(COUNTERS))


def count(state: ScaleState, found_inf: bool, found_nan: bool, bad_loss: bool = False) -> ScaleState:
    """The bookkeeping every policy shares: step, skip, inf/NaN, bad-loss and streak counters (pure form)."""
    if found_nan and not found_inf:
        raise ValueError(
            "found_nan=True with found_inf=False: found_inf means 'any inf or NaN', so a NaN step "
            "must pass found_inf=True as well."
        )
    bad_loss = bool(bad_loss)
    start = state.scale if state.overflow_streak == 0 else state.streak_start_scale
    if not (found_inf or bad_loss):
        return state.replace(
            steps=state.steps + 1,
            overflow_streak=0,
            streak_nan_steps=0,
            streak_bad_loss_steps=0,
            streak_start_scale=start,
        )
    return state.replace(
        steps=state.steps + 1,
        skipped_steps=state.skipped_steps + 1,
        inf_steps=state.inf_steps + (not found_nan),
        nan_steps=state.nan_steps + bool(found_nan),
        bad_loss_steps=state.bad_loss_steps + bad_loss,
        overflow_streak=state.overflow_streak + 1,
        streak_nan_steps=state.streak_nan_steps + bool(found_nan),
        streak_bad_loss_steps=state.streak_bad_loss_steps + bad_loss,
        streak_start_scale=start,
    )


def count_tensor(t, found_inf, found_nan, bad_loss) -> None:
    """:func:`count` on device, in place: call it first in a tensor rule, while ``t.scale`` is still the
    scale this iteration ran with. The flags are bool 0-dim tensors; ``found_inf`` includes ``bad_loss``
    and ``found_nan`` implies ``found_inf``, as the scaler's check makes them."""
    import torch  # here, not at the top: the policies import without torch

    t.scale_before.copy_(t.scale)  # not a state field: what the stuck check and the health account read
    torch.where(t.overflow_streak == 0, t.scale, t.streak_start_scale, out=t.streak_start_scale)
    inf_only = found_inf ^ found_nan  # "inf and no NaN": found_nan implies found_inf, so their exclusive or
    # What each counter adds, in COUNTERS order (t.counters holds them as one int64 vector):
    #   steps, skipped_steps, inf_steps, nan_steps, bad_loss_steps,
    #   overflow_streak, streak_nan_steps, streak_bad_loss_steps
    t.counters.add_(torch.stack([t.true, found_inf, inf_only, found_nan, bad_loss, found_inf, found_nan, bad_loss]))
    # A streak grows through a skipped step (found_inf added 1 above) and ends at a clean one (times 0).
    t.streaks.mul_(found_inf)


def stuck_at_bound_or_streak(policy, state: ScaleState, scale_before: float, lowest: Optional[float]) -> bool:
    """The usual ``is_stuck``: an overflow while the scale sat at ``lowest``, or a long enough streak.

    A streak made only of non-finite losses is stuck after ``max_consecutive_skips`` (or
    :data:`BAD_LOSS_STREAK`) steps: the scale is not theirs to answer, so the floor does not apply.
    """
    if state.overflow_streak == 0:
        return False
    if not (math.isfinite(state.scale) and state.scale >= SMALLEST_SCALE):
        # A scale of NaN, inf, 0 or a float32 subnormal (1/scale is inf: where min_scale=None lets torch's
        # backoff go) trains no step from now on.
        return True
    if state.streak_bad_loss_steps == state.overflow_streak:
        limit = policy.max_consecutive_skips or BAD_LOSS_STREAK
        return state.overflow_streak >= limit
    at_min = lowest is not None and scale_before <= f32(lowest)
    too_long = policy.max_consecutive_skips is not None and state.overflow_streak >= policy.max_consecutive_skips
    return at_min or too_long


# ---------------------------------------------------------------------------------------- protocol
@runtime_checkable
class Policy(Protocol):
    """What :class:`lossscale.GradScaler` needs from a scale policy.

    Attributes:
        name: the registry name (``GradScaler(policy=name)``).
        state_type: the policy's immutable state, a :class:`ScaleState` subclass.
        needs_amax: the scaler measures max|g| of the scaled gradients for it (one read pass) and
            passes it as ``amax``; across ranks it passes the MAX of the ranks' finite amax (an
            inf/NaN one is sent as 0: the flags carry the overflow), so such a policy must ignore
            ``amax`` when ``found_inf``.
    """

    name: ClassVar[str]
    state_type: ClassVar[type]
    needs_amax: ClassVar[bool]
    on_stuck: str
    max_consecutive_skips: Optional[int]

    def init_state(self) -> ScaleState:
        """The state before the first step."""

    def update(
        self, state, found_inf: bool, found_nan: bool = False, amax: Optional[float] = None, bad_loss: bool = False
    ):
        """The next state after one iteration (pure). ``bad_loss``: the loss was non-finite before
        scaling: skip without touching the scale or the trackers."""

    def tensor_update(self, t, found_inf, found_nan, bad_loss, amax=None) -> None:
        """The same rule on device tensors, in place, without a host sync: ``t`` the state
        (:class:`lossscale._state.TensorState`), the flags bool 0-dim tensors (``found_inf`` includes
        ``bad_loss``), ``amax`` a float32 0-dim tensor or None."""

    def is_stuck(self, state, scale_before: float) -> bool:
        """Whether the update that produced ``state`` was an overflow the scale could not answer."""

    def scale_bounds(self) -> Tuple[Optional[float], Optional[float]]:
        """(lowest, highest) scale it allows; None where unbounded."""

    def torch_state(self, state) -> Dict[str, Any]:
        """torch's ``GradScaler.state_dict()`` keys for ``state``, with values a torch scaler can use."""

    def torch_factors(self) -> Dict[str, Any]:
        """torch's ``growth_factor``, ``backoff_factor`` and ``growth_interval`` for this policy: what
        :meth:`torch_state` writes and ``GradScaler``'s getters return."""

    def check_state(self, state) -> None:
        """Raise ValueError naming the field when ``state`` could not have come from this policy."""

    def settle_steps(self) -> int:
        """The consecutive steps without an overflow after which the health account (lossscale.health)
        takes the scale as calibrated; 0 for a scale that never searches (a fixed one)."""


class PolicyBase:
    """Defaults for the :class:`Policy` protocol; policies subclass it beside ``@dataclass(frozen=True)``.

    Subclasses set ``name`` and ``state_type`` and write ``update`` and ``tensor_update``.
    """

    name: ClassVar[str] = ""
    state_type: ClassVar[type] = ScaleState
    needs_amax: ClassVar[bool] = False
    #: GradScaler keywords that mean a field under another name (static: init_scale -> scale).
    keyword_aliases: ClassVar[Dict[str, str]] = {}

    def _plain_numbers(self) -> None:
        """Store every number field as a Python float or int (numpy's included; an int beyond float
        range raises ValueError naming the field). Every policy's ``__post_init__`` calls it first."""
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            kinds = set(typing.get_args(hints[f.name])) - {type(None)} or {hints[f.name]}  # Optional[x], x | None
            if kinds <= {float, int}:
                value = plain_number(f.name, getattr(self, f.name), integral=kinds == {int})
                object.__setattr__(self, f.name, value)

    def settle_steps(self) -> int:
        """:data:`SETTLE`, capped by the growth interval where the policy has one (the backoffs from
        ``init_scale`` come within it)."""
        interval = getattr(self, "growth_interval", None)
        return SETTLE if interval is None else min(interval, SETTLE)

    def scale_bounds(self) -> Tuple[Optional[float], Optional[float]]:
        """(min_scale, max_scale) as configured; None where unbounded."""
        return getattr(self, "min_scale", None), getattr(self, "max_scale", None)

    def config(self) -> Dict[str, Any]:
        """The configuration as a dict of the dataclass fields (what a checkpoint stores)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def torch_factors(self) -> Dict[str, Any]:
        """This policy's growth and backoff factors and growth interval where it has them, torch's
        defaults where not (a torch scaler that loads the checkpoint then follows those)."""
        return {
            "growth_factor": float(getattr(self, "growth_factor", 2.0)),
            "backoff_factor": float(getattr(self, "backoff_factor", 0.5)),
            "growth_interval": int(getattr(self, "growth_interval", 2000)),
        }

    def torch_state(self, state) -> Dict[str, Any]:
        """torch's five keys: the scale and tracker, with :meth:`torch_factors`."""
        return {
            "scale": state.scale,
            **self.torch_factors(),
            "_growth_tracker": int(getattr(state, "growth_tracker", 0)),
        }

    def smallest_scale(self) -> float:
        """The smallest scale a state of this policy may hold: float32's smallest normal,
        :data:`SMALLEST_SCALE` (below it 1/scale is inf in float32); 0.0 for a policy whose scale may back
        off to 0 as torch's does (:meth:`lossscale.DynamicPolicy.smallest_scale`)."""
        return SMALLEST_SCALE

    def check_type(self, state) -> None:
        """ValueError unless ``state`` is this policy's :attr:`state_type` (another policy's state has other
        fields and trackers); :meth:`update` and :meth:`check_state` begin with it."""
        if type(state) is not self.state_type:
            raise ValueError(f"state is a {type(state).__name__}, not {self.state_type.__name__}.")

    def check_state(self, state) -> None:
        """Raise ValueError naming the first field of ``state`` that this policy could not have produced.

        Generic checks by field type (floats finite, ints >= 0 unless signed, bools bool), the scale
        > 0 and within :meth:`scale_bounds`; subclasses add their own invariants.
        """
        self.check_type(state)
        for f in dataclasses.fields(state):
            v = getattr(state, f.name)
            kind = field_kind(f)
            if kind == "bool":
                if not isinstance(v, bool):
                    raise ValueError(f"state.{f.name}={v!r} must be a bool.")
            elif host_type(f) is int:
                if isinstance(v, bool) or not isinstance(v, int):
                    raise ValueError(f"state.{f.name}={v!r} must be an int.")
                if v < 0 and not f.metadata.get("signed"):
                    raise ValueError(f"state.{f.name}={v!r} must be >= 0.")
                if abs(v) >= _INT_LIMIT[kind]:
                    raise ValueError(f"state.{f.name}={v!r} does not fit its {kind} on device.")
            else:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise ValueError(f"state.{f.name}={v!r} must be a finite float.")
                if v < 0:
                    raise ValueError(f"state.{f.name}={v!r} must be >= 0.")
                if kind == "f32" and not math.isfinite(f32(v)):
                    raise ValueError(f"state.{f.name}={v!r} is outside float32's range, in which the device holds it.")
        if self.smallest_scale() == 0.0:
            if not 0.0 <= f32(state.scale) < math.inf:
                raise ValueError(f"state.scale={state.scale!r} must be >= 0 and below float32's 3.4e38.")
        elif not SMALLEST_SCALE <= f32(state.scale) < math.inf:
            raise ValueError(
                f"state.scale={state.scale!r} is outside float32's normal range [2**-126, 3.4e38], "
                "where the device keeps the scale (a zero scale would step on NaN gradients)."
            )
        lo, hi = self.scale_bounds()
        if (lo is not None and state.scale < f32(lo)) or (hi is not None and state.scale > f32(hi)):
            raise ValueError(f"state.scale={state.scale!r} is outside this policy's [min_scale={lo}, max_scale={hi}].")
        if state.skipped_steps > state.steps or state.inf_steps + state.nan_steps != state.skipped_steps:
            raise ValueError("state counters disagree: skipped_steps must be <= steps and equal inf_steps + nan_steps.")
        if state.overflow_streak > state.skipped_steps or state.streak_nan_steps > state.overflow_streak:
            raise ValueError("state.overflow_streak / streak_nan_steps exceed the skipped steps they count.")
        if (
            state.bad_loss_steps > state.skipped_steps
            or state.streak_bad_loss_steps > state.overflow_streak
            or state.streak_bad_loss_steps > state.bad_loss_steps
        ):
            raise ValueError("state.bad_loss_steps / streak_bad_loss_steps exceed the skipped steps they count.")


# ---------------------------------------------------------------------------------------- registry
_REGISTRY: Dict[str, type] = {}


def register(cls):
    """Class decorator: register a policy under ``cls.name`` (for ``GradScaler(policy=...)`` and checkpoints).

    The name must be the class's own (a subclass of a registered policy inherits its name, and would
    replace it for every later ``GradScaler(policy=...)``), and a built-in policy's name is never
    taken over; ValueError naming the fix otherwise. Registering a class again is a no-op; a policy of
    your own may be registered again under its name (a re-run notebook cell)."""
    name = cls.__dict__.get("name") if isinstance(cls, type) else None
    if not name or not isinstance(name, str):
        inherited = getattr(cls, "name", None)
        if isinstance(cls, type) and inherited:
            owner = next(base for base in cls.__mro__ if base.__dict__.get("name") == inherited)
            raise ValueError(
                f"{cls.__name__} inherits name={inherited!r} from {owner.__name__}, so registering it would "
                f"replace {owner.__name__} for every GradScaler(policy={inherited!r}); give {cls.__name__} its own "
                'class attribute name = "..." to register it.'
            )
        raise ValueError(
            f"{getattr(cls, '__name__', type(cls).__name__)} needs a class attribute name to be registered: "
            'give it a name of its own (name = "...").'
        )
    known = _REGISTRY.get(name)
    reloaded = known is not None and (known.__module__, known.__qualname__) == (cls.__module__, cls.__qualname__)
    if known is not None and known is not cls and not reloaded and known.__module__.startswith("lossscale."):
        raise ValueError(
            f"{cls.__name__} has name={name!r}, the name of lossscale's {known.__name__}, which it would replace "
            f'for every GradScaler(policy={name!r}); give {cls.__name__} a name of its own (name = "...").'
        )
    _REGISTRY[name] = cls
    return cls


def policy_class(name: str) -> type:
    """The policy class registered under ``name``; ValueError listing the names otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"policy={name!r} is not known; use one of {', '.join(repr(n) for n in policy_names())}, or a "
            "policy object such as lossscale.DynamicPolicy(...)."
        ) from None


def policy_names() -> List[str]:
    """The registered policy names."""
    return sorted(_REGISTRY)


def registered() -> List[type]:
    """The registered policy classes."""
    return list(_REGISTRY.values())


def policy_types() -> Dict[str, type]:
    """Registered policy classes by class name (what checkpoints store)."""
    return {cls.__name__: cls for cls in _REGISTRY.values()}
