"""lossscale.trace.Tracer: the first module whose forward output, and the first whose backward
gradient, held inf or NaN; no host sync while training; hooks removed cleanly."""

import copy
import gc
import io
import math
import pickle
import threading

import pytest
import torch
from _models import five_layer_mlp
from _sync import count_host_syncs

import lossscale
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
    tracer.close()  # idempotent
    lossscale.GradScaler(model=model, trace=True).close()  # the model can be traced again
    assert pickle.loads(blob).names == tracer.names
    with pytest.raises(ValueError, match="nn.Module"):
        Tracer(42)


# ------------------------------------------------------------------ a part of the model (issue 19)
def _held(obj, seen=None) -> int:
    """The tensors a tracer holds (through its containers and lossscale objects, not through weakrefs)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(_held(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_held(v, seen) for v in obj)
    if type(obj).__module__.startswith("lossscale") and hasattr(obj, "__dict__"):
        return _held(vars(obj), seen)
    return 0


def _inf_at(model, layer):
    """Make ``model[layer]``'s output hold an inf (registered first, so the tracer sees it)."""
    return model[layer].register_forward_hook(
        lambda m, a, out: out.index_fill(1, torch.tensor([0]), math.inf), prepend=True
    )


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_forwards_without_grad_are_not_traced_and_hold_nothing(mode):
    # Evaluation and generation run under no_grad / inference_mode: their values are never
    # backpropagated, so a NaN there says nothing about the next training step.
    model = mlp()
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with Tracer(model) as tracer:
        with context():
            for i in range(2000):
                x = torch.randn(4, 6)
                x[0, 0] = math.nan if i == 5 else x[0, 0]
                model(x)
        assert _held(tracer) == 0  # was 6,000 (3 hooked layers x 2,000 forwards)
        first = run(model, tracer, torch.randn(4, 6))
    assert first == {"forward": None, "backward": None}


def test_an_eval_mode_forward_with_grad_is_traced():
    # eval() with grad on is training too (frozen batch norm, no dropout): it counts.
    model = mlp().eval()
    _inf_at(model, 2)
    with Tracer(model) as tracer:
        assert run(model, tracer, torch.randn(4, 6))["forward"] == "2"


def test_forwards_never_handed_to_a_scaler_hold_a_bounded_number_of_tensors():
    # 1,500 forwards with grad on and no end_forward (say, a metric computed outside no_grad): the
    # checks fold as they go, and the first non-finite one is still found among them.
    model = mlp()
    most = 0
    with Tracer(model) as tracer:
        for i in range(1500):
            handle = _inf_at(model, 4) if i == 900 else None
            model(torch.randn(4, 6))
            if handle is not None:
                handle.remove()
            if i % 25 == 0 or i > 1350:
                most = max(most, _held(tracer))
        assert most <= 1024 + 2  # trace.FOLD_AT pending and one folded record (was 4,500 at the end)
        assert tracer.names_of(tracer.snapshot())["forward"] == "4"
        assert _held(tracer) == 0


def test_hooks_on_two_threads_keep_each_value_with_its_module():
    # A model split over two devices runs its hooks on two threads. Here the second thread's hook
    # runs entirely while the first is inside add(): its NaN must still be charged to module 1.
    from lossscale.trace import _Pass

    checks = _Pass()

    class Interrupted(list):
        def __iter__(self):
            other = threading.Thread(target=checks.add, args=(1, [torch.tensor(math.nan)]))
            other.start()
            other.join(timeout=5)
            return super().__iter__()

    checks.add(0, Interrupted([torch.tensor(0.0)]))
    [(indices, first, found)] = checks.take()
    assert bool(found) and indices[int(first)] == 1


def _traced_pair():
    model = mlp()
    return model, lossscale.GradScaler(model=model, trace=True)


def _report(model, scaler, inf_layer=None):
    """One training step; an inf in ``model[inf_layer]``'s output if given. The report's forward."""
    handle = None if inf_layer is None else _inf_at(model, inf_layer)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler.scale(model(torch.randn(4, 6)).square().mean()).backward()
    scaler.step(opt)
    scaler.update()
    if handle is not None:
        handle.remove()
    return scaler.overflow_report()["forward"]


def _hooked(model) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("order", ["model first", "scaler first"])
def test_a_deep_copy_of_model_and_scaler_traces_in_the_copy(order):
    model, scaler = _traced_pair()
    if order == "model first":
        twin_model, twin_scaler = copy.deepcopy((model, scaler))
    else:
        twin_scaler, twin_model = copy.deepcopy((scaler, model))
    assert _report(twin_model, twin_scaler, inf_layer=2) == "2"  # was None: the copy's hooks fed the original
    assert _report(model, scaler) is None and not scaler.last_step_skipped  # the original saw nothing
    assert _report(model, scaler, inf_layer=4) == "4"  # and still traces its own model
    twin_scaler.close()
    assert not _hooked(twin_model) and _hooked(model)


def test_a_traced_model_pickles_alone_and_with_its_scaler():
    model, scaler = _traced_pair()
    restored = pickle.loads(pickle.dumps(model))  # was "Can't pickle local object ...hook"
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for alone in (restored, loaded):
        # No scaler came with it: its hooks have nobody to report to and remove themselves.
        assert torch.equal(alone(torch.ones(2, 6)), model(torch.ones(2, 6)))
        assert not _hooked(alone)
    twin_model, twin_scaler = pickle.loads(pickle.dumps((model, scaler)))
    assert _report(twin_model, twin_scaler, inf_layer=2) == "2"
    twin_scaler.close()
    assert not _hooked(twin_model)


def test_a_tracer_nobody_holds_stops_tracing():
    # A scaler dropped without close(): its hooks do not keep the tracer (and its checks) alive.
    model = mlp()
    lossscale.GradScaler(model=model, trace=True)
    gc.collect()
    # Its hooks, not yet called, pickle and copy as they are.
    restored, copied = pickle.loads(pickle.dumps(model)), copy.deepcopy(model)
    assert _hooked(model)  # copying did not change the original
    for m in (model, restored, copied):
        m(torch.randn(4, 6))
        assert not _hooked(m)


def _step_report(model, x, fp16=False):
    """One step of torch's loop with a traced scaler: (the report's forward, whether the step was skipped)."""
    scaler = lossscale.GradScaler(model=model, trace=True)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        out = model(x)
    out = out["y"] if isinstance(out, dict) else out
    scaler.scale(out.float().mean()).backward()
    scaler.step(opt)
    scaler.update()
    report = scaler.overflow_report()["forward"], scaler.last_step_skipped
    scaler.close()
    return report


def test_a_model_that_is_one_layer_is_named_by_its_type():
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    x[0, 0] = math.inf
    assert _step_report(torch.nn.Linear(6, 3), x) == ("Linear", True)


class _DictOut(torch.nn.Module):
    """A leaf whose output is a dict (as transformers' model outputs are)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(6, 6))

    def forward(self, x):
        return {"y": x @ self.weight}


class _DictModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.last = _DictOut(), torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.last(self.first(x)["y"])


def test_a_non_finite_value_in_a_dict_output_names_its_module():
    torch.manual_seed(0)
    model = _DictModel()
    with torch.no_grad():
        model.first.weight[0, 0] = math.inf
    assert _step_report(model, torch.randn(4, 6)) == ("first", True)


def test_a_finite_fp16_output_whose_sum_passes_the_fp16_range_is_no_overflow():
    # 512 values of 200 each: every one fits FP16, their sum (102400) does not; the check sums in float32.
    model = torch.nn.Linear(8, 512)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.zero_()
    assert _step_report(model, torch.full((2, 8), 25.0), fp16=True) == (None, False)


def test_an_iteration_whose_forward_no_hook_saw_is_a_plain_step():
    # The loss comes from a parameter, not through the model's forward: nothing traced, nothing named.
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    reference = copy.deepcopy(model)  # no scaler: torch's own step
    scaler = lossscale.GradScaler(model=model, trace=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference.weight.square().sum().backward()
    ref_opt.step()
    scaler.scale(model.weight.square().sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert not scaler.last_step_skipped and scaler.overflow_report()["forward"] is None
    assert torch.equal(model.weight, reference.weight)
    scaler.close()
