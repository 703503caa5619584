"""``GradScaler(trace=True, on_backward_overflow="upcast")``: a module whose backward overflows FP16 with the
scale at 1 or below (or at its floor, if higher) is kept in FP32, widened to its enclosing module when
that does not end it.

The evidence is lossscale.demo.backward_overflow's model (built from its Config; the benchmark
benchmarks/bench_backward_overflow.py and ``lossscale audit-demo`` run it): one block whose backward
overflows FP16 at any scale >= 1 while its forward stays finite, trained with AdamW under CPU FP16
autocast. With a floor at 1 and without the option, no step is taken.
"""

import copy
import warnings

import pytest
import torch

import lossscale
from lossscale.demo import backward_overflow as bench
from lossscale.fp32 import kept_modules

STEPS = 24
CFG = bench.Config(steps=STEPS)


def _iteration(model, opt, scaler, step):
    x, y = bench.data(CFG, step)
    opt.zero_grad(set_to_none=True)
    scaler.scale(bench.loss_of(model, x, y, fp16=True)).backward()
    scaler.step(opt)
    scaler.update()
    return not scaler.last_step_skipped


def test_stuck_at_a_floor_of_1_without_it_trains_after_it():
    stuck = bench.train(CFG, "lossscale_min_scale_1")
    assert not any(not s for s in stuck["skipped"]) and stuck["scale"][-1] == 1.0  # stuck at the floor

    model = bench.Model(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=CFG.lr)
    scaler = lossscale.GradScaler(model=model, trace=True, on_backward_overflow="upcast", min_scale=1.0)
    taken, reports = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            taken.append(_iteration(model, opt, scaler, step))
            reports.append(scaler.overflow_report())
    messages = [str(w.message) for w in caught if w.category is UserWarning]
    # The first skip at the floor is reported stuck (on_stuck="warn", once) before the rule has its
    # second naming; the trace's line in it names the module.
    stuck = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert len(stuck) == 1 and "the backward of `block.up` overflowed fp16 at scale 2^0" in stuck[0]
    assert "the loss scale, at its floor (min_scale): it cannot back off" in stuck[0]
    assert "The backward of `block.up` overflows FP16 (a gradient above 65504) at every scale the floor" in stuck[0]
    # 2**16 backs off to the floor 1 in 16 skips; named at the floor twice -> block.up kept in FP32;
    # named again (its FP32 backward casts the gradient back to FP16 at its edge) -> the block; trains.
    assert taken == [False] * 19 + [True] * (STEPS - 19)
    assert (
        "the backward of `block.up` overflowed FP16 with the scale at 1 or below (or at its floor) on 2 steps"
        in (messages[0])
    )
    assert "its enclosing module `block` now runs in FP32" in messages[1] and len(messages) == 2
    assert [r["backward"] for r in reports[16:19]] == ["block.up"] * 3 and reports[16]["upcast"] is None
    assert reports[17]["upcast"] == "block.up" and reports[18]["upcast"] == "block"
    assert "now runs in FP32 (on_backward_overflow='upcast')" in reports[18]["cause"]
    assert kept_modules(model) == ["block", "block.up"]
    health = scaler.health()
    assert health.upcast_modules == ("block.up", "block") and health.backward_upcasts == ("block.up", "block")
    assert health.upcasts == 2 and scaler.counters()["upcasts"] == 2
    assert (
        "after their backward overflowed FP16 with the scale at 1 or below, or at its floor "
        "(on_backward_overflow='upcast'): block.up, block."
        in health.text
        and "forward overflows" not in health.text
    )
    assert all(torch.isfinite(p).all() for p in model.parameters())

    # Kept in the checkpoint: a fresh model and scaler loading it keep the block in FP32 and train at once.
    state = scaler.state_dict()
    assert state["upcast_backward"] == ["block.up", "block"] and state["upcast_backward_seen"] == {"block.up": 2}
    fresh = bench.Model(CFG)
    fresh.load_state_dict(model.state_dict())
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=CFG.lr)
    fresh_opt.load_state_dict(opt.state_dict())
    resumed = lossscale.GradScaler(model=fresh, trace=True, on_backward_overflow="upcast", min_scale=1.0)
    resumed.load_state_dict(state)
    assert kept_modules(fresh) == ["block", "block.up"] and resumed.health().backward_upcasts == ("block.up", "block")
    assert _iteration(fresh, fresh_opt, resumed, STEPS)
    scaler.close()
    resumed.close()


def test_with_the_default_floor_it_acts_once_the_scale_is_at_1_or_below():
    # The default floor, 2**-24, lets the scale back off below 1. The rule counts only the steps skipped at
    # a scale of 1 or below (above 1 the trace names head, then block.up, as the scale calibrates): named at
    # 1 and at 1/2, block.up is kept in FP32; from 1/4 on it trains, as many steps as torch's scaler takes.
    model = bench.Model(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=CFG.lr)
    scaler = lossscale.GradScaler(model=model, trace=True, on_backward_overflow="upcast")
    assert scaler.state().scale == 2.0**16 and lossscale.DynamicPolicy().min_scale == 2.0**-24
    taken, scales, reports = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            scales.append(scaler.get_scale())
            taken.append(_iteration(model, opt, scaler, step))
            reports.append(scaler.overflow_report())
    assert scales[15:19] == [2.0, 1.0, 0.5, 0.25]
    assert taken == [False] * 18 + [True] * (STEPS - 18)
    assert [r["backward"] for r in reports[:18]] == ["head"] * 5 + ["block.up"] * 13  # above 1: not counted
    assert reports[17]["upcast"] == "block.up" and all(r["upcast"] is None for r in reports[:17])
    messages = [str(w.message) for w in caught if w.category is UserWarning]
    assert (
        len(messages) == 1
        and "the backward of `block.up` overflowed FP16 with the scale at 1 or below" in (messages[0])
    )
    assert not [w for w in caught if w.category is RuntimeWarning]  # never stuck: the scale backs off below 1
    assert kept_modules(model) == ["block.up"] and scaler.state_dict()["upcast_backward_seen"] == {"block.up": 2}
    assert sum(taken) == sum(not s for s in bench.train(CFG, "torch")["skipped"])
    scaler.close()


def test_no_floor_no_backward_upcast():
    # min_scale=None backs off as torch's does: below 1, where this block fits; nothing is kept.
    model = bench.Model(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=CFG.lr)
    scaler = lossscale.GradScaler(model=model, trace=True, on_backward_overflow="upcast", min_scale=None)
    taken = [_iteration(model, opt, scaler, step) for step in range(STEPS)]
    assert kept_modules(model) == [] and scaler.get_scale() < 1 and any(taken)
    assert taken == [not s for s in bench.train(CFG, "torch")["skipped"]]  # step for step torch's
    scaler.close()


def test_a_top_level_module_that_still_overflows_says_to_lower_the_floor():
    # The block itself at the top: kept, named again, nothing encloses it but the model.
    cfg = CFG
    model = bench.Block(cfg)
    torch.manual_seed(0)
    head = torch.nn.Linear(cfg.d, cfg.d_out)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    scaler = lossscale.GradScaler(
        model=model, trace=True, on_backward_overflow="upcast", upcast_after=1, init_scale=1.0
    )
    x = torch.randn(cfg.batch, cfg.d) * 4
    caught = []
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            out = head(model(x.half()))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            scaler.scale(out.float().pow(2).sum() * 64).backward()
            scaler.step(opt)
            scaler.update()
        caught += w
    assert kept_modules(model) == ["up"]
    last = [m for m in caught if "no enclosing module is left" in str(m.message)]
    assert len(last) == 1 and "GradScaler(min_scale=2**-24)" in str(last[0].message)
    assert last[0].category is RuntimeWarning
    scaler.close()


def test_the_option_is_validated():
    model = bench.Model(CFG)
    with pytest.raises(ValueError, match="on_backward_overflow='upcast' needs trace=True"):
        lossscale.GradScaler(model=model, on_backward_overflow="upcast")
    with pytest.raises(ValueError, match="on_backward_overflow='fp32' must be one of"):
        lossscale.GradScaler(model=model, trace=True, on_backward_overflow="fp32")
    with pytest.raises(ValueError, match="upcast_after=3 applies only"):
        lossscale.GradScaler(upcast_after=3)
    scaler = lossscale.GradScaler(model=model, trace=True, on_backward_overflow="upcast")
    bad = {"upcast_modules": ["block"], "upcast_seen": {}, "upcast_backward": ["block.up"], "upcast_backward_seen": {}}
    base = scaler.state_dict()
    with pytest.raises(ValueError, match="must be among 'upcast_modules'"):
        scaler.load_state_dict({**base, **bad})
    assert kept_modules(model) == []  # validated before anything changed
    assert copy.deepcopy(scaler)._upcast.backward  # a copy keeps the rule
    scaler.close()


@pytest.mark.filterwarnings("ignore:lossscale. the checkpoint's policy replaces")  # init_scale 4.0: on purpose
def test_a_checkpoints_upcast_entries_load_as_saved_and_bad_ones_are_refused_by_key():
    model = bench.Model(CFG)
    scaler = lossscale.GradScaler(model=model, trace=True, on_backward_overflow="upcast", init_scale=2.0**10)
    other = lossscale.GradScaler(model=bench.Model(CFG), trace=True, on_backward_overflow="upcast", init_scale=4.0)
    saved = {
        **other.state_dict(),  # another scale: a refused load must not have taken it
        "upcast_modules": ["block.up", "block"],
        "upcast_seen": {"block.up": 0},  # a count of 0 is a count
        "upcast_backward": ["block.up", "block"],
        "upcast_backward_seen": {"block.up": 2},
    }
    for key, bad in (
        ("upcast_modules", ["block", 3]),
        ("upcast_backward", "block"),
        ("upcast_seen", {"block": -1}),
        ("upcast_backward_seen", {"block.up": -1}),
        ("upcast_modules", ["block.up", "block", "block.nowhere"]),
    ):
        with pytest.raises(ValueError, match=f"'{key}'=" if "nowhere" not in str(bad) else "block.nowhere"):
            scaler.load_state_dict({**saved, key: bad})
        # refused before anything changed: the scale, the account, the model
        assert scaler.get_scale() == 2.0**10 and scaler.state_dict()["upcast_modules"] == []
        assert scaler.state_dict()["upcast_backward_seen"] == {} and kept_modules(model) == []
    scaler.load_state_dict(saved)
    assert kept_modules(model) == ["block", "block.up"] and scaler.get_scale() == 4.0
    assert {k: scaler.state_dict()[k] for k in saved if k.startswith("upcast")} == {
        k: v for k, v in saved.items() if k.startswith("upcast")
    }
    # A copy keeps the account, not the model: it loads a checkpoint as an account only.
    twin = copy.deepcopy(scaler)
    fresh_model = bench.Model(CFG)
    twin.load_state_dict({**saved, "upcast_modules": ["block"], "upcast_backward": ["block"]})
    assert twin.state_dict()["upcast_modules"] == ["block"] and twin.counters()["upcasts"] == 1
    assert kept_modules(fresh_model) == [] and kept_modules(model) == ["block", "block.up"]
    # Without the counts (only the modules saved), the modules are kept and the counts start at none.
    third = lossscale.GradScaler(model=fresh_model, trace=True, on_backward_overflow="upcast", init_scale=4.0)
    third.load_state_dict({k: v for k, v in saved.items() if not k.endswith("_seen")})
    assert kept_modules(fresh_model) == ["block", "block.up"]
    assert third.state_dict()["upcast_seen"] == {} and third.state_dict()["upcast_backward_seen"] == {}
    scaler.close()
    other.close()
    third.close()


def test_off_by_default_nothing_is_held():
    assert lossscale.GradScaler()._upcast is None
    assert lossscale.GradScaler(model=bench.Model(CFG), trace=True)._upcast is None


@pytest.mark.parametrize("trace", [False, True])
def test_health_points_at_the_trace_when_it_is_on(trace):
    """Stuck at a floor of 1 on the backward overflow: health() tells how to find the module. With the
    trace on it points at the trace, not at turning it on."""
    model = bench.Model(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=CFG.lr)
    scaler = lossscale.GradScaler(model=model if trace else None, trace=trace, min_scale=1.0, on_stuck="ignore")
    for step in range(18):  # 2**16 backs off to the floor 1 in 16 skips, then skips there
        _iteration(model, opt, scaler, step)
    text = scaler.health().text
    assert "lossscale health: stuck." in text
    if trace:
        assert "the trace (scaler.overflow_report()) names the first module" in text
        assert "GradScaler(model=model, trace=True) names" not in text
    else:
        assert "GradScaler(model=model, trace=True) names the first module" in text
