"""A skipped step is a skip on torch's real kernels: every torch.optim optimizer, in every
implementation, under every fault, clip mode and policy (``tests/_skip_matrix.py``).

The assertion of each cell: after the skipped step the parameters and every optimizer state tensor
are bitwise unchanged; the next clean step changes the parameters and leaves everything finite.
torch's fused kernels skip only when ``found_inf == 1.0`` exactly, so this is also the test of the
flag contract (``lossscale._check``): a flag of 2.0 made the "skipped" step run on NaN gradients.

The matrix runs in CI in well under a minute; ``-m slow`` adds a 10,000-step soak.
"""

from __future__ import annotations

import math

import pytest
import torch
from _skip_matrix import (
    CLIPS,
    FAULTS,
    POLICIES,
    Net,
    OptimizerKind,
    applies,
    backward,
    differences,
    iteration,
    make_scaler,
    optimizer_kinds,
    run_scenario,
    snapshot,
)

import lossscale

KINDS = optimizer_kinds()

# A static scale (and any scale at its floor) meets every injected fault "at the minimum": the stuck
# diagnosis fires by design. The matrix tests the skip, not the diagnosis (tests/test_stuck.py does).
# One intra-op thread (conftest's one_thread): the models are tiny, and on a busy 2-core machine torch's
# thread pool made a fused Adam step ~10x slower (measured: the Adam-fused row 9.5 s with 2 threads, 1.1 s with 1).
pytestmark = [
    pytest.mark.filterwarnings("ignore:lossscale. .*consecutive skipped step:RuntimeWarning"),
    pytest.mark.usefixtures("one_thread"),
]


def test_the_matrix_covers_every_optimizer_torch_ships():
    names = {k.name for k in KINDS}
    shipped = {
        n
        for n in dir(torch.optim)
        if isinstance(getattr(torch.optim, n), type)
        and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
        and n != "Optimizer"
    }
    assert shipped - names == {"LBFGS"}  # the closure optimizer, tested below
    # The implementations that matter most are there: fused kernels on CPU read found_inf == 1.0.
    assert {"Adam-fused", "AdamW-fused", "SGD-fused", "Adam-foreach", "SGD-for-loop"} <= {k.id for k in KINDS}


@pytest.mark.parametrize("kind", KINDS, ids=[k.id for k in KINDS])
def test_a_skipped_step_leaves_parameters_and_optimizer_state_bitwise_unchanged(kind):
    failures = []
    for policy in POLICIES:
        for clip in filter(lambda c: applies(kind, c), CLIPS):
            for fault in FAULTS:
                for failure in run_scenario(kind, policy, clip, fault):
                    failures.append(f"{policy}, clip={clip}, {fault}: {failure}")
    assert not failures, f"{len(failures)} failing cell(s):\n" + "\n".join(failures[:40])


def test_lbfgs_closure_is_refused_as_torch_refuses_it():
    model = Net("dense")
    opt = torch.optim.LBFGS(model.parameters())
    scaler = lossscale.GradScaler()
    backward(model, scaler, 0)
    with pytest.raises(RuntimeError, match="Closure"):
        scaler.step(opt, closure=lambda: 0.0)


def test_fused_adam_nan_batch_regression():
    """The defect that started the matrix, in its plainest form: fused Adam and a NaN input row. With
    found_inf == 2.0 torch's fused kernel stepped on NaN gradients and Adam's step count went to -1."""
    model = Net("dense")
    opt = torch.optim.Adam(model.parameters(), fused=True)
    scaler = lossscale.GradScaler()
    iteration(model, opt, scaler, 0, "none")
    before = snapshot(model, opt)
    iteration(model, opt, scaler, 1, "none", "nan_input_row")
    assert scaler.last_step_skipped
    assert differences(before, snapshot(model, opt)) == []
    assert all(float(s["step"]) == 1.0 for s in opt.state.values())


# ----------------------------------------------------------------------------------------- soak
@pytest.mark.slow
@pytest.mark.parametrize(
    "kind",
    [
        OptimizerKind("Adam", "fused"),
        OptimizerKind("AdamW", "fused"),
        OptimizerKind("SGD", "fused"),
        OptimizerKind("Adagrad", "fused"),
        OptimizerKind("Adam", "foreach"),
        OptimizerKind("SGD", "for-loop"),
    ],
    ids=lambda k: k.id,
)
def test_soak_ten_thousand_steps_with_five_percent_faults(kind):
    """10,000 iterations, a fault in ~5% of them (each kind of fault, each clip mode), dynamic policy:
    every faulty iteration is skipped bitwise, every clean one trains, nothing goes non-finite."""
    steps, rate = 10_000, 0.05
    model = Net(kind.model_kind)
    opt = kind.build(model.parameters())
    scaler = lossscale.GradScaler(model=model, trace=True)
    g = torch.Generator().manual_seed(2026)
    missed, faults = [], 0
    for step in range(steps):
        fault = None
        if torch.rand((), generator=g).item() < rate:
            fault = FAULTS[int(torch.randint(len(FAULTS), (), generator=g))]
            faults += 1
        clip = CLIPS[step % len(CLIPS)]
        before = snapshot(model, opt) if fault else None
        iteration(model, opt, scaler, step + 3, clip, fault)
        if fault and (not scaler.last_step_skipped or differences(before, snapshot(model, opt))):
            missed.append((step, fault, clip))
    after = snapshot(model, opt)
    assert faults > 400
    assert not missed, f"{len(missed)} of {faults} faults not skipped bitwise: {missed[:10]}"
    assert all(bool(torch.isfinite(v).all()) for v in after.values() if v.is_floating_point())
    assert math.isfinite(scaler.get_scale())


@pytest.mark.distributed
def test_a_fault_on_one_rank_is_skipped_bitwise_on_every_rank():
    """The flags reduced across ranks (MAX) stay 0/1: a NaN batch on one rank with fused Adam was
    applied on that rank (its weights went NaN) while the clean ranks stepped."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    from _dist_workers import WorkerPool

    pool = WorkerPool(world_size=2, scenarios="_skip_matrix")
    try:
        results = pool.run(
            "skip_across_ranks",
            kinds=[("Adam", "fused"), ("SGD", "fused"), ("Adam", "foreach")],
            faults=["nan_input_row", "inf_loss_term", "nan_grad", "forward_inf_traced"],
        )
    finally:
        pool.close()
    failures = [f"rank {rank}, {cell}: {why}" for rank, r in enumerate(results) for cell, why in r.items() if why]
    assert not failures, "\n".join(failures)
    assert len(results[0]) == 12


@pytest.mark.parametrize("kind", KINDS, ids=[k.id for k in KINDS])
def test_a_skipped_first_step_leaves_the_optimizer_as_if_it_had_not_run(kind):
    """The first step is often skipped (a fresh scale overflows). torch's SGD(fused=True, momentum) makes
    its momentum buffers with empty_like and its kernel leaves them unwritten when it skips: the next
    step read garbage (weights at 5e27). So after a skipped first step, one clean step must train
    exactly as a fresh optimizer's first step does (bitwise: the scales differ by a power of two)."""
    for fault in ("inf_grad", "nan_input_row"):
        model, fresh = Net(kind.model_kind), Net(kind.model_kind)
        optimizer, fresh_optimizer = kind.build(model.parameters()), kind.build(fresh.parameters())
        scaler, fresh_scaler = make_scaler("dynamic", model, False), make_scaler("dynamic", fresh, False)
        iteration(model, optimizer, scaler, 1, "none", fault)
        assert scaler.last_step_skipped, (kind.id, fault)
        iteration(model, optimizer, scaler, 2, "none")
        iteration(fresh, fresh_optimizer, fresh_scaler, 2, "none")
        assert not scaler.last_step_skipped
        for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
            assert torch.equal(a, b), (kind.id, fault, name)
