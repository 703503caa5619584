"""What torchtitan 0.3.0 needs to train on a machine without a GPU, and FSDP2 on gloo: stand-ins, nothing else.

``install()`` before torchtitan is first imported, ``gloo_reductions(trainer)`` after building a
Trainer. Each line stands in for one CUDA- or NCCL-only piece; the trainer, FSDP2, the loss, the
optimizers, the checkpointer and the metrics are torchtitan's own.
"""

import sys
import types

import torch
import torch._utils
import torch.nn.functional as F

_MOE_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _cuda_only(*args, **kwargs):
    raise RuntimeError("torchtitan's MinimalAsyncEP Triton kernels need CUDA (not used by a dense model).")


def _dense_flex_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    """torch's FlexAttention has no backward on CPU: the same masked attention (the block mask's
    mask_mod as a dense mask, no score_mod: llama3 uses none), through scaled_dot_product_attention."""
    from torch.nn.attention.flex_attention import create_mask

    mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa), None


class _NoDeviceMemory:
    """components/metrics.py:38 DeviceMemoryMonitor reads torch.cuda's memory statistics; zeros here."""

    device_name = "cpu"

    def get_peak_stats(self):
        from torchtitan.components.metrics import DeviceMemStats

        return DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

    def reset_peak_stats(self):
        pass


def install() -> None:
    """Import torchtitan's trainer with the stand-ins in place."""
    if "torchtitan.trainer" in sys.modules:
        return
    found = torch._utils._get_available_device_type
    # tools/utils.py:55 takes "cuda" when no accelerator is found; CPU here (device module torch.cpu).
    torch._utils._get_available_device_type = lambda: "cpu"
    # distributed/minimal_async_ep/kernels.py imports triton (CUDA builds only) for expert-parallel kernels.
    kernels = sys.modules[_MOE_KERNELS] = types.ModuleType(_MOE_KERNELS)
    for name in (
        "copy_full_counts_to_peers_kernel",
        "copy_rows_to_peers_kernel",
        "expand_topk_grad_kernel",
        "fill_combine_metadata_kernel",
        "fill_dispatch_metadata_kernel",
        "invert_flat_indices_kernel",
        "reduce_topk_slots_kernel",
        "topk_scores_grad_kernel",
    ):
        setattr(kernels, name, _cuda_only)
    try:
        import torchtitan.trainer  # noqa: F401
    finally:
        torch._utils._get_available_device_type = found
    from torchtitan.components import metrics
    from torchtitan.models.common import attention

    # components/metrics.py:95 builds the CUDA memory monitor for every MetricsProcessor.
    metrics.build_device_memory_monitor = _NoDeviceMemory
    # models/common/attention.py:277 torch.compile(flex_attention): no backward on CPU in torch.
    attention.FlexAttention._compiled_flex_attn = _dense_flex_attention


def gloo_reductions(trainer) -> None:
    """distributed/fsdp.py:41 sets FSDP2's gradient divide factor to 1, which FSDP2 reduces with NCCL's
    PREMUL_SUM(1/1); gloo has no PREMUL_SUM, and a SUM divided by 1 is the same reduction."""
    from torch.distributed.fsdp import FSDPModule

    for module in (m for part in trainer.model_parts for m in part.modules() if isinstance(m, FSDPModule)):
        module.set_force_sum_reduction_for_comms(True)
