"""The warp-specialised GEMM against the layer's tiles, side by side in one process, on the GPU:

    python3 benchmarks/specialized_ab.py --jobs mixtral:w4a16-g128:256 mixtral:nvfp4:256 [--rounds 2]

For each job (shape:format:M, as `compare_trees.py` names them) one layer and one routed
batch, run two ways: the oracle's warp-specialised backend (`moe.oracle.specialized_backend`,
`numba_kernels.gemm_specialized`) and the backend it picks without it (the tuned entry or
the heuristic's tiles). First the two layers' outputs are compared (largest difference
over the largest output); then, round by round, each way's two GEMMs as `bench_moe.py`
times them (replayed from a CUDA graph, the L2 flushed, best of three medians; the
warp-specialised pair with its gather and activation kernels) and its whole layer. A job
the warp-specialised GEMM does not take (its shape, format or slots an expert) is timed
once, and says so.
"""

from __future__ import annotations

import argparse

import torch

import numba_kernels  # noqa: F401  (before numba: no simulator on a GPU machine)
import moe.oracle
from bench_moe import FORMATS, SHAPES, Timer, best_times, routing_for
from compare_trees import parse_job
from moe import MoEConfig, MoELayer


def time_way(timer, layer, hidden, logits, topk_weights, topk_ids) -> tuple[float, float, str]:
    """(GEMMs us, layer us, backend) of `layer` as the oracle now chooses."""
    gemm_ms, layer_ms, backend = best_times(timer, layer, hidden, logits, topk_weights, topk_ids)
    return gemm_ms * 1e3, layer_ms * 1e3, "warp-specialised" if backend.specialized else "tiles"


def run_job(timer, job: str, rounds: int) -> None:
    shape, format_name, tokens = parse_job(job)
    config = MoEConfig(**SHAPES[shape], quant=FORMATS[format_name])
    layers = {}
    for way in (True, False):  # each way a workspace of its own (its recorded forwards)
        moe.oracle.USE_SPECIALIZED = True  # so that both workspaces hold both ways' buffers
        layers[way] = MoELayer(config, max_tokens=tokens)
    layers[True].weights.fill_random(seed=1)
    layers[False].weights = layers[True].weights
    generator = torch.Generator(device="cuda").manual_seed(tokens)
    hidden = torch.randn(tokens, config.hidden_size, generator=generator, device="cuda").to(torch.bfloat16)
    logits, topk_weights, topk_ids = routing_for(config, tokens, generator)
    if moe.oracle.specialized_backend(config, tokens, layers[True].weights.spec) is None:
        print(f"{job}: the warp-specialised GEMM does not take it; the tiles timed once")
        moe.oracle.USE_SPECIALIZED = False
        gemm_us, layer_us, name = time_way(timer, layers[False], hidden, logits, topk_weights, topk_ids)
        print(f"  {name:16s} GEMMs {gemm_us:9.1f} us   layer {layer_us:9.1f} us", flush=True)
        rounds = 0
    else:
        outputs = {}
        for way, layer in layers.items():
            moe.oracle.USE_SPECIALIZED = way
            outputs[way] = layer(hidden, logits).float()
        difference = float((outputs[True] - outputs[False]).abs().max() / outputs[False].abs().max())
        print(f"{job}: outputs differ by {difference:.1e} of the largest", flush=True)
    for round_ in range(rounds):
        for way, layer in layers.items():
            moe.oracle.USE_SPECIALIZED = way
            gemm_us, layer_us, name = time_way(timer, layer, hidden, logits, topk_weights, topk_ids)
            print(f"  round {round_ + 1} {name:16s} GEMMs {gemm_us:9.1f} us   layer {layer_us:9.1f} us", flush=True)
    moe.oracle.USE_SPECIALIZED = True
    del layers
    torch.cuda.empty_cache()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", nargs="+", default=["mixtral:w4a16-g128:256", "mixtral:nvfp4:256"],
                        help="shape:format:M")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window", type=float, nargs=2, metavar=("LOW", "HIGH"),
                        help="slots an expert at which the oracle takes the warp-specialised GEMM (default "
                             f"{moe.oracle.SPECIALIZED_TOKENS_PER_EXPERT}): to time it beyond")
    args = parser.parse_args(argv)
    for job in args.jobs:
        parse_job(job)
    if not torch.cuda.is_available():
        parser.error("it times kernels on a CUDA GPU and none is available here (the warp-specialised GEMM's "
                     "checks run in the simulator: tests/test_specialized.py)")
    if args.window:
        moe.oracle.SPECIALIZED_TOKENS_PER_EXPERT = tuple(args.window)
    timer = Timer()
    print(f"{torch.cuda.get_device_name()}")
    for job in args.jobs:
        run_job(timer, job, args.rounds)


if __name__ == "__main__":
    main()
