#!/usr/bin/env bash
# The GPU check, in one call of at most 8 minutes on a bare device machine (torch there, nothing installed):
#   bash benchmarks/gpu_check.sh                 # results under $OUT (or benchmarks/results)
# It runs benchmarks/gpu_check.py from this source tree (PYTHONPATH=src, no pip): the CUDA tests (when
# pytest is there), the syncs torch's own detector sees per iteration on every path beside torch's, the
# kernels the profiler counts per iteration beside torch's, a fused NaN batch, a fused AdamW iteration
# (unscale_/clip_grad_norm_, step, update) captured in a CUDA graph and replayed bitwise against eager,
# skips included (that step has never run yet: written without a GPU), and bench_iteration on the GPU. Every result goes to $OUT/gpu_check.json (rewritten after each step), a summary to stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
python -c "import torch" 2>/dev/null || { echo "gpu_check: torch cannot be imported here: nothing to check" >&2; exit 2; }
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "gpu_check: torch sees no CUDA device" >&2; exit 2; }
python -c "import pytest" 2>/dev/null \
    || echo "gpu_check: pytest is not installed: the tests step fails, every other step runs" >&2
PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" timeout -k 10 465 python benchmarks/gpu_check.py --out "$out" "$@"
status=$?
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    echo "gpu_check: stopped at the 8-minute limit; $out/gpu_check.json holds the steps that finished" >&2
fi
exit "$status"
