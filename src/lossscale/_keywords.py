"""``GradScaler(policy=name, **keywords)``: the keywords a user passes, routed to the policy's fields.

A keyword that is not a field of the chosen policy does not apply: it is validated by a registered
policy that has it (so ``hysteresis=0`` fails whatever the policy) and then warned about, since it
changes nothing. An unknown keyword raises. Pure Python.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import warnings
from typing import Any, Dict, Sequence

from ._validate import plain_number, positive_finite
from ._warnings import warn
from .formats import is_power_of_two
from .policy import policy_class, policy_names, registered

__all__ = ["policy_from_keywords"]


def policy_from_keywords(name: str, given: Dict[str, Any], scaler_keywords: Sequence[str] = ()):
    """The policy registered as ``name``, built from the GradScaler keywords ``given``; ``scaler_keywords``:
    the scaler's own, listed (with every policy's) when a keyword is no one's."""
    cls = policy_class(name)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs, ignored, named = {}, [], {}
    for key, value in given.items():
        field = cls.keyword_aliases.get(key, key)
        if field in named:  # the field under both its names (static: init_scale and scale)
            first = named[field]
            raise ValueError(
                f"{first}={given[first]!r} and {key}={value!r} both set policy={cls.name!r}'s {field}; "
                "pass one of them."
            )
        if field in names:
            kwargs[field], named[field] = value, key
        else:
            ignored.append(key)
    for key in ignored:
        _validate_elsewhere(cls, key, given[key], scaler_keywords)
    _lift_default_bounds(cls, kwargs)
    if ignored:
        warn(
            f"lossscale.GradScaler: {', '.join(f'{k}={given[k]!r}' for k in ignored)} do(es) not apply to "
            f"policy={cls.name!r} and is ignored; its keywords are: "
            f"{', '.join(sorted(names | set(cls.keyword_aliases)))}."
        )
    return cls(**kwargs)


def _number(x: float) -> str:
    """``x`` as a message shows it: a power of two as ``2**k``, anything else as Python writes it."""
    if is_power_of_two(x) and not 0 <= math.log2(x) < 11:  # 1 to 1024 read better as numbers
        return f"2**{int(math.log2(x))}"
    return repr(x)


def _lift_default_bounds(cls, kwargs) -> None:
    """An ``init_scale`` given outside the *default* bounds moves the bound to it (torch has none, so
    ``GradScaler(init_scale=2**32)``, Megatron's default, or ``init_scale=1e38`` must start training),
    with one note; a bound the caller gave is theirs, and a scale outside it stays an error."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    init = plain_number("init_scale", kwargs.get("init_scale"))  # ValueError beyond float range, naming it
    if isinstance(init, bool) or not isinstance(init, (int, float)) or "max_scale" not in defaults:
        return
    for bound, side in (("max_scale", 1), ("min_scale", -1)):
        default = defaults[bound]
        if bound not in kwargs and default is not None and (init - default) * side > 0:
            kwargs[bound] = float(init)
            warn(
                f"lossscale.GradScaler: init_scale={_number(init)} is {'above' if side > 0 else 'below'} the "
                f"default {bound}={_number(default)}, so {bound} is set to init_scale: the scale starts where asked "
                f"and never goes past it. Pass {bound}= to choose the bound ({bound}=None: none, as torch)."
            )


def _validate_elsewhere(cls, key: str, value, scaler_keywords: Sequence[str] = ()) -> None:
    """Validate a keyword that ``cls`` does not have with a registered policy that has it; ValueError
    listing the keywords, the nearest first, for a keyword no one has (a misspelling)."""
    for other in registered():
        field = other.keyword_aliases.get(key, key)
        if other is cls or field not in {f.name for f in dataclasses.fields(other)}:
            continue
        try:
            if field in ("init_scale", "scale", "min_scale", "max_scale"):  # a scale (a bound may be None)
                if not (value is None and field in ("min_scale", "max_scale")):
                    positive_finite(key, plain_number(key, value))  # numpy's numbers too; 10**400 named
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    other(**{field: value})
        except ValueError as e:
            raise ValueError(f"{e} (and {key} does not apply to policy={cls.name!r} anyway)") from None
        return
    others = sorted({n for other in registered() for n in _keywords_of(other)} - set(scaler_keywords))
    nearest = difflib.get_close_matches(key, list(scaler_keywords) + others, n=1)
    raise ValueError(
        f"{key}={value!r} is not a keyword of any scale policy, nor of GradScaler"
        + (f"; did you mean {nearest[0]}={value!r}?" if nearest else ".")
        + (f" GradScaler's keywords: {', '.join(scaler_keywords)}." if scaler_keywords else "")
        + f" The policies' other keywords ({', '.join(policy_names())}): {', '.join(others)}."
    )


def _keywords_of(cls) -> set:
    """The GradScaler keywords that set a field of policy ``cls``: its fields and their aliases."""
    return {f.name for f in dataclasses.fields(cls)} | set(cls.keyword_aliases)
