"""The stuck check describes the step that tripped it, and says when it cannot run.

The check reads a snapshot of the state one update late (no sync). Before, its message then appended
the *current* step's report ("the last step was not skipped") and, with tracing on, still suggested
turning tracing on instead of naming the module.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import lossscale


class Blowup(torch.nn.Module):
    """Multiplies by ``factor``: set it to inf to make this module's forward output non-finite."""

    def __init__(self):
        super().__init__()
        self.factor = 1.0

    def forward(self, x):  # noqa: D102
        return x * self.factor


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), Blowup(), torch.nn.Linear(8, 2))


def _step(model, opt, scaler, bad=False):
    model[2].factor = math.inf if bad else 1.0
    opt.zero_grad()
    scaler.scale(model(torch.ones(3, 4)).pow(2).mean()).backward()
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("fused", [False, True])
def test_the_stuck_message_names_the_module_of_the_step_that_tripped_it(fused):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), fused=fused)
    scaler = lossscale.GradScaler(model=model, trace=True, max_consecutive_skips=1)
    _step(model, opt, scaler)
    with pytest.warns(RuntimeWarning) as caught:
        _step(model, opt, scaler, bad=True)  # stuck: one bad loss is the limit (SGD: reported at once)
        _step(model, opt, scaler)  # a clean step (fused: the snapshot of the bad one is read here)
    message = str(caught[0].message)
    assert "forward output of `2`" in message
    assert "not skipped" not in message
    assert "trace=True" not in message  # it is on: no suggestion to turn it on


def test_the_stuck_message_gives_the_scale_and_parameters_of_an_overflow_at_min_scale():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = lossscale.GradScaler(model=model, init_scale=2.0**4, min_scale=2.0**4)
    _step(model, opt, scaler)
    opt.zero_grad()
    scaler.scale(model(torch.ones(3, 4)).pow(2).mean()).backward()
    model[3].weight.grad[0, 0] = math.inf
    scaler.step(opt)
    with pytest.warns(RuntimeWarning) as caught:
        scaler.update()  # SGD's check synced: the host runs the rule and reports the stuck step at once
        _step(model, opt, scaler)
    message = str(caught[0].message)
    assert "The step that tripped this check: inf in the gradients (3.weight) at scale 2^4" in message


def test_under_compile_the_stuck_check_is_off_silently_and_check_stuck_runs_it():
    # Nothing reaches the host inside a compiled update, and a warning there would break the graph:
    # the stuck check is off for compiled updates (their docstrings say so); check_stuck() is the eager point.
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = lossscale.GradScaler(init_scale=1.0, min_scale=1.0)
    scaler.scale((p * p).sum()).backward()
    scaler.step(opt)

    @torch.compile(backend="eager")
    def update():
        scaler.update()

    for step in range(4):  # from the second on, an overflow at min_scale, every update compiled: silent
        if step:
            opt.zero_grad()
            scaler.scale((p * p).sum()).backward()
            p.grad[0] = math.inf
            scaler.step(opt)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            update()
    with pytest.warns(RuntimeWarning, match="consecutive skipped step"):
        scaler.check_stuck()  # the eager point


def test_a_scale_backed_off_to_zero_reads_as_zero_and_stuck():
    # min_scale=None is torch's rule: the backoff may reach 0.0 (and below 2**-126 nothing trains). The
    # account says stuck and writes the scale as 0.0, not as a power of two.
    scaler = lossscale.GradScaler("cpu", loss_check=False, min_scale=None, max_scale=None)
    scaler.init_device("cpu")
    scaler.load_state_dict(
        dict(scale=2.0**-148, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, _growth_tracker=0)
    )  # a torch checkpoint from just above 0
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the stuck warning, by design
        for _ in range(4):
            opt.zero_grad()
            scaler.scale(p.sum()).backward()
            p.grad[0] = float("inf")
            scaler.step(opt)
            scaler.update()
    assert scaler.get_scale() == 0.0
    report = scaler.health()
    assert report.verdict == "stuck"
    assert "The scale is 0.0" in report.text and "*0.0" not in report.text
