"""The structure's promises: a torch-free policy core, one code path on every device (the snapshots
that feed the stuck check run on CPU as on CUDA), in-place state, a fused iteration (unscale_ or
clip_grad_norm_, step, update) that compiles whole and bitwise eager, no import cycle, and the opt-in
features loaded only when used. Sizes (lines, functions per iteration) are measured and reported
(``benchmarks/count_iteration.py``, docs/architecture.md), never gated on: a budget shapes the code to
the count."""

import math
import subprocess
import sys
import warnings

import pytest
import torch
from _sync import count_host_syncs

import lossscale
from lossscale.policy import Policy, policy_names


def test_the_policy_core_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import lossscale.policy, lossscale.dynamic, lossscale.static, lossscale.adaptive, lossscale.logmax\n"
        "import lossscale.checkpoint, lossscale.formats\n"
        "from lossscale import DynamicPolicy, AdaptivePolicy, LogMaxPolicy\n"
        "p = DynamicPolicy(growth_interval=1); s = p.update(p.init_state(), False)\n"
        "assert s.scale == 2.0**17, s\n"
        "try:\n    lossscale.GradScaler\nexcept ImportError:\n    print('lazy')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "lazy"  # the torch-facing names load on first use, and need torch


def test_every_registered_policy_follows_the_protocol():
    assert policy_names() == ["adaptive", "dynamic", "logmax", "static"]
    for name in policy_names():
        policy = lossscale.policy.policy_class(name)()
        assert isinstance(policy, Policy), name
        assert isinstance(policy.init_state(), lossscale.ScaleState)


def test_the_public_surface_is_pinned():
    assert lossscale.__all__ == [
        "GradScaler",
        "ShardedGradScaler",
        "SkipIf",
        "OptState",
        "Policy",
        "DynamicPolicy",
        "DynamicState",
        "StaticPolicy",
        "StaticState",
        "AdaptivePolicy",
        "AdaptiveState",
        "LogMaxPolicy",
        "LogMaxState",
        "ScaleState",
        "diagnose",
        "HealthReport",
        "is_power_of_two",
        "formats",
        "grad_stats",
        "GradStats",
        "recommend_scale",
        "ActivationGradRecorder",
        "activation_grad_probe",
        "Telemetry",
        "JsonlLogger",
        "audit",
        "AuditReport",
        "keep_fp32",
        "check_setup",
        "rescale",
        "Rescaling",
        "choose_rescale",
    ]


# ------------------------------------------------------------------ the stuck check, from snapshots
def _stuck_run(scaler, steps, bad_from, fused=True):
    """A one-parameter loop whose gradients are inf from ``bad_from`` on; returns the update at which
    on_stuck='raise' fired (None if never). ``fused``: Adam(fused=True), whose flags stay on device;
    else SGD, whose check syncs to decide the step."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([p], lr=0.1, fused=True) if fused else torch.optim.SGD([p], lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        scaler.scale((p * p).sum()).backward()
        if step >= bad_from:
            p.grad[0] = math.inf
        scaler.step(opt)
        try:
            scaler.update()
        except RuntimeError as e:
            assert "consecutive skipped step" in str(e)
            return step
    return None


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "synced"])
def test_on_stuck_fires_at_the_stuck_update_on_the_cpu_on_every_path(fused):
    # Every update sends a snapshot of the state to the host; on the CPU it has landed when it is
    # made, so the streak that reaches max_consecutive_skips at update 4 is reported at update 4.
    scaler = lossscale.GradScaler("cpu", on_stuck="raise", max_consecutive_skips=2)
    assert _stuck_run(scaler, 10, bad_from=3, fused=fused) == 4


def _lagging(monkeypatch, lag):
    """Snapshots that land only once ``lag`` newer ones have been made: a copy from a GPU that runs
    ``lag`` updates behind the host."""
    from lossscale import _state

    made = {}
    real_init = _state.Snapshot.__init__

    def init(self, t, evidence=None):
        real_init(self, t, evidence)
        made[id(self)] = len(made)

    monkeypatch.setattr(_state.Snapshot, "__init__", init)
    monkeypatch.setattr(_state.Snapshot, "landed", lambda self: len(made) - made[id(self)] > lag)


def test_a_lagging_device_reports_later_but_never_loses_the_stuck_state(monkeypatch):
    _lagging(monkeypatch, lag=2)
    scaler = lossscale.GradScaler("cpu", on_stuck="raise", max_consecutive_skips=2)
    fired = _stuck_run(scaler, 12, bad_from=3)
    assert fired is not None and fired > 4


def test_snapshots_in_flight_are_read_in_order_and_the_account_misses_no_step(monkeypatch):
    _lagging(monkeypatch, lag=3)
    scaler = lossscale.GradScaler("cpu", growth_interval=3)
    seen = []
    real = scaler._health.record
    scaler._health.record = lambda policy, state, *rest: (seen.append(state.steps), real(policy, state, *rest))
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([p], lr=0.1, fused=True)
    for step in range(12):
        scaler.scale((p * p).sum()).backward()
        if step in (4, 5):
            p.grad[0] = math.nan
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert seen == sorted(seen) and len(set(seen)) == len(seen)  # each once, oldest first
    report = scaler.health()  # reads the state now: the account covers every step
    assert report.steps == 12 and report.skipped == 2


def test_a_caught_raise_does_not_raise_again_once_training_is_clean():
    scaler = lossscale.GradScaler("cpu", on_stuck="raise", max_consecutive_skips=1)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    raised = []
    for step in range(8):
        opt.zero_grad()
        scaler.scale((p * p).sum()).backward()
        if step == 2:
            p.grad[0] = math.inf
        scaler.step(opt)
        try:
            scaler.update()
        except RuntimeError:
            raised.append(step)
    assert raised == [2]  # once, at the skipped step's update; never again


def test_a_checkpoint_load_fills_the_state_in_place():
    # A CUDA graph captured before the load keeps reading the same tensors: identity must survive.
    scaler = lossscale.GradScaler("cpu", growth_interval=2)
    scaler.init_device("cpu")
    scale = scaler._get_scale_async()
    other = lossscale.GradScaler("cpu", growth_interval=2)
    other.load_state_dict(
        {**other.state_dict(), "scale": 2.0**10, "state": {**other.state_dict()["state"], "scale": 2.0**10}}
    )
    scaler.load_state_dict(other.state_dict())
    assert scaler._get_scale_async() is scale is scaler._scale and scale.item() == 2.0**10


def test_device_type_decisions_live_in_named_places():
    # One code path on every device. Where a device type decides, it is one of: the read-only pass's
    # kernel (measured per device type) and whether a snapshot needs pinned memory and an event. Nothing
    # else in the core asks (the inverse scale is float32 everywhere: no float64 route to choose).
    import inspect
    import re

    from lossscale import _check, _state, adaptive, checkpoint, dynamic, logmax, policy, scaler, static

    allowed = {"largest_magnitudes", "Snapshot", "__init__"}
    for module in (scaler, _check, _state, policy, dynamic, static, adaptive, logmax, checkpoint):
        source = inspect.getsource(module)
        for m in re.finditer(r'== "cpu"|\.numpy\(\)', source):
            owners = re.findall(r"\n(?:class|def|    def) (\w+)", source[: m.start()])
            line = source[: m.start()].rsplit("\n", 1)[-1] + source[m.start() :].split("\n", 1)[0]
            assert owners and owners[-1] in allowed, (module.__name__, owners[-1:], line)


# ------------------------------------------------------------------ compile-friendly
class FusedSGD:
    """A minimal optimizer with torch's amp-scaling contract (reads grad_scale/found_inf, skips on
    device): plain tensor ops, so dynamo can trace it. torch.optim's own fused optimizers do not compile
    whole in torch 2.13 (every step calls ``torch._dynamo.graph_break()``, and the fused kernels are
    wrapped in ``torch.compiler.disable``: test_torchs_fused_optimizer_step_alone_does_not_compile_whole),
    so they cannot show whether the scaler's part breaks the graph."""

    _step_supports_amp_scaling = True

    def __init__(self, params, lr=0.1):
        self.param_groups = [{"params": list(params)}]
        self.lr = lr

    def step(self):
        # Skip exactly as torch's fused kernels do: only when found_inf == 1.0 (any other value steps).
        # grad_scale None: the gradients are already unscaled (unscale_ or clip_grad_norm_ ran), as torch's.
        skip = self.found_inf == 1.0
        for p in self.param_groups[0]["params"]:
            grad = p.grad if self.grad_scale is None else p.grad / self.grad_scale
            p.data.copy_(torch.where(skip, p.data, p.data - grad * self.lr))


@pytest.mark.parametrize(
    "settings",
    [{}, {"hysteresis": 2}, {"policy": "adaptive"}, {"policy": "static"}],
    ids=["default", "hysteresis=2", "adaptive", "static"],
)
def test_a_fused_step_and_update_trace_without_graph_breaks(settings):
    import torch._dynamo

    p = torch.nn.Parameter(torch.ones(4))
    opt = FusedSGD([p])
    scaler = lossscale.GradScaler("cpu", **settings)
    scaler.scale((p * p).sum()).backward()
    scaler.step(opt)
    scaler.update()

    def iteration():
        scaler.step(opt)
        scaler.update()

    scaler.scale((p * p).sum()).backward()
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning either: a warning is a graph break
        explained = torch._dynamo.explain(iteration)()
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def _compiled_and_eager(after_backward, make_optimizer, settings=None, iterations=5, inf_at=3, **compile_kw):
    """Weights, optimizer state, scaler state and counters after ``iterations`` of a tiny model, the
    calls after the backward run eagerly and under ``torch.compile(**compile_kw)`` (the first iteration
    eager: it creates the optimizer's state); iteration ``inf_at`` has an inf gradient."""
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = make_optimizer(model.parameters())
        scaler = lossscale.GradScaler("cpu", init_scale=2.0**10, growth_interval=2, **(settings or {}))
        fn = torch.compile(after_backward, **compile_kw) if compiled else after_backward
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
        for i in range(iterations):
            model.zero_grad()
            scaler.scale(model(x).sum()).backward()
            if i == inf_at:
                model.weight.grad[0, 0] = math.inf
            (fn if i else after_backward)(model, opt, scaler)
        optimizer_state = [v for state in getattr(opt, "state", {}).values() for v in state.values()]
        tensors = [p.detach().clone() for p in model.parameters()] + optimizer_state
        results.append((tensors + [scaler._t.scale, scaler._t.growth_tracker], scaler.state_dict(), scaler.counters()))
    (eager, eager_sd, eager_counts), (graphed, graphed_sd, graphed_counts) = results
    assert len(eager) == len(graphed)
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b), (a, b)
    assert eager_sd == graphed_sd
    assert eager_counts == graphed_counts and graphed_counts["inf_steps"] == 1
    return graphed_counts


def _unscale_step_update(model, opt, scaler):
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()


def _unscale_clip_step_update(model, opt, scaler):
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()


def _own_clip_step_update(model, opt, scaler):
    scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize(
    "after_backward",
    [_unscale_step_update, _unscale_clip_step_update, _own_clip_step_update],
    ids=["unscale_", "torch clip", "own clip"],
)
def test_a_fused_iteration_compiles_whole_and_matches_eager_bitwise_skips_included(after_backward):
    """unscale_ (or clip_grad_norm_), step and update of a fused optimizer under
    torch.compile(fullgraph=True): no graph break, and bitwise the eager run, an inf step skipped. The
    stand-in optimizer: torch's own fused step does not compile whole (the next test)."""
    # lr a power of two: inductor may fuse the stand-in's p - grad * lr into one rounding (an FMA), which
    # rounds as eager's two only when the product is exact.
    # A clip's norm compiled by inductor is not eager's bitwise (its reduction sums in another order:
    # torch's own clip_grad_norm_ too), so the clips compile whole under aot_eager, which keeps eager's
    # kernels; the step and update alone under inductor.
    backend = "inductor" if after_backward is _unscale_step_update else "aot_eager"
    counts = _compiled_and_eager(
        after_backward, lambda params: FusedSGD(params, lr=0.125), fullgraph=True, backend=backend
    )
    assert counts["skipped_steps"] >= 1


def test_torchs_fused_optimizer_step_alone_does_not_compile_whole():
    """Why the test above uses a stand-in: in this torch, AdamW(fused=True).step() alone (no scaler)
    breaks the graph twice over: every torch.optim step calls torch._dynamo.graph_break() (around
    its no_grad), and the fused kernels are wrapped in torch.compiler.disable. When this fails, torch
    compiles its fused step: run the test above on it."""
    import torch._dynamo

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    opt = torch.optim.AdamW([p], fused=True)
    opt.step()
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="graph_break"):
        torch.compile(opt.step, fullgraph=True)()


def test_torchs_fused_adamw_under_compile_breaks_only_in_torch_optim_and_matches_eager():
    """The real AdamW(fused=True) under torch.compile (graph breaks allowed): bitwise the eager run,
    weights, moments, step counts, scale and tracker, an inf step skipped; every graph break is
    torch.optim's own (its graph_break() and the disabled fused kernel), none the scaler's."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    _compiled_and_eager(_unscale_step_update, lambda params: torch.optim.AdamW(params, fused=True))
    reasons = [reason.split("\n")[0] for reason in counters["graph_break"]]
    assert reasons, "torch.optim's step breaks the graph in this torch"
    torch_optims = ("Call to `torch._dynamo.graph_break()`", "Skip calling `torch.compiler.disable()`d function")
    assert all(reason.startswith(torch_optims) for reason in reasons), reasons


# ------------------------------------------------------------------ syncs
def test_an_overflow_decided_on_the_host_costs_one_sync_like_torch():
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = lossscale.GradScaler("cpu")
    scaler.scale((p * p).sum()).backward()
    p.grad[0] = math.inf
    with count_host_syncs() as syncs:
        scaler.step(opt)
        scaler.update()
    assert syncs.count == 1, syncs.ops  # the skip decision; NaN is told apart and the state reported without one


def test_reading_the_state_is_one_sync():
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.Adam([p], lr=0.1, fused=True)
    scaler = lossscale.GradScaler("cpu")
    scaler.scale((p * p).sum()).backward()
    scaler.step(opt)
    scaler.update()
    for read in (scaler.get_scale, scaler.state, scaler.counters, scaler.state_dict):
        with count_host_syncs() as syncs:
            read()
        assert syncs.count == 1, (read.__name__, syncs.ops)


def test_sync_counter_sees_copies_from_pageable_host_memory():
    # A host-to-device copy from pageable memory waits for the stream on CUDA ("meta" stands in here).
    with count_host_syncs() as syncs:
        torch.ones(3).to("meta")
    assert syncs.count == 1
    with count_host_syncs() as syncs:
        torch.ones(3, device="meta") * 2
    assert syncs.count == 0


# ------------------------------------------------------------------ keywords
def test_scale_keywords_come_from_the_policy_fields():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = lossscale.GradScaler(policy="adaptive", margin_bits=3, fmt="fp8_e5m2")
    assert s.policy == lossscale.AdaptivePolicy(margin_bits=3, fmt="fp8_e5m2")
    with pytest.warns(UserWarning, match="do\\(es\\) not apply to policy='static'"):
        s = lossscale.GradScaler(policy="static", init_scale=2.0**10, growth_factor=4.0)
    assert s.policy == lossscale.StaticPolicy(scale=2.0**10)
    with pytest.raises(ValueError, match="hysteresis=0"):
        lossscale.GradScaler(policy="static", hysteresis=0)
    with pytest.raises(ValueError, match="not a keyword of any scale policy"):
        lossscale.GradScaler(hysterisis=2)


# ------------------------------------------------------------------ no import cycle
def _intra_package_imports():
    """``{module: modules of lossscale it imports}``, module-level and inside functions alike (a
    lazy import that runs back up is a cycle all the same). A submodule's import of its own package
    (``from . import x`` reads the package, which is already loading) is not an edge."""
    import ast
    import os

    root = os.path.dirname(lossscale.__file__)
    mods = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.dirname(root))[:-3].replace(os.sep, ".")
                mods[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, f)
    graph = {}
    for mod, path in mods.items():
        pkg = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                deps.update(c for c in [base] + [f"{base}.{a.name}" for a in node.names] if c in mods)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in mods)
        graph[mod] = {d for d in deps if d != mod and not mod.startswith(d + ".")}
    return graph


def test_no_import_cycle_anywhere_the_demo_included():
    graph = _intra_package_imports()
    assert "lossscale.demo.render" in graph and "lossscale.scaler" in graph
    cycles = []

    def visit(mod, path):
        for dep in sorted(graph[mod]):
            if dep in path:
                cycles.append(path[path.index(dep) :] + [dep])
            elif len(path) < 40:
                visit(dep, path + [dep])

    for mod in sorted(graph):
        visit(mod, [mod])
    assert not cycles, cycles[:5]


# ------------------------------------------------------------------ structure, not size
def test_the_scaler_is_one_class_without_mixins():
    assert lossscale.GradScaler.__mro__ == (lossscale.GradScaler, object)


def test_no_test_instrument_lives_in_the_package():
    # A launch or sync counter, a profiler hook, a stand-in device: tests/ and benchmarks/, never what a
    # user imports.
    import os

    root = os.path.dirname(lossscale.__file__)
    found = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                text = open(os.path.join(dirpath, f), encoding="utf-8").read()
                found += [
                    (f, word)
                    for word in (
                        "TorchDispatchMode",
                        "_python_dispatch",
                        "setprofile",
                        "settrace",
                        "count_host_syncs",
                        "count_device_work",
                    )
                    if word in text
                ]
    assert not found, found


def test_the_opt_in_features_load_when_first_used():
    code = (
        "import sys, torch, lossscale\n"
        "s = lossscale.GradScaler()\n"
        "p = torch.nn.Parameter(torch.ones(2)); o = torch.optim.SGD([p], lr=0.1)\n"
        "s.scale(p.sum()).backward(); s.step(o); s.update(); s.health(); s.state_dict()\n"
        "print(sorted(m for m in sys.modules if m.startswith('lossscale.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    loaded = {m.split(".")[1] for m in eval(out.stdout)}
    assert not loaded & {
        "stats",
        "hooks",
        "trace",
        "report",
        "demo",
        "cli",
        "telemetry",
        "distributed",
        "integrations",
        "schedulers",
    }, loaded
