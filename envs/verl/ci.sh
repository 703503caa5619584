#!/usr/bin/env bash
# The verl tests in a venv of their own: bash envs/verl/ci.sh DIR makes a fresh venv in DIR, installs
# lossscale from this checkout and verl with envs/verl/constraints.txt's exact pins, and runs
# tests/test_rl_verl.py. Fails on any failure, on a missing verl (the tests would skip) and on no tests run.
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: bash envs/verl/ci.sh DIR   (DIR: where to make the venv)" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=$1
started=$SECONDS

python -m venv "$venv"
"$venv/bin/pip" install -q -c "$here/constraints.txt" -e "$root"
"$venv/bin/pip" install -q -c "$here/constraints.txt" verl uvicorn fastapi pytest
"$venv/bin/python" -c "import verl, lossscale.integrations.verl; print('verl', verl.__version__)"
installed=$SECONDS
echo "envs/verl: venv installed in $((installed - started)) s"

cd "$root"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_rl_verl.py
echo "envs/verl: tests ran in $((SECONDS - installed)) s"
