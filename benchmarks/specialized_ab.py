"""The warp-specialised GEMM against the layer's tiles, side by side in one process, on the GPU:

    python3 benchmarks/specialized_ab.py --jobs mixtral:w4a16-g128:256 mixtral:nvfp4:256 [--rounds 2] \
        [--variant max_width=64 stages=3] [--without-tiles]

Formats: bench_moe.py's (`FORMATS`, with w4a16-g128-zp, int4 with zero points).

For each job (shape:format:M, as `compare_trees.py` names them) one layer and one routed
batch, run two ways: the oracle's warp-specialised backend
(`moe.oracle.specialized_backend`, `numba_kernels.gemm_specialized`, at the tile the token
count takes, whatever the tuned entry says) and the backend it picks without it (the tuned
entry or the heuristic's tiles);
with `--variant`, a third: the warp-specialised GEMM with that tile's fields changed as
given (`--without-tiles` leaves the tiles out: their kernels take minutes to compile at
prefill counts, and a device call has ten). First the outputs are compared with the tiles'
(else the oracle's way's; largest difference over the largest output), each line as soon as
its way has run; then, round by round, each way's two GEMMs as `bench_moe.py` times them
(replayed from a CUDA graph, the L2 flushed, best of three medians; the warp-specialised
pair with its gather and activation kernels) and its whole layer. A job the warp-specialised
GEMM does not take (its shape, format or slots an expert) is timed once, and says so.
"""

from __future__ import annotations

import argparse
import time

import attrs
import torch

import numba_kernels  # noqa: F401  (before numba: no simulator on a GPU machine)
import moe.oracle
from bench_moe import Timer, best_times, job_config, routing_for
from moe import MoELayer
from moe.weights import kernel_spec
from numba_kernels.gemm_specialized import SpecializedTile

TILE_NAMES = moe.oracle.SPECIALIZED_TILE_NAMES
OWN_TILES = tuple(getattr(moe.oracle, name) for name in TILE_NAMES)  # the oracle's, by token count
OWN = "the oracle's"
TUNED = moe.oracle.USE_TUNED
START = time.monotonic()


def say(line: str) -> None:
    """`line` at once, after the seconds since the start: a device call's budget goes
    mostly to compiling each way's kernels, which these times show."""
    print(f"[{time.monotonic() - START:5.0f} s] {line}", flush=True)


def choose(tile: SpecializedTile | str | None) -> None:
    """The oracle's choice from now on: the warp-specialised GEMM at its own tiles (OWN), at
    `tile` whatever the token count, or (None) not at all. The warp-specialised ways pass
    over the tuned entries, which may say the tiles at the count timed."""
    moe.oracle.USE_SPECIALIZED = tile is not None
    moe.oracle.USE_TUNED = TUNED and tile is None
    forced = isinstance(tile, SpecializedTile)
    for name, own in zip(TILE_NAMES, OWN_TILES):
        setattr(moe.oracle, name, tile if forced else own)


def time_way(timer, layer, hidden, logits, topk_weights, topk_ids) -> tuple[float, float]:
    """(GEMMs us, layer us) of `layer` as the oracle now chooses."""
    gemm_ms, layer_ms, _ = best_times(timer, layer, hidden, logits, topk_weights, topk_ids)
    return gemm_ms * 1e3, layer_ms * 1e3


def run_job(timer, job: str, rounds: int, variant: dict[str, int], with_tiles: bool) -> None:
    config, tokens = job_config(job)
    changed = attrs.evolve(moe.oracle.specialized_tile(config, tokens), **variant)
    ways = {"warp-specialised": OWN, **({f"variant {changed}": changed} if variant else {}),
            **({"tiles": None} if with_tiles else {})}
    if moe.oracle.specialized_backend(config, tokens, kernel_spec(config)) is None:
        say(f"{job}: the warp-specialised GEMM does not take it; the tiles timed once")
        ways, rounds = {"tiles": None}, 1
    layers = {}
    for name, tile in ways.items():  # each way a workspace of its own (its recorded forwards), sized for it
        choose(tile)
        layers[name] = MoELayer(config, max_tokens=tokens)
    weights = next(iter(layers.values())).weights
    weights.fill_random(seed=1)
    for layer in layers.values():
        layer.weights = weights
    generator = torch.Generator(device="cuda").manual_seed(tokens)
    hidden = torch.randn(tokens, config.hidden_size, generator=generator, device="cuda").to(torch.bfloat16)
    logits, topk_weights, topk_ids = routing_for(config, tokens, generator)
    reference = "tiles" if "tiles" in ways else "warp-specialised"
    choose(ways[reference])
    expected = layers[reference](hidden, logits).float()
    say(f"{job}: {reference} compiled and ran")
    for name, tile in ways.items():  # each line as its way has compiled: a call cut short still says these
        if name != reference:
            choose(tile)
            difference = (layers[name](hidden, logits).float() - expected).abs().max() / expected.abs().max()
            say(f"{job}: {name}'s outputs differ from {reference}'s by {float(difference):.1e} of the largest")
    for round_ in range(rounds):
        for name, tile in ways.items():
            choose(tile)
            gemm_us, layer_us = time_way(timer, layers[name], hidden, logits, topk_weights, topk_ids)
            say(f"  round {round_ + 1} {name:16s} GEMMs {gemm_us:9.1f} us   layer {layer_us:9.1f} us")
    choose(OWN)
    del layers
    torch.cuda.empty_cache()


def parse_variant(fields: list[str], tiles) -> dict[str, int]:
    """`--variant`'s KEY=VALUE fields, checked as changes to each of `tiles` (those the jobs
    take: a variant of the tile of blocks of 128, say, need not fit the widest's steps)."""
    try:
        variant = {key: int(value) for key, value in (f.split("=") for f in fields)}
        for tile in tiles:
            attrs.evolve(tile, **variant)
        return variant
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(f"--variant takes SpecializedTile fields as KEY=INT: {error}") from None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", nargs="+", default=["mixtral:w4a16-g128:256", "mixtral:nvfp4:256"],
                        help="shape:format:M")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--from-slots", type=float, metavar="SLOTS",
                        help="slots an expert from which the oracle takes the warp-specialised GEMM (default "
                             f"`moe.oracle.specialized_from`, {moe.oracle.LARGE_EXPERT_TOKENS_PER_EXPERT} or "
                             f"{moe.oracle.SPECIALIZED_TOKENS_PER_EXPERT}), to time it below, even in the decode "
                             f"tiles' regime (under {moe.oracle.DECODE_TOKENS_PER_EXPERT}, where the tuner does "
                             "not time it)")
    parser.add_argument("--variant", nargs="+", metavar="FIELD=VALUE",
                        help="also time the warp-specialised GEMM with these SpecializedTile fields changed")
    parser.add_argument("--without-tiles", action="store_true",
                        help="leave the tiles out (their kernels take minutes to compile at prefill counts): the "
                             "outputs are compared with the oracle's warp-specialised way's")
    args = parser.parse_args(argv)
    try:
        tiles = {moe.oracle.specialized_tile(*job_config(job)) for job in args.jobs}
    except ValueError as error:
        parser.error(f"--jobs: {error}")
    try:
        variant = parse_variant(args.variant, tiles) if args.variant else {}
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    if not torch.cuda.is_available():
        parser.error("it times kernels on a CUDA GPU and none is available here (the warp-specialised GEMM's "
                     "checks run in the simulator: tests/test_specialized.py)")
    if args.from_slots is not None:
        if args.from_slots <= 0:
            parser.error(f"--from-slots must be positive, got {args.from_slots}")
        moe.oracle.specialized_from = lambda config: args.from_slots
        moe.oracle.SPECIALIZED_CANDIDATE_TOKENS_PER_EXPERT = args.from_slots  # the tuner's gate, which it passes too
    timer = Timer()
    say(torch.cuda.get_device_name())
    for job in args.jobs:
        run_job(timer, job, args.rounds, variant, not args.without_tiles)


if __name__ == "__main__":
    main()
