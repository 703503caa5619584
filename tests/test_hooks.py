"""Activation-gradient recorder and FP32 probe: exact figures, no trace left, .grad untouched."""

import json
import math
import warnings

import pytest
import torch
from _models import batch, five_layer_mlp, tiny_mlp

import lossscale
from lossscale.hooks import ActivationGradRecorder, activation_grad_probe, activation_metrics, default_modules
from lossscale.report import schema


def _loss(out, y):
    return torch.nn.functional.cross_entropy(out, y)


def _output_grads(model, x, y):
    """The reference: each default module's output gradient in a plain FP32 backward, by tensor hooks."""
    captured = {}

    def keep(name):
        def hook(module, args, out):
            out.register_hook(lambda g: captured.__setitem__(name, g))

        return hook

    hs = [m.register_forward_hook(keep(n)) for n, m in default_modules(model).items()]
    _loss(model(x), y).backward()
    for h in hs:
        h.remove()
    model.zero_grad(set_to_none=True)
    return captured


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._backward_hooks) + len(m._backward_pre_hooks) for m in model.modules())


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
            1 / 0  # noqa: B018  raises inside the recorder on purpose
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
    captured = _output_grads(model, x, y)
    assert set(captured) == {"0", "2"}
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


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((), dict(fmt="fp17"), r"fmt='fp17'.*fp16"),
        ((), dict(fmt=None), r"fmt=None"),
    ],
)
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


def _train(model, rec, steps=4, log=None, scaler=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = scaler or lossscale.GradScaler("cpu", init_scale=2.0**10)
    for step in range(steps):
        x, y = batch(step, d_in=model[0].in_features, d_out=model[-1].out_features)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(model(x), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if log is not None:
            log.log(step, {**scaler.metrics(), **rec.metrics()})
        rec.step()


def test_recorder_does_not_warn_when_the_inputs_need_no_grad():
    """Issue 21: torch's "Full backward hook is firing ..." warning on the first layer (its input needs no grad)."""
    model = tiny_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ActivationGradRecorder(model) as rec:
            _train(model, rec, steps=2)
        activation_grad_probe(model, _loss, *batch(0))
    assert set(rec.latest) == {"0", "2"}


def test_recorder_and_probe_work_with_an_inplace_op_after_a_watched_module():
    """A full backward hook made ``ReLU(inplace=True)`` after a watched Linear fail in the forward."""
    model = five_layer_mlp(inplace_relu=True)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    captured = _output_grads(model, x, y)
    with ActivationGradRecorder(model) as rec:
        _loss(model(x), y).backward()
    probed = activation_grad_probe(model, _loss, x, y)
    assert set(rec.latest) == set(probed) == set(captured) == {"0", "2", "4"}
    for name, g in captured.items():
        assert rec.latest[name].numel == probed[name].numel == g.numel()
        assert rec.latest[name].amax == probed[name].amax == float(g.abs().max())


def test_a_module_with_several_outputs_gives_one_record_per_call():
    lstm = torch.nn.LSTM(4, 3)
    model = torch.nn.Sequential()
    model.add_module("lstm", lstm)
    with ActivationGradRecorder(model) as rec:
        out, (h, c) = model(torch.randn(5, 2, 4))
        (out.sum() + h.sum() + c.sum()).backward()
    assert len(rec.history) == 1 and rec.latest["lstm"].numel == 5 * 2 * 3 + 2 * 3 + 2 * 3


def test_no_grad_forwards_and_backwards_after_exit_record_nothing():
    model = tiny_mlp()
    x, y = batch(0)
    with ActivationGradRecorder(model) as rec:
        with torch.no_grad():
            model(x)
        loss = _loss(model(x), y)
    loss.backward()  # the forward was watched, the recorder has exited since
    assert rec.history == [] and rec.latest == {}


def test_activation_metrics_are_the_keys_the_report_reads():
    model = tiny_mlp()
    x, y = batch(0)
    per = activation_grad_probe(model, _loss, x, y, scale=2.0**-16)  # low enough that some flush
    figures = activation_metrics(per)
    total = per["0"] + per["2"]
    assert figures["act/flushed_frac"] == total.flushed_frac > 0
    assert figures["act/headroom_bits"] == total.headroom_bits
    assert figures["act/0/flushed_frac"] == per["0"].flushed_frac
    assert activation_metrics(per, of_nonzero=True)["act/2/flushed_frac"] == per["2"].frac_of_nonzero("flushed")
    tel = schema.parse_records([{"step": 0, "loss_scale": 1.0, **figures}])
    assert set(tel.layer_series("act", "flushed_frac")) == {"0", "2"}
    assert tel.metrics["act/flushed_frac"] == [figures["act/flushed_frac"]]
    assert {k for k in figures if k.count("/") == 2} == {
        f"act/{n}/{m}" for n in ("0", "2") for m in schema.LAYER_METRICS
    }
    assert activation_metrics({}) == {}


def test_recorder_metrics_logged_with_the_scaler_make_the_report_s_layer_plots(tmp_path):
    """Issue 21: nothing said how the recorder's per-layer figures reach the JSONL ``lossscale report`` reads."""
    pytest.importorskip("matplotlib")
    from lossscale.report.run_report import render_run_report

    model = tiny_mlp()
    path = tmp_path / "run.jsonl"
    with lossscale.JsonlLogger(str(path)) as log, ActivationGradRecorder(model, every=2) as rec:
        _train(model, rec, steps=4, log=log)
    first = json.loads(path.read_text().splitlines()[0])
    at_0 = {h["module"]: h["stats"] for h in rec.history if h["step"] == 0}
    assert first["act/0/headroom_bits"] == at_0["0"].headroom_bits and "act/0/flushed_frac" in first
    summary = render_run_report(str(path), str(tmp_path / "rep"))
    assert set(summary["act_flushed_frac_mean_per_layer"]) == {"0", "2"}
    assert math.isfinite(summary["act_headroom_bits_median_clean"])
    assert (tmp_path / "rep" / "layers_act.png").is_file()
