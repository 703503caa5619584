#!/usr/bin/env bash
# The GPU check, in one call of at most 8 minutes on a bare device machine (torch there, nothing installed):
#   bash benchmarks/gpu_check.sh                 # results under $OUT (or benchmarks/results)
# It runs benchmarks/gpu_check.py from this source tree (PYTHONPATH=src, no pip): the CUDA tests (when
# pytest is there), one clean iteration of every path at the default settings beside torch under torch's
# sync detector (and "error" mode where torch's path makes no sync), the fused NaN-batch check, the sync
# counter beside torch's detector, each policy's tensor rule replayed from a CUDA graph (graph_rule.py),
# grad_stats timed per histogram method, and bench_scaler at the default and torch-like settings. Every
# result goes to $OUT/gpu_check.json (rewritten after each step, so a run cut short keeps what it
# measured), a one-screen summary to stdout.
# Its CPU twin runs in CI: python benchmarks/gpu_check.py --stand-in --quick (tests/test_fake_cuda.py).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
python -c "import torch" 2>/dev/null || { echo "gpu_check: torch cannot be imported here: nothing to check" >&2; exit 2; }
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "gpu_check: torch sees no CUDA device (the CPU twin: python benchmarks/gpu_check.py --stand-in)" >&2; exit 2; }
python -c "import pytest" 2>/dev/null \
    || echo "gpu_check: pytest is not installed: the CUDA tests are skipped, every other step runs" >&2
PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" timeout -k 10 465 python benchmarks/gpu_check.py --out "$out" "$@"
status=$?
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    echo "gpu_check: stopped at the 8-minute limit; $out/gpu_check.json holds the steps that finished" >&2
fi
exit "$status"
