"""No float64 tensor in an iteration: devices without float64 (Apple MPS, Intel Arc) run the scaler.

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` records the dtype of every tensor each
operator takes or returns during ``scale(loss).backward()``, ``unscale_``/``clip_grad_norm_``,
``step`` and ``update``, at the defaults and with each feature on, on SGD, AdamW foreach and AdamW
fused, with and without clipping. The model's own work is float32/float16, so a float64 seen is the
scaler's.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import lossscale


class RecordDtypes(TorchDispatchMode):
    """Every operator whose inputs or outputs hold a float64 tensor: ``[(operator name, where), ...]``."""

    def __init__(self):
        super().__init__()
        self.float64 = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for where, tree in (("in", (args, kwargs)), ("out", out)):
            if any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in tree_leaves(tree)):
                self.float64.append((str(func), where))
        # a dtype= keyword (torch.tensor(..., dtype=float64), zeros, full) creates float64 too
        if kwargs.get("dtype") is torch.float64:
            self.float64.append((str(func), "dtype="))
        return out


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
}

#: Scaler configurations: the defaults, torch's, and each feature on.
CONFIGS = {
    "defaults": {},
    "as_torch": dict(loss_check=False, min_scale=None, max_scale=None),
    "telemetry": dict(telemetry=dict(every=1)),
    "trace": dict(trace=True, model=True),
    "skip_if": dict(skip_if=dict(grad_norm_above=1e6)),
    "bad_microbatch_drop": dict(bad_microbatch="drop"),
    "allow_fp16": dict(allow_fp16=True),
    "upcast": dict(on_forward_overflow="upcast", trace=True, model=True),
    "backward_upcast": dict(on_backward_overflow="upcast", trace=True, model=True),
    "hysteresis": dict(hysteresis=2),
    "static": dict(policy="static"),
    "adaptive": dict(policy="adaptive"),
    "logmax": dict(policy="logmax"),
}


def _float64_in_iterations(optimizer: str, config: dict, clip: str, steps: int = 6, overflow_at=(2,)):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = OPTIMIZERS[optimizer](model.parameters())
    config = dict(config)
    if config.pop("model", False):
        config["model"] = model
    scaler = lossscale.GradScaler(init_scale=2.0**10, **config)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    seen = []
    for i in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        with RecordDtypes() as rec:
            scaled = scaler.scale(loss)
            if i in overflow_at:
                scaled = scaled * float("inf")  # an overflowing backward: the step is skipped
            scaled.backward()
            if clip == "torch":
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            elif clip == "scaler":
                scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()
        seen += [(i, *op) for op in rec.float64]
    return seen


#: Configurations that still compute in float64, each for a reason of its own (not yet moved to float32):
#: strict, so the day one is fixed the mark must go.
STILL_FLOAT64 = {
    "skip_if": "the spike window's mean and std are float64 (spikes.py), as its pure-Python reference is",
    "adaptive": "the scale's move is a float64 multiply by exact_pow2 (a move may pass float32's range)",
    "logmax": "the policy's state is the source's float64 TF variables (logmax.py), bitwise with them",
}


@pytest.mark.parametrize("clip", ["none", "torch", "scaler"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize(
    "config",
    [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=STILL_FLOAT64[c])) if c in STILL_FLOAT64 else c
        for c in sorted(CONFIGS)
    ],
)
def test_no_float64_tensor_in_an_iteration(config, optimizer, clip):
    assert _float64_in_iterations(optimizer, CONFIGS[config], clip) == []


def test_the_recorder_sees_float64():
    """The instrument itself: a float64 operation is recorded (so an empty record means none ran)."""
    with RecordDtypes() as rec:
        torch.ones(2).double().sum()
        torch.zeros(1, dtype=torch.float64)
    assert len(rec.float64) >= 3
