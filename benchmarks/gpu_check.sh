#!/usr/bin/env bash
# The first GPU run, in one command (under 8 minutes on one GPU):
#   bash benchmarks/gpu_check.sh
# 1. the CUDA tests (the device-parametrised suite's CUDA half, CUDA graphs, a second GPU if present);
# 2. the tests of the device paths, which then also see torch.cuda (kernels, architecture, syncs, clip);
# 3. the scaler benchmark on the GPU (1M and 10M parameters, 16 and 200 tensors), side by side with torch.
# Results land in benchmarks/results/bench_scaler_cuda.{json,md} (or $OUT when set).
# It installs nothing into torch: the GPU machine's own CUDA build of torch is used.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device')"
pip install -q --no-deps -e . && pip install -q "pytest>=7" "hypothesis>=6.80"
python -c "import torch; print('torch', torch.__version__, 'on', torch.cuda.get_device_name(0), 'x', torch.cuda.device_count())"
out="${OUT:-benchmarks/results}"
status=0
timeout 240 python -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider || status=1
timeout 120 python -m pytest -q tests/test_kernels.py tests/test_architecture.py tests/test_syncs.py tests/test_clip.py \
    -p no:cacheprovider || status=1
timeout 150 python benchmarks/bench_scaler.py --device cuda --sizes 1000000x16,1000000x200,10000000x16,10000000x200 \
    --out "$out" || status=1
cat "$out/bench_scaler_cuda.md" 2>/dev/null | head -20 || true
exit $status
