"""What fetching a decode GEMM's weights into the L2 ahead of it could gain at best, on the GPU:

    python3 benchmarks/l2_bound.py --shapes qwen3 --tokens 1 4

A kernel before a GEMM (routing, or gemm1 for gemm2) could ask for the touched experts'
weights while it runs, so that the GEMM's own loads hit the L2 instead of DRAM. The best
such a prefetch can do is every byte already in the L2 when the GEMM starts, which this
times: the two GEMMs in sequence (the benchmark's GEMMs column), then gemm2 alone, each
with the L2 flushed as `bench_moe` flushes it and then, outside the timed span, the
touched experts' gemm2 weights (w2), gemm1 weights (w13) or both read back into it.
Only shapes whose touched weights fit the L2 can gain (Qwen3 at M = 1). benchmarks/LOG.md,
fifty-ninth session.
"""

import argparse

import torch

import numba_kernels  # noqa: F401  (before numba: no simulator on a GPU machine)
from bench_moe import FORMATS, ISSUE_FORMATS, SHAPES, Timer, captured, layer_gemms, routed_batches
from numba_kernels.launch import replaying


def expert_slices(stored, experts: torch.Tensor) -> list[torch.Tensor]:
    """Views of the touched experts' rows of each stored array (weights, scales, ...: E
    rows each): reading them reads the GEMM's own bytes."""
    count = stored.shape[0]
    return [t.view(count, -1)[e] for t in stored.tensors if t.numel() % count == 0 and t.numel() >= count
            for e in experts.tolist()]


def holding(tensors):
    """A Timer `prepare` that reads `tensors` into the L2, then has the GPU wait a while:
    without the wait, a chain of small reads lets the GPU catch up with the host, and the
    timed span would include the host's launch of the graph (15.9 -> 19.9 us, where a
    single large flush leaves the host ahead)."""

    def prepare():
        for t in tensors:
            t.sum()
        torch.cuda._sleep(200_000)

    return prepare


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3"], choices=list(SHAPES))
    parser.add_argument("--formats", nargs="+", default=ISSUE_FORMATS, choices=list(FORMATS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4])
    args = parser.parse_args(argv)
    timer = Timer()
    generator = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; us, L2 flushed, then holding: nothing / w2 / w13 / both (GEMMs in "
          "sequence); nothing / w2 (gemm2 alone)")
    for shape, format_name, tokens, layer, hidden, topk_weights, topk_ids in routed_batches(
            args.shapes, args.formats, args.tokens, generator):
        launch1, launch2, _ = layer_gemms(layer, hidden, topk_weights, topk_ids)
        gemm1, gemm2 = replaying(launch1), replaying(launch2)

        def in_sequence():
            gemm1()
            gemm2()

        experts = torch.unique(topk_ids).long()
        w13, w2 = expert_slices(layer.weights.w13, experts), expert_slices(layer.weights.w2, experts)
        both, alone = captured(in_sequence), captured(gemm2)
        times = [timer(both, prepare=holding(warm)) for warm in ((), w2, w13, w13 + w2)]
        times += [timer(alone, prepare=holding(warm)) for warm in ((), w2)]
        megabytes = [sum(t.nbytes for t in ts) / 1e6 for ts in (w13, w2)]
        print(f"{shape:8s} {format_name:11s} M={tokens:3d} (w13 {megabytes[0]:.1f} MB, w2 {megabytes[1]:.1f} MB) "
              + " ".join(f"{t * 1e3:7.1f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
