"""The lossscale APIs the demo measures with, found at run time.

Each function returns None (or False) when its API is not available in this build, so the demo
reports the figure that depends on it as PENDING instead of faking it. This is the one place that
knows their names.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Dict, Optional

__all__ = ["formats", "stats", "hooks", "telemetry_kwargs", "adaptive_available", "histogram", "nonzero_frac", "missing"]

#: What each optional API is, for messages.
DESCRIPTIONS = {
    "formats": "lossscale.formats (get('fp16') facts, table())",
    "stats": "lossscale.stats.grad_stats (flushed/overflow fractions, exponent histogram, .at(scale))",
    "hooks": "lossscale.hooks (per-layer activation-gradient statistics)",
    "telemetry": "GradScaler(telemetry=...) + scaler.metrics() (per-step grad/flushed_frac, grad/headroom_bits)",
    "adaptive": "GradScaler(policy='adaptive')",
}


def _module(name: str, *attrs: str) -> Optional[Any]:
    try:
        mod = importlib.import_module(f"lossscale.{name}")
    except ImportError:
        return None
    return mod if all(hasattr(mod, a) for a in attrs) else None


def formats():
    """``lossscale.formats`` with ``get`` and ``table``, or None."""
    return _module("formats", "get", "table")


def stats():
    """``lossscale.stats`` with ``grad_stats``, or None."""
    return _module("stats", "grad_stats")


def hooks():
    """``lossscale.hooks`` with ``activation_grad_probe`` and ``ActivationGradRecorder``, or None."""
    return _module("hooks", "activation_grad_probe", "ActivationGradRecorder")


def telemetry_kwargs() -> Optional[Dict[str, Any]]:
    """The GradScaler keyword that turns on per-step telemetry, or None when the scaler has none."""
    import inspect

    from lossscale import GradScaler

    if "telemetry" not in inspect.signature(GradScaler).parameters or not hasattr(GradScaler, "metrics"):
        return None
    if stats() is None:
        return None
    return {"telemetry": 1}


def adaptive_available() -> bool:
    """Whether ``GradScaler(policy="adaptive")`` is registered."""
    import lossscale  # noqa: F401  (registers the policies it ships)
    from lossscale import _policy_registry

    return _policy_registry.get("adaptive") is not None


def histogram(gstats) -> Dict[int, int]:
    """``{binade e: count}`` of the nonzero finite values of ``x * scale`` (``2**e <= |x * scale| < 2**(e+1)``).

    Read from the GradStats histogram, whose bin ``5 * exponent_field + class`` holds ``|x|``'s float32
    bit patterns (see :mod:`lossscale.stats`): a binade is an exponent field, its five classes are
    summed. A power-of-two ``scale`` shifts every binade by ``log2(scale)`` exactly.
    """
    shift = math.log2(gstats.scale)
    if shift != int(shift):
        raise ValueError(f"histogram(): scale={gstats.scale!r} is not a power of two, binades would not be exact")
    out: Dict[int, int] = {}
    for i, count in enumerate(gstats.hist.tolist()):
        if not count:
            continue
        field, cls = divmod(i, 5)
        if (field == 0 and cls == 0) or field == 255:  # exact zeros; inf and NaN
            continue
        e = field - 127 + int(shift)  # field 0 (float32 subnormals) lands at -127: far below any cliff
        out[e] = out.get(e, 0) + count
    return out


def nonzero_frac(gstats, what: str = "flushed") -> float:
    """``gstats.<what>`` over the nonzero finite values (the share of gradient signal, not of slots)."""
    n = gstats.numel - gstats.zeros - gstats.inf - gstats.nan
    return getattr(gstats, what) / n if n else 0.0


def missing() -> Dict[str, str]:
    """``{api: description}`` of the APIs this build lacks."""
    out = {}
    if formats() is None:
        out["formats"] = DESCRIPTIONS["formats"]
    if stats() is None:
        out["stats"] = DESCRIPTIONS["stats"]
    if hooks() is None:
        out["hooks"] = DESCRIPTIONS["hooks"]
    if telemetry_kwargs() is None:
        out["telemetry"] = DESCRIPTIONS["telemetry"]
    if not adaptive_available():
        out["adaptive"] = DESCRIPTIONS["adaptive"]
    return out
