"""lossscale.audit against references computed here: the amaxes against hooks of the test's own, the
flushed share against a direct count of ``(g * S).half() == 0`` on the FP32 gradients, the safe scale
against its rule; on a real GPT-2 whose MLP down-projection overflows FP16 it names that module, and the
model is left bit for bit as it was (parameters, grads, buffers, modes, hooks, RNG)."""

import json
import math

import pytest
import torch

import lossscale
from lossscale import auditing
from lossscale.fp32 import kept_modules

pytestmark = pytest.mark.usefixtures("one_thread")

transformers = pytest.importorskip("transformers")
from _gpt2 import gpt2_batch, gpt2_loss, overflowing_gpt2, tiny_gpt2  # noqa: E402

AUTOCAST = dict(device_type="cpu", dtype=torch.float16)
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


@pytest.fixture(scope="module")
def overflowing():
    """The overflowing GPT-2, its module's name, and its audit (computed once for the module's tests)."""
    model, name = overflowing_gpt2()
    return model, name, lossscale.audit(model, gpt2_loss, gpt2_batch(0))


# ------------------------------------------------------------------ the real model
def test_audit_names_the_overflowing_module_of_a_gpt2(overflowing):
    model, name, report = overflowing
    assert report.keep_fp32 == [name]
    row = report.modules[name]
    assert row.fwd_overflow and not row.nonfinite_input and row.dtype == "float16"
    assert row.fp32_amax > lossscale.formats.FP16.max  # its output itself needs FP32
    assert "KEEP FP32 (output overflows)" in row.verdict
    assert report.modules["transformer.h.0.mlp.c_fc"].verdict == ""  # upstream of it: fine
    assert report.modules["transformer.h.1.ln_1"].nonfinite_input  # downstream: reached, not the cause
    assert not math.isfinite(report.loss_fp16) and report.forward_finite
    assert report.loss_fp16_kept == pytest.approx(report.loss_fp32, rel=1e-3)
    assert report.fp32_nonfinite == [] and report.hardware.verdict == "ok"
    assert kept_modules(model) == []  # the rounds' kept modules were un-kept
    text = str(report)
    assert f"lossscale.keep_fp32(model, ['{name}'])" in text and name in text and "HARDWARE: ok" in text
    json.dumps(report.to_dict())  # plain data


def test_after_keep_fp32_a_second_audit_finds_nothing_more(overflowing):
    model, name, _ = overflowing
    handle = lossscale.keep_fp32(model, [name])
    try:
        again = lossscale.audit(model, gpt2_loss, gpt2_batch(0))
    finally:
        handle.remove()
    assert again.keep_fp32 == [] and again.already_kept == [name]
    assert math.isfinite(again.loss_fp16) and again.forward_finite
    assert again.modules[name].dtype == "float32" and again.modules[name].verdict == "kept fp32"
    assert not again.modules[name].grad_fp16  # its gradient is float32 now: nothing of it flushes


def test_rounds_find_an_overflow_that_only_shows_once_the_first_is_kept():
    # c_fc's output overflows; kept in FP32 it stays float32 through GELU, and c_proj's own cast of it to
    # FP16 overflows next: only a second FP16 forward can see that.
    model, name = overflowing_gpt2(module="transformer.h.0.mlp.c_fc", factor=2.0**20)
    report = lossscale.audit(model, gpt2_loss, gpt2_batch(0))
    assert report.keep_fp32 == [name, "transformer.h.0.mlp.c_proj"] and report.forward_finite
    assert not report.modules["transformer.h.0.mlp.c_proj"].fwd_overflow  # in round one it only saw inf
    one = lossscale.audit(model, gpt2_loss, gpt2_batch(0), max_rounds=1)
    assert one.keep_fp32 == [name] and not one.forward_finite and "still overflows" in " ".join(one.notes)


# ------------------------------------------------------------------ the figures against references
def _reference_pass(model, batch, *, autocast):
    """Per module: forward output amax (a test hook of its own), and in FP32 the output gradients."""
    amax, grads, handles = {}, {}, []

    def floats(o):
        if isinstance(o, torch.Tensor):
            return [o] if o.is_floating_point() else []
        if isinstance(o, dict):
            o = list(o.values())
        return [t for x in o for t in floats(x)] if isinstance(o, (list, tuple)) else []

    def hook(name):
        def fn(module, args, out):
            ts = floats(out)
            amax[name] = max(float(x.detach().abs().max()) for x in ts)
            for x in ts:
                if x.requires_grad and not autocast:
                    x.register_hook(lambda g, name=name: grads.setdefault(name, []).append(g.detach().clone()))

        return fn

    for name, m in model.named_modules():
        handles.append(m.register_forward_hook(hook(name)))
    try:
        if autocast:
            with torch.autocast(**AUTOCAST):
                gpt2_loss(model, batch)
        else:
            loss = gpt2_loss(model, batch)
            torch.autograd.grad(loss, [p for p in model.parameters()])
    finally:
        for h in handles:
            h.remove()
    return amax, grads


def _flushed_share(grads, scale):
    g = torch.cat([x.flatten() for x in grads]).double()
    nonzero = g != 0
    flushed = nonzero & ((g * scale).float().half() == 0)
    return int(flushed.sum()) / max(int(nonzero.sum()), 1)


@pytest.mark.parametrize("scale", [None, 1.0, 3.0])
def test_amaxes_and_flushed_shares_match_direct_counts(scale):
    model = tiny_gpt2(**NO_DROPOUT)
    batch = gpt2_batch(1)
    report = lossscale.audit(model, gpt2_loss, batch, scale=scale)
    amax16, _ = _reference_pass(model, batch, autocast=True)
    amax32, grads = _reference_pass(model, batch, autocast=False)
    S = report.scale if scale is None else scale
    assert report.scale == S and report.scale_source == ("largest safe" if scale is None else "given")
    flushed_somewhere = False
    for name, row in report.modules.items():
        assert row.fwd_amax == amax16[name], name
        assert row.fp32_amax == amax32[name], name
        assert row.grad_amax == max(float(g.abs().max()) for g in grads[name]), name
        if row.grad_fp16:
            assert row.flushed_frac == _flushed_share(grads[name], S), name
            flushed_somewhere |= row.flushed_frac > 0
        else:
            assert row.flushed_frac is None and row.dtype == "float32"
    assert flushed_somewhere or scale is None  # at scale 1 and 3 FP16 flushes some of these gradients


def test_the_safe_scale_is_the_largest_power_of_two_with_a_binade_of_headroom():
    model = tiny_gpt2(**NO_DROPOUT)
    report = lossscale.audit(model, gpt2_loss, gpt2_batch(1))
    # The rule's inputs: FP16-stored output gradients and the gradients of those modules' own parameters
    # (by identity: the tied lm_head / wte weight belongs to both).
    amax = max(r.grad_amax for r in report.modules.values() if r.grad_fp16)
    loss = gpt2_loss(model, gpt2_batch(1))
    params = list(model.parameters())
    grads = {id(p): g for p, g in zip(params, torch.autograd.grad(loss, params))}
    for mname, row in report.modules.items():
        if row.grad_fp16:
            for p in model.get_submodule(mname).parameters(recurse=False):
                amax = max(amax, float(grads[id(p)].abs().max()))
    S = report.safe_scale
    assert math.frexp(S)[0] == 0.5  # a power of two
    assert amax * S * 2 <= 65504 < amax * S * 4
    assert report.backward_overflow == []


def test_a_too_large_scale_is_reported_as_a_backward_overflow_exactly_where_it_overflows():
    model = tiny_gpt2(**NO_DROPOUT)
    S = 2.0**30
    report = lossscale.audit(model, gpt2_loss, gpt2_batch(1), scale=S)
    _, grads = _reference_pass(model, gpt2_batch(1), autocast=False)

    def overflows(gs):
        return bool(torch.isinf((torch.cat([g.flatten() for g in gs]).double() * S).float().half()).any())

    expected = [n for n, r in report.modules.items() if r.grad_fp16 and overflows(grads[n])]
    assert expected and report.backward_overflow == expected
    assert all("BWD OVERFLOW" in report.modules[n].verdict for n in expected)
    assert "the scale must drop" in str(report)


def test_scale_from_a_grad_scaler():
    model = tiny_gpt2()
    scaler = lossscale.GradScaler("cpu", init_scale=2.0**10)
    report = lossscale.audit(model, gpt2_loss, gpt2_batch(0), scale=scaler)
    assert report.scale == 2.0**10 and report.scale_source == "scaler"
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    assert (
        lossscale.audit(torch.nn.Linear(2, 2), lambda m, b: m(b).sum(), torch.ones(1, 2), scale=torch_scaler).scale
        == 2.0**8
    )


# ------------------------------------------------------------------ the model is left as it was
def _snapshot(model):
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "modes": {n: m.training for n, m in model.named_modules()},
        "types": {n: type(m) for n, m in model.named_modules()},
        "hooks": {
            n: [
                len(getattr(m, a))
                for a in (
                    "_forward_hooks",
                    "_forward_pre_hooks",
                    "_backward_hooks",
                    "_forward_hooks_with_kwargs",
                    "_forward_pre_hooks_with_kwargs",
                )
            ]
            for n, m in model.named_modules()
        },
        "rng": torch.get_rng_state(),
    }


def _same(a, b):
    assert a["state"].keys() == b["state"].keys()
    assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])
    assert a["grads"].keys() == b["grads"].keys()
    for k in a["grads"]:
        assert (a["grads"][k] is None) == (b["grads"][k] is None)
        assert a["grads"][k] is None or torch.equal(a["grads"][k], b["grads"][k])
    assert a["modes"] == b["modes"] and a["types"] == b["types"] and a["hooks"] == b["hooks"]
    assert torch.equal(a["rng"], b["rng"])


def test_a_gpt2_is_left_exactly_as_it_was():
    model, _ = overflowing_gpt2()
    model.transformer.h[1].eval()  # mixed training flags
    model.lm_head.weight.grad = torch.full_like(model.lm_head.weight, 0.5)  # an existing grad
    torch.manual_seed(123)
    before = _snapshot(model)
    lossscale.audit(model, gpt2_loss, gpt2_batch(0))
    _same(before, _snapshot(model))
    # The dropout stream is the user's: the next draw is the one it would have been.
    expected = torch.rand(3, generator=torch.Generator().set_state(before["rng"]))
    assert torch.equal(torch.rand(3), expected)


def test_batchnorm_statistics_and_a_half_precision_model_are_left_as_they_were():
    torch.manual_seed(0)
    cnn = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.LazyLinear(4)
    )
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    cnn(x)  # materialise the lazy layer
    loss_fn = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]).float(), b[1])  # noqa: E731
    for model in (cnn, cnn.half()):
        before = _snapshot(model)
        report = lossscale.audit(model, loss_fn, (x.to(next(model.parameters()).dtype), y))
        _same(before, _snapshot(model))
        assert report.hardware.verdict == "ok" and report.keep_fp32 == []
    assert any("deep copy" in n for n in report.notes)  # the half model's shadow is a float32 copy


# ------------------------------------------------------------------ verdicts on made-up faults
class _WrongInFP16(torch.nn.Module):
    """A layer whose FP16 kernel is off by 1%: a stand-in for broken hardware that gives finite garbage."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        y = self.lin(x)
        return y * 1.01 if y.dtype == torch.float16 else y


def _small(*layers):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), *layers, torch.nn.Linear(16, 4))


_LOSS = lambda m, b: m(b).float().pow(2).mean()  # noqa: E731


def test_hardware_check_names_the_first_module_whose_fp16_output_departs_from_fp32():
    model = _small(torch.nn.Tanh(), _WrongInFP16(), torch.nn.Tanh())
    report = lossscale.audit(model, _LOSS, torch.randn(8, 16))
    hw = report.hardware
    assert hw.verdict == "disagrees" and hw.first_disagreement == "2"
    assert hw.rel_error > hw.tolerance == auditing.TOL_PER_LAYER * (3 + 1)  # the 3rd leaf run (0, 1, 2.lin)
    assert report.modules["2"].verdict == "FP16 DISAGREES" and "HARDWARE: disagrees" in str(report)


def test_hardware_check_is_broken_when_a_known_answer_fails(monkeypatch):
    def nan_kernel(device):
        got = torch.tensor([1.0, math.nan])
        return got, torch.tensor([1.0, 2.0], dtype=torch.float64), torch.zeros(2, dtype=torch.float64)

    cases = auditing._KNOWN_ANSWER_CASES + (("nan kernel", nan_kernel),)
    monkeypatch.setattr(auditing, "_KNOWN_ANSWER_CASES", cases)
    report = lossscale.audit(_small(), _LOSS, torch.randn(8, 16))
    assert report.hardware.verdict == "broken" and "FP32 or BF16" in report.hardware.detail
    assert report.hardware.known_answer["nan kernel"].startswith("1 non-finite")
    assert all(report.hardware.known_answer[name] == "ok" for name, _ in auditing._KNOWN_ANSWER_CASES[:-1])


def test_known_answer_inputs_are_exact_in_fp16_and_the_checks_catch_a_one_ulp_error():
    for _, case in auditing._KNOWN_ANSWER_CASES:
        got, want, bound = case(torch.device("cpu"))
        assert bool(((got.double() - want).abs() <= bound).all())
    got, want, bound = auditing._exact_linear(torch.device("cpu"))
    assert torch.equal(want.half().double(), want) and bool((bound == 0).all())  # exact in FP16


def test_a_nan_in_the_batch_is_a_data_problem_not_fp16s():
    model = _small(torch.nn.Tanh())
    x = torch.randn(8, 16)
    x[3, 5] = math.nan
    report = lossscale.audit(model, _LOSS, x)
    assert report.keep_fp32 == [] and report.fp32_nonfinite == [] and not report.forward_finite
    assert not report.batch_finite and "DATA: the batch holds inf or NaN" in str(report)
    assert report.modules["0"].nonfinite_input and report.modules["0"].fp32_nonfinite


def test_a_module_that_is_non_finite_in_fp32_too_is_a_model_problem():
    class Log(torch.nn.Module):
        def forward(self, x):
            return torch.log(x - x)  # -inf in any precision

    report = lossscale.audit(_small(Log()), _LOSS, torch.randn(8, 16))
    assert report.fp32_nonfinite == ["1"] and report.keep_fp32 == [] and report.batch_finite
    assert "NON-FINITE IN FP32" in report.modules["1"].verdict and "FP32 TOO: 1 are" in str(report)


def test_table_keeps_flagged_rows_when_it_is_cut_short(overflowing):
    _, name, report = overflowing
    short = report.table(max_rows=6)
    assert name in short and "more module(s)" in short
    assert len(report.table(max_rows=None).splitlines()) == len(report.modules) + 3


def test_bad_arguments_raise_value_errors_that_say_what_to_do():
    model = _small()
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="model=.*torch.nn.Module"):
        lossscale.audit("m", _LOSS, x)
    with pytest.raises(ValueError, match=r"loss_fn=.*loss_fn\(model, batch\)"):
        lossscale.audit(model, None, x)
    with pytest.raises(ValueError, match="loss_fn returned Tensor of shape"):
        lossscale.audit(model, lambda m, b: m(b), x)
    for bad in (0.0, -1.0, math.inf, math.nan, True, "2**16"):
        with pytest.raises(ValueError, match="scale=.*positive finite number"):
            lossscale.audit(model, _LOSS, x, scale=bad)
    with pytest.raises(ValueError, match="max_rounds=0 must be an int >= 1"):
        lossscale.audit(model, _LOSS, x, max_rounds=0)
