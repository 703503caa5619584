"""Shared pieces of the framework integration tests: tiny models, inf injection, probes, read-backs.

Nothing is downloaded: models are built from configs in code, and the HF libraries run offline.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from _models import TORCH_LIKE  # noqa: E402,F401  (lossscale configured as torch's GradScaler; re-exported)

INIT_SCALE = 2.0**10  # small enough that no step overflows by itself: only the injected inf does


@pytest.fixture
def fresh_accelerate_state():
    """accelerate (under the Trainer too) keeps process-wide singletons (mixed precision, gradient
    state): start and leave each test with them empty. Test modules import this name to use it."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def mlp(seed: int = 0) -> torch.nn.Module:
    """Linear(8, 16) - ReLU - Linear(16, 4), FP32 parameters."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def batch(step: int, n: int = 8):
    """A deterministic (x, y) batch for ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def dataset(steps: int, n: int = 8) -> torch.utils.data.TensorDataset:
    """``steps`` batches of :func:`batch` in order, for frameworks that want a DataLoader."""
    xs, ys = zip(*(batch(s, n) for s in range(steps)))
    return torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))


def warmup_decay(step: int) -> float:
    """An LR multiplier that changes every step (warmup 4 steps, then 1/sqrt decay)."""
    return (step + 1) / 4 if step < 4 else (4 / (step + 1)) ** 0.5


class InfAt:
    """A gradient hook that puts an inf into one element of ``param``'s gradient at given backward calls.

    It runs inside backward, as an overflow would. Call ``n`` counts backwards (one per step without
    gradient accumulation); ``start`` offsets it for resumed runs.
    """

    def __init__(self, param: torch.Tensor, steps, start: int = 0):
        self.steps, self.calls = set(steps), start
        self.handle = param.register_hook(self)

    def __call__(self, grad):
        call, self.calls = self.calls, self.calls + 1
        if call in self.steps:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
            return grad
        return None


class DtypeProbe:
    """Records the output dtype of a module's forward (proof that autocast is on)."""

    def __init__(self, module: torch.nn.Module):
        self.dtypes = []
        module.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        self.dtypes.append(output.dtype)  # returns None: the output is not replaced


def snapshot(params) -> list:
    """Detached copies of parameters."""
    return [p.detach().clone() for p in params]


def all_equal(a, b) -> bool:
    """Bitwise equality of two lists of tensors."""
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def lr_reference(make_scheduler, taken, lr: float):
    """The LR each step would use if the scheduler stepped only after taken steps (a plain scheduler)."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = make_scheduler(opt)
    out = []
    for was_taken in taken:
        out.append(opt.param_groups[0]["lr"])
        if was_taken:
            opt.step()
            sched.step()
    return out


def read_tensorboard(logdir) -> dict:
    """Every scalar in a TensorBoard log directory: {tag: [(step, value), ...]}, read back by tensorboard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tiny_gpt2(seed: int = 0, vocab: int = 64, n_positions: int = 16):
    """A 2-layer GPT-2 (n_embd=32, 2 heads) built in code, dropout off (resumed runs must match)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=vocab,
        n_positions=n_positions,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


class TokenData(torch.utils.data.Dataset):
    """Random token sequences (fixed by seed) for causal LM training: labels are the inputs."""

    def __init__(self, n: int, length: int = 16, vocab: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
