"""Shared test configuration: tests marked ``slow`` run only when asked for (``-m slow``), and the
fixtures several test modules use.

Plain helpers (not fixtures) live in ``_models.py`` (tiny models, the torch-like settings, ``quiet``)
and ``_rules.py`` (a policy's tensor rule run beside its pure rule).
"""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Skip ``@pytest.mark.slow`` tests unless the marker expression names ``slow``."""
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """Run the test on one CPU thread: at these sizes OpenMP's barriers cost more than the math (ten
    times the run time on a busy 2-core machine). A module opts in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
