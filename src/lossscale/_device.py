"""The primitives that differ between devices, behind one tiny interface (the few other device-type
decisions, such as the CPU's amax kernel, are listed in ``docs/architecture.md``).

The scaler runs the same sequence of operations on every device; only these primitives differ:

* :func:`host_buffer`: where an asynchronous copy between host and device lands or starts. On CUDA
  pinned memory (a ``non_blocking`` copy does not wait); on CPU a plain tensor (a memcpy).
  :func:`copy_to_host_` and :func:`copy_from_host_` queue the copies.
* :func:`record_event`: a marker that a copy has landed. On CUDA an event recorded on the stream of
  the *state's* device (not the current device's); on CPU an event that is always complete.
  On other accelerators (XPU, MPS, ...) no event is used and the copy is made blocking: correct,
  at the cost of a sync per snapshot.
* :func:`capturing`: whether the state's device is capturing a CUDA graph, or torch.compile is
  tracing (no host reads then, on any device).
* :func:`reciprocal`: ``1/scale`` as a float32, through float64 as torch does, or directly where a
  device has no float64 (MPS; exact for the power-of-two scales lossscale keeps).
* :func:`replays_rules` and :class:`GraphedCall`: a policy's tensor rule captured once in a CUDA graph
  and replayed, one launch where the rule is one per elementwise op. **Off** unless the environment
  sets ``LOSSSCALE_GRAPHED_RULES=1``, and never on other devices: no GPU has verified it yet
  (``benchmarks/graph_rule.py`` and ``benchmarks/gpu_check.py`` measure it on the first one).

Supported: CPU (the test bench) and CUDA (the product) run the same code; other accelerators are
expected to work with the blocking fallback, untested.
"""

from __future__ import annotations

import os

import torch

from . import _sync

__all__ = ["host_buffer", "record_event", "wait", "capturing", "reciprocal", "copy_to_host_", "copy_from_host_",
           "replays_rules", "GraphedCall"]

_NO_FLOAT64 = ("mps",)


# torch.compiler.is_compiling appeared in torch 2.3's era; without it nothing is ever being compiled.
_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


class _Done:
    """The event of a copy that has already landed (CPU memcpy, or a blocking copy)."""

    def query(self) -> bool:
        """Always complete."""
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""


_DONE = _Done()


def _async(device: torch.device) -> bool:
    """Whether copies from ``device`` to the host can be queued and waited for with an event."""
    return device.type == "cuda"


def host_buffer(like: torch.Tensor) -> torch.Tensor:
    """An empty host tensor shaped like ``like``, pinned when copies from its device are asynchronous."""
    return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=_async(like.device))


def copy_to_host_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Queue ``dst <- src`` without waiting where the device allows it (see :func:`record_event`)."""
    dst.copy_(src, non_blocking=_async(src.device))


def copy_from_host_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Queue ``dst <- src`` (a host buffer from :func:`host_buffer`) without waiting where the device
    allows it: from pinned memory a CUDA copy is queued on the stream (the caller must not rewrite
    ``src`` until it has run); on the CPU it is a memcpy."""
    dst.copy_(src, non_blocking=_async(dst.device))


def record_event(device: torch.device):
    """An object whose ``query()`` says whether the copies queued so far on ``device`` have landed."""
    if not _async(device):
        return _DONE
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def wait(event) -> None:
    """Block until ``event`` (from :func:`record_event`) has completed: a sync, unless it already has."""
    if not event.query():
        event.synchronize()


def capturing(device: torch.device) -> bool:
    """Whether the host cannot look at values now: ``torch.compile`` is tracing (a host read would
    break the graph), or ``device``'s current stream is capturing a CUDA graph."""
    if _compiling():
        return True
    if device.type != "cuda":
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """``1/scale`` as float32. In float64 and rounded once, as torch's GradScaler (a float32
    reciprocal may be an ulp off for a non-power-of-two scale); directly in float32 where the device
    has no float64, which is exact for a power-of-two scale."""
    if scale.device.type in _NO_FLOAT64:
        return scale.reciprocal()
    return scale.double().reciprocal().float()


def replays_rules(device: torch.device) -> bool:
    """Whether a tensor rule on ``device`` runs as a :class:`GraphedCall`: CUDA, with
    ``LOSSSCALE_GRAPHED_RULES=1`` in the environment (read at every call), and no capture or trace in
    progress (a capture inside a capture is an error; a trace records the rule's operators itself)."""
    return (device.type == "cuda" and os.environ.get("LOSSSCALE_GRAPHED_RULES") == "1"
            and not capturing(device))


class GraphedCall:
    """``fn(*inputs)`` captured once in a CUDA graph over copies of ``inputs`` (static buffers); a
    call copies new inputs in (one launch each) and replays the graph (one launch).

    ``fn`` must depend on its inputs' values only through tensor operations (a policy's tensor rule
    does: its Python branches read the policy's configuration). Warm-up runs on a side stream, as
    torch's capture recipe asks (constants and workspaces are made outside the capture); it writes
    ``keep`` (the state ``fn`` updates), which is restored after it, so building the call leaves
    ``keep`` as it found it: capture records without running. No host sync after construction.
    """

    def __init__(self, fn, inputs, keep: torch.Tensor):
        self.inputs = [None if x is None else x.clone() for x in inputs]
        saved = keep.clone()
        here = torch.cuda.current_stream(keep.device)
        side = torch.cuda.Stream(keep.device)
        side.wait_stream(here)
        with torch.cuda.stream(side):
            for _ in range(3):
                fn(*self.inputs)
        here.wait_stream(side)
        keep.copy_(saved)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=side):  # the warm-up's stream: what it set up is there
            fn(*self.inputs)

    def __call__(self, *inputs) -> None:
        for static, x in zip(self.inputs, inputs):
            if static is not None:
                static.copy_(x)
        self.graph.replay()
        _sync.count_launch("cudaGraphLaunch")  # no operator: the launch counters would not see it
