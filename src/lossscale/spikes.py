"""Spike skipping: a finite step whose gradient norm or loss is far off its recent run is skipped too.

An overflow is skipped because its gradients are inf or NaN; a *spike* is finite and would be written
into the weights. Pretraining stacks skip them (OLMo-core's loss and gradient-norm z-scores, Levanter's
``SkipStepConfig``, Megatron-LM's ``grad_norm_skip_threshold``, llm.c's z-scores), each with its own
code and none skip-aware for schedulers and EMAs. ``GradScaler(skip_if=SkipIf(...))`` skips them through
the scaler's own skip flag, so fused optimizers skip on device, and ``step_scheduler``, ``skip_aware``
averages and ``on_step`` see a skipped step. The rule, for each statistic ``x`` (the true gradient norm
of an optimizer's gradients; the loss before scaling)::

    window = the last `window` values of x over steps that were taken (a skipped step adds nothing)
    spike  = x > grad_norm_above                                         # the absolute bound (norm only)
          or (len(window) >= min_steps and x > mean(window) + z * std(window))   # population std, float64
    a step with an inf/NaN gradient is an overflow, never a spike

A spike skips the optimizer step; for the loss scale it is a clean step (the gradients fit FP16), so the
scale never backs off on one. Spikes are counted apart (``counters()["spike_steps"]``, ``metrics()``,
``health()``). It works in ``GradScaler.passthrough()`` too: bf16 runs get it with the same account.

Costs. The rule runs on the device: about twenty small kernels per statistic per step, no sync on the
fused path (on the synced path the decision rides in the check's one read). The gradient norm comes from
``scaler.clip_grad_norm_`` when the loop clips through it (free: the clip computes it); otherwise it
takes one more read pass over the gradients (``_foreach_norm``), only when a norm rule is set. With
several optimizers each has its own windows; across ranks the decision is all-reduced (MAX, one more
collective), so every rank skips together (with sharded gradients each rank's rule sees its shard's
norm unless the loop clips with ``scaler.clip_grad_norm_``, whose norm is the total).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from ._features import Feature

__all__ = ["SkipIf", "SpikeSkipper", "SpikeWindows"]


@dataclass(frozen=True)
class SkipIf:
    """When a finite step counts as a spike (see :mod:`lossscale.spikes`); a field left None is off.

    Args:
        grad_norm_above: skip when the true (unscaled) gradient norm is above this.
        grad_norm_zscore: skip when the norm is more than this many standard deviations above the
            mean of the window.
        loss_zscore: the same for the loss before scaling (the sum of the iteration's losses).
        window: how many recent taken steps the statistics cover.
        min_steps: the z-scores apply once the window holds this many values.
    """

    grad_norm_above: Optional[float] = None
    grad_norm_zscore: Optional[float] = None
    loss_zscore: Optional[float] = None
    window: int = 128
    min_steps: int = 16

    def __post_init__(self):
        for name in ("grad_norm_above", "grad_norm_zscore", "loss_zscore"):
            v = getattr(self, name)
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
            ):
                raise ValueError(f"skip_if: {name}={v!r} must be a finite number > 0, or None (off).")
        for name, lo in (("window", 2), ("min_steps", 2)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"skip_if: {name}={v!r} must be an int >= {lo}.")
        if self.min_steps > self.window:
            raise ValueError(
                f"skip_if: min_steps={self.min_steps} is above window={self.window}: the z-scores would never apply."
            )
        if self.grad_norm_above is None and self.grad_norm_zscore is None and self.loss_zscore is None:
            raise ValueError("skip_if has no rule: set grad_norm_above, grad_norm_zscore or loss_zscore.")

    @classmethod
    def of(cls, value) -> Optional["SkipIf"]:
        """``GradScaler(skip_if=...)``'s argument: None, a SkipIf, or a dict of its fields."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls(**value)
        raise ValueError(
            f"skip_if={value!r} must be None, a lossscale.SkipIf or a dict of its fields "
            "(grad_norm_above, grad_norm_zscore, loss_zscore, window, min_steps)."
        )

    @property
    def needs_norm(self) -> bool:
        """Whether a rule reads the gradient norm."""
        return self.grad_norm_above is not None or self.grad_norm_zscore is not None


def _window_spike(values: torch.Tensor, count: torch.Tensor, x: torch.Tensor, z: float, min_steps: int):
    """``x > mean + z * std`` over the filled part of the ring ``values`` (``count`` values pushed so far)."""
    size = values.numel()
    n = torch.clamp(count, max=size)
    filled = torch.arange(size, device=values.device) < n
    denom = torch.clamp(n, min=1).to(torch.float64)
    mean = torch.where(filled, values, 0.0).sum() / denom
    var = torch.where(filled, (values - mean) ** 2, 0.0).sum() / denom
    return (n >= min_steps) & (x.to(torch.float64) > mean + z * var.sqrt())


class SpikeWindows:
    """One optimizer's windows of recent gradient norms and losses, on the device, and its spike count."""

    def __init__(self, rule: SkipIf, device: torch.device, saved: Optional[Dict[str, Any]] = None):
        self.rule = rule
        saved = saved or {}
        zeros = torch.zeros(rule.window, dtype=torch.float64, device=device)
        self.norms, self.losses = zeros.clone(), zeros.clone()
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.spikes = torch.zeros((), dtype=torch.int64, device=device)
        if saved:
            self.load(saved)

    def check(self, norm: Optional[torch.Tensor], loss: Optional[torch.Tensor]) -> torch.Tensor:
        """Whether this step is a spike (a bool 0-dim tensor, no sync). ``norm`` and ``loss`` are None
        where the rule does not read them; a non-finite value is an overflow, not a spike."""
        r = self.rule
        spike = torch.zeros((), dtype=torch.bool, device=self.count.device)
        for x, values, z in ((norm, self.norms, r.grad_norm_zscore), (loss, self.losses, r.loss_zscore)):
            if x is None:
                continue
            if z is not None:
                spike = spike | _window_spike(values, self.count, x, z, r.min_steps)
            if values is self.norms and r.grad_norm_above is not None:
                spike = spike | (x > r.grad_norm_above)
            spike = spike & torch.isfinite(x)
        return spike

    def learn(
        self, norm: Optional[torch.Tensor], loss: Optional[torch.Tensor], spike: torch.Tensor, taken: torch.Tensor
    ) -> None:
        """After the step: a taken step's values join the windows; a spike is counted. No sync."""
        slot = (self.count % self.rule.window).reshape(1)
        for x, values in ((norm, self.norms), (loss, self.losses)):
            if x is not None:
                values.index_put_((slot,), torch.where(taken, x.to(torch.float64), values[slot]))
        self.count.add_(taken)
        self.spikes.add_(spike)

    def state(self) -> Dict[str, Any]:
        """The windows as plain numbers, for a checkpoint (one sync)."""
        return {
            "norms": self.norms.tolist(),
            "losses": self.losses.tolist(),
            "count": int(self.count.item()),
            "spikes": int(self.spikes.item()),
        }

    def load(self, saved: Dict[str, Any]) -> None:
        """Fill the windows from :meth:`state` (ValueError naming what does not fit)."""
        if not isinstance(saved, dict) or set(saved) != {"norms", "losses", "count", "spikes"}:
            raise ValueError(f"state dict 'skip_if' entries must hold norms, losses, count and spikes; got {saved!r}.")
        if len(saved["norms"]) != self.rule.window or len(saved["losses"]) != self.rule.window:
            raise ValueError(
                f"state dict 'skip_if' windows hold {len(saved['norms'])} values; this rule's window is "
                f"{self.rule.window}."
            )
        self.norms.copy_(torch.tensor(saved["norms"], dtype=torch.float64))
        self.losses.copy_(torch.tensor(saved["losses"], dtype=torch.float64))
        self.count.fill_(int(saved["count"]))
        self.spikes.fill_(int(saved["spikes"]))


class SpikeSkipper(Feature):
    """What ``GradScaler(skip_if=...)`` holds: the rule, each optimizer's :class:`SpikeWindows` (in the
    order they were first checked) and a loaded checkpoint's windows for the optimizers still to come."""

    def __init__(self, rule: SkipIf):
        self.rule = rule
        self.windows: Dict[int, SpikeWindows] = {}  # by id(optimizer)
        self.saved: List[Dict[str, Any]] = []
        self.pending: Dict[int, tuple] = {}  # this iteration's (windows, norm, loss) by id(optimizer)

    @classmethod
    def of(cls, skip_if) -> Optional["SpikeSkipper"]:
        """For ``GradScaler(skip_if=...)``: None (off), a SkipIf or a dict of its fields (ValueError otherwise)."""
        rule = SkipIf.of(skip_if)
        return None if rule is None else cls(rule)

    def judge(
        self,
        optimizer,
        device: torch.device,
        losses: List[torch.Tensor],
        grads: List[torch.Tensor],
        scale: Optional[torch.Tensor] = None,
        norm: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Whether this rank sees ``optimizer``'s step as a spike (a bool 0-dim tensor on ``device``, no
        sync); the check reduces it across ranks with its flags, so every rank skips together. ``norm``:
        the true gradient norm where the clip computed it; else one more read pass over ``grads``
        (scaled by ``scale``, when not None). What :meth:`learn` needs is kept until the update."""
        windows = self.windows.get(id(optimizer))
        if windows is None:
            windows = self.windows[id(optimizer)] = SpikeWindows(
                self.rule, device, self.saved.pop(0) if self.saved else None
            )
        if norm is None and self.rule.needs_norm:
            norm = true_norm(grads, scale, device)
        loss = sum(x.float().sum() for x in losses) if self.rule.loss_zscore and losses else None
        spike = windows.check(norm, loss)
        self.pending[id(optimizer)] = (windows, norm, loss)
        return spike

    def learn(self, decided: Dict[int, Any]) -> None:
        """In ``update()``: each judged optimizer's windows learn its step (``decided``: its flags, by
        ``id(optimizer)``): a taken step's values join them, a spike is counted: only on a step that was
        skipped as a spike alone, finite (an overflow or a bad loss on the same step skips it anyway, and
        is counted as such). No sync."""
        for key, (windows, norm, loss) in self.pending.items():
            flags = decided.get(key)
            if flags is not None and flags.spike is not None:
                finite_spike = flags.spike & ~(flags.overflow | flags.bad_loss)
                windows.learn(norm, loss, finite_spike, taken=~flags.skip)
        self.pending = {}

    def new_iteration(self) -> None:
        """Forget what the iteration judged (``update()`` learned it, or the iteration was discarded)."""
        self.pending = {}

    def counts(self) -> Dict[str, int]:
        """The steps skipped as spikes so far, for ``counters()``, ``metrics()``, ``health()`` (a sync per
        optimizer)."""
        return {
            "spike_steps": sum(int(w.spikes.item()) for w in self.windows.values())
            + sum(w["spikes"] for w in self.saved)
        }

    def entries(self) -> Dict[str, Any]:
        """The checkpoint's entry: every optimizer's windows as plain numbers, in the order first checked."""
        return {"skip_if": [w.state() for w in self.windows.values()] + self.saved}

    def loadable(self, state_dict: Dict[str, Any]) -> Optional[List[Dict[str, Any]]]:
        """A checkpoint's windows (None when absent), each validated (ValueError naming what does not fit)."""
        saved = state_dict.get("skip_if")
        if saved is None:
            return None
        if not isinstance(saved, list):
            raise ValueError(f"state dict 'skip_if' must be a list of windows (one per optimizer); got {saved!r}.")
        for entry in saved:
            SpikeWindows(self.rule, torch.device("cpu"), entry)
        return saved

    def load(self, saved: Optional[List[Dict[str, Any]]]) -> None:
        """Take what :meth:`loadable` returned: the optimizers pick the windows up as they are first checked."""
        if saved is not None:
            self.saved, self.windows = list(saved), {}

    def __getstate__(self):  # a copy meets other optimizers (ids): it takes the windows as saved ones
        return {"rule": self.rule, "windows": {}, "saved": self.entries()["skip_if"], "pending": {}}


def true_norm(grads: List[torch.Tensor], scale: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The 2-norm of ``grads`` (divided by ``scale`` when they are scaled), on ``device``: one read pass."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norm = torch.linalg.vector_norm(torch.stack([n.to(device) for n in torch._foreach_norm(grads, 2.0)]))
    return norm if scale is None else norm / scale
