"""lossscale.rescale: the residual stream divided by a power of two, the function unchanged.

Tiny transformers models built from their configs (2 layers, 64 wide, nothing downloaded), one per family the
rescaling knows. In FP32 everything is compared bitwise (torch.equal): logits, every parameter's gradient, and
after optimizer steps the weights, gradients and optimizer state. In FP16 (CPU autocast) a model whose
residual writers overflow is made finite and trains with lossscale's GradScaler.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
import re

import pytest
import torch

import lossscale
import lossscale.fp32
from lossscale import rescaling

transformers = pytest.importorskip("transformers")

KW = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=64,
)


def _config(family: str):
    T = transformers
    if family == "gpt2":
        return T.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0
        )
    return {
        "llama": lambda: T.LlamaConfig(**KW),
        "llama-tied": lambda: T.LlamaConfig(tie_word_embeddings=True, **KW),
        "qwen2": lambda: T.Qwen2Config(**KW),
        "qwen3": lambda: T.Qwen3Config(**KW),
        "mistral": lambda: T.MistralConfig(**KW),
        "gemma2": lambda: T.Gemma2Config(**KW),
        "gemma3": lambda: T.Gemma3TextConfig(**KW),
    }[family]()


FAMILIES = ["llama", "llama-tied", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "gpt2"]


def tiny(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny model, its norms' weights random (so Gemma's ``1 + weight`` and the LayerNorm biases matter)."""
    torch.manual_seed(seed)
    m = transformers.AutoModelForCausalLM.from_config(_config(family), attn_implementation="eager")
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n or ".ln_" in n:
                p.normal_(0.5, 0.3)
    return m.eval()  # no dropout unless a test asks


def overflowing(family: str) -> torch.nn.Module:
    """A tiny model whose residual stream reaches about 1e5 in FP32: its writers' FP16 outputs overflow."""
    m = tiny(family)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if family.startswith("gemma"):
                if "post_attention_layernorm" in n or "post_feedforward_layernorm" in n:
                    p.fill_(2.0e4)  # Gemma-style: large post-norm weights
            elif family == "gpt2":
                if "attn.c_attn.weight" in n:
                    p[:, 128:].mul_(70.0)  # the value projection
                if "c_proj.weight" in n:
                    p.mul_(6.0e4)
            else:
                if "v_proj" in n:
                    p.mul_(70.0)
                if "o_proj" in n or "down_proj" in n:
                    p.mul_(3.0e4)
    return m


IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def _undo_every_rescaling():
    # A rescaling in force shows in every scaler's health() in the process: none outlives its test.
    yield
    for r in list(rescaling._IN_FORCE.values()):
        r.undo()


def loss_of(m, ids=IDS):
    return m(ids, labels=ids).loss


def grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


# ------------------------------------------------------------------ FP32: bitwise
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_logits_and_every_gradient_are_bitwise_the_originals(family):
    m = tiny(family)
    m.train()  # GPT-2's dropout on: the same masks from the same seed
    torch.manual_seed(1)
    out = m(IDS, labels=IDS)
    out.loss.backward()
    g0, sd0 = grads(m), {k: v.clone() for k, v in m.state_dict().items()}
    m.zero_grad(set_to_none=True)

    r = lossscale.rescale(m, 64)
    torch.manual_seed(1)
    out2 = m(IDS, labels=IDS)
    out2.loss.backward()
    assert torch.equal(out.logits, out2.logits)
    assert torch.equal(out.loss, out2.loss)
    g1 = grads(m)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[n], g1[n]) for n in g0)
    sd1 = m.state_dict()  # no parameter or persistent buffer changed
    assert sd0.keys() == sd1.keys() and all(torch.equal(sd0[k], sd1[k]) for k in sd0)
    assert r.in_force and r.family == family.split("-")[0]


def test_the_stream_itself_is_divided_and_its_gradient_grows_by_c():
    # What changes: the residual stream (hidden states) is divided by c, its gradient multiplied by c.
    m = tiny("llama")
    h0 = m(IDS, output_hidden_states=True).hidden_states
    lossscale.rescale(m, 64)
    h1 = m(IDS, output_hidden_states=True).hidden_states
    assert torch.equal(h0[0] / 64, h1[0]) and torch.equal(h0[1] / 64, h1[1])
    seen = []
    m.model.layers[1].register_full_backward_pre_hook(lambda mod, g: seen.append(g[0].clone()))
    loss_of(m).backward()
    rescaling.in_force(m).undo()
    loss_of(m).backward()
    assert torch.equal(seen[0], seen[1] * 64)


def _train(m, make_opt, steps=3):
    opt = make_opt(m.parameters())
    torch.manual_seed(2)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss_of(m).backward()
        opt.step()
    return opt


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.0),
    "adamw-wd": lambda p: torch.optim.AdamW(p, lr=1e-3),  # torch's default weight decay, 0.01
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1, fused=True),
    "sgd": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
}
TRAINING = [(f, o) for f in ("llama-tied", "gemma3", "gpt2") for o in OPTIMIZERS] + [
    (f, "adamw-wd") for f in ("llama", "qwen2", "qwen3", "mistral", "gemma2")
]


@pytest.mark.parametrize("family,optimizer", TRAINING)
def test_fp32_training_keeps_its_trajectory_bitwise(family, optimizer):
    a, b = tiny(family), tiny(family)
    lossscale.rescale(b, 256)
    opt_a = _train(a, OPTIMIZERS[optimizer])
    opt_b = _train(b, OPTIMIZERS[optimizer])
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), n
        assert torch.equal(pa.grad, pb.grad), n
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for key, va in sa[k].items():
            assert torch.equal(torch.as_tensor(va), torch.as_tensor(sb[k][key])), (k, key)


# ------------------------------------------------------------------ FP16: finite, and trains
def _fp16_logits(m):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        return m(IDS).logits.float()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "gemma2", "gpt2"])
def test_fp16_forward_that_overflowed_is_finite_and_close_to_fp32(family):
    m = overflowing(family)
    with torch.no_grad():
        ref = m(IDS).logits
        hidden = m(IDS, output_hidden_states=True).hidden_states[:-1]  # the last is the final norm's output
    assert max(h.abs().max().item() for h in hidden) > 65504  # the residual stream outgrows FP16
    assert not _fp16_logits(m).isfinite().all()
    lossscale.rescale(m, 64)
    y = _fp16_logits(m)
    assert y.isfinite().all()
    # FP16's precision: a few unit roundoffs (2^-11) through two layers; measured about 1e-3.
    assert (y - ref).abs().max() / ref.abs().max() < 4e-3


def _fp16_run(m, steps, scaler):
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of(m)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
def test_fp16_training_through_the_overflow_follows_fp32(family):
    steps = 6
    ref = overflowing(family)
    ref_losses = []
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(ref)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())

    # The original in FP16: every forward overflows, every step is skipped (no loss scale helps).
    orig = overflowing(family)
    scaler = lossscale.GradScaler("cpu", init_scale=2.0**10)
    assert not any(math.isfinite(x) for x in _fp16_run(orig, 2, scaler))

    m = overflowing(family)
    r = lossscale.rescale(m, 64)
    scaler = lossscale.GradScaler("cpu", init_scale=2.0**10)
    losses = _fp16_run(m, steps, scaler)
    assert all(math.isfinite(x) for x in losses)
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / abs(b) < 1e-2, (losses, ref_losses)
    assert r.in_force and not lossscale.fp32.kept_modules(m)  # no module upcast: every one ran under autocast


# ------------------------------------------------------------------ undo, records, copies
@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
def test_undo_restores_the_original_bitwise(family):
    m = tiny(family)
    eps = {n: dict(vars(mod)) for n, mod in m.named_modules()}
    before = m(IDS).logits
    r = lossscale.rescale(m, 2.0**10)
    assert rescaling.in_force(m) is r
    r.undo()
    assert rescaling.in_force(m) is None and not r.in_force
    for n, mod in m.named_modules():  # every attribute is back: no forward on the instance, eps the very float
        now = vars(mod)
        assert now.keys() == eps[n].keys(), n
        assert all(now[k] is eps[n][k] for k in now if not k.startswith("_")), n
        assert not mod._forward_pre_hooks
    assert torch.equal(before, m(IDS).logits)
    with pytest.raises(RuntimeError, match="undone already"):
        r.undo()
    with pytest.raises(RuntimeError, match="export before undo"):
        r.export("unused")
    lossscale.rescale(m, 4).undo()  # it can be applied again


def test_a_checkpoint_round_trips_the_rescaling(tmp_path):
    m = tiny("gemma3")
    r = lossscale.rescale(m, 128)
    ref = m(IDS).logits
    torch.save({"model": m.state_dict(), "rescale": r.state_dict()}, tmp_path / "ckpt.pt")
    ck = torch.load(tmp_path / "ckpt.pt")
    fresh = tiny("gemma3", seed=5)
    fresh.load_state_dict(ck["model"])
    r2 = lossscale.rescale(fresh, **ck["rescale"])
    assert r2.factor == 128 and torch.equal(ref, fresh(IDS).logits)
    r2.undo()  # and the checkpoint is the original model's
    r.undo()
    assert torch.equal(m(IDS).logits, fresh(IDS).logits)


def test_a_deep_copy_is_rescaled_on_its_own_modules():
    m = tiny("gpt2")
    lossscale.rescale(m, 64)
    c = copy.deepcopy(m)
    with torch.no_grad():
        c.transformer.h[0].attn.c_proj.weight.mul_(2)  # a change to the copy shows in the copy only
    assert not torch.equal(m(IDS).logits, c(IDS).logits)
    assert c.transformer.h[0].attn.c_proj.forward.__self__ is c.transformer.h[0].attn.c_proj


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
def test_inputs_embeds_are_rescaled_like_the_embedding(family):
    m = tiny(family)
    emb = m.get_input_embeddings()(IDS).detach()
    ref = m(inputs_embeds=emb).logits
    lossscale.rescale(m, 64)
    assert torch.equal(ref, m(inputs_embeds=emb).logits)


# ------------------------------------------------------------------ refusals
class PreNorm(torch.nn.Module):
    """A pre-norm block of our own: rescale cannot know its forward."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.ln = torch.nn.LayerNorm(8)
        self.fc = torch.nn.Linear(8, 8)
        self.ln_f = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.fc(torch.tanh(self.ln(h)))
        return self.head(self.ln_f(h))


def test_an_unknown_model_is_refused_naming_what_is_not_proven_and_left_unchanged():
    m = PreNorm()
    before = {n: dict(vars(mod)) for n, mod in m.named_modules()}
    with pytest.raises(ValueError, match="which modules write its residual stream and which norms read it"):
        lossscale.rescale(m, 64)
    assert {n: dict(vars(mod)) for n, mod in m.named_modules()} == before
    assert rescaling.in_force(m) is None


def test_a_subclassed_layer_is_refused_naming_it():
    m = tiny("llama")
    m.model.layers[1].__class__ = type("MyLayer", (type(m.model.layers[1]),), {})
    with pytest.raises(ValueError, match=r"model\.layers\.1 is MyLayer, not LlamaDecoderLayer"):
        lossscale.rescale(m, 64)
    assert "forward" not in vars(m.model.layers[0].self_attn.o_proj)  # nothing half-applied


def test_named_writers_and_readers_rescale_any_model_bitwise():
    torch.manual_seed(0)
    m = PreNorm()
    ids = torch.randint(0, 16, (4, 5))
    ref = m(ids)
    r = lossscale.rescale(m, 32, writers=["emb", "fc"], readers=["ln", "ln_f"])
    assert torch.equal(ref, m(ids)) and r.family == "named"
    assert r.state_dict() == {"factor": 32.0, "writers": ["emb", "fc"], "readers": ["ln", "ln_f"]}
    with pytest.raises(ValueError, match="export needs one of the known families"):
        r.export("unused")


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(factor=3), ValueError, "power of two"),
        (dict(factor=0.5), ValueError, "power of two >= 1"),
        (dict(factor=True), TypeError, "factor must be"),
        (dict(factor="64"), TypeError, "factor must be"),
        (dict(factor=2.0**80, writers=["emb", "fc"], readers=["ln", "ln_f"]), ValueError, "subnormal"),
        (dict(factor=4, writers=["emb"]), ValueError, "writers and readers go together"),
        (dict(factor=4, writers=["nope"], readers=[]), ValueError, "'nope' is not a module name"),
        (dict(factor=4, writers=["emb"], readers=["fc"]), ValueError, "no float eps"),
        (dict(factor=4, writers=["head", "ln"], readers=["ln_f"]), None, None),
    ],
)
def test_bad_arguments_are_refused_clearly(kwargs, error, match):
    m = PreNorm()
    if error is None:  # a Linear and a norm are writers it can scale
        lossscale.rescale(m, **kwargs).undo()
        return
    with pytest.raises(error, match=match):
        lossscale.rescale(m, **kwargs)
    assert rescaling.in_force(m) is None


def test_rescaling_twice_is_refused():
    m = tiny("llama")
    r = lossscale.rescale(m, 4)
    with pytest.raises(RuntimeError, match="rescaled already"):
        lossscale.rescale(m, 4)
    r.undo()


# ------------------------------------------------------------------ choosing c, and the audit's advice
def _audit(m):
    return lossscale.audit(m, lambda model, ids: model(ids, labels=ids).loss, IDS)


@pytest.mark.parametrize("family", ["gemma3", "gpt2"])
def test_choose_rescale_takes_the_smallest_power_of_two_per_layer_and_the_audit_names_it(family):
    m = overflowing(family)
    report = _audit(m)
    assert report.keep_fp32  # the FP16 forward overflows
    choice = lossscale.choose_rescale(m, report)
    layers = [f"model.layers.{i}" for i in range(2)] if family == "gemma3" else [f"transformer.h.{i}" for i in range(2)]
    assert [r.name for r in choice.layers][1:] == layers
    for r in choice.layers:
        assert r.amax / r.factor * 2 <= 65504  # one binade of headroom left
        assert r.factor == 1 or r.amax / (r.factor / 2) * 2 > 65504  # and no smaller power of two does it
    assert choice.factor == max(r.factor for r in choice.layers) > 1
    layer = report.modules[layers[1]].fp32_amax
    assert choice.layers[2].amax >= layer  # the layer's output (the stream) is among what it reads
    assert lossscale.choose_rescale(m, report, headroom_bits=4).factor == choice.factor * 8
    advice = [n for n in report.notes if "lossscale.rescale(model, " in n]
    assert advice == [next(n for n in advice if f"lossscale.rescale(model, {int(choice.factor)})" in n)]

    lossscale.rescale(m, choice.factor)
    again = _audit(m)
    assert again.keep_fp32 == [] and again.forward_finite
    assert not any("lossscale.rescale(model, " in n for n in again.notes)
    assert f"audited with a rescaling in force: residual stream divided by 2^{int(math.log2(choice.factor))}" in (
        "\n".join(again.notes)
    )


def test_the_audit_does_not_advise_rescaling_for_an_overflow_inside_a_branch():
    m = overflowing("gemma3")
    with torch.no_grad():
        for layer in m.model.layers:
            layer.mlp.up_proj.weight.mul_(100.0)
            layer.mlp.down_proj.weight.mul_(3.0e4)  # its own FP16 output overflows: dividing the stream cannot help
    report = _audit(m)
    assert any(n.endswith("mlp.down_proj") for n in report.keep_fp32)
    assert lossscale.choose_rescale(m, report).factor > 1  # the stream is large too
    assert not any("lossscale.rescale(model, " in n for n in report.notes)


def test_choose_rescale_refuses_what_rescale_refuses():
    with pytest.raises(ValueError, match="not a model rescale knows"):
        lossscale.choose_rescale(PreNorm(), None)
    with pytest.raises(TypeError, match="AuditReport"):
        lossscale.choose_rescale(tiny("llama"), {"modules": {}})
    with pytest.raises(ValueError, match="headroom_bits"):
        lossscale.choose_rescale(tiny("llama"), None, headroom_bits=-1)


# ------------------------------------------------------------------ inference export
@pytest.mark.parametrize("family", FAMILIES)
def test_export_writes_a_plain_checkpoint_that_computes_the_same_function(family, tmp_path):
    m = tiny(family)
    ref = m(IDS).logits
    r = lossscale.rescale(m, 64)
    r.export(str(tmp_path))
    e = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    assert rescaling.in_force(e) is None and not e.config.tie_word_embeddings
    y = e(IDS).logits
    if family.startswith("gemma"):
        # (1 + w) / c - 1 rounded to float32 in the post-norms: measured 1.4e-6 (Gemma 2), 2.2e-6 (Gemma 3).
        assert 0 < (y - ref).abs().max() / ref.abs().max() < 1e-5
    else:
        assert torch.equal(y, ref)  # every fold is a power of two: bitwise
    assert torch.equal(m(IDS).logits, ref)  # the rescaled model itself untouched by the export


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
def test_the_exported_checkpoint_runs_in_float16_where_the_original_overflows(family, tmp_path):
    m = overflowing(family)
    with torch.no_grad():
        ref = m(IDS).logits
        assert not copy.deepcopy(m).half()(IDS).logits.isfinite().all()  # a float16 model: its forward overflows
    lossscale.rescale(m, 64).export(str(tmp_path))
    e = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float16, attn_implementation="eager"
    )
    with torch.no_grad():
        y = e.eval()(IDS).logits.float()
    assert y.isfinite().all()
    assert (y - ref).abs().max() / ref.abs().max() < 1e-2


# ------------------------------------------------------------------ visible in health()
def test_health_says_which_rescaling_is_in_force():
    m = overflowing("gemma3")
    scaler = lossscale.GradScaler("cpu", init_scale=2.0**10)
    assert scaler.health().rescaling is None
    r = lossscale.rescale(m, 64)
    _fp16_run(m, 2, scaler)
    report = scaler.health()
    line = (
        "Gemma3ForCausalLM: residual stream divided by 2^6 (gemma3: 5 writers scaled, 5 norms' eps divided by 2^12), "
        "in force"
    )
    assert report.rescaling == (line,)
    assert str(report).endswith(f"Residual stream rescaled (lossscale.rescale): {line}.")
    assert "rescaling" not in report.metrics()
    r.undo()
    assert scaler.health().rescaling is None


# ------------------------------------------------------------------ the benchmark and the how-to page
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        return fh.read()


def test_the_benchmark_runs_end_to_end(tmp_path):
    # A smoke run: one model, two steps, one pair. Nothing timed is asserted.
    spec = importlib.util.spec_from_file_location("bench_rescale", os.path.join(ROOT, "benchmarks", "bench_rescale.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        out = bench.main(["--families", "gpt2", "--steps", "2", "--pairs", "1", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    row = out["models"]["gpt2"]
    assert row["fp32_exactness"] == {"logits_max_abs_diff": 0.0, "grads_max_abs_diff": 0.0}
    assert row["variants"]["fp16"]["steps_taken"] == 0 and row["variants"]["rescale"]["steps_taken"] == 2
    assert "| rescale |" in (tmp_path / "rescale.md").read_text()


def test_the_how_to_page_quotes_the_committed_results():
    page, results = _read("docs/how-to/fp16-rescale.md"), _read("benchmarks/results/rescale.md")
    lines = set(results.splitlines())
    rows = [line for line in page.splitlines() if re.match(r"\| (fp16|clamp|upcast|rescale|fp32)\S* \|", line)]
    assert len(rows) >= 10 and all(row in lines for row in rows), [r for r in rows if r not in lines]
    measured = page.split("## Clamp, FP32 upcast, rescale: measured")[1].split("## Other models")[0]
    measured += page.split("**The loss scale.**")[1].split("## Clamp")[0]
    for figure in re.findall(r"\b\d+(?:\.\d+)?(?:e-\d+)?%?|2\^\d+", measured):
        if figure not in ("0", "1", "2", "20", "30", "64", "65504", "1000", "8", "32"):
            assert figure in results, figure
