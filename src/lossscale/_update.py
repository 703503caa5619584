"""The two forms of ``GradScaler.update()``: the pure rule on the host, or the tensor rule on device.

Where every gradient check of the iteration synced (optimizers without amp-scaling support), the host
knows the flags, so it runs the policy's pure rule (the specification) on its copy of the state and
the scaler sends the result in one copy. Otherwise the flags live on device (fused optimizers, CUDA
graphs, torch.compile) and the policy's tensor rule runs there. Property tests hold the two forms to
each other bitwise, so which one ran never shows in the state.
"""

from __future__ import annotations

import math
from typing import List

import torch

from . import _kernels
from ._check import Flags
from ._validate import plain_number
from .policy import SMALLEST_SCALE, ScaleState, count, count_tensor, f32

__all__ = ["host_rule", "pending_nan", "device_rule", "validate_new_scale"]


def host_rule(policy, before: ScaleState, flags: List[Flags], new_scale) -> ScaleState:
    """The state after this iteration by the policy's pure rule, from the flags the checks read. An
    overflow whose NaN is not known on the host yet counts as inf here (see :func:`pending_nan`)."""
    if len(flags) == 1:  # one optimizer: its flags as they are (this runs every synced step)
        only = flags[0]
        found_inf, found_nan, bad_loss, amax = only.host_found, bool(only.host_nan), only.host_bad, only.host_amax
    else:
        found_inf = any(f.host_found for f in flags)
        found_nan, bad_loss = any(f.host_nan for f in flags), any(f.host_bad for f in flags)
        amaxes = [f.host_amax for f in flags if f.host_amax is not None]
        amax = max(amaxes) if amaxes else None
    if new_scale is not None:  # the iteration still happened: count it; torch leaves the trackers alone
        return (count(before, found_inf, found_nan, bad_loss) if flags else before).replace(scale=f32(new_scale))
    return policy.update(before, found_inf, found_nan, amax, bad_loss)


def pending_nan(flags: List[Flags]):
    """The device flag of the NaN that :func:`host_rule` could not know (None when it knew): the
    checks that overflowed before they could tell NaN from inf."""
    pending = [f.found_nan for f in flags if f.host_nan is None]
    if not pending or any(f.host_nan for f in flags):  # none, or a NaN the host knows counts already
        return None
    return pending[0] if len(pending) == 1 else torch.stack(pending).amax()


def device_rule(policy, t, flags: List[Flags], new_scale) -> None:
    """The policy's tensor rule on the device state ``t``, in place, no sync."""
    vectors = [f.vector() for f in flags]
    vector = vectors[0] if len(vectors) == 1 else _kernels.combined(vectors) if vectors else None
    if new_scale is None:
        amaxes = [f.amax for f in flags if f.amax is not None]
        amax = None if not amaxes else amaxes[0] if len(amaxes) == 1 else torch.stack(amaxes).max()
        t.run_rule(policy, vector, amax)
        return
    if vector is not None:  # the iteration still happened: count it; torch leaves the trackers alone
        count_tensor(t, vector)
    if isinstance(new_scale, torch.Tensor):
        value = new_scale.detach().reshape(()).to(t.scale)
        # A non-finite or too small scale would poison every later step: keep the old one, decided on
        # device and before the clamp (which would turn inf into max_scale as if it had been asked for).
        ok = torch.isfinite(value) & (value >= SMALLEST_SCALE)
        lo, hi = policy.scale_bounds()
        if lo is not None or hi is not None:
            value = value.clamp(lo, hi)
        t.scale.copy_(torch.where(ok, value, t.scale))
    else:
        t.scale.fill_(new_scale)


def validate_new_scale(policy, new_scale, state_device):
    """``update(new_scale)``'s argument checked: a Python float within the policy's bounds, or a
    1-element float tensor on the state's device type; ValueError naming it otherwise."""
    if isinstance(new_scale, torch.Tensor):
        if new_scale.numel() != 1 or new_scale.requires_grad or not new_scale.is_floating_point():
            raise ValueError("new_scale must be a float or a 1-element floating-point tensor with requires_grad="
                             f"False; got a {new_scale.dtype} tensor of shape {tuple(new_scale.shape)}.")
        if state_device is not None and new_scale.device.type != state_device.type:
            raise ValueError(f"new_scale is on {new_scale.device} but the scaler's state is on {state_device}.")
        return new_scale
    new_scale = plain_number("new_scale", new_scale)
    if isinstance(new_scale, bool) or not isinstance(new_scale, (int, float)):
        raise ValueError(f"new_scale={new_scale!r} must be a float or a 1-element tensor.")
    if not (math.isfinite(new_scale) and SMALLEST_SCALE <= f32(new_scale) < math.inf):
        raise ValueError(f"new_scale={new_scale!r} must be finite and within float32's normal range "
                         "[2**-126, 3.4e38], where the scale is kept.")
    lo, hi = policy.scale_bounds()
    if (lo is not None and new_scale < lo) or (hi is not None and new_scale > hi):
        raise ValueError(f"new_scale={new_scale!r} is outside [min_scale={lo}, max_scale={hi}].")
    return new_scale
