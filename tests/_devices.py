"""The devices the device tests run on besides the CPU: CUDA when present (marked ``cuda``, skipped
without it; ``benchmarks/gpu_check.sh`` runs them on a GPU)."""

import contextlib

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA_LIKE = [pytest.param("cuda", id="cuda", marks=[needs_cuda, pytest.mark.cuda])]


@contextlib.contextmanager
def on(device):
    """The device to run on (a context, so a test reads the same on every device)."""
    yield device
