#!/usr/bin/env bash
# Independent GPU steps side by side, one per card of a multi-GPU machine: the i-th
# argument runs as a bash command with only card i visible, its output in $OUT/job<i>.log,
# and this waits for all of them. A timing step has its card to itself (CUDA events time
# the GPU, which nothing else shares); only host-side figures (the eager layer's host time)
# feel the others. Run on the device machine from the repository root, e.g. on four cards:
#   bash benchmarks/per_gpu.sh \
#     'bash benchmarks/refine_side_by_side.sh q1 "--experts 128 --top-k 8 --hidden 2048 --intermediate 768 --tokens 1" qwen3:w4a16-g128:1' \
#     'STEPS=tests TESTS="-m gpu tests/test_gpu_runner.py" bash benchmarks/gpu_check.sh' \
#     'STEPS=tests TESTS="-m gpu --ignore=tests/test_gpu_runner.py" bash benchmarks/gpu_check.sh' \
#     'STEPS=bench bash benchmarks/gpu_check.sh --shapes deepseek'
# A step that tunes works on a copy of the tree (refine_side_by_side.sh), never on the
# table that tests beside it read. Each step writes under a folder of its own ($OUT/gpu<i>:
# gpu_check.sh names its logs the same on every card); the folders come back packed in
# $OUT/steps.tar.gz (the device tool returns at most 8 files). It fails if any step failed.
set -o pipefail
source benchmarks/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cards=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
if (( $# == 0 || $# > cards )); then
  echo "per_gpu.sh: $# steps for $cards cards (one step a card, at least one)" >&2
  exit 2
fi
pids=()
for (( i = 0; i < $#; i++ )); do
  step=${@:i+1:1}
  mkdir -p "$OUT/gpu$i"
  (CUDA_VISIBLE_DEVICES=$i OUT="$OUT/gpu$i" bash -c "$step" > "$OUT/job$i.log" 2>&1; status=$?
   echo "exit $status" >> "$OUT/job$i.log"; exit $status) &
  pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
for log in "$OUT"/job*.log; do
  echo "== $log"; tail -n 25 "$log"
done
tar -czf "$OUT/steps.tar.gz" -C "$OUT" $(cd "$OUT" && ls -d gpu*) && rm -rf "$OUT"/gpu*
exit $failed
