"""Config validation (``lossscale._validate``) as every policy applies it: a ValueError whose message
starts with the argument's name and value, for a bad value, a bool where a number is meant, a string, a
bound moved by one; and the values on the edge of each valid range accepted. Each policy's own table of
bad configs is in its own file (test_dynamic.py, test_adaptive.py, test_logmax.py).

Mutation-killing tests (issue 15): "Kills: ..." names the one-line change each was seen to fail on
(docs/testing.md).
"""

import math

import numpy as np
import pytest
from _models import quiet
from _rules import ALL_POLICIES

from lossscale import AdaptivePolicy, DynamicPolicy, LogMaxPolicy, StaticPolicy


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: DynamicPolicy(init_scale=0.0), "init_scale"),
        (lambda: DynamicPolicy(init_scale=True), "init_scale"),
        (lambda: DynamicPolicy(init_scale="1"), "init_scale"),
        (lambda: DynamicPolicy(growth_factor=True), "growth_factor"),
        (lambda: DynamicPolicy(growth_factor="2.0"), "growth_factor"),
        (lambda: DynamicPolicy(backoff_factor="0.5"), "backoff_factor"),
        (lambda: DynamicPolicy(growth_interval=0), "growth_interval"),
        (lambda: DynamicPolicy(hysteresis=0), "hysteresis"),
        (lambda: StaticPolicy(scale=0.0), "scale"),
        (lambda: AdaptivePolicy(init_scale=0.0), "init_scale"),
        (lambda: AdaptivePolicy(margin_bits=31), "margin_bits"),
        (lambda: AdaptivePolicy(growth_interval=0), "growth_interval"),
        (lambda: AdaptivePolicy(search_bits=65), "search_bits"),
        (lambda: AdaptivePolicy(min_scale=0.0), "min_scale"),
        (lambda: AdaptivePolicy(min_scale=2.0**-127), "min_scale"),
        (lambda: AdaptivePolicy(max_scale=2.0**128), "max_scale"),
        (lambda: LogMaxPolicy(min_scale=2.0**-127), "min_scale"),
        (lambda: LogMaxPolicy(max_scale=2.0**128), "max_scale"),
        (lambda: LogMaxPolicy(beta1=True), "beta1"),
        (lambda: LogMaxPolicy(beta1=0.0), "beta1"),
        (lambda: LogMaxPolicy(beta1="0.9"), "beta1"),
        (lambda: LogMaxPolicy(beta2=1.0), "beta2"),
        (lambda: LogMaxPolicy(overflow_std_dev=True), "overflow_std_dev"),
        (lambda: LogMaxPolicy(overflow_std_dev=-1.0), "overflow_std_dev"),
        (lambda: LogMaxPolicy(overflow_std_dev=math.inf), "overflow_std_dev"),
        *[
            (lambda cls=cls, v=v: cls(max_consecutive_skips=v), "max_consecutive_skips")
            for cls in ALL_POLICIES
            for v in (0, True, 2.5)
        ],
    ],
)
def test_config_errors_are_value_errors_that_start_with_the_argument(make, name):
    """Kills: a validator handed another name (``"XXscaleXX"``, None), a dropped argument
    (``validate_stuck(on_stuck, None)``), ``or`` turned ``and`` in a type check (then a bool passes,
    or a string reaches a comparison and raises TypeError instead of ValueError)."""
    with pytest.raises(ValueError, match=f"^{name}="):
        quiet(make)


@pytest.mark.parametrize(
    "make",
    [
        lambda: AdaptivePolicy(margin_bits=30),
        lambda: AdaptivePolicy(search_bits=64),
        lambda: AdaptivePolicy(init_scale=2.0**-126, min_scale=2.0**-126, max_scale=2.0**127),
        lambda: LogMaxPolicy(init_scale=2.0**-126, min_scale=2.0**-126, max_scale=2.0**127),
        lambda: LogMaxPolicy(overflow_std_dev=0.0),
        lambda: DynamicPolicy(init_scale=2.0**-126, min_scale=None),
    ],
)
def test_configs_on_the_edge_of_the_valid_range_are_accepted(make):
    """Kills every bound made strict or moved by one (``<=`` to ``<``, 30 to 31, 2**-126 to 2**-127)."""
    quiet(make)


def test_more_config_edges():
    """Kills: an int config bound made strict at 2**62, the float32 range check letting 1e39 (inf in
    float32) through, LogMax's deviation bound moved off 100."""
    from lossscale._validate import validate_int

    validate_int("n", 2**62, 1)  # no upper bound given: the int64 device counters' 2**62
    with pytest.raises(ValueError, match="^n="):
        validate_int("n", 2**62 + 1, 1)
    assert LogMaxPolicy(overflow_std_dev=100.0).overflow_std_dev == 100.0
    for make, name in (
        (lambda: DynamicPolicy(init_scale=1e39, max_scale=None), "init_scale"),
        (lambda: LogMaxPolicy(overflow_std_dev=100.5), "overflow_std_dev"),
    ):
        with pytest.raises(ValueError, match=f"^{name}="):
            quiet(make)


def test_plain_bool_takes_bools_and_numpy_bools_only():
    """A checkpoint's bool field may be numpy's bool (either name), never another numpy number. Kills:
    any numpy scalar taken for a bool (``or`` for ``and``), numpy 1.x's name dropped."""
    from lossscale._validate import plain_bool

    assert plain_bool("flag", np.bool_(True)) is True and plain_bool("flag", False) is False

    class bool_:  # numpy 1.x's bool type, by its module and name (numpy 2 calls it "bool")
        __module__ = "numpy"

        def __bool__(self):
            return True

    assert plain_bool("flag", bool_()) is True
    for bad in (np.int64(1), np.float64(0.0), 1, "true"):
        with pytest.raises(ValueError, match="must be True or False"):
            plain_bool("flag", bad)


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan])
def test_a_scale_that_is_not_a_positive_finite_number_is_told_so(value):
    """Zero, a negative, inf and NaN fail the first check, whose message says what a scale must be (the
    float32 range check comes after). Kills: that check's ``or`` made ``and``, its ``<=`` made ``<``."""
    from lossscale._validate import positive_finite

    with pytest.raises(ValueError, match=r"^x=.* must be a finite number > 0\.$"):
        positive_finite("x", value)
