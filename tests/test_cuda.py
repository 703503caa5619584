"""Every device present: bitwise torch, host syncs no more than torch's (none on the fused path), and
on CUDA a graph-captured step+update, the skip flag under replay, and a state on a second GPU.

The same tests run on CPU (always) and on CUDA (when present); the CUDA-only ones skip without it
(``-m cuda`` selects them; ``benchmarks/gpu_check.sh`` runs them on a GPU). What only a real device
can show: nothing in the hot path reads a value back (counted here, and under torch's own detector in
gpu_check), the snapshot's pinned copy and event, and a captured ``step`` + ``update`` that replays
exactly like an eager torch.amp.GradScaler.
"""

import copy

import pytest
import torch
from _devices import CUDA_LIKE, on
from _models import TORCH_LIKE, tiny_mlp
from _sync import count_device_work, count_host_syncs

import lossscale

DEVICES = [pytest.param("cpu", id="cpu"), *CUDA_LIKE]

CUDA = torch.device("cuda")


def _batch(step, device=CUDA):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 8, generator=g).to(device), torch.randint(0, 4, (8,), generator=g).to(device)


def _backward(model, scaler, step, bad=None, device=CUDA):
    x, y = _batch(step, device)
    with torch.autocast(torch.device(device).type, dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y) * 4.0
    scaler.scale(loss).backward()
    if bad is not None:
        next(model.parameters()).grad.view(-1)[step % 7] = float(bad)


def _blocking(syncs):
    """Every counted sync (the snapshot's non_blocking copy into pinned memory is not one: the counter
    leaves asynchronous copies into pinned memory out)."""
    return list(syncs.ops)


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-3, fused=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["sgd", "fused_adam"])
@pytest.mark.parametrize("clip", [False, True])
def test_bitwise_torch_and_syncs(kind, clip, device):
    with on(device) as device:
        _bitwise_torch_and_syncs(kind, clip, device)


def _bitwise_torch_and_syncs(kind, clip, device):
    model_t = tiny_mlp(3).to(device)
    model_l = copy.deepcopy(model_t)
    opt_t, opt_l = _optimizer(kind, model_t.parameters()), _optimizer(kind, model_l.parameters())
    cfg = dict(init_scale=2.0**16, growth_interval=3)
    ref = torch.amp.GradScaler(device, **cfg)
    ours = lossscale.GradScaler(device, **cfg, **TORCH_LIKE)
    skipped = 0
    for step in range(20):
        bad = {5: "inf", 11: "nan"}.get(step)
        counts = {}
        for model, opt, scaler in ((model_t, opt_t, ref), (model_l, opt_l, ours)):
            opt.zero_grad(set_to_none=True)
            _backward(model, scaler, step, bad, device)
            with count_host_syncs() as syncs:
                if clip and scaler is ref:
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                elif clip:
                    scaler.clip_grad_norm_(opt, 0.5)
                scaler.step(opt)
                scaler.update()
            counts[scaler is ours] = len(_blocking(syncs))
            ops = syncs.ops  # lossscale's, the last in the loop
        # Never more syncs than torch, overflow steps included (the model overflows on its own at
        # 2**16 too, not only on the injected steps): the stuck check reads a snapshot later.
        assert counts[True] <= counts[False], (step, counts, ops)
        if kind == "fused_adam":
            assert counts[True] == 0, (step, syncs.ops)
        skipped += ours.last_step_skipped
        assert torch.equal(ref._scale, ours._get_scale_async()), step
        assert all(torch.equal(a, b) for a, b in zip(model_t.parameters(), model_l.parameters())), step
    assert ours.counters()["skipped_steps"] == skipped >= 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_capture_of_fused_step_and_update_replays_like_torch():
    torch.manual_seed(0)
    model_t = tiny_mlp(4).to(CUDA)
    model_l = copy.deepcopy(model_t)
    params_t, params_l = list(model_t.parameters()), list(model_l.parameters())
    opt_t = torch.optim.Adam(params_t, lr=1e-3, fused=True, capturable=True)
    opt_l = torch.optim.Adam(params_l, lr=1e-3, fused=True, capturable=True)
    cfg = dict(init_scale=2.0**16, growth_interval=2)
    ref = torch.amp.GradScaler("cuda", **cfg)
    ours = lossscale.GradScaler("cuda", **cfg, **TORCH_LIKE)
    for p in params_t + params_l:
        p.grad = torch.zeros_like(p)  # static gradient buffers, refilled before every replay
    ref.scale(torch.ones((), device=CUDA))
    ours.scale(torch.ones((), device=CUDA))

    def grads_for(k):
        g = torch.Generator().manual_seed(k)
        out = [torch.randn(p.shape, generator=g).mul_(100.0).to(CUDA) for p in params_l]
        if k % 4 == 3:
            out[k % len(out)].view(-1)[0] = float("inf") if k % 8 == 3 else float("nan")
        return out

    def feed(params, k):
        for p, g in zip(params, grads_for(k)):
            p.grad.copy_(g)

    # Warm up on a side stream (optimizer state, the scaler's lazily built constants), both sides alike.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for k in range(3):
            for params, opt, scaler in ((params_t, opt_t, ref), (params_l, opt_l, ours)):
                feed(params, k)
                scaler.step(opt)
                scaler.update()
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    feed(params_l, 3)
    with torch.cuda.graph(graph):
        ours.step(opt_l)
        ours.update()
    # Capture recorded the kernels without running them: the eager reference starts from iteration 3 too.
    for k in range(3, 15):
        feed(params_t, k)
        ref.step(opt_t)
        ref.update()
        feed(params_l, k)
        with count_host_syncs() as syncs:
            graph.replay()
        assert syncs.count == 0
        torch.cuda.synchronize()
        assert torch.equal(ref._scale, ours._get_scale_async()), k
        # The skip flag is read from the device state, so replays (no Python update()) keep it right.
        assert ours.last_step_skipped == (k % 4 == 3), k
        assert all(torch.equal(a, b) for a, b in zip(params_t, params_l)), k
    counters = ours.counters()
    assert counters["skipped_steps"] == 3 and counters["steps"] == 3 + 12


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_state_on_a_second_gpu_while_the_first_is_current():
    # The snapshot's event must be recorded on the state's device's stream, not the current one's,
    # or the host could read the pinned buffer before the copy lands (stale values, int(nan)).
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    model = tiny_mlp(5).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    scaler = lossscale.GradScaler(dev, on_stuck="raise", max_consecutive_skips=3)
    fired = None
    for step in range(12):
        opt.zero_grad(set_to_none=True)
        _backward(model, scaler, step, "inf" if step >= 4 else None, dev)
        scaler.step(opt)
        try:
            scaler.update()
        except RuntimeError:
            fired = step
            break
    assert fired is not None and fired >= 7  # 3 skipped (4, 5, 6): reported once the snapshot lands


@pytest.mark.parametrize("device", CUDA_LIKE)
def test_the_first_update_and_a_load_make_no_copy_the_host_waits_for(device):
    # Constants built from host lists (torch.tensor(list, device="cuda"), .to() from pageable memory)
    # would wait for the stream, and fail inside a graph capture (a non_blocking copy from pinned
    # memory waits for nothing). The batch moves to the device before the count (its copies are the
    # caller's), and so does the forward.
    with on(device) as device:
        model = tiny_mlp(6).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
        x, y = _batch(0, device)
        for policy in ("dynamic", "adaptive", "logmax", "static"):
            scaler = lossscale.GradScaler(device, policy=policy)
            with torch.autocast(torch.device(device).type, dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            with count_device_work() as work:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            assert work.syncs == 0, (policy, work.ops)
            sd = scaler.state_dict()
            with count_device_work() as work:
                scaler.load_state_dict(sd)
            assert work.syncs == 0, (policy, work.ops)
