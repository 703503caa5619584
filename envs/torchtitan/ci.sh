#!/usr/bin/env bash
# torchtitan's tests (tests/test_rl_torchtitan.py) in their own venv: torchtitan's pins clash with the main
# test environment's (constraints.txt). Usage: bash envs/torchtitan/ci.sh DIR, where DIR is a path for a new
# venv. Installs lossscale from this checkout and envs/torchtitan/constraints.txt's pins, then runs the tests.
# Fails when the install or a test fails, and when torchtitan does not import (the tests would only skip).
set -euo pipefail
venv="$1"
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
started=$SECONDS
python -m venv "$venv"
"$venv/bin/pip" install -q -c envs/torchtitan/constraints.txt -e . torchtitan pytest
"$venv/bin/python" -c "import torchtitan"
echo "envs/torchtitan: venv installed in $((SECONDS - started)) s"
started=$SECONDS
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_rl_torchtitan.py
echo "envs/torchtitan: tests ran in $((SECONDS - started)) s"
