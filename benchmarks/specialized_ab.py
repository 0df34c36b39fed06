"""The warp-specialised GEMM against the layer's tiles, side by side in one process, on the GPU:

    python3 benchmarks/specialized_ab.py --jobs mixtral:w4a16-g128:256 mixtral:nvfp4:256 [--rounds 2] \
        [--variant max_width=64 stages=3]

For each job (shape:format:M, as `compare_trees.py` names them) one layer and one routed
batch, run two ways: the oracle's warp-specialised backend (`moe.oracle.specialized_backend`,
`numba_kernels.gemm_specialized`) and the backend it picks without it (the tuned entry or
the heuristic's tiles); with `--variant`, a third: the warp-specialised GEMM with those
fields of its `SpecializedTile` changed. First the outputs are compared with the tiles'
(largest difference over the largest output); then, round by round, each way's two GEMMs
as `bench_moe.py` times them (replayed from a CUDA graph, the L2 flushed, best of three
medians; the warp-specialised pair with its gather and activation kernels) and its whole
layer. A job the warp-specialised GEMM does not take (its shape, format or slots an
expert) is timed once, and says so.
"""

from __future__ import annotations

import argparse

import attrs
import torch

import numba_kernels  # noqa: F401  (before numba: no simulator on a GPU machine)
import moe.oracle
from bench_moe import FORMATS, SHAPES, Timer, best_times, routing_for
from compare_trees import parse_job
from moe import MoEConfig, MoELayer
from numba_kernels.gemm_specialized import SpecializedTile

DEFAULT_TILE = moe.oracle.SPECIALIZED_TILE


def choose(tile: SpecializedTile | None) -> None:
    """The oracle's choice from now on: the warp-specialised GEMM with `tile`, or (None) without it."""
    moe.oracle.USE_SPECIALIZED = tile is not None
    moe.oracle.SPECIALIZED_TILE = tile or DEFAULT_TILE


def time_way(timer, layer, hidden, logits, topk_weights, topk_ids) -> tuple[float, float]:
    """(GEMMs us, layer us) of `layer` as the oracle now chooses."""
    gemm_ms, layer_ms, _ = best_times(timer, layer, hidden, logits, topk_weights, topk_ids)
    return gemm_ms * 1e3, layer_ms * 1e3


def run_job(timer, job: str, rounds: int, variant: SpecializedTile | None) -> None:
    shape, format_name, tokens = parse_job(job)
    config = MoEConfig(**SHAPES[shape], quant=FORMATS[format_name])
    variants = {} if variant is None else {f"variant {variant}": variant}
    ways = {"warp-specialised": DEFAULT_TILE, **variants, "tiles": None}
    layers = {}
    for name in ways:  # each way a workspace of its own (its recorded forwards)
        choose(DEFAULT_TILE)  # so that every workspace holds both kinds of buffers
        layers[name] = MoELayer(config, max_tokens=tokens)
    layers["tiles"].weights.fill_random(seed=1)
    for layer in layers.values():
        layer.weights = layers["tiles"].weights
    generator = torch.Generator(device="cuda").manual_seed(tokens)
    hidden = torch.randn(tokens, config.hidden_size, generator=generator, device="cuda").to(torch.bfloat16)
    logits, topk_weights, topk_ids = routing_for(config, tokens, generator)
    if moe.oracle.specialized_backend(config, tokens, layers["tiles"].weights.spec) is None:
        print(f"{job}: the warp-specialised GEMM does not take it; the tiles timed once")
        ways, rounds = {"tiles": None}, 1
    else:
        outputs = {}
        for name, tile in ways.items():
            choose(tile)
            outputs[name] = layers[name](hidden, logits).float()
        largest = outputs["tiles"].abs().max()
        for name in ways:
            if name != "tiles":
                difference = float((outputs[name] - outputs["tiles"]).abs().max() / largest)
                print(f"{job}: {name}'s outputs differ from the tiles' by {difference:.1e} of the largest", flush=True)
    for round_ in range(rounds):
        for name, tile in ways.items():
            choose(tile)
            gemm_us, layer_us = time_way(timer, layers[name], hidden, logits, topk_weights, topk_ids)
            print(f"  round {round_ + 1} {name:16s} GEMMs {gemm_us:9.1f} us   layer {layer_us:9.1f} us", flush=True)
    choose(DEFAULT_TILE)
    del layers
    torch.cuda.empty_cache()


def parse_variant(fields: list[str]) -> SpecializedTile:
    """`--variant`'s KEY=VALUE fields as a SpecializedTile (the default's other fields)."""
    try:
        return attrs.evolve(DEFAULT_TILE, **{key: int(value) for key, value in (f.split("=") for f in fields)})
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(f"--variant takes SpecializedTile fields as KEY=INT: {error}") from None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", nargs="+", default=["mixtral:w4a16-g128:256", "mixtral:nvfp4:256"],
                        help="shape:format:M")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window", type=float, nargs=2, metavar=("LOW", "HIGH"),
                        help="slots an expert at which the oracle takes the warp-specialised GEMM (default "
                             f"{moe.oracle.SPECIALIZED_TOKENS_PER_EXPERT}): to time it beyond")
    parser.add_argument("--variant", nargs="+", metavar="FIELD=VALUE",
                        help="also time the warp-specialised GEMM with these SpecializedTile fields changed")
    args = parser.parse_args(argv)
    for job in args.jobs:
        parse_job(job)
    try:
        variant = parse_variant(args.variant) if args.variant else None
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    if not torch.cuda.is_available():
        parser.error("it times kernels on a CUDA GPU and none is available here (the warp-specialised GEMM's "
                     "checks run in the simulator: tests/test_specialized.py)")
    if args.window:
        moe.oracle.SPECIALIZED_TOKENS_PER_EXPERT = tuple(args.window)
    timer = Timer()
    print(f"{torch.cuda.get_device_name()}")
    for job in args.jobs:
        run_job(timer, job, args.rounds, variant)


if __name__ == "__main__":
    main()
