"""The gradient check: the per-iteration work that ``unscale_``, ``step`` and ``clip_grad_norm_`` share.

For one optimizer it gathers the gradients (with torch's FP16-gradient error made actionable),
groups them by device and dtype, checks them for inf/NaN (and unscales them, or clips them), measures
the amax a policy may need, and reduces the flags across ranks in ONE collective (a second one
only to classify an overflow on the synced path). What it learns is
a small :class:`Flags` record; the scaler keeps the records of an iteration and hands them to the
policy in ``update()``.

**The flag contract.** Every ``found_inf`` (and ``found_nan``) that leaves this module is a float32
0-dim tensor holding exactly 0.0 or 1.0, whatever was combined into it: the per-device flags of a
check, the bad-loss flag (the loss check and the trace's forward flag), and the flags of other ranks.
Flags are combined with :func:`any_flag` (an elementwise ``maximum``) or a MAX all-reduce, never
added. Why it matters: torch's fused optimizers (``Adam/AdamW/SGD/Adagrad(fused=True)``, CPU and CUDA
kernels alike) skip only when ``found_inf == 1.0`` and otherwise *step*, subtracting ``found_inf``
from their step counters; a sum of two flags (2.0) made a "skipped" step write NaN into the weights.
``tests/test_skip_matrix.py`` holds every torch.optim optimizer to this.

It also refuses to unscale the same gradients twice in one iteration, which an optimizer wrapper
(Fabric's, accelerate's) over the same parameters would otherwise do silently: torch's scaler keys
its bookkeeping by optimizer object, so ``unscale_(wrapper)`` after ``unscale_(inner)`` divides by
the scale twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Set

import torch

from . import _clip, _kernels
from . import distributed as _distributed

__all__ = ["Flags", "Gathered", "GradientCheck"]


@dataclass
class Gathered:
    """One optimizer's gradients, as checked: ``grads[i]`` is the tensor checked for ``params[i]``.

    ``all_params``: every parameter with a gradient, in the optimizer's order, empty local shards
    included; ``sharded``: whether the parameters are DTensors (FSDP2). Both are the same on every
    rank, unlike ``params`` (a rank may hold only empty shards), so collectives are decided on them.
    """

    params: List[torch.Tensor]
    grads: List[torch.Tensor]
    all_params: List[torch.Tensor] = field(default_factory=list)
    sharded: bool = False


@dataclass
class Flags:
    """What one check learned, on the scale's device, reduced across ranks.

    Attributes:
        found_inf: float32 0-dim, 1.0 when some gradient was inf or NaN (torch's found_inf), else 0.0.
        found_nan: float32 0-dim, 1.0 when NaN was among them, else 0.0.
        amax: max|g| of the scaled gradients for policies that need it, else None.
        host_found: the skip decision as a host bool where it was synced, else None (on device).
        host_nan, host_bad, host_amax: where it was synced, the rest of what the policy reads, on the
            host (``host_nan`` None: an overflow whose NaN is learned on device, after the decision).
        bad_loss: 0-dim (bool, or float32 0/1), the loss (or a traced forward output) was non-finite before scaling on
            some rank; None when the scaler does not check. ``found_inf`` includes it (the step is
            skipped), and the policy learns from it that the scale was not the cause.
        params, amax_vectors: the parameters in check order and per-parameter max|g| vectors
            (NaN/inf where a parameter held one), for ``overflow_report``; empty when not measured.
        loss_check: the loss check (non-finite where a loss was) not yet folded into ``found_inf`` (one process,
            synced: the host reads it with the decision; :meth:`fold` makes the device flags on demand).
        bools: the flag vector (``FLAG_LAYOUT``: entries 1-3 are overflow, nan, bad_loss) as bools, not yet converted: until
            :meth:`fold` converts it (on demand: where the host reads the decision, nothing may ask),
            ``found_inf``, ``found_nan``, ``bad_loss`` and ``flag_vector`` are None.
    """

    found_inf: torch.Tensor
    found_nan: torch.Tensor
    amax: Optional[torch.Tensor] = None
    host_found: Optional[bool] = None
    bad_loss: Optional[torch.Tensor] = None
    host_nan: Optional[bool] = False
    host_bad: bool = False
    host_amax: Optional[float] = None
    loss_check: Optional[torch.Tensor] = None
    params: List[torch.Tensor] = field(default_factory=list)
    amax_vectors: List[torch.Tensor] = field(default_factory=list)

    flag_vector: Optional[torch.Tensor] = None
    bools: Optional[torch.Tensor] = None

    @classmethod
    def from_vector(cls, vector: torch.Tensor, amax: Optional[torch.Tensor], **kwargs) -> "Flags":
        """Flags whose found_inf, found_nan and bad_loss are views of the flag vector (entries 1, 2, 3 of ``FLAG_LAYOUT``)
        (float32 0/1; bools are kept as they are until :meth:`fold`)."""
        if vector.dtype == torch.bool:
            return cls(found_inf=None, found_nan=None, amax=amax, bools=vector, **kwargs)
        return cls(found_inf=vector[1], found_nan=vector[2], amax=amax, bad_loss=vector[3], flag_vector=vector,
                   **kwargs)

    def fold(self) -> "Flags":
        """Make the device flags from what is still kept apart: the bool vector (one conversion), or a
        loss check (folded into ``found_inf`` and ``bad_loss``). Device ops, no sync; returns self."""
        if self.bools is not None:
            vector, self.bools = _kernels.from_bools(self.bools), None
            self.found_inf, self.found_nan, self.bad_loss, self.flag_vector = vector[1], vector[2], vector[3], vector
        if self.loss_check is not None:
            bad = _kernels.bad_loss_flag(self.loss_check)
            self.found_inf, self.bad_loss, self.loss_check = torch.maximum(self.found_inf, bad), bad, None
        return self

    def vector(self) -> torch.Tensor:
        """The flags laid out (:data:`lossscale.policy.FLAG_LAYOUT`) as float32 0/1 on the flags' device: what a tensor rule
        takes (:func:`lossscale.policy.count_tensor`). ``found_inf`` already includes a bad loss."""
        self.fold()
        if self.flag_vector is None:
            bad = torch.zeros_like(self.found_inf) if self.bad_loss is None else self.bad_loss.to(self.found_inf.dtype)
            self.flag_vector = _kernels.laid_out([torch.ones_like(self.found_inf), self.found_inf, self.found_nan, bad])
        return self.flag_vector

    def read(self, needs_amax: bool, nan_known: bool) -> bool:
        """THE sync of this optimizer's iteration: the skip decision on the host, with what the policy's
        pure rule needs besides (the bad loss, the amax of a measuring policy, and NaN where it is
        known already: ``nan_known``) in the same read. Returns the decision.

        One read, as torch's ``.item()``: the 0/1 flags ride in one number, ``overflow + 2 nan + 4
        bad`` (a bool vector not yet converted is copied as it is; where only the decision is read, a
        loss check kept apart is added times 0: NaN, a bad loss, or 0), and a measuring policy's amax (>= 0, finite on a clean step) takes its place on a clean step
        (an overflow's code is then negative). Where NaN is learned only after the decision (torch's
        check+unscale kernel cannot tell NaN from inf), ``host_nan`` stays None and ``found_nan``
        goes on to the device (see ``lossscale._state.StateKeeper``): no second sync.
        """
        if self.bools is not None:  # [1, overflow, nan, bad, ...]
            if not needs_amax:  # one read, no kernel
                _, overflow, nan, bad = _kernels.read_four_bools(self.bools[:4])
                return self._learn(overflow + 2 * nan + 4 * bad, needs_amax, nan_known)
            self.fold()  # the float vector, for the dot below
        if self.flag_vector is not None:  # [1, overflow, nan, bad, ...]: one dot gives the number
            code = torch.dot(self.flag_vector[1:4], _kernels.bit_weights(self.flag_vector))
        else:  # torch's check+unscale kernel: the decision alone (its NaN is learned after, on device)
            code = self.found_inf
            if self.loss_check is not None:  # + loss * 0: NaN for a bad loss
                code = torch.addcmul(code, self.loss_check, _kernels.zero_on(code.device))
            elif self.bad_loss is not None:
                code = torch.add(code, self.bad_loss.to(code.dtype), alpha=4)
        if needs_amax:
            code = torch.where(code > 0, -code, self.amax.to(code.dtype))
        return self._learn(code.item(), needs_amax, nan_known)

    def _learn(self, value: float, needs_amax: bool, nan_known: bool) -> bool:
        """Take the number :meth:`read` read apart into the host's flags; returns the decision."""
        if value != value:  # a bad loss (read() adds the loss check's NaN-or-0 where NaN is not known)
            self.host_found, self.host_nan, self.host_bad, self.host_amax = True, None, True, None
            return True
        bits = int(-value) if needs_amax and value < 0 else 0 if needs_amax else int(value)
        self.host_found = bool(bits & 5)  # an inf/NaN gradient, or a bad loss
        self.host_nan = bool(bits & 2) if nan_known else (None if self.host_found else False)
        self.host_bad = bool(bits & 4)
        self.host_amax = value if needs_amax and not self.host_found else None
        return self.host_found


class GradientCheck:
    """Gathers, checks, unscales and reduces one optimizer's gradients at a time.

    Args:
        name_of: ``param -> name`` for error messages.
        process_group: the scaler's ``process_group`` setting ("default", None or a group); resolved
            at every use, so a scaler built before ``init_process_group`` picks the group up.
    """

    def __init__(self, name_of: Callable[[torch.Tensor], Optional[str]], process_group: Any):
        self._name_of = name_of
        self.process_group = process_group
        self._unscaled: Set[int] = set()

    def new_iteration(self) -> None:
        """Forget which gradients were unscaled (called by ``update()``)."""
        self._unscaled = set()

    # ------------------------------------------------------------------------------ gathering
    def gather(self, optimizer, allow_half: bool, coalesce: bool = False) -> Gathered:
        """The gradients to check (dense tensors, local shards, or coalesced sparse values).

        ``coalesce``: coalesce every sparse gradient (norms need it); FP16 sparse ones are always
        coalesced, like torch, because a sum of duplicate scaled fp16 values may overflow.
        """
        grads, params, half, every = [], [], [], []
        sharded = False
        fp16 = torch.float16
        dense = torch.Tensor
        for gi, group in enumerate(optimizer.param_groups):
            for pi, param in enumerate(group["params"]):
                if not isinstance(param, torch.Tensor):
                    raise ValueError(f"optimizer.param_groups[{gi}]['params'][{pi}] is not a tensor.")
                grad = param.grad  # read once: a property, and this loop runs per parameter per step
                if grad is None:
                    continue
                every.append(param)
                if not allow_half and grad.dtype == fp16:
                    half.append(self._name_of(param) or f"param_groups[{gi}][{pi}] {tuple(param.shape)}")
                    continue
                if type(grad) is not dense or grad.is_sparse:  # plain dense gradients are checked as they are
                    sharded = sharded or hasattr(grad, "_local_tensor")  # a DTensor on every rank alike
                    if coalesce and grad.is_sparse and not grad.is_coalesced():
                        param.grad = grad.coalesce()
                    grad = _kernels.grad_to_check(param)
                if grad.numel() == 0:
                    # Nothing to check, and the inf-norm of an empty tensor raises. FSDP2 gives a rank
                    # an empty local shard when a parameter's dim 0 is smaller than the world size.
                    continue
                grads.append(grad)
                params.append(param)
        if half:
            raise ValueError(
                f"{len(half)} parameter(s) have FP16 gradients ({', '.join(half[:5])}"
                f"{', ...' if len(half) > 5 else ''}): unscaling them in FP16 would flush the small ones, "
                "the very values loss scaling protects. Keep the parameters in FP32 and run the forward "
                "under torch.autocast(device_type, dtype=torch.float16) (FP32 master weights), or use an "
                "optimizer that unscales itself (e.g. torch.optim.Adam(fused=True))."
            )
        return Gathered(params, grads, every, sharded)

    def _claim(self, gathered: Gathered) -> None:
        """Refuse gradients already unscaled this iteration (before anything is rewritten)."""
        ids = {id(p) for p in gathered.params}
        again = ids & self._unscaled
        if again:
            names = [self._name_of(p) or f"param {tuple(p.shape)}" for p in gathered.params if id(p) in again]
            raise RuntimeError(
                f"{len(again)} gradient(s) were already unscaled in this iteration ({', '.join(names[:5])}"
                f"{', ...' if len(names) > 5 else ''}): unscale_()/clip_grad_norm_() reached them through "
                "another optimizer object over the same parameters (an optimizer wrapper such as Fabric's "
                "or accelerate's, and its inner optimizer). Dividing by the scale twice would shrink them "
                "silently; unscale through one of the two objects only."
            )
        self._unscaled |= ids

    # ------------------------------------------------------------------------------ reduction
    def reduce(self, found_inf: torch.Tensor, found_nan: torch.Tensor, amax: Optional[torch.Tensor] = None,
               bad_loss: Optional[torch.Tensor] = None):
        """All-reduce (MAX) the flags, and ``amax``/``bad_loss`` when given, over the group in ONE collective.

        Returns ``(found_inf, found_nan, amax, bad_loss)`` (None where not given). A collective:
        whether it runs, and with what, depends only on the group, the policy and the scaler's
        settings, never on local values.
        """
        group = _distributed.resolve_group(self.process_group)
        if group is None:
            return found_inf, found_nan, amax, bad_loss
        return _distributed.all_reduce_flags(found_inf, found_nan, amax, group, bad_loss)

    def reduce_vector(self, vector: torch.Tensor, amax: Optional[torch.Tensor]):
        """:meth:`reduce` for a flag vector (``FLAG_LAYOUT``; 0/1 or bools, MAX keeps
        it so) and ``amax``: one collective; returns ``(vector, amax)`` (a reduced vector is float32)."""
        group = _distributed.resolve_group(self.process_group)
        if group is None:
            return vector, amax
        vector = vector.float()  # a MAX of 0/1 floats, which every backend reduces
        found_inf, found_nan, amax, bad = _distributed.all_reduce_flags(vector[1], vector[2], amax, group, vector[3])
        # Laid out again from the reduced flags: "overflow and not a bad loss" is not a MAX of the ranks'.
        return _kernels.laid_out([vector[0], found_inf, found_nan, bad]), amax

    @staticmethod
    def _with_bad_loss(flags: "Flags", bad_loss: Optional[torch.Tensor]) -> None:
        """A reduced non-finite loss skips the step: fold it into found_inf (a max: the flag contract
        above; NaN gradients *and* a NaN loss are still 1.0); keep it as a bool."""
        if bad_loss is not None:
            flags.found_inf = torch.maximum(flags.found_inf, bad_loss.to(flags.found_inf.dtype))
            flags.bad_loss = bad_loss > 0

    # ------------------------------------------------------------------------------ the checks
    def check_(self, gathered: Gathered, scale: torch.Tensor, inv_scale: Optional[torch.Tensor], *, sync: bool,
               needs_amax: bool, bad_loss: Optional[torch.Tensor] = None) -> Flags:
        """Check (and unscale in place, by ``inv_scale``) the gathered gradients; return the reduced flags.

        ``inv_scale``: torch's ``1/scale`` (float32, rounded once from float64), or None: read-only
        (the fused-optimizer path).

        ``bad_loss``: the loss check's float32 0-dim value, NaN where a loss (or a traced forward
        output) was non-finite before scaling, else 0 (None: not checked); reduced with the others and
        folded into ``found_inf``.

        ``sync``: decide on the host now (one sync) and, on overflow only, classify inf vs NaN with a
        second read pass. Without ``sync`` the flags stay on device (read-only amax pass first).
        """
        device = scale.device
        unscale = inv_scale is not None
        groups = _kernels.group_grads(gathered.grads)
        params = gathered.params
        if len(groups) > 1 or any(len(per_dtype) > 1 for per_dtype in groups.values()):
            # The amax vectors come per (device, dtype) group: line the parameters up with them, or
            # overflow_report() names the wrong ones when dtypes interleave.
            owner = {id(g): p for g, p in zip(gathered.grads, gathered.params)}
            params = [owner[id(g)] for per_dtype in groups.values() for gs in per_dtype.values() for g in gs]
        if unscale:
            self._claim(gathered)
        nan_pending = False
        if unscale and sync and not needs_amax:
            # torch's fused check+unscale: one read+write pass. It cannot tell NaN from inf; that is
            # learned below, on the overflow path only.
            found = torch.zeros((), dtype=torch.float32, device=device)
            per_device = _kernels.check_and_unscale_(groups, inv_scale, found)
            found_inf = any_flag(per_device.values(), device)
            if _distributed.resolve_group(self.process_group) is None:
                # One process: the host reads the loss check with the decision (Flags.read); the device
                # flags with it folded in are made only if something asks for them (Flags.fold).
                flags = Flags(found_inf=found_inf, found_nan=found_inf, params=params, loss_check=bad_loss)
            else:
                flags = Flags(found_inf=None, found_nan=None, params=params)
                # Every rank must feed the policy the same flags: they ride in one collective.
                flags.found_inf, flags.found_nan, _, bad = self.reduce(found_inf, found_inf, None,
                                                                       None if bad_loss is None else _kernels.bad_loss_flag(bad_loss))
                self._with_bad_loss(flags, bad)
            nan_pending = True  # found_nan is a placeholder until an overflow is classified below
        else:
            # Read-only pass first (the flags, inf vs NaN, the amax, the names), then torch's kernel.
            vector, amax, amax_vectors = _kernels.read_only_check(groups, device, bad_loss, needs_amax)
            if unscale:
                _kernels.check_and_unscale_(groups, inv_scale, torch.zeros((), dtype=torch.float32, device=device))
            # Every rank must feed the policy the same flags and amax: they ride in one collective.
            vector, amax = self.reduce_vector(vector, amax)
            flags = Flags.from_vector(vector, amax, params=params, amax_vectors=amax_vectors)
        # Decided on reduced values only, so every rank takes the same path to the collective below.
        if sync and flags.read(needs_amax, nan_known=not nan_pending) and nan_pending:
            flags.amax_vectors, local = _kernels.amax_per_tensor(groups, device)
            _, flags.found_nan, _, _ = self.reduce(flags.found_inf, torch.isnan(local).float())
        return flags

    def clip_unscaled_(self, optimizer, max_norm: float, norm_type: float, norm_group: Any = None) -> torch.Tensor:
        """A disabled scaler's ``clip_grad_norm_``: torch's clip, or where the gradients are spread over
        ranks the same reduced norm as when enabled, at scale 1 (exact). Returns the norm."""
        gathered = self.gather(optimizer, allow_half=True, coalesce=True)
        reduce_norm, counted = _distributed.norm_reduction(gathered.all_params, gathered.params, norm_type, norm_group)
        if reduce_norm is None:
            return torch.nn.utils.clip_grad_norm_(gathered.all_params, max_norm, norm_type)
        one = torch.ones((), device=gathered.all_params[0].grad.device if gathered.all_params else "cpu")
        return _clip.clip_scaled_(gathered.grads, one, max_norm, norm_type, counted, reduce_norm)[0]

    def clip_(self, gathered: Gathered, scale: torch.Tensor, inv_scale: torch.Tensor, max_norm: float,
              norm_type: float, *, sync: bool,
              needs_amax: bool, bad_loss: Optional[torch.Tensor] = None, norm_group: Any = None):
        """Unscale and clip by the true norm (``lossscale._clip``); returns ``(true_norm, flags)``.

        Sharded gradients: the norm is reduced over ``norm_group`` or the DTensors' mesh
        (``lossscale.distributed.norm_reduction``), one collective before the flags' one.
        """
        reduce_norm, counted = _distributed.norm_reduction(gathered.all_params, gathered.params, norm_type, norm_group)
        self._claim(gathered)
        amax = None
        if needs_amax:
            # max|g| of the *scaled* gradients, taken before anything below rewrites them.
            _, amax = _kernels.amax_per_tensor(_kernels.group_grads(gathered.grads), scale.device)
        true_norm, vector, per_tensor, order = _clip.clip_scaled_(gathered.grads, scale, max_norm, norm_type,
                                                                  counted, reduce_norm, loss_check=bad_loss,
                                                                  inv_scale=inv_scale, host_reads=sync)
        vector, amax = self.reduce_vector(vector, amax)
        # overflow_report() reads one value per parameter: the per-tensor norm is NaN for a tensor
        # holding a NaN and inf for one holding an inf, so it serves as an amax vector.
        flags = Flags.from_vector(vector, amax, params=[gathered.params[i] for i in order],
                                  amax_vectors=[per_tensor] if order else [])
        if sync:
            flags.read(needs_amax, nan_known=True)
        return true_norm, flags


def any_flag(flags, device: torch.device) -> torch.Tensor:
    """The largest of 0/1 flag tensors, on ``device`` (1.0 when any is set); 0.0 for none. No sync.

    A maximum, not a sum: the result stays 0.0 or 1.0, as torch's fused optimizers require.
    """
    flags = [_kernels.to_device(f, device) for f in flags]
    if not flags:
        return torch.zeros((), dtype=torch.float32, device=device)
    total = flags[0]
    for f in flags[1:]:
        total = torch.maximum(total, f)
    return total
