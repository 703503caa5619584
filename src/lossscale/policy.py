"""What every loss-scale policy shares: the protocol, the common state, the bookkeeping, the registry.

This module imports no torch, and neither does any policy module (``dynamic``, ``static``,
``adaptive``, ``logmax``): a policy's tensor rule imports torch inside the function, when the scaler
calls it. So the rules can be read, run and tested with plain Python values::

    state = policy.init_state()
    state = policy.update(state, found_inf=..., found_nan=..., amax=...)

A policy is one file holding four things side by side (jmp's shape, plus the device form):

* its frozen config (a dataclass; validation in ``__post_init__``);
* its own immutable state type, a subclass of :class:`ScaleState`;
* ``update``: the readable pure rule, the spec a reader checks against the seed;
* ``tensor_update``: the same rule as branch-free tensor ops on the state's device tensors, in
  place, with no host sync. Its flags are device tensors, or host bools where the scaler already
  synced them: the helpers :func:`is_set`, :func:`either`, :func:`both`, :func:`negate` and
  :func:`where` fold a known flag, so one rule text serves both. A hypothesis test drives the pure
  form and both tensor forms with the same random sequences and requires bitwise agreement.

What the scaler needs from a policy is :class:`Policy` (the protocol, with defaults in
:class:`PolicyBase`). A policy registers itself under a name with :func:`register`, so
``GradScaler(policy="name")`` and checkpoints find it; nothing else in lossscale lists policies.

The bookkeeping every policy shares (:func:`count`, and :func:`count_tensor` on device)::

    steps += 1
    found_inf = found_inf or bad_loss             # a non-finite loss skips the step too
    if found_inf:                                 # "some gradient was inf or NaN" (torch's naming)
        skipped_steps += 1; overflow_streak += 1  # the optimizer step is skipped
        inf_steps += not found_nan; nan_steps += found_nan; streak_nan_steps += found_nan
        bad_loss_steps += bad_loss; streak_bad_loss_steps += bad_loss
        if the streak just began: streak_start_scale = scale
    else:
        overflow_streak = streak_nan_steps = streak_bad_loss_steps = 0

**The cause is an input.** ``bad_loss`` says the loss (or, with tracing, a forward output) was
already non-finite before any scaling: the scale did not cause it and cannot cure it, so every policy
skips such a step *without* backing off and leaves its trackers as they were (:func:`unless_bad`
holds them on device). A streak of them is stuck after ``max_consecutive_skips`` steps, or
:data:`BAD_LOSS_STREAK` when that is None: the scale no longer falls, so "an overflow at min_scale"
can never catch an endless run of bad batches.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Protocol, Tuple, runtime_checkable

from ._validate import plain_number

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
    "count_flags",
    "is_power_of_two",
    "diagnose",
    "STUCK_REACTIONS",
]

STUCK_REACTIONS = ("raise", "warn", "ignore")


#: The smallest scale lossscale keeps: float32's smallest normal. Below it, the unscale's 1/scale
#: (computed in float64, applied in float32, as torch does) leaves float32's range near 2**-128, and the
#: unscaled gradients become inf and NaN that the check, which reads the *scaled* ones, cannot see.
SMALLEST_SCALE = 2.0**-126

#: Consecutive non-finite losses that count as stuck when ``max_consecutive_skips`` is None.
BAD_LOSS_STREAK = 10


def f32(x: float) -> float:
    """Round a Python float to the nearest float32, as the device scale tensor stores it.

    Why: torch keeps the scale in a float32 tensor and multiplies in double before storing
    (``static_cast<float>(scale * growth_factor)``); mirroring that rounding keeps a pure rule
    bitwise equal to its tensor form for any factor, not only powers of two.
    """
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # beyond float32's range: the cast gives inf, as on device
        return math.copysign(math.inf, x)


def is_power_of_two(x: float) -> bool:
    """True when ``x`` is a positive, finite power of two (2**k for any integer k, negative included)."""
    return (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
            and math.frexp(x)[0] == 0.5)


def _torch():
    """torch, imported when a tensor rule runs (never at import: the policies are pure Python)."""
    import torch

    return torch


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
        streak_start_scale: the scale when the current streak began (for the diagnosis).
    """

    scale: float
    steps: int = 0
    skipped_steps: int = 0
    inf_steps: int = 0
    nan_steps: int = 0
    bad_loss_steps: int = 0
    overflow_streak: int = 0
    streak_nan_steps: int = 0
    streak_bad_loss_steps: int = 0
    streak_start_scale: float = 0.0

    def replace(self, **changes) -> "ScaleState":
        """A copy with ``changes`` applied (the state itself is frozen)."""
        return dataclasses.replace(self, **changes)

    @property
    def last_step_skipped(self) -> bool:
        """Whether the iteration that produced this state was skipped."""
        return self.overflow_streak > 0


#: Field metadata marking a float field held in float64 on device (default for floats: float32).
F64 = {"dtype": "f64"}
#: Field metadata marking an int field held in int32 on device (default for ints: int64), for a
#: tracker that torch's own kernels take (``_amp_update_scale_`` wants torch's int32 growth tracker).
I32 = {"dtype": "i32"}
#: Field metadata marking an int field that may be negative (checkpoint validation).
SIGNED = {"signed": True}


def field_kind(f: dataclasses.Field) -> str:
    """How a state field is held on device: "f32", "f64" (float), "i64" (int and bool) or "i32"."""
    if f.metadata.get("dtype"):
        return f.metadata["dtype"]
    kind = str(f.type)
    if kind in ("float", "Optional[float]"):
        return "f32"
    if kind in ("int", "bool"):
        return "i64"
    raise TypeError(f"state field {f.name}: type {kind!r} has no device form; use float, int or bool.")


def count(state: ScaleState, found_inf: bool, found_nan: bool, bad_loss: bool = False) -> ScaleState:
    """The bookkeeping every policy shares: step, skip, inf/NaN, bad-loss and streak counters (pure form)."""
    if found_nan and not found_inf:
        raise ValueError(
            "found_nan=True with found_inf=False: found_inf means 'any inf or NaN', so a NaN step "
            "must pass found_inf=True as well."
        )
    bad_loss = bool(bad_loss)
    if not (found_inf or bad_loss):
        return state.replace(steps=state.steps + 1, overflow_streak=0, streak_nan_steps=0, streak_bad_loss_steps=0)
    return state.replace(
        steps=state.steps + 1,
        skipped_steps=state.skipped_steps + 1,
        inf_steps=state.inf_steps + (not found_nan),
        nan_steps=state.nan_steps + bool(found_nan),
        bad_loss_steps=state.bad_loss_steps + bad_loss,
        overflow_streak=state.overflow_streak + 1,
        streak_nan_steps=state.streak_nan_steps + bool(found_nan),
        streak_bad_loss_steps=state.streak_bad_loss_steps + bad_loss,
        streak_start_scale=state.scale if state.overflow_streak == 0 else state.streak_start_scale,
    )


# ------------------------------------------------------------------ flags the host may already know
# A tensor rule receives the iteration's flags (found_inf, found_nan, bad_loss) either as device
# tensors (the fused-optimizer path: nothing was synced) or, where the scaler has already synced the
# check (every optimizer without amp-scaling support, on every device), as Python bools for what the
# host knows: found_inf, and on a clean step found_nan and bad_loss too (both imply found_inf). The
# helpers below evaluate the same rule text either way: a known condition folds at trace time and its
# kernels are never launched. The hypothesis tests run every rule both ways (tests/_rules.TensorForm).
def is_set(flag):
    """A flag as a condition: a host bool as it is; a device tensor as ``flag > 0`` (torch's
    convention: found_inf is a sum of per-device flags); None as False."""
    if flag is None or isinstance(flag, bool):
        return bool(flag)
    return flag if flag.dtype is _torch().bool else flag > 0


def _fold(a, b, absorbing: bool, combine):
    """``combine(a, b)`` for a boolean operator whose ``absorbing`` operand decides it alone (True
    for or, False for and); the other constant is its identity."""
    if a is absorbing or b is absorbing:
        return absorbing
    if isinstance(a, bool):
        return b
    if isinstance(b, bool):
        return a
    return combine(a, b)


def either(a, b):
    """``a or b`` over host bools and bool 0-dim tensors; a known operand folds."""
    return _fold(a, b, True, lambda x, y: x | y)


def both(a, b):
    """``a and b`` over host bools and bool 0-dim tensors; a known operand folds."""
    return _fold(a, b, False, lambda x, y: x & y)


def negate(a):
    """``not a`` over a host bool or a bool 0-dim tensor."""
    return (not a) if isinstance(a, bool) else ~a


def where(cond, if_true, if_false):
    """``torch.where`` that folds a condition the host knows (no kernel then)."""
    if isinstance(cond, bool):
        return if_true if cond else if_false
    return _torch().where(cond, if_true, if_false)


def assign(field, value) -> None:
    """Copy the tensor ``value`` into the 0-dim state view ``field``; nothing when it already is
    ``field`` (a folded ``where`` that kept the old value)."""
    if value is not field:
        field.copy_(value)


def as_tensor(t, flag):
    """A flag as a float32 device tensor (torch's found_inf convention): a host bool becomes the
    state's constant 0 or 1 (``t.zero``/``t.one``), a bool tensor 0.0/1.0, a float32 flag stays as
    it is (None stays None)."""
    if isinstance(flag, bool):
        return t.one if flag else t.zero
    if flag is not None and flag.dtype is _torch().bool:
        return flag.float()
    return flag


def as_bool_tensor(t, flag):
    """A bool 0-dim tensor for a condition: a host bool becomes ``t.true``/``t.false``."""
    if isinstance(flag, bool):
        return t.true if flag else t.false
    return flag


#: The shared counters' update as a table over the step's flags ``v = [1, overflow, nan, bad_loss]``
#: (nan and bad_loss imply overflow): ``counts = counts * (KEEP @ v) + (ADD @ v)``, in ScaleState's
#: order. A clean step (overflow 0) zeroes the three streak counters; "inf only" is overflow - nan.
COUNT_KEEP = ((1, 0, 0, 0),) * 5 + ((0, 1, 0, 0),) * 3
COUNT_ADD = (
    (1, 0, 0, 0),   # steps
    (0, 1, 0, 0),   # skipped_steps
    (0, 1, -1, 0),  # inf_steps
    (0, 0, 1, 0),   # nan_steps
    (0, 0, 0, 1),   # bad_loss_steps
    (0, 1, 0, 0),   # overflow_streak
    (0, 0, 1, 0),   # streak_nan_steps
    (0, 0, 0, 1),   # streak_bad_loss_steps
)


def count_rows(overflow: bool, nan: bool, bad_loss: bool) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """``(keep, add)``: :data:`COUNT_KEEP` and :data:`COUNT_ADD` applied to known flags."""
    v = (1, int(overflow), int(nan), int(bad_loss))
    return tuple(tuple(sum(a * b for a, b in zip(row, v)) for row in table) for table in (COUNT_KEEP, COUNT_ADD))


def count_tensor(t, overflow, nan, bad_loss=None) -> None:
    """:func:`count` on device, in place. ``overflow``, ``nan``, ``bad_loss``: bool 0-dim tensors or
    host bools (see :func:`is_set`); nan and bad_loss imply overflow (the caller ORs bad_loss into
    overflow); ``bad_loss`` None means not checked.

    ``t`` is the scaler's tensor state: 0-dim views named like the state's fields, ``t.counts`` (the
    eight shared counters, contiguous, in :class:`ScaleState`'s order), ``t.scale_before`` and the
    constants of :class:`lossscale._state.TensorState`. Call it first in a tensor rule, while
    ``t.scale`` still holds the scale this iteration ran with.

    A step the host knows was clean costs one kernel; one known or possibly skipped also records the
    scale it ran with (``scale_before``, which only the stuck check reads, and only after such a
    step) and the streak's first scale.
    """
    torch = _torch()
    bad = False if bad_loss is None else bad_loss
    if overflow is not False:
        t.scale_before.copy_(t.scale)
        # The streak starts at this iteration's scale when the previous streak length was 0.
        starts = both(overflow, t.overflow_streak == 0)
        torch.where(starts, t.scale, t.streak_start_scale, out=t.streak_start_scale)
    if all(isinstance(f, bool) for f in (overflow, nan, bad)):
        keep, add = t.known_counts[(overflow, nan, bad)]
    else:
        v = torch.stack([t.true] + [as_bool_tensor(t, f) for f in (overflow, nan, bad)]).long()
        keep, add = (t.count_table * v).sum(-1)  # [KEEP @ v, ADD @ v]
    torch.addcmul(add, t.counts, keep, out=t.counts)


def count_flags(t, found_inf, found_nan, bad_loss=None):
    """:func:`count_tensor` from the iteration's flags as a rule receives them (device tensors or
    host bools, :func:`is_set`); returns the overflow condition, a non-finite loss included."""
    overflow = either(is_set(found_inf), is_set(bad_loss))
    count_tensor(t, overflow, both(is_set(found_nan), overflow), bad_loss)
    return overflow


def unless_bad(t, bad_loss, names):
    """Hold the fields ``names`` of ``t`` as they are when ``bad_loss`` (a bool 0-dim tensor, a host
    bool, or None).

    A tensor rule calls ``hold = unless_bad(t, bad_loss, names)`` before it writes, and ``hold()``
    after: every named field then keeps its old value on a step whose loss was non-finite, which
    the scale did not cause (the pure rules return ``count(...)`` alone for such a step).
    """
    if bad_loss is None or bad_loss is False:
        return lambda: None
    bad = as_bool_tensor(t, bad_loss)
    saved = [(getattr(t, n), getattr(t, n).clone()) for n in names]

    def restore():
        for field, old in saved:
            _torch().where(bad, old, field, out=field)
    return restore


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

    def update(self, state, found_inf: bool, found_nan: bool = False, amax: Optional[float] = None,
               bad_loss: bool = False):
        """The next state after one iteration (pure). ``bad_loss``: the loss was non-finite before
        scaling: skip without touching the scale or the trackers."""

    def tensor_update(self, t, found_inf, found_nan, amax=None, bad_loss=None) -> None:
        """The same rule on device tensors, in place, without a host sync."""

    def is_stuck(self, state, scale_before: float) -> bool:
        """Whether the update that produced ``state`` was an overflow the scale could not answer."""

    def scale_bounds(self) -> Tuple[Optional[float], Optional[float]]:
        """(lowest, highest) scale it allows; None where unbounded."""

    def torch_state(self, state) -> Dict[str, Any]:
        """torch's ``GradScaler.state_dict()`` keys for ``state``, with values a torch scaler can use."""

    def check_state(self, state) -> None:
        """Raise ValueError naming the field when ``state`` could not have come from this policy."""


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
        for f in dataclasses.fields(self):
            kind = str(f.type)
            if kind in ("float", "Optional[float]", "int", "Optional[int]"):
                value = plain_number(f.name, getattr(self, f.name), integral="int" in kind)
                object.__setattr__(self, f.name, value)

    # -- what the scaler calls
    def scale_bounds(self) -> Tuple[Optional[float], Optional[float]]:
        """(min_scale, max_scale) as configured; None where unbounded."""
        return getattr(self, "min_scale", None), getattr(self, "max_scale", None)

    def config(self) -> Dict[str, Any]:
        """The configuration as a dict of the dataclass fields (what a checkpoint stores)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def torch_state(self, state) -> Dict[str, Any]:
        """torch's five keys: the scale and tracker, with this policy's growth and backoff factors."""
        return {
            "scale": state.scale,
            "growth_factor": float(getattr(self, "growth_factor", 2.0)),
            "backoff_factor": float(getattr(self, "backoff_factor", 0.5)),
            "growth_interval": int(getattr(self, "growth_interval", 2000)),
            "_growth_tracker": int(getattr(state, "growth_tracker", 0)),
        }

    def check_state(self, state) -> None:
        """Raise ValueError naming the first field of ``state`` that this policy could not have produced.

        Generic checks by field type (floats finite, ints >= 0 unless signed, bools bool), the scale
        > 0 and within :meth:`scale_bounds`; subclasses add their own invariants.
        """
        if type(state) is not self.state_type:
            raise ValueError(f"state is a {type(state).__name__}, not {self.state_type.__name__}.")
        for f in dataclasses.fields(state):
            v = getattr(state, f.name)
            kind = field_kind(f)
            if str(f.type) == "bool":
                if not isinstance(v, bool):
                    raise ValueError(f"state.{f.name}={v!r} must be a bool.")
            elif kind in ("i64", "i32"):
                if isinstance(v, bool) or not isinstance(v, int):
                    raise ValueError(f"state.{f.name}={v!r} must be an int.")
                if v < 0 and not f.metadata.get("signed"):
                    raise ValueError(f"state.{f.name}={v!r} must be >= 0.")
                if abs(v) >= (2**62 if kind == "i64" else 2**31 - 1):
                    raise ValueError(f"state.{f.name}={v!r} does not fit the {kind.replace('i', 'int')} device counter.")
            else:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise ValueError(f"state.{f.name}={v!r} must be a finite float.")
                if v < 0:
                    raise ValueError(f"state.{f.name}={v!r} must be >= 0.")
        if state.scale <= 0:
            raise ValueError(f"state.scale={state.scale!r} must be > 0: a zero scale would step on NaN gradients.")
        if not SMALLEST_SCALE <= f32(state.scale) < math.inf:
            raise ValueError(f"state.scale={state.scale!r} is outside float32's normal range [2**-126, 3.4e38], "
                             "where the device keeps the scale.")
        for f in dataclasses.fields(state):  # the device holds these in float32: they must fit it
            v = getattr(state, f.name)
            if field_kind(f) == "f32" and not math.isfinite(f32(v)):
                raise ValueError(f"state.{f.name}={v!r} is outside float32's range, in which the device holds it.")
        lo, hi = self.scale_bounds()
        if (lo is not None and state.scale < f32(lo)) or (hi is not None and state.scale > f32(hi)):
            raise ValueError(f"state.scale={state.scale!r} is outside this policy's [min_scale={lo}, max_scale={hi}].")
        if state.skipped_steps > state.steps or state.inf_steps + state.nan_steps != state.skipped_steps:
            raise ValueError("state counters disagree: skipped_steps must be <= steps and equal inf_steps + nan_steps.")
        if state.overflow_streak > state.skipped_steps or state.streak_nan_steps > state.overflow_streak:
            raise ValueError("state.overflow_streak / streak_nan_steps exceed the skipped steps they count.")
        if (state.bad_loss_steps > state.skipped_steps or state.streak_bad_loss_steps > state.overflow_streak
                or state.streak_bad_loss_steps > state.bad_loss_steps):
            raise ValueError("state.bad_loss_steps / streak_bad_loss_steps exceed the skipped steps they count.")

    # -- construction from GradScaler keywords
    @classmethod
    def from_scaler_kwargs(cls, **given):
        """``GradScaler(policy=cls.name, **given)``: the keywords the user passed, mapped to fields.

        Keywords that are not fields of this policy do not apply: each is validated by a policy that
        has it (so ``hysteresis=0`` fails everywhere) and then warned about, since it changes nothing.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs, ignored = {}, []
        for key, value in given.items():
            field = cls.keyword_aliases.get(key, key)
            if field in names:
                kwargs[field] = value
            else:
                ignored.append(key)
        for key in ignored:
            _validate_elsewhere(cls, key, given[key])
        if ignored:
            warnings.warn(
                f"lossscale.GradScaler: {', '.join(f'{k}={given[k]!r}' for k in ignored)} do(es) not apply to "
                f"policy={cls.name!r} and is ignored; its keywords are: "
                f"{', '.join(sorted(names | set(cls.keyword_aliases)))}.",
                UserWarning,
                stacklevel=4,
            )
        return cls(**kwargs)


def _validate_elsewhere(cls, key: str, value) -> None:
    """Validate a keyword that ``cls`` does not have with a registered policy that has it."""
    for other in _REGISTRY.values():
        if other is cls:
            continue
        fields = {f.name for f in dataclasses.fields(other)}
        field = other.keyword_aliases.get(key, key)
        if field not in fields:
            continue
        if field in ("init_scale", "scale", "min_scale", "max_scale"):
            # The bounds and the scale only make sense beside each other: check the value alone.
            if not (value is None and field in ("min_scale", "max_scale")):
                try:
                    positive_finite(key, value)
                except ValueError as e:
                    raise ValueError(f"{e} (and {key} does not apply to policy={cls.name!r} anyway)") from None
            return
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                other(**{field: value})
        except ValueError as e:
            raise ValueError(f"{e} (and {key} does not apply to policy={cls.name!r} anyway)") from None
        return
    raise ValueError(
        f"{key}={value!r} is not a keyword of any scale policy; known policies: {', '.join(policy_names())}."
    )


# ---------------------------------------------------------------------------------------- registry
_REGISTRY: Dict[str, type] = {}


def register(cls):
    """Class decorator: register a policy under ``cls.name`` (for ``GradScaler(policy=...)`` and checkpoints)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a class attribute `name` to be registered.")
    _REGISTRY[cls.name] = cls
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


def policy_types() -> Dict[str, type]:
    """Registered policy classes by class name (what checkpoints store)."""
    return {cls.__name__: cls for cls in _REGISTRY.values()}


# -------------------------------------------------------------------------------- shared validation
def validate_stuck(on_stuck: str, max_consecutive_skips: Optional[int]) -> None:
    """Validate the two stuck-reaction fields every policy has."""
    if on_stuck not in STUCK_REACTIONS:
        raise ValueError(f"on_stuck={on_stuck!r} is not one of {STUCK_REACTIONS}.")
    if max_consecutive_skips is not None and (
        isinstance(max_consecutive_skips, bool)
        or not isinstance(max_consecutive_skips, int)
        or max_consecutive_skips < 1
    ):
        raise ValueError(
            f"max_consecutive_skips={max_consecutive_skips!r} must be a positive int, or None to "
            "react only at the minimum scale."
        )


def validate_backoff(value) -> None:
    """``backoff_factor`` must lie in (0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 < value < 1.0):
        raise ValueError(f"backoff_factor={value!r} must be in (0, 1) (e.g. 0.5).")


#: The largest int a config field may hold: the tensor rules compare it with int64 device counters.
MAX_INT = 2**62


def validate_int(name: str, value, lo: int, hi: Optional[int] = None) -> None:
    """An int field in [lo, hi] (bools refused); hi=None: up to :data:`MAX_INT`."""
    hi = MAX_INT if hi is None else hi
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or value > hi:
        raise ValueError(f"{name}={value!r} must be an int in [{lo}, {'2**62' if hi == MAX_INT else hi}].")


def positive_finite(name: str, value) -> None:
    """A scale: a number > 0 in float32's normal range (bools refused). The device keeps scales in
    float32, where 1e39 is inf, and unscales by 1/scale, which is inf below :data:`SMALLEST_SCALE`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite number > 0.")
    if not SMALLEST_SCALE <= f32(value) < math.inf:
        raise ValueError(f"{name}={value!r} is outside float32's normal range [2**-126, 3.4e38], where the "
                         "device keeps the scale.")


def validate_bounds(policy) -> None:
    """min_scale/max_scale finite and > 0 (or None), ordered, and init_scale between them."""
    for name in ("min_scale", "max_scale"):
        v = getattr(policy, name)
        if v is not None:
            positive_finite(name, v)
    lo, hi, init = policy.min_scale, policy.max_scale, policy.init_scale
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"min_scale={lo!r} is above max_scale={hi!r}; swap them.")
    if lo is not None and init < lo:
        raise ValueError(f"init_scale={init!r} is below min_scale={lo!r}.")
    if hi is not None and init > hi:
        raise ValueError(f"init_scale={init!r} is above max_scale={hi!r}; raise max_scale or pass max_scale=None.")


def warn_not_powers_of_two(policy, names) -> None:
    """Warn (once per config) about the ``names`` of ``policy`` that are not powers of two, and why."""
    bad = [f"{n}={getattr(policy, n)!r}" for n in names
           if getattr(policy, n) is not None and not is_power_of_two(getattr(policy, n))]
    if bad:
        warnings.warn(
            "lossscale: " + ", ".join(bad) + " is not a power of two, so the loss scale can leave the "
            "powers of two. Multiplying by a power of two only shifts the exponent and is exact; any "
            "other scale rounds every gradient when it is scaled and again when unscaled.",
            UserWarning,
            stacklevel=4,  # the user's constructor call: helper <- __post_init__ <- __init__ <- user
        )


def stuck_at_bound_or_streak(policy, state: ScaleState, scale_before: float, lowest: Optional[float]) -> bool:
    """The usual ``is_stuck``: an overflow while the scale sat at ``lowest``, or a long enough streak.

    A streak made only of non-finite losses is stuck after ``max_consecutive_skips`` (or
    :data:`BAD_LOSS_STREAK`) steps: the scale is not theirs to answer, so the floor does not apply.
    """
    if state.overflow_streak == 0:
        return False
    if not (math.isfinite(state.scale) and state.scale > 0):
        return True  # a scale of NaN, inf or 0 that the update kept skips every step from now on
    if state.streak_bad_loss_steps == state.overflow_streak:
        limit = policy.max_consecutive_skips or BAD_LOSS_STREAK
        return state.overflow_streak >= limit
    at_min = lowest is not None and scale_before <= f32(lowest)
    too_long = policy.max_consecutive_skips is not None and state.overflow_streak >= policy.max_consecutive_skips
    return at_min or too_long


# ---------------------------------------------------------------------------------------- diagnosis
def diagnose(policy, state: ScaleState, tracing: bool = False) -> str:
    """A plain-language diagnosis of a stuck run, from the counters alone (no tensors needed).

    ``tracing``: the scaler traces first causes (``trace=True``), so its caller names the module
    and this text does not suggest turning tracing on."""
    streak, nan = state.overflow_streak, state.streak_nan_steps
    lo = policy.scale_bounds()[0]
    if state.streak_bad_loss_steps == streak:
        return (
            f"lossscale: the loss was non-finite before any scaling in {streak} consecutive step(s) "
            f"({nan} with NaN gradients); every one was skipped and the scale kept at {state.scale:g}: the "
            "scale is not the cause (it only multiplies the backward). This is a data or model problem: a "
            "bad batch (NaN/inf inputs or labels), a log or sqrt of zero or a negative, a division by zero, "
            "an fp16 activation that overflowed in the forward, or weights that are already NaN."
            + ("" if tracing else " GradScaler(model=model, trace=True) names the first module whose output was "
               "non-finite (overflow_report()['forward']).")
        )
    lines = [
        f"lossscale: {streak} consecutive skipped step(s) ({nan} with NaN, {streak - nan} with inf only); "
        f"the scale went from {state.streak_start_scale:g} to {state.scale:g}"
        + (f" (min_scale={lo:g})." if lo is not None else ".")
    ]
    if not (math.isfinite(state.scale) and state.scale > 0):
        lines.append(
            f"The scale itself is {state.scale:g}, so every step overflows and is skipped. lossscale never "
            "sets such a scale (update(new_scale=...) ignores one); something wrote it into the scale tensor "
            "(scaler._get_scale_async()), or min_scale=None let the backoff reach 0. Set a good one with "
            "scaler.update(new_scale=2.0**16) after a step."
        )
    elif nan and streak > 1 and state.streak_start_scale != state.scale:
        lines.append(
            f"NaN persisted while the scale fell {state.streak_start_scale / state.scale:g}x: the scale is "
            "not the cause (a smaller scale cures inf, never NaN). NaN comes from the model or data: 0/0, "
            "log or sqrt of a negative or zero, inf - inf (e.g. an overflowed fp16 activation), NaN "
            "already in the weights or inputs, or a learning rate that diverged. Find it with "
            "torch.autograd.set_detect_anomaly(True)."
        )
    elif nan:
        lines.append(
            "NaN at the smallest scale the policy allows: lowering the scale cannot cure a NaN. Look for "
            "0/0, log or sqrt of a negative or zero, inf - inf (an overflowed fp16 activation), or NaN "
            "already in the weights or inputs (torch.autograd.set_detect_anomaly(True) finds the op)."
        )
    else:
        lines.append(
            "Gradients overflow even at the smallest scale allowed: the overflow is in the fp16 "
            "forward/backward itself (an activation or gradient above 65504), not in the scaling. Fixes: "
            "keep that layer in fp32 (autocast(enabled=False) around it, or a softmax/norm in fp32), "
            "lower the learning rate or clip gradients, check the inputs for extreme values, or train in "
            "bf16 (GradScaler.passthrough()). If the overflows are rare and isolated, lower min_scale."
        )
    lines.append("scaler.overflow_report() names the parameters that held inf and NaN on the last skipped step.")
    return "\n".join(lines)
