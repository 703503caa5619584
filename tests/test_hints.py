"""One-time hints: a default (scaling) GradScaler used for bf16 points to GradScaler.passthrough()."""

import warnings

import pytest
import torch
from _models import batch, tiny_mlp

import lossscale
from lossscale import _hints

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
