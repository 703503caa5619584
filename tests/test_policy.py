"""What every policy shares (``lossscale.policy``): the protocol, the state and its bookkeeping (the
counters of ``count``), ``check_state``'s generic checks, and the registry. Each policy's own rule is
tested in its own file: test_dynamic.py, test_static.py, test_adaptive.py, test_logmax.py."""

import math

import pytest
from _rules import ALL_POLICIES

from lossscale import AdaptivePolicy, DynamicPolicy, LogMaxPolicy, ScaleState, StaticPolicy
from lossscale.policy import f32


def test_counters_never_wrap():
    p = DynamicPolicy()
    s = p.init_state().replace(steps=2**63 - 1, skipped_steps=2**63 - 1, inf_steps=2**63 - 1)
    s = p.update(s, True)
    assert s.steps == 2**63 and s.skipped_steps == 2**63


def test_found_nan_without_found_inf_is_rejected():
    with pytest.raises(ValueError, match="found_inf"):
        DynamicPolicy().update(DynamicPolicy().init_state(), found_inf=False, found_nan=True)


def test_policy_state_is_a_plain_value():
    s = ScaleState(scale=1.0)
    with pytest.raises(Exception):  # noqa: B017  frozen: any refusal to assign will do
        s.scale = 2.0  # frozen


# ------------------------------------------------------------------ the protocol, for every policy
# From here on, mutation-killing tests (issue 15): "Kills: ..." names the one-line change each was seen
# to fail on (docs/testing.md).
@pytest.mark.parametrize("cls", ALL_POLICIES)
def test_update_counts_an_overflow_as_inf_unless_told_nan(cls):
    """Kills: the default ``found_nan=False`` of ``update`` turned True."""
    p = cls()
    s = p.update(p.init_state(), True, amax=None) if p.needs_amax else p.update(p.init_state(), True)
    assert (s.inf_steps, s.nan_steps) == (1, 0)


@pytest.mark.parametrize("cls", ALL_POLICIES)
def test_a_bad_loss_with_nan_gradients_counts_the_nan(cls):
    """Kills: a policy's bad-loss branch passing ``found_inf``/``found_nan`` to ``count`` as None or
    False (then a NaN step raises, or counts as inf)."""
    p = cls()
    s = p.update(p.init_state(), found_inf=True, found_nan=True, bad_loss=True)
    assert (s.skipped_steps, s.inf_steps, s.nan_steps, s.bad_loss_steps) == (1, 0, 1, 1)
    assert s.scale == p.init_state().scale


def test_scale_bounds_of_every_policy():
    """Kills: ``scale_bounds`` reading another attribute, or losing getattr's default (static has none)."""
    assert DynamicPolicy(min_scale=2.0, max_scale=2.0**20).scale_bounds() == (2.0, 2.0**20)
    assert StaticPolicy().scale_bounds() == (None, None)
    assert LogMaxPolicy(init_scale=2.0, min_scale=2.0, max_scale=2.0**20).scale_bounds() == (2.0, 2.0**20)
    assert AdaptivePolicy(min_scale=None, max_scale=None).scale_bounds() == (2.0**-126, 2.0**127)


@pytest.mark.parametrize(
    "policy, want",
    [
        (DynamicPolicy(growth_factor=4.0, backoff_factor=0.25, growth_interval=7), (4.0, 0.25, 7)),
        (StaticPolicy(scale=2.0**10), (1.0, 1.0, 2**31 - 1)),
        (AdaptivePolicy(backoff_factor=0.25, growth_interval=9), (2.0, 0.25, 9)),
        (LogMaxPolicy(), (2.0, 0.5, 2000)),
    ],
)
def test_torch_state_gives_torch_a_scaler_it_can_run(policy, want):
    """Kills: any of torch's five keys renamed, or given another value (growth_factor 3.0, tracker 1)."""
    state = policy.init_state()
    if hasattr(state, "growth_tracker") and not isinstance(policy, StaticPolicy):
        state = state.replace(growth_tracker=3)
    got = policy.torch_state(state)
    tracker = 3 if hasattr(state, "growth_tracker") and not isinstance(policy, StaticPolicy) else 0
    assert got == {
        "scale": state.scale,
        "growth_factor": want[0],
        "backoff_factor": want[1],
        "growth_interval": want[2],
        "_growth_tracker": tracker,
    }
    assert all(type(got[k]) is float for k in ("scale", "growth_factor", "backoff_factor"))


# --------------------------------------------------------------------------- check_state's edges
def _dyn():
    return DynamicPolicy(init_scale=2.0**4, growth_interval=5, hysteresis=3, min_scale=2.0, max_scale=2.0**20)


def _ad():
    return AdaptivePolicy(growth_interval=5, hysteresis=3, max_scale=None)


_COUNTS = dict(steps=5, skipped_steps=3, inf_steps=2, nan_steps=1, overflow_streak=2, streak_nan_steps=1)


@pytest.mark.parametrize(
    "policy, changes",
    [
        (_dyn(), dict(growth_tracker=4, hysteresis_tracker=3)),
        (_dyn(), dict(scale=2.0)),  # on min_scale
        (_dyn(), dict(scale=2.0**20)),  # on max_scale
        (_dyn(), dict(steps=2**53 - 1)),
        (_dyn(), _COUNTS),
        (StaticPolicy(scale=1.0), dict(scale=1.0)),
        (_ad(), dict(calibrated=True, window_exp=-160)),
        (_ad(), dict(calibrated=True, window_exp=140)),
        (_ad(), dict(calibrated=True, window_exp=-5, growth_tracker=4)),
        (LogMaxPolicy(), dict(b1_correction=1.0, b2_correction=1e-300)),
    ],
)
def test_check_state_accepts_states_on_the_edge(policy, changes):
    """Kills every bound of check_state moved inward (``>=`` for ``>``, 140 to 139, ``<= 1``)."""
    policy.check_state(policy.init_state().replace(**changes))


@pytest.mark.parametrize(
    "policy, changes, name",
    [
        (_dyn(), dict(growth_tracker=5), "growth_tracker"),
        (_dyn(), dict(hysteresis_tracker=4), "hysteresis_tracker"),
        (_dyn(), dict(growth_tracker=-1), "growth_tracker"),
        (_dyn(), dict(steps=2**53), "steps"),
        (_dyn(), dict(steps=True), "steps"),
        (_dyn(), dict(steps=1.0), "steps"),
        (_dyn(), dict(streak_start_scale=True), "streak_start_scale"),
        (_dyn(), dict(streak_start_scale="1.0"), "streak_start_scale"),
        (_dyn(), dict(streak_start_scale=math.inf), "streak_start_scale"),
        (_dyn(), dict(scale=f32(2.0 * (1 - 2**-23))), "scale"),  # one float32 step under min_scale
        (_dyn(), dict(scale=2.0**20 * (1 + 2**-23)), "scale"),  # one step over max_scale
        (StaticPolicy(scale=1.0), dict(scale=0.0), "scale"),
        (_dyn(), dict(steps=2, skipped_steps=3, inf_steps=3), "counters"),
        (_dyn(), dict(steps=5, skipped_steps=3, inf_steps=1), "counters"),
        (_dyn(), dict(steps=5, skipped_steps=1, inf_steps=1, overflow_streak=2), "overflow_streak"),
        (_dyn(), dict(steps=5, skipped_steps=2, inf_steps=2, overflow_streak=1, streak_nan_steps=2), "overflow_streak"),
        (_ad(), dict(growth_tracker=5), "growth_tracker"),
        (_ad(), dict(calibrated=True, window_exp=-161), "window_exp"),
        (_ad(), dict(calibrated=True, window_exp=141), "window_exp"),
        (_ad(), dict(calibrated=False, window_exp=-5), "window_exp"),
        (LogMaxPolicy(), dict(b1_correction=0.0), "b1_correction"),
        (LogMaxPolicy(), dict(b2_correction=1.5), "b2_correction"),
    ],
)
def test_check_state_refuses_naming_the_field(policy, changes, name):
    """Kills: a check of check_state weakened (``and`` for ``or``, a bound moved outward, a type test
    that lets a bool or a string through to a comparison)."""
    with pytest.raises(ValueError, match=name):
        policy.check_state(policy.init_state().replace(**changes))


def test_check_state_keeps_the_scale_within_float32s_normal_range():
    """Kills: the smallest normal refused (``<`` for ``<=``). Without a floor (``min_scale=None``, torch's
    rule) the scale may go on below it to 0, as torch's backoff does: such states are this policy's."""
    p = DynamicPolicy(init_scale=1.0, min_scale=2.0**-126)
    p.check_state(p.init_state().replace(scale=2.0**-126))
    with pytest.raises(ValueError, match="scale"):
        p.check_state(p.init_state().replace(scale=2.0**-127))
    unbounded = DynamicPolicy(init_scale=1.0, min_scale=None)
    for scale in (2.0**-126, 2.0**-127, 0.0):
        unbounded.check_state(unbounded.init_state().replace(scale=scale))
    with pytest.raises(ValueError, match=r"^state\.scale=-1\.0 must be >= 0"):
        unbounded.check_state(unbounded.init_state().replace(scale=-1.0))


@pytest.mark.parametrize(
    "changes",
    [
        dict(bad_loss_steps=4, streak_bad_loss_steps=1),  # more bad losses than skipped steps
        dict(bad_loss_steps=3, streak_bad_loss_steps=3),  # a streak of them longer than the streak
        dict(bad_loss_steps=1, streak_bad_loss_steps=2),  # more in the streak than in all
    ],
)
def test_check_state_refuses_bad_loss_counters_that_disagree(changes):
    """Kills: ``or`` turned ``and`` between the three bad-loss invariants."""
    p = _dyn()
    with pytest.raises(ValueError):
        p.check_state(p.init_state().replace(**{**_COUNTS, **changes}))
    p.check_state(p.init_state().replace(**{**_COUNTS, "bad_loss_steps": 1, "streak_bad_loss_steps": 1}))


def test_the_int32_tracker_holds_up_to_its_range():
    """Kills: the int32 bound of check_state moved (``2**31 - 2``, ``2 * 31 - 1``) or its kind renamed
    (then a float passes as the int32 tracker)."""
    p = DynamicPolicy(growth_interval=2**31 - 1)
    p.check_state(p.init_state().replace(growth_tracker=2**31 - 2))
    with pytest.raises(ValueError, match="growth_tracker"):
        p.check_state(p.init_state().replace(growth_tracker=1.0))


# ------------------------------------------------------------------------- f32 and the registry
def test_f32_of_a_value_beyond_float32_is_a_signed_inf():
    """A finite value beyond float32 rounds to a signed inf, as the device cast does. (f32's
    ``except OverflowError`` branch is dead: Python 3.10 to 3.13 pack such a value as inf themselves.)"""
    assert f32(1e39) == math.inf and f32(-1e39) == -math.inf


def test_register_refuses_a_nameless_policy_and_registers_the_class():
    """Kills: register's name check inverted, or the registry holding None."""
    from lossscale.policy import policy_class, register

    for name, cls in (
        ("dynamic", DynamicPolicy),
        ("static", StaticPolicy),
        ("adaptive", AdaptivePolicy),
        ("logmax", LogMaxPolicy),
    ):
        assert policy_class(name) is cls
    assert register(DynamicPolicy) is DynamicPolicy and policy_class("dynamic") is DynamicPolicy  # idempotent
    nameless = type("Nameless", (), {"name": ""})
    with pytest.raises(ValueError, match="name"):
        register(nameless)


@pytest.mark.parametrize(
    "cls, field, value",
    [
        (cls, field, value)
        for cls, fields in (
            (DynamicPolicy, ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale")),
            (AdaptivePolicy, ("init_scale", "backoff_factor", "min_scale", "max_scale")),
        )
        for field, value in {
            "init_scale": 3072.0,
            "growth_factor": 3.0,
            "backoff_factor": 0.75,
            "min_scale": 0.75,
            "max_scale": 3.0 * 2**20,
        }.items()
        if field in fields
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_each_setting_that_is_not_a_power_of_two_is_warned_about_by_name(cls, field, value):
    """Kills: a name dropped or misspelt in the list of settings each policy checks (no warning)."""
    with pytest.warns(UserWarning, match=rf"^lossscale: {field}={value!r} is not a power of two"):
        cls(**{field: value})


def test_several_settings_off_the_powers_of_two_are_named_in_one_warning():
    """Kills: the separator between the names (the warning's list)."""
    with pytest.warns(UserWarning, match=r"^lossscale: init_scale=3072\.0, growth_factor=3\.0 is not a power of two"):
        DynamicPolicy(init_scale=3072.0, growth_factor=3.0)


@pytest.mark.parametrize("cls", ALL_POLICIES, ids=lambda cls: cls.__name__)
def test_update_refuses_another_policys_state_with_the_documented_message(cls):
    # Another policy's state has other trackers: update() says so, instead of an AttributeError (or,
    # for a state with the fields it reads, a silently mixed state).
    policy = cls()
    for other in ALL_POLICIES:
        if other is cls:
            continue
        state = other().init_state()
        expected = f"state is a {type(state).__name__}, not {policy.state_type.__name__}."
        with pytest.raises(ValueError, match=f"^{expected}$"):
            policy.update(state, found_inf=False)
        with pytest.raises(ValueError, match=f"^{expected}$"):
            policy.check_state(state)


def test_register_refuses_a_protocol_subclass_without_a_name():
    import dataclasses

    from lossscale.policy import Policy, policy_names, register

    before = policy_names()

    @dataclasses.dataclass(frozen=True)
    class Mine(Policy):  # the protocol declares name but gives it no value
        on_stuck: str = "warn"

    with pytest.raises(ValueError, match=r"^Mine needs a class attribute name to be registered: give it a name of"):
        register(Mine)
    assert policy_names() == before


def test_register_refuses_an_inherited_or_a_built_in_name_and_the_built_in_stays():
    import dataclasses

    import lossscale
    from lossscale.policy import policy_class, policy_names, register

    before = policy_names()

    @dataclasses.dataclass(frozen=True)
    class Tweaked(DynamicPolicy):  # inherits name = "dynamic"
        pass

    inherited = r"^Tweaked inherits name=.dynamic. from DynamicPolicy, .* give Tweaked its own class attribute"
    with pytest.raises(ValueError, match=inherited):
        register(Tweaked)

    @dataclasses.dataclass(frozen=True)
    class Impostor(DynamicPolicy):
        name = "static"

    with pytest.raises(ValueError, match=r"^Impostor has name='static', the name of lossscale's StaticPolicy"):
        register(Impostor)
    assert policy_names() == before and policy_class("dynamic") is DynamicPolicy
    assert type(lossscale.GradScaler().policy) is DynamicPolicy  # every later GradScaler() keeps the built-in

    @dataclasses.dataclass(frozen=True)
    class Renamed(DynamicPolicy):  # its own name: registered, and registered again (a re-run cell)
        name = "renamed-dynamic-for-a-test"

    try:
        assert register(Renamed) is Renamed and register(Renamed) is Renamed
        assert type(lossscale.GradScaler(policy="renamed-dynamic-for-a-test").policy) is Renamed
    finally:
        from lossscale import policy as policy_module

        del policy_module._REGISTRY["renamed-dynamic-for-a-test"]
