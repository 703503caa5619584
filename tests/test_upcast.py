"""``GradScaler(trace=True, on_forward_overflow="upcast")`` (issue 33): the scaler keeps a module in FP32
by itself once the trace names it as the first forward overflow on ``upcast_after`` skipped steps.

The evidence is a GPT-2 from a config whose first MLP down-projection overflows FP16 in the forward
(``_gpt2.overflowing_gpt2``), trained under CPU FP16 autocast with torch's AdamW, fused and not.
"""

import copy
import math
import pickle
import warnings

import pytest
import torch
from _gpt2 import overflowing_gpt2, train_fp16

import lossscale
from lossscale.fp32 import kept_modules


def _train(model, scaler, opt, steps, start=0):
    """(losses, the overflow report after each step)."""
    reports = []
    losses = train_fp16(model, scaler, opt, steps, start, after_step=lambda: reports.append(scaler.overflow_report()))
    return losses, reports


def _scaler(model, **kw):
    return lossscale.GradScaler("cpu", model=model, trace=True, on_forward_overflow="upcast", **kw)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_the_overflowing_module_is_kept_in_fp32_by_itself_and_training_becomes_finite(fused):
    model, name = overflowing_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scaler = _scaler(model)
    with pytest.warns(UserWarning, match=f"`{name}` was the first forward overflow on 2 steps"):
        losses, reports = _train(model, scaler, opt, steps=6)
    assert [math.isfinite(x) for x in losses] == [False, False, True, True, True, True]
    assert [r["forward"] for r in reports[:2]] == [name, name]
    assert reports[0]["upcast"] is None and reports[1]["upcast"] == name
    assert "now runs in FP32" in reports[1]["cause"]
    assert kept_modules(model) == [name]
    assert scaler.get_scale() == 2.0**16  # a forward overflow never backed the scale off
    counters = scaler.counters()
    assert counters["skipped_steps"] == 2 and counters["bad_loss_steps"] == 2 and counters["upcasts"] == 1
    health = scaler.health()
    assert health.upcast_modules == (name,) and health.upcasts == 1
    assert f"Kept in FP32 after repeated forward overflows (on_forward_overflow='upcast'): {name}." in health.text
    assert "health/upcast_modules" not in health.metrics() and health.metrics()["health/upcasts"] == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    scaler.close()


def test_with_upcast_after_one_it_acts_on_the_first_skip():
    model, name = overflowing_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = _scaler(model, upcast_after=1)
    with pytest.warns(UserWarning, match="on 1 steps"):
        losses, _ = _train(model, scaler, opt, steps=3)
    assert [math.isfinite(x) for x in losses] == [False, True, True]
    scaler.close()


def test_without_the_opt_in_every_step_stays_skipped():
    model, name = overflowing_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = lossscale.GradScaler("cpu", model=model, trace=True)
    losses, reports = _train(model, scaler, opt, steps=3)
    assert not any(math.isfinite(x) for x in losses) and kept_modules(model) == []
    assert reports[-1]["forward"] == name and reports[-1]["upcast"] is None
    scaler.close()


def test_the_checkpoint_keeps_the_module_in_fp32_after_a_restart():
    model, name = overflowing_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = _scaler(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(model, scaler, opt, steps=3)
    saved = scaler.state_dict()
    assert saved["upcast_modules"] == [name] and saved["upcast_seen"] == {name: 2}
    torch.amp.GradScaler("cpu").load_state_dict(saved)  # still a torch state dict
    scaler.close()

    fresh, _ = overflowing_gpt2()  # a restarted process: the model as built, nothing kept
    fresh.load_state_dict(model.state_dict())
    restarted = _scaler(fresh)
    restarted.load_state_dict(saved)
    assert kept_modules(fresh) == [name] and restarted.counters()["upcasts"] == 1
    losses, _ = _train(fresh, restarted, torch.optim.AdamW(fresh.parameters(), lr=1e-3), steps=2, start=3)
    assert all(math.isfinite(x) for x in losses)
    restarted.close()


def test_a_checkpoint_naming_a_module_the_model_lacks_is_refused_and_changes_nothing():
    model, name = overflowing_gpt2()
    scaler = _scaler(model)
    state = scaler.state_dict()
    for bad, match in (
        (dict(state, upcast_modules=["transformer.h.9.mlp"]), "transformer.h.9.mlp"),
        (dict(state, upcast_modules="x"), "upcast_modules"),
        (dict(state, upcast_modules=[name], upcast_seen={name: -1}), "upcast_seen"),
    ):
        with pytest.raises(ValueError, match=match):
            scaler.load_state_dict(bad)
    assert kept_modules(model) == [] and scaler.counters()["upcasts"] == 0
    scaler.close()


def test_a_module_kept_that_still_overflows_is_named_as_not_an_fp16_problem():
    model, name = overflowing_gpt2()
    with torch.no_grad():
        model.get_submodule(name).weight[0, 0] = math.nan  # non-finite in FP32 as well: a bug, not the range
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = _scaler(model, upcast_after=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, scaler, opt, steps=2)  # kept on the first skip, named again on the second
    texts = [str(w.message) for w in caught]
    assert any("now runs in FP32" in t for t in texts)
    again = [w for w in caught if "non-finite again: not an FP16 range problem" in str(w.message)]
    assert len(again) == 1 and again[0].category is RuntimeWarning
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        _train(model, scaler, opt, steps=2, start=2)  # named again twice more: said once is enough
    assert not [w for w in later if "non-finite again" in str(w.message)]
    scaler.close()


def test_bad_arguments_name_themselves():
    model, _ = overflowing_gpt2()
    with pytest.raises(ValueError, match="on_forward_overflow='upcast' needs trace=True"):
        lossscale.GradScaler(model=model, on_forward_overflow="upcast")
    for after in (True, 2.0):
        with pytest.raises(ValueError, match=f"upcast_after={after!r} must be an int >= 1"):
            lossscale.GradScaler(model=model, trace=True, on_forward_overflow="upcast", upcast_after=after)
    with pytest.raises(ValueError, match="on_forward_overflow='fp32'"):
        lossscale.GradScaler(model=model, trace=True, on_forward_overflow="fp32")
    with pytest.raises(ValueError, match="upcast_after=0"):
        lossscale.GradScaler(model=model, trace=True, on_forward_overflow="upcast", upcast_after=0)
    with pytest.raises(ValueError, match="applies only with"):
        lossscale.GradScaler(upcast_after=3)


def test_a_copy_keeps_the_account():
    model, name = overflowing_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = _scaler(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(model, scaler, opt, steps=2)
    for twin in (copy.deepcopy(scaler), pickle.loads(pickle.dumps(scaler))):
        assert twin.counters()["upcasts"] == 1 and twin.health().upcast_modules == (name,)
    scaler.close()


def test_the_backward_rule_alone_keeps_nothing_for_a_forward_overflow():
    model, name = overflowing_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = lossscale.GradScaler("cpu", model=model, trace=True, on_backward_overflow="upcast", upcast_after=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, reports = _train(model, scaler, opt, steps=2)
    assert [r["forward"] for r in reports] == [name, name]  # named, and skipped, but not kept
    assert kept_modules(model) == [] and scaler.counters()["upcasts"] == 0
    scaler.close()
