"""lossscale: safe, observable, fast FP16 loss scaling for PyTorch.

``lossscale.GradScaler`` is a drop-in for ``torch.amp.GradScaler`` (bitwise identical where configured
the same) built on a pure, framework-free scale policy (``lossscale.policy``), with gradient telemetry
(``grad_stats``, ``ActivationGradRecorder``) that shows the underflow other scalers ignore.
Importing lossscale never imports matplotlib.
"""

from . import formats
from .adaptive import AdaptivePolicy
from .hooks import ActivationGradRecorder, activation_grad_probe
from .policy import DynamicPolicy, ScaleState, StaticPolicy, diagnose, is_power_of_two
from .scaler import GradScaler, OptState
from .stats import GradStats, grad_stats, recommend_scale
from .telemetry import JsonlLogger, Telemetry

__version__ = "0.1.0"

__all__ = [
    "GradScaler",
    "OptState",
    "DynamicPolicy",
    "StaticPolicy",
    "AdaptivePolicy",
    "ScaleState",
    "diagnose",
    "is_power_of_two",
    "formats",
    "grad_stats",
    "GradStats",
    "recommend_scale",
    "ActivationGradRecorder",
    "activation_grad_probe",
    "Telemetry",
    "JsonlLogger",
]
