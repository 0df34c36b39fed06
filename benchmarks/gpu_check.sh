#!/usr/bin/env bash
# One device call: GPU tests and the memcheck sanitizer side by side, then the benchmark
# alone (nothing else on the GPU while it times); logs under $OUT.
# Run on the device machine from the repository root (see shared/DEVICE.md):
#   bash benchmarks/gpu_check.sh [benchmark arguments...]
# TESTS (pytest arguments), WORKERS, TEST_SECONDS, SANITIZE (none | memcheck | "memcheck racecheck"),
# SANITIZE_SECONDS and BENCH_SECONDS adjust it.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
workers=${WORKERS:-6}
timeout "${TEST_SECONDS:-240}" python3 -m pytest -q -p no:cacheprovider -n "$workers" --maxprocesses="$workers" \
  ${TESTS:--m gpu} > "$OUT/gpu_tests.log" 2>&1 &
for tool in ${SANITIZE:-memcheck}; do
  [ "$tool" = none ] && continue
  timeout "${SANITIZE_SECONDS:-240}" compute-sanitizer --tool "$tool" --report-api-errors no --print-limit 20 python3 benchmarks/sanitize.py \
    > "$OUT/sanitize_$tool.log" 2>&1
done
wait
tail -n 60 "$OUT/gpu_tests.log"; tail -n 15 "$OUT"/sanitize_*.log 2>/dev/null
timeout "${BENCH_SECONDS:-280}" python3 benchmarks/bench_moe.py --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
