"""keep_fp32: chosen modules run outside autocast in FP32, reversibly, surviving state_dict, pickling and
deepcopy; on a real GPT-2 whose MLP down-projection overflows FP16 it turns a run that never trains into
one that does, with torch's AdamW (fused and not) and lossscale's GradScaler."""

import copy
import io
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lossscale
from lossscale import fp32
from lossscale.fp32 import is_kept, kept_modules, release, to_float32

pytestmark = pytest.mark.usefixtures("one_thread")

AUTOCAST = dict(device_type="cpu", dtype=torch.float16)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.c = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def _net(seed=0):
    torch.manual_seed(seed)
    return Net()


# ------------------------------------------------------------------ what a kept module computes
def test_a_kept_module_computes_in_fp32_and_returns_fp32_under_autocast():
    net = _net()
    x = torch.randn(4, 8)
    keep = lossscale.keep_fp32(net, ["b"])
    seen = {}
    net.b.register_forward_hook(lambda m, args, out: seen.update(inp=args[0].dtype, out=out.dtype))
    with torch.autocast(**AUTOCAST):
        y = net(x)
    h = torch.nn.functional.linear(x.half(), net.a.weight.half(), net.a.bias.half())  # what autocast gives a
    reference = torch.nn.functional.linear(h.float(), net.b.weight, net.b.bias)  # b in FP32, by hand
    with torch.autocast(**AUTOCAST):
        assert torch.equal(net.b(h), reference)
        assert net.c(reference).dtype == torch.float16  # the next autocast op casts the FP32 output itself
    assert seen == {"inp": torch.float16, "out": torch.float32}  # hooks see the call as the caller made it
    assert y.dtype == torch.float16
    keep.remove()


def test_outside_autocast_a_kept_module_runs_unchanged():
    net = _net().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    expected = net(x)
    net.float()
    lossscale.keep_fp32(net, ["a"])
    net.double()  # the check on float32 parameters is at keep time; outside autocast nothing is cast
    assert net.a(x).dtype == torch.float64
    assert torch.equal(net(x), expected)


def test_cast_back_returns_autocasts_dtype():
    net = _net()
    lossscale.keep_fp32(net, ["b"], cast_back=True)
    with torch.autocast(**AUTOCAST):
        assert net.b(torch.randn(2, 8).half()).dtype == torch.float16
    lossscale.keep_fp32(net, ["b"])  # a second call updates the rule
    with torch.autocast(**AUTOCAST):
        assert net.b(torch.randn(2, 8).half()).dtype == torch.float32


def test_nested_keyword_and_non_float_inputs_follow_the_cast_rule():
    class Takes(torch.nn.Module):
        def forward(self, x, *, extra):
            return {
                "x": x.dtype,
                "h": extra["h"][0].dtype,
                "b": extra["h"][1].dtype,
                "d": extra["d"].dtype,
                "i": extra["i"].dtype,
                "n": extra["n"],
            }

    mod = torch.nn.Sequential(Takes())
    lossscale.keep_fp32(mod, [mod[0]])  # a module object works as well as a name
    extra = {
        "h": [torch.ones(2, dtype=torch.float16), torch.ones(2, dtype=torch.bfloat16)],
        "d": torch.ones(2, dtype=torch.float64),
        "i": torch.ones(2, dtype=torch.int64),
        "n": 3,
    }
    with torch.autocast(**AUTOCAST):
        got = mod[0](torch.ones(2, dtype=torch.float16), extra=extra)
    assert got == {
        "x": torch.float32,
        "h": torch.float32,
        "b": torch.float32,
        "d": torch.float64,
        "i": torch.int64,
        "n": 3,
    }


_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.bool]
_leaf = st.one_of(st.sampled_from(_DTYPES).map(lambda d: torch.zeros(2, dtype=d)), st.integers(), st.none())
_nested = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.tuples(inner, inner), st.dictionaries(st.text(max_size=2), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(_nested)
def test_to_float32_casts_exactly_the_lower_precision_floats_and_keeps_the_structure(value):
    def check(before, after):
        if isinstance(before, torch.Tensor):
            want = torch.float32 if before.dtype in (torch.float16, torch.bfloat16) else before.dtype
            assert after.dtype == want and (after is before) == (want == before.dtype)
        elif isinstance(before, (list, tuple)):
            assert type(after) is type(before) and len(after) == len(before)
            for b, a in zip(before, after):
                check(b, a)
        elif isinstance(before, dict):
            assert type(after) is type(before) and list(after) == list(before)
            for k in before:
                check(before[k], after[k])
        else:
            assert after is before

    check(value, to_float32(value))


def test_gradients_match_a_hand_written_fp32_island_bitwise():
    def run(kept):
        net = _net()
        if kept:
            lossscale.keep_fp32(net, ["b"])
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
        with torch.autocast(**AUTOCAST):
            h = net.a(x)
            if kept:
                h = net.b(h)
            else:
                with torch.autocast("cpu", enabled=False):
                    h = net.b(h.float())
            loss = net.c(h).float().pow(2).sum()
        loss.backward()
        return [p.grad for p in net.parameters()]

    for g_kept, g_hand in zip(run(True), run(False)):
        assert torch.equal(g_kept, g_hand)


# ------------------------------------------------------------------ reversible, repeatable
def test_handle_removes_what_it_kept_and_repeated_calls_add_idempotently():
    net = _net()
    h1 = lossscale.keep_fp32(net, ["a"])
    h2 = lossscale.keep_fp32(net, ["a", "c.0", "a"])
    assert h1.names == ["a"] and h2.names == ["c.0"]
    assert kept_modules(net) == ["a", "c.0"]
    assert type(net.a) is type(net.c[0]) and isinstance(net.a, torch.nn.Linear)
    assert type(net.a).__name__ == "Linear"  # code matching modules by class name still matches
    h1.remove()
    h1.remove()  # idempotent
    assert kept_modules(net) == ["c.0"] and type(net.a) is torch.nn.Linear
    with lossscale.keep_fp32(net, "b") as h3:
        assert kept_modules(net) == ["b", "c.0"] and h3.names == ["b"]
    assert kept_modules(net) == ["c.0"]
    assert release(net) == ["c.0"] and kept_modules(net) == []
    assert all(not is_kept(m) for m in net.modules())


def test_the_root_and_nested_modules_can_be_kept():
    net = _net()
    lossscale.keep_fp32(net, ["", "c"])
    with torch.autocast(**AUTOCAST):
        assert net(torch.randn(2, 8)).dtype == torch.float32
    assert kept_modules(net) == ["", "c"]


# ------------------------------------------------------------------ state_dict, pickle, deepcopy
def test_state_dict_keys_and_values_are_the_plain_models_and_load_both_ways():
    net, plain = _net(), _net()
    keys = list(plain.state_dict())
    lossscale.keep_fp32(net, ["a", "c"])
    sd = net.state_dict()
    assert list(sd) == keys and all(torch.equal(sd[k], v) for k, v in plain.state_dict().items())
    assert vars(net.a).keys() == vars(plain.a).keys()  # nothing stored on the instance
    other = _net(seed=3)
    plain.load_state_dict(other.state_dict())
    net.load_state_dict(other.state_dict())
    assert kept_modules(net) == ["a", "c"] and torch.equal(net.a.weight, other.a.weight)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    assert list(torch.load(buf, weights_only=True)) == keys


@pytest.mark.parametrize("copier", ["pickle", "deepcopy", "torch.save"])
def test_pickling_and_deepcopy_keep_the_modules_kept(copier):
    net = _net()
    lossscale.keep_fp32(net, ["b"], cast_back=True)
    lossscale.keep_fp32(net, ["c.0"])
    if copier == "pickle":
        twin = pickle.loads(pickle.dumps(net))
    elif copier == "deepcopy":
        twin = copy.deepcopy(net)
    else:
        buf = io.BytesIO()
        torch.save(net, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    assert kept_modules(twin) == ["b", "c.0"]
    assert type(twin.b)._lossscale_fp32_cast_back and not type(twin.c[0])._lossscale_fp32_cast_back
    x = torch.randn(3, 8)
    with torch.autocast(**AUTOCAST):
        assert torch.equal(twin(x), net(x))
        assert twin.c[0](x.half()).dtype == torch.float32
    assert list(twin.state_dict()) == list(net.state_dict())
    assert release(twin, ["b"]) == ["b"] and kept_modules(twin) == ["c.0"] and kept_modules(net) == ["b", "c.0"]


def test_a_module_that_refers_back_to_its_parent_deep_copies():
    net = _net()
    object.__setattr__(net.a, "owner", net)  # a back-reference (not a submodule)
    lossscale.keep_fp32(net, ["a"])
    twin = copy.deepcopy(net)
    assert twin.a.owner is twin and kept_modules(twin) == ["a"]


# ------------------------------------------------------------------ errors
def test_bad_arguments_raise_value_errors_that_say_what_to_do():
    net = _net()
    with pytest.raises(ValueError, match=r"'bb' is not a submodule name.*did you mean 'b'"):
        lossscale.keep_fp32(net, ["bb"])
    with pytest.raises(ValueError, match="not a submodule of the model"):
        lossscale.keep_fp32(net, [torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="model=.*torch.nn.Module"):
        lossscale.keep_fp32("net", ["a"])
    with pytest.raises(ValueError, match="cast_back=1 must be True or False"):
        lossscale.keep_fp32(net, ["a"], cast_back=1)
    with pytest.raises(ValueError, match="entries must be module names or module objects"):
        lossscale.keep_fp32(net, [3])
    with pytest.raises(ValueError, match="modules=3 must be a list"):
        lossscale.keep_fp32(net, 3)
    net.b.half()
    with pytest.raises(ValueError, match=r"'b' has a float16 parameter 'weight'.*\.float\(\)"):
        lossscale.keep_fp32(net, ["a", "b"])
    assert kept_modules(net) == []  # nothing kept when one entry is refused


# ------------------------------------------------------------------ a real GPT-2
transformers = pytest.importorskip("transformers")
from _gpt2 import gpt2_batch, gpt2_loss, overflowing_gpt2, tiny_gpt2, train_fp16  # noqa: E402


def _train(model, *, fused, steps=5):
    """``steps`` FP16 autocast steps with AdamW and lossscale's GradScaler: (losses, whether the parameters
    moved). Only the scaler's public training calls are used."""
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    losses = train_fp16(model, lossscale.GradScaler("cpu"), opt, steps)
    moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return losses, moved


@pytest.mark.parametrize("fused", [False, True])
def test_gpt2_with_an_overflowing_module_trains_only_when_it_is_kept_in_fp32(fused):
    model, name = overflowing_gpt2()
    losses, moved = _train(model, fused=fused)
    assert all(loss != loss or abs(loss) == float("inf") for loss in losses)  # every loss non-finite
    assert not moved  # every step skipped

    model, name = overflowing_gpt2()
    handle = lossscale.keep_fp32(model, [name])
    losses, moved = _train(model, fused=fused)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert moved
    assert all(torch.isfinite(p).all() for p in model.parameters())
    handle.remove()
    assert kept_modules(model) == [] and type(model.get_submodule(name)).__name__ == "Conv1D"
    with torch.no_grad(), torch.autocast(**AUTOCAST):
        assert not torch.isfinite(gpt2_loss(model, gpt2_batch(0)))  # removed: it overflows again


def test_gpt2_kept_module_survives_state_dict_pickle_and_deepcopy():
    model, name = overflowing_gpt2()
    keys = list(tiny_gpt2().state_dict())
    lossscale.keep_fp32(model, [name])
    assert list(model.state_dict()) == keys
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert kept_modules(twin) == [name]
        with torch.no_grad(), torch.autocast(**AUTOCAST):
            assert torch.isfinite(gpt2_loss(twin, gpt2_batch(0)))
    fresh, _ = overflowing_gpt2()
    fresh.load_state_dict(model.state_dict())  # the checkpoint loads into the plain model
    assert kept_modules(fresh) == []


def test_public_names():
    assert lossscale.keep_fp32 is fp32.keep_fp32
    assert fp32.keep_fp32.__doc__ and fp32.KeepFP32Handle.remove.__doc__
