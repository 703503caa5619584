"""``GradScaler(policy=name, **keywords)`` (``lossscale._keywords``): a keyword the chosen policy does not
have is validated as a policy that has it would, then warned about (it changes nothing); a bound or a
scale meant for another policy is checked alone, since it only makes sense beside its own policy's.
(Issue 12's bug 6, and mutation-killing tests of issue 15 whose "Kills: ..." names the change each was
seen to fail on.)"""

import dataclasses
import warnings

import pytest
from _models import quiet

import lossscale
from lossscale import StaticPolicy
from lossscale.policy import policy_class


@pytest.mark.parametrize(
    "policy, kwargs",
    [
        ("static", dict(growth_factor=4)),
        ("static", dict(min_scale=2**20)),
        ("static", dict(max_scale=None)),
        ("logmax", dict(hysteresis=2)),
        ("dynamic", dict(margin_bits=3)),
        ("dynamic", dict(scale=8.0)),
    ],
)
def test_keywords_of_another_policy_are_warned_about(policy, kwargs):
    with pytest.warns(UserWarning, match=f"{next(iter(kwargs))}=.*not apply to policy='{policy}'") as record:
        scaler = lossscale.GradScaler(policy=policy, **kwargs)
    assert record[0].filename == __file__  # points at the user's line
    assert scaler.policy == policy_class(policy)()  # and changes nothing


@pytest.mark.parametrize(
    "policy, kwargs, match",
    [
        ("static", dict(hysteresis=0), "hysteresis"),
        ("static", dict(growth_factor=0.5), "growth_factor"),
        ("static", dict(min_scale=-1.0), "min_scale"),
        ("dynamic", dict(margin_bits=0), "margin_bits"),
        ("dynamic", dict(fmt="fp17"), "fmt"),
        ("static", dict(bogus=1), "bogus"),
    ],
)
def test_keywords_of_another_policy_are_validated_as_that_policy_would(policy, kwargs, match):
    with pytest.raises(ValueError, match=match):
        quiet(lambda: lossscale.GradScaler(policy=policy, **kwargs))


@pytest.mark.parametrize(
    "kwargs", [dict(min_scale=2.0**20), dict(max_scale=2.0), dict(min_scale=None), dict(max_scale=None)]
)
def test_a_bound_for_another_policy_is_checked_alone_and_only_warned_about(kwargs):
    """Kills: the bound names missing from _validate_elsewhere's list (then DynamicPolicy(min_scale=2**20)
    is built and refuses, with its own init_scale, a value that was never wrong)."""
    with pytest.warns(UserWarning, match="not apply"):
        scaler = lossscale.GradScaler(policy="static", **kwargs)
    assert scaler.policy == StaticPolicy()


@pytest.mark.parametrize("kwargs, name", [(dict(min_scale=-1.0), "min_scale"), (dict(max_scale=0.0), "max_scale")])
def test_a_bad_bound_for_another_policy_is_refused_by_name(kwargs, name):
    """Kills: _validate_elsewhere checking the bound under another name, or not at all."""
    with pytest.raises(ValueError, match=f"^{name}="):
        lossscale.GradScaler(policy="static", **kwargs)


@pytest.mark.parametrize(
    "init, shown",
    [(2.0**-30, "init_scale=2**-30 is below the default min_scale=2**-24"), (1e-9, "init_scale=1e-09 is below")],
)
def test_a_scale_outside_the_default_bounds_is_named_as_a_power_of_two(init, shown):
    """The bound moved to init_scale is said in the units a scale is chosen in (2**-24, not 5.96e-08)."""
    with pytest.warns(UserWarning) as caught:
        scaler = lossscale.GradScaler(init_scale=init)
    assert shown in str(caught[0].message) and scaler.policy.min_scale == init


def test_an_init_scale_beyond_float_range_is_refused_naming_it():
    """Kills: the name the range check gives (the message then names another keyword)."""
    with pytest.raises(ValueError, match=r"^init_scale=1000+ is beyond the range of a float"):
        lossscale.GradScaler("cpu", init_scale=10**400)


@pytest.mark.parametrize("bound", ["max_scale", "min_scale"])
def test_an_init_scale_on_a_default_bound_keeps_it_without_a_note(bound):
    """An init_scale equal to a default bound is within it: the bound stays, and no note is given.
    Kills: the lift's test made ``>= 0`` (the bound then moves onto itself, with a note)."""
    default = {f.name: f.default for f in dataclasses.fields(lossscale.DynamicPolicy)}[bound]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler = lossscale.GradScaler("cpu", init_scale=default)
    assert getattr(scaler.policy, bound) == default and scaler.get_scale() == default


def test_a_keyword_of_another_policy_is_checked_as_that_policy_would():
    """A scale given as a numpy number is a number; one beyond float range is a ValueError naming it."""
    import numpy as np

    with pytest.warns(UserWarning, match="scale"):
        lossscale.GradScaler("cpu", scale=np.float32(2.0))  # static's keyword: warned about, not refused
    with pytest.raises(ValueError, match=r"^scale=1000+ is beyond the range of a float"):
        lossscale.GradScaler("cpu", scale=10**400)
    with pytest.raises(ValueError, match=r"^min_scale=1000+ is beyond the range of a float"):
        lossscale.GradScaler(policy="static", min_scale=10**400)


@pytest.mark.parametrize(
    "x, shown",
    [(1.0, "1.0"), (1024.0, "1024.0"), (2048.0, "2**11"), (0.5, "2**-1"), (2.0**-24, "2**-24"), (3.0, "3.0")],
)
def test_a_scale_in_a_message_is_a_number_from_1_to_1024_and_a_power_of_two_beyond(x, shown):
    from lossscale._keywords import _number

    assert _number(x) == shown


def test_logmaxs_default_floor_of_1_is_named_as_1():
    """The moved bound's note through the public call: LogMax's default floor is 1, said as a number."""
    with pytest.warns(UserWarning) as caught:
        lossscale.GradScaler("cpu", policy="logmax", init_scale=0.5)
    assert "init_scale=2**-1 is below the default min_scale=1.0," in str(caught[0].message)


@pytest.mark.parametrize(
    "typo, nearest", [("min_sacle", "min_scale"), ("loss_chek", "loss_check"), ("hysterisis", "hysteresis")]
)
def test_a_misspelt_keyword_names_the_nearest_and_lists_the_keywords(typo, nearest):
    with pytest.raises(ValueError) as e:
        lossscale.GradScaler(**{typo: 1.0})
    message = str(e.value)
    assert message.startswith(f"{typo}=1.0 is not a keyword of any scale policy, nor of GradScaler; ")
    assert f"did you mean {nearest}=1.0?" in message
    import inspect

    for name in inspect.signature(lossscale.GradScaler).parameters:  # every keyword is listed
        if name != "policy_keywords":
            assert f" {name}," in message or f" {name}." in message, name
    for field in ("hysteresis", "margin_bits", "max_consecutive_skips"):  # the policies' too
        assert field in message


def test_nothing_near_a_keyword_lists_them_without_a_guess():
    with pytest.raises(ValueError, match=r"^zzzz=1 is not a keyword of any scale policy, nor of GradScaler\. "):
        lossscale.GradScaler(zzzz=1)


def test_the_signature_shows_the_defaults_the_code_has():
    # min_scale, max_scale and on_stuck are keywords of their own, with the default policy's defaults
    # shown; upcast_after and process_group show the values the code uses.
    import inspect

    from lossscale import upcast

    params = inspect.signature(lossscale.GradScaler).parameters
    dynamic = {f.name: f.default for f in dataclasses.fields(lossscale.DynamicPolicy)}
    for name in ("min_scale", "max_scale", "on_stuck"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY and params[name].default == dynamic[name]
    assert params["upcast_after"].default == upcast.AFTER
    assert params["process_group"].default == "default" == lossscale.GradScaler().process_group
    assert inspect.signature(lossscale.ShardedGradScaler).parameters["process_group"].default == "default"


@pytest.mark.parametrize("policy", ["static", "adaptive", "logmax"])
def test_the_shown_bounds_go_to_the_policy_only_when_given(policy):
    # Not given, another policy keeps its own bounds (logmax's floor is 1; static has none) and no
    # warning fires; given, they reach the policy, as before.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lossscale.GradScaler(policy=policy).policy == policy_class(policy)()
    if policy != "static":
        assert lossscale.GradScaler(policy=policy, max_scale=2.0**20).policy.max_scale == 2.0**20
    assert lossscale.GradScaler(policy=policy, on_stuck="raise").policy.on_stuck == "raise"
    given = lossscale.GradScaler(min_scale=None, max_scale=None, on_stuck="ignore").policy
    assert (given.min_scale, given.max_scale, given.on_stuck) == (None, None, "ignore")
    with pytest.raises(ValueError, match="policy is a policy object, so min_scale must be set on the object"):
        lossscale.GradScaler(policy=lossscale.DynamicPolicy(), min_scale=1.0)
