"""The warp-specialised path's two kernels besides its GEMMs, alone, against the card's copy
bandwidth, on the GPU:

    python3 benchmarks/stage_blocks_rates.py [--jobs qwen3:4096 mixtral:4096 deepseek:1024]

`gather_blocks` (the hidden states into gemm1's stage blocks) and `activate_blocks` (gemm1's
output into gemm2's) move bytes and do little else, so their floor is those bytes over the
copy bandwidth. Each is timed as `bench_moe.py` times the GEMMs (CUDA events, the L2
flushed, median) at the oracle's tile for the token count, on routing like the
benchmark's. The seventy-ninth session found them at a third of the warp-specialised
GEMMs' time at Qwen3 M = 4096 (four 4-byte stores a thread where one 16-byte store does).
"""

from __future__ import annotations

import argparse

import torch

import numba_kernels  # noqa: F401  (before numba: no simulator on a GPU machine)
from bench_moe import SHAPES, Timer, copy_bandwidth, routing_for
from moe import MoEConfig
from moe.oracle import specialized_tile
from numba_kernels.align import moe_align_block_size
from numba_kernels.stage_blocks import activate_blocks, gather_blocks

HALF_BYTES = 2


def parse_job(job: str) -> tuple[str, int]:
    shape, _, tokens = job.partition(":")
    if shape not in SHAPES or not tokens.isdigit() or int(tokens) < 1:
        raise argparse.ArgumentTypeError(f"a job is shape:tokens with a shape of {list(SHAPES)}, got {job!r}")
    return shape, int(tokens)


def run_job(timer: Timer, bandwidth: float, shape: str, tokens: int) -> None:
    config = MoEConfig(**SHAPES[shape])
    tile = specialized_tile(config, tokens)
    generator = torch.Generator(device="cuda").manual_seed(0)
    _, _, topk_ids = routing_for(config, tokens, generator)
    alignment = moe_align_block_size(topk_ids, tile.block_m, config.num_experts)
    hidden, inter, slots = config.hidden_size, config.intermediate_size, tokens * config.top_k
    picks = torch.empty(alignment[1].shape[0] * tile.sub_blocks, dtype=torch.int32, device="cuda")
    stage = torch.empty(tile.stage_words(picks.numel(), max(hidden, inter)), dtype=torch.int32, device="cuda")
    states = torch.randn(tokens, hidden, generator=generator, device="cuda").to(torch.bfloat16)
    gate_up = torch.randn(alignment[1].shape[0] * tile.block_m, config.gate_up_size, generator=generator,
                          device="cuda").to(torch.bfloat16)
    gather_blocks(states, alignment, slots, config.top_k, tile, picks, stage)  # compiles; writes the picks
    columns = sum((pick + 1) * tile.width_step for pick in picks.tolist() if pick >= 0)  # slots and padding
    moved = {"gather": (slots + columns) * hidden * HALF_BYTES,
             "activate": columns * (config.gate_up_size + inter) * HALF_BYTES}
    ways = {"gather": lambda: gather_blocks(states, alignment, slots, config.top_k, tile, picks, stage),
            "activate": lambda: activate_blocks(gate_up, config.activation, tile, picks, stage)}
    for name, way in ways.items():
        way()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()  # replayed: the GPU's time, not the launch's
        with torch.cuda.graph(graph):
            way()
        ms = timer(graph.replay)
        floor_ms = moved[name] / bandwidth * 1e3
        print(f"{shape:8s} M={tokens:5d} {name:8s} {ms * 1e3:8.1f} us  {moved[name] / 1e6:7.1f} MB  "
              f"floor {floor_ms * 1e3:7.1f} us ({floor_ms / ms:.2f} of it)", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", nargs="+", type=parse_job, default=[("qwen3", 4096), ("mixtral", 4096),
                                                                       ("deepseek", 1024)], help="shape:tokens")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("it times kernels on a CUDA GPU and none is available here")
    timer = Timer()
    bandwidth = copy_bandwidth(timer)
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s")
    for shape, tokens in args.jobs:
        run_job(timer, bandwidth, shape, tokens)


if __name__ == "__main__":
    main()
