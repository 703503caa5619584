"""The skip matrix's parts: torch's own optimizers in every implementation, the faults, one scenario.

Shared by ``tests/test_skip_matrix.py`` (the CI matrix) and its slow soak. Nothing here is a stand-in:
the optimizers are ``torch.optim``'s, found by looking at what the installed torch offers, and each is
built in every implementation its constructor takes (for-loop, ``foreach``, ``fused``).

A scenario: one clean step (so the optimizer has state), one faulty iteration that must be skipped,
then one clean step that must train. After the skipped step the parameters and every tensor of the
optimizer's state are compared with ``torch.equal`` against a copy taken before it.
"""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

import lossscale

#: torch.optim optimizers the matrix does not run, and why. Everything else torch.optim exports is run.
NOT_RUN = {
    # LBFGS re-evaluates the loss through a closure, and GradScaler refuses closures, as torch's does
    # ("Closure use is not supported if GradScaler is enabled"): tested on its own below.
    "LBFGS": "needs a closure, which GradScaler refuses (as torch's does)",
}

#: Constructor arguments an optimizer needs to train the matrix's tiny model in a few steps.
KWARGS: Dict[str, dict] = {"SGD": {"lr": 0.1, "momentum": 0.9}, "ASGD": {"lr": 0.1}, "Muon": {"lr": 0.02}}

FAULTS = ("nan_input_row", "inf_loss_term", "nan_loss_in_accumulation", "inf_grad", "nan_grad", "forward_inf_traced")
CLIPS = ("none", "scaler", "torch")  # scaler.clip_grad_norm_, or unscale_ + torch.nn.utils.clip_grad_norm_
POLICIES = ("dynamic", "static", "adaptive", "logmax", "passthrough")
ACCUMULATION = 4  # micro-batches in the accumulation fault


@dataclass(frozen=True)
class OptimizerKind:
    """One torch.optim optimizer in one implementation ("for-loop", "foreach" or "fused")."""

    name: str
    impl: str

    @property
    def id(self) -> str:
        """A test id such as ``Adam-fused``."""
        return f"{self.name}-{self.impl}"

    @property
    def model_kind(self) -> str:
        """Which model it trains: sparse gradients (SparseAdam), 2-D weights only (Muon), else dense."""
        return {"SparseAdam": "sparse", "Muon": "matrices"}.get(self.name, "dense")

    def build(self, params) -> torch.optim.Optimizer:
        """The optimizer over ``params``, in this implementation."""
        cls = getattr(torch.optim, self.name)
        kwargs = dict(KWARGS.get(self.name, {}))
        if self.impl == "foreach":
            kwargs["foreach"] = True
        elif self.impl == "fused":
            kwargs["fused"] = True
        elif "foreach" in inspect.signature(cls.__init__).parameters:
            kwargs["foreach"] = False
        return cls(params, **kwargs)


def _fused_runs_on_cpu(cls) -> bool:
    try:
        cls([torch.nn.Parameter(torch.zeros(2))], fused=True)
        return True
    except (RuntimeError, ValueError):  # "fused=True requires all the params to be ... supported devices"
        return False


def optimizer_kinds() -> List[OptimizerKind]:
    """Every optimizer in the installed ``torch.optim``, in each implementation it offers on CPU."""
    kinds = []
    for name in sorted(dir(torch.optim)):
        cls = getattr(torch.optim, name)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
            continue
        if name in NOT_RUN:
            continue
        params = inspect.signature(cls.__init__).parameters
        kinds.append(OptimizerKind(name, "for-loop"))
        if "foreach" in params:
            kinds.append(OptimizerKind(name, "foreach"))
        if "fused" in params and _fused_runs_on_cpu(cls):
            kinds.append(OptimizerKind(name, "fused"))
    return kinds


# ------------------------------------------------------------------------------------------- model
class Amplify(torch.nn.Module):
    """A parameter-free leaf module (x * 2, exact), traced like any other: the forward fault makes its
    output inf, and the model masks that out before any parameter sees it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x * 2.0


class Net(torch.nn.Module):
    """The matrix's model: dense (two Linear layers), 2-D weights only (Muon), or a sparse embedding.

    ``forward(x, idx)``: the inputs pass through :class:`Amplify`, infinities are masked to 0 (so a
    forward inf leaves the loss and the gradients finite; a NaN input passes), then the layers.
    """

    def __init__(self, kind: str, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.kind = kind
        self.amplify = Amplify()
        if kind == "sparse":
            self.emb = torch.nn.Embedding(16, 4, sparse=True)
            self.register_buffer("head", torch.randn(4, 3))
        else:
            bias = kind == "dense"
            self.l1 = torch.nn.Linear(4, 8, bias=bias)
            self.l2 = torch.nn.Linear(8, 3, bias=bias)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:  # noqa: D102
        h = self.amplify(x)
        h = torch.where(torch.isinf(h), torch.zeros_like(h), h)  # NaN passes
        if self.kind == "sparse":
            return (self.emb(idx) * h) @ self.head
        return self.l2(torch.tanh(self.l1(h)))


def batch(step: int, n: int = 6) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A deterministic ``(x, idx, y)`` for ``step``."""
    g = torch.Generator().manual_seed(7919 * step + 1)
    return torch.randn(n, 4, generator=g), torch.randint(0, 16, (n,), generator=g), torch.randn(n, 3, generator=g)


# ------------------------------------------------------------------------------------------ faults
def _poison_grad(model: torch.nn.Module, value: float) -> None:
    """Write ``value`` into one element of the first gradient (the values of a sparse one)."""
    param = next(p for p in model.parameters() if p.grad is not None)
    grad = param.grad
    if grad.is_sparse:
        grad = grad.coalesce()
        grad._values().view(-1)[0] = value
        param.grad = grad
    else:
        grad.view(-1)[0] = value


def backward(model, scaler: lossscale.GradScaler, step: int, fault: Optional[str] = None) -> None:
    """The iteration's forward(s) and scaled backward(s), with ``fault`` planted (None: clean)."""
    micro = ACCUMULATION if fault == "nan_loss_in_accumulation" else 1
    for m in range(micro):
        x, idx, y = batch(step * ACCUMULATION + m)
        if fault == "nan_input_row" or (fault == "nan_loss_in_accumulation" and m == 2):
            x[0] = math.nan
        if fault == "forward_inf_traced":
            x[0, 0] = 3e38  # Amplify doubles it past float32's max: inf, masked before the layers
        loss = torch.nn.functional.mse_loss(model(x, idx), y) / micro
        if fault == "inf_loss_term":
            loss = loss + math.inf  # a constant term: the loss is inf, every gradient stays finite
        scaler.scale(loss).backward()
    if fault == "inf_grad":
        _poison_grad(model, math.inf)
    elif fault == "nan_grad":
        _poison_grad(model, math.nan)


def make_scaler(policy: str, model, trace: bool) -> lossscale.GradScaler:
    """A scaler with ``policy`` at its defaults (passthrough: ``GradScaler.passthrough``)."""
    if policy == "passthrough":
        return (
            lossscale.GradScaler.passthrough(model=model)
            if not trace
            else lossscale.GradScaler(policy=lossscale.StaticPolicy(scale=1.0), model=model, trace=True)
        )
    return lossscale.GradScaler(policy=policy, model=model, trace=trace)


def iteration(model, optimizer, scaler, step: int, clip: str, fault: Optional[str] = None) -> None:
    """One training iteration with torch's calls: backward, optional clip, step, update."""
    optimizer.zero_grad(set_to_none=True)
    backward(model, scaler, step, fault)
    if clip == "scaler":
        scaler.clip_grad_norm_(optimizer, 1.0)
    elif clip == "torch":
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
    scaler.step(optimizer)
    scaler.update()


# ----------------------------------------------------------------------------------------- checks
def snapshot(model, optimizer) -> Dict[str, torch.Tensor]:
    """Every parameter and every tensor of the optimizer's state, cloned, by a readable key."""
    out = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"state {names[id(param)]}.{key}"] = value.detach().clone()
            else:
                out[f"state {names[id(param)]}.{key}"] = torch.tensor(copy.deepcopy(value))
    return out


def differences(before: Dict[str, torch.Tensor], after: Dict[str, torch.Tensor]) -> List[str]:
    """Keys whose tensors are not bitwise equal (``torch.equal``), or that appeared / disappeared."""
    keys = sorted(set(before) | set(after))
    return [k for k in keys if k not in before or k not in after or not torch.equal(before[k], after[k])]


def non_finite(snap: Dict[str, torch.Tensor]) -> List[str]:
    """Keys of floating-point tensors holding an inf or a NaN."""
    return [k for k, v in snap.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]


def applies(kind: OptimizerKind, clip: str) -> bool:
    """Whether a cell can run at all: ``torch.nn.utils.clip_grad_norm_`` refuses sparse gradients
    (torch's own limit: no sparse ``linalg_vector_norm``); ``scaler.clip_grad_norm_`` takes them."""
    return not (kind.model_kind == "sparse" and clip == "torch")


def run_scenario(kind: OptimizerKind, policy: str, clip: str, fault: str) -> List[str]:
    """One cell of the matrix; returns its failures (empty when the skip was a skip)."""
    model = Net(kind.model_kind)
    optimizer = kind.build(model.parameters())
    scaler = make_scaler(policy, model, trace=fault == "forward_inf_traced")
    try:
        return _run(model, optimizer, scaler, clip, fault)
    finally:
        scaler.close()


def _run(model, optimizer, scaler, clip: str, fault: str) -> List[str]:
    failures = []
    iteration(model, optimizer, scaler, 0, clip)  # a clean step: the optimizer now has state
    if scaler.last_step_skipped:
        return ["the warm-up step was skipped"]
    before = snapshot(model, optimizer)
    iteration(model, optimizer, scaler, 1, clip, fault)
    after = snapshot(model, optimizer)
    if not scaler.last_step_skipped:
        failures.append("last_step_skipped is False after the faulty iteration")
    changed = differences(before, after)
    if changed:
        failures.append(f"the skipped step changed {', '.join(changed)}")
    iteration(model, optimizer, scaler, 2, clip)
    trained = snapshot(model, optimizer)
    if scaler.last_step_skipped:
        failures.append("the clean step after the fault was skipped")
    if not any(k.startswith("param") for k in differences(after, trained)):
        failures.append("the clean step after the fault changed no parameter")
    bad = non_finite(trained)
    if bad:
        failures.append(f"non-finite after the clean step: {', '.join(bad)}")
    return failures


# ----------------------------------------------------------------------------------- across ranks
def skip_across_ranks(rank: int, world: int, kinds, faults) -> Dict[str, List[str]]:
    """On every rank (gloo, spawned by ``_dist_workers.WorkerPool``): for each optimizer kind and fault,
    a clean step, then the fault on the last rank only, then a clean step. The flags are reduced
    across ranks (MAX), so every rank must skip bitwise and every rank must train afterwards.
    Returns ``{cell: failures}`` for this rank."""
    out = {}
    for name, impl in kinds:
        kind = OptimizerKind(name, impl)
        for fault in faults:
            model = Net(kind.model_kind)  # the same seed on every rank: the same weights
            optimizer = kind.build(model.parameters())
            scaler = make_scaler("dynamic", model, trace=fault == "forward_inf_traced")
            failures = []
            iteration(model, optimizer, scaler, 0, "scaler")
            before = snapshot(model, optimizer)
            iteration(model, optimizer, scaler, 1, "scaler", fault if rank == world - 1 else None)
            if not scaler.last_step_skipped:
                failures.append("not skipped")
            changed = differences(before, snapshot(model, optimizer))
            if changed:
                failures.append(f"the skipped step changed {', '.join(changed)}")
            iteration(model, optimizer, scaler, 2, "scaler")
            bad = non_finite(snapshot(model, optimizer))
            if scaler.last_step_skipped or bad:
                failures.append(f"the next clean step: skipped={scaler.last_step_skipped}, non-finite={bad}")
            scaler.close()
            out[f"{kind.id} {fault}"] = failures
    return out


SCENARIOS = {"skip_across_ranks": skip_across_ranks}
