"""Tiny models, a twin-run harness and the small helpers the tests share (kept tiny: CPU fp16 is slow)."""

from __future__ import annotations

import copy
import warnings

import torch

#: The dynamic rule as torch runs it: no hysteresis, no bounds.
TORCH_RULE = dict(hysteresis=1, min_scale=None, max_scale=None)
#: A scaler configured like torch's GradScaler: torch's rule, and no look at the loss before scaling
#: (a check torch does not make). Bitwise the same trajectory as torch.
TORCH_LIKE = {**TORCH_RULE, "loss_check": False}


def quiet(make):
    """``make()`` with the warnings that fire by design (non-power-of-two config, replaced policy)
    silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make()


def tiny_mlp(seed: int = 0, d_in: int = 8, hidden: int = 16, d_out: int = 4) -> torch.nn.Module:
    """A two-layer MLP with FP32 parameters (FP32 master weights under autocast)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, d_out))


def five_layer_mlp(inplace_relu: bool = False) -> torch.nn.Sequential:
    """Linear, ReLU, Linear, Tanh, Linear (6 -> 8 -> 8 -> 3), seed 0: the tracing tests' model."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8),
        torch.nn.ReLU(inplace=inplace_relu),
        torch.nn.Linear(8, 8),
        torch.nn.Tanh(),
        torch.nn.Linear(8, 3),
    )


def batch(step: int, n: int = 8, d_in: int = 8, d_out: int = 4):
    """A deterministic batch for ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, d_in, generator=g), torch.randint(0, d_out, (n,), generator=g)


def make_optimizer(kind: str, params):
    """SGD with momentum, Adam (foreach) or fused Adam."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-3, foreach=True)
    if kind == "fused_adam":
        return torch.optim.Adam(params, lr=1e-3, fused=True)
    raise ValueError(kind)


def backward(model, scaler, step: int, loss_mult: float = 1.0):
    """Forward under fp16 autocast and a scaled backward."""
    x, y = batch(step)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y) * loss_mult
    scaler.scale(loss).backward()
    return loss


def inject(model, step: int, rate: float, seed: int = 0) -> str:
    """Plant an inf or a NaN in one gradient with probability ``rate``; returns "", "inf" or "nan"."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    if torch.rand((), generator=g).item() >= rate:
        return ""
    params = [p for p in model.parameters() if p.grad is not None]
    p = params[int(torch.randint(0, len(params), (), generator=g))]
    kind = "nan" if torch.rand((), generator=g).item() < 0.5 else "inf"
    idx = int(torch.randint(0, p.grad.numel(), (), generator=g))
    p.grad.view(-1)[idx] = float("nan") if kind == "nan" else float("inf")
    return kind


def twins(seed: int = 0):
    """Two bitwise-identical models."""
    a = tiny_mlp(seed)
    return a, copy.deepcopy(a)


def states_equal(opt_a, opt_b) -> bool:
    """Optimizer states equal bitwise (every tensor with torch.equal)."""
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    if sa.keys() != sb.keys():
        return False
    for k in sa:
        for name in sa[k]:
            va, vb = sa[k][name], sb[k][name]
            if isinstance(va, torch.Tensor):
                if not torch.equal(va, vb):
                    return False
            elif va != vb:
                return False
    return True


def params_equal(a, b) -> bool:
    """Parameters equal bitwise."""
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def drive(scaler, bad_flags, kind: str = "nan"):
    """Iterations on one two-element parameter with SGD, planting ``kind`` in the gradient where a
    flag is true: the smallest loop that walks a scaler through clean and skipped steps."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    for bad in bad_flags:
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        if bad:
            p.grad[0] = float(kind)
        scaler.step(opt)
        scaler.update()
    return p


def two_optimizer_run(scaler, bad_steps, kind, unscale_first):
    """Six iterations of one loss over two parameters, each with its own SGD optimizer, planting ``kind``
    in the FIRST optimizer's gradient at ``bad_steps`` (``unscale_first``: ``unscale_`` it before the
    steps). Returns both parameters and the scale after each iteration."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.full((2,), 2.0))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.1, momentum=0.9), torch.optim.SGD([b], lr=0.1, momentum=0.9)
    scales = []
    for step in range(6):
        opt_a.zero_grad()
        opt_b.zero_grad()
        scaler.scale(a.sum() * 2 + b.sum() * 3).backward()
        if step in bad_steps:
            a.grad[1] = float(kind)  # the FIRST optimizer's gradient only
        if unscale_first:
            scaler.unscale_(opt_a)
        scaler.step(opt_a)
        scaler.step(opt_b)
        scaler.update()
        scales.append(scaler.get_scale())
    return a, b, scales
