"""Count host-device synchronisations, for tests that promise "no sync in the hot path".

A sync is the host waiting for an accelerator's queue to drain so it can read a value.  On a
CPU-only machine nothing waits, but the same *operations* that would sync on a GPU still pass
through torch's dispatcher, so a :class:`~torch.utils._python_dispatch.TorchDispatchMode` can
count them.  This makes the promise checkable in CPU-only CI:

>>> import torch
>>> from lossscale._sync import count_host_syncs
>>> x = torch.ones(3)
>>> with count_host_syncs() as syncs:
...     y = (x * 2).sum()          # stays a tensor: no sync
...     _ = float(y)               # reads the value: one sync
>>> syncs.count
1

What is counted (each call once):

* ``aten._local_scalar_dense``: every ``.item()``, ``float(t)``, ``int(t)``, ``bool(t)`` and
  ``if t:`` on a tensor;
* copies from a non-CPU device to the CPU (``t.cpu()``, ``t.to("cpu")``, ``t.tolist()`` and
  ``t.numpy()`` of a device tensor), except a ``non_blocking`` copy into pinned memory, which the
  host does not wait for;
* copies from pageable (not pinned) host memory to a device (``torch.tensor(list, device="cuda")``,
  ``t.to("cuda")`` of a CPU tensor): the host waits for the stream before it may reuse the memory,
  and inside a CUDA-graph capture such a copy fails;
* operators whose output *shape* depends on tensor values, which must read them on the host:
  ``nonzero``, ``masked_select``, ``unique`` and friends, and indexing with a boolean mask.

What it cannot see: syncs hidden inside a single operator's device kernel (CUDA's
``torch.bincount`` reads the input's maximum on the host; a dispatch mode only sees the
``bincount`` call, and on CPU that call is no sync at all).  Code that must stay sync-free on
accelerators should avoid such operators there; see ``lossscale.stats`` for an example.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SyncCounter", "count_host_syncs"]

_aten = torch.ops.aten

# Operators that always read tensor values on the host (their output shape depends on them).
_VALUE_DEPENDENT_SHAPE = {
    _aten._local_scalar_dense.default,
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten._unique2.default,
    _aten.unique_consecutive.default,
    _aten.unique_dim.default,
}

_COPIES = {_aten._to_copy.default, _aten.copy_.default}


@dataclass
class SyncCounter:
    """What :func:`count_host_syncs` saw.

    Attributes:
        count: number of operations that synchronise (or, on CPU, would synchronise) the host
            with the device.
        ops: their names, in call order, for error messages.
    """

    count: int = 0
    ops: List[str] = field(default_factory=list)

    def _add(self, name: str) -> None:
        self.count += 1
        self.ops.append(name)


def _is_pageable_to_device(func, args, out) -> bool:
    if func is _aten.copy_.default:
        dst, src = args[0], args[1]
    else:
        dst, src = out, args[0]
    return (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.device.type == "cpu"
            and dst.device.type != "cpu" and not src.is_pinned())


def _is_device_to_host(func, args, kwargs, out) -> bool:
    if func is _aten.copy_.default:
        dst, src = args[0], args[1]
        non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
        if non_blocking and dst.is_pinned():
            # An asynchronous copy into pinned host memory is queued, not waited for: the host
            # syncs only when it later reads the buffer (after an event says it is done).
            return False
        return dst.device.type == "cpu" and isinstance(src, torch.Tensor) and src.device.type != "cpu"
    src = args[0]
    return (
        isinstance(src, torch.Tensor)
        and src.device.type != "cpu"
        and isinstance(out, torch.Tensor)
        and out.device.type == "cpu"
    )


def _is_mask_index(func, args) -> bool:
    if func not in (_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
    )


class _SyncCountingMode(TorchDispatchMode):
    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _VALUE_DEPENDENT_SHAPE or _is_mask_index(func, args):
            self.counter._add(str(func))
        elif func in _COPIES and (_is_device_to_host(func, args, kwargs, out) or _is_pageable_to_device(func, args, out)):
            self.counter._add(str(func))
        return out


@contextmanager
def count_host_syncs() -> Iterator[SyncCounter]:
    """Context manager: count the host syncs of the torch operations run inside it.

    Yields a :class:`SyncCounter` whose ``.count`` is final when the block exits.  Nested
    dispatch modes (e.g. ``FakeTensorMode``) are not supported inside the block.
    """
    counter = SyncCounter()
    with _SyncCountingMode(counter):
        yield counter
