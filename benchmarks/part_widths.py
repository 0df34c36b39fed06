"""What a part of the warp-specialised GEMM costs at each width, on the GPU:

    python3 benchmarks/part_widths.py --shape qwen3 --format w4a16-g128 --widths 32 64 128 256 [--tile widest] \
        [--variants stages=4 stages=6]

The warp-specialised GEMM (`numba_kernels.gemm_specialized`) runs a CTA per column panel
and *part* (up to `max_width` slots of one expert). Under random routing an expert just
past a multiple of max_width gets a last part of a few slots, which runs the whole K loop
as a full part does. Whether that matters depends on how a part's time grows with its
width: this times the layer's four warp-specialised kernels (gather, gemm1, activation,
gemm2; each alone, replayed from a CUDA graph, the L2 flushed, median) with every expert
given exactly `w` slots (`uniform_routing`: tokens = w x experts / top_k), one line a
width, then the benchmark's random routing at `--tokens` for comparison (with its count of
parts at each width). With `--variants`, each line for each variant of the tile in turn
(a layer each, the same weights).
"""

from __future__ import annotations

import argparse

import attrs
import torch

import numba_kernels  # noqa: F401  (before numba: no simulator on a GPU machine)
import moe.oracle
from bench_moe import FORMATS, SHAPES, Timer, captured, routing_for
from moe import MoEConfig, MoELayer, check_inputs, prepare
from numba_kernels.gemm_specialized import specialized_gemm
from numba_kernels.launch import replaying
from numba_kernels.stage_blocks import activate_blocks, gather_blocks
from specialized_ab import OWN_TILES, choose, parse_variant

TILES = dict(zip(("narrow", "default", "wide", "widest"), OWN_TILES))  # the oracle's, narrowest first


def uniform_routing(config: MoEConfig, per_expert: int, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights, topk_ids) giving every expert exactly `per_expert` slots: token t
    takes experts top_k t .. top_k t + top_k - 1 (mod E), all distinct."""
    experts, top_k = config.num_experts, config.top_k
    tokens, rest = divmod(per_expert * experts, top_k)
    if rest or top_k > experts:
        raise ValueError(f"{per_expert} slots an expert: per_expert x E ({experts}) must be a multiple of top_k "
                         f"({top_k}), which must not exceed E")
    ids = (torch.arange(tokens, device=device)[:, None] * top_k + torch.arange(top_k, device=device)) % experts
    return torch.full((tokens, top_k), 1.0 / top_k, device=device), ids.to(torch.int32)


def specialized_times(timer: Timer, layer: MoELayer, topk_weights, topk_ids) -> dict:
    """Each warp-specialised kernel of the layer alone (us) for the routed batch, and the
    count of parts at each width (from `picks`). Not `bench_moe.kernel_times`: that one
    records the layer with hooks, which never take the warp-specialised GEMM."""
    config, weights = layer.config, layer.weights
    hidden = torch.randn(topk_ids.shape[0], config.hidden_size, device="cuda").to(torch.bfloat16)
    inputs = check_inputs(config, weights, layer.workspace, hidden, topk=(topk_weights, topk_ids), check_ids=False)
    prepared = prepare(config, weights, layer.workspace, inputs)
    tile, buffers = prepared.backend.specialized, prepared.buffers
    if tile is None:
        raise RuntimeError("the oracle did not take the warp-specialised GEMM")
    alignment = (buffers.sorted_token_ids, buffers.expert_ids, buffers.num_tokens_post_padded)
    picks, blocks = buffers.picks, buffers.stage_blocks
    slots = topk_ids.numel()
    steps = {
        "gather": lambda: gather_blocks(hidden, alignment, slots, config.top_k, tile, picks, blocks),
        "gemm1": lambda: specialized_gemm(blocks, weights.w13, picks, alignment[1], alignment[0], buffers.gemm1_out,
                                          tile, blocked=True, check_ids=False),
        "activation": lambda: activate_blocks(buffers.gemm1_out, config.activation, tile, picks, blocks),
        "gemm2": lambda: specialized_gemm(blocks, weights.w2, picks, alignment[1], alignment[0], buffers.gemm2_out,
                                          tile, blocked=False, check_ids=False),
    }
    times = {}
    for name, step in steps.items():  # in order: each reads what the one before wrote (captured runs it first)
        times[name] = timer(captured(replaying(step)), repeats=30) * 1e3
    used = picks[picks >= 0]
    widths = torch.bincount(used.long(), minlength=len(tile.widths)).tolist()
    times["parts"] = {w: count for w, count in zip(tile.widths, widths) if count}
    return times


def line(label: str, times: dict) -> str:
    kernels = "  ".join(f"{name} {times[name]:8.1f}" for name in ("gather", "gemm1", "activation", "gemm2"))
    return f"{label:34s} {kernels}   GEMMs {times['gemm1'] + times['gemm2']:8.1f} us   parts {times['parts']}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3", choices=list(SHAPES))
    parser.add_argument("--format", default="w4a16-g128", choices=list(FORMATS))
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 64, 128, 192, 256],
                        help="slots an expert, one run each")
    parser.add_argument("--tokens", type=int, default=4096, help="the random routing's token count")
    parser.add_argument("--tile", default="widest", choices=list(TILES), help="the oracle's tile, forced")
    parser.add_argument("--variants", nargs="+", metavar="FIELD=VALUE[,FIELD=VALUE]",
                        help="the tile with these SpecializedTile fields changed, each timed")
    args = parser.parse_args(argv)
    tile = TILES[args.tile]
    try:  # label: tile
        tiles = {fields: attrs.evolve(tile, **parse_variant(fields.split(","), [tile]))
                 for fields in args.variants} if args.variants else {args.tile: tile}
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    if not torch.cuda.is_available():
        parser.error("it times kernels on a CUDA GPU and none is available here")
    config = MoEConfig(**SHAPES[args.shape], quant=FORMATS[args.format])
    moe.oracle.specialized_from = lambda config: 1
    max_tokens = max(args.tokens, max(args.widths) * config.num_experts // config.top_k)
    layers, weights = {}, None
    for label, variant in tiles.items():  # a layer each (its buffers sized for its tile), the same weights
        choose(variant)
        layers[label] = MoELayer(config, max_tokens=max_tokens)
        weights = layers[label].weights if weights is None else weights
        layers[label].weights = weights
    weights.fill_random(seed=1)
    timer = Timer()
    print(f"{torch.cuda.get_device_name()}: {args.shape} {args.format}, {tile}")
    generator = torch.Generator(device="cuda").manual_seed(args.tokens)
    routings = [(f"{width} an expert", uniform_routing(config, width)) for width in args.widths]
    routings.append((f"random, M = {args.tokens}", routing_for(config, args.tokens, generator)[1:]))
    for label, routing in routings:
        for name, layer in layers.items():
            choose(tiles[name])
            print(line(f"{label}, {name}", specialized_times(timer, layer, *routing)), flush=True)


if __name__ == "__main__":
    main()
