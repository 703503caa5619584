"""What torchtitan 0.3.0 needs to train on a machine without a GPU, and FSDP2 on gloo: stand-ins, nothing else.

``install()`` before torchtitan is first imported, ``gloo_reductions(trainer)`` after building a
Trainer, and ``microbatch_lists(trainer)`` for a pipeline-parallel one. Each line stands in for one
CUDA- or NCCL-only piece, or (``microbatch_lists``) for a torch API newer than torch 2.13; the trainer,
FSDP2, the pipeline schedules, the loss, the optimizers, the checkpointer and the metrics are
torchtitan's and torch's own.
"""

import sys
import types

import torch
import torch._utils
import torch.nn.functional as F

_MOE_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _cuda_only(*args, **kwargs):
    raise RuntimeError(
        "torchtitan's MinimalAsyncEP Triton kernels need CUDA (not used by a dense model, nor by expert "
        'parallelism with the "standard" all-to-all token dispatcher).'
    )


def _dense_flex_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    """torch's FlexAttention has no backward on CPU: the same masked attention (the block mask's
    mask_mod as a dense mask, no score_mod: llama3 and deepseek_v3 pass none), through
    scaled_dot_product_attention."""
    from torch.nn.attention.flex_attention import create_mask

    if score_mod is not None:
        raise NotImplementedError("the CPU stand-in for FlexAttention applies no score_mod")

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


def microbatch_lists(trainer) -> None:
    """trainer.py:856-863 hands its pipeline schedule microbatches already split, as
    ``step(arg_mbs=, kwarg_mbs=, target_mbs=, ...)``: an API of torch releases after 2.13. torch 2.13's
    ``step`` (pipelining/schedules.py:740-790) takes the whole batch only and would pass those lists to
    the model as keyword arguments ("Expecting 2 arg_mbs but got 1", schedules.py:563). Here ``step`` is
    torch 2.13's own, less its split: the schedule's ``_step_microbatches`` (1F1B, GPipe, ...) takes the
    lists as they are."""
    schedule = trainer.pp_schedule
    stages = getattr(schedule, "_stages", None) or [schedule._stage]  # multi-stage schedules / single-stage

    def step(*, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True, loss_kwargs=None):
        for stage in stages:  # what step() does before its split (schedules.py:768-772)
            stage.has_backward = schedule._has_backward
            stage.clear_runtime_states()
        schedule._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)

    schedule.step = step
