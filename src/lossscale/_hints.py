"""One-time hints for set-ups that run but are probably not what the user meant.

Kept outside the scaler: each hint is a check the scaler calls in one line, and costs nothing once it
has spoken.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_leaves

from ._warnings import warn
from .diagnosis import NO_FP16, NO_FP16_FIX, NO_FP16_STEPS

__all__ = ["warn_if_bf16", "Fp16Watch", "GRAPH_NODES"]

_warned_bf16 = False  # once per process: after the first warning the check is skipped too

#: The ``scale()`` calls of a scaler that look for bf16: a bf16 set-up shows in the first ones, and
#: asking torch for the autocast state costs ~10 us per call, a tenth of a small iteration.
CALLS_CHECKED = 8


def warn_if_bf16(outputs: Any, passthrough: bool) -> None:
    """Warn once when a scaling ``GradScaler`` scales a bf16 loss, or scales under bf16 autocast.

    bf16 has fp32's exponent range, so nothing underflows that a loss scale would save, while a
    default ``GradScaler()`` still multiplies the loss by 2^16 and unscales every gradient.
    ``passthrough``: the scaler is ``GradScaler.passthrough()`` (scale fixed at 1), which is what bf16
    wants. The first tensor of the outputs is looked at; a float32 loss scaled after the bf16 autocast
    block has closed (the usual loop) shows neither sign and is not detected.
    """
    global _warned_bf16
    if _warned_bf16 or passthrough:
        return
    outputs = next((x for x in tree_leaves(outputs) if isinstance(x, torch.Tensor)), None)
    if outputs is None:
        return
    device_type = outputs.device.type
    try:
        autocast_bf16 = (
            torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.bfloat16
        )
    except (TypeError, AttributeError):  # torch < 2.4 has no per-device query: no hint
        autocast_bf16 = False
    why = (
        "the loss is bf16" if outputs.dtype == torch.bfloat16 else "bf16 autocast is active" if autocast_bf16 else None
    )
    if why is None:
        return
    _warned_bf16 = True
    warn(
        f"lossscale.GradScaler.scale(): {why}. bf16 has fp32's exponent range, so nothing underflows that "
        "loss scaling would save, and this scaler multiplies the loss by its scale (2^16 by default) and "
        "unscales every gradient for nothing. For bf16 use lossscale.GradScaler.passthrough() (scale fixed "
        "at 1, no unscale pass, non-finite steps still skipped); for FP16 autocast with dtype=torch.float16. "
        "(Warned once.)"
    )


#: The backward-graph nodes :class:`Fp16Watch` looks at from the loss, breadth first: an FP16 forward
#: shows within the first few (the last layer's output, cast to float32 for the loss), and the walk costs
#: about a microsecond a node.
GRAPH_NODES = 128


class Fp16Watch:
    """Whether a scaling ``GradScaler`` sees FP16 work, looked for at :meth:`look` (``scale()``) for its
    first :data:`~lossscale.diagnosis.NO_FP16_STEPS` iterations at most; if none of them shows any, it
    warns once and the health report says so (:attr:`idle`).

    FP16 work is, on the scaled tensor (metadata only: no kernel, no host-device sync): an FP16 loss,
    FP16 autocast active on its device at ``scale()``, or an FP16 tensor among the first
    :data:`GRAPH_NODES` nodes of its backward graph (an FP16 activation or parameter: ``model.half()``,
    FP16 autocast whose block closed before ``scale()``, FSDP2's ``param_dtype=torch.float16``). A run
    whose graph it cannot see into (a ``torch.compile`` region, whose FP16 stays inside it, or a torch
    without node metadata) is never told: no false alarm. The first FP16 sign ends the watch, so an FP16
    run pays for it once; any other run, for its first iterations only.
    """

    __slots__ = ("iterations", "seen", "blind", "idle", "watching")

    def __init__(self) -> None:
        self.iterations = 0  # the scaled iterations looked at
        self.seen = False  # FP16 work seen
        self.blind = False  # some graph could not be seen into: no verdict
        self.idle = False  # NO_FP16_STEPS iterations without FP16, all seen into: warned
        self.watching = True  # still looking: neither FP16 seen nor NO_FP16_STEPS iterations (an attribute,
        # not a property: scale() reads it on every call, and an FP16 run should pay one read for it)

    def look(self, outputs: Any, first_of_iteration: bool) -> None:
        """Look at what ``scale()`` got (``first_of_iteration``: its first call since the last update);
        warn once when the iterations looked at reach the limit without FP16."""
        if torch.compiler.is_compiling():
            return
        tensor = next((x for x in tree_leaves(outputs) if isinstance(x, torch.Tensor)), None)
        fp16 = None if tensor is None else _fp16_work(tensor)  # (a lazy iterable: nothing to see)
        self.seen = bool(fp16)
        self.blind = self.blind or fp16 is None
        if self.seen:
            self.watching = False
            return
        if not first_of_iteration:
            return
        self.iterations += 1
        self.watching = self.iterations < NO_FP16_STEPS
        if self.iterations == NO_FP16_STEPS and not self.blind:
            self.idle = True
            warn(f"lossscale.GradScaler: {NO_FP16}. {NO_FP16_FIX} (Warned once.)")


def _fp16_work(tensor: torch.Tensor) -> Optional[bool]:
    """True if ``tensor`` shows FP16 work (see :class:`Fp16Watch`), False if it shows none, None if its
    graph cannot be seen into. Metadata only: no sync."""
    if tensor.dtype == torch.float16:
        return True
    device_type = tensor.device.type
    try:
        if torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.float16:
            return True
    except (TypeError, AttributeError):  # torch < 2.4 has no per-device query: the graph alone tells
        pass
    if tensor.grad_fn is None:
        return False
    queue, seen, opaque = deque([tensor.grad_fn]), {tensor.grad_fn}, False
    for _ in range(GRAPH_NODES):
        if not queue:
            break
        node = queue.popleft()
        metadata = getattr(node, "_input_metadata", None)  # the dtypes of the tensors the node's forward made
        if metadata is None:
            return None
        if any(m.dtype == torch.float16 for m in metadata):
            return True
        opaque = opaque or node.name().startswith("CompiledFunction")  # compiled: its insides are not nodes
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return None if opaque else False
