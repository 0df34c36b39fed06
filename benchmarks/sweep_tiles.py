"""Time named tile families of the grouped GEMMs side by side, on the GPU: how the oracle's
defaults were chosen (and how to re-check them on another card).

For each shape, format and token count, every family's tile (its K split chosen by
`oracle.split_to_fill`, as the oracle would) is timed for gemm1 and gemm2 with
`moe.tune`'s measurement (CUDA-graph replays, L2 flushed, median); tiles a layout cannot
take are reported as skipped. Prints one line per measurement and writes JSON.

    python benchmarks/sweep_tiles.py --shapes mixtral qwen3 --tokens 1 16 --json sweep.json
"""

from __future__ import annotations

import argparse
import json

import attrs

import numba_kernels  # noqa: F401  (before numba: no simulator on a GPU machine)
from moe import MoEConfig
from moe.oracle import DECODE_TILE, PREFILL_TILE, SWAPPED_DECODE_TILE, heuristic_backend, split_to_fill
from moe.tune import tune

from bench_moe import FORMATS, ISSUE_FORMATS, SHAPES

FAMILIES = {  # the oracle's tiles and the variants they were measured against
    "decode-global": DECODE_TILE,
    "decode-swap": SWAPPED_DECODE_TILE,
    "decode-swap-k2": attrs.evolve(SWAPPED_DECODE_TILE, warps_k=2),
    "decode-swap-d2": attrs.evolve(SWAPPED_DECODE_TILE, slabs_per_warp=2),
    "decode-swap-k2d2": attrs.evolve(SWAPPED_DECODE_TILE, warps_k=2, slabs_per_warp=2),
    "decode-swap-d1": attrs.evolve(SWAPPED_DECODE_TILE, slabs_per_warp=1),
    "decode-swap-k8d1": attrs.evolve(SWAPPED_DECODE_TILE, warps_k=8, slabs_per_warp=1),
    "decode-swap-steady": attrs.evolve(SWAPPED_DECODE_TILE, steady_loop=True),
    "decode-swap-d2-steady": attrs.evolve(SWAPPED_DECODE_TILE, slabs_per_warp=2, steady_loop=True),
    "decode-swap-k2-steady": attrs.evolve(SWAPPED_DECODE_TILE, warps_k=2, steady_loop=True),
    "decode-staged-k4": attrs.evolve(DECODE_TILE, stages=4, a_in_shared=True),
    "decode-staged-n2k2": attrs.evolve(DECODE_TILE, warps_n=2, warps_k=2, stages=5, a_in_shared=True),
    "decode-staged-n4": attrs.evolve(DECODE_TILE, warps_n=4, warps_k=1, stages=6, a_in_shared=True),
    "prefill-32x256": attrs.evolve(PREFILL_TILE, block_m=32),
    "prefill-64x256": PREFILL_TILE,
    "prefill-64x256-m2": attrs.evolve(PREFILL_TILE, warps_m=2),
    "prefill-64x256-d1s6": attrs.evolve(PREFILL_TILE, slabs_per_warp=1, stages=6),
    "prefill-64x256-d2s3": attrs.evolve(PREFILL_TILE, slabs_per_warp=2, stages=3),
    "prefill-64x256-d2s4": attrs.evolve(PREFILL_TILE, slabs_per_warp=2, stages=4),
    "prefill-64x256-d2s6": attrs.evolve(PREFILL_TILE, slabs_per_warp=2, stages=6),
    "prefill-64x256-s2": attrs.evolve(PREFILL_TILE, stages=2),
    "prefill-64x256-s4": attrs.evolve(PREFILL_TILE, stages=4),
    "prefill-64x512-d2s3": attrs.evolve(PREFILL_TILE, warps_n=8, slabs_per_warp=2, stages=3),
    "prefill-128x256-d2s3": attrs.evolve(PREFILL_TILE, block_m=128, warps_m=2, slabs_per_warp=2, stages=3),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["mixtral", "qwen3"], choices=sorted(SHAPES))
    parser.add_argument("--formats", nargs="+", default=ISSUE_FORMATS, choices=list(FORMATS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--families", nargs="+", default=["decode-global", "decode-swap"],
                        choices=list(FAMILIES) + ["heuristic"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = []
    for shape in args.shapes:
        for fmt in args.formats:
            config = MoEConfig(**SHAPES[shape], quant=FORMATS[fmt])
            sizes = {config.hidden_size: config.gate_up_size, config.intermediate_size: config.hidden_size}

            def candidates(tokens, config, k):
                n = sizes[k]
                tiles = [split_to_fill(FAMILIES[f], config, tokens, n, k) for f in args.families if f in FAMILIES]
                if "heuristic" in args.families:
                    backend = heuristic_backend(config, tokens)
                    tiles.append(backend.gemm1 if k == config.hidden_size else backend.gemm2)
                return tiles

            def report(tokens, stage, tile, ms):
                row = dict(shape=shape, format=fmt, M=tokens, gemm=stage, tile=str(tile), ms=ms)
                rows.append(row)
                print(f"{shape:8s} {fmt:10s} M={tokens:<5d} {stage} {'skipped' if ms is None else f'{ms:.4f} ms'} "
                      f"{tile}", flush=True)

            tune(config, args.tokens, candidates=candidates, report=report, progress=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
