"""Checkpoints: the scaler's state as a versioned dict, and its validation on the way back in.

A lossscale state dict holds torch's five keys (so ``torch.amp.GradScaler.load_state_dict`` accepts
it, with values a torch scaler can use: :meth:`~lossscale.policy.Policy.torch_state`) plus the whole
policy config and state::

    {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker",   # torch's
     "lossscale_version": 2, "policy_type": "DynamicPolicy", "policy": {...}, "state": {...}}

Loading validates every key before anything changes (:func:`load`): the types, finiteness, the scale
> 0, within the bounds and within float32, counters >= 0, the trackers within their configured range,
every config field, and the torch keys of a lossscale dict equal to what its state implies (they are
copies; a mismatch means the dict was edited, and which one to believe is not ours to guess). Every
error is a ``ValueError`` naming the key. Only this version's dicts are read: earlier versions were
written by pre-release builds, which no published lossscale reads. A torch dict continues exactly as
torch would; its numbers may be 1-element tensors, as some trainers save them.

Which policy wins: the checkpoint's. It restores the run that was saved, including a policy type or
config that differs from the constructor's (a torch dict: its growth and backoff factors and growth
interval); a warning names what changed.

Pure Python: this module imports no torch.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from typing import Any, Dict, Tuple

from ._validate import plain_bool, plain_number
from ._warnings import warn
from .dynamic import DynamicPolicy
from .policy import ScaleState, f32, field_kind, host_type, policy_types

__all__ = ["STATE_DICT_VERSION", "TORCH_KEYS", "to_dict", "load"]

STATE_DICT_VERSION = 2
TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def to_dict(policy, state: ScaleState) -> Dict[str, Any]:
    """The versioned state dict of ``policy`` in ``state``."""
    return {
        **policy.torch_state(state),
        "lossscale_version": STATE_DICT_VERSION,
        "policy_type": type(policy).__name__,
        "policy": policy.config(),
        "state": dataclasses.asdict(state),
    }


def load(state_dict: Any, current) -> Tuple[Any, ScaleState]:
    """``(policy, state)`` from a lossscale or torch state dict, validated; ``current`` is the scaler's
    policy (torch dicts continue it; a different lossscale policy is warned about). Changes nothing."""
    if not isinstance(state_dict, dict):
        raise ValueError(f"load_state_dict takes a dict, got {type(state_dict).__name__}.")
    if len(state_dict) == 0:
        raise RuntimeError("The state dict is empty, possibly because it was saved from a disabled scaler.")
    if "lossscale_version" in state_dict:
        return _load_lossscale(state_dict, current)
    ours = [k for k in ("policy_type", "policy", "state") if k in state_dict]
    if ours:  # read as a torch dict, it would silently drop the policy and every counter
        raise ValueError(
            f"state dict has {ours} but no 'lossscale_version': a lossscale state dict that lost "
            f"its version key. Add 'lossscale_version': {STATE_DICT_VERSION}."
        )
    return _load_torch(state_dict, current)


def _load_lossscale(sd: Dict[str, Any], current) -> Tuple[Any, ScaleState]:
    version = sd["lossscale_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version != STATE_DICT_VERSION:
        raise ValueError(
            f"state dict 'lossscale_version'={version!r} is not supported: this lossscale reads "
            f"version {STATE_DICT_VERSION} (earlier versions came from pre-release builds)."
        )
    missing = [k for k in ("policy_type", "policy", "state") if k not in sd]
    if missing:
        raise ValueError(f"state dict is missing {missing}.")
    type_name = sd["policy_type"]
    cls = policy_types().get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise ValueError(f"state dict 'policy_type'={type_name!r} is unknown; known: {sorted(policy_types())}.")
    config, fields = sd["policy"], sd["state"]
    for key, value in (("policy", config), ("state", fields)):
        if not isinstance(value, dict):
            raise ValueError(f"state dict '{key}' must be a dict, got {type(value).__name__}.")
    _check_keys("policy", config, cls, version)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the power-of-two warning was given when it was created
        try:
            policy = cls(**config)
        except (TypeError, ValueError) as e:
            raise ValueError(f"state dict 'policy' ({type_name}): {e}") from None
    _check_keys("state", fields, cls.state_type, version)
    fields = _plain_fields(cls.state_type, fields)
    try:
        policy.check_state(cls.state_type(**fields))
    except ValueError as e:
        raise ValueError(f"state dict {e}") from None
    # As the device will hold them (an int scale as a float32 float), so the state reads the same
    # before the first step as after.
    state = cls.state_type(**{f.name: _as_held(f, fields[f.name]) for f in dataclasses.fields(cls.state_type)})
    _check_torch_copies(sd, policy.torch_state(state))
    if policy != current:
        _warn_replaced(current, policy)
    return policy, state


def _check_torch_copies(sd: Dict[str, Any], expected: Dict[str, Any]) -> None:
    """A lossscale dict's torch keys, where present, must say what its policy and state say."""
    for key in TORCH_KEYS:
        if key not in sd:
            continue  # only torch reads them, and it reports its own missing keys
        value = _torch_number(sd, key, float)
        if value != expected[key]:
            raise ValueError(
                f"state dict '{key}'={sd[key]!r} disagrees with the lossscale state it copies ({expected[key]!r}). "
                "A lossscale dict loads from 'policy' and 'state': edit those, or drop 'lossscale_version', "
                "'policy_type', 'policy' and 'state' to load it as a torch state dict."
            )


def _check_keys(key: str, given: Dict[str, Any], cls, version: int) -> None:
    """ValueError naming the unknown and the missing keys when ``given`` does not hold ``cls``'s fields."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown, absent = sorted(map(str, set(given) - names)), sorted(names - set(given))
    if unknown or absent:
        parts = ([f"unknown keys {unknown}"] if unknown else []) + ([f"missing keys {absent}"] if absent else [])
        raise ValueError(
            f"state dict '{key}' does not fit {cls.__name__} of 'lossscale_version'={version}: {', '.join(parts)}."
        )


def _plain_fields(state_type, fields: Dict[str, Any]) -> Dict[str, Any]:
    """Each field as a Python number or bool (numpy's converted, so the state saves as plain numbers
    again); the policy's ``check_state`` then checks the types, naming the key."""
    kinds = {f.name: host_type(f) for f in dataclasses.fields(state_type)}
    return {
        name: plain_bool(f"state dict state.{name}", value)
        if kinds[name] is bool
        else plain_number(f"state dict state.{name}", value, integral=kinds[name] is int)
        for name, value in fields.items()
    }


def _as_held(f: dataclasses.Field, value):
    """A float field as the device holds it (float32 or float64); ints and bools as they are."""
    if host_type(f) is not float:
        return value
    return f32(float(value)) if field_kind(f) == "f32" else float(value)


def _torch_number(sd: Dict[str, Any], key: str, kind: type):
    v = sd[key]
    if not isinstance(v, (int, float)) and hasattr(v, "item"):  # a 1-element tensor (or numpy number),
        n = v.numel() if hasattr(v, "numel") else getattr(v, "size", 1)  # as some trainers save them
        if n != 1:
            raise ValueError(f"state dict '{key}' must hold one number, got {n}.")
        if getattr(v, "is_meta", False):
            raise ValueError(
                f"state dict '{key}' is a tensor on the meta device, which holds no value; load the "
                "checkpoint with map_location='cpu' (or the training device)."
            )
        v = v.item()
    v = plain_number(f"state dict '{key}'", v, integral=kind is int and isinstance(v, numbers.Integral))
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"state dict '{key}'={sd[key]!r} must be a number.")
    if kind is int:
        if isinstance(v, float) and not v.is_integer():
            raise ValueError(f"state dict '{key}'={v!r} must be an integer.")
        return int(v)
    v = float(v)
    if not math.isfinite(v):
        raise ValueError(f"state dict '{key}'={v!r} must be finite.")
    return v


def _load_torch(sd: Dict[str, Any], current) -> Tuple[Any, ScaleState]:
    missing = [k for k in TORCH_KEYS if k not in sd]
    if missing:
        raise ValueError(f"state dict is missing {missing} (expected a lossscale or torch GradScaler state).")
    if not isinstance(current, DynamicPolicy):
        raise ValueError(
            f"a torch GradScaler state dict needs a dynamic policy; this scaler's is {type(current).__name__}."
        )
    scale = _torch_number(sd, "scale", float)
    values = {
        "growth_factor": _torch_number(sd, "growth_factor", float),
        "backoff_factor": _torch_number(sd, "backoff_factor", float),
        "growth_interval": _torch_number(sd, "growth_interval", int),
    }
    tracker = _torch_number(sd, "_growth_tracker", int)
    if not 0.0 <= f32(scale) < math.inf:
        raise ValueError(
            f"state dict 'scale'={scale!r} must be >= 0 and below float32's 3.4e38, where the scale is kept."
        )
    lo, hi = current.min_scale, current.max_scale
    if f32(scale) < current.smallest_scale():  # below 2**-126, where torch's unbounded backoff goes, on to 0
        raise ValueError(
            f"state dict 'scale'={scale!r} is below float32's normal range (2**-126), where 1/scale is inf "
            f"and no step trains; this scaler has min_scale={lo!r}. To load it as torch's scaler does, build "
            "the scaler with min_scale=None (torch's rule, no floor)."
        )
    # torch's scale is unbounded: a scale beyond this scaler's bounds moves the bound to it (as an
    # init_scale beyond them does), said in the one warning below, rather than refuse a torch checkpoint.
    moved = {
        bound: scale
        for bound, outside in (
            ("min_scale", lo is not None and scale < f32(lo)),
            ("max_scale", hi is not None and scale > f32(hi)),
        )
        if outside
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for key, value in values.items():
            try:
                dataclasses.replace(current, **{key: value})
            except ValueError as e:
                raise ValueError(f"state dict '{key}': {e}") from None
        policy = dataclasses.replace(current, **values, **moved)
    if tracker < 0 or tracker >= policy.growth_interval:
        raise ValueError(f"state dict '_growth_tracker'={tracker!r} must be in [0, growth_interval).")
    state = policy.init_state().replace(scale=f32(scale), growth_tracker=tracker)
    try:
        policy.check_state(state)  # nothing above should let a bad state through; this keeps it so
    except ValueError as e:
        raise ValueError(f"state dict (torch format) gives {e}") from None
    if policy != current:
        note = "".join(
            f" The torch checkpoint's scale={scale!r} is {'below' if bound == 'min_scale' else 'above'} "
            f"{bound}={getattr(current, bound)!r} (torch's scale has no bounds), so {bound} is set to "
            f"it: the run continues where it was saved. Pass {bound}= to choose the bound."
            for bound in moved
        )
        _warn_replaced(current, policy, note)
    return policy, state


def _warn_replaced(current, loaded, note: str = "") -> None:
    if type(current) is not type(loaded):
        what = f"policy {type(current).__name__} -> {type(loaded).__name__}"
    else:
        a, b = current.config(), loaded.config()
        what = ", ".join(f"{k}: {a[k]!r} -> {b[k]!r}" for k in a if a[k] != b[k])
    warn(
        f"lossscale: the checkpoint's policy replaces the one this scaler was built with ({what}).{note} A "
        "checkpoint restores the run it saved; build the scaler with the same settings to silence this.",
    )
