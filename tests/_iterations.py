"""One training iteration of a GradScaler, counted as a GPU sees it: kernel launches, host syncs, copies.

    with fake_cuda():                                        # tests/_fake_cuda.py (or a real GPU)
        work = count_iteration("lossscale", "fused_adam")    # default settings
        ref = count_iteration("torch", "fused_adam")         # torch.amp.GradScaler("cuda")
        assert work.launches <= ref.launches + 5             # a budget (issue 22)

What is counted: the scaler's share of a clean iteration after ``warmup`` iterations (state
allocated, optimizer state built, constants made): ``scaler.scale(loss)``, then (backward not
counted) the clip if any (lossscale's ``clip_grad_norm_``; torch's ``unscale_`` +
``torch.nn.utils.clip_grad_norm_``), ``step``, ``update``, the skip-aware scheduler's ``step`` and
``telemetry.metrics()`` when asked for. The optimizer's own step is included (its kernels are
the same on both sides). The model is ``tests/_models.tiny_mlp`` (4 parameters: every foreach or
fused kernel is one launch), the forward runs under ``torch.autocast(device, torch.float16)``.

``benchmarks/gpu_check.py`` runs the same iterations on a real GPU.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, List, Optional

import torch

import lossscale
from lossscale._sync import DeviceWork, count_device_work
from lossscale.schedulers import skip_aware
from _models import batch, tiny_mlp

__all__ = ["OPTIMIZERS", "Iteration", "count_iteration", "make_iteration"]

#: Optimizer kinds: torch's three implementations (for-loop, foreach, fused).
OPTIMIZERS: Dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, foreach=True),
    "sgd_loop": lambda p: torch.optim.SGD(p, lr=0.05, foreach=False),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=True),
    "fused_sgd": lambda p: torch.optim.SGD(p, lr=0.05, fused=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True),
    "fused_adam": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True),
}


@dataclass
class Iteration:
    """A model, optimizer and scaler ready to run iterations (see :func:`make_iteration`)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    device: torch.device
    clip: Optional[float] = None
    metrics: bool = False
    scheduler: Any = None
    step_no: int = 0

    def forward(self, bad: Optional[str] = None) -> torch.Tensor:
        """Zero the gradients and compute this iteration's loss (fp16 autocast); ``bad``="nan" or "inf"
        puts that value in the first input row (a bad batch)."""
        self.optimizer.zero_grad(set_to_none=True)
        x, y = batch(self.step_no)
        if bad is not None:
            x[0] = float(bad)
        x, y = x.to(self.device), y.to(self.device)
        with torch.autocast(self.device.type, dtype=torch.float16):
            return torch.nn.functional.cross_entropy(self.model(x), y)

    def scaler_part(self) -> None:
        """What follows the backward: clip, step, update, the scheduler's step, the metrics."""
        if self.clip is not None:
            if isinstance(self.scaler, torch.amp.GradScaler):
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            else:
                self.scaler.clip_grad_norm_(self.optimizer, self.clip)
        self.scaler.step(self.optimizer)
        if self.scheduler is not None:
            self.scheduler.step()
        self.scaler.update()
        if self.metrics and self.scaler.telemetry is not None:
            self.scaler.telemetry.metrics()

    def run(self, bad: Optional[str] = None) -> None:
        """One whole iteration, uncounted."""
        loss = self.forward(bad)
        self.scaler.scale(loss).backward()
        self.scaler_part()
        self.step_no += 1

    def counted(self, bad: Optional[str] = None, watch: Callable[[], ContextManager] = nullcontext) -> DeviceWork:
        """One iteration whose scaler share (``scale``, then clip/step/update/...) is counted; ``watch()``
        is entered around each counted block too (``benchmarks/gpu_check.py``: torch's sync detector)."""
        loss = self.forward(bad)
        with count_device_work() as scale, watch():
            scaled = self.scaler.scale(loss)
        scaled.backward()
        with count_device_work() as rest, watch():
            self.scaler_part()
        self.step_no += 1
        return merged(scale, rest)


def merged(*works: DeviceWork) -> DeviceWork:
    """The counts of several counted blocks, as one."""
    return DeviceWork(_calls=[c for w in works for c in w._calls], on_device=any(w.on_device for w in works))


def make_iteration(scaler: str = "lossscale", optimizer: str = "fused_adam", *, device: str = "cuda",
                   clip: Optional[float] = None, metrics: bool = False, scheduler: bool = False, seed: int = 0,
                   **scaler_kwargs: Any) -> Iteration:
    """An :class:`Iteration`: ``scaler`` is "lossscale" (``lossscale.GradScaler(device,
    **scaler_kwargs)``, default settings unless given; ``trace=True`` gets ``model=``) or "torch"
    (``torch.amp.GradScaler(device)``); ``optimizer`` a key of :data:`OPTIMIZERS`; ``scheduler``
    adds a skip-aware ``StepLR`` (a plain one for torch)."""
    dev = torch.device(device)
    model = tiny_mlp(seed).to(dev)
    opt = OPTIMIZERS[optimizer](model.parameters())
    if scaler == "torch":
        if scaler_kwargs:
            raise ValueError(f"torch's GradScaler is run at its defaults; got {sorted(scaler_kwargs)}")
        sc = torch.amp.GradScaler(dev.type)
    elif scaler == "lossscale":
        if scaler_kwargs.get("trace"):
            scaler_kwargs.setdefault("model", model)
        sc = lossscale.GradScaler(dev.type, **scaler_kwargs)
    else:
        raise ValueError(f"scaler={scaler!r} must be 'lossscale' or 'torch'")
    sched = None
    if scheduler:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000)
        if scaler == "lossscale":
            sched = skip_aware(sched, sc)
    return Iteration(model, opt, sc, dev, clip=clip, metrics=metrics, scheduler=sched)


def count_iteration(scaler: str = "lossscale", optimizer: str = "fused_adam", *, warmup: int = 2,
                    **kwargs: Any) -> DeviceWork:
    """Launches, syncs and copies of one clean iteration's scaler share after ``warmup`` iterations
    (:func:`make_iteration` takes the other arguments). Run it on a GPU or inside ``fake_cuda()``."""
    it = make_iteration(scaler, optimizer, **kwargs)
    for _ in range(warmup):
        it.run()
    return it.counted()


def table(rows: Dict[str, DeviceWork]) -> List[str]:
    """Markdown lines: one row per counted iteration (launches, syncs, h2d, d2h)."""
    out = ["| iteration | launches | syncs | h2d | d2h |", "|---|---:|---:|---:|---:|"]
    out += [f"| {k} | {w.launches} | {w.syncs} | {w.h2d} | {w.d2h} |" for k, w in rows.items()]
    return out
