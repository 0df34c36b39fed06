"""What fetching a decode GEMM's weights into the L2 ahead of it could gain at best, on the GPU:

    python3 benchmarks/l2_bound.py --shapes qwen3 --tokens 1 4

A kernel before a GEMM (routing, or gemm1 for gemm2) could ask for the touched experts'
weights while it runs, so that the GEMM's own loads hit the L2 instead of DRAM. The best
such a prefetch can do is every byte already in the L2 when the GEMM starts, which this
times: the two GEMMs in sequence (the benchmark's GEMMs column), then gemm2 alone, each
with the L2 flushed as `bench_moe` flushes it and then, outside the timed span, the
touched experts' gemm2 weights (w2), gemm1 weights (w13) or both read back into it.
Only shapes whose touched weights fit the L2 can gain (Qwen3 at M <= 4).
"""

import argparse
import statistics

import torch

import numba_kernels  # noqa: F401  (before numba: no simulator on a GPU machine)
from bench_moe import FORMATS, SHAPES, Timer, captured, layer_gemms, routing_for
from moe import MoEConfig, MoELayer
from numba_kernels.launch import replaying


def expert_slices(stored, experts: torch.Tensor) -> list[torch.Tensor]:
    """Views of the touched experts' rows of each stored array (weights, scales, ...: E
    rows each): reading them reads the GEMM's own bytes."""
    count = stored.shape[0]
    return [t.view(count, -1)[e] for t in stored.tensors if t.numel() % count == 0 and t.numel() >= count
            for e in experts.tolist()]


def timed(run, timer: Timer, warm=(), repeats: int = 30) -> float:
    """Median us of `run` with the L2 flushed, then `warm`'s tensors read back into it."""
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        timer.flush()
        for t in warm:
            t.sum()
        torch.cuda._sleep(200_000)  # the GPU waits, so the host's launches are queued before the start
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) * 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3"], choices=list(SHAPES))
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4])
    args = parser.parse_args(argv)
    timer = Timer()
    generator = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; us, L2 flushed, then holding: nothing / w2 / w13 / both (GEMMs in "
          "sequence); nothing / w2 (gemm2 alone)")
    for shape in args.shapes:
        for format_name in args.formats:
            layer = MoELayer(MoEConfig(**SHAPES[shape], quant=FORMATS[format_name]), max_tokens=max(args.tokens))
            layer.weights.fill_random(seed=1)
            for tokens in args.tokens:
                config = layer.config
                hidden = torch.randn(tokens, config.hidden_size, generator=generator, device="cuda").to(torch.bfloat16)
                _, topk_weights, topk_ids = routing_for(config, tokens, generator)
                launch1, launch2, _ = layer_gemms(layer, hidden, topk_weights, topk_ids)
                gemm1, gemm2 = replaying(launch1), replaying(launch2)

                def in_sequence():
                    gemm1()
                    gemm2()

                experts = torch.unique(topk_ids).long()
                w13, w2 = expert_slices(layer.weights.w13, experts), expert_slices(layer.weights.w2, experts)
                both, alone = captured(in_sequence), captured(gemm2)
                times = [timed(both, timer, warm) for warm in ((), w2, w13, w13 + w2)]
                times += [timed(alone, timer, warm) for warm in ((), w2)]
                megabytes = [sum(t.nbytes for t in ts) / 1e6 for ts in (w13, w2)]
                print(f"{shape:8s} {format_name:11s} M={tokens:3d} (w13 {megabytes[0]:.1f} MB, w2 {megabytes[1]:.1f} MB) "
                      + " ".join(f"{t:7.1f}" for t in times), flush=True)
            del layer
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
