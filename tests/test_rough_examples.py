"""The examples as a new user runs them: piped output stays clean, a direct run of the torchrun example says how."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args, env=None, timeout=240):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_quickstart_piped_has_no_progress_bar():
    """Issue 12: piped output was flooded with tqdm's carriage returns; like the demo, no bar off a terminal."""
    pytest.importorskip("sklearn")
    pytest.importorskip("tqdm")
    done = _run("quickstart.py", "--epochs", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "\r" not in done.stderr and "it/s" not in done.stderr, done.stderr[-500:]
    assert "epoch 1: loss" in done.stdout


def test_ddp_example_run_directly_prints_the_torchrun_command():
    """Issue 12: ``python examples/ddp_torchrun.py`` died with torch's "RANK expected" traceback."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    done = _run("ddp_torchrun.py", "--steps", "3", env=env, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "torchrun --standalone --nproc_per_node=2 " in done.stderr
    assert done.stderr.rstrip().endswith("ddp_torchrun.py --steps 3")  # the user's own arguments carried over
