"""A stand-in CUDA device for the test suite: tensors that report ``cuda:0`` and compute on the CPU.

    with fake_cuda() as gpu:                       # or the ``stand_in_cuda`` fixture
        model = tiny_mlp().to("cuda")              # FakeCudaTensor parameters, device cuda:0
        scaler = lossscale.GradScaler("cuda")      # its CUDA path: pinned buffers, events, capture check
        with count_device_work() as work:          # lossscale._sync: launches, syncs, copies
            ...
        gpu.events_recorded

Why it is built this way (torch 2.13, CPU build):

* **The tensors.** A :class:`FakeCudaTensor` is a wrapper subclass (``_make_wrapper_subclass``) around
  a CPU tensor. Its ``__torch_dispatch__`` (and :class:`_FakeCudaMode`'s, for factories) runs every
  aten operator on the CPU tensors and wraps what comes back, so optimizers (for-loop, foreach and
  ``fused=True``: ``torch._fused_adam_`` runs torch's CPU kernel), ``torch.amp.GradScaler`` and
  lossscale run their real code. Python sees ``cuda:0`` (``device``, ``is_cuda``, ``get_device``,
  ``to``/``cuda``/``cpu``, ``tolist``, ``numpy`` are overridden on the class).
* **torch's C++ core sees a meta tensor.** Not CUDA: on a CPU build the autograd engine aborts the
  process on a tensor whose C++ device is CUDA (it asks the absent CUDA runtime for a stream in
  ``InputMetadata`` and ``InputBuffer::add``), and torch registers no CUDA device guard a test could
  borrow (``_ensureCUDADeviceGuardSet`` helps only CUDA builds without a GPU). Not CPU either: C++
  code that allocates or casts "like this tensor" (autograd's ``.to()`` backward, composite
  operators' ``empty(..., self.options())``) passes the C++ device explicitly, and "cpu" there could
  not be told from a copy to the host; "meta" can. Meta tensors have a no-op device guard and run
  autograd on the CPU queue. So inside the stand-in ``device=meta`` means the stand-in device.
* **What C++ would decide from that device** is redone in Python where it matters: torch's
  device/dtype grouping for foreach and fused kernels (``torch._C._group_tensors_by_device_and_dtype``)
  groups by the device Python sees, the foreach fast path accepts the class, ``.to()`` aliases or
  copies by the device Python sees.
* **Factories** (``torch.zeros(..., device="cuda")``, ``torch.full``, ``torch.randn``...) reach
  :class:`_FakeCudaMode` with ``device=cuda`` and are built on the CPU. A small ``TorchFunctionMode``
  (:class:`_CudaCalls`) gives a device without index its index 0 (torch would ask the absent CUDA
  guard for the current device), and ``torch.tensor(list, device="cuda")`` is built on the host and
  copied to the device where the dispatch modes see it (``torch._C._set_only_lift_cpu_tensors``, as
  ``FakeTensorMode`` does): a copy from pageable memory, as on CUDA.
* **Autocast.** ``torch.autocast("cuda", dtype=torch.float16)`` sets CUDA's autocast state, but
  torch's autocast kernels decide by the C++ device, so :class:`_CudaCalls` applies CUDA's autocast
  lists at the Python API (matmuls, linears, convolutions to the fast dtype; losses, norms, softmax,
  exp/log/pow to float32; cat/stack/addcmul... to the widest), caching the casts of leaf weights until
  ``torch.clear_autocast_cache()`` as autocast does. It sees the functions user code calls
  (``F.linear``, ``F.cross_entropy``, ``torch.mm``, ``x @ w``), not operators other C++ operators call.
* **The CUDA runtime** calls that torch and lossscale make are faked while the stand-in is active:
  ``torch.cuda.is_available()`` is True (one device), events are always complete and counted, streams
  are no-ops, no graph is ever being captured (``capturing`` pretends one is), pinned memory is plain
  host memory that says it is pinned (:func:`pinned`), and ``torch.cuda.set_sync_debug_mode`` works:
  "warn" or "error" on every operation ``lossscale._sync.classify`` calls a sync (CUDA's own detector
  leaves out a ``non_blocking`` copy from pageable memory, which this one flags), and on
  ``Stream.synchronize``. lossscale's ``_device.py`` needs no seam: its CUDA branch (pinned buffer,
  ``non_blocking`` copy, ``torch.cuda.Event`` on ``current_stream``, the capture check under
  ``torch.cuda.device``) runs unchanged against these fakes.

Where it is more forgiving than CUDA: no memory limit, no asynchrony (an event is complete at once,
so a snapshot is never read late), one device, and the CPU's random numbers and kernels (float16
arithmetic on the CPU may round differently). Where it is as strict: a CPU tensor with dimensions
mixed into a device operator raises as on CUDA (a 0-dim CPU tensor is a scalar, as CUDA accepts,
except in the ``_amp_*`` and ``_fused_*`` kernels), and so does pinning a device tensor or calling
``numpy()`` on it.
"""

from __future__ import annotations

import time
import warnings
from contextlib import ExitStack, contextmanager
from typing import Any, Dict, Iterator, List, Optional

import pytest
import torch
import torch.utils._foreach_utils as _foreach_utils
from torch.optim import optimizer as _optimizer
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from lossscale import _sync

__all__ = ["FakeCudaTensor", "FakeCuda", "fake_cuda", "stand_in_cuda", "pinned", "needs_cuda", "STAND_IN",
           "CUDA_LIKE", "on"]

CUDA0 = torch.device("cuda", 0)
_HOST = torch.device("cpu")
_META = torch.device("meta")  # the C++ device of a FakeCudaTensor (see the module docstring)
_active: Optional["FakeCuda"] = None


def _on_device(device: torch.device) -> bool:
    return device.type != "cpu"


# ------------------------------------------------------------------ the tensors
class FakeCudaTensor(torch.Tensor):
    """A tensor that reports ``cuda:0`` and holds its values in a CPU tensor (``_data``)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> "FakeCudaTensor":
        t = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            layout=data.layout, device=_META, requires_grad=False)
        t._data = data
        return t

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"FakeCudaTensor({self._data!r}, device='cuda:0')"

    # torch.compile/Module._apply: a traceable wrapper (Module.to/.half swap it in whole).
    def __tensor_flatten__(self):
        """The inner tensor's attribute name (torch's traceable-wrapper protocol)."""
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        """Rebuild from the inner tensor (torch's traceable-wrapper protocol)."""
        return FakeCudaTensor(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        """Run ``func`` on the CPU tensors and wrap what comes back."""
        return _run(func, args, kwargs or {})

    # What Python sees: a CUDA tensor.
    @property
    def device(self) -> torch.device:
        """``cuda:0``."""
        return CUDA0

    @property
    def is_cuda(self) -> bool:
        """True."""
        return True

    @property
    def is_cpu(self) -> bool:
        """False."""
        return False

    @property
    def is_meta(self) -> bool:
        """False (only torch's C++ core sees meta)."""
        return False

    def get_device(self) -> int:
        """0."""
        return 0

    def is_pinned(self, device=None) -> bool:
        """False: device memory."""
        return False

    def pin_memory(self, device=None):
        """Refused, as for a CUDA tensor."""
        raise RuntimeError(f"cannot pin '{self.type()}' only dense CPU tensors can be pinned")

    def type(self, dtype=None, non_blocking=False, **kwargs):
        """``torch.cuda.<T>Tensor`` as a string; with ``dtype``, a cast (torch's meaning)."""
        if dtype is None:
            return torch.Tensor.type(self._data).replace("torch.", "torch.cuda.", 1)
        return self.to(dtype=dtype, non_blocking=non_blocking)

    def tolist(self):
        """A copy to the host (a sync, as on CUDA), then its values."""
        return self.cpu().tolist()

    def numpy(self, *, force: bool = False):
        """Refused, as for a CUDA tensor."""
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                        "to host memory first.")

    def to(self, *args, **kwargs):
        """torch's ``Tensor.to``, deciding alias-or-copy by the device Python sees."""
        return _to(self, *args, **kwargs)

    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        """Already on the device (a copy only for another dtype or format)."""
        return _to(self, CUDA0 if device is None else device, non_blocking=non_blocking, memory_format=memory_format)

    def cpu(self, memory_format=torch.preserve_format):
        """A copy to the host."""
        return _to(self, _HOST, memory_format=memory_format)

    def new_tensor(self, data, dtype=None, device=None, requires_grad=False, **kwargs):
        """``torch.tensor(data)`` on this tensor's device (and dtype) unless told otherwise."""
        return torch.tensor(data, dtype=dtype or self.dtype, device=device or CUDA0, requires_grad=requires_grad)


class _Pinned(torch.Tensor):
    """Plain host memory that says it is pinned (the stand-in has no page-locked allocator)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def is_pinned(self, device=None) -> bool:
        """True."""
        return True

    def pin_memory(self, device=None):
        """Already pinned."""
        return self


def pinned(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a CPU tensor) as stand-in pinned memory: ``is_pinned()`` is True."""
    return torch.Tensor._make_subclass(_Pinned, t.detach(), t.requires_grad)


def _python_device(t: Any) -> torch.device:
    return CUDA0 if isinstance(t, FakeCudaTensor) else t.device


def _normal(device) -> Optional[torch.device]:
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda":
        if device.index not in (None, 0):
            raise RuntimeError(f"CUDA error: invalid device ordinal (the stand-in has one device; got {device})")
        return CUDA0
    return device


def _to(t: torch.Tensor, *args, copy: bool = False, **kwargs):
    if args and isinstance(args[0], torch.Tensor):  # t.to(other): other's device and dtype
        other, args = args[0], args[1:]
        device, dtype = _python_device(other), other.dtype
        _, _, non_blocking, memory_format = torch._C._nn._parse_to(other.dtype, *args, **kwargs)
    else:
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    device = _normal(device) or _python_device(t)
    dtype = dtype or t.dtype
    keeps_format = memory_format in (None, torch.preserve_format)
    if device == _python_device(t) and dtype == t.dtype and keeps_format and not copy:
        return t
    return torch.ops.aten._to_copy.default(
        t, dtype=dtype, device=device, non_blocking=non_blocking,
        memory_format=torch.preserve_format if memory_format is None else memory_format)


# ------------------------------------------------------------------ running an operator
_STRICT = ("_amp_", "_fused_")  # CUDA kernels that take no CPU tensor, not even a 0-dim one
_returns: Dict[Any, List[Optional[str]]] = {}


def _written_args(func) -> List[Optional[str]]:
    """For each return of ``func``: the name of the argument it writes and returns (in-place, out=)."""
    names = _returns.get(func)
    if names is None:
        schema = func._schema
        by_set = {frozenset(a.alias_info.before_set): a.name for a in schema.arguments
                  if a.alias_info is not None and a.alias_info.is_write}
        names = [by_set.get(frozenset(r.alias_info.before_set)) if r.alias_info is not None and r.alias_info.is_write
                 else None for r in schema.returns]
        _returns[func] = names
    return names


def _argument(func, args, kwargs, name: str):
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return kwargs[name] if name in kwargs else args[i]
    raise KeyError(name)


def _check_devices(func, args, kwargs) -> None:
    packet = func.overloadpacket
    if packet in _sync._COPIES or packet in _sync._INDEXING:
        return
    tensors = [t for t in _leaves(args, kwargs) if isinstance(t, torch.Tensor)]
    if not any(isinstance(t, FakeCudaTensor) for t in tensors):
        return
    strict = packet.__name__.startswith(_STRICT)
    for t in tensors:
        if not isinstance(t, FakeCudaTensor) and (strict or t.dim() > 0):
            raise RuntimeError(f"{func}: Expected all tensors to be on the same device, but found at least two "
                               f"devices, cuda:0 and {t.device}! (the stand-in CUDA device, as CUDA would)")


def _unwrap(x):
    return x._data if isinstance(x, FakeCudaTensor) else x


def _map(fn, x):
    """``fn`` over the leaves of an operator's arguments or outputs (tuples, lists, dicts; faster than pytree)."""
    if isinstance(x, (list, tuple)):
        return type(x)(_map(fn, v) for v in x)
    if isinstance(x, dict):
        return {k: _map(fn, v) for k, v in x.items()}
    return fn(x)


def _leaves(*trees) -> Iterator[Any]:
    for x in trees:
        if isinstance(x, (list, tuple)):
            yield from _leaves(*x)
        elif isinstance(x, dict):
            yield from _leaves(*x.values())
        else:
            yield x


def _run(func, args: tuple, kwargs: dict):
    """``func`` on the CPU: the stand-in device's every operator."""
    if _active is not None and _active.sync_debug_mode:
        if _sync.classify(func, args, kwargs, _on_device)[1]:
            _active._flag(str(func))
    _check_devices(func, args, kwargs)
    device = kwargs.get("device")
    if device is not None:
        to_device = torch.device(device).type in ("cuda", "meta")
        if to_device:
            kwargs = {**kwargs, "device": _HOST}
    else:
        to_device = any(isinstance(t, FakeCudaTensor) for t in _leaves(args, kwargs))
    out = func(*_map(_unwrap, args), **_map(_unwrap, kwargs))
    written = _written_args(func)
    if any(written):  # in place or out=: hand back the caller's own tensors
        originals = [None if n is None else _argument(func, args, kwargs, n) for n in written]
        if len(originals) == 1:
            return originals[0]
        return tuple(o if o is not None else r for o, r in zip(originals, out))
    if not to_device:
        return out
    return _map(lambda x: FakeCudaTensor(x) if isinstance(x, torch.Tensor) else x, out)


class _FakeCudaMode(TorchDispatchMode):
    """Every operator, factories with ``device=cuda`` included, goes to :func:`_run`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


# CUDA's autocast lists (aten/src/ATen/autocast_mode.cpp), by the names user code calls.
_TO_FAST = ("_convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d "
            "convolution prelu addmm addmv addr matmul einsum mm mv vecdot linear addbmm baddbmm bmm "
            "chain_matmul multi_dot lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell scaled_dot_product_attention "
            "__matmul__ __rmatmul__")
_TO_FP32 = ("acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus "
            "layer_norm group_norm frobenius_norm nuclear_norm cosine_similarity poisson_nll_loss "
            "cosine_embedding_loss nll_loss hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss "
            "margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss "
            "binary_cross_entropy_with_logits cross_entropy dist pdist cdist renorm logsumexp prod softmax "
            "log_softmax cumprod cumsum vector_norm matrix_norm")
_TO_WIDEST = "addcdiv addcmul atan2 bilinear cross dot grid_sample index_put scatter_add tensordot cat stack"


def _policies() -> Dict[Any, str]:
    import torch.nn.functional as F

    table = {}
    for policy, names in (("fast", _TO_FAST), ("fp32", _TO_FP32), ("widest", _TO_WIDEST)):
        for name in names.split():
            for owner in (torch, torch.Tensor, F, torch._C._nn, torch.linalg, torch.special):
                fn = getattr(owner, name, None)
                if callable(fn):
                    table[fn] = policy
    return table


_AUTOCAST: Dict[Any, str] = {}


class _CudaCalls(TorchFunctionMode):
    """The stand-in's part above the dispatcher: ``"cuda"`` becomes ``cuda:0`` before torch's C++ asks
    the absent CUDA guard for the current device; ``Tensor.to``/``cuda`` of host tensors take the
    stand-in's copy; pinned memory is faked; CUDA autocast's casts are applied (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: Dict[int, Any] = {}  # id(leaf weight) -> (weight, its cast), as autocast caches
        if not _AUTOCAST:
            _AUTOCAST.update(_policies())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs = {**kwargs, "device": _normal(kwargs["device"])}
        if func is torch.Tensor.to:
            return _to(*args, **kwargs)
        if func is torch.Tensor.cuda:
            t, device = args[0], (args[1] if len(args) > 1 else kwargs.pop("device", None))
            return _to(t, _normal(device) or CUDA0, **kwargs)
        if func is torch.Tensor.pin_memory:
            return pinned(args[0].clone())
        if kwargs.get("pin_memory"):
            return pinned(func(*args, **{**kwargs, "pin_memory": False}))
        policy = _AUTOCAST.get(func)
        if policy is not None and torch.is_autocast_enabled("cuda"):
            args, kwargs = self._autocast(policy, args, kwargs)
        return func(*args, **kwargs)

    def _autocast(self, policy: str, args, kwargs):
        floats = [t for t in _leaves(args, kwargs) if isinstance(t, FakeCudaTensor) and t.is_floating_point()
                  and t.dtype is not torch.float64]
        if policy == "fast":
            dtype = torch.get_autocast_dtype("cuda")
        elif policy == "fp32":
            dtype = torch.float32
        else:
            dtype = max((t.dtype for t in floats), key=lambda d: torch.finfo(d).bits, default=None)
        if dtype is None:
            return args, kwargs

        def cast(x):
            if not (isinstance(x, FakeCudaTensor) and x.is_floating_point() and x.dtype not in (dtype, torch.float64)):
                return x
            if not (x.is_leaf and x.requires_grad and torch.is_autocast_cache_enabled()):
                return torch.ops.aten._to_copy.default(x, dtype=dtype)
            hit = self.cache.get(id(x))
            if hit is None or hit[0] is not x or hit[1].dtype is not dtype:
                hit = self.cache[id(x)] = (x, torch.ops.aten._to_copy.default(x, dtype=dtype))
            return hit[1]

        return _map(cast, args), _map(cast, kwargs)


# ------------------------------------------------------------------ the CUDA runtime, faked
class _Stream:
    """A CUDA stream: everything has run by the time Python looks."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device = CUDA0

    def synchronize(self) -> None:
        """A host wait (flagged by the sync debug mode, as CUDA's stream synchronize is)."""
        if _active is not None:
            _active._flag("Stream.synchronize")

    def query(self) -> bool:
        """True."""
        return True

    def wait_stream(self, stream) -> None:
        """Nothing to wait for."""

    def wait_event(self, event) -> None:
        """Nothing to wait for."""

    def record_event(self, event=None):
        """Record ``event`` (a new one by default) on this stream."""
        event = event or torch.cuda.Event()
        event.record(self)
        return event

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


class _Event:
    """A CUDA event: complete as soon as recorded; counted; times what ran between two records."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **kwargs):
        self._at: Optional[float] = None
        if _active is not None:
            _active.events_created += 1

    def record(self, stream=None) -> None:
        """Mark now."""
        self._at = time.perf_counter()
        if _active is not None:
            _active.events_recorded += 1

    def query(self) -> bool:
        """Always complete."""
        return True

    def wait(self, stream=None) -> None:
        """Nothing to wait for."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def elapsed_time(self, end: "_Event") -> float:
        """Milliseconds between this record and ``end``'s."""
        return (end._at - self._at) * 1000.0


class _DeviceContext:
    """``torch.cuda.device(d)``: the stand-in has one device."""

    def __init__(self, device):
        _normal(torch.device("cuda", device) if isinstance(device, int) else device)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


_SYNC_MODES = {"default": 0, "warn": 1, "error": 2, 0: 0, 1: 1, 2: 2}


def _group_by_python_device(tensorlistlist, with_indices=False):
    """torch's ``_group_tensors_by_device_and_dtype``, keyed by the device Python sees."""
    groups: Dict[Any, Any] = {}
    for i, t in enumerate(tensorlistlist[0]):
        if t is None:
            continue
        key = (_python_device(t), t.dtype)
        if key not in groups:
            groups[key] = ([[] for _ in tensorlistlist], [])
        lists, indices = groups[key]
        for lst, src in zip(lists, tensorlistlist):
            if src:  # an empty list (e.g. no max_exp_avg_sqs) stays empty
                lst.append(src[i])
        indices.append(i)
    return {k: (lists, indices if with_indices else []) for k, (lists, indices) in groups.items()}


class FakeCuda:
    """The active stand-in: what it counted (``events_created``, ``events_recorded``), the sync debug
    mode (``sync_debug_mode``: 0, 1 warn, 2 error) and ``capturing`` (True makes
    ``torch.cuda.is_current_stream_capturing()`` say a graph is being captured)."""

    def __init__(self) -> None:
        self.events_created = 0
        self.events_recorded = 0
        self.sync_debug_mode = 0
        self.capturing = False

    def _flag(self, what: str) -> None:
        if self.sync_debug_mode == 2:
            raise RuntimeError(f"called a synchronizing CUDA operation ({what}; the stand-in device)")
        if self.sync_debug_mode == 1:
            warnings.warn(f"called a synchronizing CUDA operation ({what}; the stand-in device)", UserWarning,
                          stacklevel=3)

    def set_sync_debug_mode(self, mode) -> None:
        """``torch.cuda.set_sync_debug_mode``: "default"/0, "warn"/1 or "error"/2."""
        self.sync_debug_mode = _SYNC_MODES[mode]

    def _patches(self, calls: _CudaCalls) -> Dict[Any, Dict[str, Any]]:
        cuda = torch.cuda
        clear_autocast_cache = torch.clear_autocast_cache

        def clear():
            calls.cache.clear()
            clear_autocast_cache()

        return {
            cuda: dict(
                is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
                set_device=lambda d: _normal(torch.device("cuda", d) if isinstance(d, int) else d),
                _lazy_init=lambda: None, get_device_name=lambda device=None: "stand-in CUDA device (CPU)",
                get_device_capability=lambda device=None: (9, 0), is_bf16_supported=lambda *a, **k: True,
                synchronize=lambda device=None: None, current_stream=lambda device=None: _Stream(),
                default_stream=lambda device=None: _Stream(), Stream=_Stream, Event=_Event,
                stream=lambda s: s if s is not None else _Stream(), device=_DeviceContext,
                is_current_stream_capturing=lambda: self.capturing,
                set_sync_debug_mode=self.set_sync_debug_mode, get_sync_debug_mode=lambda: self.sync_debug_mode,
                manual_seed=lambda seed: None, manual_seed_all=lambda seed: None,
                memory_allocated=lambda device=None: 0, max_memory_allocated=lambda device=None: 0,
                reset_peak_memory_stats=lambda device=None: None, empty_cache=lambda: None),
            torch: dict(clear_autocast_cache=clear),
            torch._C: dict(_group_tensors_by_device_and_dtype=_group_by_python_device),
        }


@contextmanager
def fake_cuda() -> Iterator[FakeCuda]:
    """Context manager: the stand-in CUDA device is active inside (not reentrant).

    Enter it before ``lossscale._sync.count_device_work`` / ``count_host_syncs``: the counter must
    see the operators before the stand-in runs them on the CPU.
    """
    global _active
    if _active is not None:
        raise RuntimeError("fake_cuda() is already active")
    if any(isinstance(m, _sync._CountingMode) for m in _get_current_dispatch_mode_stack()):
        raise RuntimeError("enter fake_cuda() before count_device_work()/count_host_syncs(), not inside them")
    gpu, calls = FakeCuda(), _CudaCalls()
    patches = gpu._patches(calls)
    saved = [(owner, name, getattr(owner, name)) for owner, names in patches.items() for name in names]
    lift = torch._C._only_lift_cpu_tensors()
    foreach_lists = (_foreach_utils._foreach_supported_types, _optimizer._foreach_supported_types)
    try:
        for owner, names in patches.items():
            for name, value in names.items():
                setattr(owner, name, value)
        for lst in foreach_lists:
            lst.append(FakeCudaTensor)
        torch._C._set_only_lift_cpu_tensors(True)
        _active = gpu
        with ExitStack() as stack:
            stack.enter_context(_FakeCudaMode())
            stack.enter_context(calls)
            yield gpu
    finally:
        _active = None
        torch._C._set_only_lift_cpu_tensors(lift)
        for lst in foreach_lists:
            while FakeCudaTensor in lst:
                lst.remove(FakeCudaTensor)
        for owner, name, value in saved:
            setattr(owner, name, value)


class TwinGraphedCall:
    """``lossscale._device.GraphedCall``'s stand-in, for CUDA graphs, which neither the CPU nor this
    module's device has: the same static input buffers, the same warm-up and restore of the state, and
    a "replay" that calls ``fn`` on the static buffers, which is what a replay computes. It checks the
    plumbing around a graph, not capture. Launch counters see a replay as a GPU does: the input copies,
    then one launch (``fn``'s operators run out of their sight). Counts its constructions and replays
    (class attributes)."""

    built = 0
    replays = 0

    def __init__(self, fn, inputs, keep):
        type(self).built += 1
        self.fn = fn
        self.inputs = [None if x is None else x.clone() for x in inputs]
        saved = keep.clone()
        for _ in range(3):
            fn(*self.inputs)
        keep.copy_(saved)

    def __call__(self, *inputs):
        type(self).replays += 1
        for static, x in zip(self.inputs, inputs):
            if static is not None:
                static.copy_(x)
        with _uncounted():
            self.fn(*self.inputs)
        _sync.count_launch("cudaGraphLaunch (twin)")


@contextmanager
def _uncounted():
    """The launch counters (``lossscale._sync``'s modes on top of the mode stack) set aside for the block;
    the stand-in device's own modes stay."""
    from torch.utils._python_dispatch import _pop_mode_temporarily

    with ExitStack() as stack:
        while _get_current_dispatch_mode_stack() and isinstance(_get_current_dispatch_mode_stack()[-1],
                                                                 _sync._CountingMode):
            stack.enter_context(_pop_mode_temporarily())
        yield


@contextmanager
def twin_graphed_rules():
    """Tensor rules replayed through :class:`TwinGraphedCall` on any device (``lossscale._device``'s
    switch turned on, its graph swapped for the twin); the counts start at 0. Yields the class."""
    from lossscale import _device

    saved = _device.replays_rules, _device.GraphedCall
    _device.replays_rules = lambda device: not _device.capturing(device)
    _device.GraphedCall = TwinGraphedCall
    TwinGraphedCall.built = TwinGraphedCall.replays = 0
    try:
        yield TwinGraphedCall
    finally:
        _device.replays_rules, _device.GraphedCall = saved


@pytest.fixture
def stand_in_cuda():
    """Fixture: the stand-in CUDA device, active for the test (yields :class:`FakeCuda`)."""
    with fake_cuda() as gpu:
        yield gpu


#: Marks for a test that needs a real CUDA device (``-m cuda`` selects them; they skip without one).
needs_cuda = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
STAND_IN = pytest.param("stand-in", id="stand-in")
#: The CUDA devices a test runs on: a GPU when there is one, the stand-in always.
CUDA_LIKE = [pytest.param("cuda", id="cuda", marks=needs_cuda), STAND_IN]


@contextmanager
def on(device):
    """The device to ask for: ``device`` itself, or "cuda" inside the stand-in for "stand-in"."""
    if device != "stand-in":
        yield device
        return
    with fake_cuda():
        yield "cuda"
