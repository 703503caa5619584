"""Checkpoints (``lossscale.checkpoint``, ``GradScaler.state_dict/load_state_dict``) and the scaler's
other round trips: issue 12's bugs 1-3 and 7-9, each with a regression test (bug 6, the keywords of
another policy, is in test_keywords.py), the property test that every loader must pass, and the
mutation-killing tests of the loader (issue 15).

The standard (issue 12): a corrupted checkpoint either loads a state that trains with finite weights,
or raises ``ValueError`` naming the key, with the scaler's ``state_dict()`` unchanged.
"""

import copy
import dataclasses
import math
import pickle
import re
import warnings

import numpy as np
import pytest
import torch
from _models import TORCH_LIKE, backward, drive, quiet, tiny_mlp
from _rules import f32
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lossscale
from lossscale import AdaptivePolicy, DynamicPolicy, LogMaxPolicy, ScaleState, StaticPolicy
from lossscale.adaptive import AdaptiveState
from lossscale.checkpoint import to_dict
from lossscale.dynamic import DynamicState
from lossscale.logmax import LogMaxState
from lossscale.static import StaticState

NAN, INF = float("nan"), float("inf")


def train(scaler, steps=3, model=None, first=0, fused=False):
    """A few real iterations of the tiny MLP under fp16 autocast (CPU); returns the model. ``fused``:
    Adam(fused=True), whose flags stay on device (the tensor rule); else SGD (the host runs the rule)."""
    model = model if model is not None else tiny_mlp()
    opt = (
        torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
        if fused
        else torch.optim.SGD(model.parameters(), lr=0.05)
    )
    for step in range(first, first + steps):
        opt.zero_grad()
        backward(model, scaler, step)
        scaler.step(opt)
        scaler.update()
    return model


def finite(model) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def refuses(scaler, state_dict, match):
    """``load_state_dict`` raises ValueError matching ``match`` and changes nothing (the warnings that
    fire by design on the way, such as a replaced policy's, silenced)."""
    before = scaler.state_dict(), scaler.state()
    with pytest.raises(ValueError, match=match):
        quiet(lambda: scaler.load_state_dict(state_dict))
    assert (scaler.state_dict(), scaler.state()) == before


# ------------------------------------------------------------------------------------------ bug 1
def test_zero_scale_is_refused_instead_of_training_into_nan():
    # The reproduction: accepted before, and the next iteration wrote NaN into the weights.
    scaler = lossscale.GradScaler()
    sd = copy.deepcopy(scaler.state_dict())
    sd["state"]["scale"] = 0.0
    refuses(scaler, sd, r"state\.scale")
    assert finite(train(scaler))


@pytest.mark.parametrize("value", [0.0, -1.0, NAN, INF, 2.0**30, True, "abc", None])
def test_bad_state_scale_is_refused(value):
    scaler = lossscale.GradScaler()
    train(scaler, 1)
    sd = copy.deepcopy(scaler.state_dict())
    sd["state"]["scale"] = value
    refuses(scaler, sd, r"state\.scale")


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("steps", -1, r"state\.steps"),
        ("steps", 1.5, r"state\.steps"),
        ("steps", True, r"state\.steps"),
        ("steps", 2**70, r"state\.steps"),
        ("skipped_steps", 99, "skipped_steps"),
        ("nan_steps", 1, "nan_steps"),
        ("overflow_streak", 5, "overflow_streak"),
        ("streak_start_scale", NAN, r"state\.streak_start_scale"),
        ("streak_start_scale", 1e39, r"state\.streak_start_scale"),  # inf in the float32 device vector
        ("growth_tracker", 7, r"state\.growth_tracker.*growth_interval"),
        ("growth_tracker", "x", r"state\.growth_tracker"),
        ("hysteresis_tracker", 4, r"state\.hysteresis_tracker.*hysteresis=3"),
        ("hysteresis_tracker", -1, r"state\.hysteresis_tracker"),
    ],
)
def test_every_dynamic_state_field_is_validated(field, value, match):
    scaler = lossscale.GradScaler(growth_interval=7, hysteresis=3)
    drive(scaler, (True, False, True))
    sd = copy.deepcopy(scaler.state_dict())
    sd["state"][field] = value
    refuses(scaler, sd, match)


def test_scale_beyond_float32_is_refused_when_unbounded():
    # With max_scale=None / min_scale=None the bounds cannot catch it, but the float32 device scale
    # would hold inf. A subnormal scale and 0 are where torch's unbounded backoff goes (min_scale=None
    # is torch's rule): they load, as torch's scaler loads them.
    scaler = lossscale.GradScaler(min_scale=None, max_scale=None)
    for value in (1e39, -1.0):
        sd = scaler.state_dict()
        sd["state"]["scale"] = value
        refuses(scaler, sd, r"state\.scale")
    for value in (2.0**-149, 0.0):
        sd = scaler.state_dict()
        sd["state"]["scale"] = sd["scale"] = value
        scaler.load_state_dict(sd)
        assert scaler.get_scale() == value


@pytest.mark.parametrize("value", [True, "2", 2.0, None, 3])
def test_version_must_be_a_known_int(value):
    scaler = lossscale.GradScaler()
    sd = scaler.state_dict()
    sd["lossscale_version"] = value
    refuses(scaler, sd, "lossscale_version")


def test_lossscale_dict_without_its_version_is_not_read_as_a_torch_dict():
    # Read as a torch dict it would keep the scale but silently drop the policy and every counter.
    scaler = lossscale.GradScaler()
    drive(scaler, (True, False))
    sd = scaler.state_dict()
    del sd["lossscale_version"]
    refuses(lossscale.GradScaler(), sd, "lossscale_version")


@pytest.mark.parametrize(
    "policy, field, value, match",
    [
        ("adaptive", "window_exp", 500, r"state\.window_exp"),
        ("adaptive", "calibrated", 1, r"state\.calibrated"),
        ("logmax", "b1_correction", 0.0, r"state\.b1_correction"),
        ("logmax", "x_hat", 1e300, r"state\.x_hat"),  # squared to inf - inf = NaN in the rule
        ("logmax", "xsquared_hat", -1.0, r"state\.xsquared_hat"),
        ("logmax", "scale", 3.0, r"state\.scale.*power of two"),
    ],
)
def test_measuring_policies_validate_their_own_fields(policy, field, value, match):
    scaler = lossscale.GradScaler(policy=policy)
    train(scaler, 2)
    sd = copy.deepcopy(scaler.state_dict())
    sd["state"][field] = value
    refuses(scaler, sd, match)


def test_adaptive_window_needs_calibration():
    # A measured window in a policy that never calibrated: "an amax field consistent with its policy".
    scaler = lossscale.GradScaler(policy="adaptive")
    sd = scaler.state_dict()
    assert sd["state"]["calibrated"] is False
    sd["state"]["window_exp"] = 3
    refuses(scaler, sd, r"state\.window_exp")


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("init_scale", NAN, "init_scale"),
        ("growth_interval", 0, "growth_interval"),
        ("growth_interval", 2**70, "growth_interval"),  # would overflow the int64 device comparison
        ("hysteresis", True, "hysteresis"),
        ("on_stuck", "maybe", "on_stuck"),
        ("bogus", 1, "bogus"),
    ],
)
def test_every_policy_config_field_is_validated(key, value, match):
    scaler = lossscale.GradScaler()
    sd = scaler.state_dict()
    sd["policy"][key] = value
    refuses(scaler, sd, match)


def test_missing_policy_config_key_is_refused():
    # A default silently standing in for a saved setting is jmp's round-trip bug.
    scaler = lossscale.GradScaler(hysteresis=4)
    sd = scaler.state_dict()
    del sd["policy"]["hysteresis"]
    refuses(scaler, sd, "hysteresis")


@pytest.mark.parametrize("key, value", [("scale", 2.0**3), ("_growth_tracker", 1), ("growth_interval", 5)])
def test_torch_keys_of_a_lossscale_dict_must_agree_with_its_state(key, value):
    # They are copies for torch's loader; an edited copy is ambiguous, so it is refused, not ignored.
    scaler = lossscale.GradScaler()
    sd = scaler.state_dict()
    sd[key] = value
    refuses(scaler, sd, f"'{key}'.*disagrees")


@pytest.mark.parametrize(
    "key, value",
    [
        ("scale", "abc"),
        ("_growth_tracker", None),
        ("growth_factor", NAN),
        ("growth_interval", 2.5),
        ("backoff_factor", True),
        ("scale", -2.0),
    ],
)
def test_torch_dict_errors_name_the_key(key, value):
    sd = torch.amp.GradScaler("cpu").state_dict()
    sd[key] = value
    refuses(lossscale.GradScaler(), sd, f"'{key}'")


def test_torch_scale_above_max_scale_moves_the_bound_and_names_the_scale_not_init_scale():
    # torch's scale is unbounded, so its checkpoint loads: the bound moves to it, said in one warning.
    sd = torch.amp.GradScaler("cpu", init_scale=2.0**30).state_dict()
    scaler = lossscale.GradScaler(max_scale=2.0**20)  # a bound the user gave moves too: torch's dict wins
    with pytest.warns(UserWarning, match="scale=1073741824.0 is above max_scale=1048576.0") as caught:
        scaler.load_state_dict(sd)
    assert len(caught) == 1 and "init_scale" not in str(caught[0].message)
    assert scaler.get_scale() == 2.0**30 and scaler.policy.max_scale == 2.0**30
    unbounded = lossscale.GradScaler(max_scale=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        unbounded.load_state_dict(sd)
    assert unbounded.get_scale() == 2.0**30 and unbounded.policy.max_scale is None


# ------------------------------------------------------------------------------------------ bug 2
def test_failed_load_leaves_nothing_half_changed():
    # The case: a lossscale dict whose policy differs and whose growth_tracker is "x". Before,
    # the policy and pending state were swapped in, then building the device state failed.
    scaler = lossscale.GradScaler(init_scale=2.0**8, growth_interval=10)
    model = train(scaler, 2)
    twin, twin_model = copy.deepcopy(scaler), copy.deepcopy(model)
    other = lossscale.GradScaler(init_scale=2.0**4, growth_interval=50, hysteresis=2)
    sd = other.state_dict()
    sd["state"]["growth_tracker"] = "x"
    before = scaler.state_dict()
    with pytest.raises(ValueError, match=r"state\.growth_tracker"):
        quiet(lambda: scaler.load_state_dict(sd))
    assert scaler.state_dict() == before
    assert scaler.policy == twin.policy and scaler.get_growth_interval() == 10
    # ... and it trains on exactly as an untouched twin.
    train(scaler, 3, model, first=2)
    train(twin, 3, twin_model, first=2)
    assert scaler.state_dict() == twin.state_dict()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin_model.parameters()))


def test_failed_load_before_the_first_step_changes_nothing():
    scaler = lossscale.GradScaler(growth_interval=10)
    sd = lossscale.GradScaler(policy="adaptive").state_dict()
    sd["state"]["window_exp"] = "x"
    refuses(scaler, sd, r"state\.window_exp")
    assert isinstance(scaler.policy, lossscale.DynamicPolicy) and scaler.device is None


# ------------------------------------------------------------------------------------------ bug 3
@pytest.mark.parametrize("bounded", [True, False])
@pytest.mark.parametrize("bad", [NAN, INF, -INF, 0.0, -4.0, 1e-40])
def test_bad_tensor_new_scale_is_ignored_on_device(bad, bounded):
    bounds = {} if bounded else dict(min_scale=None, max_scale=None)
    scaler = lossscale.GradScaler(init_scale=2.0**8, **bounds)
    model = train(scaler, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    backward(model, scaler, 1)
    scaler.step(opt)
    # Not clamped to a bound either: inf is no request for max_scale, nor 0 for min_scale.
    scaler.update(new_scale=torch.tensor(bad))
    assert scaler.get_scale() == 2.0**8 and scaler.state().steps == 2
    assert finite(train(scaler, 3, model, first=2))
    assert math.isfinite(scaler.get_scale()) and scaler.get_scale() > 0


def test_good_tensor_new_scale_is_clamped_to_the_bounds():
    scaler = lossscale.GradScaler(init_scale=2.0**8, max_scale=2.0**10)
    train(scaler, 1)
    scaler.update(new_scale=torch.tensor(2.0**20))
    assert scaler.get_scale() == 2.0**10
    scaler.update(new_scale=torch.tensor(2.0**5, dtype=torch.float64))
    assert scaler.get_scale() == 2.0**5


@pytest.mark.parametrize("bad", [1e39, 1e-50, 1e-40])
def test_float_new_scale_beyond_float32_is_refused(bad):
    scaler = lossscale.GradScaler(min_scale=None, max_scale=None)
    train(scaler, 1)
    before = scaler.state_dict()
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(new_scale=bad)
    assert scaler.state_dict() == before


@pytest.mark.parametrize("fused", [False, True], ids=["synced", "fused"])
def test_stuck_check_catches_a_bad_scale_written_from_outside(fused):
    # update() no longer lets one in, but the scale tensor is reachable (torch's _get_scale_async,
    # which frameworks use). Every step is then skipped: the stuck check must say why, at once.
    scaler = lossscale.GradScaler(init_scale=2.0**8, on_stuck="raise")
    model = train(scaler, 1, fused=fused)
    scaler._get_scale_async().fill_(NAN)
    with pytest.raises(RuntimeError, match="scale itself is nan"):
        train(scaler, 3, model, first=1, fused=fused)
    assert finite(model)


@pytest.mark.parametrize("fused", [False, True], ids=["synced", "fused"])
def test_an_inf_scale_written_from_outside_skips_one_step_and_is_clamped_to_max_scale(fused):
    # The rule runs on the device state on every path: an inf backs off to inf, which the bound
    # clamps to max_scale; the step that ran at inf is skipped, training goes on from there.
    scaler = lossscale.GradScaler(init_scale=2.0**8, max_scale=2.0**10, on_stuck="raise")
    model = train(scaler, 1, fused=fused)
    scaler._get_scale_async().fill_(INF)
    train(scaler, 1, model, first=1, fused=fused)
    assert scaler.last_step_skipped and scaler.get_scale() == 2.0**10
    train(scaler, 2, model, first=2, fused=fused)
    assert not scaler.last_step_skipped and finite(model)


def test_unbounded_backoff_goes_on_as_torchs_and_is_stuck_below_float32s_smallest_normal():
    # torch's setting (min_scale=None) goes on halving into the subnormals and then to 0, whose float32
    # inverse is inf: lossscale's too (bitwise torch's), and the stuck check says so once it is there.
    scaler = lossscale.GradScaler(init_scale=2.0**-125, min_scale=None)
    with pytest.warns(RuntimeWarning, match=r"consecutive skipped(.|\n)*The scale itself is 5\.877\d*e-39"):
        drive(scaler, (True, True, True))
    assert scaler.get_scale() == 2.0**-128
    p = scaler.policy
    assert p.update(p.update(p.init_state(), found_inf=True), found_inf=True).scale == 2.0**-127  # pure form


@pytest.mark.parametrize("policy", ["dynamic", "static", "adaptive", "logmax"])
def test_every_policy_calls_a_nonfinite_scale_stuck(policy):
    p = lossscale.GradScaler(policy=policy, max_consecutive_skips=50).policy
    for bad in (NAN, INF, 0.0):
        state = p.init_state().replace(scale=bad, steps=1, skipped_steps=1, inf_steps=1, overflow_streak=1)
        assert p.is_stuck(state, bad)
        assert "scale itself" in lossscale.diagnose(p, state)


# ------------------------------------------------------------------------------------------ bug 7
def test_passthrough_says_what_it_does_with_a_scale():
    with pytest.raises(ValueError, match="passthrough.*fixes the scale at 1") as e:
        lossscale.GradScaler.passthrough(init_scale=1024)
    assert "policy object" not in str(e.value)  # the user passed no policy
    assert "policy='static'" in str(e.value)  # and it says how to get a fixed scale


# ------------------------------------------------------------------------------------------ bug 8
def test_checkpoint_policy_wins_with_a_warning_naming_the_change():
    saved = lossscale.GradScaler(policy="adaptive")
    train(saved, 2)
    scaler = lossscale.GradScaler()
    with pytest.warns(UserWarning, match="DynamicPolicy -> AdaptivePolicy") as record:
        scaler.load_state_dict(saved.state_dict())
    assert record[0].filename == __file__
    assert scaler.policy == saved.policy and scaler.state() == saved.state()


def test_changed_config_is_named_field_by_field():
    saved = lossscale.GradScaler(hysteresis=3, on_stuck="ignore")
    scaler = lossscale.GradScaler()
    with pytest.warns(UserWarning, match=r"hysteresis: 1 -> 3, on_stuck: 'warn' -> 'ignore'"):
        scaler.load_state_dict(saved.state_dict())
    assert scaler.policy == saved.policy


def test_a_checkpoint_of_the_floor_at_1_loads_and_keeps_its_floor():
    # The dynamic policy's default floor was 1.0; it is 2**-24 now. A checkpoint saved with a floor at 1
    # (the old default, or min_scale=1.0 by name) restores that run: its floor wins, named in the warning;
    # loaded by a scaler built with min_scale=1.0 it loads silently. A torch checkpoint loads silently.
    saved = lossscale.GradScaler(min_scale=1.0)
    drive(saved, (True, True, False))
    sd = saved.state_dict()
    assert sd["policy"]["min_scale"] == 1.0
    scaler = lossscale.GradScaler()
    with pytest.warns(UserWarning, match=r"min_scale: 5\.96\d*e-08 -> 1\.0"):
        scaler.load_state_dict(sd)
    assert scaler.policy.min_scale == 1.0 and scaler.state() == saved.state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lossscale.GradScaler(min_scale=1.0).load_state_dict(sd)
        fresh = lossscale.GradScaler()
        fresh.load_state_dict(torch.amp.GradScaler("cpu").state_dict())
    assert fresh.policy.min_scale == 2.0**-24 and fresh.get_scale() == 2.0**16


def test_same_policy_loads_silently():
    saved = lossscale.GradScaler(hysteresis=3)
    drive(saved, (True, False))
    scaler = lossscale.GradScaler(hysteresis=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.load_state_dict(saved.state_dict())
    assert scaler.state_dict() == saved.state_dict()


def test_torch_dict_factors_win_with_a_warning():
    sd = torch.amp.GradScaler("cpu", growth_interval=100).state_dict()
    scaler = lossscale.GradScaler(hysteresis=2)
    with pytest.warns(UserWarning, match="growth_interval: 2000 -> 100"):
        scaler.load_state_dict(sd)
    assert scaler.get_growth_interval() == 100 and scaler.policy.hysteresis == 2  # ours kept: torch has none


# ------------------------------------------------------------------------------------------ bug 9
def _overflow_names(model, scaler):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    backward(model, scaler, 7)
    model[0].weight.grad[0, 0] = INF
    model[2].bias.grad[0] = NAN
    scaler.step(opt)
    scaler.update()
    return {k: v for k, v in scaler.overflow_report().items() if k in ("inf", "nan")}


@pytest.mark.parametrize(
    "round_trip",
    [
        lambda m, s: pickle.loads(pickle.dumps((m, s))),
        lambda m, s: pickle.loads(pickle.dumps((s, m)))[::-1],
        lambda m, s: copy.deepcopy((m, s)),
        lambda m, s: copy.deepcopy({"model": m, "scaler": s}).values(),
    ],
    ids=["pickle", "pickle-scaler-first", "deepcopy", "deepcopy-dict"],
)
def test_overflow_report_names_survive_a_round_trip(round_trip):
    model = tiny_mlp()
    scaler = lossscale.GradScaler(model=model, on_stuck="ignore")
    train(scaler, 1, model)
    model2, scaler2 = round_trip(model, scaler)
    assert _overflow_names(model2, scaler2) == {"inf": ["0.weight"], "nan": ["2.bias"]}
    assert _overflow_names(model, scaler) == {"inf": ["0.weight"], "nan": ["2.bias"]}  # the original too


def test_pickling_the_scaler_alone_pickles_no_parameter():
    model = torch.nn.Sequential(torch.nn.Linear(256, 256))  # 256 KiB of weights
    scaler = lossscale.GradScaler(model=model)
    assert len(pickle.dumps(scaler)) < 16_384
    alone = pickle.loads(pickle.dumps(scaler))
    assert alone._names(model[0].weight) == "0.weight"  # the same process's parameters: still named
    twin = copy.deepcopy(scaler)
    assert twin._names(model[0].weight) == "0.weight"


def test_a_reused_id_does_not_inherit_a_stale_name():
    scaler = lossscale.GradScaler(model=[("gone", torch.zeros(3))])  # freed at once; its id may come back
    fresh = [torch.zeros(3) for _ in range(64)]
    assert all(scaler._names(t) is None for t in fresh)


def test_name_parameters_refuses_what_is_not_a_tensor():
    with pytest.raises(ValueError, match="'w'"):
        lossscale.GradScaler(model=[("w", 3.0)])


# --------------------------------------------------------------------------- torch dicts of tensors
@pytest.mark.parametrize("shape", [(), (1,)])
def test_torch_dict_of_one_element_tensors_loads(shape):
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=5)
    sd = {k: torch.tensor(v).reshape(shape) for k, v in ref.state_dict().items()}
    sd["_growth_tracker"] = torch.tensor(3, dtype=torch.int32).reshape(shape)
    scaler = lossscale.GradScaler()
    quiet(lambda: scaler.load_state_dict(sd))
    assert scaler.get_scale() == 2.0**10 and scaler._get_growth_tracker() == 3
    assert scaler.get_growth_interval() == 5 and scaler.get_growth_factor() == 2.0
    assert finite(train(scaler))
    sd["scale"] = torch.tensor([2.0, 4.0])
    refuses(scaler, sd, "'scale' must hold one number")


# ------------------------------------------------------- state_dict() keeps every field (issue 15)
# The tests from here to the property test are mutation-killing tests: "Kills: ..." names the one-line
# change to the library each was seen to fail on (docs/testing.md).
#: A value off its default for every shared field (a consistent state: check_state accepts it).
_SHARED = dict(
    scale=2.0**10,
    steps=9,
    skipped_steps=5,
    inf_steps=3,
    nan_steps=2,
    bad_loss_steps=2,
    overflow_streak=2,
    streak_nan_steps=1,
    streak_bad_loss_steps=1,
    streak_start_scale=2.0**12,
)


def _every_field_set():
    """A policy of each kind and a state in which every field differs from its default."""
    shared = {f.name: _SHARED[f.name] for f in dataclasses.fields(ScaleState)}  # a new field must be added
    return [
        (
            DynamicPolicy(init_scale=2.0**14, growth_interval=10, hysteresis=3, max_consecutive_skips=9),
            DynamicState(**shared, growth_tracker=4, hysteresis_tracker=2),
        ),
        (StaticPolicy(scale=2.0**10, max_consecutive_skips=9), StaticState(**shared, growth_tracker=7)),
        (
            AdaptivePolicy(growth_interval=10, hysteresis=3, max_scale=None),
            AdaptiveState(**shared, growth_tracker=3, hysteresis_tracker=2, calibrated=True, window_exp=-7),
        ),
        (
            LogMaxPolicy(init_scale=2.0**3, min_scale=1.0, max_scale=2.0**20),
            LogMaxState(
                **shared, x_hat=-3.25, slow_x_hat=-1.5, xsquared_hat=4.75, b1_correction=0.9801, b2_correction=0.998001
            ),
        ),
    ]


def _fields(state):
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}


@pytest.mark.parametrize("policy, state", _every_field_set(), ids=lambda v: type(v).__name__)
def test_state_dict_round_trip_keeps_every_field_of_the_state(policy, state):
    """Kills: state_dict() (checkpoint.to_dict) or the loader dropping or resetting any one field,
    e.g. the overflow streak (then a reload delays the max_consecutive_skips check); also a
    TensorState that mixes up two fields of one vector."""
    init = policy.init_state()
    for f in dataclasses.fields(state):  # the test only means something if every field is off its default
        if f.name == "scale" and isinstance(policy, StaticPolicy):
            continue  # a static scale is its config
        default = f.default if f.default is not dataclasses.MISSING else None
        assert getattr(state, f.name) not in (default, getattr(init, f.name)), f.name
    scaler = lossscale.GradScaler("cpu")
    scaler.init_device("cpu")
    quiet(lambda: scaler.load_state_dict(to_dict(policy, state)))
    assert _fields(scaler.state()) == _fields(state)  # the device state holds it all
    for other in (lossscale.GradScaler("cpu"), lossscale.GradScaler()):  # on device and before the first scale()
        quiet(lambda other=other: other.load_state_dict(scaler.state_dict()))
        assert type(other.state()) is type(state) and _fields(other.state()) == _fields(state)
        assert other.policy == policy
    assert _fields(pickle.loads(pickle.dumps(scaler)).state()) == _fields(state)


# ------------------------------------------------------ a torch checkpoint taken mid-run (tracker > 0)
def _clean_steps(scaler, p, opt, n):
    scales = []
    for _ in range(n):
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def test_torch_checkpoint_taken_mid_run_grows_at_the_same_step_as_torch():
    """Kills: the torch-format loader ignoring ``_growth_tracker`` (the state starting with
    growth_tracker=0): torch grows 2 steps after the save, a reset tracker 5."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=5)
    _clean_steps(ref, p, opt, 3)
    assert ref._get_growth_tracker() == 3  # taken mid-run
    ours = lossscale.GradScaler("cpu", **TORCH_LIKE)
    quiet(lambda: ours.load_state_dict(ref.state_dict()))
    assert ours._get_growth_tracker() == 3 and ours.state().growth_tracker == 3
    q = torch.nn.Parameter(torch.ones(2))
    theirs = _clean_steps(ref, p, opt, 7)
    mine = _clean_steps(ours, q, torch.optim.SGD([q], lr=0.1), 7)
    assert mine == theirs == [2.0**10, 2.0**11, 2.0**11, 2.0**11, 2.0**11, 2.0**11, 2.0**12]


def test_our_checkpoint_taken_mid_run_continues_in_torch_at_the_same_step():
    """Kills: ``torch_state`` writing ``_growth_tracker`` as 0 (or dropping it): torch then grows
    late after loading our checkpoint."""
    ours = lossscale.GradScaler("cpu", init_scale=2.0**10, growth_interval=5, **TORCH_LIKE)
    p = torch.nn.Parameter(torch.ones(2))
    _clean_steps(ours, p, torch.optim.SGD([p], lr=0.1), 3)
    ref = torch.amp.GradScaler("cpu")
    ref.load_state_dict(ours.state_dict())
    assert ref._get_growth_tracker() == 3
    q = torch.nn.Parameter(torch.ones(2))
    assert _clean_steps(ref, q, torch.optim.SGD([q], lr=0.1), 3)[1] == 2.0**11


# ------------------------------------------------------------------------------ the loader's edges
def test_a_loaded_state_reads_as_the_device_holds_it_before_the_first_step():
    """Kills: ``field_kind`` naming float32 fields otherwise (then a loaded int scale, or a float64
    streak start, is not rounded to float32 until the first step)."""
    p = DynamicPolicy()
    sd = to_dict(p, p.init_state())
    sd["state"] = {**sd["state"], "scale": 1024, "streak_start_scale": 0.1}
    sd["scale"] = 1024.0
    scaler = lossscale.GradScaler()
    scaler.load_state_dict(sd)
    s = scaler.state()
    assert type(s.scale) is float and s.streak_start_scale == f32(0.1)


def _sd(policy=None, state=None, **changes):
    """A lossscale state dict (of a dynamic policy unless given), with top-level keys changed."""
    policy = DynamicPolicy() if policy is None else policy
    return {**to_dict(policy, policy.init_state() if state is None else state), **changes}


def test_lossscale_dict_refusals_name_what_is_wrong():
    """Kills: the loader's lists of missing/unknown keys emptied or ``or`` turned ``and`` (a dict then
    fails later with a TypeError or KeyError, or loads a default in place of a missing key), the names
    in its type checks, an unhashable policy_type reaching the registry."""
    base = _sd()
    refuses(lossscale.GradScaler(), {"lossscale_version": 2}, "missing")
    refuses(lossscale.GradScaler(), {**base, "policy_type": ["DynamicPolicy"]}, "policy_type")
    refuses(lossscale.GradScaler(), {**base, "policy": []}, "'policy' must be a dict")
    refuses(lossscale.GradScaler(), {**base, "state": []}, "'state' must be a dict")
    refuses(lossscale.GradScaler(), {**base, "policy": {**base["policy"], "bogus": 1}}, "unknown keys")
    config = dict(base["policy"])
    del config["hysteresis"]
    refuses(lossscale.GradScaler(), {**base, "policy": config}, "missing keys")
    adaptive = _sd(AdaptivePolicy())
    del adaptive["policy"]["fmt"]
    refuses(lossscale.GradScaler(), adaptive, "missing keys")
    refuses(lossscale.GradScaler(), {**base, "state": {**base["state"], "bogus": 1}}, "unknown keys")
    state = dict(base["state"])
    del state["steps"]
    refuses(lossscale.GradScaler(), {**base, "state": state}, "missing keys")


def test_every_torch_copy_in_a_lossscale_dict_is_checked():
    """Kills: the torch-key check stopping at the first key that is absent (``break`` for ``continue``)."""
    sd = _sd()
    del sd["scale"]
    sd["growth_factor"] = 3.0
    refuses(lossscale.GradScaler(), sd, "'growth_factor'")


def test_a_loaded_measuring_state_holds_floats_where_the_device_does():
    """Kills: ``_as_held`` not converting float64 fields (an int x_hat stays an int until the first step)."""
    p = LogMaxPolicy()
    sd = _sd(p, p.init_state().replace(x_hat=1, slow_x_hat=2, xsquared_hat=4))
    scaler = lossscale.GradScaler()
    quiet(lambda: scaler.load_state_dict(sd))
    s = scaler.state()
    assert all(type(getattr(s, n)) is float for n in ("x_hat", "slow_x_hat", "xsquared_hat"))


def test_torch_dict_edges():
    """Kills: the torch loader's bounds made strict (a scale on min_scale, max_scale or float32's
    smallest normal refused), its tracker check weakened (then check_state refuses it instead, without
    naming the torch key), its per-key validation dropped (the error no longer names the key), and a
    numpy value's size read from anywhere but ``size``."""
    torch_sd = dict(scale=2.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=5, _growth_tracker=4)
    for scale in (2.0, 2.0**20):
        s = lossscale.GradScaler(min_scale=2.0, max_scale=2.0**20, growth_interval=5)
        s.load_state_dict({**torch_sd, "scale": scale})
        assert s.get_scale() == scale and s._get_growth_tracker() == 4
    tiny = lossscale.GradScaler(min_scale=None, growth_interval=5)
    tiny.load_state_dict({**torch_sd, "scale": 2.0**-126})
    assert tiny.get_scale() == 2.0**-126
    refuses(lossscale.GradScaler(growth_interval=5), {**torch_sd, "_growth_tracker": 5}, "'_growth_tracker'")
    refuses(lossscale.GradScaler(growth_interval=5), {**torch_sd, "growth_factor": 0.5}, "^state dict 'growth_factor'")
    s = lossscale.GradScaler(growth_interval=5)
    s.load_state_dict({**torch_sd, "scale": np.float32(8.0), "_growth_tracker": np.int64(3)})
    assert s.get_scale() == 8.0 and s._get_growth_tracker() == 3
    refuses(lossscale.GradScaler(growth_interval=5), {**torch_sd, "scale": np.array([2.0, 4.0])}, "one number")


def test_a_replaced_policy_is_named_in_the_warning():
    """Kills: the warning's ``what`` losing the two policy names (this file's
    test_checkpoint_policy_wins_with_a_warning_naming_the_change also checks the warning's line, which
    mutmut's trampolines move, so the mutation run leaves it out)."""
    scaler = lossscale.GradScaler()
    with pytest.warns(UserWarning, match="DynamicPolicy -> AdaptivePolicy"):
        scaler.load_state_dict(_sd(AdaptivePolicy()))


def test_a_replaced_policy_warning_ends_where_its_note_would_go():
    """Kills: the default of the warning's trailing note (a lossscale dict has none to add: the change
    is followed at once by the advice)."""
    scaler = lossscale.GradScaler()
    with pytest.warns(UserWarning, match=r"\(policy DynamicPolicy -> StaticPolicy\)\. A checkpoint restores"):
        scaler.load_state_dict(_sd(StaticPolicy()))


def test_keys_that_do_not_fit_are_refused_naming_the_section_and_version():
    """Kills: the section name ('policy', 'state') or the version dropped from the refusal, and the
    list of unknown or of missing keys shown when it is empty."""
    base = _sd()
    unknown = {**base, "policy": {**base["policy"], "bogus": 1}}
    expected = "state dict 'policy' does not fit DynamicPolicy of 'lossscale_version'=2: unknown keys ['bogus']."
    refuses(lossscale.GradScaler(), unknown, "^" + re.escape(expected) + "$")
    state = dict(base["state"])
    del state["steps"]
    expected = "state dict 'state' does not fit DynamicState of 'lossscale_version'=2: missing keys ['steps']."
    refuses(lossscale.GradScaler(), {**base, "state": state}, "^" + re.escape(expected) + "$")


class _Scalar:
    """A framework's 0-dim number that has ``item()`` and neither ``numel`` nor ``size``."""

    def __init__(self, value):
        self.value = value

    def item(self):
        return self.value


def test_a_torch_dict_number_with_only_item_loads_as_its_value():
    """Kills: the size assumed for a value with ``item()`` but no ``numel``/``size`` other than one (then
    refused as 'must hold one number'), or read without a default (AttributeError)."""
    torch_sd = dict(scale=2.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=5, _growth_tracker=4)
    s = lossscale.GradScaler(growth_interval=5)
    s.load_state_dict({**torch_sd, "scale": _Scalar(8.0), "_growth_tracker": _Scalar(3)})
    assert s.get_scale() == 8.0 and s._get_growth_tracker() == 3


def test_a_torch_scale_beyond_float32_is_refused_naming_the_key():
    """Kills: the torch loader's float32 range check letting inf through (check_state refuses it later,
    without naming the torch key)."""
    torch_sd = dict(scale=1e39, growth_factor=2.0, backoff_factor=0.5, growth_interval=5, _growth_tracker=0)
    refuses(lossscale.GradScaler(min_scale=None, max_scale=None, growth_interval=5), torch_sd, "^state dict 'scale'=")


def test_a_torch_dict_integer_is_read_exactly_not_through_a_float():
    """An integer past 2**53 is quoted as given in the refusal, not rounded through a float. Kills: the
    integer keys read as floats first (``integral`` dropped)."""
    torch_sd = dict(scale=2.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2**53 + 1, _growth_tracker=0)
    refuses(lossscale.GradScaler(), torch_sd, "growth_interval=9007199254740993 must be an int")


@pytest.mark.parametrize("bound, value", [("min_scale", 0.1), ("max_scale", 65536.1)])
def test_a_torch_scale_on_a_bound_keeps_the_bound(bound, value):
    """A torch scale equal to a bound as float32 holds it (the scale is within the bounds): the bound is
    not moved to it, and no replaced-policy warning. Kills: the moved-bound tests made ``<=``/``>=``
    (a bound that is not a float32 value then moves by its rounding, with a warning)."""
    torch_sd = dict(scale=f32(value), growth_factor=2.0, backoff_factor=0.5, growth_interval=5, _growth_tracker=0)
    scaler = quiet(lambda: lossscale.GradScaler(growth_interval=5, **{bound: value}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.load_state_dict(torch_sd)
    assert scaler.get_scale() == f32(value) and getattr(scaler.policy, bound) == value


@pytest.mark.parametrize("key", ["policy_type", "policy", "state"])
def test_a_lossscale_dict_that_lost_its_version_is_not_read_as_torchs(key):
    """Kills: the names of lossscale's own keys in ``load`` (the dict then loads as a torch dict,
    dropping the policy and every counter)."""
    sd = _sd()
    del sd["lossscale_version"]
    torch_keys = {k: sd[k] for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")}
    refuses(lossscale.GradScaler(), {**torch_keys, key: sd[key]}, "lossscale_version")


# ------------------------------------------------------------------------------------- property test
# Valid checkpoints from real short runs (tiny MLP, fp16 autocast on CPU, a few injected overflows so
# the counters and trackers are not at their defaults), of every policy and format.
_CONFIGS = {
    "dynamic": dict(policy="dynamic", init_scale=2.0**12, growth_interval=3, hysteresis=3, max_consecutive_skips=9),
    "static": dict(policy="static", init_scale=2.0**10),
    "adaptive": dict(policy="adaptive", growth_interval=3, hysteresis=2, max_scale=None),
    "logmax": dict(policy="logmax"),
}
_POLICY_TYPES = {
    "dynamic": "DynamicPolicy",
    "static": "StaticPolicy",
    "adaptive": "AdaptivePolicy",
    "logmax": "LogMaxPolicy",
}


def _real_run(config):
    scaler = lossscale.GradScaler(on_stuck="ignore", **config)
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(7):
        opt.zero_grad()
        backward(model, scaler, step)
        if step in (2, 3):
            next(model.parameters()).grad[0, 0] = NAN if step == 2 else INF
        scaler.step(opt)
        scaler.update()
    return scaler.state_dict()


_BASES = {}


def bases():
    if not _BASES:
        for name, config in _CONFIGS.items():
            _BASES[f"v2-{name}"] = quiet(lambda config=config: _real_run(config))
        ref = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
        model = tiny_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(5):
            opt.zero_grad()
            backward(model, ref, step)
            ref.step(opt)
            ref.update()
        _BASES["torch"] = ref.state_dict()
        _BASES["torch-tensors"] = {k: torch.tensor(v) for k, v in ref.state_dict().items()}
    return _BASES


def _paths(sd):
    out = [(k,) for k in sd]
    for top in ("policy", "state"):
        if isinstance(sd.get(top), dict):
            out += [(top, k) for k in sd[top]]
    return out


def _corrupt(value, how):
    """The corruption ``how`` applied to ``value``."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if how == "negative":
        return -abs(value) if number and value else -1
    if how == "str":
        return "x" if not isinstance(value, str) else "not-a-" + value
    if how in ("to-float", "to-int", "plus-one", "times-two", "half", "tensor"):
        if not number or abs(value) > 2**60:
            return {"tensor": torch.tensor([1.0, 2.0])}.get(how, 1.5)
        return {
            "to-float": float(value),
            "to-int": int(value),
            "plus-one": value + 1,
            "times-two": value * 2,
            "half": value / 2,
            "tensor": torch.tensor(value),
        }[how]
    return {
        "nan": NAN,
        "inf": INF,
        "-inf": -INF,
        "zero": 0,
        "huge": 1e300,
        "huge-int": 2**70,
        "int64-edge": 2**63 - 1,
        "tiny": 1e-300,
        "subnormal": 1e-40,
        "true": True,
        "false": False,
        "none": None,
        "list": [value],
        "dict": {},
    }[how]


_HOWS = (
    "drop",
    "nan",
    "inf",
    "-inf",
    "zero",
    "negative",
    "huge",
    "huge-int",
    "int64-edge",
    "tiny",
    "subnormal",
    "true",
    "false",
    "none",
    "str",
    "list",
    "dict",
    "to-float",
    "to-int",
    "plus-one",
    "times-two",
    "half",
    "tensor",
)


@st.composite
def corrupted_checkpoints(draw):
    """(base name, corrupted dict, the keys corrupted): one to three corruptions of a valid checkpoint."""
    name = draw(st.sampled_from(sorted(bases())))
    sd = copy.deepcopy(bases()[name])
    keys = []
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(sd)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        how = draw(st.sampled_from(_HOWS))
        parent = sd if len(path) == 1 else sd[path[0]]
        if how == "drop":
            del parent[path[-1]]
        else:
            parent[path[-1]] = _corrupt(parent[path[-1]], how)
        keys.append(path)
    return name, sd, keys


def _same(a, b) -> bool:
    """state_dict equality (a lossscale dict holds no tensors and no NaN after a validated load)."""
    return a == b


def check_corrupted_checkpoint(case, target, started):
    """The property: a corrupted checkpoint loads a state that trains with finite weights, or raises
    ValueError naming a corrupted key, with ``state_dict()`` unchanged."""
    name, sd, keys = case
    if name.startswith("torch"):
        target = "dynamic"  # a torch dict needs a dynamic scaler (any other is refused, for that reason)
    scaler = quiet(lambda: lossscale.GradScaler(policy=target, on_stuck="ignore"))
    if started:
        scaler.init_device("cpu")
    before = scaler.state_dict()
    try:
        quiet(lambda: scaler.load_state_dict(sd))
    except ValueError as e:
        message = str(e)
        assert any(path[-1] in message for path in keys), (message, keys)
        assert _same(scaler.state_dict(), before), (message, keys)
        assert finite(train(scaler, 2))  # still usable
        return
    loaded = scaler.state_dict()
    s = scaler.state()
    assert math.isfinite(s.scale) and s.scale > 0, (keys, s)
    # What loaded round-trips, and trains with finite weights.
    again = quiet(lambda: lossscale.GradScaler(policy=target))
    quiet(lambda: again.load_state_dict(loaded))
    assert again.state_dict() == loaded
    model = quiet(lambda: train(scaler, 3))
    assert finite(model), (keys, scaler.state())
    assert math.isfinite(scaler.get_scale()) and scaler.get_scale() > 0


_TARGETS = st.sampled_from(sorted(_CONFIGS))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=corrupted_checkpoints(), target=_TARGETS, started=st.booleans())
def test_corrupted_checkpoint_loads_and_trains_or_is_refused_naming_the_key(case, target, started):
    check_corrupted_checkpoint(case, target, started)


@pytest.mark.slow
@pytest.mark.skipif("'slow' not in config.getoption('markexpr')", reason="slow: run with -m slow")
@settings(max_examples=2500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=corrupted_checkpoints(), target=_TARGETS, started=st.booleans())
def test_corrupted_checkpoint_property_slow(case, target, started):
    check_corrupted_checkpoint(case, target, started)


@pytest.mark.filterwarnings("ignore:lossscale. the checkpoint.s policy replaces:UserWarning")  # by design here
def test_every_base_checkpoint_round_trips_and_trains():
    # The property test's starting points are valid: each loads into a fresh scaler of its policy
    # and trains.
    for name, sd in bases().items():
        kind = "dynamic" if name.startswith("torch") else name.split("-", 1)[1]
        scaler = quiet(lambda kind=kind: lossscale.GradScaler(policy=kind))
        scaler.load_state_dict(sd)
        if name.startswith("v2"):
            assert scaler.state_dict() == sd, name
        assert finite(train(scaler)), name


def test_a_pre_release_version_1_dict_is_refused_by_name():
    sd = lossscale.GradScaler().state_dict()
    refuses(lossscale.GradScaler(), {**sd, "lossscale_version": 1}, "lossscale_version.*pre-release")


def test_numpy_and_python_values_load_as_the_fields_kinds_and_wrong_kinds_are_refused():
    """A state dict whose fields are numpy numbers (as some trainers save them) loads as plain Python
    ones of each field's kind, a bool field keeping a numpy bool as a bool; a bool where an int or a
    float is due is refused naming the key, as is a telemetry count that is negative, a bool or not
    whole (0 is a count). Kills: the kind tests renamed or joined with ``or``, the count's bound moved."""
    scaler = lossscale.GradScaler(policy="adaptive", telemetry=1)
    drive(scaler, (False, True, False))
    sd = copy.deepcopy(scaler.state_dict())
    sd["state"].update(steps=np.int64(3), scale=np.float32(sd["state"]["scale"]), calibrated=np.bool_(True))
    twin = lossscale.GradScaler(policy="adaptive", telemetry=1)
    twin.load_state_dict(sd)
    state = twin.state()
    assert (type(state.steps), type(state.scale), type(state.calibrated)) == (int, float, bool)
    assert state.steps == 3 and state.calibrated is True
    for field, value in (("steps", True), ("scale", True), ("growth_tracker", False)):
        bad = copy.deepcopy(sd)
        bad["state"][field] = value
        refuses(twin, bad, rf"state\.{field}")
    fresh = lossscale.GradScaler(telemetry=1)
    fresh_sd = fresh.state_dict()
    assert fresh_sd["telemetry_iteration"] == 0
    lossscale.GradScaler(telemetry=1).load_state_dict(fresh_sd)  # a count of 0 loads
    for value in (-1, True, 2.5):
        bad = dict(fresh_sd, telemetry_iteration=value)
        refuses(lossscale.GradScaler(telemetry=1), bad, "telemetry_iteration")
