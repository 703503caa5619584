"""Issue 22's budgets per clean iteration, counted as a CUDA run sees them (the stand-in device).

Launches and syncs of the scaler's share of one clean iteration after warm-up
(``tests/_iterations.count_iteration``: scale, optional clip, step with the optimizer's own kernels,
update), lossscale at its default settings against ``torch.amp.GradScaler("cuda")`` on the same model.

Where the host decides the step (SGD, Adam foreach), the host runs the policy's pure rule and sends the
state in one copy, with torch's inverse scale in it (``unscale_`` reads it instead of computing it):
every budget holds. Where the flags stay on device (fused optimizers), the read-only check's
``_foreach_norm`` is four launches on CUDA (two workspace fills, the kernel, a cleanup: the counter
models them) where torch's check is one, and the tensor rule costs a kernel per elementwise op: no
fused budget is met yet (``xfail(strict=True)`` with the measured counts in the reason, so the day one
is met the test says so, and ratchets at today's counts). ``docs/performance.md`` has the whole table.
"""

from __future__ import annotations

import pytest

from _fake_cuda import fake_cuda, twin_graphed_rules
from _iterations import count_iteration

SYNCED = ["sgd", "sgd_loop", "sgd_momentum", "adam"]
FUSED = ["fused_adam", "fused_sgd"]


def _counts(optimizer, **settings):
    with fake_cuda():
        ours = count_iteration("lossscale", optimizer, **settings)
        ref = count_iteration("torch", optimizer, clip=settings.get("clip"))
    return ours, ref


@pytest.mark.parametrize("optimizer", SYNCED)
def test_default_dynamic_costs_at_most_torch_plus_5_launches_and_torchs_syncs(optimizer):
    ours, ref = _counts(optimizer)
    assert ours.launches <= ref.launches + 5 and ours.syncs <= ref.syncs, (ours.launch_ops, ref.launch_ops)


@pytest.mark.parametrize("optimizer", SYNCED)
def test_the_host_sent_inverse_makes_the_synced_default_cheaper_than_torch(optimizer):
    """Where the host ran the rule it also sent torch's inverse scale, so ``unscale_`` launches none
    of the three kernels torch spends on it (cast, reciprocal, cast): a clean iteration at the default
    settings, loss check included, costs at least five launches fewer than torch's (the loss check has
    no kernel of its own: the read adds ``loss * 0`` to the decision, one ``addcmul``). Kills: the
    inverse computed on device again, the loss check's ``x - x`` back at ``scale()`` or turned into a
    bit first (``isnan``: one more each), and device flags made on a path where the host reads the
    decision (folding the loss check in: 3 more)."""
    ours, ref = _counts(optimizer)
    assert ours.launches <= ref.launches - 5 and ours.syncs == ref.syncs, (ours.launch_ops, ref.launch_ops)


@pytest.mark.parametrize("optimizer", SYNCED)
@pytest.mark.parametrize("policy", ["adaptive", "logmax"])
def test_measuring_policies_cost_at_most_torch_plus_16(optimizer, policy):
    ours, ref = _counts(optimizer, policy=policy)
    assert ours.launches <= ref.launches + 16 and ours.syncs <= ref.syncs, ours.launch_ops


@pytest.mark.parametrize("optimizer", SYNCED)
def test_hysteresis_2_costs_at_most_torch_plus_8(optimizer):
    ours, ref = _counts(optimizer, hysteresis=2)
    assert ours.launches <= ref.launches + 8 and ours.syncs <= ref.syncs, ours.launch_ops


@pytest.mark.parametrize("optimizer", SYNCED + FUSED)
@pytest.mark.parametrize("telemetry", [1, {"every": 1, "per": "param"}, {"every": 1, "per": "module"}])
def test_metrics_is_one_sync_whatever_the_telemetry_grouping(optimizer, telemetry):
    with fake_cuda():
        with_metrics = count_iteration("lossscale", optimizer, telemetry=telemetry, metrics=True)
        without = count_iteration("lossscale", optimizer, telemetry=telemetry)
    assert with_metrics.syncs - without.syncs == 1


@pytest.mark.parametrize("optimizer", SYNCED)
def test_clip_costs_at_most_torchs_unscale_and_clip(optimizer):
    ours, ref = _counts(optimizer, clip=1.0)
    assert ours.launches <= ref.launches and ours.syncs <= ref.syncs, (ours.launch_ops, ref.launch_ops)


@pytest.mark.xfail(strict=True, reason="not met yet on the fused path: clip_grad_norm_ with fused Adam costs 31 "
                                       "launches, torch's unscale_ + clip_grad_norm_ 24; fused SGD 29, torch 22 "
                                       "(the default rule's 7 against torch's 1, the clip's 6 against 4: the "
                                       "true norm, the unscale folded in; stand-in, 2026-12-02)")
@pytest.mark.parametrize("optimizer", FUSED)
def test_fused_clip_costs_at_most_torchs_unscale_and_clip(optimizer):
    ours, ref = _counts(optimizer, clip=1.0)
    assert ours.launches <= ref.launches and ours.syncs <= ref.syncs


@pytest.mark.xfail(strict=True, reason="not met yet on the fused path: fused Adam 20 launches against torch's 12, "
                                       "fused SGD 18 against 10 (the read-only check's _foreach_norm is 4 on "
                                       "CUDA, the check 9 against torch's 2; stand-in, 2026-12-02)")
@pytest.mark.parametrize("optimizer", FUSED)
def test_fused_default_dynamic_costs_at_most_torch_plus_5(optimizer):
    ours, ref = _counts(optimizer)
    assert ours.launches <= ref.launches + 5, ours.launch_ops


#: Launches over torch's on the fused path, measured on the stand-in (2026-12-02) with
#: ``_foreach_norm``'s four CUDA launches counted, over their budgets (default: + 5; hysteresis=2: + 8;
#: adaptive, LogMax: + 16; clip: torch's unscale_ + clip): ratchets, so they can only go down.
FUSED_MEASURED = {"default": ({}, 8), "hysteresis": ({"hysteresis": 2}, 14), "adaptive": ({"policy": "adaptive"}, 43),
                  "logmax": ({"policy": "logmax"}, 51), "clip": ({"clip": 1.0}, 7)}


@pytest.mark.parametrize("optimizer", FUSED)
@pytest.mark.parametrize("setting", sorted(FUSED_MEASURED))
def test_the_fused_paths_cost_no_more_than_measured(optimizer, setting):
    """Default: fused Adam 20 against torch's 12, fused SGD 18 against 10: the read-only check is the
    amax pass (``_foreach_norm``: 4 on CUDA) and five kernels (``_kernels.read_only_check``: cat, mul,
    ne, mv, clamp), the update the counters' three, the bad loss's tracker hold (two), torch's kernel
    and the bounds' clamp. Kills: the flags' float conversion back as its own kernel, the counters in
    more than three kernels, "overflow and not a bad loss" computed in the rule again instead of read
    from the flags (``SCALE_OVERFLOW``), the loss check's ``* 0`` as a kernel of its own, a policy's
    writes back to ``copy_(where(...))`` (``where(..., out=)`` is one kernel), the adaptive rule
    shifting the scale three times where it needs one, LogMax's fills out of place (a copy each)."""
    settings, over = FUSED_MEASURED[setting]
    ours, ref = _counts(optimizer, **settings)
    assert ours.launches <= ref.launches + over, ours.launch_ops


def test_fused_paths_make_no_sync():
    for optimizer in FUSED:
        for settings in ({}, {"policy": "adaptive"}, {"hysteresis": 2}, {"clip": 1.0}):
            ours, _ = _counts(optimizer, **settings)
            assert ours.syncs == 0, (optimizer, settings)


#: The fused budgets over torch's launches: default + 5, hysteresis=2 + 8, adaptive and LogMax + 16.
FUSED_BUDGETS = {"default": ({}, 5), "hysteresis": ({"hysteresis": 2}, 8), "adaptive": ({"policy": "adaptive"}, 16),
                 "logmax": ({"policy": "logmax"}, 16)}


@pytest.mark.parametrize("optimizer", FUSED)
@pytest.mark.parametrize("setting", sorted(FUSED_BUDGETS))
def test_with_graphed_rules_the_fused_budgets_hold_as_modelled(optimizer, setting):
    """With ``LOSSSCALE_GRAPHED_RULES=1`` (off by default: no GPU has verified it) the rule is one graph
    launch after a copy per input, so each fused budget holds: fused Adam 15 / 15 / 17 / 17 against
    torch's 12 (fused SGD 13 / 13 / 15 / 15 against 10; stand-in, 2026-12-02). A model: the twin
    (``_fake_cuda.TwinGraphedCall``) counts a replay as the one launch a GPU sees; ``gpu_check``'s
    ``graph_rule`` step measures the real one. The clip stays over (26 against 24: its own arithmetic
    is not replayed), ratcheted at + 2."""
    settings, over = FUSED_BUDGETS[setting]
    with fake_cuda(), twin_graphed_rules() as twin:
        ours = count_iteration("lossscale", optimizer, **settings)
        ref = count_iteration("torch", optimizer)
        clip = count_iteration("lossscale", optimizer, clip=1.0)
        ref_clip = count_iteration("torch", optimizer, clip=1.0)
    assert twin.replays > 0 and ours.syncs == 0 and "cudaGraphLaunch (twin)" in ours.launch_ops
    assert ours.launches <= ref.launches + over, ours.launch_ops
    assert clip.launches <= ref_clip.launches + 2, clip.launch_ops
