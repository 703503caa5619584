"""lossscale.trace.Tracer: the first module whose forward output, and the first whose backward
gradient, held inf or NaN; no host sync while training; hooks removed cleanly."""

import math
import pickle

import pytest
import torch

from _models import five_layer_mlp
from lossscale._sync import count_host_syncs
from lossscale.trace import Tracer


def mlp():
    return five_layer_mlp(inplace_relu=True)  # an in-place module must not break the input hooks


def run(model, tracer, x, scale=1.0):
    out = model(x)
    tracer.end_forward()
    (out.float().sum() * scale).backward()
    tracer.end_backward()
    return tracer.names_of(tracer.snapshot())


@pytest.mark.parametrize("layer", [0, 2, 4])
def test_an_inf_in_a_forward_output_names_that_layer(layer):
    model = mlp()
    # Registered before the tracer's hooks, so the tracer sees the output it produced.
    model[layer].register_forward_hook(lambda m, a, out: out.index_fill(1, torch.tensor([0]), math.inf))
    with Tracer(model) as tracer:
        first = run(model, tracer, torch.randn(4, 6))
    assert first["forward"] == str(layer)


def test_a_nan_weight_names_its_layer_forward_and_backward():
    model = mlp()
    with torch.no_grad():
        model[2].weight[0, 0] = math.nan
    with Tracer(model) as tracer:
        first = run(model, tracer, torch.randn(4, 6))
    # The forward names the source. In backward order Tanh's input gradient is NaN first (tanh' of a
    # NaN activation), but Tanh cannot originate one (tracer.PASS_THROUGH, not hooked): layer 2's is next.
    assert first == {"forward": "2", "backward": "2"}


def test_a_backward_overflow_names_the_layer_whose_gradient_overflowed():
    # fp16 backward: only layer 2's weights are large, so its input gradient (W^T g, in fp16 under
    # autocast) is the first to overflow at this scale; the forward stays finite.
    model = mlp()
    with torch.no_grad():
        model[0].bias.zero_()
        model[2].bias.zero_()
        model[2].weight.mul_(1e3)
    x = torch.randn(4, 6) * 1e-4  # layer 2's output stays small: tanh does not saturate
    with Tracer(model) as tracer, torch.autocast("cpu", dtype=torch.float16):
        first = run(model, tracer, x, scale=2.0**12)
    assert first == {"forward": None, "backward": "2"}


def test_a_clean_iteration_names_nothing_and_makes_no_host_sync():
    model = mlp()
    with Tracer(model) as tracer:
        with count_host_syncs() as syncs:
            out = model(torch.randn(4, 6))
            tracer.end_forward()
            out.sum().backward()
            tracer.end_backward()
            snap = tracer.snapshot()
        assert syncs.count == 0, syncs.ops
        assert tracer.names_of(snap) == {"forward": None, "backward": None}


def test_hooks_are_removed_and_a_tracer_pickles():
    model = mlp()
    tracer = Tracer(model)
    assert any(m._forward_hooks for m in model.modules())
    blob = pickle.dumps(tracer)
    tracer.close()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert pickle.loads(blob).names == tracer.names
    with pytest.raises(ValueError, match="nn.Module"):
        Tracer(42)
