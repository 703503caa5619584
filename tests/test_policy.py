"""What every policy shares (``lossscale.policy``): the protocol, the state and its bookkeeping (the
counters of ``count``), ``check_state``'s generic checks, and the registry. Each policy's own rule is
tested in its own file: test_dynamic.py, test_static.py, test_adaptive.py, test_logmax.py."""

import pytest

from lossscale import DynamicPolicy, ScaleState


def test_counters_never_wrap():
    p = DynamicPolicy()
    s = p.init_state().replace(steps=2**63 - 1, skipped_steps=2**63 - 1, inf_steps=2**63 - 1)
    s = p.update(s, True)
    assert s.steps == 2**63 and s.skipped_steps == 2**63


def test_found_nan_without_found_inf_is_rejected():
    with pytest.raises(ValueError, match="found_inf"):
        DynamicPolicy().update(DynamicPolicy().init_state(), found_inf=False, found_nan=True)


def test_policy_state_is_a_plain_value():
    s = ScaleState(scale=1.0)
    with pytest.raises(Exception):
        s.scale = 2.0  # frozen
