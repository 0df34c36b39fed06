#!/usr/bin/env bash
# One device call: GPU tests, sanitizers, then the benchmark; logs under $OUT.
# Run on the device machine from the repository root (see shared/DEVICE.md):
#   bash benchmarks/gpu_check.sh [benchmark arguments...]
# TESTS (pytest arguments), TEST_SECONDS, SANITIZE=0/1 and BENCH_SECONDS adjust it.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
timeout "${TEST_SECONDS:-300}" python3 -m pytest -q -p no:cacheprovider ${TESTS:--m gpu} 2>&1 | tail -n 80 | tee "$OUT/gpu_tests.log"
if [ "${SANITIZE:-1}" = 1 ]; then
  for tool in memcheck racecheck; do
    timeout 150 compute-sanitizer --tool $tool --print-limit 20 python3 benchmarks/sanitize.py 2>&1 | tail -n 30 \
      | tee "$OUT/sanitize_$tool.log"
  done
fi
timeout "${BENCH_SECONDS:-280}" python3 benchmarks/bench_moe.py --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
