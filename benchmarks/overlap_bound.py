"""What one kernel running both decode GEMMs could gain at best, on the GPU:

    python3 benchmarks/overlap_bound.py --shapes qwen3 mixtral

Such a kernel would let gemm2's CTAs stream their weights while gemm1 runs, then wait for
gemm1's output. Nothing of that kind can beat the two tuned GEMMs (each with its
reduction, as the layer runs them) launched on two streams with no dependency at all,
which this times from one CUDA graph beside the two in sequence (the benchmark's GEMMs
column), each alone, and plain reads of their bytes in two kernels and in one. Timed as
`bench_moe` times (L2 flushed, median); gemm2 reads whatever its intermediate buffer holds
(the result is not the layer's, only the time counts). LOG.md, thirty-fifth session.
"""

import argparse

import torch

import numba_kernels  # noqa: F401  (before numba: no simulator on a GPU machine)
from bench_moe import FORMATS, ISSUE_FORMATS, SHAPES, Timer, captured, gemm_bytes, layer_gemms, routed_batches
from numba_kernels.launch import replaying
from reads import PlainReads


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3"], choices=list(SHAPES))
    parser.add_argument("--formats", nargs="+", default=ISSUE_FORMATS, choices=list(FORMATS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16])
    args = parser.parse_args(argv)
    timer, side = Timer(), torch.cuda.Stream()
    generator = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; us: in sequence, concurrent (no dependency), gemm1 alone, gemm2 alone, "
          "plain reads in two kernels, in one")
    for shape, format_name, tokens, layer, hidden, topk_weights, topk_ids in routed_batches(
            args.shapes, args.formats, args.tokens, generator):
        # The functions keep what the replays read alive (a `Replay` holds addresses only).
        launch1, launch2, _ = layer_gemms(layer, hidden, topk_weights, topk_ids, own_counters=True)
        gemm1, gemm2 = replaying(launch1), replaying(launch2)
        byte_counts = gemm_bytes(layer, int(torch.unique(topk_ids).numel()))

        def in_sequence():
            gemm1()
            gemm2()

        def concurrent():
            main_stream = torch.cuda.current_stream()
            side.wait_stream(main_stream)
            gemm1()
            with torch.cuda.stream(side):
                gemm2()
            main_stream.wait_stream(side)

        reads = [PlainReads(byte_counts), PlainReads([sum(byte_counts)])]  # their buffers stay alive
        runs = (in_sequence, concurrent, gemm1, gemm2, *map(replaying, reads))
        times = [timer(captured(run)) * 1e3 for run in runs]
        print(f"{shape:8s} {format_name:11s} M={tokens:3d} " + " ".join(f"{t:7.1f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
