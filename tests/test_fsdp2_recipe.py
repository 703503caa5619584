"""examples/fsdp2_fp16.py on two gloo ranks: FSDP2 with FP16 parameters and FP32 gradient reduction,
lossscale.GradScaler with the global clip, a NaN batch on one rank, and a DCP checkpoint round trip.

The ranks are the spawned pool of tests/_dist_workers.py, running this module's SCENARIOS.
"""

import importlib.util
import os

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.distributed

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "fsdp2_fp16.py")
STEPS, NAN_AT, SAVE_AT = 8, 3, 4


def _example():
    spec = importlib.util.spec_from_file_location("fsdp2_fp16_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recipe(rank, world, checkpoint):
    """The example's train() on the pool's group: a whole run that saves at SAVE_AT, then a fresh model,
    optimizer and scaler resumed from that checkpoint."""
    import torch

    example = _example()
    lines = []
    model, scaler, whole = example.train(STEPS, NAN_AT, checkpoint, save_at=SAVE_AT, log=lines.append)
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    mine = [p.to_local().detach().clone() for p in model.parameters()]
    model2, scaler2, resumed = example.train(STEPS, NAN_AT, checkpoint, save_at=SAVE_AT, resume=True, log=lines.append)
    same = all(torch.equal(a, b.to_local()) for a, b in zip(mine, model2.parameters()))
    return dict(
        whole=whole,
        resumed=resumed,
        same=same,
        counters=scaler.counters(),
        counters2=scaler2.counters(),
        dtypes=dtypes,
        lines=lines,
        health=scaler.health().verdict,
    )


SCENARIOS = {"recipe": recipe}


@needs_gloo
def test_fsdp2_fp16_recipe_on_two_ranks(tmp_path):
    from _dist_workers import WorkerPool

    pool = WorkerPool(world_size=2, scenarios=__name__)
    try:
        r0, r1 = pool.run("recipe", timeout_s=240, checkpoint=str(tmp_path / "ckpt"))
    finally:
        pool.close()
    for r in (r0, r1):
        skipped = [rec["skipped"] for rec in r["whole"]]
        assert skipped == [s == NAN_AT for s in range(STEPS)]  # the NaN batch: every rank skips
        scales = [rec["scale"] for rec in r["whole"]]
        assert scales == [2.0**12] * STEPS  # a bad batch keeps the scale
        assert r["counters"]["bad_loss_steps"] == 1 and r["counters"]["skipped_steps"] == 1
        assert r["dtypes"] == ["torch.float32"]  # FP32 shards, FP16 compute
        assert r["resumed"] == r["whole"][SAVE_AT + 1 :]  # the DCP round trip: same scales, norms
        assert r["same"]  # and the same weights, bitwise
        assert r["counters2"] == r["counters"]
        assert r["health"] == "healthy"
    assert repr(r0["whole"]) == repr(r1["whole"])  # norms (NaN at the bad batch) and decisions agree across ranks
    assert r0["lines"] and not r1["lines"]  # rank 0 logs
