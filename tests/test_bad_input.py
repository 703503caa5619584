"""Bad input gets a clear error and changes no state, or it works (issue 19's probes).

Each test names the probe it answers; each failed before its fix.
"""

from __future__ import annotations

import collections
import io
import math
import warnings

import numpy as np
import pytest
import torch

import lossscale

HUGE = 10**400  # an int beyond float range


def _model_opt(dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(dtype)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _backward(model, scaler, dtype=torch.float32, bad=False):
    x = torch.ones(2, 3, dtype=dtype)
    if bad:
        x[0, 0] = math.nan
    scaler.scale(model(x).sum()).backward()


def _iteration(model, opt, scaler, **kw):
    opt.zero_grad()
    _backward(model, scaler, **kw)
    scaler.step(opt)
    scaler.update()


# ------------------------------------------------------------------------------------ telemetry
def test_telemetry_on_a_float64_model_warns_once_and_training_goes_on():
    model, opt = _model_opt(torch.float64)
    scaler = lossscale.GradScaler(telemetry=1)
    with pytest.warns(UserWarning, match="float64"):
        _iteration(model, opt, scaler, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _iteration(model, opt, scaler, dtype=torch.float64)
    assert not scaler.last_step_skipped
    assert scaler.metrics()["loss_scale"] == 65536.0


def test_the_telemetry_sampling_phase_survives_a_checkpoint():
    model, opt = _model_opt()
    scaler = lossscale.GradScaler(telemetry=3)
    for _ in range(4):
        _iteration(model, opt, scaler)
    resumed = lossscale.GradScaler(telemetry=3)
    resumed.load_state_dict(scaler.state_dict())
    for _ in range(5):
        _iteration(model, opt, scaler)
        _iteration(model, opt, resumed)
        assert scaler.telemetry.due() == resumed.telemetry.due()
    assert scaler.telemetry.iteration == resumed.telemetry.iteration == 9


# ---------------------------------------------------------------------------------------- numbers
def test_numpy_numbers_are_stored_as_python_numbers_so_weights_only_loading_works():
    scaler = lossscale.GradScaler(init_scale=np.float32(1024.0), growth_factor=np.float64(2.0),
                                  growth_interval=np.int64(100), min_scale=np.float32(1.0))
    scaler.set_backoff_factor(np.float32(0.25))
    scaler.set_growth_interval(np.int32(50))
    sd = scaler.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)  # how transformers reloads scaler.pt
    assert loaded["policy"]["init_scale"] == 1024.0 and type(loaded["policy"]["init_scale"]) is float
    assert type(loaded["policy"]["growth_interval"]) is int

    sd["policy"] = dict(sd["policy"], growth_factor=np.float64(4.0))
    sd["growth_factor"] = np.float64(4.0)
    sd["state"] = dict(sd["state"], scale=np.float32(1024.0), steps=np.int64(0))
    other = lossscale.GradScaler(init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=50)
    other.load_state_dict(sd)
    buf = io.BytesIO()
    torch.save(other.state_dict(), buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["policy"]["growth_factor"] == 4.0


@pytest.mark.parametrize("keyword", ["init_scale", "growth_factor", "min_scale", "max_scale", "backoff_factor"])
def test_an_int_beyond_float_range_is_a_value_error_naming_the_argument(keyword):
    with pytest.raises(ValueError, match=keyword):
        lossscale.GradScaler(**{keyword: HUGE})


def test_an_int_beyond_float_range_in_setters_updates_loads_and_clips_is_a_value_error():
    model, opt = _model_opt()
    scaler = lossscale.GradScaler()
    with pytest.raises(ValueError, match="growth_factor"):
        scaler.set_growth_factor(HUGE)
    _iteration(model, opt, scaler)
    sd = scaler.state_dict()
    with pytest.raises(ValueError, match="scale"):
        scaler.load_state_dict(dict(sd, state=dict(sd["state"], scale=HUGE)))
    with pytest.raises(ValueError, match="scale"):
        scaler.load_state_dict({"scale": HUGE, "growth_factor": 2.0, "backoff_factor": 0.5,
                                "growth_interval": 2000, "_growth_tracker": 0})
    opt.zero_grad()
    _backward(model, scaler)
    with pytest.raises(ValueError, match="max_norm"):
        scaler.clip_grad_norm_(opt, HUGE)
    scaler.step(opt)
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(HUGE)
    assert scaler.state_dict() == sd or scaler.get_scale() == 65536.0


# ------------------------------------------------------------------------------------ scale()
def test_a_failed_scale_leaves_no_bad_loss_behind():
    model, opt = _model_opt()
    scaler = lossscale.GradScaler()
    _iteration(model, opt, scaler)
    with pytest.raises(ValueError, match="NoneType"):
        scaler.scale([torch.tensor(math.nan), None])
    _iteration(model, opt, scaler)
    assert not scaler.last_step_skipped


def test_scale_of_a_meta_tensor_is_refused_and_the_state_stays():
    model, opt = _model_opt()
    scaler = lossscale.GradScaler()
    with pytest.raises(ValueError, match="meta"):
        scaler.scale(torch.ones((), device="meta"))
    assert scaler.device is None
    _iteration(model, opt, scaler)
    assert scaler.device == torch.device("cpu") and not scaler.last_step_skipped


def test_scale_keeps_a_defaultdict_a_defaultdict():
    scaler = lossscale.GradScaler()
    out = scaler.scale(collections.defaultdict(list, a=torch.ones(()), b=[torch.ones(())]))
    assert isinstance(out, collections.defaultdict) and out.default_factory is list
    assert out["a"].item() == 65536.0 and out["b"][0].item() == 65536.0


# ---------------------------------------------------------------------------------- optimizers
@pytest.mark.parametrize("call", ["step(5)", "step(None)", "unscale_(None)", "clip_grad_norm_(None)"])
def test_a_non_optimizer_is_a_value_error_and_leaves_no_record(call):
    model, opt = _model_opt()
    scaler = lossscale.GradScaler()
    opt.zero_grad()
    _backward(model, scaler)
    arg = 5 if "5" in call else None
    method = getattr(scaler, call.split("(")[0])
    with pytest.raises(ValueError, match="optimizer"):
        method(arg, 1.0) if call.startswith("clip") else method(arg)
    scaler.step(opt)  # the iteration goes on as if the bad call had not happened
    scaler.update()
    assert not scaler.last_step_skipped and scaler.state().steps == 1


def test_load_state_dict_between_backward_and_step_loads_and_drops_the_iteration():
    # torch loads there (its test_grad_scaling_state_dict does, after a scale()); the gradients in flight
    # carry the old scale, so the iteration is dropped, with a warning that says so.
    model, opt = _model_opt()
    scaler = lossscale.GradScaler()
    _iteration(model, opt, scaler)
    sd = lossscale.GradScaler(init_scale=4.0).state_dict()
    opt.zero_grad()
    _backward(model, scaler)
    with pytest.warns(RuntimeWarning, match="mid-iteration.*discarded"):
        scaler.load_state_dict(sd)
    assert scaler.get_scale() == 4.0 and scaler.state().steps == 0
    with pytest.raises(RuntimeError, match="update\\(\\) found no inf checks"):
        scaler.update()  # nothing of the dropped iteration is left to update on


# --------------------------------------------------------------------------------------- minor
@pytest.mark.parametrize("value", ["false", "False", 0.0, None, "yes"])
def test_enabled_must_be_a_bool(value):
    with pytest.raises(ValueError, match="enabled"):
        lossscale.GradScaler(enabled=value)


def test_enabled_takes_numpy_bools():
    assert lossscale.GradScaler(enabled=np.bool_(False)).is_enabled() is False


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64])
def test_a_non_float_new_scale_tensor_is_refused(dtype):
    model, opt = _model_opt()
    scaler = lossscale.GradScaler()
    opt.zero_grad()
    _backward(model, scaler)
    scaler.step(opt)
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(torch.tensor(1, dtype=dtype))
    scaler.update()
    assert scaler.get_scale() == 65536.0


def test_discard_iteration_drops_the_iteration_in_flight_and_counts_nothing():
    model, opt = _model_opt()
    scaler = lossscale.GradScaler()
    _iteration(model, opt, scaler)
    before = scaler.state()
    opt.zero_grad()
    _backward(model, scaler, bad=True)  # a NaN loss
    scaler.unscale_(opt)  # ...and then the loop hits an exception before step()
    opt.zero_grad()
    scaler.discard_iteration()
    assert scaler.state() == before
    scaler.load_state_dict(scaler.state_dict())  # between iterations again
    _iteration(model, opt, scaler)  # unscale_ is allowed again, and the NaN loss is forgotten
    assert not scaler.last_step_skipped and scaler.state().steps == before.steps + 1


# ------------------------------------------------------------------------- hostile-user probes
def test_telemetry_reducing_on_a_rank_with_only_empty_parameters_reads_its_metrics():
    # A rank whose optimizer holds only 0-element parameters (an FSDP2 rank past the end of dim 0, a
    # pipeline stage) still joins the telemetry's reduction, and reads the scale its empty figures ran at.
    import socket

    owned = not torch.distributed.is_initialized()
    if owned:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        p = torch.nn.Parameter(torch.zeros(0))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler = lossscale.GradScaler(telemetry={"every": 1, "reduce": "sum"},
                                      process_group=torch.distributed.group.WORLD)
        scaler.scale((p.sum() + 1.0) * torch.ones(())).backward()
        scaler.step(opt)
        scaler.update()
        m = scaler.metrics()
        assert m["loss_scale"] == 65536.0 and m["grad/loss_scale"] == 65536.0 and m["grad/numel"] == 0
    finally:
        if owned:
            torch.distributed.destroy_process_group()


def test_a_scale_given_twice_under_two_names_is_refused():
    with pytest.raises(ValueError, match="init_scale=2.0.*scale=4.0|scale=4.0.*init_scale=2.0"):
        lossscale.GradScaler(policy="static", init_scale=2.0, scale=4.0)


def test_a_disabled_scaler_with_trace_holds_no_tensors_over_many_steps():
    import gc

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = lossscale.GradScaler(enabled=False, model=model, trace=True)

    def tensors():
        gc.collect()
        return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())

    def steps(n):
        for _ in range(n):
            opt.zero_grad()
            scaler.scale(model(torch.ones(1, 3)).sum()).backward()
            scaler.step(opt)
            scaler.update()

    steps(5)
    before = tensors()
    steps(300)
    assert tensors() - before < 10


def test_init_device_meta_is_refused_naming_the_argument():
    scaler = lossscale.GradScaler()
    with pytest.raises(ValueError, match="device=meta"):
        scaler.init_device("meta")
    assert scaler.device is None
    model, opt = _model_opt()
    _iteration(model, opt, scaler)  # and the next CPU step runs
    assert scaler.device == torch.device("cpu")


@pytest.mark.parametrize("key", ["scale", "_growth_tracker"])
def test_a_torch_state_dict_holding_a_meta_tensor_is_a_value_error_naming_the_key(key):
    sd = torch.amp.GradScaler("cpu").state_dict()
    sd[key] = torch.tensor(sd[key]).to("meta")
    scaler = lossscale.GradScaler(init_scale=8.0)
    with pytest.raises(ValueError, match=f"'{key}'.*meta"):
        scaler.load_state_dict(sd)
    assert scaler.get_scale() == 8.0
