"""Skip-aware EMAs of the ``update(model)`` kind: timm's ``ModelEmaV2``/``ModelEmaV3`` (the real
timm) and a class of ultralytics' ``ModelEMA`` shape. ``skip_aware(ema, scaler)`` is bitwise the
same EMA updated only on the steps ``scaler.last_step_skipped`` reports as taken, and syncs nowhere
with fused optimizers, except for an EMA that counts its updates on the host.

timm's wheel depends on torchvision, and ``import timm`` imports it (timm/layers); PyPI's
torchvision is a CUDA build that does not load with the CPU torch. ``timm/utils/model_ema.py``
itself needs only torch, so the tests load that file of the installed timm (installed with
``pip install --no-deps``) and skip when timm is not installed.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import pathlib
import pickle
import sys

import pytest
import torch
from _sync import count_host_syncs

import lossscale
from lossscale.schedulers import is_skip_aware, skip_aware

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 8
FAULTS = {1: "inf_grad", 3: "nan_grad", 4: "inf_grad", 6: "nan_loss"}
OPTIMIZERS = {
    "sgd_foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
}


def _timm_model_ema():
    """timm's own ``utils/model_ema.py``, loaded from the installed timm without running
    ``timm/__init__.py`` (which imports torchvision)."""
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "utils" / "model_ema.py"
    module_spec = importlib.util.spec_from_file_location("timm_utils_model_ema", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # pickle finds its classes by module name
    module_spec.loader.exec_module(module)
    return module


TIMM = _timm_model_ema()
needs_timm = pytest.mark.skipif(
    TIMM is None,
    reason="timm is not installed: pip install -c constraints.txt --no-deps "
    "timm (its wheel requires torchvision, whose PyPI build is CUDA)",
)


class UltralyticsShapedEMA:
    """The shape of ultralytics' ``ModelEMA`` (ultralytics/utils/torch_utils.py): a plain object
    holding the averaged module as ``ema``, a host counter ``updates`` and a decay that reads it."""

    def __init__(self, model, decay=0.9999, tau=2000, updates=0):
        self.ema = copy.deepcopy(model).eval()
        self.updates = updates
        self.decay = lambda x: decay * (1 - math.exp(-x / tau))
        for p in self.ema.parameters():
            p.requires_grad_(False)
        self.enabled = True

    def update(self, model):
        if self.enabled:
            self.updates += 1
            d = self.decay(self.updates)
            msd = model.state_dict()
            for k, v in self.ema.state_dict().items():
                if v.dtype.is_floating_point:
                    v *= d
                    v += (1 - d) * msd[k].detach()


EMAS = {
    "timm_v2": lambda m: TIMM.ModelEmaV2(m, decay=0.9),
    "timm_v3": lambda m: TIMM.ModelEmaV3(m, decay=0.9, use_warmup=True),
    "timm_v3_loop": lambda m: TIMM.ModelEmaV3(m, decay=0.9, foreach=False),
    "ultralytics": lambda m: UltralyticsShapedEMA(m, decay=0.9, tau=4),
}


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def forward_backward(model, scaler, step):
    g = torch.Generator().manual_seed(step)
    loss = model(torch.randn(6, 4, generator=g)).square().mean()
    fault = FAULTS.get(step)
    if fault == "nan_loss":
        loss = loss * math.nan
    scaler.scale(loss).backward()
    if fault in ("inf_grad", "nan_grad"):
        model[0].weight.grad[0, 0] = math.inf if fault == "inf_grad" else math.nan


def ema_state(ema):
    module = ema if isinstance(ema, torch.nn.Module) else ema.ema
    return module.state_dict(), getattr(ema, "updates", None)


def equal(a, b) -> bool:
    (sa, ua), (sb, ub) = ema_state(a), ema_state(b)
    return ua == ub and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def update(ema, model, kind, step):
    if kind.startswith("timm_v3"):
        return ema.update(model, step=step)
    return ema.update(model)


def train(opt_kind, ema_kind):
    model = net()
    opt = OPTIMIZERS[opt_kind](model.parameters())
    scaler = lossscale.GradScaler("cpu", init_scale=2.0**10)
    ours = skip_aware(EMAS[ema_kind](model), scaler)
    ref = EMAS[ema_kind](model)
    taken, skipped, same, syncs = 0, [], [], []
    for step in range(STEPS):
        opt.zero_grad()
        forward_backward(model, scaler, step)
        scaler.step(opt)
        with count_host_syncs() as counter:
            update(ours, model, ema_kind, taken)  # a framework's loop: every step, its own step count
        syncs.append(counter.count)
        scaler.update()
        skipped.append(scaler.last_step_skipped)
        if not skipped[-1]:
            update(ref, model, ema_kind, taken)
            taken += 1
        same.append(equal(ours, ref))
    return dict(skipped=skipped, same=same, syncs=syncs, ours=ours, ref=ref)


def _params(kinds):
    return [pytest.param(k, marks=needs_timm) if k.startswith("timm") else k for k in kinds]


@pytest.mark.parametrize("ema_kind", _params(sorted(EMAS)))
@pytest.mark.parametrize("opt_kind", sorted(OPTIMIZERS))
def test_bitwise_an_ema_updated_only_on_taken_steps(opt_kind, ema_kind):
    run = train(opt_kind, ema_kind)
    assert run["skipped"] == [s in FAULTS for s in range(STEPS)]
    assert all(run["same"]), run["same"]
    assert is_skip_aware(run["ours"]) and isinstance(run["ours"], type(run["ref"]))
    if opt_kind == "adam_fused":
        if ema_kind == "ultralytics":  # its decay reads `updates` on the host: one sync per update
            assert run["syncs"] == [1] * STEPS
        else:  # gated on the device flag
            assert run["syncs"] == [0] * STEPS
    else:
        assert run["syncs"] == [0] * STEPS  # the host decided the step


@needs_timm
def test_timm_ema_state_dict_pickle_and_deepcopy_stay_plain_and_skip_aware():
    model = net()
    scaler = lossscale.GradScaler("cpu")
    ema = skip_aware(TIMM.ModelEmaV3(model, decay=0.9), scaler)
    plain = TIMM.ModelEmaV3(model, decay=0.9)
    plain.load_state_dict(ema.state_dict())  # the plain object's keys
    for twin in (copy.deepcopy(ema), pickle.loads(pickle.dumps(ema))):
        assert is_skip_aware(twin) and isinstance(twin, TIMM.ModelEmaV3)


def test_an_object_with_neither_step_nor_update_is_refused():
    with pytest.raises(ValueError, match="no step\\(\\) or update\\(model\\)"):
        skip_aware(object(), lossscale.GradScaler("cpu"))
