"""Tiny GPT-2 models built from a config in code (nothing is downloaded), for tests on a real transformer.

CPU FP16 matmuls are ~50x slower than FP32 ones, so the defaults are tiny: 2 layers, 64 wide, a
vocabulary of 128 and 32 positions (about 120k parameters; one FP16 forward and backward of a 2 x 16
batch takes milliseconds).

* :func:`tiny_gpt2` -- a ``GPT2LMHeadModel`` from ``GPT2Config`` with those defaults, seeded.
* :func:`overflowing_gpt2` -- the same with one module whose own FP16 forward output overflows (its
  weights scaled up): ``(model, name)``. By default the first block's MLP down-projection
  ``transformer.h.0.mlp.c_proj``, the module unsloth-zoo PR #600 found by hand in real models
  (``layers.0.mlp.down_proj``): its output joins GPT-2's float32 residual stream, so keeping that one
  module in FP32 makes the whole forward finite, and the next layer norm brings the scale back.
* :func:`gpt2_batch` -- a seeded batch of token ids, and :func:`gpt2_loss` -- the causal-LM loss
  ``loss_fn(model, batch)`` as :func:`lossscale.audit` calls it.
* :func:`train_fp16` -- steps of torch's GradScaler loop under CPU FP16 autocast, on those batches.
"""

from __future__ import annotations

import torch

#: The tiny config's sizes (``tiny_gpt2``'s defaults).
TINY = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)

#: How much ``overflowing_gpt2`` scales the overflowing module's weight by default. The first block's
#: c_proj output has an amax of about 0.05 at initialisation; 2^22 puts it near 2e5, three times FP16's
#: largest value (65504), while float32 holds it without effort.
OVERFLOW_FACTOR = 2.0**22


def tiny_gpt2(seed: int = 0, **config_overrides) -> torch.nn.Module:
    """A ``GPT2LMHeadModel`` built from ``GPT2Config(**TINY, **config_overrides)``, initialised under
    ``torch.manual_seed(seed)``, in train mode, on the CPU, float32 parameters."""
    from transformers import GPT2Config, GPT2LMHeadModel

    # The special tokens are set so the config does not warn about GPT-2's real vocabulary (token 50256).
    settings = dict(TINY, bos_token_id=0, eos_token_id=0)
    settings.update(config_overrides)
    config = GPT2Config(**settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
    return model.train()


def overflowing_gpt2(
    seed: int = 0, *, module: str = "transformer.h.0.mlp.c_proj", factor: float = OVERFLOW_FACTOR, **config_overrides
):
    """``(model, name)``: :func:`tiny_gpt2` with ``name``'s weight multiplied by ``factor``, so its own
    FP16 output overflows while its input and the FP32 forward stay finite."""
    model = tiny_gpt2(seed, **config_overrides)
    with torch.no_grad():
        model.get_submodule(module).weight.mul_(factor)
    return model, module


def gpt2_batch(seed: int = 0, *, batch_size: int = 2, seq_len: int = 16, vocab_size: int = TINY["vocab_size"]):
    """A ``(batch_size, seq_len)`` tensor of token ids, drawn from its own generator (the global RNG is
    left alone)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)


def gpt2_loss(model, batch):
    """The causal-LM loss of ``batch``: next-token cross-entropy of the logits, in float32 (as
    transformers' own loss computes it; written out so no version's loss plumbing is involved)."""
    logits = model(batch).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def train_fp16(model, scaler, opt, steps: int, start: int = 0, after_step=None) -> list:
    """``steps`` iterations of torch's loop (zero_grad; the forward under CPU FP16 autocast on
    ``gpt2_batch(step)``; ``scaler.scale(loss).backward()``; ``step``; ``update``), the batches numbered
    from ``start``; ``after_step()`` after each update. Returns the losses (floats)."""
    losses = []
    for step in range(start, start + steps):
        opt.zero_grad()
        with torch.autocast(device_type="cpu", dtype=torch.float16):
            loss = gpt2_loss(model, gpt2_batch(step))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
        if after_step is not None:
            after_step()
    return losses
