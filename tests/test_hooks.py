"""Activation-gradient recorder and FP32 probe: exact figures, no trace left, .grad untouched."""

import pytest
import torch

# The first watched layer's input needs no grad, so torch warns that its hook sees outputs only:
# the grad_output the recorder wants.
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")

from lossscale.hooks import ActivationGradRecorder, activation_grad_probe, default_modules
from _models import batch, tiny_mlp


def _loss(out, y):
    return torch.nn.functional.cross_entropy(out, y)


def _hook_count(model):
    return sum(len(m._backward_hooks) + len(m._backward_pre_hooks) for m in model.modules())


def test_recorder_records_per_module_and_leaves_no_trace():
    model = tiny_mlp()
    before = _hook_count(model)
    with ActivationGradRecorder(model, every=2) as rec:
        assert _hook_count(model) > before
        for step in range(4):
            x, y = batch(step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = _loss(model(x), y)
            (loss * 1024).backward()
            rec.step()
    assert _hook_count(model) == before
    assert set(rec.latest) == set(default_modules(model)) == {"0", "2"}
    assert [h["step"] for h in rec.history] == [0, 0, 2, 2]
    assert all(h["measured_dtype"] == "float16" for h in rec.history)
    assert rec.latest["2"].numel == 8 * 4


def test_recorder_removes_hooks_on_exception():
    model = tiny_mlp()
    before = _hook_count(model)
    with pytest.raises(ZeroDivisionError):
        with ActivationGradRecorder(model):
            1 / 0
    assert _hook_count(model) == before


def test_probe_matches_direct_cast_and_leaves_grad_untouched():
    model = tiny_mlp()
    x, y = batch(0)
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    scale = 2.0**-8  # push gradients toward the cliff so some flush
    got = activation_grad_probe(model, _loss, x, y, scale=scale)
    assert all(p.grad is None for p in model.parameters())
    # Direct reference: the same exact FP32 activation gradients, cast to fp16 at the scale.
    captured = {}
    hs = [model[i].register_full_backward_hook(lambda m, gi, go, i=i: captured.__setitem__(str(i), go[0]))
          for i in (0, 2)]
    _loss(model(x), y).backward()
    for h in hs:
        h.remove()
    for name, g in captured.items():
        g64 = g.double() * scale
        flushed = int(((g64.to(torch.float16) == 0) & (g != 0)).sum())
        assert got[name].flushed == flushed
        assert got[name].numel == g.numel()


def test_bad_arguments():
    model = tiny_mlp()
    with pytest.raises(ValueError, match="every"):
        ActivationGradRecorder(model, every=0)
    with pytest.raises(ValueError, match="nope"):
        ActivationGradRecorder(model, modules=["nope"])


@pytest.mark.parametrize("args, kwargs, match", [
    ((), dict(fmt="fp17"), r"fmt='fp17'.*fp16"),
    ((), dict(fmt=None), r"fmt=None"),
])
def test_bad_format_fails_at_construction(args, kwargs, match):
    """Issue 12, bug 5: fmt="fp17" was accepted and failed only inside the hooked backward."""
    model = tiny_mlp()
    with pytest.raises(ValueError, match=match):
        ActivationGradRecorder(model, *args, **kwargs)
    x, y = batch(0)
    with pytest.raises(ValueError, match=match):
        activation_grad_probe(model, _loss, x, y, **kwargs)
    assert all(p.grad is None for p in model.parameters())  # refused before any backward


@pytest.mark.parametrize("model", [42, None, [torch.nn.Linear(2, 2)]], ids=["int", "None", "list"])
def test_a_model_that_is_not_a_module_fails_at_construction(model):
    """Issue 12, bug 5: ``ActivationGradRecorder(42)`` raised AttributeError deep in module selection."""
    with pytest.raises(ValueError, match=r"model=.* must be a torch.nn.Module"):
        ActivationGradRecorder(model)
    with pytest.raises(ValueError, match=r"model=.* must be a torch.nn.Module"):
        activation_grad_probe(model, _loss, torch.ones(1, 8))
