"""Differential tests: lossscale.GradScaler configured like torch is bitwise torch.amp.GradScaler("cpu")."""

import warnings

import pytest
import torch
from _models import TORCH_LIKE, backward, inject, make_optimizer, params_equal, states_equal, twins, two_optimizer_run

import lossscale


@pytest.mark.parametrize("kind", ["sgd", "adam", "fused_adam"])
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_bitwise_identical_to_torch(kind, clip, seed):
    model_t, model_l = twins(seed)
    opt_t, opt_l = make_optimizer(kind, model_t.parameters()), make_optimizer(kind, model_l.parameters())
    cfg = dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ref = torch.amp.GradScaler("cpu", **cfg)
    ours = lossscale.GradScaler("cpu", **cfg, **TORCH_LIKE)
    # loss_mult lifts gradients so the 2**16 start overflows in fp16 now and then, besides injections.
    for step in range(40):
        for model, opt, scaler in ((model_t, opt_t, ref), (model_l, opt_l, ours)):
            opt.zero_grad(set_to_none=True)
            backward(model, scaler, step, loss_mult=4.0)
            inject(model, step, rate=0.2, seed=seed)
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
        assert ref.get_scale() == ours.get_scale(), step
        assert ref._get_growth_tracker() == ours._get_growth_tracker(), step
        assert params_equal(model_t, model_l), step
        assert states_equal(opt_t, opt_l), step
    assert ours.skipped_steps > 0  # the run exercised the skip path


def test_scale_trajectory_matches_torch_under_random_flags():
    # Drive both scalers with forced inf at random iterations and a mix of factors; compare every scale.
    g = torch.Generator().manual_seed(5)
    for growth, backoff, interval in [(2.0, 0.5, 1), (4.0, 0.25, 2), (1.5, 0.7, 3)]:
        p_t = torch.nn.Parameter(torch.ones(3))
        p_l = torch.nn.Parameter(torch.ones(3))
        opt_t, opt_l = torch.optim.SGD([p_t], lr=0.1), torch.optim.SGD([p_l], lr=0.1)
        ref = torch.amp.GradScaler(
            "cpu", init_scale=1000.0, growth_factor=growth, backoff_factor=backoff, growth_interval=interval
        )
        with pytest.warns(UserWarning, match="power of two"):
            ours = lossscale.GradScaler(
                init_scale=1000.0, growth_factor=growth, backoff_factor=backoff, growth_interval=interval, **TORCH_LIKE
            )
        for _ in range(60):
            bad = torch.rand((), generator=g).item() < 0.3
            for p, opt, s in ((p_t, opt_t, ref), (p_l, opt_l, ours)):
                opt.zero_grad()
                s.scale(p.sum()).backward()
                if bad:
                    p.grad[0] = float("inf")
                s.step(opt)
                s.update()
            assert ref.get_scale() == ours.get_scale()
            assert torch.equal(p_t, p_l)


@pytest.mark.filterwarnings("ignore:lossscale. the checkpoint.s policy replaces:UserWarning")  # by design here
def test_state_dict_is_torch_loadable_and_torch_state_loads():
    ours = lossscale.GradScaler(init_scale=2.0**10, growth_interval=7, **TORCH_LIKE)
    ref = torch.amp.GradScaler("cpu")
    ref.load_state_dict(ours.state_dict())
    assert ref.get_scale() == 2.0**10 and ref.get_growth_interval() == 7
    ref2 = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=5)
    ours2 = lossscale.GradScaler(**TORCH_LIKE)
    ours2.load_state_dict(ref2.state_dict())
    assert ours2.get_scale() == 2.0**12 and ours2.get_growth_interval() == 5


@pytest.mark.parametrize("kind", ["inf", "nan"])
@pytest.mark.parametrize("unscale_first", [False, True])
def test_two_optimizers_overflow_in_the_first_backs_off_like_torch(kind, unscale_first):
    """Kills: ``update()`` combining only the last stepped optimizer's found_inf
    (``sum_flags([f.found_inf for f in flags][-1:], ...)`` in scaler.update): the first optimizer's
    step is still skipped, but the scale stays at 65536 where torch backs off to 32768."""
    bad = {1, 2, 4}
    ref = two_optimizer_run(torch.amp.GradScaler("cpu", growth_interval=2), bad, kind, unscale_first)
    ours = two_optimizer_run(lossscale.GradScaler("cpu", growth_interval=2, **TORCH_LIKE), bad, kind, unscale_first)
    assert ours[2] == ref[2]
    assert ref[2][1] == 2.0**15  # the overflow in the first optimizer backed off
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


def test_unscale_after_device_updates_divides_by_the_live_scale():
    """The host sends torch's inverse scale with every state it computes, and ``unscale_`` reads it;
    an update on device (fused optimizer) moves the scale without it. Kills: unscaling by a stale
    inverse after a device update (gradients off by the growth factor), and an inverse that is not
    torch's ``scale.double().reciprocal().float()`` (a non-power-of-two factor makes it round)."""
    g = torch.Generator().manual_seed(3)
    runs = []
    for make in (
        lambda: torch.amp.GradScaler("cpu", init_scale=1000.0, growth_factor=1.5, growth_interval=1),
        lambda: lossscale.GradScaler(init_scale=1000.0, growth_factor=1.5, growth_interval=1, **TORCH_LIKE),
    ):
        torch.manual_seed(0)
        fused_p, plain_p = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(5))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "lossscale.*power of two", UserWarning)  # on purpose here
            scaler = make()
        runs.append(
            (
                scaler,
                fused_p,
                plain_p,
                torch.optim.Adam([fused_p], lr=0.01, fused=True),
                torch.optim.SGD([plain_p], lr=0.1),
            )
        )
    used_fused = 0
    for step in range(30):
        fused = torch.rand((), generator=g).item() < 0.5
        bad = torch.rand((), generator=g).item() < 0.2
        used_fused += fused
        grads = []
        for scaler, fused_p, plain_p, fused_opt, plain_opt in runs:
            p, opt = (fused_p, fused_opt) if fused else (plain_p, plain_opt)
            opt.zero_grad()
            scaler.scale((p * p).sum() * 1e-3).backward()
            if bad:
                p.grad[1] = float("inf")
            scaler.unscale_(opt)
            grads.append(p.grad.clone())
            scaler.step(opt)
            scaler.update()
        (ref, *ref_params), (ours, *our_params) = [(r[0], r[1], r[2]) for r in runs]
        assert torch.equal(grads[0], grads[1]), step
        assert ref.get_scale() == ours.get_scale(), step
        assert all(torch.equal(a, b) for a, b in zip(ref_params, our_params)), step
    assert 5 < used_fused < 25


class _UnscalesItself(torch.optim.Optimizer):
    """Stands in for apex's DistributedFusedAdam / DistributedFusedLAMB (and NeMo's distributed optimizers):
    ``_step_supports_amp_scaling = True`` and ``step(grad_scaler=)``, so the scaler passes itself and the
    optimizer unscales, checks and skips by itself, as apex's do: it reads its record's stage (still
    scaled: divide by ``grad_scaler._scale``), then either calls ``grad_scaler._check_inf_per_device(self)``
    ("check"), or finds the overflow from its gradient norm and writes ``found_inf_per_device`` into
    ``grad_scaler._per_optimizer_states[id(self)]`` (as a whole: "write", DistributedFusedAdam; one device's
    entry: "write_entry", DistributedFusedLAMB); it returns early on an overflow. A plain SGD step."""

    def __init__(self, params, lr: float, variant: str):
        super().__init__(params, dict(lr=lr))
        self._step_supports_amp_scaling = True
        self.variant = variant

    @torch.no_grad()
    def step(self, closure=None, *, grad_scaler=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        scale = None
        if grad_scaler is not None:
            record = grad_scaler._per_optimizer_states[id(self)]
            if record["stage"] is lossscale.OptState.READY:  # the gradients still carry the scale
                scale = grad_scaler._scale
            if self.variant == "check":
                found_inf = sum(grad_scaler._check_inf_per_device(self).values())
            else:
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
                found_inf = (~torch.isfinite(norm)).float()
                if self.variant == "write":
                    record["found_inf_per_device"] = {found_inf.device: found_inf}
                else:
                    record["found_inf_per_device"][found_inf.device] = found_inf
            if found_inf.item():
                return None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad if scale is None else p.grad / scale, alpha=-group["lr"])
        return None


@pytest.mark.filterwarnings("ignore:.*grad_scaler.*:FutureWarning")  # both scalers warn: torch deprecates it
@pytest.mark.filterwarnings("ignore:GradScaler is going to stop:FutureWarning")
@pytest.mark.parametrize("unscale_first", [False, True], ids=["scaled", "unscale_ first"])
@pytest.mark.parametrize("variant", ["check", "write", "write_entry"])
def test_an_optimizer_that_unscales_itself_trains_as_under_torchs_scaler(variant, unscale_first):
    # torch's step(grad_scaler=) contract, beside torch's scaler: the same weights and scale bitwise over
    # steps that grow the scale and two inf steps that must skip (the weights do not move) and back off.
    ref_model, model = twins()
    ref_opt = _UnscalesItself(ref_model.parameters(), 0.1, variant)
    opt = _UnscalesItself(model.parameters(), 0.1, variant)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    ours = lossscale.GradScaler("cpu", init_scale=2.0**10, growth_interval=3, **TORCH_LIKE)
    inf_steps = (4, 5)
    for step in range(10):
        for m, o, scaler in ((ref_model, ref_opt, ref), (model, opt, ours)):
            o.zero_grad()
            backward(m, scaler, step)
            if step in inf_steps:
                m[0].weight.grad[0, 0] = float("inf")
            if unscale_first:
                scaler.unscale_(o)
            before = [p.detach().clone() for p in m.parameters()]
            scaler.step(o)
            moved = not all(torch.equal(p, q) for p, q in zip(m.parameters(), before))
            assert moved is (step not in inf_steps), (step, type(scaler))
            assert scaler._per_optimizer_states[id(o)]["stage"] is lossscale.OptState.STEPPED
            scaler.update()
        assert params_equal(ref_model, model), step
        assert torch.equal(ref._scale, ours._scale) and torch.equal(ref._growth_tracker, ours._growth_tracker), step
    assert ours.get_scale() == ref.get_scale() == 2.0**10 * 2 / 4 * 2  # grown, backed off twice, grown again
    c = ours.counters()
    assert (c["steps"], c["skipped_steps"]) == (10, 2)


def test_without_a_floor_the_scale_backs_off_to_zero_bitwise_as_torchs():
    # min_scale=None is torch's rule all the way: with an inf on every step, through float32's subnormals
    # (below 2**-126) down to 0.0, the same float32 scale as torch's at every step; the state dict at each
    # of those scales goes both ways (torch's loads lossscale's, lossscale's loads torch's).
    ref = torch.amp.GradScaler("cpu")
    ours = lossscale.GradScaler("cpu", **TORCH_LIKE)
    p_ref, p_ours = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    o_ref, o_ours = torch.optim.SGD([p_ref], lr=0.1), torch.optim.SGD([p_ours], lr=0.1)
    seen = set()
    for step in range(170):  # 2**16 halves to 2**-149 (float32's smallest subnormal) in 165 steps, then to 0
        for scaler, p, o in ((ref, p_ref, o_ref), (ours, p_ours, o_ours)):
            o.zero_grad()
            scaler.scale(p.sum()).backward()
            p.grad[0] = float("inf")
            scaler.step(o)
            scaler.update()
        assert torch.equal(ref._scale, ours._scale), (step, ref._scale, ours._scale)
        seen.add(ours.get_scale())
        if step in (150, 166, 169):  # a subnormal scale and 0.0: checkpoints both ways
            back = torch.amp.GradScaler("cpu")
            back.load_state_dict(ours.state_dict())
            assert back.get_scale() == ours.get_scale()
            again = lossscale.GradScaler("cpu", **TORCH_LIKE)
            again.init_device("cpu")
            again.load_state_dict(ref.state_dict())
            assert torch.equal(again._scale, ref._scale)
    assert ours.get_scale() == ref.get_scale() == 0.0 and 2.0**-149 in seen
    assert torch.equal(p_ref, p_ours) and torch.equal(p_ours, torch.ones(2))  # every step skipped
    assert ours.counters()["skipped_steps"] == 170
