"""`python -m moe.tune`: measure tile configurations on this GPU and save the best per
token count to `moe/tuned/sm_<major><minor>/<device>.json`, which the oracle
(`select_backend`) reads, also for other GPUs of the architecture until they are tuned.

For each token count M it routes M random tokens, and for each alignment block size times
every candidate tile of gemm1 and of gemm2 on that alignment, each together with the
reduction that reads its output as the layer runs it (gemm1 -> activation, gemm2 -> combine:
fused into a decode GEMM's last CTAs, gemm1's activation into a prefill GEMM's epilogue,
else a kernel of its own; a K split in S parts makes it sum S partials, which the GEMM alone
does not show). Every time is a CUDA-graph replay, L2 flushed, of the alignment and then
those launches, replayed as the layer replays its own (`launch.replaying`: a kernel that
waits for the one before starts early; the first GEMM waits for the alignment, as in the
layer). The `FINALISTS` fastest tiles of each GEMM (and their twins releasing the next
kernel early or late, where timed) are then timed in pairs, one GEMM after the other as in
the layer, where gemm2 starts beside gemm1's tail: on the H200 a fused gemm1 won alone by 2
to 3 % but lost in the layer's sequence by 2 to 5 % (DeepSeek at M = 4 and 16,
benchmarks/LOG.md). A pair runs the activation kernel between the GEMMs where gemm1 leaves
it, as the layer does and the benchmark's GEMMs column does not: so at Qwen3 w4a16 M = 1 the
tuner sees no gain in gemm1 releasing early, which that column times 0.6 us faster and the
layer 0.2 (within the spread; H200, benchmarks/LOG.md). Where the warp-specialised GEMM can
run (Hopper, the native layout) and the experts get half a decode tile's slots or more
(`oracle.specialized_candidate`), it is timed too, at the tile the token count takes
(`oracle.specialized_tile`), with its gather, activation and combine, as one more pair. The
fastest pair wins, over all block sizes; its entry says whether it is the warp-specialised
GEMM ("specialized"). A time is the mean over `routings` random routings (3 by default):
with a few slots per expert one draw can rank two tiles the other way round from the next
(on the H200 one draw picked a Mixtral M = 16 gemm2 tile that the benchmark's own draw timed
1.36x slower). The candidates are the oracle's own families (`candidate_tiles`): decode
tiles (16-slot blocks, or 8-slot blocks with swapped operands, those also with the reduction
fused into the GEMM or an unchecked steady loop; gemm1's also as gate/up pairs of warps that
finish the activation in their epilogue; operands straight from global memory, K split over
warps and CTAs) and prefill tiles (32 to 128-row blocks staged in shared memory, in either
CTA order, with and without trim_padding, gemm1's with and without the activation in its
epilogue); a tile that the layout or the shared memory cannot take is skipped. Weights are
random bits in the kernel layout: timing does not depend on their values.

    python -m moe.tune --experts 128 --top-k 8 --hidden 2048 --intermediate 768 --tokens 1 16 256 4096
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Callable, Iterable

import attrs
import torch

from numba_kernels import interop
from numba_kernels.activation import activate
from numba_kernels.align import align_sizes, moe_align_block_size
from numba_kernels.combine import combine
from numba_kernels.fragments import SLAB_K
from numba_kernels.gemm import GemmTile, grouped_gemm
from numba_kernels.launch import replaying

from .config import MoEConfig, QuantScheme
from .oracle import (DECODE_TILE, SWAPPED_DECODE_TILE, Backend, activation_finishable, backend_from_dict,
                     backend_to_dict, device_architecture, device_name, heuristic_backend, select_backend, shape_key,
                     shape_prefix, slots_per_expert, specialized_candidate, specialized_tile, tuned_path, tuned_tables,
                     warp_specialised)
from .runner import fused_activation, fused_combine, specialized_gemm1, specialized_gemm2
from .weights import ExpertWeights, kernel_spec
from .workspace import arrivals_elements, gemm_out_elements, gemm_view, specialized_sizes

Measure = Callable[[Callable[[], None], GemmTile | Backend], float]
FINALISTS = 2
"""The fastest tiles of each GEMM (per block size) whose pairs are timed together."""


PREFILL_SHAPES = [  # (block_m, warps_m, warps_n, slabs_per_warp, stages): the best of a wider H200 sweep
    (32, 1, 4, 4, 2), (64, 1, 4, 4, 2), (64, 1, 4, 2, 4), (64, 1, 4, 4, 3), (64, 1, 4, 4, 4), (64, 1, 8, 2, 3),
    (128, 2, 4, 2, 3)]


DECODE_FAMILIES = [  # (up to this many slots per expert, tile): each won some GEMMs on the H200 (benchmarks/LOG.md)
    (64, attrs.evolve(DECODE_TILE, warps_k=2)), (64, DECODE_TILE)] + [
    (8, attrs.evolve(SWAPPED_DECODE_TILE, warps_k=warps_k, slabs_per_warp=slabs, steady_loop=steady))
    for warps_k, slabs, steady in (  # swapped: warps along K, slabs per batch, unchecked steady loop
        (4, 4, False), (2, 4, False), (4, 2, False), (2, 2, False), (4, 1, False), (4, 4, True), (4, 2, True))]


def heuristic_tiles(num_tokens: int, config: MoEConfig, k: int) -> list[GemmTile]:
    """The untuned choice for the GEMM of reduction length `k`: a candidate of every
    tuning, so that an entry is never one the heuristic beats (on the H200 the heuristic's
    Mixtral M = 256 pair, gemm2 with a K split, took 7 % less time than the entry the
    families gave)."""
    return list(dict.fromkeys(tiles_of_length(heuristic_backend(config, num_tokens, kernel_spec(config)), config, k)))


def tiles_of_length(backend: Backend, config: MoEConfig, k: int) -> list[GemmTile]:
    """The tiles of `backend`'s GEMMs whose reduction length is `k` (both where H = I)."""
    return [tile for tile, tile_k in ((backend.gemm1, config.hidden_size), (backend.gemm2, config.intermediate_size))
            if tile_k == k]


def candidate_tiles(num_tokens: int, config: MoEConfig, k: int) -> list[GemmTile]:
    """Tiles worth timing for `num_tokens` tokens and reduction length `k` (some may not
    fit a layout or shared memory: `tune` skips those): the heuristic's, those the tables
    hold for the shape's other formats (`other_format_tiles`) and the families'."""
    per_expert = slots_per_expert(config, num_tokens)
    slabs = -(-k // SLAB_K)
    tiles = heuristic_tiles(num_tokens, config, k) + other_format_tiles(num_tokens, config, k)
    for up_to, decode in DECODE_FAMILIES:
        if per_expert <= up_to:
            for split_k in (1, 2, 4, 8):
                if split_k == 1 or slabs // split_k >= decode.stage_slabs:
                    tiles.append(attrs.evolve(decode, split_k=split_k))
                    if decode.swap_ab:  # one wave of CTAs: finishing the reduction in the GEMM may pay
                        tiles.append(attrs.evolve(decode, split_k=split_k, fused_reduction=True))
            tiles += paired_decode(config, k, decode)
    if per_expert > 4:
        for block_m, warps_m, warps_n, depth, stages in PREFILL_SHAPES:
            for chunks_first in (False, True):  # which operand the L2 keeps for the CTAs running together
                tile = GemmTile(block_m=block_m, warps_m=warps_m, warps_n=warps_n, warps_k=1, slabs_per_warp=depth,
                                stages=stages, a_in_shared=True, chunks_first=chunks_first)
                variants = [tile, attrs.evolve(tile, trim_padding=True)] if tile.trimmable else [tile]
                if k == config.hidden_size and activation_finishable(config, tile):
                    variants += [attrs.evolve(variant, fused_reduction=True) for variant in variants]  # gemm1's activation
                tiles += variants
    return list(dict.fromkeys(tiles))  # the families' paired variants overlap: each tile timed once


def paired_decode(config: MoEConfig, k: int, tile: GemmTile) -> list[GemmTile]:
    """gemm1's decode `tile` as gate/up pairs of warps finishing the activation in its
    epilogue (`gemm.paired_activation`): no K split, twice the warps along N, and as
    many warps a CTA with half the warps along K; none where it cannot pair."""
    if k != config.hidden_size or tile.a_in_shared:
        return []
    pairs = [attrs.evolve(tile, warps_n=2, split_k=1, fused_reduction=True, warps_k=warps_k)
             for warps_k in sorted({tile.warps_k, max(tile.warps_k // 2, 1)})]
    return [pair for pair in pairs if activation_finishable(config, pair)]


def refine_candidates(num_tokens: int, config: MoEConfig, k: int) -> list[GemmTile]:
    """Candidates for `--refine`: the tile the oracle now picks (tuned or heuristic) for the
    GEMM of reduction length `k` and, if it is a decode tile, that tile with each boolean
    option flipped (steady_loop; fused_reduction when swapped) and with half and twice the
    warps along K (registers and waves change with it), gemm1's also as pairs of warps
    (`paired_decode`), any tile in the other CTA order (chunks_first), with half, twice
    and four times its K split (`split_variants`) and with half and twice its slabs per
    warp (a decode batch, a prefill stage), and a prefill tile with trim_padding flipped
    (gemm1's also with fused_reduction flipped, where it can finish the activation) and
    with a stage more and one fewer, and any tile releasing the next kernel early or late
    (release_early): minutes instead of a full tuning's tens of minutes,
    to re-check saved entries after a kernel or an option changes (or on another GPU).
    Then the tiles the tables hold at this count for the shape's other formats
    (`other_format_tiles`); the heuristic's tile comes last (`heuristic_tiles`)."""
    backend = select_backend(config, num_tokens, kernel_spec(config), specialized=False)
    tiles = []
    for tile, tile_k, first in ((backend.gemm1, config.hidden_size, True), (backend.gemm2, config.intermediate_size, False)):
        if tile_k == k:
            tiles += [tile, attrs.evolve(tile, chunks_first=not tile.chunks_first)]
            if not tile.a_in_shared:
                tiles.append(attrs.evolve(tile, steady_loop=not tile.steady_loop))
                tiles += [attrs.evolve(tile, warps_k=warps_k) for warps_k in (tile.warps_k // 2, tile.warps_k * 2)
                          if 1 <= warps_k <= 8]
            if tile.swap_ab or (first and tile.a_in_shared and activation_finishable(config, tile)):
                tiles.append(attrs.evolve(tile, fused_reduction=not tile.fused_reduction))
            if first and not tile.pairs_warps:
                tiles += paired_decode(config, k, tile)
            if tile.trimmable:
                tiles.append(attrs.evolve(tile, trim_padding=not tile.trim_padding))
            tiles += split_variants(tile, tile_k)
            if tile.a_in_shared:  # the pipeline: a stage more or fewer
                tiles += [attrs.evolve(tile, stages=stages) for stages in (tile.stages - 1, tile.stages + 1)
                          if stages >= 2]
            tiles += [attrs.evolve(tile, slabs_per_warp=depth)  # loads in flight: half or twice the slabs a batch
                      for depth in (tile.slabs_per_warp // 2, tile.slabs_per_warp * 2) if depth >= 1]
            tiles.append(attrs.evolve(tile, release_early=not tile.release_early))  # the next kernel's start
    others = other_format_tiles(num_tokens, config, k) + heuristic_tiles(num_tokens, config, k)
    return list(dict.fromkeys(tiles + others))


def other_format_tiles(num_tokens: int, config: MoEConfig, k: int) -> list[GemmTile]:
    """The GEMM tiles of reduction length `k` that the tables of this architecture hold at
    `num_tokens` for the same shape (experts, top_k, H, I) in other formats: another block
    size, which the refine's variants of one entry never reach. On the H200 the w4a16
    entry's 32-slot tiles beat NVFP4's own 64-slot entry by 3.7 % at Mixtral M = 256
    (fifty-fifth session)."""
    own, shape = shape_key(config, kernel_spec(config)), shape_prefix(config)
    return [tile for table in tuned_tables(device_architecture()).values() for key, entries in table.items()
            if key.startswith(shape) and key != own and str(num_tokens) in entries
            for tile in tiles_of_length(backend_from_dict(entries[str(num_tokens)]), config, k)]


def split_variants(tile: GemmTile, k: int) -> list[GemmTile]:
    """`tile` with half, twice and four times its K split, where each split keeps a stage
    of slabs (decode) or two (prefill, as `oracle.split_to_fill`); none for a tile of
    paired warps finishing the activation (no partials). A split fills the card where few
    token blocks meet few output chunks over a long K: Mixtral's gemm2 at M = 256 (K =
    14336, some 320 CTAs of 4 warps) is split in four in the H100's refined entry."""
    if tile.fused_reduction and tile.pairs_warps:
        return []
    slabs, stages = -(-k // SLAB_K), 2 if tile.a_in_shared else 1
    return [attrs.evolve(tile, split_k=split) for split in (tile.split_k // 2, tile.split_k * 2, tile.split_k * 4)
            if split >= 1 and slabs // (stages * split) >= tile.stage_slabs]


class ProgressBar:
    """A one-line text progress bar on stderr (no dependency)."""

    def __init__(self, total: int, label: str, stream=sys.stderr, width: int = 30):
        self.total, self.label, self.stream, self.width, self.done = max(total, 1), label, stream, width, 0

    def step(self, note: str = "") -> None:
        self.done += 1
        filled = self.width * self.done // self.total
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
                          f"{self.done}/{self.total} {note:40.40s}")
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


def cuda_graph_measure(repeats: int = 20) -> Measure:
    """Median CUDA-event time (ms) of `fn` replayed from a CUDA graph, the L2 flushed each
    time by reading a buffer far larger than it (zeroing one would leave dirty lines that
    the timed kernels write back: `benchmarks/bench_moe.py --flush`)."""
    flush = torch.zeros(256 << 17, dtype=torch.int64, device="cuda")

    def measure(fn, tile):
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        times = []
        for _ in range(repeats):
            flush.sum()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    return measure


def tune(config: MoEConfig, token_counts: Iterable[int], *, measure: Measure | None = None,
         candidates: Callable[[int, MoEConfig, int], list[GemmTile]] = candidate_tiles, seed: int = 0,
         progress: bool = True, report: Callable[[int, str, GemmTile | Backend, float | None], None] | None = None,
         routings: int = 3, finished: Callable[[int, Backend], None] | None = None) -> dict[int, Backend]:
    """The fastest backend per token count (see the module docstring); `report` sees every
    measurement (token count, "gemm1" or "gemm2", tile, ms or None when skipped; "pair",
    backend, ms for the finalists timed together), `finished` each token count's backend
    as soon as it is chosen."""
    if isinstance(routings, bool) or not isinstance(routings, int) or routings < 1:
        raise ValueError(f"routings must be an integer of at least 1, got {routings!r}")
    token_counts = list(token_counts)
    if not token_counts or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in token_counts):
        raise ValueError(f"token_counts must be one or more positive integers, got {token_counts!r}")
    if measure is None and (interop.SIMULATED or not torch.cuda.is_available()):
        raise RuntimeError("moe.tune times kernels on a CUDA GPU (CUDA graphs, events) and none is available "
                           "here; pass measure= to time them another way")
    measure = measure or cuda_graph_measure()
    weights = ExpertWeights(config)
    weights.fill_random(seed)
    h, i, n1 = config.hidden_size, config.intermediate_size, config.gate_up_size
    half = getattr(torch, config.dtype)
    device = interop.kernel_device()
    generator = torch.Generator(device=device).manual_seed(seed)
    best = {}
    for tokens in token_counts:
        slots = tokens * config.top_k
        tiles1, tiles2 = candidates(tokens, config, h), candidates(tokens, config, i)
        bar = ProgressBar(len(tiles1) + len(tiles2), f"M={tokens:<5d}") if progress else None
        hidden = torch.randn(tokens, h, generator=generator, device=device).to(half)
        draws = [torch.stack([torch.randperm(config.num_local_experts, generator=generator, device=device)[:config.top_k]
                              for _ in range(tokens)]).to(torch.int32) for _ in range(routings)]
        intermediate = torch.randn(slots, i, generator=generator, device=device).to(half)
        topk_weights = torch.rand(tokens, config.top_k, generator=generator, device=device)
        reduced = {"gemm1": torch.empty(slots, i, dtype=half, device=device),
                   "gemm2": torch.empty(tokens, h, dtype=half, device=device)}
        # Counters for any candidate: the most blocks (8 slots) and columns (one warp's) a tile has.
        widest = attrs.evolve(SWAPPED_DECODE_TILE, fused_reduction=True)
        blocks = align_sizes(slots, config.num_experts, widest.block_m)[1]
        arrivals = torch.zeros(arrivals_elements(config, Backend(widest.block_m, widest, widest), blocks, tokens),
                               dtype=torch.int32, device=device)

        @functools.cache
        def alignments(block_m: int) -> list:  # each draw aligned once per block size
            return [moe_align_block_size(ids, block_m, config.num_experts, check_ids=False) for ids in draws]

        def runner(stage: str, tile: GemmTile, alignment_ready: bool = False):
            """run(alignment): the GEMM of `stage` with `tile`, then the reduction reading its
            output; `alignment_ready`: a GEMM runs before it (gemm2 in a pair, as in the layer)."""
            act, stored, n = (hidden, weights.w13, n1) if stage == "gemm1" else (intermediate, weights.w2, h)
            out = gemm_view(torch.empty(gemm_out_elements(tile, slots, n), dtype=torch.float32, device=device),
                            tile, slots, n, half)
            then = (fused_activation(config, tile, reduced[stage], arrivals) if stage == "gemm1"
                    else fused_combine(config, tile, topk_weights, reduced[stage], arrivals))

            def run(alignment):
                grouped_gemm(act, stored, *alignment, num_slots=slots, tile=tile, out=out, then=then,
                             alignment_ready=alignment_ready, check_ids=False)
                if then is None and stage == "gemm1":
                    activate(out, config.activation, out=reduced[stage])
                elif then is None:
                    combine(out, topk_weights, out=reduced[stage])

            return run

        def specialized_runner(tile):
            """run(alignment): both GEMMs warp-specialised with `tile`, its gather and
            activation, then the combine, as the layer runs them."""
            rows1, rows2, words, parts = specialized_sizes(config, tile, slots)
            picks = torch.empty(parts, dtype=torch.int32, device=device)
            stage_blocks = torch.empty(words, dtype=torch.int32, device=device)
            gemm1_out = torch.empty(rows1, n1, dtype=half, device=device)
            gemm2_out = torch.empty(rows2, h, dtype=half, device=device)

            def run(alignment):
                specialized_gemm1(config, weights, hidden, alignment, slots, tile, picks, stage_blocks, gemm1_out)
                specialized_gemm2(weights, alignment, tile, picks, stage_blocks, gemm2_out)
                combine(gemm2_out[:-1], topk_weights, out=reduced["gemm2"])

            return run

        def timed(runs: list, subject: GemmTile | Backend) -> float:
            """Mean over the routings of `runs` one after another, replayed as the layer does:
            behind the alignment that they wait for, so that gemm1 too starts early (its
            CTAs are in place when it lets the next kernel's CTAs start, `release_early`)."""
            def replayed(ids, alignment):
                moe_align_block_size(ids, subject.block_m, config.num_experts, check_ids=False, out=alignment)
                for run in runs:
                    run(alignment)

            return statistics.fmean(measure(replaying(functools.partial(replayed, ids, alignment)), subject)
                                    for ids, alignment in zip(draws, alignments(subject.block_m)))

        timings: dict[int, dict[str, list[tuple[float, GemmTile]]]] = {}
        for stage, tiles in (("gemm1", tiles1), ("gemm2", tiles2)):
            for tile in tiles:
                try:
                    ms = timed([runner(stage, tile)], tile)
                except ValueError as error:  # a tile this layout or shared memory cannot take
                    if report:
                        report(tokens, stage, tile, None)
                    if bar:
                        bar.step(f"{stage} skipped: {error}")
                    continue
                if report:
                    report(tokens, stage, tile, ms)
                timings.setdefault(tile.block_m, {}).setdefault(stage, []).append((ms, tile))
                if bar:
                    bar.step(f"{stage} {ms:.4f} ms")
        complete = {m: t for m, t in timings.items() if len(t) == 2}
        if not complete:
            raise ValueError(f"no block size has candidate tiles for both GEMMs at M={tokens}")
        pairs = {}  # the finalists of each block size, timed together as the layer runs them
        for block_m, stages in complete.items():
            finalists = [with_release_twins([tile for _, tile in sorted(stages[stage], key=lambda timing: timing[0])],
                                            FINALISTS) for stage in ("gemm1", "gemm2")]
            for tile1, tile2 in itertools.product(*finalists):
                backend = Backend(block_m, tile1, tile2)
                pairs[backend] = timed([runner("gemm1", tile1), runner("gemm2", tile2, alignment_ready=True)], backend)
                if report:
                    report(tokens, "pair", backend, pairs[backend])
        if specialized_candidate(config, tokens, weights.spec):
            backend = warp_specialised(specialized_tile(config, tokens))
            pairs[backend] = timed([specialized_runner(backend.specialized)], backend)
            if report:
                report(tokens, "pair", backend, pairs[backend])
        best[tokens] = min(pairs, key=pairs.get)
        if finished:
            finished(tokens, best[tokens])
    return best


def with_release_twins(ranked: list[GemmTile], count: int) -> list[GemmTile]:
    """The `count` first of `ranked` (tiles fastest first), each followed by its twin with
    release_early flipped where that was timed too: what releasing the next kernel early
    does shows beside that kernel, which for a gemm1 finishing its own reduction is
    gemm2, timed with it only in a pair."""
    finalists = []
    for tile in ranked[:count]:
        twin = attrs.evolve(tile, release_early=not tile.release_early)
        finalists += [tile] + ([twin] if twin in ranked else [])
    return list(dict.fromkeys(finalists))


def save(config: MoEConfig, backends: dict[int, Backend], device: str | None = None) -> str:
    """Merge `backends` into this device's tuned table (or `device`'s, of this device's
    architecture); returns the file written."""
    path = tuned_path(device_architecture(), device or device_name())
    write_entries(path, shape_key(config, kernel_spec(config)), {m: backend_to_dict(b) for m, b in backends.items()})
    return str(path)


def write_entries(path: Path, key: str, entries: dict[int, dict]) -> None:
    """Merge `entries` ({num_tokens: backend dict}) into the table at `path` under the shape
    `key`, in the one form every table is written in (a refined entry taken by hand too:
    `benchmarks/take_entries.py`)."""
    table = json.loads(path.read_text()) if path.exists() else {}
    table.setdefault(key, {}).update({str(m): entry for m, entry in entries.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    tuned_tables.cache_clear()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moe.tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, required=True)
    parser.add_argument("--top-k", type=int, required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--intermediate", type=int, required=True)
    parser.add_argument("--format", default="native", choices=["native", "nvfp4"])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--zero-points", action="store_true",
                        help="int4 with a zero point a group (AWQ, asymmetric compressed-tensors) instead of symmetric")
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 64, 256, 1024, 4096])
    parser.add_argument("--routings", type=int, default=3, help="random routings each candidate is timed on")
    parser.add_argument("--verbose", action="store_true", help="print every measurement")
    parser.add_argument("--refine", action="store_true",
                        help="time only the current choice and its decode tiles with each option flipped")
    args = parser.parse_args(argv)
    if min(args.tokens) < 1 or args.routings < 1:
        parser.error("--tokens and --routings must be positive")
    if args.format == "nvfp4" and args.zero_points:
        parser.error("--zero-points applies to --format native (NVFP4 has no zero points)")
    try:
        quant = QuantScheme("nvfp4") if args.format == "nvfp4" else QuantScheme(
            "native", bits=4, group_size=args.group_size, symmetric=not args.zero_points)
        config = MoEConfig(num_experts=args.experts, top_k=args.top_k, hidden_size=args.hidden,
                           intermediate_size=args.intermediate, quant=quant)
    except ValueError as error:  # the shape's own checks, as a usage error rather than a traceback
        parser.error(str(error))
    if interop.SIMULATED or not torch.cuda.is_available():
        parser.error("moe.tune times kernels on a CUDA GPU, and none is available here")

    def report(tokens, stage, tile, ms):
        if args.verbose:
            print(f"M={tokens} {stage} {'skipped' if ms is None else f'{ms:.4f} ms'} {tile}", flush=True)

    def finished(tokens, backend):  # saved one count at a time: an interrupted run keeps what it measured
        print(f"M={tokens}: {backend}\nsaved to {save(config, {tokens: backend})}", flush=True)

    tune(config, args.tokens, report=report, routings=args.routings, finished=finished,
         candidates=refine_candidates if args.refine else candidate_tiles)


if __name__ == "__main__":
    main()
