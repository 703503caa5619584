"""Named policies beyond "dynamic" and "static" (e.g. "adaptive"), so ``GradScaler(policy=name)`` and
checkpoints can find them without the scaler importing every policy module.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

_FACTORIES: Dict[str, Callable] = {}
_TYPES: Dict[str, type] = {}


def register(name: str, factory: Callable, policy_type: type) -> None:
    """Register ``factory(**GradScaler scale keywords) -> policy`` under ``name``, and its type for checkpoints."""
    _FACTORIES[name] = factory
    _TYPES[policy_type.__name__] = policy_type


def get(name: str) -> Optional[Callable]:
    """The factory registered under ``name``, or None."""
    return _FACTORIES.get(name)


def names():
    """Registered policy names."""
    return sorted(_FACTORIES)


def types() -> Dict[str, type]:
    """Registered policy types by class name (for loading checkpoints)."""
    return dict(_TYPES)
