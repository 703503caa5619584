"""One-time hints: a default (scaling) GradScaler used for bf16 points to GradScaler.passthrough()."""

import copy
import os
import warnings

import pytest
import torch
from _models import batch, tiny_mlp

import lossscale
from lossscale import _hints
from lossscale.diagnosis import NO_FP16_STEPS

HINT = "bf16 has fp32's exponent range"


@pytest.fixture(autouse=True)
def fresh_hint(monkeypatch):
    monkeypatch.setattr(_hints, "_warned_bf16", False)


def _scale(scaler, dtype, inside_autocast):
    model = tiny_mlp()
    x, y = batch(0)
    with torch.autocast("cpu", dtype=dtype):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if inside_autocast:
            return scaler.scale(loss)
    return scaler.scale(loss)


def _hints_of(record):
    return [w for w in record if HINT in str(w.message)]


def test_a_bf16_loss_with_a_default_scaler_warns_once_naming_passthrough():
    """Issue 21: bf16 with a default GradScaler() silently scaled by 65536, with no word of passthrough()."""
    scaler = lossscale.GradScaler("cpu")
    loss = torch.ones((), dtype=torch.bfloat16, requires_grad=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        scaler.scale(loss)
        scaler.scale(loss)
        lossscale.GradScaler("cpu").scale(loss)
    hints = _hints_of(record)
    assert len(hints) == 1, [str(w.message) for w in record]
    text = str(hints[0].message)
    assert "the loss is bf16" in text and "GradScaler.passthrough()" in text and "2^16" in text
    assert hints[0].filename == __file__  # points at the user's scale() call


def test_scaling_under_bf16_autocast_warns():
    with pytest.warns(UserWarning, match="bf16 autocast is active.*passthrough"):
        _scale(lossscale.GradScaler("cpu"), torch.bfloat16, inside_autocast=True)


@pytest.mark.parametrize("case", ["fp16_autocast", "passthrough", "disabled", "fp32_loss_after_bf16_block"])
def test_no_hint_where_the_scaler_is_right_or_cannot_tell(case):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        if case == "fp16_autocast":
            _scale(lossscale.GradScaler("cpu"), torch.float16, inside_autocast=True)
        elif case == "passthrough":
            _scale(lossscale.GradScaler.passthrough("cpu"), torch.bfloat16, inside_autocast=True)
        elif case == "disabled":
            _scale(lossscale.GradScaler("cpu", enabled=False), torch.bfloat16, inside_autocast=True)
        else:  # the known blind spot: a float32 loss scaled after the autocast block has closed
            _scale(lossscale.GradScaler("cpu"), torch.bfloat16, inside_autocast=False)
    assert _hints_of(record) == []
    assert _hints._warned_bf16 is False


def test_nested_outputs_are_looked_into():
    loss = torch.ones((), dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="the loss is bf16"):
        lossscale.GradScaler("cpu").scale({"a": [loss]})


# ------------------------------------------------------------------ no FP16 work seen
NO_FP16_HINT = "saw no FP16 work"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _no_fp16_hints(record):
    return [w for w in record if NO_FP16_HINT in str(w.message)]


def test_the_readme_loop_pasted_on_cpu_warns_once_that_it_does_not_train_in_fp16():
    """The README's loop with its torch.autocast("cuda") on a CPU model: autocast is off, the run trains in
    FP32 while the scaler scales. After NO_FP16_STEPS iterations it says so, once, at the user's line."""
    from test_docs import _blocks, _read

    diff = _blocks(_read("README.md"), "diff")[0].splitlines()
    new_side = "\n".join(line[1:] for line in diff if not line.startswith("-"))
    assert 'torch.autocast("cuda", dtype=torch.float16)' in new_side
    model = tiny_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    said_before = []  # the hints said before each batch

    def loader():
        for step in range(NO_FP16_STEPS + 5):
            said_before.append(len(_no_fp16_hints(record)))
            yield batch(step)

    namespace = dict(
        model=model,
        optimizer=optimizer,
        loss_fn=torch.nn.functional.cross_entropy,
        lr_scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1),
        loader=loader(),
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        exec(compile(new_side, "README.md", "exec"), namespace)
    hints = _no_fp16_hints(record)
    assert len(hints) == 1, [str(w.message) for w in record]
    assert said_before[NO_FP16_STEPS - 1] == 0 and said_before[NO_FP16_STEPS] == 1  # at the 100th scale()
    assert hints[0].filename == "README.md" and hints[0].category is UserWarning  # the user's scale() line
    text = str(hints[0].message)
    assert f"in its first {NO_FP16_STEPS} steps" in text
    assert "torch.autocast(device_type=x.device.type, dtype=torch.float16)" in text and "model.half()" in text
    assert "GradScaler(enabled=False)" in text and "GradScaler.passthrough()" in text
    with open(os.path.join(ROOT, "docs", "troubleshooting.md"), encoding="utf-8") as fh:
        quoted = fh.read().split('## lossscale: "this GradScaler saw no FP16 work"', 1)[1].split("`")[1]
    assert quoted == f"UserWarning: {text[: len(quoted) - len('UserWarning: ')]}"  # the docs quote its start
    report = namespace["scaler"].health()
    assert report.no_fp16 and report.metrics()["health/no_fp16"] is True
    assert "Not FP16: in its first 100 steps this GradScaler saw no FP16 work" in report.text
    assert "What to do: for FP16, autocast's device type must be the model's" in report.text


def _run(scaler, steps, forward, model=None, opt=None):
    model = model or tiny_mlp()
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        scaler.scale(forward(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
    return scaler


def _fp16_autocast(model, x, y):
    with torch.autocast("cpu", dtype=torch.float16):
        return torch.nn.functional.cross_entropy(model(x), y)  # float32 parameters, gradients and loss


def _half_model(model, x, y):
    return torch.nn.functional.cross_entropy(model.half()(x.half()).float(), y)  # an FP32 loss


def _fp32(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def _bf16_autocast(model, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return torch.nn.functional.cross_entropy(model(x), y)


def _scaled_inside_autocast(steps):
    """The loss scaled inside the FP16 autocast block, as some loops do."""
    model, scaler = tiny_mlp(), lossscale.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            scaled = scaler.scale(torch.nn.functional.cross_entropy(model(x), y))
        scaled.backward()
        scaler.step(opt)
        scaler.update()
    return scaler


@pytest.mark.parametrize("case", ["autocast", "half", "scaled_inside_autocast"])
def test_an_fp16_run_never_says_it_is_not_fp16(case):
    """FP32 parameters under FP16 autocast (FP32 gradients and loss), model.half() with an FP32 loss, and
    a loss scaled inside the autocast block: FP16 runs, never told otherwise."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        if case == "scaled_inside_autocast":
            scaler = _scaled_inside_autocast(NO_FP16_STEPS + 1)
        else:
            forward = _fp16_autocast if case == "autocast" else _half_model
            scaler = _run(lossscale.GradScaler("cpu", allow_fp16=True), NO_FP16_STEPS + 1, forward)
    assert _no_fp16_hints(record) == []
    assert not scaler.health().no_fp16 and "Not FP16" not in scaler.health().text


def test_a_compiled_fp16_forward_the_graph_cannot_show_is_not_called_fp32():
    """torch.compile keeps the FP16 inside its region (one opaque backward node): no false alarm."""
    model = tiny_mlp()

    @torch.compile(backend="aot_eager")
    def compiled_loss(x, y):
        with torch.autocast("cpu", dtype=torch.float16):
            return torch.nn.functional.cross_entropy(model(x).float(), y)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        scaler = _run(lossscale.GradScaler("cpu"), NO_FP16_STEPS + 1, lambda m, x, y: compiled_loss(x, y), model)
    assert _no_fp16_hints(record) == [] and not scaler.health().no_fp16
    assert not scaler._fp16_watch.watching  # and it stopped looking: a compiled run pays its first steps only


@pytest.mark.parametrize("forward", [_fp32, _bf16_autocast], ids=["fp32", "bf16_closed_before_scale"])
def test_an_fp32_or_bf16_run_is_told_and_passthrough_is_not(forward):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        scaler = _run(lossscale.GradScaler("cpu"), NO_FP16_STEPS, forward)
        quiet = _run(lossscale.GradScaler.passthrough("cpu"), NO_FP16_STEPS, forward)
    assert len(_no_fp16_hints(record)) == 1 and scaler.health().no_fp16
    assert not quiet.health().no_fp16
    # Once said, it is not said again, and copies keep knowing it.
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _run(scaler, 3, forward)
    assert _no_fp16_hints(record) == [] and copy.deepcopy(scaler).health().no_fp16
