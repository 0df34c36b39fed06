#!/usr/bin/env bash
# Refine tuned entries in a private copy of the tree, then time them against the tree
# before, side by side; the refined table comes back as $OUT/<device>_<name>.json, its
# entries taken job by job where the side-by-side figures agree with the refine
# (benchmarks/take_entries.py REFINED TABLE JOB...). Run on the device
# machine from the repository root (several at once, one card each: benchmarks/per_gpu.sh):
#   bash benchmarks/refine_side_by_side.sh NAME "TUNE ARGS[;TUNE ARGS...]" JOB [JOB...]
# e.g.
#   bash benchmarks/refine_side_by_side.sh q1 \
#     "--experts 128 --top-k 8 --hidden 2048 --intermediate 768 --tokens 1;--experts 128 --top-k 8 --hidden 2048 --intermediate 768 --tokens 1 --format nvfp4" \
#     qwen3:w4a16-g128:1 qwen3:nvfp4:1
# Each TUNE ARGS runs `python3 -m moe.tune ARGS --refine`; the JOBs are compare_trees.py's.
# The copy keeps the tree's own table untouched, so GPU tests beside it read a whole file.
set -o pipefail
source benchmarks/device_env.sh || exit 1
(( $# >= 3 )) || { echo "usage: $0 NAME 'TUNE ARGS[;...]' JOB [JOB...]" >&2; exit 2; }
name=$1 tunes=$2; shift 2
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
before=/tmp/refine_$name/before after=/tmp/refine_$name/after
rm -rf "/tmp/refine_$name" && mkdir -p "$before" || exit 1
cp -r moe numba_kernels layouts benchmarks "$before"/ && cp -r "$before" "$after" || exit 1
cd "$after" && export PYTHONPATH=/tmp/site:$after
IFS=';' read -ra runs <<< "$tunes"
for args in "${runs[@]}"; do
  python3 -m moe.tune $args --refine || exit 1
done
for table in moe/tuned/*/*.json; do  # before the comparison: a call that runs out of time keeps the refine
  cmp -s "$table" "$before/$table" || cp "$table" "$OUT/$(basename "$table" .json)_$name.json"
done
python3 benchmarks/compare_trees.py --trees before="$before" after="$after" --jobs "$@" --rounds 2 || exit 1
