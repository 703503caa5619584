"""Host syncs per iteration, counted with a dispatch mode: lossscale never pays more than torch.

``_sync.count_host_syncs`` counts ``aten._local_scalar_dense`` (``.item()``, ``bool()``,
``float()`` on a tensor), device-to-host copies and value-dependent shapes. On CPU these are the
operations that *would* sync on an accelerator, so the promise is checkable without one.
"""

import copy

import pytest
import torch
from _models import TORCH_LIKE, backward, make_optimizer, tiny_mlp
from _sync import count_host_syncs

import lossscale

MODES = ["plain", "unscale_", "unscale_+clip", "clip"]


def _iteration(model, opt, scaler, step, mode, bad=None):
    opt.zero_grad(set_to_none=True)
    backward(model, scaler, step)
    if bad is not None:
        next(model.parameters()).grad[0, 0] = float(bad)
    if mode in ("unscale_", "unscale_+clip") or (mode == "clip" and isinstance(scaler, torch.amp.GradScaler)):
        scaler.unscale_(opt)
        if mode != "unscale_":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    elif mode == "clip":
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()


def _count(kind, scaler, mode, bad=None):
    model = tiny_mlp()
    opt = make_optimizer(kind, model.parameters())
    _iteration(model, opt, scaler, 0, mode)  # warm-up: state allocation, first-call work
    with count_host_syncs() as syncs:
        _iteration(model, opt, scaler, 1, mode, bad)
    return syncs.count


def _optimizer_own(kind):
    """Syncs of the optimizer's own step (Adam(foreach) on CPU reads its step counts on the host)."""
    model = tiny_mlp()
    opt = make_optimizer(kind, model.parameters())
    for step in range(2):
        opt.zero_grad()
        model(torch.ones(2, 8)).sum().backward()
        if step == 0:
            opt.step()
            continue
        with count_host_syncs() as syncs:
            opt.step()
    return syncs.count


@pytest.mark.parametrize("kind", ["sgd", "adam", "fused_adam"])
@pytest.mark.parametrize("mode", MODES)
def test_iteration_syncs_at_most_torch(kind, mode):
    ours = _count(kind, lossscale.GradScaler("cpu", **TORCH_LIKE), mode)
    ref = _count(kind, torch.amp.GradScaler("cpu"), mode)
    assert ours <= ref, (ours, ref)
    own = _optimizer_own(kind)
    # The scaler's own share: one decision sync without amp-scaling support, none with it.
    assert ours - own == (0 if kind == "fused_adam" else 1), (ours, own)


@pytest.mark.parametrize("kind", ["sgd", "fused_adam"])
@pytest.mark.parametrize("bad", ["inf", "nan"])
def test_overflow_iteration_syncs(kind, bad):
    # On the host path the decision sync already happened; the stuck check reads host memory on CPU
    # (on CUDA it costs one more transfer, documented). The fused path stays at zero.
    ours = _count(kind, lossscale.GradScaler("cpu", **TORCH_LIKE, on_stuck="ignore"), "plain", bad)
    ref = _count(kind, torch.amp.GradScaler("cpu"), "plain", bad)
    assert ours <= ref and (kind != "fused_adam" or ours == 0), (ours, ref)


@pytest.mark.parametrize("kind", ["sgd", "fused_adam"])
@pytest.mark.parametrize("mode", ["plain", "clip"])
def test_telemetry_adds_no_sync(kind, mode):
    plain = _count(kind, lossscale.GradScaler("cpu"), mode)
    sampled = _count(kind, lossscale.GradScaler("cpu", telemetry=1), mode)
    assert sampled == plain


def test_update_and_fused_step_alone_do_not_sync():
    model = tiny_mlp()
    opt = make_optimizer("fused_adam", model.parameters())
    scaler = lossscale.GradScaler("cpu")
    _iteration(model, opt, scaler, 0, "plain")
    backward(model, scaler, 1)
    with count_host_syncs() as syncs:
        scaler.step(opt)
        scaler.update()
        scaler.scale(torch.ones(()))
    assert syncs.count == 0, syncs.ops
    # Reading what the device decided is the caller's sync, once per update() (under CUDA-graph
    # replay, where update() is not called again, every read syncs: tests/test_cuda.py).
    with count_host_syncs() as syncs:
        scaler.last_step_skipped  # noqa: B018  the read is what is counted
        scaler.last_step_skipped  # noqa: B018  a second read: no second sync
    assert syncs.count == 1


def test_copied_scaler_keeps_counting_alike():
    # A deep copy between iterations runs the same hot path (the per-state caches are rebuilt).
    model = tiny_mlp()
    opt = make_optimizer("sgd", model.parameters())
    scaler = lossscale.GradScaler("cpu")
    _iteration(model, opt, scaler, 0, "plain")
    twin = copy.deepcopy(scaler)
    model2 = copy.deepcopy(model)
    opt2 = make_optimizer("sgd", model2.parameters())
    _iteration(model2, opt2, twin, 1, "plain")
    with count_host_syncs() as syncs:
        _iteration(model2, opt2, twin, 2, "plain")
    assert syncs.count == 1


def test_the_no_fp16_watch_adds_no_sync_and_no_launch(monkeypatch):
    """An FP32 run keeps the scaler looking for FP16 work at every scale() (metadata and the autograd
    graph's, no tensor read): its iterations count the same syncs and launches as with the look removed."""
    from lossscale import _hints

    def fp32_iteration(model, opt, scaler, step):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
        scaler.scale(model(x).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()

    def counted():
        model = tiny_mlp()
        opt = make_optimizer("fused_adam", model.parameters())
        scaler = lossscale.GradScaler("cpu")
        fp32_iteration(model, opt, scaler, 0)
        with count_host_syncs() as syncs:
            fp32_iteration(model, opt, scaler, 1)
        return scaler, syncs.count, syncs.launches

    scaler, syncs, launches = counted()
    assert scaler._fp16_watch.watching and scaler._fp16_watch.iterations == 2  # it looked, both times
    monkeypatch.setattr(_hints.Fp16Watch, "look", lambda self, outputs, first_of_iteration: None)
    assert counted()[1:] == (syncs, launches) and syncs == 0
