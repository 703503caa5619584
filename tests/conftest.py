"""Shared test configuration: tests marked ``slow`` run only when asked for (``-m slow``)."""

import pytest


def pytest_collection_modifyitems(config, items):
    """Skip ``@pytest.mark.slow`` tests unless the marker expression names ``slow``."""
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
