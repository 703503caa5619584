"""A test instrument: count what a GPU would see, kernel launches, host syncs and copies between host and device.

A sync is the host waiting for an accelerator's queue to drain so it can read a value. Every torch
operation passes through torch's dispatcher, so a
:class:`~torch.utils._python_dispatch.TorchDispatchMode` can classify each one by its operator and
its tensors' devices, the same way on a real GPU and on a plain CPU run:

>>> import torch
>>> from _sync import count_host_syncs
>>> x = torch.ones(3)
>>> with count_host_syncs() as syncs:
...     y = (x * 2).sum()          # stays a tensor: no sync
...     _ = float(y)               # reads the value: one sync
>>> syncs.count
1

What is counted (:func:`classify` is the rule, one operator call at a time):

* **syncs**: ``aten._local_scalar_dense`` of a device tensor (every ``.item()``, ``float(t)``,
  ``int(t)``, ``bool(t)`` and ``if t:``); a copy to host memory that the host waits for (``t.cpu()``,
  ``t.to("cpu", copy=True)``, ``t.tolist()`` of a GPU tensor; a ``non_blocking`` copy into pinned
  memory is queued, not waited for); a copy to the device that the host waits for: a blocking one,
  or any from pageable (not pinned) memory (``torch.tensor(list, device="cuda")``, ``t.to("cuda")``
  of a CPU tensor), which also fails inside a CUDA-graph capture; operators whose output *shape*
  depends on values (``nonzero``, ``masked_select``, ``unique`` and friends, indexing with a boolean
  mask), ``torch.equal`` (a host bool) and, on a device, ``bincount``, whose CUDA implementation
  reads its input's maximum on the host.
* **h2d / d2h**: copies from host to device and back (a copy between two devices is a launch).
* **launches**: every operator that touches a device tensor and runs a kernel there. Views and
  metadata (``view``, ``select``, ``detach``, ``as_strided``, ``t``, ``expand``, ...), allocations
  (``empty``, ``empty_like``, ...) and host-only operators launch nothing. A ``_foreach_*`` operator
  is one launch when its lists share one device and dtype (torch's multi-tensor fast path) and one per
  tensor otherwise. Operators known to launch more than one kernel count them all: out-of-place
  ``masked_fill`` (a clone, then ``masked_fill_``: 2), and on their multi-tensor route
  ``_foreach_norm`` (two workspace fills, the kernel, a cleanup: 4) and ``_foreach_max`` (3), as
  torch's CUDA source reads. Not modelled: other operators that launch more than one kernel in
  their device code, and a multi-tensor launch that splits past 110/64/48/36/30 tensors (by the
  number of lists) or 320 chunks of 65536 elements; torch and lossscale are counted alike.

**A CPU-only run stands for the device.** When the counted block touched no accelerator tensor at
all, every tensor is taken to be where a GPU run would put it: value reads and value-dependent
shapes count as syncs, non-view operators as launches, an explicit copy to the host as a read
(``.tolist()`` of a CPU tensor reads memory without the dispatcher, so it is not seen: host memory
that a copy filled, such as a snapshot's, is read that way). So the CPU test suite checks the promise
"no sync in the hot path" without a GPU. Where the block touched an accelerator tensor, only device
work counts (a read of a CPU-resident tensor, such as ``Adam(foreach=True)``'s step count, is then no
sync). The totals are final when the block exits.

``torch.tensor(data, device=...)`` builds the tensor on the host and copies it below the Python
dispatch key, out of every mode's sight; while a counter is active the copy is made visible by
telling torch to lift the tensor on the CPU first (what ``FakeTensorMode`` does), so it counts as a
copy from pageable memory: a sync and an h2d.

What it cannot see: work done inside a single operator's device code beyond the rules above, and
device calls that are not operators (``torch.cuda.synchronize()``, events), unless their caller
reports them (:func:`count_launch`). Launch counts are a model of a GPU, reported beside measured
time in ``benchmarks/bench_iteration.py``, never a goal.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves

__all__ = ["DeviceWork", "SyncCounter", "classify", "count_device_work", "count_host_syncs", "count_launch"]

_aten = torch.ops.aten

#: (launches, syncs, h2d, d2h) of one operator call.
Work = Tuple[int, int, int, int]
_NOTHING: Work = (0, 0, 0, 0)
_HOST = torch.device("cpu")


def _packets(*names: str) -> frozenset:
    return frozenset(getattr(_aten, n) for n in names if hasattr(_aten, n))


# Operators that read values on the host to size their output.
_READS_VALUES = _packets(
    "nonzero", "masked_select", "_unique2", "unique_consecutive", "unique_dim", "unique_dim_consecutive", "equal"
)
# Operators whose CUDA implementation reads values on the host (not their CPU one, which a CPU run
# standing for the device picks for that reason: lossscale.stats).
_READS_VALUES_ON_DEVICE = _packets("bincount")
_COPIES = _packets("_to_copy", "copy_")
# Operators that allocate or describe memory without running a kernel (besides views, found by schema).
_NO_KERNEL = _packets(
    "empty",
    "empty_strided",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "empty_permuted",
    "resize_",
    "resize_as_",
    "_unsafe_view",
    "is_pinned",
    "record_stream",
    "set_",
    "sym_size",
    "sym_numel",
    "sym_stride",
    "sym_storage_offset",
    "is_same_size",
    "_has_same_storage_numel",
)
_INDEXING = _packets("index", "index_put_", "index_put", "_index_put_impl_")
# Operators that launch more kernels than one, as torch's implementations read. Out-of-place
# masked_fill is a clone and a masked_fill_ on every device (CompositeExplicitAutograd).
_MORE = {p: 1 for p in _packets("masked_fill")}
# A reduction's multi-tensor route on CUDA (aten/src/ATen/native/cuda/ForeachReduceOp.cu): the
# multi-tensor kernel, and besides it _foreach_norm zero-fills two workspaces (the per-chunk partial
# results and the global ones) and runs a cleanup kernel that reduces the chunks; _foreach_max
# zero-fills one workspace and runs its cleanup.
_MORE_ON_FAST_ROUTE = {**{p: 3 for p in _packets("_foreach_norm")}, **{p: 2 for p in _packets("_foreach_max")}}


@dataclass
class DeviceWork:
    """What :func:`count_device_work` (or :func:`count_host_syncs`) saw; final when the block exits.

    Attributes (properties, computed from the recorded calls):
        launches: kernel launches on the device.
        syncs: host waits for the device (``count`` is the same number).
        h2d, d2h: copies from host to device and from device to host.
        ops: the syncing operators' names, in call order, for error messages.
        launch_ops: the launching operators' names, one entry per launch.
        on_device: whether the block touched an accelerator tensor (else the CPU stood for it).
    """

    _calls: List[Tuple[str, Work, Work]] = field(default_factory=list, repr=False)
    on_device: bool = False

    def _pick(self, call) -> Work:
        return call[1] if self.on_device else call[2]

    def _sum(self, i: int) -> int:
        return sum(self._pick(c)[i] for c in self._calls)

    def _names(self, i: int) -> List[str]:
        return [c[0] for c in self._calls for _ in range(self._pick(c)[i])]

    launches = property(lambda self: self._sum(0), doc="Kernel launches.")
    syncs = property(lambda self: self._sum(1), doc="Host syncs.")
    h2d = property(lambda self: self._sum(2), doc="Host-to-device copies.")
    d2h = property(lambda self: self._sum(3), doc="Device-to-host copies.")
    count = property(lambda self: self._sum(1), doc="Host syncs (``count_host_syncs``' name for :attr:`syncs`).")
    ops = property(lambda self: self._names(1), doc="The syncing operators, in call order (one entry per sync).")
    launch_ops = property(lambda self: self._names(0), doc="The launching operators, one entry per launch.")

    def summary(self) -> dict:
        """``{"launches", "syncs", "h2d", "d2h"}`` as plain ints (for JSON and messages)."""
        return {"launches": self.launches, "syncs": self.syncs, "h2d": self.h2d, "d2h": self.d2h}


#: ``count_host_syncs``' record: the same object (``.count``, ``.ops``).
SyncCounter = DeviceWork


def _tensors(tree) -> List[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _pinned(t: torch.Tensor) -> bool:
    try:
        return bool(t.is_pinned())
    except RuntimeError:  # no accelerator to ask
        return False


def _copy(
    src: torch.Tensor,
    dst_device: torch.device,
    dst_pinned: Callable[[], bool],
    non_blocking: bool,
    on_device: Callable[[torch.device], bool],
) -> Work:
    from_dev, to_dev = on_device(src.device), on_device(dst_device)
    if from_dev and to_dev:
        return (1, 0, 0, 0)  # a cast or a copy on the device (or between two devices)
    if from_dev:  # the host waits unless the copy lands in pinned memory without blocking
        return (0, int(not (non_blocking and dst_pinned())), 0, 1)
    if to_dev:  # the host waits for a blocking copy, and for any copy out of pageable memory
        return (0, int(not non_blocking or not _pinned(src)), 1, 0)
    return _NOTHING


def _foreach_launches(packet, args) -> int:
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    tensors = [t for lst in lists for t in lst]
    scalars = [a for a in args if isinstance(a, torch.Tensor)]  # a Tensor scalar operand
    fast = len({(t.device, t.dtype) for t in tensors}) <= 1 and all(
        s.device == tensors[0].device for s in scalars if tensors
    )
    return 1 + _MORE_ON_FAST_ROUTE.get(packet, 0) if fast else max(len(lst) for lst in lists)


def classify(func, args: tuple, kwargs: dict, on_device: Callable[[torch.device], bool]) -> Work:
    """(launches, syncs, h2d, d2h) of one operator call, as a GPU run would see it.

    ``on_device(device)`` says whether a device is the accelerator's (``device.type != "cpu"`` on a
    GPU run; always true where the CPU stands for the device). The rules are in
    the module docstring. Everything is decided from the arguments, before the call runs.
    """
    packet = getattr(func, "overloadpacket", None)
    if packet is None:  # not an aten operator (a higher-order operator runs aten operators itself)
        return _NOTHING
    if packet in _COPIES:
        if packet is _aten.copy_:
            dst, src = args[0], args[1]
            nb = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
            if not isinstance(src, torch.Tensor):
                return (int(on_device(dst.device)), 0, 0, 0)
            return _copy(src, dst.device, lambda: _pinned(dst), nb, on_device)
        src = args[0]
        dst_device = torch.device(kwargs.get("device") or src.device)
        if (
            kwargs.get("device") is not None
            and dst_device.type == "cpu"
            and kwargs.get("dtype") in (None, src.dtype)
            and not kwargs.get("non_blocking")
        ):
            # An explicit, blocking move to the host (t.to("cpu", copy=True)): it leaves the device even
            # where the CPU stands for it. A cast names no device, or another dtype (autograd's casts name
            # both); a copy between devices is non_blocking (torch's GradScaler replicates its scale so).
            return _copy(
                src,
                dst_device,
                lambda: bool(kwargs.get("pin_memory")),
                bool(kwargs.get("non_blocking", False)),
                lambda d: d is not dst_device and on_device(d),
            )
        return _copy(
            src, dst_device, lambda: bool(kwargs.get("pin_memory")), bool(kwargs.get("non_blocking", False)), on_device
        )
    tensors = _tensors((args, kwargs))
    device_kw = kwargs.get("device")
    touches = any(on_device(t.device) for t in tensors) or (
        device_kw is not None and on_device(torch.device(device_kw))
    )
    if packet is _aten._local_scalar_dense:
        return (0, 1, 0, 1) if touches else _NOTHING
    if not touches:
        return _NOTHING
    if packet in _READS_VALUES or (packet in _READS_VALUES_ON_DEVICE and not on_device(_HOST)):
        return (1, 1, 0, 1)
    if packet in _INDEXING:
        indices = [i for i in tree_leaves(args[1:2]) if isinstance(i, torch.Tensor)]
        host = [i for i in indices if not on_device(i.device) and i.dim() > 0]
        masks = any(i.dtype in (torch.bool, torch.uint8) for i in indices)
        h2d_syncs = sum(not _pinned(i) for i in host)
        return (1, int(masks) + h2d_syncs, len(host), int(masks))
    if func.is_view or packet in _NO_KERNEL or torch.Tag.inplace_view in func.tags:
        return _NOTHING
    if packet.__name__.startswith("_foreach_"):
        return (_foreach_launches(packet, args), 0, 0, 0)
    return (1 + _MORE.get(packet, 0), 0, 0, 0)


def count_launch(what: str) -> None:
    """Count one launch that no operator shows, such as a CUDA graph's replay, in every counter active
    now (none: nothing happens)."""
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, _CountingMode):
            mode.work._calls.append((what, (1, 0, 0, 0), (1, 0, 0, 0)))


def _accelerator(device: torch.device) -> bool:
    return device.type != "cpu"


def _everywhere(device: torch.device) -> bool:
    return True


class _CountingMode(TorchDispatchMode):
    """Records every operator call classified both ways (on a device, and CPU standing for it)."""

    def __init__(self, work: DeviceWork) -> None:
        super().__init__()
        self.work = work

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = classify(func, args, kwargs, _accelerator)
        if not self.work.on_device:
            where = [t.device for t in _tensors((args, kwargs))] + [torch.device(kwargs.get("device") or _HOST)]
            self.work.on_device = any(map(_accelerator, where))
        self.work._calls.append((str(func), device, classify(func, args, kwargs, _everywhere)))
        return func(*args, **kwargs)


@contextmanager
def count_device_work() -> Iterator[DeviceWork]:
    """Context manager: count the launches, syncs and copies of the torch operations run inside it.

    Yields a :class:`DeviceWork`, final when the block exits.
    """
    work = DeviceWork()
    lift = torch._C._only_lift_cpu_tensors()
    torch._C._set_only_lift_cpu_tensors(True)  # torch.tensor(data, device=...): copy where modes see it
    try:
        with _CountingMode(work):
            yield work
    finally:
        torch._C._set_only_lift_cpu_tensors(lift)


@contextmanager
def count_host_syncs() -> Iterator[SyncCounter]:
    """Context manager: count the host syncs of the torch operations run inside it.

    Yields a :class:`SyncCounter` (a :class:`DeviceWork`) whose ``.count`` and ``.ops`` are final when
    the block exits. Other dispatch modes (e.g. ``FakeTensorMode``) are not supported inside the
    block.
    """
    with count_device_work() as work:
        yield work
