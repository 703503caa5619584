"""lossscale: safe, observable, fast FP16 loss scaling for PyTorch.

``lossscale.GradScaler`` is a drop-in for ``torch.amp.GradScaler`` (bitwise identical where configured
the same) built on pure, framework-free scale policies (``lossscale.policy`` and one module per
policy), with gradient telemetry (``grad_stats``, ``ActivationGradRecorder``) that shows the underflow
other scalers ignore.

Importing lossscale imports the policies and ``formats`` only, which need no torch: the torch-facing
names (``GradScaler``, ``grad_stats``, ...) load on first use. It never imports matplotlib.
"""

from __future__ import annotations

import importlib

from . import formats
from .adaptive import AdaptivePolicy, AdaptiveState
from .diagnosis import diagnose
from .dynamic import DynamicPolicy, DynamicState
from .health import HealthReport
from .logmax import LogMaxPolicy, LogMaxState
from .policy import Policy, ScaleState, is_power_of_two
from .static import StaticPolicy, StaticState

__version__ = "0.1.0"

# Names that need torch, and the module each lives in: imported on first access (PEP 562).
_LAZY = {
    "GradScaler": "scaler",
    "ShardedGradScaler": "sharded",
    "SkipIf": "spikes",
    "OptState": "scaler",
    "grad_stats": "stats",
    "GradStats": "stats",
    "recommend_scale": "stats",
    "ActivationGradRecorder": "hooks",
    "activation_grad_probe": "hooks",
    "Telemetry": "telemetry",
    "JsonlLogger": "telemetry",
    "audit": "auditing",
    "AuditReport": "auditing",
    "keep_fp32": "fp32",
    "check_setup": "setup_check",
    "rescale": "rescaling",
    "Rescaling": "rescaling",
    "choose_rescale": "rescaling",
}

__all__ = [
    "GradScaler",
    "ShardedGradScaler",
    "SkipIf",
    "OptState",
    "Policy",
    "DynamicPolicy",
    "DynamicState",
    "StaticPolicy",
    "StaticState",
    "AdaptivePolicy",
    "AdaptiveState",
    "LogMaxPolicy",
    "LogMaxState",
    "ScaleState",
    "diagnose",
    "HealthReport",
    "is_power_of_two",
    "formats",
    "grad_stats",
    "GradStats",
    "recommend_scale",
    "ActivationGradRecorder",
    "activation_grad_probe",
    "Telemetry",
    "JsonlLogger",
    "audit",
    "AuditReport",
    "keep_fp32",
    "check_setup",
    "rescale",
    "Rescaling",
    "choose_rescale",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lossscale' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
