"""Warnings point at the user's line (``lossscale._warnings``): the first frame outside the package,
computed, whatever the depth of the package's calls that raised them."""

import inspect
import math
import warnings

import torch

import lossscale


def _caught(fn):
    """``(warnings, the line fn's call to lossscale is on)``: fn calls lossscale on its last line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    lines, start = inspect.getsourcelines(fn)
    return caught, start + len(lines) - 1


def test_a_warning_from_the_constructor_names_the_users_line():
    def build():
        return lossscale.GradScaler(init_scale=2.0**30)

    caught, line = _caught(build)
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)]


def test_a_policy_built_directly_and_through_the_scaler_name_the_users_line():
    def direct():
        return lossscale.DynamicPolicy(init_scale=3.0)  # through the dataclass's generated __init__

    def through():
        return lossscale.GradScaler(policy="static", init_scale=3.0)

    for fn in (direct, through):
        caught, line = _caught(fn)
        assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)], fn.__name__


def test_the_stuck_warning_of_update_names_the_users_update_call():
    scaler = lossscale.GradScaler("cpu", max_consecutive_skips=2)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)

    def iteration():
        opt.zero_grad()
        scaler.scale((p * p).sum()).backward()
        p.grad[0] = math.inf
        scaler.step(opt)
        scaler.update()

    caught, _ = _caught(lambda: [iteration() for _ in range(3)])
    lines, start = inspect.getsourcelines(iteration)
    update_line = start + len(lines) - 1
    stuck = [w for w in caught if "consecutive skipped step" in str(w.message)]
    assert len(stuck) == 1 and (stuck[0].filename, stuck[0].lineno) == (__file__, update_line)


def test_a_checkpoint_warning_names_the_users_load_call():
    sd = torch.amp.GradScaler("cpu", growth_interval=7).state_dict()
    scaler = lossscale.GradScaler()

    def load():
        scaler.load_state_dict(sd)

    caught, line = _caught(load)
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)]
