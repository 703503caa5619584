"""``lossscale.check_setup(model, optimizer, scaler)``: what will go wrong in FP16 training, before the first step.

Some FP16 set-ups run without an error and train badly, or fail only at the first ``unscale_`` or the first
resume. Each is visible in the objects before training starts::

    report = lossscale.check_setup(model, optimizer, scaler, dtype=torch.float16)
    print(report)            # every finding: what, where, why, the fix; or "no problems found"
    assert report.ok

What it looks at, and what each finding means (:class:`Kind`):

* ``FP16_MASTER_WEIGHTS``: the optimizer updates float16 parameters (a model ``.half()``-ed before the
  optimizer was built, or before ``fully_shard``, whose ``MixedPrecisionPolicy(param_dtype=float16)`` is
  then a silent no-op): an update smaller than half a float16 ulp of its weight is lost.
* ``FP16_GRADIENTS``: a gradient will be float16 (a float16 parameter; ``grad_dtype=float16``; under
  ``fully_shard`` the sharded parameter's dtype, whatever ``grad_dtype`` was set before sharding; FSDP's
  ``keep_low_precision_grads``): unscaling it in float16 flushes the small values the scale protected.
* ``FP16_REDUCE``: FSDP (``fully_shard`` or ``FullyShardedDataParallel``) reduces the scaled gradients in
  float16 (``reduce_dtype`` left unset with ``param_dtype=float16``): the sum over ranks can overflow.
* ``FUSED_FP16_STATE``: a fused optimizer over float16 parameters keeps its moments in float16: Adam's
  second moment of a gradient below about 5e-3 flushes to zero at every step, and that weight's update
  grows to up to 32 times Adam's.
* ``BF16_WITH_SCALING``: the compute dtype is bfloat16 and the scaler scales: nothing to save, a
  multiply and an unscale for nothing (``GradScaler.passthrough()``).
* ``SCALER_NOT_CHECKPOINTED``: a framework saves checkpoints (``framework=`` an accelerate
  ``Accelerator`` or a transformers ``Trainer``) and this scaler is not among what it saves.
* ``SECOND_SCALER``: the optimizer is accelerate's, and accelerate steps it through a scaler of its own.

What it cannot see, it says (``report.not_checked``): the autocast dtype of a training loop that has not
run yet (pass ``dtype=``, or call it inside the autocast region; the scaler warns at its first ``scale()``
anyway), and the checkpoint path of a hand-written loop.

No host sync, no collective: it reads dtypes, configurations and object identities, never a tensor's
values; on FSDP models it reads torch's FSDP state objects (private names, each with the torch line).
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

__all__ = ["Kind", "Finding", "SetupReport", "check_setup"]

#: ``where`` lists at most this many names in ``str(report)``; the finding keeps them all.
SHOWN = 5


class Kind(str, enum.Enum):
    """What a finding is about (its value is the string a log or a test can match)."""

    FP16_MASTER_WEIGHTS = "fp16_master_weights"
    FP16_GRADIENTS = "fp16_gradients"
    FP16_REDUCE = "fp16_reduce"
    FUSED_FP16_STATE = "fused_fp16_state"
    BF16_WITH_SCALING = "bf16_with_scaling"
    SCALER_NOT_CHECKPOINTED = "scaler_not_checkpointed"
    SECOND_SCALER = "second_scaler"


@dataclass(frozen=True)
class Finding:
    """One thing that will go wrong.

    Attributes:
        kind: what it is about (:class:`Kind`).
        where: the parameters or modules it names (as in ``model.named_parameters()`` /
            ``named_modules()``; ``param_groups[i][j]`` for a parameter the model does not hold).
        message: what will happen, and why.
        fix: what to change.
    """

    kind: Kind
    where: Tuple[str, ...]
    message: str
    fix: str

    def __str__(self) -> str:
        shown = ", ".join(self.where[:SHOWN]) + (f", ... ({len(self.where)} in all)" if len(self.where) > SHOWN else "")
        return f"[{self.kind.value}] {shown}\n    {self.message}\n    fix: {self.fix}"


@dataclass(frozen=True)
class SetupReport:
    """What :func:`check_setup` found.

    Attributes:
        findings: every finding, in the order of :class:`Kind`.
        dtype: the compute dtype the bf16 check used (None: not known), and ``dtype_from`` where it came
            from ("dtype=", "autocast", "FSDP policy", "parameters").
        not_checked: what could not be checked, and how to make it checkable.
    """

    findings: Tuple[Finding, ...]
    dtype: Optional[torch.dtype] = None
    dtype_from: Optional[str] = None
    not_checked: Tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        """No finding."""
        return not self.findings

    def kinds(self) -> List[Kind]:
        """The findings' kinds, in order."""
        return [f.kind for f in self.findings]

    def __str__(self) -> str:
        head = ("lossscale.check_setup: no problems found." if self.ok else
                f"lossscale.check_setup: {len(self.findings)} problem(s) for FP16 training:")
        lines = [head] + [str(f) for f in self.findings]
        lines += [f"not checked: {n}" for n in self.not_checked]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------ inputs
def _named_optimizer_params(model: torch.nn.Module, optimizer) -> List[Tuple[str, torch.Tensor, dict]]:
    """(name, parameter, its param group) for every parameter the optimizer updates."""
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            out.append((names.get(id(p), f"param_groups[{gi}][{pi}] {tuple(p.shape)}"), p, group))
    return out


def _fsdp2_params(model: torch.nn.Module) -> Iterator[Tuple[str, Any, Any]]:
    """(module name, its ``MixedPrecisionPolicy``, its FSDPParams) for every ``fully_shard``-ed module."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            # torch/distributed/fsdp/_fully_shard/_fully_shard.py: FSDPModule._get_fsdp_state(); the state's
            # _fsdp_param_group (None for a module that holds no parameter of its own) has mp_policy and
            # fsdp_params (_fsdp_param_group.py:187, init_dtype_attrs at :275).
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                yield name or type(module).__name__, group.mp_policy, group.fsdp_params


def _fsdp1_modules(model: torch.nn.Module) -> Iterator[Tuple[str, Any]]:
    """(module name, its ``MixedPrecision`` or None) for every ``FullyShardedDataParallel`` module."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return
    for name, module in model.named_modules():
        if isinstance(module, FullyShardedDataParallel):
            yield name or type(module).__name__, module.mixed_precision  # FSDP1's public property


def _compute_dtype(model, fsdp2, fsdp1, dtype) -> Tuple[Optional[torch.dtype], Optional[str]]:
    """The dtype the forward will compute in, and where that was learnt (None, None: unknown)."""
    if dtype is not None:
        return dtype, "dtype="
    from .fp32 import _autocast_state  # torch 2.3 and later

    device_type = next((p.device.type for p in model.parameters()), "cpu")
    enabled, autocast_dtype = _autocast_state(device_type)
    if enabled:  # called inside the training loop's autocast region
        return autocast_dtype, "autocast"
    policies = [p.param_dtype for _, p, _ in fsdp2 if p.param_dtype is not None]
    policies += [mp.param_dtype for _, mp in fsdp1 if mp is not None and mp.param_dtype is not None]
    if policies:
        return policies[0], "FSDP policy"
    floating = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(floating) == 1 and floating != {torch.float32}:  # a model in one low precision computes in it
        return floating.pop(), "parameters"
    return None, None


# ------------------------------------------------------------------------------------------ checks
def _master_weights(params, fsdp2_names) -> List[Finding]:
    half = [name for name, p, _ in params if p.dtype == torch.float16]
    if not half:
        return []
    sharded = [n for n in half if n in fsdp2_names]
    if sharded:
        message = ("the optimizer updates float16 parameters: fully_shard keeps each parameter in the dtype it had "
                   "when it was sharded, and MixedPrecisionPolicy(param_dtype=float16) only casts the unsharded "
                   "copy for compute, so on a float16 model it does nothing and there are no FP32 master weights. "
                   "An update below half a float16 ulp of its weight (lr * step < |w| * 2**-11) is lost.")
        fix = ("convert the model to float32 before fully_shard (model.float()), and keep "
               "MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32) for FP16 compute.")
    else:
        message = ("the optimizer updates float16 parameters (the model was .half()-ed, or loaded in float16, "
                   "before the optimizer was built): there are no FP32 master weights, and an update below half "
                   "a float16 ulp of its weight (lr * step < |w| * 2**-11) is lost.")
        fix = ("keep the parameters float32 (model.float() before building the optimizer) and run the forward "
               "under torch.autocast(device_type, dtype=torch.float16).")
    return [Finding(Kind.FP16_MASTER_WEIGHTS, tuple(half), message, fix)]


def _fp16_gradients(params, fsdp2_dtypes, fsdp1) -> List[Finding]:
    """Parameters whose gradient will be float16, where the optimizer does not unscale it itself."""
    low_precision_grads = any(mp is not None and mp.keep_low_precision_grads and mp.param_dtype == torch.float16
                              for _, mp in fsdp1)
    named: List[str] = []
    sharded = False
    for name, p, group in params:
        if group.get("fused"):  # a fused optimizer unscales in float32 arithmetic itself: exact
            continue
        if name in fsdp2_dtypes:
            # fully_shard casts the reduced gradient to the sharded parameter's dtype (orig_dtype:
            # _fsdp_collectives.py:696), whatever grad_dtype the parameter had before sharding.
            grad_dtype = fsdp2_dtypes[name]
            sharded = sharded or grad_dtype == torch.float16
        elif low_precision_grads:
            grad_dtype = torch.float16 if p.dtype == torch.float32 else p.dtype
        else:
            grad_dtype = getattr(p, "grad_dtype", p.dtype)  # torch >= 2.10: None means "any", then p.dtype
            grad_dtype = p.dtype if grad_dtype is None else grad_dtype
        if grad_dtype == torch.float16:
            named.append(name)
    if not named:
        return []
    why = (" Under fully_shard a gradient has the sharded parameter's dtype; a grad_dtype set on the parameter "
           "before fully_shard does not carry over." if sharded else
           " FSDP's MixedPrecision(keep_low_precision_grads=True) keeps them in param_dtype." if low_precision_grads
           else "")
    message = ("these gradients will be float16, unscaled outside the optimizer: dividing them by the scale in "
               "float16 flushes the small values the scale protected (lossscale.GradScaler raises at the first "
               "unscale_ unless allow_fp16=True; torch's GradScaler raises 'Attempting to unscale FP16 gradients')."
               + why)
    fix = ("keep those parameters (and so their gradients) float32, or use a fused optimizer (AdamW(fused=True) "
           "unscales in float32 arithmetic), or accept the flushing with GradScaler(allow_fp16=True), which "
           "counts it.")
    return [Finding(Kind.FP16_GRADIENTS, tuple(named), message, fix)]


def _fp16_reduce(fsdp2, fsdp1) -> List[Finding]:
    modules = []
    for name, policy, _ in fsdp2:
        # reduce_dtype None reduces in the compute dtype (torch's MixedPrecisionPolicy docstring).
        if (policy.reduce_dtype or policy.param_dtype) == torch.float16:
            modules.append(name)
    for name, mp in fsdp1:
        if mp is not None and (mp.reduce_dtype or mp.param_dtype) == torch.float16:
            modules.append(name)
    if not modules:
        return []
    return [Finding(
        Kind.FP16_REDUCE, tuple(modules),
        "FSDP reduces the scaled gradients in float16 (reduce_dtype unset, so it is param_dtype): the sum over "
        "ranks of gradients already multiplied by the loss scale overflows float16 sooner than any one rank's, "
        "and each overflow skips the step and halves the scale.",
        "set reduce_dtype=torch.float32 in the policy (MixedPrecisionPolicy for fully_shard, MixedPrecision for "
        "FullyShardedDataParallel).")]


def _fused_fp16_state(params, optimizer) -> List[Finding]:
    named = []
    for name, p, group in params:
        if not group.get("fused"):
            continue
        state = optimizer.state.get(p, {})
        held = [v for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor) and v.is_floating_point()]
        if p.dtype == torch.float16 or any(v.dtype == torch.float16 for v in held):
            named.append(name)
    if not named:
        return []
    return [Finding(
        Kind.FUSED_FP16_STATE, tuple(named),
        "a fused optimizer keeps its state in the parameter's dtype, here float16: it computes in float32 but "
        "stores the moments in float16, where Adam's second moment of a gradient below about 5e-3 flushes to "
        "zero at every step, so that weight's update grows to up to 1/sqrt(1 - beta2) times Adam's (about 32 "
        "with the default betas).",
        "keep the parameters float32 (FP32 master weights, autocast for FP16 compute): the fused optimizer then "
        "keeps float32 state.")]


def _scaling(scaler) -> bool:
    """Whether ``scaler`` multiplies the loss (enabled, and not a scale fixed at 1)."""
    from .static import StaticPolicy

    policy = getattr(scaler, "policy", None)  # lossscale's; torch's GradScaler has none and always scales
    return scaler.is_enabled() and not (isinstance(policy, StaticPolicy) and policy.scale == 1.0)


def _bf16(scaler, dtype, source) -> List[Finding]:
    if scaler is None or dtype != torch.bfloat16 or not _scaling(scaler):
        return []
    return [Finding(
        Kind.BF16_WITH_SCALING, (type(scaler).__name__,),
        f"the compute dtype is bfloat16 (from {source}) and the scaler scales the loss: bfloat16 has float32's "
        "exponent range, so nothing underflows that a loss scale would save; the multiply and the unscale pass "
        "cost time for nothing.",
        "use lossscale.GradScaler.passthrough() (scale fixed at 1, non-finite steps still skipped) or no "
        "scaler; for FP16 training use autocast dtype=torch.float16.")]


def _accelerators(framework) -> Optional[Tuple[str, Any]]:
    """(what saves, the accelerate Accelerator) for ``framework=``: an Accelerator, or a transformers
    Trainer (which saves its accelerator's scaler, trainer.py:3605 in transformers 5.24.0)."""
    accelerator = getattr(framework, "accelerator", None)
    if accelerator is not None:
        return f"{type(framework).__name__}'s checkpoints (scaler.pt: its accelerator.scaler)", accelerator
    return "accelerator.save_state (its .scaler and register_for_checkpointing objects)", framework


def _checkpoint(scaler, framework) -> List[Finding]:
    if scaler is None or framework is None:
        return []
    what, accelerator = _accelerators(framework)
    saved = [accelerator.scaler]
    if accelerator is framework:  # accelerate's save_state also saves registered objects (accelerator.py:3660)
        saved += list(accelerator._custom_objects)
    if any(s is scaler for s in saved):
        return []
    return [Finding(
        Kind.SCALER_NOT_CHECKPOINTED, (type(scaler).__name__,),
        f"this scaler is not in {what}: a resumed run starts from the initial scale and counters, and "
        "calibrates again (skipped steps right after every resume).",
        "lossscale.integrations.accelerate.attach(accelerator, scaler) (or .transformers.attach(trainer, "
        "scaler)) makes it the framework's scaler, which is saved; or accelerator.register_for_checkpointing("
        "scaler).")]


def _second_scaler(scaler, optimizer) -> List[Finding]:
    # accelerate's AcceleratedOptimizer keeps the scaler its step() goes through as .scaler
    # (accelerate/optimizer.py). Without accelerate imported, the optimizer cannot be one.
    accelerate_optimizer = sys.modules.get("accelerate.optimizer")
    if scaler is None or accelerate_optimizer is None or \
            not isinstance(optimizer, accelerate_optimizer.AcceleratedOptimizer):
        return []
    theirs = optimizer.scaler
    if theirs is None or theirs is scaler:
        return []
    return [Finding(
        Kind.SECOND_SCALER, (type(theirs).__name__,),
        "the optimizer is accelerate's, and its step() goes through the accelerator's own scaler, not this one: "
        "two scalers disagree on the scale and on which steps were skipped.",
        "give the accelerator this scaler before prepare(): lossscale.integrations.accelerate.attach("
        "accelerator, scaler).")]


# ------------------------------------------------------------------------------------------ entry
_DTYPES = (None, torch.float16, torch.bfloat16, torch.float32)


def check_setup(model: torch.nn.Module, optimizer, scaler=None, *, dtype: Optional[torch.dtype] = None,
                framework: Any = None) -> SetupReport:
    """What will go wrong in FP16 training with these objects, before the first step (see
    :mod:`lossscale.setup_check`).

    Args:
        model: the model as it will train (after ``fully_shard`` / FSDP wrapping, if any).
        optimizer: the optimizer that will step it (accelerate's prepared optimizer too).
        scaler: the ``lossscale.GradScaler`` (or ``torch.amp.GradScaler``) that will scale its loss, or None.
        dtype: the autocast (compute) dtype the loop will use. None: learnt from an autocast region this
            call runs in, the FSDP mixed-precision policy, or a model entirely in one low precision;
            ``report.not_checked`` says when it could not be.
        framework: an accelerate ``Accelerator`` or a transformers ``Trainer`` that saves the
            checkpoints, to check that this scaler is among what it saves. None: not checked.

    Returns:
        A :class:`SetupReport`: ``print(report)`` for the user, ``report.ok``, ``report.findings``.

    Raises:
        ValueError: an argument is not what it must be (named, with what to pass).

    No host sync, no collective (configuration and dtypes only): every rank may call it, or one.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model={model!r} must be the torch.nn.Module that will train.")
    if not hasattr(optimizer, "param_groups"):
        raise ValueError(f"optimizer={optimizer!r} is not an optimizer (no param_groups); pass the one that will "
                         "step the model.")
    if scaler is not None and not callable(getattr(scaler, "is_enabled", None)):
        raise ValueError(f"scaler={scaler!r} must be a lossscale.GradScaler, a torch.amp.GradScaler or None.")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} must be None, torch.float16, torch.bfloat16 or torch.float32 (the "
                         "autocast dtype the training loop will use).")
    if framework is not None and not hasattr(getattr(framework, "accelerator", framework), "_custom_objects"):
        raise ValueError(f"framework={framework!r} must be an accelerate Accelerator or a transformers Trainer "
                         "(the object whose checkpoints should hold the scaler), or None.")
    params = _named_optimizer_params(model, optimizer)
    fsdp2 = list(_fsdp2_params(model))
    fsdp1 = list(_fsdp1_modules(model))
    names = {id(p): n for n, p, _ in params}
    # Per optimizer parameter under fully_shard: its sharded dtype, which its gradient will have.
    fsdp2_dtypes: Dict[str, torch.dtype] = {}
    for _, _, fsdp_params in fsdp2:
        for fp in fsdp_params:
            name = names.get(id(fp.sharded_param))
            if name is not None:  # its orig_dtype once lazily initialised (_fsdp_param.py:588)
                fsdp2_dtypes[name] = fp.sharded_param.dtype
    compute, source = _compute_dtype(model, fsdp2, fsdp1, dtype)
    findings = (_master_weights(params, fsdp2_dtypes) + _fp16_gradients(params, fsdp2_dtypes, fsdp1)
                + _fp16_reduce(fsdp2, fsdp1) + _fused_fp16_state(params, optimizer) + _bf16(scaler, compute, source)
                + _checkpoint(scaler, framework) + _second_scaler(scaler, optimizer))
    not_checked = []
    if scaler is not None and compute is None:
        not_checked.append("bf16 autocast with a scaling scaler: the compute dtype is not known yet; pass dtype= "
                           "(or call check_setup inside the autocast region). The scaler also warns at its first "
                           "scale() under bf16 autocast.")
    if scaler is not None and framework is None:
        not_checked.append("whether the scaler is checkpointed: pass framework=<the Accelerator or Trainer that "
                           "saves checkpoints>; a hand-written loop must save scaler.state_dict() itself.")
    return SetupReport(tuple(findings), compute, source, tuple(not_checked))
