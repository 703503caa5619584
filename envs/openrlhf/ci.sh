#!/usr/bin/env bash
# OpenRLHF's DeepSpeed with lossscale, on CPU: a fresh venv in the directory given (default: a new temporary
# one), lossscale from this checkout, the pins in envs/openrlhf/constraints.txt (deepspeed 0.19.6, the release
# OpenRLHF 0.11.2 pins), then the tests of DeepSpeed's classic fp16 mode. .ci/run calls it; by hand:
#     bash envs/openrlhf/ci.sh /tmp/somewhere
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:-$(mktemp -d)}
pins=envs/openrlhf/constraints.txt
venv="$dir/openrlhf-env"

python -m venv "$venv"
"$venv/bin/pip" install -q -c "$pins" torch deepspeed transformers pytest
# openrlhf without its dependencies: flash-attn, vllm and ray need CUDA or a cluster; the tests load its
# DeepSpeed config builder by path (see tests/test_rl_openrlhf.py).
"$venv/bin/pip" install -q --no-deps -c "$pins" openrlhf
"$venv/bin/pip" install -q -c "$pins" -e .
# lossscale's integrations extra resolves beside OpenRLHF's pins (its deepspeed floor is 0.19.6).
"$venv/bin/pip" install -q --dry-run -c "$pins" -e ".[integrations]"

"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_rl_openrlhf.py
# The project's classic-fp16 DeepSpeed tests (ZeRO-0 to 3), on this release. Its ZeRO torch_autocast tests
# are left out: attach() refuses that mode before deepspeed 0.19.8 (test_rl_openrlhf.py checks the refusal).
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_integrations_deepspeed.py \
    -k "classic or loss_scaler or pr8588 or bad_loss or (checkpoint and fp16) or log_health or validation or zero0"
