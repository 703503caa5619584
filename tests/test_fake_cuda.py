"""The stand-in CUDA device (``tests/_fake_cuda.py``) and the counter that runs on it (``lossscale._sync``).

Known operator sequences give known counts; real code (``nn.Linear``, torch's optimizers in every
implementation, autocast, torch's and lossscale's scalers) runs on the stand-in and computes what the
CPU computes, bit for bit; and one clean iteration of lossscale beside ``torch.amp.GradScaler`` is
counted for each optimizer kind (printed with ``-s``; budgets are for the tests of issue 22).
"""

import copy
import importlib.util
import json
import os

import pytest
import torch

import lossscale
from lossscale._sync import count_device_work, count_host_syncs
from _fake_cuda import FakeCudaTensor, fake_cuda, pinned, stand_in_cuda  # noqa: F401 (fixture)
from _iterations import OPTIMIZERS, count_iteration, make_iteration, table
from _models import TORCH_LIKE, tiny_mlp

F = torch.nn.functional


def _counts(fn, *inputs):
    with count_device_work() as work:
        fn(*inputs)
    return (work.launches, work.syncs, work.h2d, work.d2h)


def _d():
    return torch.arange(6.0, device="cuda")


# (what, fn of a device tensor d, (launches, syncs, h2d, d2h))
KNOWN = [
    ("zeros", lambda d: torch.zeros(3, device="cuda"), (1, 0, 0, 0)),
    ("empty: an allocation", lambda d: torch.empty(3, device="cuda"), (0, 0, 0, 0)),
    ("full", lambda d: torch.full((2,), 1.5, device="cuda"), (1, 0, 0, 0)),
    ("tensor(list, device=cuda)", lambda d: torch.tensor([1.0, 2.0], device="cuda"), (0, 1, 1, 0)),
    ("host tensor .to(cuda)", lambda d: torch.ones(3).to("cuda"), (0, 1, 1, 0)),
    ("pinned .to(cuda, non_blocking)", lambda d: pinned(torch.ones(3)).to("cuda", non_blocking=True), (0, 0, 1, 0)),
    ("pinned .to(cuda), blocking", lambda d: pinned(torch.ones(3)).to("cuda"), (0, 1, 1, 0)),
    ("views", lambda d: (d.view(2, 3).t(), d[1], d.detach(), d[:1].expand(4), d.as_strided((2,), (1,)),
                         d.reshape(3, 2), d.split(2), d.unbind(), d.unsqueeze(0).squeeze_(0)), (0, 0, 0, 0)),
    ("mul", lambda d: d * 2, (1, 0, 0, 0)),
    ("add_", lambda d: d.add_(1), (1, 0, 0, 0)),
    # CUDA's where(cond, x, scalar) puts the scalar on the device first (scalar_tensor: a fill).
    ("where of a compare", lambda d: torch.where(d > 2, d, 0.0), (3, 0, 0, 0)),
    ("cast", lambda d: d.to(torch.float16), (1, 0, 0, 0)),
    ("to(cuda): already there", lambda d: d.to("cuda"), (0, 0, 0, 0)),
    ("to(cuda, copy=True)", lambda d: d.to("cuda", copy=True), (1, 0, 0, 0)),
    ("item", lambda d: d.sum().item(), (1, 1, 0, 1)),
    ("bool()", lambda d: bool(d.sum() > 0), (2, 1, 0, 1)),
    ("tolist", lambda d: d.tolist(), (0, 1, 0, 1)),
    ("cpu", lambda d: d.cpu(), (0, 1, 0, 1)),
    ("nonzero", lambda d: d.nonzero(), (1, 1, 0, 1)),
    ("boolean mask", lambda d: d[d > 2], (2, 1, 0, 1)),
    ("equal", lambda d: torch.equal(d, d), (1, 1, 0, 1)),
    ("copy into pinned, non_blocking", lambda d: pinned(torch.empty(6)).copy_(d, non_blocking=True), (0, 0, 0, 1)),
    ("copy into pageable, non_blocking", lambda d: torch.empty(6).copy_(d, non_blocking=True), (0, 1, 0, 1)),
    ("foreach, one dtype", lambda d: torch._foreach_mul_([d, d.clone()], 2.0), (2, 0, 0, 0)),
    ("foreach, two dtypes: per tensor", lambda d: torch._foreach_mul_([d, d.half()], 2.0), (3, 0, 0, 0)),
    # Operators whose device code launches more than one kernel (torch's source, _sync's table):
    # out-of-place masked_fill is a clone then masked_fill_; _foreach_norm's multi-tensor route fills
    # two workspaces, runs its kernel and a cleanup; the per-tensor route is one norm per tensor.
    ("masked_fill: a clone and the fill", lambda d: d.masked_fill(d > 2, 0.0), (3, 0, 0, 0)),
    ("masked_fill_ in place", lambda d: d.masked_fill_(d > 2, 0.0), (2, 0, 0, 0)),
    ("foreach norm, one dtype", lambda d: torch._foreach_norm([d, d], float("inf")), (4, 0, 0, 0)),
    ("foreach norm, two dtypes: per tensor", lambda d: torch._foreach_norm([d, d.double()], 2.0), (3, 0, 0, 0)),
    # Host work beside device work costs the device nothing (a block of host work alone is a CPU
    # run, where the CPU stands for the device: test_a_cpu_only_run_stands_for_the_device).
    ("host work", lambda d: (d * 2, torch.ones(3).mul(2).sum().item()), (1, 0, 0, 0)),
]


@pytest.mark.parametrize("what, fn, expected", KNOWN, ids=[k[0] for k in KNOWN])
def test_known_operations_count_as_a_gpu_sees_them(stand_in_cuda, what, fn, expected):
    assert _counts(fn, _d()) == expected


def test_count_host_syncs_sees_a_tensor_built_from_a_list():
    # torch.tensor(list, device=...) copies below the Python key; the counter makes it visible
    # (benchmarks/gpu_check.py checks it on a real GPU).
    with fake_cuda(), count_host_syncs() as syncs:
        torch.tensor([1.0, 2.0], device="cuda")
        torch.tensor(3.0, device="cuda")
    assert syncs.count == 2 and syncs.on_device


def test_a_cpu_only_run_stands_for_the_device():
    # No accelerator tensor in the block: reads of CPU tensors are the syncs a GPU run would make,
    # and operators are launches. With one, only device work counts.
    x = torch.ones(3)
    with count_host_syncs() as syncs:
        (x * 2).sum().item()
    assert (syncs.count, syncs.launches, syncs.on_device) == (1, 2, False)
    with fake_cuda(), count_device_work() as work:
        d = torch.ones(3, device="cuda")
        x.sum().item()
    assert (work.syncs, work.launches, work.on_device) == (0, 1, True)


def test_the_counter_must_sit_above_the_stand_in():
    with count_device_work(), pytest.raises(RuntimeError, match="enter fake_cuda"):
        with fake_cuda():
            pass


# ------------------------------------------------------------------ the stand-in itself
def test_tensors_report_cuda_and_compute_on_the_cpu():
    available = torch.cuda.is_available()  # False in CI; the stand-in puts back whatever it was
    with fake_cuda():
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1
        d = torch.arange(4.0, device="cuda") * 2
        assert type(d) is FakeCudaTensor and d.device == torch.device("cuda", 0)
        assert d.is_cuda and not d.is_cpu and not d.is_meta and d.get_device() == 0
        assert d.type() == "torch.cuda.FloatTensor" and "cuda:0" in repr(d)
        host = d.cpu()
        assert type(host) is torch.Tensor and host.tolist() == [0.0, 2.0, 4.0, 6.0] == d.tolist()
        assert d.new_tensor([1.0]).device == d.device and torch.zeros_like(d).device == d.device
    assert torch.cuda.is_available() == available


def test_the_stand_in_refuses_what_cuda_refuses():
    with fake_cuda():
        d = _d()
        with pytest.raises(RuntimeError, match="same device"):
            d + torch.ones(6)
        d + torch.tensor(1.0)  # a 0-dim host tensor is a scalar, as on CUDA
        with pytest.raises(RuntimeError, match="same device"):
            torch._amp_update_scale_(torch.ones(()), torch.zeros((), dtype=torch.int32, device="cuda"),
                                     torch.zeros((), device="cuda"), 2.0, 0.5, 10)
        with pytest.raises(TypeError, match="numpy"):
            d.numpy()
        with pytest.raises(RuntimeError, match="pin"):
            d.pin_memory()
        with pytest.raises(RuntimeError, match="ordinal"):
            torch.zeros(1, device="cuda:1")


def test_sync_debug_mode_flags_what_the_counter_calls_a_sync():
    with fake_cuda():
        d = _d()
        torch.cuda.set_sync_debug_mode("error")
        try:
            pinned(torch.empty(6)).copy_(d, non_blocking=True)  # queued: fine
            with pytest.raises(RuntimeError, match="synchronizing"):
                d.sum().item()
            with pytest.raises(RuntimeError, match="synchronizing"):
                torch.ones(2).to("cuda")
            torch.cuda.set_sync_debug_mode("warn")
            with pytest.warns(UserWarning, match="synchronizing"):
                d.tolist()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert torch.cuda.get_sync_debug_mode() == 0


def test_autocast_casts_as_cuda_autocast_does():
    with fake_cuda():
        lin = torch.nn.Linear(4, 3).to("cuda")
        x = torch.randn(2, 4, device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            assert torch.is_autocast_enabled("cuda")
            h = lin(x)
            with count_device_work() as work:
                lin(x)  # the weight's cast is cached within the autocast region: x's and the addmm
            loss = F.cross_entropy(h, torch.tensor([0, 2], device="cuda"))
        assert h.dtype is torch.float16 and (x @ lin.weight.t()).dtype is torch.float32
        assert loss.dtype is torch.float32 and work.launches == 2, work.launch_ops
        loss.backward()
        assert type(lin.weight.grad) is FakeCudaTensor and lin.weight.grad.dtype is torch.float32


def test_models_move_copy_and_cast_whole():
    with fake_cuda():
        model = tiny_mlp().to("cuda")
        params = list(model.parameters())
        assert all(type(p) is FakeCudaTensor and isinstance(p, torch.nn.Parameter) for p in params)
        twin = copy.deepcopy(model)
        assert all(type(p) is FakeCudaTensor and torch.equal(p, q) for p, q in zip(twin.parameters(), params))
        twin.half()
        assert all(p.dtype is torch.float16 and p._data.dtype is torch.float16 for p in twin.parameters())
        back = tiny_mlp().to("cuda").cpu()
        assert all(type(p) is torch.nn.Parameter for p in back.parameters())


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_training_on_the_stand_in_is_bitwise_the_cpu_run(kind):
    # The stand-in runs CPU kernels, so lossscale's CUDA path (foreach amax kernel, pinned snapshots,
    # events) must land on the same weights as its CPU path, overflow steps included.
    def train(device):
        torch.manual_seed(0)
        model = tiny_mlp(1).to(device)
        opt = OPTIMIZERS[kind](model.parameters())
        scaler = lossscale.GradScaler(device, init_scale=2.0**16, growth_interval=2)
        for step in range(6):
            opt.zero_grad(set_to_none=True)
            x = torch.randn(8, 8).to(device)
            y = torch.arange(8).remainder(4).to(device)
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            if step == 3:
                next(model.parameters()).grad.view(-1)[0] = float("inf")
            scaler.step(opt)
            scaler.update()
        return [p.detach().cpu() for p in model.parameters()], scaler.get_scale(), scaler.counters()

    cpu = train("cpu")
    with fake_cuda():
        stand_in = train("cuda")
    assert all(torch.equal(a, b) for a, b in zip(cpu[0], stand_in[0]))
    assert cpu[1:] == stand_in[1:] and cpu[2]["skipped_steps"] == 1


def test_lossscale_takes_its_cuda_path_on_the_stand_in():
    with fake_cuda() as gpu:
        it = make_iteration("lossscale", "fused_adam")
        it.run()
        it.run("inf")  # an overflow: the stuck check snapshots the state (pinned buffer, event)
        assert gpu.events_recorded >= 1
        it.run("inf")
        work = it.counted()  # reads the landed snapshots, queues one more
        assert work.syncs == 0 and work.d2h >= 1, work.ops  # into pinned memory, without a wait
        gpu.capturing = True  # update() must not read the host then
        with pytest.warns(RuntimeWarning, match="stuck check"):
            it.run()


# ------------------------------------------------------------------ iterations, side by side
SIDE_BY_SIDE = {
    "default": {},
    "torch-like": TORCH_LIKE,
    "hysteresis=2": dict(hysteresis=2),
    "adaptive": dict(policy="adaptive"),
    "logmax": dict(policy="logmax"),
}


def test_one_clean_iteration_beside_torch(capsys):
    # Counted, not budgeted (issue 22 sets the budgets): torch's own figures pin the counter on real
    # code, and lossscale never syncs more than torch.
    rows, torch_rows = {}, {}
    with fake_cuda():
        for kind in ("sgd", "adam", "fused_adam"):
            torch_rows[kind] = rows[f"torch, {kind}"] = count_iteration("torch", kind)
            for name, kwargs in SIDE_BY_SIDE.items():
                rows[f"lossscale {name}, {kind}"] = work = count_iteration("lossscale", kind, **kwargs)
                assert work.syncs <= torch_rows[kind].syncs, (name, kind, work.ops)
        rows["torch, fused_adam, unscale_ + clip_grad_norm_"] = count_iteration("torch", "fused_adam", clip=1.0)
        rows["lossscale, fused_adam, clip_grad_norm_"] = count_iteration("lossscale", "fused_adam", clip=1.0)
        rows["lossscale, sgd, telemetry per param + metrics()"] = count_iteration(
            "lossscale", "sgd", telemetry={"every": 1, "per": "param"}, metrics=True)
    assert {k: (w.launches, w.syncs) for k, w in torch_rows.items()} == {
        "sgd": (10, 1), "adam": (16, 1), "fused_adam": (12, 0)}
    with capsys.disabled():
        print("\n" + "\n".join(table(rows)))


def test_gpu_check_runs_on_the_stand_in(tmp_path):
    # benchmarks/gpu_check.py's CPU twin: the driver the GPU machine runs, with its benchmarks shrunk.
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "gpu_check.py")
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main(["--stand-in", "--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = results["steps"]
    assert results["ok"] and results["meta"]["stand_in"] and steps["tests"]["status"] == "skipped"
    rows = steps["paths"]["rows"]
    assert list(rows) == [p[0] for p in gpu_check.PATHS] and all(r["ok"] for r in rows.values())
    # On the stand-in torch's detector is the counter's rule, so the two agree exactly.
    assert all(r[side]["syncs"] == r[side]["detector_syncs"] for r in rows.values() for side in ("lossscale", "torch"))
    assert rows["adam fused"]["error_mode"] == "ok" and rows["adam fused"]["lossscale"]["syncs"] == 0
    assert steps["nan_batch"]["weights_unchanged"] and steps["nan_batch"]["skipped"]
    assert steps["counter"]["differences"] == [] and steps["counter"]["rows"]["torch.tensor(list, device=cuda)"]["h2d"] == 1
    assert steps["graph_rule"]["twin"] and steps["graph_rule"]["results"]["ok"]  # the plumbing: no graphs here
    assert steps["bench_scaler"]["default"]["result"]["meta"]["settings"] == "default"
    assert (tmp_path / "bench_scaler_quick_cuda_default.json").exists() and (tmp_path / "bench_scaler_quick_cuda.json").exists()
    checks = steps["grad_stats"]["checks"]
    assert len(checks) == 8 and all(c["equal_to_index_add"] and c["sync_raised"] is None for c in checks.values())
    assert {r["method"] for r in steps["grad_stats"]["timing"]} == {"auto", "index_add", "histc", "sort"}
