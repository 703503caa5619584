"""Gradient telemetry inside the scaler, a flat metrics dict for any logger, and a JSONL logger.

The scaler hands each optimizer's *scaled* gradients (before unscaling) to :class:`Telemetry` on
sampled steps. Statistics stay on device until read, so collecting them adds no host sync; reading
``scaler.metrics()`` syncs, once, at the caller's logging cadence.

What the figures measure depends on the gradients' dtype, and every record says which:

* FP32 parameter gradients (autocast with FP32 master weights): ``flushed``/``subnormal``/
  ``overflow`` are what FP16 *would* do to these scaled gradients (``grad/measured`` =
  "fp32 as fp16", in :meth:`GradScaler.metric_labels`). The flushing that really happens under autocast
  is in the FP16 activation gradients: see :mod:`lossscale.hooks`.
* FP16 parameter gradients: they are measured as stored (``grad/measured`` = "fp16 as stored"), so a
  value that flushed is already 0 and counted among ``zeros``.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import formats
from ._features import Feature, saved_count
from ._warnings import warn
from .stats import GradStats, fetch_figures, grad_stats

__all__ = ["Telemetry", "JsonlLogger", "flatten_stats"]

_PER = (None, "param", "module")
#: The gradient dtypes the statistics measure (``stats.grad_stats``); others are left out, with a warning.
_MEASURABLE = (torch.float32, torch.float16, torch.bfloat16)


def flatten_stats(prefix: str, stats: GradStats) -> Dict[str, float]:
    """``{prefix/field: value}`` for the figures of ``stats`` worth a chart. Syncs."""
    d = stats.to_dict()
    keep = (
        "flushed_frac",
        "subnormal_frac",
        "zeros_frac",
        "overflow_frac",
        "headroom_bits",
        "amax",
        "numel",
        "zeros",
        "flushed",
        "subnormal",
        "overflow",
        "inf",
        "nan",
    )
    return {f"{prefix}/{k}": d[k] for k in keep if k in d}


class Telemetry(Feature):
    """Sampled statistics of the scaled gradients, kept on device until read.

    Args:
        every: collect on every ``every``-th iteration (iterations are counted by ``update()``).
        per: None (overall only), "param" (also per parameter) or "module" (also per module, grouping
            parameters by their name's prefix; needs names via ``GradScaler(model=...)``).
        fmt: the format to classify against ("fp16").
        reduce: how figures combine across the scaler's process group when they are read. "auto"
            (default): sum the histograms when the gradients are sharded DTensors (FSDP2), so every
            rank reads the whole gradient's figures; leave replicated gradients (DDP) alone, whose
            figures are the same on every rank. "sum": always sum (pipeline stages, tensor-parallel
            shards held as plain tensors; per-parameter figures then stay local, since each rank
            names other parameters). None: never. When it reduces, :meth:`metrics` is a collective:
            call it on every rank at the same iterations.
    """

    def __init__(self, every: int = 100, per: Optional[str] = None, fmt: str = "fp16", reduce: Optional[str] = "auto"):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"telemetry every={every!r} must be an int >= 1.")
        if per not in _PER:
            raise ValueError(f"telemetry per={per!r} must be one of {_PER}.")
        if reduce not in ("auto", "sum", None):
            raise ValueError(f"telemetry reduce={reduce!r} must be 'auto', 'sum' or None.")
        formats.get(fmt)  # ValueError naming fmt and the valid names, now rather than inside step()
        self.every, self.per, self.fmt, self.reduce = every, per, fmt, reduce
        self.sharded = False  # DTensor gradients seen (FSDP2): their local figures are partial
        self.iteration = 0
        self.step_collected: Optional[int] = None
        self.overall: Optional[GradStats] = None
        self.groups: Dict[str, GradStats] = {}
        self.measured: str = ""
        self.scale_used: Optional[torch.Tensor] = None
        self._warned_dtype = False  # gradients of a dtype the statistics do not measure: said once

    @classmethod
    def from_arg(cls, telemetry) -> Optional["Telemetry"]:
        """A ``GradScaler(telemetry=...)`` argument as a Telemetry: None/False (off), an int N (every N
        iterations), a dict of Telemetry arguments, or a Telemetry."""
        if telemetry is None or telemetry is False:
            return None
        if isinstance(telemetry, Telemetry):
            return telemetry
        if isinstance(telemetry, int) and not isinstance(telemetry, bool):
            return cls(every=telemetry)
        if isinstance(telemetry, dict):
            return cls(**telemetry)
        raise ValueError(
            f"telemetry={telemetry!r} must be None, an int (collect every N iterations), a dict of "
            "Telemetry arguments, or a lossscale.Telemetry."
        )

    def due(self) -> bool:
        """Whether this iteration is sampled."""
        return self.iteration % self.every == 0

    # The scaler's opt-in feature protocol (lossscale._features.Feature): the iteration count is
    # checkpointed, so a resumed run samples at the same iterations. No counters of its own: its
    # figures come from metrics().
    def entries(self) -> Dict[str, Any]:
        """The checkpoint's entry: the iteration count (the sampling phase)."""
        return {"telemetry_iteration": self.iteration}

    def loadable(self, state_dict: Dict[str, Any]) -> Optional[int]:
        """The checkpoint's iteration count, validated (None when absent)."""
        return saved_count(state_dict, "telemetry_iteration")

    def load(self, value: Optional[int]) -> None:
        """Take what :meth:`loadable` returned."""
        if value is not None:
            self.iteration = value

    def observe(
        self,
        params: List[torch.Tensor],
        grads: List[torch.Tensor],
        name_of: Callable,
        scale: torch.Tensor,
        *,
        all_params: Optional[List[torch.Tensor]] = None,
        sharded: bool = False,
    ) -> None:
        """Collect the statistics of one optimizer's scaled gradients (called by the scaler).

        ``grads[i]`` is the checked tensor of ``params[i]``; ``name_of``: ``param -> name or None``;
        ``scale``: the scale tensor these gradients carry. ``all_params`` (every parameter with a
        gradient, empty local shards included) and ``sharded`` (DTensor parameters) are the same on
        every rank: with sharded gradients a rank that holds only empty shards still records (empty)
        figures under the same names, so every rank passes the same structure to the reduction.
        """
        if not self.due():
            return
        self.sharded = self.sharded or sharded
        if sharded:  # a tensor-parallel Replicate copy is counted by one rank only, or sums count it twice
            from .distributed import replica_copies

            kept = [(p, g) for p, g, copy in zip(params, grads, replica_copies(params)) if not copy]
            params, grads = [p for p, _ in kept], [g for _, g in kept]
        measurable = [(p, g) for p, g in zip(params, grads) if g.dtype in _MEASURABLE]
        if len(measurable) < len(grads):
            if not self._warned_dtype:
                self._warned_dtype = True
                dtypes = sorted({str(g.dtype).replace("torch.", "") for g in grads if g.dtype not in _MEASURABLE})
                warn(
                    f"lossscale telemetry: {', '.join(dtypes)} gradients are left out of the statistics "
                    "(they measure float32, float16 and bfloat16 gradients against fp16's range; a "
                    "float64 model needs no loss scaling). Training is not affected."
                )
            params, grads = [p for p, _ in measurable], [g for _, g in measurable]
        if self.step_collected != self.iteration:  # first optimizer of a sampled iteration
            self.step_collected, self.overall, self.groups = self.iteration, None, {}
            # The scale these gradients carry (update() may change it before the figures are read), kept
            # on a rank without gradients too: a reduction reads it beside that rank's empty figures.
            self.scale_used = scale.clone()
        if not grads and not self.sharded:
            return
        device = scale.device
        stats = grad_stats(grads, scale=1.0, fmt=self.fmt, device=device)
        self.overall = stats if self.overall is None else self.overall + stats
        if grads:
            own = formats.dtype_name(self.fmt)
            dtypes = sorted({str(g.dtype).replace("torch.", "") for g in grads})
            self.measured = ", ".join(f"{d} as {self.fmt}" if d != own else f"{d} as stored" for d in dtypes)
        if self.per is None:
            return
        everyone = all_params if all_params is not None else params
        checked = {id(p): g for p, g in zip(params, grads)}
        # Names by position in the full list: the same on every rank, empty shards included.
        named = [(name_of(p) or f"param{i}", checked.get(id(p))) for i, p in enumerate(everyone)]
        buckets: Dict[str, List[torch.Tensor]] = {}
        for n, g in named:
            key = n.rsplit(".", 1)[0] if self.per == "module" and "." in n else n
            bucket = buckets.setdefault(key, [])
            if g is not None:
                bucket.append(g)
        for n, gs in buckets.items():
            self.groups[n] = grad_stats(gs, scale=1.0, fmt=self.fmt, device=device)

    def wants_reduction(self) -> bool:
        """Whether :meth:`metrics` should sum the figures over the scaler's group (see ``reduce``)."""
        return self.reduce == "sum" or (self.reduce == "auto" and self.sharded)

    def labels(self) -> Dict[str, str]:
        """What the figures measure, as text (``{"grad/measured": "float32 as fp16"}``); empty before
        the first sampled iteration. Kept out of :meth:`metrics`, whose values are all numbers."""
        return {"grad/measured": self.measured} if self.overall is not None else {}

    def metrics(self, group=None, device: Optional[torch.device] = None) -> Dict[str, float]:
        """Flat figures of the last sampled iteration (empty before the first). Syncs once.

        ``group``: the process group to sum the figures over (the scaler passes its own when
        :meth:`wants_reduction`); a collective then: every rank of it calls this at the same
        iterations. ``device``: where a rank without gradients makes its empty statistics.
        """
        return self.metrics_with(group, device)[0]

    def metrics_with(
        self, group=None, device: Optional[torch.device] = None, also: Sequence[torch.Tensor] = ()
    ) -> Tuple[Dict[str, float], List[List[float]]]:
        """:meth:`metrics`, and the values of the tensors ``also`` read in the same transfer (one sync)."""
        overall, groups = self.overall, self.groups
        if group is not None:
            from .distributed import reduce_stats

            if overall is None:  # a rank without gradients still joins, with empty statistics
                overall = grad_stats([], scale=1.0, fmt=self.fmt, device=device or "cpu")
            overall = reduce_stats(overall, group)
            if self.sharded:  # FSDP2: every rank holds a shard of the same parameters
                groups = reduce_stats(groups, group)
            # the sampled step and its scale are the same on every rank (the scaler keeps them so)
        if overall is None:
            return {}, [t.reshape(-1).tolist() for t in also]
        # One transfer for every figure read below (the overall ones, each group's, the scale, ``also``).
        scale, *riding = fetch_figures([overall, *groups.values()], [self.scale_used, *also])
        out = flatten_stats("grad", overall)
        out["grad/step"] = self.step_collected
        out["grad/loss_scale"] = float(scale[0])
        for name, s in groups.items():
            out.update(flatten_stats(f"grad/{name}", s))
        return out, riding


class JsonlLogger:
    """Append one JSON object per line: ``{"step": ..., **metrics}``, for ``lossscale report RUN.jsonl``.

    Non-finite floats are written as null-safe strings ("inf", "-inf", "nan") so every line is valid
    JSON. Opens the file lazily and flushes every record, so a crashed run keeps what it logged.

    Usage::

        log = lossscale.JsonlLogger("run.jsonl")
        ...
        scaler.update()
        if step % 50 == 0:
            log.log(step, scaler.metrics(), loss=loss.item())
        log.close()
    """

    def __init__(self, path: str, mode: str = "w"):
        if mode not in ("w", "a"):
            raise ValueError(f"mode={mode!r} must be 'w' (new file) or 'a' (append).")
        self.path, self._mode, self._file = os.fspath(path), mode, None

    def log(self, step: int, metrics: Dict[str, object], **extra) -> None:
        """Write one record."""
        if self._file is None:
            self._file = open(self.path, self._mode, encoding="utf-8")
        record = {"step": int(step)}
        for k, v in {**metrics, **extra}.items():
            if isinstance(v, torch.Tensor):
                v = v.item()  # the caller logs at its own cadence: this sync is theirs
            if isinstance(v, float) and not math.isfinite(v):
                v = str(v)
            record[k] = v
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "JsonlLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
