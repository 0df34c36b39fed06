#!/usr/bin/env bash
# GPU tests and the memcheck sanitizer side by side, then the benchmark alone (nothing else
# on the GPU while it times); logs under $OUT. Run on the device machine from the
# repository root (see shared/DEVICE.md):
#   bash benchmarks/gpu_check.sh [benchmark arguments...]
# STEPS (any of tests, sanitize, bench), TESTS (pytest arguments), WORKERS, TEST_SECONDS,
# SANITIZE ("memcheck racecheck" for both), SANITIZE_SECONDS and BENCH_SECONDS adjust it.
# The whole `-m gpu` suite takes about 7 minutes with 16 workers (H200, 2026-12-02, most of
# it compiling kernels; tests/long_first.py starts the long tests first), and the benchmark
# of one shape 3 to 4: a 10-minute device call holds one of the two, so run them as
# separate calls:
#   STEPS=tests bash benchmarks/gpu_check.sh
#   STEPS=bench bash benchmarks/gpu_check.sh --shapes qwen3
# An 80 GB card gets 7 workers (below): split the suite over two calls there, e.g.
#   STEPS=tests TESTS="-m gpu tests/test_gpu_runner.py" bash benchmarks/gpu_check.sh
#   STEPS=tests TESTS="-m gpu --ignore=tests/test_gpu_runner.py" bash benchmarks/gpu_check.sh
# or, on a machine of several cards, side by side in one call (benchmarks/per_gpu.sh).
set -o pipefail
source benchmarks/device_env.sh || exit 1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
steps=" ${STEPS:-tests sanitize bench} "
# Test workers: one per 10 GiB of the card, at most 16. The realistic-shape tests hold up to
# 20 GB each (DeepSeek's weights and workspace): 16 workers fit the H200's 141 GB, but on the
# H100's 80 GB they ran out of memory (27 of 46 tests of test_gpu_runner.py, 2026-11-28).
memory_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
workers=${WORKERS:-$(( memory_mib / 10240 < 16 ? memory_mib / 10240 : 16 ))}
if [[ $steps == *" tests "* ]]; then
  timeout "${TEST_SECONDS:-585}" python3 -m pytest -q -p no:cacheprovider -n "$workers" --maxprocesses="$workers" \
    ${TESTS:--m gpu} > "$OUT/gpu_tests.log" 2>&1 &
fi
if [[ $steps == *" sanitize "* ]]; then
  for tool in ${SANITIZE:-memcheck}; do
    timeout "${SANITIZE_SECONDS:-240}" compute-sanitizer --tool "$tool" --report-api-errors no --print-limit 20 python3 benchmarks/sanitize.py \
      > "$OUT/sanitize_$tool.log" 2>&1
  done
fi
wait
tail -n 60 "$OUT/gpu_tests.log" 2>/dev/null; tail -n 15 "$OUT"/sanitize_*.log 2>/dev/null
if [[ $steps == *" bench "* ]]; then
  timeout "${BENCH_SECONDS:-560}" python3 benchmarks/bench_moe.py --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
fi
