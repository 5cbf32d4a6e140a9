#!/usr/bin/env bash
# The GPU check of the Triton kernels, for a lent CUDA machine: correctness (compiled,
# bfloat16 included), then timing. Writes logs under $OUT when set.
set -uo pipefail
OUT=${OUT:-/tmp/pdserve-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
timeout "${TEST_TIMEOUT:-280}" python3 -m pytest -q tests/kernels -p no:cacheprovider \
    --durations=5 2>&1 | tee "$OUT/kernel_tests.log" | tail -25
timeout "${BENCH_TIMEOUT:-220}" python3 -m pdserve.bench.kernels 2>&1 | tee "$OUT/bench_kernels.log"
