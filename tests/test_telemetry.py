"""Telemetry in the scaler: bitwise-neutral, sync-free while collecting, flat metrics, JSONL."""

import json

import pytest
import torch
from _models import backward, make_optimizer, params_equal, twins

import lossscale
from lossscale.telemetry import JsonlLogger, Telemetry


def _run(model, scaler, steps=12):
    opt = make_optimizer("sgd", model.parameters())
    for step in range(steps):
        opt.zero_grad()
        backward(model, scaler, step)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    return opt


def test_telemetry_on_is_bitwise_neutral():
    a, b = twins(3)
    _run(a, lossscale.GradScaler(growth_interval=3))
    on = lossscale.GradScaler(growth_interval=3, model=b, telemetry=dict(every=2, per="module"))
    _run(b, on)
    assert params_equal(a, b)
    m = on.metrics()
    assert m["grad/step"] == 10 and 0.0 <= m["grad/flushed_frac"] <= 1.0
    assert on.metric_labels() == {"grad/measured": "float32 as fp16"}
    assert all(isinstance(v, (int, float, bool)) for v in m.values()), m  # every value a number, for any logger
    assert "grad/0/flushed_frac" in m and "grad/2/headroom_bits" in m
    assert m["loss_scale"] == on.get_scale() and m["skipped_steps"] == on.skipped_steps


def test_telemetry_figures_equal_direct_measurement_of_scaled_grads():
    model, _ = twins(0)
    scaler = lossscale.GradScaler(init_scale=2.0**20, telemetry=1)
    opt = make_optimizer("sgd", model.parameters())
    backward(model, scaler, 0)
    scaled = [p.grad.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    m = scaler.metrics()
    g = torch.cat([t.flatten() for t in scaled]).double()
    as16 = g.to(torch.float16)
    assert m["grad/flushed"] == int(((as16 == 0) & (g != 0)).sum())
    assert m["grad/overflow"] == int((torch.isinf(as16) & torch.isfinite(g)).sum())
    assert m["grad/amax"] == float(g[torch.isfinite(g)].abs().max())  # amax is over finite values
    assert m["grad/inf"] + m["grad/nan"] == int((~torch.isfinite(g)).sum())


def test_bad_telemetry_argument():
    with pytest.raises(ValueError, match="telemetry"):
        lossscale.GradScaler(telemetry="often")
    with pytest.raises(ValueError, match="per"):
        Telemetry(per="layer")


def test_jsonl_logger_round_trip(tmp_path):
    path = tmp_path / "run.jsonl"
    model, _ = twins(1)
    scaler = lossscale.GradScaler(telemetry=2)
    opt = make_optimizer("sgd", model.parameters())
    with JsonlLogger(path) as log:
        for step in range(4):
            opt.zero_grad()
            backward(model, scaler, step)
            scaler.step(opt)
            scaler.update()
            log.log(step, scaler.metrics(), note=float("inf"))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2, 3]
    assert lines[0]["note"] == "inf" and "loss_scale" in lines[0] and "grad/flushed_frac" in lines[-1]


def test_metrics_on_the_fused_path_reads_the_state_in_the_telemetrys_one_transfer():
    """Only the device knows the state; ``metrics()`` reads it inside the telemetry's one transfer (one
    sync), and its counters are the pure rule's. Kills: the riding values decoded wrong or dropped."""
    from _sync import count_host_syncs

    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.Adam([p], lr=0.0, fused=True)
    scaler = lossscale.GradScaler("cpu", telemetry=1, init_scale=2.0**4, growth_interval=2)
    policy = lossscale.DynamicPolicy(init_scale=2.0**4, growth_interval=2)
    expected = policy.init_state()
    for value in (1.0, float("inf"), 1.0, 1.0, float("nan"), 1.0):
        scaler.scale(torch.ones(()))
        p.grad = torch.full((3,), value * 2.0**4)
        scaler.step(opt)
        scaler.update()
        expected = policy.update(expected, found_inf=value != 1.0, found_nan=value != value)
    with count_host_syncs() as syncs:
        metrics = scaler.metrics()
    assert syncs.count == 1 and scaler.state() == expected
    assert (metrics["steps"], metrics["skipped_steps"], metrics["nan_steps"]) == (6, 2, 1)


@pytest.mark.parametrize("kind", ["sgd", "fused_adam"])
def test_the_logged_loss_scale_is_the_one_the_gradients_carried(kind):
    # metrics() is read after update(), which backs the scale off on an overflow and grows it after a
    # clean run: grad/loss_scale is the scale of the sampled gradients, loss_scale the one now.
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    opt = make_optimizer(kind, model.parameters())
    scaler = lossscale.GradScaler("cpu", telemetry=1, growth_interval=2)
    logged = []
    for step in range(5):
        opt.zero_grad()
        carried = scaler.get_scale()
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        if step == 0:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        m = scaler.metrics()
        logged.append((carried, m["grad/loss_scale"], m["loss_scale"]))
    # 2^16 backs off to 2^15 at the overflow, then grows after every second clean step.
    assert logged == [
        (2.0**16, 2.0**16, 2.0**15),
        (2.0**15, 2.0**15, 2.0**15),
        (2.0**15, 2.0**15, 2.0**16),
        (2.0**16, 2.0**16, 2.0**16),
        (2.0**16, 2.0**16, 2.0**17),
    ]


def test_a_resumed_run_samples_at_the_same_iterations():
    # The sampling phase (the iteration count) is checkpointed: a scaler loaded from a checkpoint taken
    # at iteration 4 of an every-3 telemetry samples at 6, as the run it resumes does.
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    opt = make_optimizer("sgd", model.parameters())

    def iteration(scaler):
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        return scaler.metrics().get("grad/step")

    scaler = lossscale.GradScaler("cpu", telemetry=3)
    assert [iteration(scaler) for _ in range(4)] == [0, 0, 0, 3]
    saved = scaler.state_dict()
    assert saved["telemetry_iteration"] == 4
    resumed = lossscale.GradScaler("cpu", telemetry=3)
    resumed.load_state_dict(saved)
    assert [iteration(resumed) for _ in range(3)] == [None, None, 6]  # nothing sampled yet, then 6
    assert [iteration(scaler) for _ in range(3)] == [3, 3, 6]


def test_telemetry_arguments_refused_and_accepted():
    for every in (2.5, True, 0):
        with pytest.raises(ValueError, match="every"):
            Telemetry(every=every)
    assert Telemetry(reduce="sum").reduce == "sum" and Telemetry(reduce=None).reduce is None
    for off in (None, False):  # telemetry off: no figures of the gradients
        scaler = lossscale.GradScaler("cpu", telemetry=off)
        assert scaler.telemetry is None


def _direct(grads, fmt_dtype=torch.float16):
    """flushed and amax of ``grads`` (the scaled gradients) measured by hand against FP16."""
    g = torch.cat([t.detach().flatten() for t in grads]).double()
    return int(((g.to(fmt_dtype) == 0) & (g != 0)).sum()), float(g.abs().max())


@pytest.mark.parametrize("per", ["module", "param"])
def test_per_module_and_per_parameter_figures_are_those_of_their_own_gradients(per):
    # Nested names: a module's key is the parameter's name without its last part ("body.0"), a
    # parameter's its whole name; each group's figures are its own scaled gradients'.
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    model.head = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = lossscale.GradScaler("cpu", model=model, telemetry=dict(every=1, per=per), init_scale=2.0**-20)
    scaler.scale(model.head(model.body(torch.randn(5, 4))).sum()).backward()
    scaled = {n: p.grad.clone() for n, p in model.named_parameters()}
    scaler.step(opt)
    scaler.update()
    m = scaler.metrics()
    if per == "module":
        groups = {k: [g for n, g in scaled.items() if n.rsplit(".", 1)[0] == k] for k in ("body.0", "body.2", "head")}
    else:
        groups = {n: [g] for n, g in scaled.items()}
    assert sorted(k[len("grad/") : -len("/amax")] for k in m if k.endswith("/amax") and k != "grad/amax") == sorted(
        groups
    )
    for key, grads in groups.items():
        flushed, amax = _direct(grads)
        assert (m[f"grad/{key}/flushed"], m[f"grad/{key}/amax"]) == (flushed, amax), key
    flushed, amax = _direct(list(scaled.values()))
    assert (m["grad/flushed"], m["grad/amax"]) == (flushed, amax) and flushed > 0  # 2**-20: some flush


def test_two_optimizers_figures_are_over_both():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.0), torch.optim.SGD(b.parameters(), lr=0.0)
    scaler = lossscale.GradScaler("cpu", telemetry=1, init_scale=2.0**-20)
    scaler.scale(b(a(torch.randn(5, 4))).sum()).backward()
    scaled = [p.grad.clone() for p in [*a.parameters(), *b.parameters()]]
    scaler.step(opt_a)
    scaler.step(opt_b)
    scaler.update()
    m = scaler.metrics()
    flushed, amax = _direct(scaled)
    assert (m["grad/flushed"], m["grad/amax"]) == (flushed, amax)
    assert m["grad/numel"] == sum(g.numel() for g in scaled)


def test_float64_gradients_are_left_out_with_one_warning_naming_their_dtype():
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    opt = torch.optim.SGD([a, b], lr=0.0)
    scaler = lossscale.GradScaler("cpu", telemetry=1)
    assert scaler.metric_labels() == {}  # nothing sampled yet
    with pytest.warns(UserWarning, match=r"lossscale telemetry: float64 gradients are left out") as caught:
        for _ in range(2):
            opt.zero_grad()
            scaler.scale(a.sum() + b.sum()).backward()
            scaler.step(opt)
            scaler.update()
    assert sum("telemetry" in str(w.message) for w in caught) == 1  # said once
    m = scaler.metrics()
    assert m["grad/numel"] == 3  # the float32 gradient only
    assert scaler.metric_labels() == {"grad/measured": "float32 as fp16"}


def test_the_default_samples_every_100_iterations():
    assert Telemetry().every == 100


def test_the_measured_label_names_each_dtype():
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    opt = torch.optim.SGD([a, b], lr=0.0)
    scaler = lossscale.GradScaler("cpu", telemetry=1, allow_fp16=True)
    scaler.scale(a.sum() + b.float().sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.metric_labels() == {"grad/measured": "float16 as stored, float32 as fp16"}


def test_jsonl_logger_appends_reads_tensors_and_closes_idempotently(tmp_path):
    path = tmp_path / "run.jsonl"
    JsonlLogger(path).close()  # never opened: nothing to close
    with JsonlLogger(path) as log:
        log.log(0, {"x": torch.tensor(2.5)})
    log = JsonlLogger(path, mode="a")
    log.log(1, {"x": 1.0})
    log.close()
    log.log(2, {"x": 0.5})  # reopened, still appending
    log.close()
    log.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 0, "x": 2.5},
        {"step": 1, "x": 1.0},
        {"step": 2, "x": 0.5},
    ]


def test_the_telemetry_objects_own_metrics_are_the_scalers_gradient_figures():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    opt = make_optimizer("sgd", model.parameters())
    scaler = lossscale.GradScaler("cpu", telemetry=1)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    own = scaler.telemetry.metrics()
    assert own and own == {k: v for k, v in scaler.metrics().items() if k.startswith("grad/")}


@pytest.mark.parametrize("per", [None, "param"])
def test_bf16_telemetry_measures_against_bf16_and_a_float32_run_warns_nothing(per):
    # Gradients at 2**-20 of a float32 model: FP16 flushes some of them, bf16 (8 exponent bits) none.
    # A model whose gradients are all measurable gets no warning about left-out dtypes.
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = lossscale.GradScaler("cpu", model=model, telemetry=dict(every=1, fmt="bf16", per=per), init_scale=2.0**-20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.scale(model(torch.randn(5, 4)).sum()).backward()
        scaled = {n: p.grad.clone() for n, p in model.named_parameters()}
        scaler.step(opt)
        scaler.update()
        m = scaler.metrics()
    assert _direct(scaled.values())[0] > 0  # FP16 would flush some
    assert (m["grad/flushed"], m["grad/amax"]) == _direct(scaled.values(), torch.bfloat16) == (0, m["grad/amax"])
    if per == "param":
        for name, g in scaled.items():
            assert m[f"grad/{name}/flushed"] == _direct([g], torch.bfloat16)[0] == 0, name
    assert scaler.metric_labels() == {"grad/measured": "float32 as bf16"}
