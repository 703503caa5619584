"""Distributed skip decisions: every rank skips or steps together (gloo on CPU, two ranks on loopback).

The ranks are spawned once for the module (tests/_dist_workers.py) and run one scenario per test.
Every wait is bounded (process-group timeout, per-scenario deadline), so a hang fails the test.
The ``process_group=None`` cases are the proof that these tests can fail: without the reduction the
ranks visibly diverge.
"""

import importlib.util
import math

import pytest
import torch
import torch.distributed as dist

import lossscale
from lossscale import distributed as lsd

pytestmark = pytest.mark.distributed

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)
HAVE_STATS = importlib.util.find_spec("lossscale.stats") is not None  # reduce_stats needs it
needs_stats = pytest.mark.skipif(not HAVE_STATS, reason="lossscale.stats is not in this tree")


@pytest.fixture(scope="module")
def run():
    """run(scenario, **kwargs) -> per-rank results; (re)starts the two-rank pool when needed."""
    from _dist_workers import WorkerPool

    holder = {}

    def _run(scenario, **kwargs):
        pool = holder.get("pool")
        if pool is None or not pool.alive:
            pool = holder["pool"] = WorkerPool(world_size=2)
        return pool.run(scenario, **kwargs)

    yield _run
    if holder.get("pool") is not None:
        holder["pool"].close()


# ----------------------------------------------------------------------------------------- DDP
@needs_gloo
@pytest.mark.parametrize("kind", ["sgd_clip", "fused_adam", "two_optimizers"])
def test_ddp_inf_on_one_rank_every_rank_skips(run, kind):
    r0, r1 = run("ddp", kind=kind, reduce=True)
    for step, (a, b) in enumerate(zip(r0["record"], r1["record"])):
        assert a["skipped"] == b["skipped"] == (step in (2, 4)), step  # planted on rank 1, then on both
        assert a["scale"] == b["scale"], step
        assert a["changed"] == b["changed"], step
        if kind == "two_optimizers" and step in (2, 4):
            # Only the second optimizer's gradients were bad: it skips, the first still steps.
            assert a["changed"] == [True, True, False, False], step
        else:
            assert all(a["changed"]) != a["skipped"], step
    assert r0["params"] == r1["params"]  # bitwise
    # inf on one rank and NaN on the other: NaN dominates, on every rank (the flags are kept apart).
    assert r0["counters"] == r1["counters"]
    assert r0["counters"]["inf_steps"] == 1 and r0["counters"]["nan_steps"] == 1
    assert r0["consistency"] is None and r1["consistency"] is None
    # The cost: one all-reduce per optimizer; a second one only for an optimizer that overflowed on the
    # host-decided path (to tell NaN from inf); the fused path learns both at once, on device.
    per_step = [a["collectives"] for a in r0["record"]]
    expected = {"sgd_clip": [1, 1, 2, 1, 2, 1], "fused_adam": [1] * 6, "two_optimizers": [2, 2, 3, 2, 3, 2]}[kind]
    assert per_step == expected


@needs_gloo
@pytest.mark.parametrize("optimizer", ["sgd", "fused_adam"])
def test_a_bad_loss_on_one_rank_and_an_overflow_on_another_hold_the_scale(run, optimizer):
    """The reduced flags say "overflow, and a bad loss": the scale holds on every rank, on the host's
    path (SGD) and on the device's (fused Adam, whose "overflow and not a bad loss" is made again after
    the MAX: a MAX of the ranks' own would back off). Kills: that entry reduced instead of re-made."""
    r0, r1 = run("bad_loss_elsewhere", optimizer=optimizer)
    assert [a["skipped"] for a in r0["record"]] == [b["skipped"] for b in r1["record"]] == [False, True, False]
    assert [a["scale"] for a in r0["record"]] == [b["scale"] for b in r1["record"]] == [2.0**10] * 3
    assert r0["counters"] == r1["counters"] and r0["counters"]["bad_loss_steps"] == 1


@needs_gloo
@pytest.mark.parametrize("kind", ["sgd_clip", "fused_adam"])
def test_ddp_without_reduction_ranks_diverge(run, kind):
    # The same run with process_group=None: rank 1 skips step 2 alone. This is what the reduction
    # prevents, and the proof that the test above can fail.
    r0, r1 = run("ddp", kind=kind, reduce=False)
    assert not r0["record"][2]["skipped"] and r1["record"][2]["skipped"]
    assert r0["record"][2]["scale"] != r1["record"][2]["scale"]
    assert r0["params"] != r1["params"]
    assert r0["counters"]["nan_steps"] == 0 and r1["counters"]["nan_steps"] == 1  # each saw only its own
    for r in (r0, r1):  # the debug check catches it on every rank, naming every rank's value
        message = r["consistency"]
        assert message is not None and "scale: rank 0: 1024.0, rank 1: 256.0" in message, message
        assert "growth_tracker: rank 0:" in message and "process_group='default'" in message


# ---------------------------------------------------------------------------------------- FSDP2
@needs_gloo
@pytest.mark.parametrize("optimizer, clip, steps", [("adam", True, 100), ("fused_adam", False, 30)])
def test_fsdp2_local_shard_inf_and_random_injections(run, optimizer, clip, steps):
    r0, r1 = run("fsdp", steps=steps, rate=0.08, optimizer=optimizer, clip=clip, telemetry=HAVE_STATS)
    assert r0["grads_are_dtensors"] and r1["grads_are_dtensors"]
    assert r0["empty_local_shards"] + r1["empty_local_shards"] >= 1  # an empty shard was exercised
    rec0, rec1 = r0["record"], r1["record"]
    # Step 1: inf in rank 1's local shard only: both skip.
    assert rec0[1]["planted"] == ["", "inf"] and rec0[1]["skipped"] and rec1[1]["skipped"]
    planted_steps = [s for s, e in enumerate(rec0) if any(e["planted"])]
    assert len(planted_steps) >= 3
    assert any(e["planted"].count("") == 1 for e in rec0[2:])  # some later step planted on one rank only
    for step, (a, b) in enumerate(zip(rec0, rec1)):
        assert a["skipped"] == b["skipped"] == a["ref_skipped"] == bool(any(a["planted"])), step
        assert a["scale"] == b["scale"] == a["ref_scale"], step
    assert r0["counters"] == r1["counters"] == r0["ref_counters"]
    assert r0["params"] == r1["params"] and r0["finite"]
    # The same model trained unsharded in one process: FSDP2's reduce-scatter and the sharded clip
    # round differently, so close rather than bitwise.
    assert r0["max_param_diff"] < 1e-4
    assert r0["consistency"] is None and r1["consistency"] is None
    if not HAVE_STATS:
        return
    # Telemetry on local shards, reduced: the figures of the whole gradient, on every rank.
    t, ref = r0["telemetry"], r0["ref_telemetry"]
    assert r1["telemetry"] == t
    assert t["numel"] == ref["numel"] == 8 * 16 + 16 + 16 * 8 + 8 + 8 + 1
    assert t["amax"] == pytest.approx(ref["amax"], rel=1e-5)
    assert t["zeros"] == ref["zeros"] and t["inf"] == t["nan"] == 0
    # The scaler's telemetry does the same by itself (DTensor gradients: reduce="auto" sums).
    (mine, whole), (mine1, _) = r0["scaler_telemetry"], r1["scaler_telemetry"]
    assert mine == mine1
    for key in ("grad/numel", "grad/zeros", "grad/flushed", "grad/subnormal", "grad/overflow"):
        assert mine[key] == whole[key] == t[key.split("/")[1]], key
    assert mine["grad/amax"] == pytest.approx(whole["grad/amax"], rel=1e-5)


# ------------------------------------------------------------------------------------- pipeline
@needs_gloo
def test_pipeline_stages_with_different_parameters_stay_consistent(run):
    r0, r1 = run("pipeline", steps=40, rate=0.1)
    rec0, rec1 = r0["record"], r1["record"]
    assert any(e["planted"] == ["inf", ""] or e["planted"] == ["nan", ""] for e in rec0)  # first stage alone
    assert any(e["planted"][0] == "" and e["planted"][1] for e in rec0)  # last stage alone
    for step, (a, b) in enumerate(zip(rec0, rec1)):
        assert a["skipped"] == b["skipped"] == a["ref_skipped"] == bool(any(a["planted"])), step
        assert a["scale"] == b["scale"] == a["ref_scale"], step
    assert r0["counters"] == r1["counters"] == r0["ref_counters"]
    # Each stage's parameters match the same network trained in one process.
    assert r0["max_param_diff"] < 1e-6 and r1["max_param_diff"] < 1e-6
    assert r0["unused_untouched"]
    assert r0["consistency"] is None


# ------------------------------------------------------------------------------------- adaptive
@needs_gloo
@pytest.mark.parametrize("optimizer", ["sgd", "fused_adam"])
def test_adaptive_policy_reduces_the_global_amax_in_one_collective(run, optimizer):
    # The ranks own different parameters whose gradient amax differ by binades, so an adaptive scaler
    # on each rank would calibrate and grow differently if it saw only its own amax.
    r0, r1 = run("adaptive", steps=40, rate=0.1, optimizer=optimizer)
    rec0, rec1 = r0["record"], r1["record"]
    assert rec0[1]["planted"] == ["", "inf"]  # step 1: an inf on rank 1 only
    assert any(e["planted"][0] and not e["planted"][1] for e in rec0)  # and on rank 0 only
    assert any("nan" in e["planted"] for e in rec0)  # a NaN amax too
    # Either rank holds the global max at some step: a MAX that kept one rank's value would fail.
    assert any(e["local_amax"][0] > 2 * e["local_amax"][1] for e in rec0)
    assert any(e["local_amax"][1] > 2 * e["local_amax"][0] for e in rec0)
    for step, (a, b) in enumerate(zip(rec0, rec1)):
        assert a["skipped"] == b["skipped"] == a["ref_skipped"] == bool(any(a["planted"])), step
        # The single-process references see the global amax: the reduced amax must be that max.
        assert a["scale"] == b["scale"] == a["ref_scale"] == a["pure_scale"], step
        # One all-reduce per check, clean or overflow, host- or device-decided (it was two).
        assert a["collectives"] == b["collectives"] == 1, step
        # A rank's NaN/inf amax is sent as 0: its flags, exact 0/1 values, carry the overflow.
        assert a["sent_finite"] and b["sent_finite"], step
    scales = [e["scale"] for e in rec0]
    moves = [b - a for a, b in zip(scales, scales[1:])]
    assert any(m > 0 for m in moves) and any(m < 0 for m in moves)  # it grew and backed off
    assert r0["counters"] == r1["counters"] == r0["ref_counters"] == r0["pure_counters"]
    assert r0["params_equal"] and r1["params_equal"]  # each rank's parameters: bitwise the reference's
    assert r0["consistency"] is None and r1["consistency"] is None


@needs_gloo
@pytest.mark.parametrize("optimizer", ["sgd", "fused_adam"])
def test_adaptive_policy_takes_the_largest_amax_of_the_ranks_not_their_sum(run, optimizer):
    # The ranks' amax are alike (same binade give or take one), so a sum of them lands a binade above
    # their maximum at some steps: the scale must still be the single-process one, which sees the max.
    r0, r1 = run("adaptive", steps=24, rate=0.0, optimizer=optimizer, spread=0)
    rec0, rec1 = r0["record"], r1["record"]
    sums_a_binade_up = [
        s
        for s, e in enumerate(rec0)
        if not any(e["planted"])
        and math.floor(math.log2(sum(e["local_amax"]))) > math.floor(math.log2(max(e["local_amax"])))
    ]
    assert len(sums_a_binade_up) >= 4, sums_a_binade_up  # the case this test is about does occur
    for step, (a, b) in enumerate(zip(rec0, rec1)):
        assert a["scale"] == b["scale"] == a["ref_scale"] == a["pure_scale"], (step, a["scale"], a["ref_scale"])
        assert a["skipped"] == b["skipped"] == a["ref_skipped"], step
    assert r0["counters"] == r1["counters"] == r0["ref_counters"]
    assert r0["params_equal"] and r1["params_equal"]


@needs_gloo
def test_adaptive_policy_without_reduction_ranks_diverge(run):
    # The same run with process_group=None: each rank calibrates to its own amax and skips alone.
    r0, r1 = run("adaptive", steps=40, rate=0.1, reduce=False)
    first = next(s for s, (a, b) in enumerate(zip(r0["record"], r1["record"])) if a["scale"] != b["scale"])
    assert first == 0  # the calibration step already differs: different local amax
    assert not r0["record"][1]["skipped"] and r1["record"][1]["skipped"]
    assert all(e["collectives"] == 0 for e in r0["record"])
    for r in (r0, r1):
        assert r["consistency"] is not None and "scale: rank 0:" in r["consistency"]


@needs_gloo
@pytest.mark.parametrize("passthrough, optimizer", [(False, "sgd"), (True, "sgd"), (False, "fused_adam")])
def test_rank_without_gradients_joins_every_collective(run, passthrough, optimizer):
    # Rank 0 has no gradient at all. It must still make every collective the other rank makes (a
    # missing or extra one would leave a rank waiting until the process-group timeout).
    r0, r1 = run("no_grads", passthrough=passthrough, optimizer=optimizer)
    assert [e["skipped"] for e in r0["record"]] == [e["skipped"] for e in r1["record"]] == [False, True, True, False]
    assert r0["record"] == r1["record"]
    assert r0["counters"] == r1["counters"]
    assert r0["counters"]["inf_steps"] == 1 and r0["counters"]["nan_steps"] == 1
    assert r0["consistency"] is None


@needs_gloo
@pytest.mark.parametrize("per", [None, "param", "module"])
def test_telemetry_with_a_rank_holding_only_empty_shards(run, per):
    # The sharded/reduce decision comes from the parameters (DTensors on every rank), not from a
    # rank's own gradients: rank 1 holds nothing, yet joins the same collectives with the same names.
    r0, r1 = run("fsdp_empty_rank", per=per)
    assert r0["local_numel"] == 5 and r1["local_numel"] == 0
    assert r0["figures"] == r1["figures"]
    for f in r0["figures"]:
        assert f["numel"] == f["whole_numel"] == 5
        if per is not None:
            assert f["per_group"] and sum(f["per_group"].values()) == 5, f


@needs_gloo
@needs_stats
def test_reduce_stats_of_shards_equals_stats_of_the_whole(run):
    r0, r1 = run("stats")
    for r in (r0, r1):
        for key in ("one@1.0", "one@1024.0", "dict"):
            reduced, whole = r[key]
            assert reduced == whole, key  # every figure and the histogram, exactly
        assert r["at"][0] == r["at"][1]
        assert r["mismatch"] is not None and "different statistics" in r["mismatch"]
    assert r0["one@1.0"][1]["nan"] == 1 and r0["one@1.0"][1]["flushed"] > 0  # the specials were counted


# ------------------------------------------------------------------------------- groups, checks
@needs_gloo
def test_group_resolution_and_an_explicit_group(run):
    r0, r1 = run("groups")
    assert r0["resolved"] == r1["resolved"] == dict(default_is_world=True, none_is_none=True, subgroup=True)
    assert r0["skipped"] == r1["skipped"] == [False, True, False]
    assert r0["scale"] == r1["scale"]
    assert r0["consistency_on_group"] is None
    # A group of one rank each: the NaN pass stays within it (kills that pass reducing over the world).
    assert r0["alone"] == dict(inf_steps=1, nan_steps=0) and r1["alone"] == dict(inf_steps=0, nan_steps=1)


@needs_gloo
def test_a_reason_seen_on_one_rank_skips_every_rank_of_the_scalers_group_only(run):
    r0, r1 = run("one_rank_reasons")
    # A spike on rank 0 alone (skip_if reads each rank's own gradients) skips both ranks.
    assert r0["spike_skipped"] == r1["spike_skipped"] == [False, True, False]
    assert r0["spike_counters"] == r1["spike_counters"]
    assert r0["spike_counters"]["spike_steps"] == 1 and r0["spike_counters"]["skipped_steps"] == 0
    # Each rank alone in its group: rank 0's inf skips rank 0 only.
    assert r0["alone_skipped"] is True and r1["alone_skipped"] is False
    # Replicated gradients: each rank's figures are its own (the same on both), never summed.
    assert r0["numel"] == r1["numel"] == r0["model_numel"]
    assert r0["figures"] == r1["figures"]


@needs_gloo
def test_check_consistency_names_every_rank_value(run):
    r0, r1 = run("diverged")
    for r in (r0, r1):
        assert r["message"].startswith("lossscale.GradScaler state differs across the 2 ranks")
        assert "scale: rank 0: 1024.0, rank 1: 2048.0" in r["message"]


@needs_gloo
def test_torchrun_example_trains_and_skips_together(run):
    r0, r1 = run("example", steps=12, inject_at=7)
    assert r0["counters"] == r1["counters"] and r0["scale"] == r1["scale"]
    assert r0["counters"]["skipped_steps"] == 1 and r0["counters"]["inf_steps"] == 1
    assert any(line.startswith("step   7") and "skipped True" in line for line in r0["lines"]), r0["lines"]
    assert r1["lines"] == []  # only rank 0 prints


# ----------------------------------------------------------------------- single process, no spawn
def test_process_group_argument_is_validated():
    with pytest.raises(ValueError, match=r"process_group='world' is not a process group.*'default'.*None"):
        lossscale.GradScaler(process_group="world")
    # What torch.distributed takes as a group is taken: None, "default", the sentinel new_group() gives
    # the ranks outside the group, and a stand-in with a group's rank() and size() (torch's sharded-scaler
    # tests pass one); a stand-in that is not a ProcessGroup reduces nothing.
    from torch.distributed.distributed_c10d import GroupMember

    class StandIn:
        def rank(self):
            return 0

        def size(self):
            return 1

    for group in (None, "default", GroupMember.NON_GROUP_MEMBER, StandIn()):
        assert lossscale.GradScaler(process_group=group).process_group is group
    # Anything else is refused when the scaler is built, naming what to pass.
    for wrong in (5, 1.0, True, object(), b"default"):
        with pytest.raises(ValueError, match=r"process_group=.* is not a process group; pass 'default'.*None.*group"):
            lossscale.GradScaler(process_group=wrong)
        with pytest.raises(ValueError, match=r"is not a process group"):
            lossscale.ShardedGradScaler(process_group=wrong)


def test_helpers_without_torch_distributed_initialised():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("torch.distributed is initialised in this process")
    scaler = lossscale.GradScaler("cpu", init_scale=2.0**8)
    assert lsd.reduction_group(scaler) is None
    assert lsd.check_consistency(scaler).scale == 2.0**8  # nothing to compare: the local state
    with pytest.raises(ValueError, match="takes a lossscale.GradScaler"):
        lsd.check_consistency(torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="group=.* must be None"):
        lsd.check_consistency(scaler, group="world")
    with pytest.raises(ValueError, match="device='gpu0' is not a device"):
        lsd.init_stage(scaler, "gpu0")


@needs_stats
def test_reduce_stats_validation_in_one_process():
    from lossscale.stats import grad_stats

    s = grad_stats([torch.ones(3)])
    assert lsd.reduce_stats(s) is s  # one process: nothing to reduce
    with pytest.raises(ValueError, match="not GradStats"):
        lsd.reduce_stats([s, torch.ones(3)])
    with pytest.raises(ValueError, match="stats must be a GradStats"):
        lsd.reduce_stats(torch.ones(3))


def test_init_stage_lets_a_stage_without_a_loss_unscale_and_step():
    # A first pipeline stage: gradients arrive already scaled, no scale() call on this rank.
    scaler = lossscale.GradScaler(init_scale=4.0)
    p = torch.ones(2, requires_grad=True)
    opt = torch.optim.SGD([p], lr=1.0)
    with pytest.raises(RuntimeError, match="before scale"):
        scaler.unscale_(opt)
    lsd.init_stage(scaler, "cpu")
    lsd.init_stage(scaler, torch.device("cpu"))  # idempotent
    p.grad = torch.full((2,), 4.0)  # d(loss)/dp = 1, times the scale
    scaler.unscale_(opt)
    assert p.grad.tolist() == [1.0, 1.0]
    scaler.step(opt)
    scaler.update()
    assert p.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="already runs on cpu"):
        lsd.init_stage(scaler, "meta")
