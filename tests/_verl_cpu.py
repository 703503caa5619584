"""What verl needs to train on CPU: a CPU platform, the one piece verl has no version of.

verl picks a platform (CUDA, NPU, ROCm) through its plugin registry (verl/plugin/platform) and has no
CPU one. This is verl's CUDA platform with the device calls a training step makes answered for the
CPU; every line says what it stands in for. The rest is configuration verl already has: the engine
registered for "cuda" chosen with ``VERL_ENGINE_DEVICE=cuda`` (verl/workers/engine/base.py:404-406),
eager attention instead of flash-attention with ``override_config.attn_implementation``
(verl/workers/config/model.py:185), the process group this test already made (verl joins it,
verl/utils/distributed.py:90).
"""

from __future__ import annotations

import types

import torch
from torch.distributed.fsdp import _init_utils as _fsdp1_init
from verl.plugin.platform import platform_manager
from verl.plugin.platform.platform_cuda import PlatformCUDA

# The torch.cuda calls a training step, a checkpoint save and a load make, answered for the CPU.
CPU_DEVICE_MODULE = types.SimpleNamespace(
    set_rng_state=torch.set_rng_state,              # torch.cuda.set_rng_state (checkpoint load): the CPU generator's
    empty_cache=lambda: None,                       # torch.cuda.empty_cache: no cache allocator on CPU
    max_memory_allocated=lambda *a, **k: 0,         # torch.cuda.max_memory_allocated (worker's perf/ metrics)
    max_memory_reserved=lambda *a, **k: 0,          # torch.cuda.max_memory_reserved (worker's perf/ metrics)
    memory_allocated=lambda *a, **k: 0,             # torch.cuda.memory_allocated (verl's memory logging)
    memory_reserved=lambda *a, **k: 0,              # torch.cuda.memory_reserved (verl's memory logging)
    mem_get_info=lambda *a, **k: (0, 0),            # torch.cuda.mem_get_info (verl's memory logging)
    get_device_name=lambda *a: "CPU",               # torch.cuda.get_device_name (the worker's mfu metric)
)


class _CPUIndex(str):
    """What verl gets for the device index: verl passes the index to ``.to()`` (fsdp_utils.py:507), where
    it must read "cpu", and formats it into ``f"{device_name}:{index}"`` (fsdp_utils.py:229), where it
    must read "0"."""

    def __format__(self, spec: str) -> str:
        return "0"


_CPU_INDEX = _CPUIndex("cpu")


class CPUPlatform(PlatformCUDA):
    """verl's CUDA platform, answering for the CPU what a training step, a checkpoint save and a load ask
    (the calls of these tests, recorded; the other methods are never reached)."""

    device_name = "cpu"                              # "cuda": tensors, autocast and the mesh go to the CPU
    device_module = CPU_DEVICE_MODULE               # torch.cuda

    def is_available(self) -> bool:                 # torch.cuda.is_available()
        return True

    def current_device(self) -> str:                # torch.cuda.current_device(): the device's index
        return _CPU_INDEX

    def communication_backend_name(self) -> str:    # "nccl"
        return "gloo"


def use_cpu() -> None:
    """Make verl's platform the CPU one, in this process, before verl asks for it."""
    platform_manager.set_platform(CPUPlatform())
    # FSDP1 with sync_module_states=True (verl's, transformer_impl.py:442) refuses CPU module states because
    # NCCL broadcasts GPU tensors only; gloo broadcasts CPU tensors, so the check stands aside.
    _fsdp1_init.__dict__["_check_module_states_for_sync_module_states"] = lambda module_states: None
