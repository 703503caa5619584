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
    clean = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0])  # FLAG_LAYOUT of a clean step
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
