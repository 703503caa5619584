"""lossscale: safe, observable, fast FP16 loss scaling for PyTorch.

``lossscale.GradScaler`` is a drop-in for ``torch.amp.GradScaler`` (bitwise identical where configured
the same) built on a pure, framework-free scale policy (``lossscale.policy``).
Importing lossscale never imports matplotlib.
"""

from .policy import DynamicPolicy, ScaleState, StaticPolicy, diagnose, is_power_of_two
from .scaler import GradScaler, OptState

__version__ = "0.1.0"

__all__ = [
    "GradScaler",
    "OptState",
    "DynamicPolicy",
    "StaticPolicy",
    "ScaleState",
    "diagnose",
    "is_power_of_two",
]
