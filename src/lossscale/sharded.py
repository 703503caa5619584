"""``lossscale.ShardedGradScaler``: torch's ``ShardedGradScaler`` signature and defaults on ``lossscale.GradScaler``.

Torch's FSDP scaler differs from its ``GradScaler`` in two ways a replacement must keep: FP16 gradients
(FSDP with FP16 gradient reduction) are unscaled in place, and the skip decision is all-reduced over
``process_group``. ``ShardedGradScaler(...)`` is ``GradScaler(..., allow_fp16=True)`` with torch's order
of positional arguments (``backoff_factor`` before ``growth_factor``); the flushed values are counted
(``metrics()["fp16_flushed"]``). Its device defaults to the first scaled tensor's, not "cuda".
"""

from __future__ import annotations

from typing import Any, Literal, Union

import torch

from .scaler import GradScaler

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(GradScaler):
    """A drop-in for ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``: torch's positional
    order and ``process_group``, FP16 gradients unscaled (``allow_fp16=True``), lossscale's everything else
    (pass ``allow_fp16=False`` to refuse them, or any :class:`lossscale.GradScaler` keyword)."""

    def __init__(
        self,
        device=None,
        init_scale=None,
        backoff_factor=None,
        growth_factor=None,
        growth_interval=None,
        enabled: bool = True,
        process_group: Union[Literal["default"], torch.distributed.ProcessGroup, None] = "default",
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("allow_fp16", True)
        super().__init__(
            device,
            init_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
            enabled,
            process_group=process_group,
            **kwargs,
        )
