"""A policy's state on device (``lossscale._state``): the typed vector each field type maps to
(``policy.field_kind``), a value at the limit of its device type, and a copy that owns its buffer.
(test_checkpoint.py loads states through the scaler; every policy's file holds its tensor rule to its
pure rule.)"""

import copy
import dataclasses
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _rules import TensorForm
from lossscale import AdaptivePolicy, DynamicPolicy
from lossscale._state import TensorState


def test_field_kind_for_a_new_state_type():
    """Kills: ``Optional[float]`` and the other field types mapped to the wrong device vector."""
    from lossscale.policy import field_kind
    fields = dataclasses.fields(dataclasses.make_dataclass(
        "S", [("a", "float"), ("b", "Optional[float]"), ("c", "int"), ("d", "bool"),
              ("e", "float", dataclasses.field(default=0.0, metadata={"dtype": "f64"}))]))
    assert [field_kind(f) for f in fields] == ["f32", "f32", "i64", "i64", "f64"]
    with pytest.raises(TypeError, match="no device form"):
        field_kind(dataclasses.fields(dataclasses.make_dataclass("T", [("x", "str")]))[0])


def test_a_counter_at_its_device_limit_reaches_the_device_exactly():
    """Kills: a shared counter's limit off by one (float64 on device: exact below 2**53), and an int
    tracker filled through float (2**62 - 1 is not a float64)."""
    p = DynamicPolicy()
    s = p.init_state().replace(steps=2**53 - 1)
    p.check_state(s)
    assert TensorForm(p, s).to_state().steps == 2**53 - 1
    with pytest.raises(ValueError, match="steps"):
        p.check_state(s.replace(steps=2**53))
    a = AdaptivePolicy(max_scale=None)
    s = a.init_state().replace(calibrated=True, window_exp=-7)
    t = TensorForm(a, s)
    t.t.growth_tracker.fill_(2**62 - 1)  # an int64 field written and read back through the buffer
    assert t.to_state().growth_tracker == 2**62 - 1


def test_a_copied_state_does_not_write_through_the_originals_views():
    policy = DynamicPolicy(init_scale=2.0**4, growth_interval=2, hysteresis=1, min_scale=None, max_scale=None)
    st = TensorState(policy.init_state(), torch.device("cpu"))
    clean = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1])  # FLAG_LAYOUT of a clean step
    policy.tensor_update(st, clean)
    twin = copy.deepcopy(st)
    policy.tensor_update(twin, clean)
    assert st.to_state().steps == 1 and twin.to_state().steps == 2


@settings(max_examples=300, deadline=None)
@given(bits=st.integers(min_value=0x00800000, max_value=0x7F7FFFFF))  # every normal positive float32
def test_the_host_inverse_is_torchs_bit_for_bit(bits):
    """The host packs ``1/scale`` with every state it sends; ``unscale_`` reads it in place of torch's
    ``scale.double().reciprocal().float()``. Kills: an inverse rounded otherwise than to nearest
    (truncated, or an approximate reciprocal), a subnormal inverse (scales above 2**126) flushed to 0,
    and the inverse left in the decoded state."""
    scale = struct.unpack("<f", struct.pack("<I", bits))[0]
    t = TensorState(DynamicPolicy().init_state().replace(scale=scale), torch.device("cpu"))
    expected = torch.tensor(scale, dtype=torch.float32).double().reciprocal().float()
    assert torch.equal(t.inv_scale, expected), (scale, t.inv_scale.item(), expected.item())
    assert t.to_state().scale == scale  # the inverse is not part of the state


def _inverse_launches(keeper):
    from lossscale._sync import count_device_work

    with count_device_work() as work:
        inv = keeper.inverse()
    return inv, work.launches


@pytest.mark.parametrize("k", [-126, -1, 0, 24, 127])
def test_a_device_moved_power_of_two_scale_is_inverted_in_one_exact_kernel(k):
    """After a tensor rule moved the scale, ``unscale_`` needs ``1/scale`` made on device. For a scale
    known to be a power of two (the host set one, and the rule keeps powers of two) it is one float32
    ``reciprocal``, exact, so the same bits as torch's float64 route (2**127: a subnormal inverse);
    otherwise torch's route. Kills: the shortcut taken for a scale the host set off the powers of two
    or after a rule that leaves them, or not taken where it may be."""
    from lossscale._state import StateKeeper

    torch_route = lambda t: t.scale.double().reciprocal().float()  # noqa: E731
    keeper = StateKeeper(DynamicPolicy().init_state().replace(scale=2.0**k))
    t = keeper.ensure(torch.device("cpu"))
    inv, launches = _inverse_launches(keeper)
    assert launches == 0 and torch.equal(inv, torch_route(t))  # the host's, sent with the state
    keeper.moved_on_device(keeps_powers_of_two=True)
    inv, launches = _inverse_launches(keeper)
    assert launches == 1 and torch.equal(inv, torch_route(t))
    keeper.moved_on_device(keeps_powers_of_two=False)  # e.g. backoff_factor=0.7
    assert _inverse_launches(keeper)[1] == 3
    keeper.set(keeper.t.to_state().replace(scale=3.0 * 2.0**(k // 2)))  # the host sets one off them
    inv, launches = _inverse_launches(keeper)
    assert launches == 0 and torch.equal(inv, torch_route(t))  # the host's again
    keeper.moved_on_device(keeps_powers_of_two=True)
    inv, launches = _inverse_launches(keeper)
    assert launches == 3 and torch.equal(inv, torch_route(t))
    keeper.set(keeper.t.to_state().replace(scale=2.0**k))  # and one on them again
    keeper.moved_on_device(keeps_powers_of_two=True)
    assert _inverse_launches(keeper)[1] == 1
    keeper.graphed = True  # a graph replays later, perhaps after the host set any scale: torch's route
    inv, launches = _inverse_launches(keeper)
    assert launches == 3 and torch.equal(inv, torch_route(t))


def test_which_policies_keep_powers_of_two():
    assert DynamicPolicy().keeps_powers_of_two() and AdaptivePolicy().keeps_powers_of_two()
    with pytest.warns(UserWarning, match="not a power of two"):
        assert not DynamicPolicy(backoff_factor=0.7).keeps_powers_of_two()
    with pytest.warns(UserWarning, match="not a power of two"):
        assert not DynamicPolicy(max_scale=3.0e6).keeps_powers_of_two()
    assert DynamicPolicy(min_scale=None, max_scale=None).keeps_powers_of_two()
    with pytest.warns(UserWarning, match="not a power of two"):
        assert not DynamicPolicy(growth_factor=3.0).keeps_powers_of_two()
    with pytest.warns(UserWarning, match="not a power of two"):
        assert not DynamicPolicy(min_scale=0.75).keeps_powers_of_two()


def test_a_span_of_fields_is_one_view_of_neighbours_only():
    from lossscale import LogMaxPolicy

    t = TensorState(LogMaxPolicy().init_state(), torch.device("cpu"))
    span = t.span("x_hat", "b2_correction")
    span.fill_(0.5)  # one write reaches all five fields
    assert t.to_state().x_hat == t.to_state().b2_correction == 0.5 and span.numel() == 5
    t.span("slow_x_hat", "xsquared_hat").fill_(0.25)  # two in the middle, and one alone
    t.span("b1_correction", "b1_correction").fill_(0.125)
    state = t.to_state()
    assert (state.x_hat, state.slow_x_hat, state.xsquared_hat, state.b1_correction, state.b2_correction) == (
        0.5, 0.25, 0.25, 0.125, 0.5)
    with pytest.raises(ValueError, match="not neighbouring fields of one kind"):
        t.span("b2_correction", "x_hat")  # out of order
    with pytest.raises(ValueError, match="not neighbouring fields of one kind"):
        t.span("scale", "x_hat")  # float32 and float64


def test_a_device_constant_is_made_once_in_float64_on_the_states_device():
    t = TensorState(DynamicPolicy().init_state(), torch.device("cpu"))
    c = t.constant(0.7)
    assert c is t.constant(0.7) and c.dtype == torch.float64 and c.device == t.device and c.item() == 0.7
    assert t.constant(0.5) is not c and t.constant(0.5).item() == 0.5


def test_decode_reads_a_host_copy_as_the_state_and_refuses_anything_else():
    """``decode`` reads the buffer's bytes straight from host memory, so it takes only a contiguous
    uint8 host tensor; a strided view or another dtype would be read as garbage. Kills: the check
    dropped, the state built with a field's type lost (an int counter read back as a float)."""
    state = AdaptivePolicy().init_state().replace(steps=7, calibrated=True, window_exp=-3, scale=2.0**5)
    t = TensorState(state, torch.device("cpu"))
    got, scale_before = t.decode(t.buffer.clone())
    assert got == state and scale_before == 2.0**5
    assert type(got.steps) is int and type(got.calibrated) is bool and type(got.scale) is float
    doubled = torch.stack([t.buffer, t.buffer], 1).reshape(-1)[::2]  # the same bytes, strided
    for bad in (doubled, t.buffer.float()):
        with pytest.raises(ValueError, match="^decode needs a contiguous uint8 host buffer"):
            t.decode(bad)
