"""A policy's state on device: one small byte buffer, with a typed 0-dim view per field.

Any :class:`~lossscale.policy.ScaleState` subclass maps onto the buffer by its field types
(:func:`lossscale.policy.field_kind`), so a new policy needs no code here. The buffer holds four
typed vectors, in this order (each aligned for its type)::

    f64: steps, skipped_steps, nan_steps, bad_loss_steps,       <- ``totals``
         overflow_streak, streak_nan_steps, streak_bad_loss_steps  <- ``streaks``
         <the policy's F64 fields>
    i64: <the policy's int and bool fields>
    f32: scale, streak_start_scale, scale_before, inv_scale, <the policy's float fields>
    i32: <the policy's I32 fields (the dynamic policy's growth tracker, torch's int32)>

Why one buffer: the whole state moves in one copy. A snapshot for the stuck check is one
device-to-host copy; a state the host computed (``update()`` on the synced path runs the pure rule)
or loaded is one host-to-device copy.

Why the shared counters are float64 on device: the iteration's flags arrive as one float 0/1 vector
(:data:`lossscale.policy.FLAG_LAYOUT`: what each counter adds and keeps), and ``counters = counters *
keep + add`` is then a single ``addcmul``; float64 counts exactly to 2**53. ``inf_steps`` is not held: it is ``skipped_steps - nan_steps`` (a NaN dominates an
inf), derived when the state is read.

The scale is a float32, as torch's GradScaler keeps it, so ``loss * scale`` is bitwise torch's.
``scale_before`` is not a state field: each update writes the scale it ran with, which the stuck
check needs. Nor is ``inv_scale``: ``1/scale`` rounded once to float32 from float64 (torch's
``scale.double().reciprocal().float()``, bit for bit: IEEE division and the rounding to float32 are the
same on the host), written with every state the host sends. While the device has not moved the scale
since (:attr:`StateKeeper.inverse`), ``unscale_`` reads it there instead of computing it: three small
kernels fewer per synced iteration. The views never change identity, so a CUDA graph captured over ``scale()`` or
``update()`` keeps reading the live values, also across :meth:`TensorState.load_`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import operator
import struct
from typing import Dict, List, Tuple

import torch

from . import _device
from .policy import ScaleState, field_kind, is_power_of_two

_DTYPES = {"f64": torch.float64, "i64": torch.int64, "f32": torch.float32, "i32": torch.int32}
_STRUCT = {"f64": "d", "i64": "q", "f32": "f", "i32": "i"}  # the same layout for struct, in native byte order
_SHARED = {
    "f64": ("steps", "skipped_steps", "nan_steps", "bad_loss_steps",
            "overflow_streak", "streak_nan_steps", "streak_bad_loss_steps"),
    "f32": ("scale", "streak_start_scale", "scale_before", "inv_scale"),
}
_DERIVED = ("inf_steps",)  # computed from the others when the state is read


def layout(state_type: type) -> Dict[str, Tuple[str, ...]]:
    """Field names per typed vector, in buffer order (``scale_before`` and ``inv_scale`` included,
    ``inf_steps`` not)."""
    names: Dict[str, List[str]] = {kind: list(_SHARED.get(kind, ())) for kind in _DTYPES}
    shared = {n for group in _SHARED.values() for n in group}
    for f in dataclasses.fields(state_type):
        if f.name in shared or f.name in _DERIVED:
            continue
        kind = field_kind(f)
        names["f64" if kind == "f64" else kind].append(f.name)
    return {k: tuple(v) for k, v in names.items()}


def _views(buffer: torch.Tensor, names: Dict[str, Tuple[str, ...]]) -> Dict[str, torch.Tensor]:
    """The typed vectors of ``buffer`` (uint8), each starting at an offset aligned for its type."""
    out, offset = {}, 0
    for kind, dtype in _DTYPES.items():
        size = dtype.itemsize
        offset = -(-offset // size) * size
        n = len(names[kind])
        out[kind] = buffer[offset:offset + n * size].view(dtype)
        offset += n * size
    return out


def _nbytes(names: Dict[str, Tuple[str, ...]]) -> int:
    offset = 0
    for kind, dtype in _DTYPES.items():
        size = dtype.itemsize
        offset = -(-offset // size) * size + len(names[kind]) * size
    return max(offset, 1)


_FROM_SCALE = ("scale_before", "inv_scale")  # packed from the state's scale (see load_)


def _writable(host: torch.Tensor):
    """The bytes of a host tensor as a writable ctypes array (``struct.pack_into`` writes into it)."""
    return (ctypes.c_char * (host.numel() * host.element_size())).from_address(host.data_ptr())


def _packer(names: Dict[str, Tuple[str, ...]]) -> struct.Struct:
    """The buffer's layout as a ``struct`` format (padding included): the host packs a whole state in
    one call (a tensor per vector cost ~10 us each, on every synced update)."""
    fmt, offset = "=", 0
    for kind, dtype in _DTYPES.items():
        size = dtype.itemsize
        pad = -(-offset // size) * size - offset
        fmt += "x" * pad + _STRUCT[kind] * len(names[kind])
        offset += pad + len(names[kind]) * size
    fmt += "x" * (_nbytes(names) - offset)
    return struct.Struct(fmt)


class TensorState:
    """A :class:`~lossscale.policy.ScaleState` (any subclass) held on ``device`` in one byte buffer.

    Attributes: ``buffer`` (uint8), the typed vectors ``f64``/``i64``/``f32``/``i32``, ``counters``
    (``totals`` then ``streaks``, views of ``f64``), and one 0-dim view per field (``t.scale``, ``t.growth_tracker``,
    ...), which the tensor rules read and write in place.
    """

    def __init__(self, state: ScaleState, device: torch.device):
        self.state_type = type(state)
        self.names = layout(self.state_type)
        self.buffer = torch.zeros(_nbytes(self.names), dtype=torch.uint8, device=device)
        for kind, vec in _views(self.buffer, self.names).items():
            setattr(self, kind, vec)
            for i, name in enumerate(self.names[kind]):
                setattr(self, name, vec[i])
        self.counters = self.f64[:7]
        self.totals, self.streaks = self.counters[:4], self.counters[4:]
        # What count_tensor compares [overflow_streak, streak_nan_steps] with: [no streak yet, always].
        # Filled on device: a copy from a host list would wait for the device (and fail in a capture).
        self.fresh_limits = torch.zeros(2, dtype=torch.float64, device=device)
        self.fresh_limits[1].fill_(2.0**53)
        self._packer = _packer(self.names)
        self._order = [n for kind in _DTYPES for n in self.names[kind]]
        # The packed values in buffer order, read from a state in one call: the scale stands in for
        # scale_before and inv_scale, and inv_scale is then inverted (load_ runs every synced step).
        self._values = operator.attrgetter(*(("scale" if n in _FROM_SCALE else n) for n in self._order))
        self._inv_at = self._order.index("inv_scale")
        # Each field's Python type, to turn the unpacked number into it (bool, int or float).
        self._decoders = [(f.name, {"bool": bool, "int": int}.get(str(f.type), float))
                          for f in dataclasses.fields(self.state_type)]
        self._constants: Dict[float, torch.Tensor] = {}
        self._replay = None  # (key, _device.GraphedCall) of the rule last replayed (see run_rule)
        self._staging = _device.host_buffer(self.buffer)  # where a host state is encoded before its copy
        self._staging_bytes = _writable(self._staging)
        self.load_(state)

    @property
    def device(self) -> torch.device:
        """Where the state lives."""
        return self.buffer.device

    def span(self, first: str, last: str) -> torch.Tensor:
        """The fields ``first`` to ``last`` as one view (they must be neighbours in one typed vector,
        as a state type's fields of one kind are, in field order): a rule writes them in one kernel."""
        for kind, names in self.names.items():
            if first in names and last in names and names.index(first) <= names.index(last):
                return getattr(self, kind)[names.index(first):names.index(last) + 1]
        raise ValueError(f"{first!r} to {last!r} are not neighbouring fields of one kind in {self.state_type.__name__}.")

    def run_rule(self, policy, flags: torch.Tensor, amax) -> None:
        """``policy.tensor_update(self, flags, amax)``, replayed from a CUDA graph where
        :func:`lossscale._device.replays_rules` says so (captured at the first call for this policy
        configuration and these inputs' shapes and dtypes; one graph kept), else called."""
        if not _device.replays_rules(self.device):
            policy.tensor_update(self, flags, amax)
            return
        key = (policy, flags.shape, flags.dtype, None if amax is None else (amax.shape, amax.dtype))
        if self._replay is None or self._replay[0] != key:
            self._replay = None  # the old graph's memory goes before the new one is captured
            call = _device.GraphedCall(lambda f, a: policy.tensor_update(self, f, a), (flags, amax), self.buffer)
            self._replay = (key, call)
        self._replay[1](flags, amax)

    def constant(self, value: float) -> torch.Tensor:
        """``value`` as a float64 0-dim tensor on the state's device, made once: a Python number in a
        tensor op is a tensor made on the device, a launch every time. Float64, so a float32 scale times
        it is taken in double and rounded once where it is stored (torch's kernel:
        ``static_cast<float>(scale * factor)``). Read it only."""
        c = self._constants.get(value)
        if c is None:
            c = self._constants[value] = torch.full((), value, dtype=torch.float64, device=self.device)
        return c

    def load_(self, state: ScaleState, staging_free: bool = False) -> None:
        """Overwrite the values in place with one host-to-device copy (the views keep their identity).

        ``staging_free``: the caller knows no earlier copy from the staging buffer is still in flight
        (the iteration has synced since): it is reused. Otherwise a fresh host buffer is used, so a
        copy still queued on the device never reads a half-written one. No host sync either way.
        """
        if type(state) is not self.state_type:
            raise ValueError(f"a {self.state_type.__name__} tensor state cannot hold a {type(state).__name__}.")
        if staging_free:
            host, memory = self._staging, self._staging_bytes
        else:
            host = _device.host_buffer(self.buffer)
            memory = _writable(host)
        values = list(self._values(state))
        # 1/scale in float64, rounded to float32 by the packing: torch's inverse, bit for bit.
        values[self._inv_at] = 1.0 / values[self._inv_at]
        # Packed straight into the host buffer's memory (pinned on CUDA): no tensor op on the host.
        self._packer.pack_into(memory, 0, *values)
        _device.copy_from_host_(self.buffer, host)

    def __getstate__(self):
        state = self.__dict__.copy()
        # Made again where it is unpickled or copied: a view of process memory, and a Struct (which
        # neither pickles nor deep-copies).
        del state["_staging_bytes"], state["_packer"]
        state["_replay"] = None  # a CUDA graph neither pickles nor copies: captured again at next use
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._staging_bytes = _writable(self._staging)
        self._packer = _packer(self.names)

    def decode(self, host: torch.Tensor) -> Tuple[ScaleState, float]:
        """``(state, scale_before)`` from a host copy of :attr:`buffer` (host memory: read directly,
        no tensor op; this runs after every device update, on the snapshot the stuck check reads)."""
        if not host.is_cpu or not host.is_contiguous() or host.dtype != torch.uint8:
            raise ValueError(f"decode needs a contiguous uint8 host buffer; got {host.dtype} on {host.device}.")
        values = dict(zip(self._order, self._packer.unpack(ctypes.string_at(host.data_ptr(), host.numel()))))
        scale_before = float(values.pop("scale_before"))
        values["inf_steps"] = values["skipped_steps"] - values["nan_steps"]
        # Straight into the frozen dataclass, as ScaleState.replace does (its __init__ is ~10 us).
        state = object.__new__(self.state_type)
        state.__dict__.update({name: kind(values[name]) for name, kind in self._decoders})
        return state, scale_before

    def to_state(self) -> ScaleState:
        """The pure state. Syncs host and device (one small copy)."""
        return self.decode(self.buffer.cpu())[0]


class StateKeeper:
    """Where the policy state lives: on the host (``mirror``) and on device (``t``).

    The host knows the state before the device state exists, after a load, and after every update
    whose flags it knew (it ran the pure rule); a tensor rule on device makes the mirror unknown
    (None) until :meth:`state` reads the device. After an update captured in a CUDA graph or compiled
    (``graphed``), replays move the device state alone: the host never trusts a copy again.

    Args:
        state: the initial state; ``device_type``: the device type the scaler was built for, or None.
    """

    def __init__(self, state: ScaleState, device_type=None):
        self.mirror: "ScaleState | None" = state
        self.t: "TensorState | None" = None
        self.graphed = False
        self.device_type = device_type
        self._host_wrote = True  # the buffer's inv_scale is 1/scale: the host wrote the state last
        self._power_of_two = False  # whether the device scale is known to be one: set with the device state
        self._pending_nan = None  # (host buffer, event): an overflow's NaN flag on its way to the host

    @property
    def device(self):
        """Where the device state lives (None before it exists)."""
        return None if self.t is None else self.t.device

    def ensure(self, device: torch.device) -> TensorState:
        """The device state, created on ``device`` from the host's state at first use."""
        if self.t is None:
            if self.device_type is not None and device.type != self.device_type:
                raise ValueError(f"GradScaler(device={self.device_type!r}) was given a tensor on {device}; pass "
                                 f"device={device.type!r} or device=None to infer it.")
            self.t = TensorState(self.mirror, device)
            self._host_wrote = True
            self._power_of_two = is_power_of_two(self.mirror.scale)
        return self.t

    def inverse(self) -> torch.Tensor:
        """``1/scale`` as float32, torch's: the host's, sent with the state, where the device has not
        moved the scale since; else computed on device: one float32 ``reciprocal`` where the scale is
        known to be a power of two (exact, so the same bits as torch's float64 route), else torch's
        three kernels. No sync.

        Computed also inside a CUDA-graph capture or ``torch.compile``, and there always by torch's
        route: a graph replays later, after device updates that do not write the host's inverse, and
        perhaps after the host set a scale that is no power of two.
        """
        t = self.t
        if not self.graphed and not _device.capturing(t.device):
            if self._host_wrote:
                return t.inv_scale
            if self._power_of_two:
                return t.scale.reciprocal()
        return _device.reciprocal(t.scale)

    def moved_on_device(self, keeps_powers_of_two: bool) -> None:
        """A tensor rule moved the device state: the host no longer knows it, nor its inverse.
        ``keeps_powers_of_two``: the rule takes a power-of-two scale to another (its policy's
        :meth:`~lossscale.policy.PolicyBase.keeps_powers_of_two`)."""
        self.mirror = None
        self._host_wrote = False
        self._power_of_two = self._power_of_two and keeps_powers_of_two

    def require(self, call: str) -> TensorState:
        """The device state; RuntimeError naming ``call`` before the first ``scale()``."""
        if self.t is None:
            raise RuntimeError(f"{call} was called before scale(): call scaler.scale(loss).backward() first in the "
                               "iteration.")
        return self.t

    def state(self) -> ScaleState:
        """The state: free where the host knows it, else one sync."""
        if self.mirror is not None:
            self.resolve()
            return self.mirror
        state = self.t.to_state()
        self._pending_nan = None  # the device counters hold it already
        if not self.graphed:
            self.mirror = state
        return state

    def take(self, values) -> None:
        """Learn the device state from a host copy of its buffer (the bytes as numbers, read by
        someone else's transfer); the host knows it again, as after :meth:`state`."""
        state = self.t.decode(torch.tensor([int(v) for v in values], dtype=torch.uint8))[0]
        self._pending_nan = None
        if not self.graphed:
            self.mirror = state

    def set(self, state: ScaleState, synced: bool = False, nan=None) -> None:
        """Make ``state`` the state, on the host and (one copy, in place) on device. ``synced``: the
        iteration synced, so the staging buffer of the last copy is free.

        ``nan``: a float32 0/1 device flag that an overflow ``state`` counted as inf held NaN, learned
        after the host's decision (torch's check+unscale kernel cannot tell them apart). The device
        counters take it now (two adds); the host's copy takes it from a non-blocking copy, by the
        next sync (:meth:`resolve`), so an overflow costs no second sync.
        """
        if self.t is not None:
            if self.t.state_type is type(state):
                self.t.load_(state, staging_free=synced)
            else:
                self.t = TensorState(state, self.t.device)
            self._host_wrote = True
        self._power_of_two = is_power_of_two(state.scale)
        self.mirror = None if self.graphed else state
        self._pending_nan = None
        if nan is not None and self.t is not None:
            self.t.totals[2].add_(nan)   # nan_steps (inf_steps is skipped - nan)
            self.t.streaks[1].add_(nan)  # streak_nan_steps: this step is in the current streak
            buffer = _device.host_buffer(nan)
            _device.copy_to_host_(buffer, nan)
            self._pending_nan = (buffer, _device.record_event(nan.device))

    def resolve(self) -> None:
        """Take a pending NaN flag into the host's copy (waits for its copy only if it has not landed)."""
        if self._pending_nan is None or self.mirror is None:
            return
        buffer, event = self._pending_nan
        self._pending_nan = None
        _device.wait(event)
        if buffer.tolist():  # host memory: no device read (a CPU counter would take .item() for one)
            m = self.mirror
            self.mirror = m.replace(nan_steps=m.nan_steps + 1, inf_steps=m.inf_steps - 1,
                                    streak_nan_steps=m.streak_nan_steps + 1)

    def cap_growth_tracker(self, limit: int) -> None:
        """Keep the growth tracker below ``limit`` (a lowered growth interval)."""
        if self.t is not None:
            self.t.growth_tracker.clamp_(max=limit - 1)
        if self.mirror is not None:
            self.mirror = self.mirror.replace(growth_tracker=min(self.mirror.growth_tracker, limit - 1))
