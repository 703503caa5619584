"""Sharded gradients: the true norm under FSDP2, tensor parallelism, a 2-D mesh of both, pipeline
stages and FSDP1, against torch's own recipe on the same gradients (gloo on CPU, loopback).

The scenarios live in tests/_mesh_workers.py. Two pools are spawned once for the module, of two
and of four ranks; the four-rank scenario runs all its checks in one call. Every wait is bounded
(process-group timeout, per-scenario deadline), so a hang fails the test.
"""

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

# Where torch reduces a DTensor norm one mesh dim at a time (x**p, SUM, **(1/p) per dim) and
# lossscale in one all-reduce over the mesh, or where one process sums the squares of every stage's
# norms while the stages reduce their partial sums, the same gradients give totals that differ in
# the last bits: compare those to a few float32 ulps (eps = 1.2e-7; x**3 and x**(1/3) add some).
ROUNDING = dict(rtol=1e-6, atol=0.0)


@pytest.fixture(scope="module")
def run():
    """run(world_size, scenario, **kwargs) -> per-rank results; starts (and restarts) the pools."""
    from _dist_workers import WorkerPool

    pools = {}

    def _run(world_size, scenario, **kwargs):
        pool = pools.get(world_size)
        if pool is None or not pool.alive:
            pool = pools[world_size] = WorkerPool(world_size=world_size, scenarios="_mesh_workers")
        return pool.run(scenario, timeout_s=240.0, **kwargs)

    yield _run
    for pool in pools.values():
        pool.close()


def _same_on_every_rank(results, key):
    values = [r[key] for r in results]
    assert all(v == values[0] for v in values), (key, values)
    return values[0]


# --------------------------------------------------------------------------- the norm: FSDP2, TP
def _check_clip_run(per_rank, norm_type, faults=True):
    """clip_vs_torch's records for one norm type, from every rank: lossscale's one call is torch's recipe."""
    records = [r[norm_type]["record"] for r in per_rank]
    for step, entries in enumerate(zip(*records)):
        first = entries[0]
        fault = any(e["planted"] for e in entries)
        for e in entries:
            assert e["norm_is_plain"], (norm_type, step)
            assert e["skipped"] == e["ref_skipped"] == fault, (norm_type, step)
            assert e["scale"] == e["ref_scale"] == first["scale"], (norm_type, step)
            assert e["norm"] == first["norm"] or fault, (norm_type, step)  # one norm on every rank
            if fault:  # non-finite on every rank, as torch's, a fault in a Replicate copy included
                assert not math.isfinite(e["norm"]) and math.isnan(e["norm"]) == math.isnan(e["ref_norm"]), step
            else:
                # torch all-reduces the vector of per-tensor norms (per mesh dim), lossscale each
                # rank's total in one all-reduce: the same norm to rounding, and the norm of the
                # whole gradients gathered into one process.
                torch.testing.assert_close(e["norm"], e["ref_norm"], **ROUNDING)
                torch.testing.assert_close(e["norm"], e["whole"], **ROUNDING)
                assert e["grad_diff"] <= ROUNDING["rtol"], (norm_type, step)  # the clip coefficient's ulp
            assert e["param_diff"] <= 1e-6, (norm_type, step)  # after skips and steps alike
    counters = [r[norm_type]["counters"] for r in per_rank]
    assert all(c == counters[0] for c in counters)
    assert counters[0]["skipped_steps"] == (3 if faults else 0)
    assert counters[0]["nan_steps"] == (1 if faults else 0) and counters[0]["inf_steps"] == (2 if faults else 0)
    assert all(r[norm_type]["consistency"] is None for r in per_rank)


@needs_gloo
@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_clip_grad_norm_on_dtensor_gradients_is_torchs_global_norm(run, layout):
    # 3.0: a norm type that is not exact under scaling, so the gradients are unscaled first.
    results = run(2, "clip_vs_torch", layout=layout, norm_types=(2.0, 1.0, math.inf, 3.0))
    for norm_type in ("2.0", "1.0", "inf", "3.0"):
        _check_clip_run(results, norm_type)


@needs_gloo
def test_clip_grad_norm_on_fsdp2_with_a_fused_optimizer(run):
    # The device-decided path: no host sync, the norm stays a tensor, fused Adam skips on device.
    _check_clip_run(run(2, "clip_vs_torch", layout="fsdp", norm_types=(2.0,), optimizer="fused_adam"), "2.0")


@needs_gloo
def test_norm_reduction_counts_copies_once_and_refuses_what_it_cannot_tell(run):
    r0, r1 = run(2, "layouts")
    assert r0["counted"] == [True, True] and r1["counted"] == [True, False]  # a Replicate copy: rank 0's
    assert r0["copies"] == [False, False, False] and r1["copies"] == [False, True, False]
    assert r0["group_is_mesh"] and r1["group_is_mesh"] and r0["plain_alone"]
    for r in (r0, r1):  # every rank raises alike (the layout decides), so none is left in a collective
        assert "lie on several device meshes" in r["several_meshes"] and "norm_group=" in r["several_meshes"]
        assert "mix DTensors and plain tensors" in r["mixed"]
        assert "Partial(sum)" in r["partial"] and "partial sums" in r["partial"]
        # A disabled scaler reduces alike, at scale 1 (float32 vs math.sqrt's float64 for the plain case).
        for key in ("disabled_dtensor", "disabled_plain"):
            norm, expected, plain = r[key]
            assert plain and norm == pytest.approx(expected, rel=1e-6), key
    assert "lacks ranks [1]" in r0["outside"] and "not in norm_group" in r1["outside"]


@needs_gloo
def test_the_clip_with_a_rank_of_copies_huge_copies_or_an_inf_elsewhere(run):
    r0, r1 = run(2, "clip_edges")
    # Rank 1 holds only copies rank 0 counts: one norm, a float32 one, and the same clip on both.
    for r in (r0, r1):
        c = r["copies"]
        assert not c["skipped"] and c["norm_dtype"] == "torch.float32"
        assert c["norm"] == pytest.approx(r0["expected_norm"], rel=1e-6)
        for got, want in zip(c["grads"], r0["expected_grads"]):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=0.0)
    assert r0["copies"] == r1["copies"]
    # Finite copies whose 2-norm would overflow float32: the inf-norm is finite, the step is taken.
    assert r0["huge"]["norm"] == r1["huge"]["norm"] == pytest.approx(3e19 / 16)
    assert not r0["huge"]["skipped"] and not r1["huge"]["skipped"]
    # An inf in rank 0's rows: both skip, and each rank's gradient is unscaled only (rank 1's rows intact).
    assert r0["inf_elsewhere"]["skipped"] and r1["inf_elsewhere"]["skipped"]
    assert math.isinf(r0["inf_elsewhere"]["norm"]) and math.isinf(r1["inf_elsewhere"]["norm"])
    rows = r0["rows"]
    assert r0["inf_elsewhere"]["grads"] == [rows[:2]] and r1["inf_elsewhere"]["grads"] == [rows[2:]]


# ---------------------------------------------------------------------------------------- pipeline
@needs_gloo
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_pipelining_norm_spans_the_stages_with_norm_group(run, norm_type):
    r0, r1 = run(2, "pipelining", norm_type=norm_type)
    for step, (a, b) in enumerate(zip(r0["world"]["record"], r1["world"]["record"])):
        fault = step == 2
        assert a["planted"] == ("inf" if fault else "") and b["planted"] == ""
        assert a["skipped"] == b["skipped"] == a["ref_skipped"] == b["ref_skipped"] == fault, step
        assert a["scale"] == b["scale"] == a["ref_scale"], step
        assert a["norm"] == b["norm"], step  # one all-reduce: the same total on both stages
        if fault:
            assert math.isinf(a["norm"]) and math.isinf(a["ref_norm"]), step
        else:
            # One process stacks all four per-tensor norms; the stages sum their partial powers.
            torch.testing.assert_close(a["norm"], a["ref_norm"], **ROUNDING)
        assert a["param_diff"] < 1e-6 and b["param_diff"] < 1e-6, step
    assert r0["world"]["counters"] == r1["world"]["counters"] and r0["world"]["counters"]["skipped_steps"] == 1
    assert r0["world"]["consistency"] is None
    # Without norm_group each stage clips by its own norm, below the network's: a different run.
    for step in (0, 1):
        a, b = r0["None"]["record"][step], r1["None"]["record"][step]
        assert max(a["norm"], b["norm"]) <= a["ref_norm"] and min(a["norm"], b["norm"]) < a["ref_norm"], step
    assert max(e["param_diff"] for e in r0["None"]["record"] + r1["None"]["record"]) > 1e-3


# -------------------------------------------------------------------------------------------- FSDP1
@needs_gloo
def test_fsdp1_lossscale_skips_and_scales_as_sharded_grad_scaler(run):
    r0, r1 = run(2, "fsdp1_parity")
    planted = [any(e["planted"]) for e in r0["record"]]
    assert any(planted) and not all(planted)
    for step, (a, b) in enumerate(zip(r0["record"], r1["record"])):
        for e in (a, b):
            # Bitwise: the same skips and scales as torch's ShardedGradScaler, both ways of calling.
            assert e["torch"]["skipped"] == e["drop_in"]["skipped"] == e["one_call"]["skipped"] == planted[step], step
            assert e["torch"]["scale"] == e["drop_in"]["scale"] == e["one_call"]["scale"] == a["torch"]["scale"], step
            if not planted[step]:
                # FSDP1's own clip_grad_norm_ reduces x**p alike: the same norm, bit for bit (measured).
                assert e["drop_in"]["norm"] == e["one_call"]["norm"] == e["torch"]["norm"], step
            else:
                assert not math.isfinite(e["one_call"]["norm"]) and not math.isfinite(e["torch"]["norm"]), step
    assert r0["drop_in_params_equal"] and r1["drop_in_params_equal"]
    assert r0["one_call_param_diff"] == r1["one_call_param_diff"] == 0.0
    assert r0["counters"] == r1["counters"] and r0["consistency"] is None
    assert r0["counters"]["skipped_steps"] == sum(planted)


# ------------------------------------------------------------------------- 2-D mesh, four ranks
@needs_gloo
def test_fsdp2_x_tp_on_a_2d_mesh(run, tmp_path):
    results = run(4, "mesh2d", checkpoint_dir=str(tmp_path / "checkpoint"))
    # The norm (types 2, 1, inf) is torch's on the 2 x 2 mesh; an inf on one rank's local TP shard,
    # a NaN on another's, an inf in a Replicate copy: every rank skips, one scale, the same counters.
    clip = [r["clip"] for r in results]
    for norm_type in ("2.0", "1.0", "inf"):
        _check_clip_run(clip, norm_type)
    assert [e["planted"] for e in clip[3]["2.0"]["record"]][:2] == ["", "inf"]  # rank 3 alone, step 1
    # HSDP (Replicate over one mesh dim, Shard over the other): the same norm as torch until the first
    # fault. A fault in one replica (rank 3, after backward) skips every rank here; torch's recipe
    # reduces found_inf over the Shard dim only, so its other replica steps and the replicas part.
    hsdp = [r["hsdp"]["2.0"]["record"] for r in results]
    for step, entries in enumerate(zip(*hsdp)):
        fault = any(e["planted"] for e in entries)
        assert [e["skipped"] for e in entries] == [fault] * 4, step
        assert len({e["scale"] for e in entries}) == 1, step
        norms = [e["norm"] for e in entries]
        assert not any(map(math.isfinite, norms)) if fault else len(set(norms)) == 1, step
        if step == 0:
            torch.testing.assert_close(entries[0]["norm"], entries[0]["ref_norm"], **ROUNDING)
            assert all(e["param_diff"] <= 1e-6 for e in entries)
        if step == 1:
            assert [e["ref_skipped"] for e in entries] == [False, False, True, True]
    assert all(r["hsdp"]["2.0"]["consistency"] is None for r in results)
    # A NaN loss on one rank (lossscale's defaults): every rank skips without backing off, and
    # counts it as the unsharded model does; telemetry totals are the unsharded model's.
    train = [r["train"] for r in results]
    for step, entries in enumerate(zip(*[t["record"] for t in train])):
        for e in entries:
            assert e["skipped"] == e["ref_skipped"] == (step == 3), step
            assert e["scale"] == e["ref_scale"] == entries[0]["scale"], step
            assert e["figures"] == entries[0]["figures"], step  # summed over the mesh: the same everywhere
            if step != 3:  # the NaN step's figures come from other losses (one rank poisoned, not all)
                assert e["figures"] == e["ref_figures"], step  # counts exact: a Replicate copy counted once
                # Tensor-parallel partial sums round in fp16 otherwise: amax within one fp16 ulp.
                assert e["amax"] == pytest.approx(e["ref_amax"], rel=2.0**-10), step
    for t in train:
        assert t["counters"] == train[0]["counters"] == t["ref_counters"]
        assert t["counters"]["bad_loss_steps"] == 1 and t["counters"]["skipped_steps"] == 1
        assert t["consistency"] is None
        assert t["max_param_diff"] < 1e-4  # the unsharded model, rounded otherwise for 6 steps
    # torch.distributed.checkpoint: saved on the 2 x 2 mesh, loaded into FSDP2 over 1 x 4.
    for r in results:
        c = r["checkpoint"]
        assert c["params_equal"] and c["moments_equal"], c
        # The loading scaler has no telemetry, so DCP's template leaves out the telemetry's sampling phase.
        saved, loaded = c["scaler_state"]
        assert {k: v for k, v in saved.items() if k != "telemetry_iteration"} == loaded
        assert c["placements"] == ["(Shard(dim=0),)"]
        # One more step on each mesh: the same up to the layouts' rounding.
        assert c["norms"][0] == pytest.approx(c["norms"][1], rel=1e-4) and c["param_diff_after"] < 1e-5


# ------------------------------------------------------------------------------ single process
def test_norm_group_is_validated():
    with pytest.raises(ValueError, match=r"norm_group='world' \(str\) must be None .* ProcessGroup"):
        lsd.norm_reduction([], [], 2.0, "world")
    assert lsd.norm_reduction([], [], 2.0, None) == (None, None)  # not initialised: nothing to reduce
    scaler = lossscale.GradScaler("cpu")
    p = torch.ones(3, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(p.sum()).backward()
    with pytest.raises(ValueError, match="norm_group=3"):
        scaler.clip_grad_norm_(opt, 1.0, norm_group=3)
    assert scaler.clip_grad_norm_(opt, 1.0).item() == pytest.approx(math.sqrt(3.0))  # nothing was consumed
