"""torch's own GradScaler training tests, by name, run on ``lossscale.GradScaler``.

pytorch's ``test/test_torch.py`` (``TestTorchDeviceType``, CPU instantiation) checks each recipe below
by training a tiny model twice, with and without the scaler, and comparing. Written here from what each
upstream test checks, not copied: every recipe runs once with ``torch.amp.GradScaler("cpu")`` and once
with ``lossscale.GradScaler`` configured like torch, and the two must agree bitwise (parameters,
optimizer state, scale after every step), besides the upstream expectation on the final scale. The
other upstream GradScaler tests (``test_grad_scaling_unscale``, ``_unscale_sparse``, ``_state_dict``,
``test_pickle_gradscaler``, ``test_grad_scale_will_not_overflow``) are in ``tests/test_torch_compat.py``;
``test_grad_scaling_update_scale`` tests torch's kernel alone and ``test_grad_scaler_deprecated_warning``
torch's own deprecation warning, neither of which involves a scaler object.
"""

import pickle

import pytest
import torch
from _models import TORCH_LIKE

import lossscale

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny ops, one thread

SKIP_AT = 2  # the iteration whose gradient gets an inf (upstream's skip_iter)
INIT, GROWTH = 128.0, 2.0


def _scalers():
    """torch's scaler and lossscale's, as upstream configures it: growth every step, so that a wrong
    growth or backoff shows at once."""
    return (
        torch.amp.GradScaler("cpu", init_scale=INIT, growth_factor=GROWTH, growth_interval=1),
        lossscale.GradScaler(
            "cpu", **{**TORCH_LIKE, "init_scale": INIT, "growth_factor": GROWTH, "growth_interval": 1}
        ),
    )


def _case(optimizer=torch.optim.SGD, models=1, **kwargs):
    """Seeded tiny models, their optimizers, and four batches: the same for both scalers."""
    torch.manual_seed(0)
    nets = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)) for _ in range(models)]
    opts = [optimizer(net.parameters(), lr=0.25, **kwargs) for net in nets]
    data = [(torch.randn(16, 8), torch.randn(16, 8)) for _ in range(4)]
    return nets, opts, data


def _poison(net):
    with torch.no_grad():
        net[1].weight.grad.fill_(float("inf"))


def _agree(recipe, expected_scale, optimizer=torch.optim.SGD, models=1, **kwargs):
    """``recipe(scaler, nets, opts, data) -> scaler`` run with torch's scaler and lossscale's on equal
    cases; parameters, optimizer state and scales bitwise equal; the final scale as upstream expects."""
    runs = []
    for scaler in _scalers():
        nets, opts, data = _case(optimizer, models, **kwargs)
        scales = []
        scaler = recipe(scaler, nets, opts, data, scales.append)
        params = [p.detach().clone() for net in nets for p in net.parameters()]
        states = [{k: v for k, v in opt.state[p].items()} for opt in opts for p in opt.state]
        runs.append((scaler.get_scale(), scales, params, states))
    (t_scale, t_scales, t_params, t_states), (l_scale, l_scales, l_params, l_states) = runs
    assert l_scales == t_scales and l_scale == t_scale == expected_scale
    assert all(torch.equal(a, b) for a, b in zip(l_params, t_params))
    assert len(l_states) == len(t_states)
    for a, b in zip(l_states, t_states):
        assert a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)
    assert all(torch.isfinite(p).all() for p in l_params)  # the skipped step left no inf behind


def _mse(net, x, y):
    return torch.nn.functional.mse_loss(net(x), y)


@pytest.mark.parametrize(
    "optimizer, kwargs",
    [
        (torch.optim.SGD, {}),
        (torch.optim.SGD, {"foreach": True}),
        (torch.optim.SGD, {"fused": True}),
        (torch.optim.Adam, {}),
        (torch.optim.Adam, {"foreach": True}),
        (torch.optim.Adam, {"fused": True}),
        (torch.optim.AdamW, {}),
        (torch.optim.AdamW, {"foreach": True}),
        (torch.optim.AdamW, {"fused": True}),
    ],
    ids=lambda v: getattr(v, "__name__", None) or ",".join(v) or "default",
)
@pytest.mark.parametrize("pickled", [False, True], ids=["", "pickled"])
def test_grad_scaling_autocast(optimizer, kwargs, pickled):
    # FP16 autocast forward; the scaler pickled and unpickled after every update when ``pickled``.
    def recipe(scaler, nets, opts, data, log):
        (net,), (opt,) = nets, opts
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = _mse(net, x, y)
            scaler.scale(loss).backward()
            if i == SKIP_AT:
                _poison(net)
            scaler.step(opt)
            scaler.update()
            log(scaler.get_scale())
            if pickled:
                scaler = pickle.loads(pickle.dumps(scaler))
        return scaler

    _agree(recipe, INIT * GROWTH**3 / 2, optimizer, **kwargs)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW], ids=lambda o: o.__name__)
def test_params_invalidated_with_grads_invalidated_between_unscale_and_step(optimizer):
    # Gradients broken after unscale_() were already checked: the step is taken, the parameters go bad,
    # as in torch (the check is unscale_'s, not step's).
    for scaler in _scalers():
        (net,), (opt,), data = _case(optimizer)
        for x, y in data:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = _mse(net, x, y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            for j, p in enumerate(net.parameters()):
                p.grad.fill_(float("inf") if j % 2 else float("nan"))
            scaler.step(opt)
            scaler.update()
        assert all(not torch.isfinite(p).all() for p in net.parameters()), type(scaler)


def test_grad_scaling_clipping():
    # Clip the scaled gradients to max_norm times the scale (no unscale_ first).
    def recipe(scaler, nets, opts, data, log):
        (net,), (opt,) = nets, opts
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            scaler.scale(_mse(net, x, y)).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.2 * scaler.get_scale())
            if i == SKIP_AT:
                _poison(net)
            scaler.step(opt)
            scaler.update()
            log(scaler.get_scale())
        return scaler

    _agree(recipe, INIT * GROWTH**3 / 2)


def test_grad_scaling_clipping_separate_unscale():
    # unscale_(), then clip the true gradients (an inf among them: error_if_nonfinite=False).
    def recipe(scaler, nets, opts, data, log):
        (net,), (opt,) = nets, opts
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            scaler.scale(_mse(net, x, y)).backward()
            if i == SKIP_AT:
                _poison(net)
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.2, error_if_nonfinite=False)
            scaler.step(opt)
            scaler.update()
            log(scaler.get_scale())
        return scaler

    _agree(recipe, INIT * GROWTH**3 / 2)


def test_grad_scaling_penalty():
    # A gradient penalty: autograd.grad of the scaled loss, unscaled by hand with 1/get_scale().
    def recipe(scaler, nets, opts, data, log):
        (net,), (opt,) = nets, opts
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            loss = _mse(net, x, y)
            grads = torch.autograd.grad(scaler.scale(loss), list(net.parameters()), create_graph=True)
            inv = 1.0 / scaler.get_scale()
            penalty = sum((g * inv).pow(2).sum() for g in grads).sqrt()
            scaler.scale(loss + penalty).backward()
            if i == SKIP_AT:
                _poison(net)
            scaler.step(opt)
            scaler.update()
            log(scaler.get_scale())
        return scaler

    _agree(recipe, INIT * GROWTH**3 / 2)


def test_grad_scaling_accumulation():
    # Two micro-batches per step: step and update every second backward (no skip: upstream's 2 and 0).
    def recipe(scaler, nets, opts, data, log):
        (net,), (opt,) = nets, opts
        for i, (x, y) in enumerate(data):
            scaler.scale(_mse(net, x, y) / 2).backward()
            if (i + 1) % 2 == 0:
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                log(scaler.get_scale())
        return scaler

    _agree(recipe, INIT * GROWTH**2)


def test_grad_scaling_multiple():
    # Two models, two optimizers, two losses each reaching both models; one optimizer unscaled
    # separately; the inf in model 1's gradients skips both steps (one found_inf per iteration).
    def recipe(scaler, nets, opts, data, log):
        for i, (x, y) in enumerate(data):
            for opt in opts:
                opt.zero_grad()
            out0, out1 = nets[0](x), nets[1](x)
            loss0 = torch.nn.functional.mse_loss(0.3 * out0 + 0.7 * out1, y)
            loss1 = torch.nn.functional.mse_loss(0.6 * out0 - 0.4 * out1, y)
            scaler.scale(loss0).backward(retain_graph=True)
            scaler.scale(loss1).backward()
            if i == SKIP_AT:
                _poison(nets[1])
            scaler.unscale_(opts[0])
            scaler.step(opts[0])
            scaler.step(opts[1])
            scaler.update()
            log(scaler.get_scale())
        return scaler

    _agree(recipe, INIT * GROWTH**3 / 2, models=2)


def test_grad_scaler_pass_itself():
    # An optimizer that declares _step_supports_amp_scaling gets the scaler itself (step(grad_scaler=),
    # with torch's FutureWarning) or, without that keyword, grad_scale and found_inf as attributes.
    seen = {}

    class Base(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})
            self._step_supports_amp_scaling = True

    class TakesTheScaler(Base):
        def step(self, closure=None, *, grad_scaler=None):
            seen["scaler"] = grad_scaler
            seen["attributes"] = hasattr(self, "grad_scale") or hasattr(self, "found_inf")

    class TakesAttributes(Base):
        def step(self, closure=None):
            seen["grad_scale"], seen["found_inf"] = self.grad_scale, self.found_inf

    for scaler in _scalers():
        seen.clear()
        net = torch.nn.Linear(4, 1)
        o1, o2 = TakesTheScaler(net.parameters()), TakesAttributes(net.parameters())
        with torch.autocast("cpu", dtype=torch.float16):
            loss = net(torch.randn(4, 4)).mean()
        scaler.scale(loss).backward()
        with pytest.warns(FutureWarning):
            scaler.step(o1)
        scaler.step(o2)
        scaler.update()
        assert seen["scaler"] is scaler and not seen["attributes"], type(scaler)
        assert torch.is_tensor(seen["grad_scale"]) and torch.is_tensor(seen["found_inf"]), type(scaler)
