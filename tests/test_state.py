"""A policy's state on device (``lossscale._state``): one 0-dim tensor per field, of the dtype each
field type maps to (``policy.field_kind``); read in one copy, or through a snapshot without waiting;
loaded in place. (test_checkpoint.py loads states through the scaler; every policy's file holds its
tensor rule to its pure rule.)"""

import dataclasses
import pickle
import struct

import pytest
import torch
from _rules import TensorForm
from hypothesis import given, settings
from hypothesis import strategies as st

from lossscale import AdaptivePolicy, DynamicPolicy, LogMaxPolicy
from lossscale._check import inverse
from lossscale._state import Snapshot, TensorState

CPU = torch.device("cpu")


def test_field_kind_is_what_each_field_declares_never_its_annotation():
    """Kills: a kind read from the annotation (``float | None`` would break it) or a default kind for a
    field that declares none."""
    from lossscale.policy import BOOL, F32, F64, I32, I64, SIGNED, field_kind, host_type

    fields = dataclasses.fields(
        dataclasses.make_dataclass(
            "S",
            [
                (name, "float | None", dataclasses.field(default=0, metadata=meta))
                for name, meta in zip("abcdef", (F32, F64, I64, I32, BOOL, SIGNED))
            ],
        )
    )
    assert [field_kind(f) for f in fields] == ["f32", "f64", "i64", "i32", "bool", "i64"]
    assert [host_type(f) for f in fields] == [float, float, int, int, bool, int]
    with pytest.raises(TypeError, match="declares no device form"):
        field_kind(dataclasses.fields(dataclasses.make_dataclass("T", [("x", "float")]))[0])


def test_every_state_field_of_every_policy_declares_its_device_form():
    from lossscale.policy import field_kind, registered

    for cls in registered():
        for f in dataclasses.fields(cls.state_type):
            field_kind(f)  # TypeError naming the field otherwise


def test_each_field_is_a_tensor_of_its_dtype_and_torch_names_are_the_state():
    t = TensorState(DynamicPolicy().init_state(), CPU)
    assert t.scale.dtype == torch.float32 and t.scale.dim() == 0  # torch's _scale
    assert t.growth_tracker.dtype == torch.int32  # torch's _growth_tracker: its update kernel takes it
    assert t.steps.dtype == t.hysteresis_tracker.dtype == torch.int64
    logmax = TensorState(LogMaxPolicy().init_state(), CPU)
    assert logmax.x_hat.dtype == logmax.b2_correction.dtype == torch.float64
    assert TensorState(AdaptivePolicy().init_state(), CPU).calibrated.dtype == torch.int64


def test_the_counters_are_one_vector_whose_elements_are_the_fields():
    """count_tensor moves every counter in one add: t.counters must be the fields themselves (views),
    in ScaleState's order, for every policy's state. Kills: a copy in place of a view, a field order
    that puts another int64 field among the counters."""
    from lossscale.policy import COUNTERS, registered

    assert COUNTERS == (
        "steps",
        "skipped_steps",
        "inf_steps",
        "nan_steps",
        "bad_loss_steps",
        "overflow_streak",
        "streak_nan_steps",
        "streak_bad_loss_steps",
    )
    for cls in registered():
        t = TensorState(cls().init_state(), CPU)
        t.counters.copy_(torch.arange(1, len(COUNTERS) + 1))
        assert [getattr(t, name).item() for name in COUNTERS] == list(range(1, len(COUNTERS) + 1)), cls
        assert t.streaks.data_ptr() == t.overflow_streak.data_ptr()
        assert [getattr(t.read()[0], name) for name in COUNTERS] == list(range(1, len(COUNTERS) + 1))


def test_a_counter_at_its_limit_reaches_the_device_and_comes_back_exactly():
    """The host reads each field in its own dtype (the state's bytes, no conversion); check_state holds
    every int field below 2**53, as the checkpoint's limit. Kills: the limit off by one, an int field read
    back through float32."""
    p = DynamicPolicy()
    s = p.init_state().replace(steps=2**53 - 1)
    p.check_state(s)
    assert TensorForm(p, s).to_state().steps == 2**53 - 1
    with pytest.raises(ValueError, match="steps"):
        p.check_state(s.replace(steps=2**53))
    big = DynamicPolicy(growth_interval=2**31 - 1)
    s = big.init_state().replace(growth_tracker=2**31 - 2)
    assert TensorForm(big, s).to_state().growth_tracker == 2**31 - 2


def test_the_device_copy_of_the_state_reads_back_every_field_exactly():
    """What an accelerator's snapshot copies (:meth:`TensorState.values`: the vectors' bytes, uint8, no
    float64) unpacks to every field exactly: a float64 field that float32 cannot hold, counters past
    float32's and int32's exact range, an int32 tracker, the float32 scale and ``scale_before``. Kills: a
    slice viewed at an unaligned offset, the vectors unpacked in another order, a value converted."""
    from lossscale.policy import f32

    for p, extra in (
        (LogMaxPolicy(), dict(x_hat=0.1, slow_x_hat=-1 / 3, b2_correction=1 - 2**-40)),
        (DynamicPolicy(growth_interval=2**31 - 1), dict(growth_tracker=2**31 - 2)),
    ):
        third = f32(1 / 3)  # a float32 field holds a float32 value
        state = p.init_state().replace(steps=2**53 - 1, nan_steps=2**24 + 1, streak_start_scale=third, **extra)
        t = TensorState(state, CPU)
        packed = t.values()
        assert packed.dtype == torch.uint8
        values = t.unpack(packed.clone())
        assert t.decode(values) == (state, state.scale)
        assert t.read() == t.decode(values) and values == t.host_values()


def test_read_gives_the_state_and_the_scale_the_last_update_ran_with():
    p = DynamicPolicy(init_scale=2.0**4, growth_interval=1)
    form = TensorForm(p)
    form.step(False)  # grows: 2**4 -> 2**5
    state, before = form.t.read()
    assert state == p.update(p.init_state(), False) and state.scale == 2.0**5 and before == 2.0**4


def test_load_fills_every_field_in_place():
    p = DynamicPolicy(hysteresis=3)
    t = TensorState(p.init_state(), CPU)
    ids = {f.name: id(getattr(t, f.name)) for f in dataclasses.fields(t.state_type)}
    loaded = p.init_state().replace(scale=2.0**3, steps=7, skipped_steps=2, inf_steps=2, hysteresis_tracker=2)
    t.load_(loaded)
    assert t.read()[0] == loaded and {n: id(getattr(t, n)) for n in ids} == ids
    with pytest.raises(ValueError, match="holds DynamicState"):
        t.load_(LogMaxPolicy().init_state())


def test_a_snapshot_keeps_the_state_it_was_taken_of():
    p = DynamicPolicy(growth_interval=1)
    form = TensorForm(p)
    snap = Snapshot(form.t, evidence="kept")
    form.step(False)  # the state moves on; the snapshot does not
    assert snap.landed() and snap.read() == (p.init_state(), p.init_state().scale) and snap.evidence == "kept"


def test_a_device_state_is_not_pickled_but_the_scaler_is():
    with pytest.raises(TypeError, match="pickle the GradScaler"):
        pickle.dumps(TensorState(DynamicPolicy().init_state(), CPU))


def _torchs_inverse(scale: torch.Tensor) -> torch.Tensor:
    return scale.double().reciprocal().float()  # torch's GradScaler.unscale_: through float64


@settings(max_examples=300, deadline=None)
@given(bits=st.integers(min_value=0x00000001, max_value=0x7F7FFFFF))  # every finite positive float32
def test_the_inverse_is_torchs_bit_for_bit(bits):
    """``unscale_`` multiplies by ``inverse(scale)``, a float32 reciprocal, bitwise torch's float64 route.
    Kills: an inverse rounded otherwise than to nearest (truncated, or an approximate reciprocal), and a
    subnormal inverse (scales above 2**126) flushed to 0."""
    scale = torch.tensor(struct.unpack("<f", struct.pack("<I", bits))[0], dtype=torch.float32)
    got = inverse(scale)
    assert got.dtype == torch.float32 and torch.equal(got, _torchs_inverse(scale))


def test_the_float32_inverse_is_torchs_over_every_binade_and_random_scales():
    """Double rounding through float64 is innocuous for a float32 division, so the float32 reciprocal is
    torch's value for every finite float32 scale: checked on every power of two (subnormal ones too), the
    extremes, and a million random bit patterns over the whole range, in one vectorised comparison."""
    gen = torch.Generator().manual_seed(0)
    random_bits = torch.randint(1, 0x7F800000, (1_000_000,), generator=gen, dtype=torch.int64)
    powers = torch.tensor([2.0**k for k in range(-149, 128)], dtype=torch.float32)
    edges = torch.tensor([1.0, 3.0, 1 / 3, 1e-45, 1.17549435e-38, 1.1754942e-38, 3.4028235e38, 8.507059e37])
    scales = torch.cat([random_bits.to(torch.int32).view(torch.float32), powers, edges, -powers])
    got = torch.stack([inverse(s) for s in scales[-600:]])  # the function itself, 0-dim as the scaler calls it
    assert torch.equal(got, _torchs_inverse(scales[-600:]))
    assert torch.equal(scales.reciprocal(), _torchs_inverse(scales))  # inverse is this, vectorised
