"""Drop-in as torch's own tests define it (issue 31): torch-valid code never raises, FP16 gradients where
the user opts in, and the private names real code reads.

Written from the behaviours upstream's tests check (``test/test_torch.py``'s ``test_grad_scaling_*``,
``test_grad_scale_will_not_overflow``, ``test_pickle_gradscaler``, the FSDP sharded-scaler tests), not
copied: each test here runs the same calls on ``lossscale.GradScaler`` and, where torch's scaler can,
on torch's, and asserts they agree.
"""

import copy
import math
import pickle
import warnings

import pytest
import torch

import lossscale
from lossscale import OptState


class DummyProcessGroup:
    """A stand-in process group of one rank, as torch's sharded-scaler tests pass one (not a ProcessGroup)."""

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def _step(scaler, model, opt, x, y):
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


# ------------------------------------------------------------------ torch-valid arguments are accepted
def test_a_scale_near_float32s_top_starts_and_never_overflows():
    # upstream test_grad_scale_will_not_overflow: init_scale=1e38 with 16x growth after every step.
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    with pytest.warns(UserWarning, match="above the default max_scale"):
        scaler = lossscale.GradScaler("cpu", growth_interval=1, growth_factor=2**4, init_scale=1e38)
    _step(scaler, model, torch.optim.Adam(model.parameters()), torch.randn(1, 5), 1e-30 * torch.randn(1, 1))
    assert math.isfinite(scaler._scale.item()) and scaler.get_scale() > 0


def test_megatrons_initial_loss_scale_starts_training_and_the_cap_is_said_once():
    with pytest.warns(UserWarning, match="max_scale is set to init_scale") as caught:
        scaler = lossscale.GradScaler(init_scale=2.0**32)
    assert len([w for w in caught if "init_scale" in str(w.message)]) == 1
    assert scaler.get_scale() == 2.0**32 and scaler.policy.max_scale == 2.0**32
    with warnings.catch_warnings():  # the user's own bounds: no note, torch's unbounded growth
        warnings.simplefilter("error")
        free = lossscale.GradScaler(init_scale=2.0**32, growth_interval=1, max_scale=None)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.0)
    free.scale(p.sum()).backward()
    free.step(opt)
    free.update()
    assert free.get_scale() == 2.0**33  # grows as torch's does
    with pytest.raises(ValueError, match="above max_scale"):  # a bound the user gave stays theirs
        lossscale.GradScaler(init_scale=2.0**32, max_scale=2.0**20)


def test_an_init_scale_below_the_default_floor_lowers_it():
    with pytest.warns(UserWarning, match="min_scale is set to init_scale"):
        scaler = lossscale.GradScaler(init_scale=2.0**-30)
    assert scaler.get_scale() == 2.0**-30 and scaler.policy.min_scale == 2.0**-30


@pytest.mark.parametrize("scale_first", [True, False], ids=["after scale()", "before scale()"])
def test_load_state_dict_in_mid_iteration_loads_and_drops_the_iteration(scale_first):
    # upstream test_grad_scaling_state_dict: the dummy scale() call first, then load.
    s0 = lossscale.GradScaler(init_scale=4.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = lossscale.GradScaler(init_scale=8.0, growth_factor=8.0, backoff_factor=0.25, growth_interval=1)
    s1._init_growth_tracker = 7  # a value for load_state_dict to overwrite
    if scale_first:
        s1.scale(torch.full((1,), 4.0))
        assert isinstance(s1._scale, torch.Tensor) and s1._scale.dtype == torch.float32
        with pytest.warns(RuntimeWarning, match="mid-iteration"):
            s1.load_state_dict(s0.state_dict())
    else:
        s1.load_state_dict(s0.state_dict())
    assert (s1.get_scale(), s1.get_growth_factor(), s1.get_backoff_factor(), s1.get_growth_interval()) == (
        4.0,
        4.0,
        0.5,
        2,
    )
    assert s1._init_growth_tracker == 0
    p = torch.nn.Parameter(torch.ones(2))  # the dropped iteration counts nothing; the next one trains
    opt = torch.optim.SGD([p], lr=0.1)
    s1.scale(p.sum()).backward()
    s1.step(opt)
    s1.update()
    assert s1.state().steps == 1


@pytest.mark.parametrize("lazy", [True, False], ids=["after scale()", "fresh"])
def test_a_scaler_pickles_after_scale_as_torchs_does(lazy):
    # upstream test_pickle_gradscaler.
    a = lossscale.GradScaler("cpu", init_scale=4.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    if lazy:
        a.scale(torch.tensor([4.0]))
        assert a._scale.device.type == "cpu"
    b = pickle.loads(pickle.dumps(a))
    assert b.is_enabled() == a.is_enabled()
    assert (b.get_scale(), b.get_growth_factor(), b.get_backoff_factor(), b.get_growth_interval()) == (4.0, 4.0, 0.5, 2)
    assert b._init_growth_tracker == 0
    assert b.scale(torch.tensor([4.0])).item() == 16.0
    p = torch.nn.Parameter(torch.ones(2))  # not once an optimizer was checked, as torch
    a.scale(p.sum()).backward()
    a.unscale_(torch.optim.SGD([p], lr=0.1))
    with pytest.raises(RuntimeError, match="pickled only"):
        pickle.dumps(a)


@pytest.mark.parametrize("group", [DummyProcessGroup(0, 1)], ids=["dummy group"])
def test_a_stand_in_process_group_is_accepted(group):
    scaler = lossscale.GradScaler(init_scale=2.0, process_group=group)
    sharded = lossscale.ShardedGradScaler(init_scale=2.0, process_group=group, enabled=True)
    t0, t1 = torch.full((1,), 4.0), torch.full((1,), 8.0)
    for s in (scaler, sharded):
        outputs = s.scale([t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), t1.clone()]])
        assert outputs[0] == 16.0 and outputs[1][0] == 8.0 and outputs[1][1] == 16.0
        assert outputs[2][0] == 8.0 and outputs[2][1] == 16.0 and s._scale.device == t1.device
    with pytest.raises(ValueError, match="process_group='world'"):
        lossscale.GradScaler(process_group="world")


def test_inf_gradients_skip_the_step_of_the_sharded_scaler():
    # upstream test_inf_gradients_skip_optim_step.
    scaler = lossscale.ShardedGradScaler(init_scale=2.0, process_group=DummyProcessGroup(0, 1), enabled=True)
    t0 = torch.tensor([float("inf")])
    t0.grad = t0.clone()
    scaler.scale(torch.full((1,), 4.0))
    assert scaler.step(torch.optim.SGD([t0], lr=1.0)) is None


# ------------------------------------------------------------------ torch's private names
def _storm(g, inject):
    """Gradients of mixed dtypes and layouts (torch's "perfect storm"), an inf written into one."""
    grads = [g.clone(), g.clone()[:, :5], g.to(torch.float16), g.to(torch.float16)]
    if inject >= 0:
        grads[inject][2, 2] = float("inf")
    return grads


@pytest.mark.parametrize("scaler_type", [lossscale.GradScaler, lossscale.ShardedGradScaler])
def test_unscale_grads_groups_by_dtype_and_finds_an_inf_anywhere(scaler_type):
    # upstream test_grad_scaling_unscale: _unscale_grads_ called directly, on a scaler never used, again
    # and again (no update between), with FP16 gradients allowed.
    g = torch.full((20, 20), 4.0)
    inv_scale = torch.full((1,), 0.25)
    scaler = scaler_type()
    params = [torch.empty_like(x) for x in _storm(g, -1)]
    opt = torch.optim.SGD(params, lr=1.0)
    for inject in range(-1, len(params)):
        found_inf = torch.full((1,), 0.0)
        grads = _storm(g, inject)
        for p, grad in zip(params, grads):
            p.grad = grad
        per_device = scaler._unscale_grads_(opt, inv_scale, found_inf, True)
        assert sum(v.item() for v in per_device.values()) == (inject >= 0)
        # torch's contract: the found_inf passed in is the entry of its own device, written in place
        # (kills a fresh flag made for that device too).
        assert per_device[found_inf.device] is found_inf and found_inf.item() == (inject >= 0)
        if inject < 0:
            assert all(torch.equal(x, torch.ones_like(x)) for x in grads)
    if scaler_type is lossscale.ShardedGradScaler:  # its allow_fp16 defaults to True, as torch's
        assert sum(v.item() for v in scaler._unscale_grads_(opt, inv_scale, torch.zeros(1)).values()) == 1


def test_sparse_fp16_gradients_are_coalesced_before_the_check():
    # upstream test_grad_scaling_unscale_sparse: 64000 + 64000 overflows fp16 only once coalesced.
    scaler = lossscale.ShardedGradScaler(init_scale=2.0, process_group=DummyProcessGroup(0, 1))
    i = torch.tensor([[0, 1, 0], [2, 0, 2]])
    p = torch.sparse_coo_tensor(i, torch.tensor([1.0, 2.0, 3.0]), (2, 3)).coalesce().half()
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.sparse_coo_tensor(i, torch.tensor([64000.0, 32.0, 64000.0]), (2, 3), dtype=torch.float16)
    found_inf = torch.zeros(1)
    assert scaler._unscale_grads_(opt, torch.full((1,), 0.5), found_inf)[found_inf.device].item() == 1.0
    p.grad = torch.sparse_coo_tensor(i, torch.tensor([16.0, 32.0, 64.0]), (2, 3), dtype=torch.float16)
    found_inf.zero_()
    assert scaler._unscale_grads_(opt, torch.full((1,), 0.5), found_inf)[found_inf.device].item() == 0.0
    assert torch.equal(p.grad.to_dense(), torch.tensor([[0.0, 0.0, 40.0], [16.0, 0.0, 0.0]], dtype=torch.float16))


def test_scale_and_growth_tracker_are_the_live_state_and_torchs_attributes_read_as_torchs():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ours = lossscale.GradScaler(init_scale=2.0**10, growth_interval=3)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    for s in (ours, ref):
        assert (
            s._init_scale,
            s._growth_factor,
            s._backoff_factor,
            s._growth_interval,
            s._enabled,
            s._init_growth_tracker,
        ) == (2.0**10, 2.0, 0.5, 3, True, 0)
    ours.scale(model(torch.ones(1, 3)).sum()).backward()
    scale, tracker = ours._scale, ours._growth_tracker
    ours.unscale_(opt)
    record = ours._per_optimizer_states[id(opt)]
    assert record["stage"] is OptState.UNSCALED is torch.amp.grad_scaler.OptState.UNSCALED
    assert [v.item() for v in record["found_inf_per_device"].values()] == [0.0]
    ours.step(opt)
    ours.update()
    assert ours._scale is scale and ours._growth_tracker is tracker  # the state, not a copy
    assert (scale.dtype, tracker.dtype, int(tracker.item())) == (torch.float32, torch.int32, 1)
    scale.fill_(2.0**5)  # code that writes torch's _scale writes the scale
    assert ours.get_scale() == 2.0**5
    ours._growth_interval = 7
    assert ours.get_growth_interval() == 7


def test_a_patched_unscale_grads_changes_what_unscale_and_step_do():
    # kohya's sd-scripts --full_fp16: GradScaler._unscale_grads_ wrapped to force allow_fp16=True.
    torch.manual_seed(0)
    p_ref = torch.nn.Parameter(torch.randn(8).half())
    p_ours = torch.nn.Parameter(p_ref.detach().clone())
    results = []
    for scaler_cls, p in ((torch.amp.GradScaler, p_ref), (lossscale.GradScaler, p_ours)):
        original = scaler_cls._unscale_grads_
        scaler = scaler_cls(
            "cpu",
            init_scale=2.0**8,
            **({} if scaler_cls is torch.amp.GradScaler else dict(min_scale=None, max_scale=None, loss_check=False)),
        )
        scaler._unscale_grads_ = lambda o, inv, found, allow, s=scaler, f=original: f(s, o, inv, found, True)
        opt = torch.optim.SGD([p], lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            scaler.scale((p.float() ** 2).sum()).backward()
            scaler.step(opt)
            scaler.update()
        results.append(p.detach().clone())
    assert torch.equal(*results)


# ------------------------------------------------------------------ FP16 gradients
def _fp16_model(kind):
    """A full-FP16 model, or an FP32 base with an FP16 LoRA-style adapter (only it trains)."""
    torch.manual_seed(0)
    if kind == "full fp16":
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).half()
        return model, list(model.parameters())
    base = torch.nn.Linear(8, 4)
    base.requires_grad_(False)
    down, up = torch.nn.Linear(8, 2, bias=False).half(), torch.nn.Linear(2, 4, bias=False).half()
    torch.nn.init.normal_(up.weight, std=1e-3)

    class Adapted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base, self.down, self.up = base, down, up

        def forward(self, x):
            return self.base(x) + self.up(self.down(x.half())).float()

    model = Adapted()
    return model, list(down.parameters()) + list(up.parameters())


def _optimizer(kind, params, sgd_lr=0.1):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=sgd_lr)
    # eps=1e-4: AdamW's default 1e-8 is 0 in FP16, and its foreach form keeps its state in the parameters'
    # dtype (the fused kernel computes in float32).
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-4, foreach=kind == "adamw foreach", fused=kind == "adamw fused")


@pytest.mark.parametrize("model_kind", ["full fp16", "fp16 adapter"])
@pytest.mark.parametrize("opt_kind", ["sgd", "adamw foreach", "adamw fused"])
def test_fp16_gradients_train_with_the_opt_in_and_their_flushed_values_are_counted(model_kind, opt_kind):
    model, params = _fp16_model(model_kind)
    opt = _optimizer(opt_kind, params, sgd_lr=100.0)  # the gradients below are small
    scaler = lossscale.GradScaler(allow_fp16=True)
    before = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(1)
    flushed = 0
    for _ in range(4):
        opt.zero_grad()
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        out = model(x.half() if model_kind == "full fp16" else x).float()
        scaler.scale(((out - y) ** 2).mean() * 2.0**-12).backward()  # small gradients: some flush
        if opt_kind != "adamw fused":  # the unscale itself is what flushes; count it independently
            scaled = [p.grad.clone() for p in params]
            inv = scaler._scale.double().reciprocal().float()
            flushed += sum(int(((s != 0) & ((s * inv) == 0)).sum()) for s in scaled)
        scaler.step(opt)
        scaler.update()
    assert all(torch.isfinite(p).all() for p in params)
    assert any(not torch.equal(a, b) for a, b in zip(before, params))
    counted = scaler.metrics()["fp16_flushed"]
    assert counted == flushed and scaler.health().fp16_flushed == counted
    if counted:
        assert f"flushed {counted} value(s)" in scaler.health().text
    assert scaler.state_dict()["fp16_flushed"] == counted
    again = lossscale.GradScaler(allow_fp16=True)
    again.load_state_dict(scaler.state_dict())
    assert again.metrics()["fp16_flushed"] == counted


@pytest.mark.parametrize("opt_kind", ["sgd", "adamw foreach"])
def test_the_flushed_count_is_exact_on_planted_values(opt_kind):
    # At scale 2**16, a scaled FP16 gradient of 2**-10 unscales to 2**-26, which FP16 rounds to 0; one of
    # 2**-9 to 2**-25, its smallest subnormal's half: a tie, rounded to even, 0 too; 2**-8 survives.
    p = torch.nn.Parameter(torch.zeros(6, dtype=torch.float16))
    opt = _optimizer(opt_kind, [p])
    scaler = lossscale.GradScaler(allow_fp16=True)
    for _ in range(2):
        scaler.scale(torch.ones(()))
        p.grad = torch.tensor([2.0**-10, 2.0**-9, 2.0**-8, -(2.0**-10), 0.0, 1.0], dtype=torch.float16)
        scaler.step(opt)
        scaler.update()
    assert scaler.metrics()["fp16_flushed"] == 2 * 3
    assert scaler.health().fp16_flushed == 6 and "flushed 6 value(s)" in scaler.health().text


def test_the_flushed_count_with_fp32_gradients_before_the_fp16_ones():
    """Gradients are unscaled per (device, dtype) group, and the FP16 group's flushed values are counted
    whichever gradient comes first. Kills: grouping by device alone (the group's first gradient, FP32,
    would then decide that nothing in it is counted)."""
    w = torch.nn.Parameter(torch.zeros(3))
    p = torch.nn.Parameter(torch.zeros(6, dtype=torch.float16))
    opt = torch.optim.SGD([w, p], lr=1.0)
    scaler = lossscale.GradScaler(allow_fp16=True)
    scaler.scale(torch.ones(()))
    w.grad = torch.ones(3)
    p.grad = torch.tensor([2.0**-10, 2.0**-9, 2.0**-8, -(2.0**-10), 0.0, 1.0], dtype=torch.float16)
    scaler.step(opt)
    scaler.update()
    assert scaler.metrics()["fp16_flushed"] == 3


@pytest.mark.parametrize("opt_kind", ["sgd", "adamw foreach"])
def test_the_flushed_count_is_exact_on_a_measuring_policys_path(opt_kind):
    """A measuring policy reads the scaled gradients first, then unscales them with a plain multiply:
    the values that multiply flushes are counted the same (the planted ones above, at the first step's
    scale 2**16). Kills: that multiply left uncounted, or its counting given the wrong arguments."""
    p = torch.nn.Parameter(torch.zeros(6, dtype=torch.float16))
    opt = _optimizer(opt_kind, [p])
    scaler = lossscale.GradScaler(policy="adaptive", allow_fp16=True)
    scaler.scale(torch.ones(()))
    p.grad = torch.tensor([2.0**-10, 2.0**-9, 2.0**-8, -(2.0**-10), 0.0, 1.0], dtype=torch.float16)
    scaler.unscale_(opt)
    assert torch.equal(p.grad, torch.tensor([0.0, 0.0, 2.0**-24, 0.0, 0.0, 2.0**-16], dtype=torch.float16))
    scaler.step(opt)
    scaler.update()
    assert scaler.metrics()["fp16_flushed"] == 3


@pytest.mark.parametrize("opt_kind", ["sgd", "adamw foreach"])
def test_fp16_gradients_without_the_opt_in_raise_with_what_to_do(opt_kind):
    model, params = _fp16_model("full fp16")
    opt = _optimizer(opt_kind, params)
    scaler = lossscale.GradScaler()
    scaler.scale(model(torch.randn(2, 8).half()).float().sum()).backward()
    before = scaler.state()
    with pytest.raises(ValueError, match="FP16 gradients.*allow_fp16=True"):
        scaler.step(opt)
    assert scaler.state() == before


def test_fused_optimizers_take_fp16_gradients_without_the_opt_in_exactly():
    # The fused kernel takes grad_scale and unscales in float32: bitwise torch's GradScaler there.
    results = []
    for scaler in (torch.amp.GradScaler("cpu"), lossscale.GradScaler(min_scale=None, max_scale=None, loss_check=False)):
        model, params = _fp16_model("full fp16")
        opt = _optimizer("adamw fused", params)
        for step in range(3):
            opt.zero_grad()
            scaler.scale(model(torch.ones(4, 8).half() * (step + 1)).float().pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
        results.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_the_sharded_scaler_trains_fp16_gradients_as_torchs_sharded_scaler_does_by_default():
    model, params = _fp16_model("full fp16")
    twin = copy.deepcopy(model)
    ours = lossscale.ShardedGradScaler(init_scale=2.0**8, min_scale=None, max_scale=None, loss_check=False)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    original = torch.amp.GradScaler._unscale_grads_
    ref._unscale_grads_ = lambda o, inv, found, allow: original(ref, o, inv, found, True)  # as ShardedGradScaler
    runs = []
    for m, scaler in ((model, ours), (twin, ref)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            scaler.scale(m(torch.ones(4, 8).half()).float().pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
        runs.append([p.detach().clone() for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


# ------------------------------------------------------------------ a load in mid-iteration
def _fresh_pair(optimizer):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.1)
        if optimizer == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    )
    return model, opt


@pytest.mark.parametrize("optimizer", ["sgd", "fused adamw"])
@pytest.mark.parametrize("call", ["unscale_", "step", "clip_grad_norm_"])
def test_the_gradients_of_an_iteration_a_load_discarded_are_refused_not_stepped(call, optimizer):
    # The gradients in flight carry 2**16, the checkpoint's scale is 2**10: unscaled by the loaded scale
    # they would step 64x too far (torch does, silently). The iteration is refused until a new backward.
    checkpoint = lossscale.GradScaler(init_scale=2.0**10).state_dict()
    model, opt = _fresh_pair(optimizer)
    scaler = lossscale.GradScaler()
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    with pytest.warns(RuntimeWarning, match="mid-iteration"):
        scaler.load_state_dict(checkpoint)
    weights = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="zero the gradients"):
        if call == "clip_grad_norm_":
            scaler.clip_grad_norm_(opt, 1.0)
        else:
            getattr(scaler, call)(opt)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    # A new backward is the loaded run's iteration: bitwise a scaler that loaded between iterations.
    ref_model, ref_opt = _fresh_pair(optimizer)
    ref = lossscale.GradScaler()
    ref.load_state_dict(checkpoint)
    for m, o, s in ((model, opt, scaler), (ref_model, ref_opt, ref)):
        o.zero_grad()
        s.scale(m(torch.ones(2, 3)).sum()).backward()
        s.step(o)
        s.update()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
    assert scaler.state() == ref.state()


def test_discard_iteration_after_zeroing_the_gradients_lets_the_loop_go_on():
    # A rank that never calls scale() (a pipeline stage) says the gradients were zeroed this way.
    model, opt = _fresh_pair("sgd")
    scaler = lossscale.GradScaler()
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    with pytest.warns(RuntimeWarning, match="mid-iteration"):
        scaler.load_state_dict(lossscale.GradScaler(init_scale=2.0**10).state_dict())
    opt.zero_grad()
    scaler.discard_iteration()
    scaler.unscale_(opt)  # no gradients: nothing to refuse
    scaler.step(opt)
    scaler.update()
    assert scaler.state().steps == 1


# ------------------------------------------------------------------ torch's record shapes and getters
@pytest.mark.parametrize("lazy", [True, False], ids=["after scale()", "fresh"])
def test_a_new_optimizers_record_is_torchs_fresh_record(lazy):
    # upstream test_pickle_gradscaler: b._per_optimizer_states["fdsa"] == _refresh_per_optimizer_state().
    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    a = lossscale.GradScaler("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    if lazy:
        a.scale(torch.tensor([4.0]))
    b = pickle.loads(pickle.dumps(a))
    assert b._per_optimizer_states["fdsa"] == _refresh_per_optimizer_state()
    assert a._per_optimizer_states["new key"] == _refresh_per_optimizer_state()
    p = torch.nn.Parameter(torch.ones(2))  # a checked optimizer's record has torch's two keys only
    opt = torch.optim.SGD([p], lr=0.1)
    a.scale(p.sum()).backward()
    a.unscale_(opt)
    assert set(a._per_optimizer_states[id(opt)]) == set(_refresh_per_optimizer_state())


@pytest.mark.parametrize("policy", lossscale.policy.policy_names())
def test_the_getters_say_what_the_state_dict_says(policy):
    # One answer: what a torch scaler that loads state_dict() reports is what the getters report.
    scaler = lossscale.GradScaler(policy=policy)
    sd = scaler.state_dict()
    ours = (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval())
    assert ours == (sd["growth_factor"], sd["backoff_factor"], sd["growth_interval"])
    ref = torch.amp.GradScaler("cpu")
    ref.load_state_dict(sd)
    assert ours == (ref.get_growth_factor(), ref.get_backoff_factor(), ref.get_growth_interval())


@pytest.mark.parametrize("torch_scale, bound", [(2.0**26, "max_scale"), (2.0**-30, "min_scale")])
def test_a_torch_checkpoint_beyond_the_default_bounds_loads_and_moves_the_bound(torch_scale, bound):
    # torch's scale is unbounded: a torch checkpoint at 2**26 is valid and must load, as init_scale=2**26 does.
    ref = torch.amp.GradScaler("cpu", init_scale=torch_scale)
    scaler = lossscale.GradScaler()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler.load_state_dict(ref.state_dict())
    assert len(caught) == 1 and bound in str(caught[0].message), [str(w.message) for w in caught]
    assert scaler.get_scale() == torch_scale and getattr(scaler.policy, bound) == torch_scale
    p = torch.nn.Parameter(torch.ones(2))  # and it goes on as torch's
    for s in (scaler, ref):
        opt = torch.optim.SGD([p], lr=0.0)
        s.scale(p.sum()).backward()
        s.step(opt)
        s.update()
    assert scaler.get_scale() == ref.get_scale()


def test_sparse_fp32_gradients_are_not_coalesced_by_the_check():
    # torch coalesces only FP16 sparse gradients before its check (their duplicates may overflow
    # once summed); an FP32 one stays as the user made it, and is unscaled value by value.
    scaler = lossscale.GradScaler("cpu", init_scale=2.0)
    i = torch.tensor([[0, 1, 0], [2, 0, 2]])
    p = torch.nn.Parameter(torch.zeros(2, 3))
    opt = torch.optim.SGD([p], lr=1.0)
    grad = torch.sparse_coo_tensor(i, torch.tensor([4.0, 8.0, 2.0]), (2, 3))
    assert not grad.is_coalesced()
    p.grad = grad
    scaler.scale(p.sum())  # a device for the scaler's state
    scaler.unscale_(opt)
    assert p.grad is grad and not p.grad.is_coalesced()
    assert torch.equal(p.grad._values(), torch.tensor([2.0, 4.0, 1.0]))
