"""Every message docs/troubleshooting.md quotes is what the code prints: each quote is read from the page
(headings, the bold items, the first column of the message tables, the italic diagnosis lines, a long
message cut short in parentheses in a paragraph) and found in the message the library (or torch, or the
framework) prints when the situation happens, triggered here.

A quote's ``<placeholder>`` stands for any text (``<a | b>``: one of the two), ``...`` for text left out;
whitespace runs compare as one space. A quote with no trigger fails the test, as does a trigger whose
quote left the page, so the page and this file move together.
"""

from __future__ import annotations

import functools
import inspect
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = "docs/troubleshooting.md"


def _text() -> str:
    with open(os.path.join(ROOT, PAGE), encoding="utf-8") as fh:
        return fh.read()


def _spans(s: str) -> list:
    """The code spans of a Markdown line: `x` and ``x`` (the second may hold backticks)."""
    return [m.group(2).strip() for m in re.finditer(r"(`+)(.+?)\1(?!`)", s)]


def quotes() -> list:
    """Every message the page quotes, in page order."""
    found = []
    table_is_messages = False
    for line in _text().splitlines():
        if line.startswith("### "):
            found += [s for s in _spans(line) if len(s) >= 15]  # "`fp16`" in a heading is not a message
        elif "**`" in line and not line.startswith("|"):
            found += [s for b in re.findall(r"\*\*(`.+?`)\*\*", line) for s in _spans(b)]
        elif line.startswith("- *") and not line.startswith("- **"):
            found += [
                re.sub(r"`([^`]*)`", r"`\1`", q) for q in re.findall(r"\*([^*]+)\*", line.split("*:", 1)[0] + "*")
            ]
        elif line.startswith("| message"):
            table_is_messages = True
        elif line.startswith("|") and table_is_messages and not line.startswith("|---"):
            cell = re.sub(r"\((?:`[^`]+`(?:, )?)+\)", "", line.split("|")[1])  # "(`skip_aware`)": where, not what
            found += _spans(cell)
        elif not line.startswith("|"):
            table_is_messages = False
            found += re.findall(r"\(`([^`]{40,}\.\.\.)`\)", line)  # a message quoted in a paragraph, cut short
    return found


def _pattern(quote: str) -> re.Pattern:
    """The regex a quote stands for: placeholders and '...' match any text."""
    out = []
    for token in re.split(r"(<[^<>]+>|\.\.\.)", " ".join(quote.split()).replace(" ...", "...")):
        if token == "...":
            out.append(".*?")
        elif token.startswith("<") and token.endswith(">") and len(token) > 2:
            options = [o.strip() for o in token[1:-1].split("|")]
            out.append("(?:" + "|".join(re.escape(o) for o in options) + ")" if len(options) > 1 else ".+?")
        else:
            out.append(re.escape(token))
    return re.compile("".join(out), re.DOTALL)


def test_the_parser_reads_each_kind_of_quote():
    page = quotes()
    assert "Attempting to unscale FP16 gradients." in page  # a heading
    assert any(q.startswith("policy=<name> is not known") for q in page)  # a bold item
    assert any(q.startswith("<call> was called before scale()") for q in page)  # a table's first column
    assert any(q.startswith("NaN persisted while the scale fell") for q in page)  # an italic diagnosis line
    assert "fp16" not in page and len(page) == len(set(page))
    assert _pattern("a <n> b ... c").fullmatch("a 12 b xyz c") and not _pattern("a <x | y> b").search("a z b")


# ------------------------------------------------------------------------------------------- triggers
# Each returns the text printed when the quoted situation happens: an exception's str(), a warning's
# message, a log line. A list: each of them must hold the quote (torch's message and lossscale's).


def _raised(call, kind=Exception) -> str:
    with pytest.raises(kind) as info:
        call()
    return str(info.value)


def _warned(call, kind=Warning) -> str:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    texts = [str(w.message) for w in caught if issubclass(w.category, kind)]
    assert texts, f"no {kind.__name__} was issued"
    return "\n".join(texts)


def _logged(logger_name: str, call) -> str:
    import logging

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger(logger_name)
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        call()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert records, f"nothing was logged on {logger_name!r}"
    return "\n".join(records)


def _loop(model=None, scaler=None, optimizer=None, fp16_params=False):
    """A tiny model, its SGD optimizer and one FP16-autocast loss."""
    import torch

    torch.manual_seed(0)
    model = model if model is not None else torch.nn.Linear(4, 2)
    if fp16_params:
        model = model.half()
    optimizer = optimizer if optimizer is not None else torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(3, 4, dtype=torch.float16 if fp16_params else torch.float32)).float().pow(2).mean()
    return model, optimizer, loss


def _gs(**kw):
    import lossscale

    return lossscale.GradScaler(**kw)


def _torch_gs():
    import torch

    return torch.amp.GradScaler("cpu")


def _unscale_fp16(make):
    model, opt, loss = _loop(fp16_params=True)
    s = make()
    s.scale(loss).backward()
    s.unscale_(opt)


def _scheduler_before_step():
    import torch

    model, opt, loss = _loop()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    s = _gs()
    s.scale(loss * float("inf")).backward()  # a bad first batch: the step is skipped
    s.step(opt)
    s.update()
    sched.step()


def _deepspeed_scaler(**kw):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    return DynamicLossScaler(scale_window=1000, consecutive_hysteresis=False, delayed_shift=1, **kw)


def _twice(make, first, second):
    def run():
        model, opt, loss = _loop()
        s = make()
        s.scale(loss).backward()
        getattr(s, first)(opt)
        getattr(s, second)(opt)

    return run


def _closure(make):
    model, opt, loss = _loop()
    s = make()
    s.scale(loss).backward()
    s.step(opt, closure=lambda: loss)


def _lightning_cpu_fp16():
    lightning = pytest.importorskip("lightning")
    lightning.Trainer(accelerator="cpu", precision="16-mixed", logger=False, enable_checkpointing=False)


def _nonfinite_clip():
    import torch

    model, opt, loss = _loop()
    (loss * float("inf")).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)


def _trainer_lr_before_step():
    pytest.importorskip("deepspeed")
    transformers = pytest.importorskip("transformers")
    import types

    from deepspeed.runtime.lr_schedules import WarmupLR

    model, opt, _ = _loop()
    # A DeepSpeed scheduler resumed at an iteration (last_batch_iteration set) has no LR until its first step.
    scheduler = WarmupLR(opt, last_batch_iteration=0)
    trainer = types.SimpleNamespace(is_deepspeed_enabled=True, lr_scheduler=scheduler)
    transformers.Trainer._get_learning_rate(trainer)


def _poisoned_steps(s, steps, value):
    """``steps`` iterations of a tiny model under ``s`` whose gradients are all ``value`` (inf or NaN)."""
    model = __import__("torch").nn.Linear(4, 2)
    for _ in range(steps):
        model, opt, loss = _loop(model)
        opt.zero_grad()
        s.scale(loss).backward()
        for p in model.parameters():
            p.grad.fill_(value)
        s.step(opt)
        s.update()


def _stepped(s, opt, loss):
    s.scale(loss).backward()
    s.step(opt)
    s.update()


def _in_iteration(action):
    def run():
        model, opt, loss = _loop()
        s = _gs()
        s.scale(loss).backward()
        action(s, opt)

    return run


def _same_params_twice():
    import torch

    model, opt, loss = _loop()
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    s = _gs()
    s.scale(loss).backward()
    s.unscale_(opt)
    s.unscale_(other)


def _pickle_mid():
    import pickle

    model, opt, loss = _loop()
    s = _gs()
    s.scale(loss).backward()
    s.unscale_(opt)
    pickle.dumps(s)


def _init_device_twice():
    model, opt, loss = _loop()
    s = _gs()
    s.scale(loss)
    s.init_device("cuda:0")  # the state already lives on the CPU


def _load_mid_iteration():
    model, opt, loss = _loop()
    s = _gs()
    state = s.state_dict()
    s.scale(loss)
    s.load_state_dict(state)


def _unscale_after_a_load_mid_iteration():
    import warnings

    model, opt, loss = _loop()
    s = _gs()
    state = s.state_dict()
    s.scale(loss).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the load's own warning, quoted above it
        s.load_state_dict(state)
    s.unscale_(opt)


def _old_contract():
    import torch

    class OldSGD(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None, grad_scaler=None):
            return super().step(closure)

    model = torch.nn.Linear(4, 2)
    model, opt, loss = _loop(model, optimizer=OldSGD(model.parameters(), lr=0.1))
    s = _gs()
    s.scale(loss).backward()
    s.step(opt)  # warns here; what update() makes of it is the contract's own test


def _bf16():
    import torch

    model = torch.nn.Linear(4, 2)
    s = _gs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s.scale(model(torch.randn(2, 4)).float().sum())


def _stuck():
    """Overflow at the floor: every gradient inf from the first step, with on_stuck='raise'."""

    def run():
        _poisoned_steps(_gs(on_stuck="raise", init_scale=2.0**-23), 4, float("inf"))

    return run


def _nan_stuck():
    _poisoned_steps(_gs(on_stuck="raise", init_scale=2.0**-20), 8, float("nan"))


def _backward_overflow_at_the_floor():
    """A layer whose input gradient overflows FP16 at the floor (min_scale=1), its forward finite."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Linear(64, 64))
    with torch.no_grad():
        model[0].bias.zero_()
        model[1].weight.fill_(6e4)  # the input gradient sums 64 of them: far above 65504
    s = _gs(model=model, trace=True, on_stuck="raise", init_scale=1.0, min_scale=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(2, 4) * 1e-6).float().sum()
        _stepped(s, opt, loss)


def _nan_at_the_floor():
    _poisoned_steps(_gs(on_stuck="raise", init_scale=2.0**-24), 3, float("nan"))


def _scale_backs_off_to_zero():
    """torch's configuration (min_scale=None) and an overflow on every step: the scale halves to 0."""
    s = _gs(
        on_stuck="raise",
        loss_check=False,
        min_scale=None,
        max_scale=None,
        init_scale=2.0**-120,
        max_consecutive_skips=40,
    )
    _poisoned_steps(s, 60, float("inf"))


def _bad_loss_streak():
    import torch

    model = torch.nn.Linear(4, 2)
    s = _gs(on_stuck="raise", max_consecutive_skips=3)
    for _ in range(4):
        model, opt, loss = _loop(model)
        opt.zero_grad()
        s.scale(loss * float("nan")).backward()
        s.step(opt)
        s.update()


def _overflowing_model():
    """The audit page's model: a layer whose FP16 output overflows in the forward."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.LayerNorm(64),
        torch.nn.Linear(64, 4),
    )
    with torch.no_grad():
        model[2].weight.mul_(1e5)
    return model


def _upcast(steps, before_step=lambda step, model: None):
    import torch

    def run():
        model = _overflowing_model()
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        s = _gs(model=model, trace=True, on_forward_overflow="upcast")
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for step in range(steps):
            before_step(step, model)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            s.scale(loss).backward()
            s.step(opt)
            s.update()

    return run


def _telemetry_float64():
    import torch

    model = torch.nn.Linear(4, 2).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = _gs(telemetry=1)
    loss = model(torch.randn(3, 4, dtype=torch.float64)).pow(2).mean()
    _stepped(s, opt, loss)


def _load(state, scaler=None):
    return lambda: (scaler or _gs()).load_state_dict(state)


def _torch_state():
    return _torch_gs().state_dict()


def _meta_state():
    import torch

    return {**_torch_state(), "scale": torch.empty((), device="meta")}  # a torch checkpoint saved from meta


def _bad_field_state():
    return {**_torch_state(), "growth_interval": -3}


def _bad_lossscale_field():
    state = _gs().state_dict()
    state["state"]["scale"] = "large"
    return state


def _other_policy_state():
    state = _gs(growth_interval=7).state_dict()
    return state


def _clip(**kw):
    def run():
        model, opt, loss = _loop()
        s = _gs()
        s.scale(loss).backward()
        s.clip_grad_norm_(opt, **kw)

    return run


def _register_without_name():
    import lossscale

    class Nameless(lossscale.Policy):
        pass

    lossscale.policy.register(Nameless)


def _policy_update_other_state():
    import lossscale

    lossscale.DynamicPolicy().update(lossscale.StaticPolicy().init_state(), found_inf=False)


def _bad_state_field():
    import lossscale

    state = lossscale.GradScaler().state_dict()
    state["state"]["growth_tracker"] = 10**6  # beyond growth_interval: no dynamic policy reaches it
    lossscale.GradScaler().load_state_dict(state)


def _skip_aware_optimizer():
    import torch

    import lossscale.schedulers

    model, opt, _ = _loop()
    lossscale.schedulers.skip_aware(torch.optim.lr_scheduler.StepLR(opt, 1), _gs(), optimizer=opt)


def _skip_aware_slots():
    import lossscale.schedulers

    class Slotted:
        __slots__ = ()

        def step(self):
            pass

    lossscale.schedulers.skip_aware(Slotted(), _gs())


def _recorder_twice():
    import torch

    import lossscale

    recorder = lossscale.ActivationGradRecorder(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with recorder:
        with recorder:
            pass


def _no_modules():
    import torch

    import lossscale

    lossscale.ActivationGradRecorder(torch.nn.ReLU())


def _pickle_tensor_state():
    import pickle

    model, opt, loss = _loop()
    s = _gs()
    s.scale(loss)
    pickle.dumps(s._t)


def _binades():
    import torch

    import lossscale

    lossscale.grad_stats([torch.randn(8)], scale=3.0).binades()


def _bincount():
    import torch

    import lossscale

    lossscale.grad_stats([torch.randn(8, device="meta")], method="bincount")


def _found_nan_without_inf():
    import lossscale

    policy = lossscale.DynamicPolicy()
    policy.update(policy.init_state(), found_inf=False, found_nan=True)


T = {
    # torch and the frameworks
    "Attempting to unscale FP16 gradients.": lambda: _raised(lambda: _unscale_fp16(_torch_gs), ValueError),
    "Detected call of `lr_scheduler.step()` before `optimizer.step()`": lambda: _warned(_scheduler_before_step),
    "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.": lambda: _raised(
        lambda: _deepspeed_scaler(init_scale=1, min_scale=1).update_scale(True)
    ),
    "GradScaler is enabled, but CUDA is not available.  Disabling.": lambda: _warned(
        lambda: __import__("torch").amp.GradScaler("cuda")
    ),
    "unscale_() has already been called on this optimizer since the last update().": lambda: [
        _raised(_twice(_torch_gs, "unscale_", "unscale_"), RuntimeError),
        _raised(_twice(_gs, "unscale_", "unscale_"), RuntimeError),
    ],
    "step() has already been called since the last update().": lambda: [
        _raised(_twice(_torch_gs, "step", "step"), RuntimeError),
        _raised(_twice(_gs, "step", "step"), RuntimeError),
    ],
    "Closure use is not currently supported if GradScaler is enabled.": lambda: [
        _raised(lambda: _closure(_torch_gs), RuntimeError),
        _raised(lambda: _closure(_gs), RuntimeError),
    ],
    "tried to get lr value before scheduler/optimizer started stepping, returning lr=0": lambda: _logged(
        "transformers.trainer", _trainer_lr_before_step
    ),
    "You passed `Trainer(accelerator='cpu', precision='16-mixed')` but AMP with fp16 is not supported on CPU. "
    "Using `precision='bf16-mixed'` instead.": lambda: _warned(_lightning_cpu_fp16),
    "The total norm of order 2.0 for gradients from ... is non-finite": lambda: _raised(_nonfinite_clip, RuntimeError),
    # building the scaler
    "policy=<name> is not known; use one of 'adaptive', 'dynamic', 'logmax', 'static', or a policy object": lambda: (
        _raised(lambda: _gs(policy="dynamc"), ValueError)
    ),
    "policy is a policy object, so <keywords> must be set on the object, not passed to GradScaler as well": lambda: (
        _raised(lambda: _gs(policy=__import__("lossscale").DynamicPolicy(), growth_interval=100), ValueError)
    ),
    "<key>=<value> is not a keyword of any scale policy": lambda: _raised(lambda: _gs(min_sacle=1.0), ValueError),
    "lossscale.GradScaler: <key>=<value> do(es) not apply to policy=<name> and is ignored": lambda: _warned(
        lambda: _gs(margin_bits=3), UserWarning
    ),
    "lossscale.GradScaler: init_scale=<s> is above the default max_scale=2**24, "
    "so max_scale is set to init_scale": lambda: _warned(lambda: _gs(init_scale=2.0**32), UserWarning),
    "lossscale: <name> is not a power of two, so the loss scale can leave the powers of two": lambda: _warned(
        lambda: _gs(init_scale=1000.0), UserWarning
    ),
    "min_scale=<a> is above max_scale=<b>; swap them": lambda: _raised(
        lambda: _gs(min_scale=4.0, max_scale=2.0), ValueError
    ),
    "init_scale=<s> is above max_scale=<b>": lambda: _raised(
        lambda: _gs(init_scale=2.0**30, max_scale=2.0**20), ValueError
    ),
    "init_scale=<s> is outside [min_scale=<a>, max_scale=<b>]": lambda: [
        _raised(lambda: _gs(policy="adaptive", init_scale=2.0**30, max_scale=2.0**20), ValueError),
        _raised(lambda: _gs(policy="logmax", init_scale=2.0**30, max_scale=2.0**20), ValueError),
    ],
    "trace=True hooks the model's modules: pass model=<the nn.Module> as well": lambda: _raised(
        lambda: _gs(trace=True), ValueError
    ),
    "<a>=<value> and <b>=<value> both set policy=<name>'s <field>; pass one of them": lambda: _raised(
        lambda: _gs(policy="static", init_scale=4.0, scale=8.0), ValueError
    ),
    "init_device got device=meta, which holds no values": lambda: _raised(
        lambda: _gs().init_device("meta"), ValueError
    ),
    "on_forward_overflow='upcast' needs trace=True (and model=)": lambda: _raised(
        lambda: _gs(on_forward_overflow="upcast"), ValueError
    ),
    "upcast_after=<n> applies only with on_forward_overflow='upcast'": lambda: _raised(
        lambda: _gs(upcast_after=3), ValueError
    ),
    "process_group=<value> is not a process group; pass 'default' ..., None (no reduction) or a group": lambda: _raised(
        lambda: _gs(process_group=5), (TypeError, ValueError)
    ),
    "telemetry=<value> must be None, an int (collect every N iterations), a dict of Telemetry arguments, "
    "or a lossscale.Telemetry": lambda: _raised(lambda: _gs(telemetry="often"), (TypeError, ValueError)),
    "skip_if has no rule: set grad_norm_above, grad_norm_zscore or loss_zscore": lambda: _raised(
        lambda: __import__("lossscale").SkipIf(), ValueError
    ),
    "skip_if: min_steps=<m> is above window=<w>": lambda: _raised(
        lambda: __import__("lossscale").SkipIf(loss_zscore=3.0, window=4, min_steps=8), ValueError
    ),
    "bad_microbatch=<value> must be one of ('skip', 'drop', 'zero')": lambda: _raised(
        lambda: _gs(bad_microbatch="ignore"), ValueError
    ),
    "passthrough() fixes the scale at 1 ..., so <keywords> do(es) not apply": lambda: _raised(
        lambda: __import__("lossscale").GradScaler.passthrough(init_scale=4.0), (TypeError, ValueError)
    ),
    "lossscale.GradScaler: device='cuda' but CUDA is not available; disabling scaling.": lambda: _warned(
        lambda: _gs(device="cuda"), UserWarning
    ),
    # the order of calls
    "<call> was called before scale(): call scaler.scale(loss).backward() first in the iteration.": lambda: _raised(
        lambda: _gs().unscale_(_loop()[1]), RuntimeError
    ),
    "clip_grad_norm_() unscales the gradients itself, and unscale_() (or clip_grad_norm_()) was already called on "
    "this optimizer since the last update(); call only one of them per iteration.": lambda: _raised(
        _in_iteration(lambda s, opt: (s.unscale_(opt), s.clip_grad_norm_(opt, 1.0))), RuntimeError
    ),
    "<call> is being called after step(); call it before step() in the iteration, and end every iteration with "
    "scaler.update() (...)": lambda: _raised(
        _in_iteration(lambda s, opt: (s.step(opt), s.unscale_(opt))), RuntimeError
    ),
    # lossscale's own message (torch raises an AssertionError there)
    "update() found no inf checks since the last update(): call scaler.step(optimizer) (or unscale_) for each "
    "optimizer before update().": lambda: _raised(_in_iteration(lambda s, opt: s.update()), RuntimeError),
    "The optimizer step of this iteration has not happened yet (unscale_()/clip_grad_norm_() ran, step() did not), "
    "so whether it is skipped is not known.": lambda: _raised(
        _in_iteration(lambda s, opt: (s.unscale_(opt), s.step_was_skipped())), RuntimeError
    ),
    "<n> gradient(s) were already unscaled in this iteration (...)": lambda: _raised(_same_params_twice, RuntimeError),
    "<call>: optimizer=<object> is not an optimizer (no param_groups)": lambda: _raised(
        _in_iteration(lambda s, opt: s.step(object())), (TypeError, ValueError)
    ),
    "A GradScaler can be pickled only at the beginning of an iteration ...": lambda: _raised(_pickle_mid, RuntimeError),
    "the scaler already runs on <device>; init_device got device=<other>": lambda: _raised(
        _init_device_twice, ValueError
    ),
    "scale() got a tensor on the meta device, which holds no values": lambda: _raised(
        lambda: _gs().scale(__import__("torch").empty((), device="meta")), ValueError
    ),
    "scale() takes a tensor or (nested) lists, tuples or dicts of tensors, got <type>": lambda: _raised(
        lambda: _gs().scale(1.0), (TypeError, ValueError)
    ),
    "lossscale: load_state_dict() was called in mid-iteration (after scale(), before update()) ...": lambda: _warned(
        _load_mid_iteration, RuntimeWarning
    ),
    "<call>: load_state_dict() was called in mid-iteration, after the gradients were scaled by the scale from "
    "before the load ...": lambda: _raised(_unscale_after_a_load_mid_iteration, RuntimeError),
    "lossscale.GradScaler passes itself as grad_scaler=, a contract torch is deprecating": lambda: _warned(
        _old_contract, FutureWarning
    ),
    # gradients and the loss
    "<n> parameter(s) have FP16 gradients (...): unscaling them in FP16 would flush the small ones": lambda: _raised(
        lambda: _unscale_fp16(_gs), ValueError
    ),
    "lossscale.GradScaler.scale(): <the loss is bf16 | bf16 autocast is active>. "
    "bf16 has fp32's exponent range ...": lambda: _warned(_bf16, UserWarning),
    "lossscale: <n> consecutive skipped step(s) (...); the scale went from <a> to <b> (min_scale=<m>).": lambda: (
        _raised(_stuck(), RuntimeError)
    ),
    "Gradients overflow even at the smallest scale allowed while the loss is finite": lambda: _raised(
        _stuck(), RuntimeError
    ),
    "NaN persisted while the scale fell": lambda: _raised(_nan_stuck, RuntimeError),
    "The backward of `<module>` overflows FP16 (a gradient above 65504) at every scale the floor allows": lambda: (
        _raised(_backward_overflow_at_the_floor, RuntimeError)
    ),
    "NaN at the smallest scale the policy allows": lambda: _raised(_nan_at_the_floor, RuntimeError),
    # min_scale=None backs off below 2**-126 (to 0), as torch's scale does
    "The scale itself is <x>": lambda: _raised(_scale_backs_off_to_zero, RuntimeError),
    "lossscale: the loss was non-finite before any scaling in <n> consecutive step(s) ...": lambda: _raised(
        _bad_loss_streak, RuntimeError
    ),
    "lossscale: `<module>` was the first forward overflow on <n> steps; "
    "it now runs in FP32 (on_forward_overflow='upcast').": lambda: _warned(_upcast(4), UserWarning),
    "lossscale: `<module>` runs in FP32 (on_forward_overflow='upcast') "
    "and its forward output was non-finite again": lambda: _warned(
        _upcast(4, lambda step, model: model[2].weight.data.fill_(float("nan")) if step == 3 else None),
        RuntimeWarning,
    ),
    "lossscale telemetry: <dtype> gradients are left out of the statistics": lambda: _warned(
        _telemetry_float64, UserWarning
    ),
    # checkpoints
    "The state dict is empty, possibly because it was saved from a disabled scaler.": lambda: _raised(
        _load({}), RuntimeError
    ),
    "state dict is missing [...] (expected a lossscale or torch GradScaler state)": lambda: _raised(
        _load({"scale": 1.0}), (KeyError, ValueError)
    ),
    "state dict 'lossscale_version'=<v> is not supported": lambda: _raised(
        _load({**_gs().state_dict(), "lossscale_version": 99}), ValueError
    ),
    "a torch GradScaler state dict needs a dynamic policy; this scaler's is <Policy>": lambda: _raised(
        lambda: _gs(policy="static").load_state_dict(_torch_state()), ValueError
    ),
    "state dict '<key>' is a tensor on the meta device, which holds no value": lambda: _raised(
        lambda: _gs().load_state_dict(_meta_state()), ValueError
    ),
    "state dict 'scale'=<s> is below float32's normal range (2**-126)": lambda: _raised(
        lambda: _gs().load_state_dict({**_torch_state(), "scale": 0.0}), (TypeError, ValueError)
    ),
    "state dict '<key>'=<value> must be ...": lambda: _raised(
        lambda: _gs().load_state_dict({**_torch_state(), "scale": -1.0}), (TypeError, ValueError)
    ),
    "state dict '<key>': <field>=<value> must be ...": lambda: _raised(
        lambda: _gs().load_state_dict(_bad_field_state()), (TypeError, ValueError)
    ),
    "state dict state.<field>=<value> must be ...": lambda: _raised(
        lambda: _gs().load_state_dict(_bad_lossscale_field()), (TypeError, ValueError)
    ),
    "lossscale: the checkpoint's policy replaces the one this scaler was built with (...)": lambda: _warned(
        lambda: _gs().load_state_dict(_other_policy_state()), UserWarning
    ),
    # clipping
    "max_norm=<x> must be a number >= 0": lambda: _raised(_clip(max_norm=-1.0), ValueError),
    "norm_type=<p> must be > 0 or inf": lambda: _raised(_clip(max_norm=1.0, norm_type=0.0), ValueError),
    # integrations
    "metric '<key>' is <value>, not a number": lambda: _raised(
        lambda: __import__("lossscale.integrations.loggers").integrations.loggers.scalars({"verdict": "healthy"}),
        ValueError,
    ),
    # other argument checks
    "found_nan=True with found_inf=False": lambda: _raised(_found_nan_without_inf, ValueError),
    "state is a <A>, not <B>": lambda: _raised(_policy_update_other_state, ValueError),
    "<Policy> needs a class attribute name to be registered": lambda: _raised(_register_without_name, ValueError),
    "state.<field>=<v> must be ...": lambda: _raised(_bad_state_field, ValueError),
    "optimizer=<x>(...) is for an AveragedModel or an EMA": lambda: _raised(
        _skip_aware_optimizer, (TypeError, ValueError)
    ),
    "obj=<x> has no instance __dict__ (__slots__ only)": lambda: _raised(_skip_aware_slots, (TypeError, ValueError)),
    "this ActivationGradRecorder is already active": lambda: _raised(_recorder_twice, RuntimeError),
    "no modules to watch": lambda: _raised(_no_modules, ValueError),
    "stats must be a GradStats, a list/tuple or a dict of them": lambda: _raised(
        lambda: __import__("lossscale.distributed").distributed.reduce_stats(3), (TypeError, ValueError)
    ),
    "device=<x> is not a device": lambda: _raised(
        lambda: __import__("lossscale.distributed").distributed.init_stage(_gs(), "gpu7"), ValueError
    ),
    "a TensorState is not pickled": lambda: _raised(_pickle_tensor_state, TypeError),
    "mode=<x> must be 'w' (new file) or 'a' (append)": lambda: _raised(
        lambda: __import__("lossscale").JsonlLogger(os.devnull, mode="x"), ValueError
    ),
    "binades(): scale=<s> is not a power of two": lambda: _raised(_binades, ValueError),
    "method='bincount' on <devices>": lambda: _raised(_bincount, ValueError),
}


# ------------------------------------------------------------------------------------------ integrations
def _accelerator(**kw):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # accelerate keeps process-wide singletons
    GradientState._reset_state()
    return Accelerator(cpu=True, **kw)


def _accelerate_attach(accelerator, **kw):
    from lossscale.integrations import accelerate as ls_accelerate

    return ls_accelerate.attach(accelerator, **kw)


def _after_prepare():
    accelerator = _accelerator(mixed_precision="fp16")
    accelerator.prepare(__import__("torch").nn.Linear(2, 2))
    _accelerate_attach(accelerator)


def _attached_twice():
    accelerator = _accelerator(mixed_precision="fp16")
    _accelerate_attach(accelerator)
    _accelerate_attach(accelerator, init_scale=8.0)


def _trainer(tmp, fp16=True):
    pytest.importorskip("transformers")
    from _integration_models import TokenData, tiny_gpt2
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp), fp16=fp16, use_cpu=True, report_to=[], max_steps=1, per_device_train_batch_size=2
    )
    return Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenData(2, length=8))


def _trainer_attach(trainer):
    from lossscale.integrations import transformers as ls_transformers

    return ls_transformers.attach(trainer)


def _trainer_after_train(tmp):
    trainer = _trainer(tmp)
    trainer.train()
    _trainer_attach(trainer)


def _trainer_rebuilt(tmp):
    trainer = _trainer(tmp)
    _trainer_attach(trainer)
    trainer.create_accelerator_and_postprocess()  # what hyperparameter_search does per trial
    trainer.train()


def _trainer_plugin_in_fabric():
    lightning = pytest.importorskip("lightning")
    from lossscale.integrations.lightning import MixedPrecision

    fabric = lightning.Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision()])
    model = __import__("torch").nn.Linear(2, 2)
    fabric.setup(model, __import__("torch").optim.SGD(model.parameters(), lr=0.1))


def _lightning_plugin(**kw):
    pytest.importorskip("lightning")
    from lossscale.integrations.lightning import MixedPrecision

    return MixedPrecision(**kw)


# DeepSpeed engines need deepspeed.comm, a one-rank gloo group: in a child process (the test process must not
# hold a process group, or lossscale would all-reduce in every later test). The child prints, for each
# situation, what was logged or raised.
_DEEPSPEED_CHILD = """
import json, logging, os, socket
sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch
import deepspeed
deepspeed.init_distributed(dist_backend="gloo", verbose=False)
out = {}
from deepspeed.runtime.fp16 import loss_scaler
logged = []
class Keep(logging.Handler):
    def emit(self, record):
        logged.append(record.getMessage())
loss_scaler.logger.addHandler(Keep())
loss_scaler.logger.setLevel(logging.INFO)
loss_scaler.DynamicLossScaler(
    init_scale=2**16, scale_window=1000, min_scale=1, delayed_shift=1, consecutive_hysteresis=False
).update_scale(True)
out["overflow"] = "\\n".join(logged)
from lossscale.integrations import deepspeed as ls_deepspeed
model = torch.nn.Linear(4, 2)
config = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
try:
    ls_deepspeed.attach(engine)
except Exception as error:
    out["fp32 engine"] = str(error)
os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin
from lossscale.integrations import accelerate as ls_accelerate
accelerator = Accelerator(mixed_precision="fp16", deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, gradient_clipping=0.0))
try:
    ls_accelerate.attach(accelerator).get_scale()
except Exception as error:
    out["before prepare"] = str(error)
print("CHILD:" + json.dumps(out))
"""


@functools.lru_cache(maxsize=None)
def _deepspeed_child() -> dict:
    import json
    import subprocess
    import sys

    pytest.importorskip("deepspeed")
    pytest.importorskip("accelerate")
    done = subprocess.run(
        [sys.executable, "-c", _DEEPSPEED_CHILD],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(sys.path)),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("CHILD:"))[len("CHILD:") :])


def _without(framework: str):
    """lossscale.integrations' import check, as it runs where ``framework`` is not installed."""
    import sys

    import lossscale.integrations

    saved = sys.modules.get(framework)
    sys.modules[framework] = None  # import raises ModuleNotFoundError, as for a package not installed
    try:
        lossscale.integrations._require(framework)
    finally:
        if saved is None:
            del sys.modules[framework]
        else:
            sys.modules[framework] = saved


T.update(
    {
        "lossscale.integrations needs <framework>, which is not installed": lambda: _raised(
            lambda: _without("lightning"), ModuleNotFoundError
        ),
        'accelerator.mixed_precision is <x>; build it with Accelerator(mixed_precision="fp16")': lambda: _raised(
            lambda: _accelerate_attach(_accelerator(mixed_precision="no")), ValueError
        ),
        "attach() was called after accelerator.prepare(...)": lambda: _raised(_after_prepare, RuntimeError),
        "a lossscale scaler is already attached to this accelerator": lambda: _raised(_attached_twice, ValueError),
        "scaler.<name>: under DeepSpeed the loss scaler lives in the engine, which accelerator.prepare(...) builds": (
            lambda: _deepspeed_child()["before prepare"]
        ),
        "trainer.args.fp16 is False; build the Trainer with TrainingArguments(fp16=True)": lambda tmp: _raised(
            lambda: _trainer_attach(_trainer(tmp, fp16=False)), ValueError
        ),
        "attach(trainer) was called after the Trainer prepared its model": lambda tmp: _raised(
            lambda: _trainer_after_train(tmp), RuntimeError
        ),
        "The Trainer rebuilt its accelerator after lossscale attach()": lambda tmp: _raised(
            lambda: _trainer_rebuilt(tmp), RuntimeError
        ),
        "lossscale.integrations.lightning.MixedPrecision is the Trainer's plugin; "
        "use FabricMixedPrecision with Fabric": (lambda: _raised(_trainer_plugin_in_fabric, RuntimeError)),
        "<precision>: this plugin is FP16 only ('16-mixed', with a loss scaler)": lambda: _raised(
            lambda: _lightning_plugin(precision="bf16-mixed"), ValueError
        ),
        "the loss is on <device> but the plugin autocasts on <type>": lambda: _raised(
            lambda: _lightning_plugin(device="cuda").pre_backward(
                __import__("torch").ones((), requires_grad=True), None
            ),
            ValueError,
        ),
        "the engine trains without fp16": lambda: _deepspeed_child()["fp32 engine"],
        "OVERFLOW! Rank 0 Skipping step. Attempted loss scale: <s>, reducing to <s/2>": lambda: _deepspeed_child()[
            "overflow"
        ],
        "optimizer=<x>(...) has no grad scaler: build it with OptimizerConfig(fp16=True)": lambda: _raised(
            lambda: __import__("lossscale.integrations.megatron").integrations.megatron.attach(_loop()[1]), ValueError
        ),
        "scaler=<x> must be a lossscale.GradScaler": lambda: _raised(
            lambda: __import__("lossscale.schedulers").schedulers.skip_aware(
                __import__("torch").optim.lr_scheduler.StepLR(_loop()[1], 1), _torch_gs()
            ),
            (TypeError, ValueError),
        ),
        "obj=<x>(...) has no step() or update(model) method": lambda: _raised(
            lambda: __import__("lossscale.schedulers").schedulers.skip_aware(object(), _gs()), (TypeError, ValueError)
        ),
    }
)


# The multi-rank messages: two gloo ranks in a child process (tests/_troubleshooting_dist.py).
DISTRIBUTED = {
    "clip_grad_norm_: the gradients lie on several device meshes": "several meshes",
    "clip_grad_norm_: the gradients mix DTensors and plain tensors": "mix",
    "a gradient of shape <s> is a DTensor with placements (Partial...)": "partial",
    "clip_grad_norm_: the gradients lie on a <k>-D mesh of <n> ranks, "
    "not the world's <w>; pass norm_group=...": "k-D mesh",
    "clip_grad_norm_: this rank is not in norm_group": "not in norm_group",
    "lossscale.GradScaler state differs across the <n> ranks of the group (differing: ...)": "differs",
}


@functools.lru_cache(maxsize=None)
def _two_ranks() -> dict:
    import json
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "messages.json")
        done = subprocess.run(
            [sys.executable, os.path.join(ROOT, "tests", "_troubleshooting_dist.py"), path],
            capture_output=True,
            text=True,
            timeout=600,
            env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(sys.path)),
        )
        assert done.returncode == 0, done.stderr[-3000:]
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)


T.update({quote: (lambda key=key: _two_ranks()[key]) for quote, key in DISTRIBUTED.items()})


# Quotes no test here can print: the framework that prints them is not installed (and not installable beside
# the test extra), so the quote is taken from its source as released.
NOT_HERE = {
    "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to <s>": "apex (amp) is not installed",
    "NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: <s>": "fairseq is not installed",
    "number of skipped iterations: <n>": "Megatron-LM's training loop (megatron.training) is not in megatron-core",
    "accelerator.distributed_type is MEGATRON_LM, whose engine scales the loss itself": (
        "accelerate's Megatron-LM plugin needs Megatron-LM, which is not installed (megatron-core is not enough)"
    ),
}


def _normal(text: str) -> str:
    """Whitespace runs as one space, and no backticks (a code span in the page, plain text in a message)."""
    return " ".join(text.replace("`", "").split())


def test_every_quote_has_a_trigger_and_every_trigger_a_quote():
    page = quotes()
    assert not sorted(set(page) - set(T) - set(NOT_HERE)), "quotes on the page with no trigger here"
    assert not sorted((set(T) | set(NOT_HERE)) - set(page)), "triggers whose quote left the page"


@pytest.mark.parametrize(
    "quote",
    [pytest.param(q, marks=[pytest.mark.distributed] if q in DISTRIBUTED else []) for q in quotes() if q in T],
    ids=lambda q: q[:60],
)
def test_the_quoted_message_is_what_is_printed(quote, recwarn, tmp_path):
    trigger = T[quote]
    takes_a_folder = "tmp" in inspect.signature(trigger).parameters
    printed = trigger(tmp_path) if takes_a_folder else trigger()
    pattern = _pattern(_normal(quote))
    for text in printed if isinstance(printed, list) else [printed]:
        assert pattern.search(_normal(text)), f"{PAGE} quotes\n  {quote}\nbut the message printed is\n  {text}"
