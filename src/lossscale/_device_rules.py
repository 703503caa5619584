"""The policies' update rules on device tensors: no host sync, CUDA-graph friendly (in-place updates).

Each function here is the tensor form of a pure rule in :mod:`lossscale.policy`; the tests drive both
forms with the same random flag sequences and assert the states agree bitwise. Keep them in step.
"""

from __future__ import annotations

import weakref

import torch

from .adaptive import CALIBRATING, LIMIT_EXP, MAX_SHIFT, AdaptivePolicy
from .policy import NO_AMAX, DynamicPolicy, ScaleState, StaticPolicy

# Layout of the int64 counter vector: one tensor, so the shared bookkeeping is a handful of kernels
# whatever the number of counters, and the whole vector can be copied to the host in one transfer.
STEPS, SKIPPED, INF_STEPS, NAN_STEPS, STREAK, STREAK_NAN, HYSTERESIS, AMAX_EXP = range(8)
_N_COUNTERS = 8


class DeviceState:
    """A policy state held as device tensors (the scaler's source of truth once training starts).

    Attributes:
        scale: float32 0-dim tensor, as torch's GradScaler keeps it (so ``loss * scale`` is bitwise
            the same).
        growth_tracker: int32 0-dim tensor, torch's dtype, so ``torch._amp_update_scale_`` can run on it.
        counters: int64 vector, see the index constants above.
        streak_start_scale: float32 0-dim tensor, the scale when the current overflow streak began.
    """

    def __init__(self, state: ScaleState, device: torch.device):
        self.scale = torch.full((), state.scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.full((), state.growth_tracker, dtype=torch.int32, device=device)
        values = [0] * _N_COUNTERS
        values[STEPS], values[SKIPPED] = state.steps, state.skipped_steps
        values[INF_STEPS], values[NAN_STEPS] = state.inf_steps, state.nan_steps
        values[STREAK], values[STREAK_NAN] = state.overflow_streak, state.streak_nan_steps
        values[HYSTERESIS] = state.hysteresis_tracker
        values[AMAX_EXP] = state.amax_exp
        self.counters = torch.tensor(values, dtype=torch.int64, device=device)
        self.streak_start_scale = torch.full((), state.streak_start_scale, dtype=torch.float32, device=device)

    @property
    def device(self) -> torch.device:
        """Where the state lives."""
        return self.scale.device

    def snapshot(self) -> torch.Tensor:
        """Every field packed in one float64 vector, for a single device-to-host copy.

        float64 holds the float32 scales and any counter below 2**53 exactly.
        """
        return torch.cat(
            [
                torch.stack([self.scale, self.streak_start_scale]).double(),
                self.growth_tracker.double().reshape(1),
                self.counters.double(),
            ]
        )

    @staticmethod
    def from_snapshot(values) -> ScaleState:
        """The pure :class:`ScaleState` for a host copy of :meth:`snapshot` (a list of floats)."""
        c = [int(v) for v in values[3:]]
        return ScaleState(
            scale=float(values[0]),
            streak_start_scale=float(values[1]),
            growth_tracker=int(values[2]),
            steps=c[STEPS],
            skipped_steps=c[SKIPPED],
            inf_steps=c[INF_STEPS],
            nan_steps=c[NAN_STEPS],
            overflow_streak=c[STREAK],
            streak_nan_steps=c[STREAK_NAN],
            hysteresis_tracker=c[HYSTERESIS],
            amax_exp=c[AMAX_EXP],
        )

    def to_state(self) -> ScaleState:
        """The pure state. Syncs host and device (one transfer)."""
        return self.from_snapshot(self.snapshot().tolist())


def count_(st: DeviceState, found_inf: torch.Tensor, found_nan: torch.Tensor) -> None:
    """The shared bookkeeping alone (counters and streak), for an iteration whose scale is set by hand."""
    overflow = (found_inf > 0).to(torch.int64)
    _count_(st, overflow, (found_nan > 0).to(torch.int64) * overflow)


def _count_(st: DeviceState, overflow: torch.Tensor, nan: torch.Tensor) -> None:
    """Shared bookkeeping (policy._count) on device. ``overflow``/``nan``: int64 0/1 0-dim tensors."""
    # The streak starts at this iteration's scale when the previous streak length was 0.
    starts = overflow * (st.counters[STREAK] == 0)
    st.streak_start_scale.copy_(torch.where(starts.bool(), st.scale, st.streak_start_scale))
    one = torch.ones_like(overflow)
    st.counters[:STREAK_NAN + 1].add_(torch.stack([one, overflow, overflow - nan, nan, one, nan]))
    st.counters[STREAK:STREAK_NAN + 1].mul_(overflow)  # a clean step ends the streak


# The torch-compatible configuration (hysteresis 1) is the hot path of every iteration, and on a CPU
# each tiny op costs a few microseconds (more when it wraps a Python scalar), so its bookkeeping is
# one small matrix-vector product and one multiply-add over the whole counter vector:
#     v = [1, o, o*n]   (o: overflow, n: NaN, 0/1)        counters = counters * MUL(v) + ADD(v)
# with MUL and ADD linear in v (the rows of policy._count for clean, inf and NaN steps). When the
# host already knows the step was clean (it synced to decide it), the clean row is applied directly.


class _H1:
    """Constants and counter views of the hysteresis-1 path, made once per DeviceState."""

    def __init__(self, st: DeviceState, consecutive: bool):
        n = _N_COUNTERS
        mul = [[1] * n for _ in range(3)]  # rows: clean, inf, NaN
        add = [[0] * n for _ in range(3)]
        for k in range(3):
            add[k][STEPS] = 1
        mul[0][STREAK] = mul[0][STREAK_NAN] = 0  # a clean step ends the streak
        for k in (1, 2):
            add[k][SKIPPED] = add[k][STREAK] = 1
            mul[k][HYSTERESIS] = 0  # an overflow spends the single tolerance: max(1 - 1, 0)
        add[1][INF_STEPS] = 1
        add[2][NAN_STEPS] = add[2][STREAK_NAN] = 1
        if consecutive:  # DeepSpeed: every clean step refills
            mul[0][HYSTERESIS], add[0][HYSTERESIS] = 0, 1
        # Columns for v = [1, o, o*n]; float32 holds these small integers exactly.
        mat = [[mul[0][j], mul[1][j] - mul[0][j], 0] for j in range(n)]
        mat += [[add[0][j], add[1][j] - add[0][j], add[2][j] - add[1][j]] for j in range(n)]
        dev = st.device
        self.mat = torch.tensor(mat, dtype=torch.float32, device=dev)
        self.clean_mul = torch.tensor(mul[0], dtype=torch.int64, device=dev)
        self.clean_add = torch.tensor(add[0], dtype=torch.int64, device=dev)
        self.one = torch.ones((), dtype=torch.float32, device=dev)
        self.one_i = torch.ones((), dtype=torch.int64, device=dev)
        self.streak = st.counters[STREAK]
        self.hyst = st.counters[HYSTERESIS]
        # On CPU the counters are host memory: a numpy view reads them in place (made once: creating
        # it costs more than the read, and right after a large kernel every new object is cache-cold).
        self.host = st.counters.numpy() if st.counters.device.type == "cpu" else None
        self.tracker_host = st.growth_tracker.numpy() if self.host is not None else None  # a 0-d view


# Kept beside, not inside, each DeviceState: a copy of a state must not inherit views of the original.
_H1_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _h1(st: DeviceState, consecutive: bool) -> _H1:
    cache = _H1_CACHE.get(st)
    if cache is None:
        cache = _H1_CACHE[st] = {}
    h = cache.get(consecutive)
    if h is None:
        h = cache[consecutive] = _H1(st, consecutive)
    return h


def _dynamic_h1_update_(policy: DynamicPolicy, st: DeviceState, found_inf: torch.Tensor, found_nan: torch.Tensor,
                        known_clean: bool = False) -> None:
    """:func:`dynamic_update_` for hysteresis 1: ~12 small kernels, 2-4 when ``known_clean``, and on
    CPU a known-clean step is torch's update kernel plus a few in-place writes of host memory."""
    h = _h1(st, policy.consecutive_hysteresis)
    n = _N_COUNTERS
    if known_clean and h.host is not None:
        # The clean row, written in place: on CPU the counters are host memory (no kernel needed).
        c = h.host
        c[STEPS] += 1
        c[STREAK] = c[STREAK_NAN] = 0
        if policy.consecutive_hysteresis:
            c[HYSTERESIS] = 1
    elif known_clean:
        torch.addcmul(h.clean_add, st.counters, h.clean_mul, out=st.counters)
    else:
        # [1, o, o*n]: sign() makes the flags 0/1 (found_inf is a sum), cumprod counts a NaN only with an overflow.
        v = torch.stack([h.one, found_inf, found_nan.to(found_inf)]).sign_().cumprod_(0)
        rows = torch.mv(h.mat, v).to(torch.int64)
        torch.addcmul(rows[n:], st.counters, rows[:n], out=st.counters)
        # A streak of 1 began at this iteration, at the scale before this update.
        torch.where(torch.eq(h.streak, h.one_i), st.scale, st.streak_start_scale, out=st.streak_start_scale)
    # Hysteresis 1 backs off on every overflow, which is torch's own fused kernel: use it, so the
    # torch-compatible configuration is torch's arithmetic by construction.
    torch._amp_update_scale_(
        st.scale, st.growth_tracker, found_inf, policy.growth_factor, policy.backoff_factor, policy.growth_interval
    )
    if policy.min_scale is not None or policy.max_scale is not None:
        # The bounds as a clamp after the kernel equal the pure rule because the scale always
        # starts inside them: only a backoff can cross min and only a growth can cross max.
        st.scale.clamp_(policy.min_scale, policy.max_scale)
    if policy.consecutive_hysteresis:
        return
    if known_clean and h.host is not None:
        if h.host[HYSTERESIS] == 0 and h.tracker_host == 0:  # this clean step grew the scale: refill
            h.host[HYSTERESIS] = 1
        return
    # A growth refills the tolerance. The tracker is 0 after a growth or an overflow; the streak
    # (0 after a clean step) tells which, and both are >= 0, so "both 0" is "their sum is 0".
    grew = torch.logical_not(st.growth_tracker if known_clean else st.growth_tracker + h.streak)
    torch.maximum(h.hyst, grew, out=h.hyst)


def dynamic_update_(policy: DynamicPolicy, st: DeviceState, found_inf: torch.Tensor, found_nan: torch.Tensor,
                    known_clean: bool = False) -> None:
    """:meth:`DynamicPolicy.update` on device tensors, in place.

    ``found_inf`` / ``found_nan``: float32 0-dim tensors on ``st.device``, > 0 meaning true (torch's
    convention: found_inf is a sum of per-device flags). ``known_clean``: the host already knows
    found_inf is 0 (a shortcut; the result is the same).
    """
    if policy.hysteresis == 1:
        _dynamic_h1_update_(policy, st, found_inf, found_nan, known_clean)
        return
    overflow = (found_inf > 0).to(torch.int64)
    nan = (found_nan > 0).to(torch.int64) * overflow
    _count_(st, overflow, nan)
    hyst = st.counters[HYSTERESIS]
    ov = overflow.bool()
    spent = (hyst - 1).clamp_min(0)
    backoff = ov & (spent == 0)
    tracker = st.growth_tracker + 1
    grow = ~ov & (tracker >= policy.growth_interval)
    # Multiply in float64 and round once to float32, as torch's kernel does
    # (static_cast<float>(scale * factor) with double factors).
    down = (st.scale.double() * policy.backoff_factor).float()
    if policy.min_scale is not None:
        down = down.clamp_min(policy.min_scale)
    up = (st.scale.double() * policy.growth_factor).float()
    up_ok = grow & torch.isfinite(up)
    if policy.max_scale is not None:
        up = up.clamp_max(policy.max_scale)
    st.scale.copy_(torch.where(backoff, down, torch.where(up_ok, up, st.scale)))
    st.growth_tracker.copy_(torch.where(ov | grow, torch.zeros_like(tracker), tracker))
    keep = torch.full_like(hyst, policy.hysteresis) if policy.consecutive_hysteresis else hyst
    hyst.copy_(torch.where(ov, spent, torch.where(grow, torch.full_like(hyst, policy.hysteresis), keep)))


def static_update_(policy: StaticPolicy, st: DeviceState, found_inf: torch.Tensor, found_nan: torch.Tensor) -> None:
    """:meth:`StaticPolicy.update` on device tensors, in place: counters only."""
    overflow = (found_inf > 0).to(torch.int64)
    nan = (found_nan > 0).to(torch.int64) * overflow
    _count_(st, overflow, nan)
    st.growth_tracker.add_(1).mul_((1 - overflow).to(torch.int32))


def _shift(scale: torch.Tensor, k: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """``scale * 2**k`` clamped to [lo, hi], as float32: ``adaptive._shift`` on device.

    ``2**k`` is built from its float64 bit pattern (exact for any |k| <= 1022), and the product is taken
    in float64 where it cannot overflow or round, so the result is bitwise the host's ``math.ldexp``.
    """
    k = k.clamp(-MAX_SHIFT, MAX_SHIFT)
    pow2 = ((k + 1023) << 52).view(torch.float64)
    return (scale.double() * pow2).clamp(lo, hi).float()


def adaptive_update_(policy: AdaptivePolicy, st: DeviceState, found_inf: torch.Tensor, found_nan: torch.Tensor,
                     amax: torch.Tensor = None) -> None:
    """:meth:`AdaptivePolicy.update` on device tensors, in place, without a host sync.

    ``amax``: float32 0-dim tensor on ``st.device``, the max |g| of the scaled gradients (NaN/inf when
    they hold one), or None when not measured.
    """
    overflow = found_inf > 0
    nan = found_nan > 0
    no = torch.zeros((), dtype=torch.bool, device=st.device)
    if amax is None:
        measured = zero = no
        e = torch.zeros((), dtype=torch.int64, device=st.device)
    else:
        amax = amax.to(device=st.device, dtype=torch.float32)
        finite = torch.isfinite(amax)
        overflow = overflow | ~finite  # a non-finite amax is an overflow
        nan = nan | torch.isnan(amax)
        measured = ~overflow & (amax > 0)
        zero = ~overflow & (amax == 0)
        e = torch.frexp(amax)[1].to(torch.int64)  # amax < 2**e; meaningless unless measured
    nan = nan & overflow
    _count_(st, overflow.to(torch.int64), nan.to(torch.int64))
    lo, hi = policy.bounds()
    window, hyst = st.counters[AMAX_EXP], st.counters[HYSTERESIS]
    calibrating = window == CALIBRATING
    scale = st.scale
    # Before calibration: search on overflow / all-zero gradients, jump to the target on a measurement.
    target = LIMIT_EXP - policy.margin_bits - e
    searched = _shift(scale, torch.where(overflow, -policy.search_bits, policy.search_bits).to(torch.int64), lo, hi)
    cal_scale = torch.where(measured, _shift(scale, target, lo, hi), torch.where(overflow | zero, searched, scale))
    # After calibration: back off on overflow (hysteresis as dynamic), grow at the end of a clean window.
    spent = (hyst - 1).clamp_min(0)
    down = (scale.double() * policy.backoff_factor).float().clamp_min(lo)
    new_window = torch.where(measured, torch.maximum(window, e), window)
    tracker = st.growth_tracker + 1
    check = ~overflow & (tracker >= policy.growth_interval)
    k = LIMIT_EXP - policy.margin_bits - new_window
    grow = check & (new_window != NO_AMAX) & (k > 0)
    run_scale = torch.where(overflow, torch.where(spent == 0, down, scale),
                            torch.where(grow, _shift(scale, k, lo, hi), scale))
    st.scale.copy_(torch.where(calibrating, cal_scale, run_scale))
    st.growth_tracker.copy_(torch.where(calibrating | overflow | check, torch.zeros_like(tracker), tracker))
    keep = torch.full_like(hyst, policy.hysteresis) if policy.consecutive_hysteresis else hyst
    run_hyst = torch.where(overflow, spent, torch.where(check, torch.full_like(hyst, policy.hysteresis), keep))
    hyst.copy_(torch.where(calibrating, hyst, run_hyst))
    empty = torch.full_like(window, NO_AMAX)
    cal_window = torch.where(measured, empty, window)
    run_window = torch.where(overflow | check, empty, new_window)
    window.copy_(torch.where(calibrating, cal_window, run_window))


_RULES = {DynamicPolicy: dynamic_update_, StaticPolicy: static_update_, AdaptivePolicy: adaptive_update_}


def register_rule(policy_type, rule) -> None:
    """Register the device form of a new policy type (its pure form is the policy's ``update``)."""
    _RULES[policy_type] = rule


def device_update_(policy, st: DeviceState, found_inf: torch.Tensor, found_nan: torch.Tensor, known_clean: bool = False,
                   **extra) -> None:
    """Dispatch to the device rule of ``policy``'s type.

    ``known_clean``: the host knows this iteration was clean; rules that can use it take a shortcut
    (the dynamic rule does), others ignore it.
    """
    try:
        rule = _RULES[type(policy)]
    except KeyError:
        raise TypeError(
            f"no device rule for policy type {type(policy).__name__}; register one with "
            "lossscale._device_rules.register_rule."
        ) from None
    if known_clean and rule is dynamic_update_:
        extra["known_clean"] = True
    rule(policy, st, found_inf, found_nan, **extra)
