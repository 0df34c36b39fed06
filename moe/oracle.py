"""Backend selection as an oracle: one function picks the kernel variant and tiles for a
call shape (the GEMM wrappers compile what it names, once per configuration). Nothing else
in the runner makes these choices.

`select_backend(config, num_tokens, spec)` looks the shape up in the tuned configurations
of this device (`moe/tuned/sm_<major><minor>/<device>.json`, written by `python -m
moe.tune`), topped up by those another GPU of the same architecture measured (`tuned_entries`:
an H100 takes the H200's tiles for the token counts it has not tuned itself, rather than
the untuned heuristic; int4 with zero points, where it has no entry of its own, the
symmetric layout's: `shape_keys`), and falls back to a heuristic. Where no entry was
tuned with the warp-specialised GEMM among its candidates (every table from before it),
the oracle may take that GEMM first (`specialized_backend`: Hopper, from 16 or 32 slots
an expert up). The heuristic:

* decode (few tokens per expert): operands straight from global memory, 4 warps splitting
  K, batches of 2 slabs each (double buffered; 4 with swapped operands), and a K split
  across CTAs large enough that the grid fills every multiprocessor twice. Up to 4 slots
  per expert the operands are swapped (`GemmTile.swap_ab`: 16 weight rows x 8 slots per
  mma, blocks of 8 slots), beyond that 16-slot blocks. On the H200 (2026-11-23,
  `benchmarks/sweep_tiles.py`) the swap was 0.98x to 1.24x the speed of 16-slot blocks at
  M = 1 to 16 on the three benchmark shapes, and shared-memory pipelines of 16-slot
  blocks were up to 2.7x slower. Batches of 2 slabs beat 4 while dequantisation cost
  more instructions (2026-11-23); since swapped tiles defer scales (2026-11-24), 4-slab
  batches are faster at 22 of 24 sweep points (Mixtral w4a16 M = 1 gemm1 53.5 -> 47.5 us,
  M = 4 118 -> 101 us; DeepSeek M = 1 gemm1 49 -> 43 us): more loads in flight;
* prefill: blocks of 64 slots (32 up to 64 slots per expert), both operands staged in
  shared memory by a `cp.async` pipeline, warps of 64 rows x 64 features (every decoded
  weight fragment feeds four mma), four warps along N, 64 input features per stage in
  three buffers, a K split only where the grid would not fill the card (`split_to_fill`).
  Since the main loop keeps two slabs' operands in registers (2026-11-24), 64-
  feature stages in two buffers beat 32-feature stages in four on the H200 at M = 1024
  and 4096 for w4a16 (Mixtral 8.64 against 9.14 ms for the two GEMMs at M = 4096): a
  barrier and a round of copies per 64 features instead of per 32, and 16-byte activation
  copies free of bank conflicts (36-word rows). Since the stage buffers are dynamic shared
  memory (2026-11-25), three buffers beat two for both GEMMs and both formats at Qwen3
  M = 4096 (gemm2, ms: w4a16 0.455 -> 0.439, NVFP4 0.453 -> 0.410). Weights whose layout cannot be staged
  (`gemm.prefill_supported`, `runs_on`: scales not lane-contiguous, act-order read through
  its index maps) take decode tiles; the MoE layer reads act-order weights as plain tiles
  (`numba_kernels.permute`), so they take prefill tiles too.

A tile's `fused_reduction` (a decode GEMM finishes the activation or the combine in its
last CTAs, `numba_kernels.epilogue`; a gemm1 of paired warps, prefill or decode with
warps_n >= 2 and no K split, the activation in its epilogue, `gemm.paired_activation`)
and `steady_loop` (whole batches without per-slab range checks: on the H200, 2026-11-24,
NVFP4 gemm1 3 % to 8 % faster, deferred 4-bit codes slower at 168 registers; 16-slot
tiles at 8 to 16 slots per expert 9 % to 24 % faster) are set only by the tuner.
Measured on the H200 (2026-11-23, fused on every decode tile): the layer 0.9 to 3 us
faster at M = 1 on Qwen3 and Mixtral, but 3 to 85 us slower at M = 4 to 16 and on
DeepSeek, where grids of several waves pay each CTA's longer tail (fence, counter,
reduction) once per wave; so the heuristic never fuses.

The batched layout (tokens laid out expert by expert, as expert parallelism ships them;
`moe.batched`) uses the same tiles, chosen from the expected tokens per expert.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import attrs
import torch

from layouts import QuantSpec
from numba_kernels import interop
from numba_kernels.fragments import SLAB_K
from numba_kernels.epilogue import activation_fusable, activation_kind, combine_kind
from numba_kernels.gemm import GemmTile, paired_activation, prefill_supported
from numba_kernels.gemm_specialized import SpecializedTile, specialized_supported
from numba_kernels.route_align import max_lanes

from .config import MoEConfig
from .weights import permutes_inputs

TUNED_DIR = Path(__file__).parent / "tuned"
"""Tuned tables, a directory per architecture: `sm_90/NVIDIA_H200.json`."""
USE_TUNED = os.environ.get("NUMBA_MOE_TUNED", "1") != "0"
"""NUMBA_MOE_TUNED=0: the heuristic only (what the tuned tables buy, or a suspect entry ruled out)."""
DECODE_TOKENS_PER_EXPERT = 16
SWAP_TOKENS_PER_EXPERT = 4
FUSED_ROUTING_TOKENS = 16
"""Up to this many tokens, and no more than one block routes side by side
(`route_align.max_lanes`), routing and alignment run as one launch (`route_align`). In one
pass the block beats the two launches; with two passes one SM routes what 16 blocks route
in parallel, and loses (H200, each kernel replayed alone: Qwen3 M = 16, two passes of 8
lanes, 14.4 us against 5.0 + 6.9 us; Mixtral M = 16, one pass, 6.6 against 4.4 + 6.5)."""


@attrs.frozen
class Backend:
    """The oracle's choice for one call shape: the alignment block size and the tiles of
    the two grouped GEMMs (gemm1: hidden -> gate/up, gemm2: intermediate -> hidden).
    `specialized`: both GEMMs run warp-specialised instead (`numba_kernels.gemm_specialized`);
    gemm1 and gemm2 then name prefill tiles of its block size, which no call runs (a call
    whose hooks see the GEMMs' rows takes `select_backend(..., specialized=False)`'s)."""

    block_m: int
    gemm1: GemmTile
    gemm2: GemmTile
    specialized: SpecializedTile | None = None

    def __attrs_post_init__(self):
        if self.gemm1.block_m != self.block_m or self.gemm2.block_m != self.block_m:
            raise ValueError("both GEMM tiles must use the alignment block size")
        if self.specialized is not None and self.specialized.block_m != self.block_m:
            raise ValueError("the warp-specialised tile must use the alignment block size")

    def split_k(self) -> int:
        return max(self.gemm1.split_k, self.gemm2.split_k)


def multiprocessors() -> int:
    """Streaming multiprocessors of the current device (an H100/H200's 132 when simulated)."""
    if not torch.cuda.is_available() or interop.kernel_device().type != "cuda":
        return 132
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def device_name() -> str:
    if interop.kernel_device().type != "cuda":
        return "simulator"
    return torch.cuda.get_device_name().replace(" ", "_")


def device_architecture() -> str:
    """The directory of this device's tuned tables: `sm_90` for compute capability 9.0."""
    if interop.kernel_device().type != "cuda":
        return "simulator"
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def expected_blocks(config: MoEConfig, num_tokens: int, block_m: int) -> int:
    """Token blocks a call is likely to have: one per touched expert, more when experts
    receive more than block_m slots."""
    slots = num_tokens * config.top_k
    touched = min(slots, config.num_local_experts)
    return max(touched, -(-slots // block_m))


DECODE_TILE = GemmTile(block_m=16, warps_m=1, warps_n=1, warps_k=4, slabs_per_warp=2)
SWAPPED_DECODE_TILE = GemmTile(block_m=8, warps_m=1, warps_n=1, warps_k=4, slabs_per_warp=4, swap_ab=True)


def split_to_fill(tile: GemmTile, config: MoEConfig, num_tokens: int, n: int, k: int) -> GemmTile:
    """`tile` with the K split that gives the grid at least two CTAs per multiprocessor
    (each split keeping two stages of slabs or more)."""
    ctas = expected_blocks(config, num_tokens, tile.block_m) * -(-n // tile.block_n)
    slabs = -(-k // SLAB_K)
    split_k, enough = 1, 2 * multiprocessors()
    while ctas * split_k < enough and slabs // (2 * split_k) >= tile.stage_slabs:
        split_k *= 2
    return _with_split_k(tile, split_k)


@functools.cache
def _with_split_k(tile: GemmTile, split_k: int) -> GemmTile:
    """`tile` split `split_k` ways along K, made once: a tile's checks cost more than the
    rest of the oracle's choice, which forwards with hooks make every call."""
    return attrs.evolve(tile, split_k=split_k)


def _filled_backend(tile: GemmTile, config: MoEConfig, num_tokens: int) -> Backend:
    """`tile` for both GEMMs, each with its own `split_to_fill`."""
    h, i, n1 = config.hidden_size, config.intermediate_size, config.gate_up_size
    return Backend(tile.block_m, split_to_fill(tile, config, num_tokens, n1, h),
                   split_to_fill(tile, config, num_tokens, h, i))


def slots_per_expert(config: MoEConfig, num_tokens: int) -> float:
    """The slots an expert gets on average from `num_tokens` tokens: the oracle's regimes.
    Over all experts, this rank's or another's: with an expert map the layer still routes
    every token, and a local expert gets its share of them, not the rank's."""
    return num_tokens * config.top_k / config.num_experts


def _decode_backend(config: MoEConfig, num_tokens: int) -> Backend:
    per_expert = slots_per_expert(config, num_tokens)
    tile = SWAPPED_DECODE_TILE if per_expert <= SWAP_TOKENS_PER_EXPERT else DECODE_TILE
    return _filled_backend(tile, config, num_tokens)


PREFILL_TILE = GemmTile(block_m=64, warps_m=1, warps_n=4, warps_k=1, slabs_per_warp=4, stages=3, a_in_shared=True)
PREFILL_BLOCK_32_TOKENS_PER_EXPERT = 64


def _prefill_backend(config: MoEConfig, num_tokens: int) -> Backend:
    """Blocks of 64 slots, one warp along the rows (four 16-row m tiles: every decoded
    weight fragment feeds four mma), four 64-feature warps along N, 64 input features per
    stage, 3 stages; blocks of 32 slots up to 64 slots per expert (less padding where
    experts get a block and a bit), and a K split where the grid would not fill the card.
    Sweep on the H200 (2026-11-24, `benchmarks/sweep_tiles.py`, w4a16): 64-row blocks
    best for both GEMMs at Mixtral M = 1024, 4096 and Qwen3 M = 4096; at 64 slots per
    expert and fewer 32-row blocks 1.2x (Qwen3 M = 1024) to 2x (M = 256) faster; 128-row
    blocks 1.05 to 2x slower everywhere."""
    per_expert = slots_per_expert(config, num_tokens)
    tile = PREFILL_TILE if per_expert > PREFILL_BLOCK_32_TOKENS_PER_EXPERT else attrs.evolve(PREFILL_TILE, block_m=32)
    return _filled_backend(tile, config, num_tokens)


SPECIALIZED_TOKENS_PER_EXPERT = 32
"""Expected slots an expert from which both GEMMs run warp-specialised (on Hopper): from
tens of slots, where the prefill tiles are latency-bound, up, for experts of any size
(large ones from 16: LARGE_EXPERT_WEIGHTS).
Measured on the H200 (the layer's GEMMs against its tiles, us): Mixtral M = 128 (32 an
expert) 350 against 632 (seventy-fourth session of benchmarks/LOG.md); M = 256 (64) 448
against 701 to 733; M = 1024 (256) 1704 against 2106 (80 wide, two parts a block); M =
4096 (1024) 6177 against 8152 (128 wide, seventy-fifth session). Qwen3-30B-A3B, the
smallest experts timed (4.7 M weights; seventy-ninth session, w4a16): 32 slots an expert
223 against 277, 64 296 against 332, 128 532 against 570, and 256 782 against 937 since
the stage blocks are written in 16-byte stores (before, 980: the tiles won there)."""
LARGE_EXPERT_WEIGHTS = 8 * 2**20
"""Experts of at least this many weights (both GEMMs') take the warp-specialised GEMM
from LARGE_EXPERT_TOKENS_PER_EXPERT slots an expert, within the decode regime: there it
streams their weights faster than the decode tiles. On the H200 (eightieth session, the
layer's GEMMs against its tiles, us, w4a16 / NVFP4): Mixtral (176 M weights) at 16 slots
an expert 312 / 323 against 385 / 359, at 12 300 against 320; DeepSeek (44 M) at 16 2381
against 3069. At 8 slots the tiles won on blocks of 128 (Mixtral 297 against 257,
DeepSeek 2220 against 2103; on NARROW_SPECIALIZED_TILE the tuner picks per entry, from
SPECIALIZED_CANDIDATE_TOKENS_PER_EXPERT), and at 16 slots Qwen3's experts (4.7 M) gained
nothing (173 / 185 against 173 / 173); on NARROW_SPECIALIZED_TILE (eighty-second session)
w4a16 gains there (148 against 172) and NVFP4 loses (180 against 172), so the H200's
tuned entry takes it for w4a16 alone."""
LARGE_EXPERT_TOKENS_PER_EXPERT = 12
"""Expected slots an expert from which experts of LARGE_EXPERT_WEIGHTS take the
warp-specialised GEMM untuned, on NARROW_SPECIALIZED_TILE. On the H200 (eighty-fourth
session of benchmarks/LOG.md, `specialized_ab.py --from-slots`, one process, GEMMs us,
medians of three or six rounds, w4a16 / NVFP4): Mixtral at 8 slots 274 / 308 against the
tiles' 258 / 284, at 10 274 / 311 against 327 / 349, at 12 274 / 310 against 319 / 345;
DeepSeek at 12 2163 / 2454 against the untuned tiles' 3258 / its entry's tiles' 2429 (a
tie within the rounds' spread, 2228 to 2470)."""
USE_SPECIALIZED = os.environ.get("NUMBA_MOE_SPECIALIZED", "1") != "0"
"""NUMBA_MOE_SPECIALIZED=0: never the warp-specialised GEMM (what it buys, side by side)."""
NARROW_SPECIALIZED_TILE = SpecializedTile(block_m=64, max_width=64)
"""The warp-specialised GEMM up to NARROW_TOKENS_PER_EXPERT slots an expert: blocks of 64
slots, one part each, so that an expert's block is not padded to 128 slots whose second
part's CTAs (half the grid) find nothing to do (module constants, so that
`benchmarks/specialized_ab.py` can time others)."""
NARROW_TOKENS_PER_EXPERT = 32
"""Expected slots an expert up to which the warp-specialised GEMM takes
NARROW_SPECIALIZED_TILE: at 32 the fullest expert stays within one block of 64 (random
routings: Mixtral M = 128 the fullest of 8 about 40, DeepSeek M = 1024 of 256 about 48).
On the H200 (eighty-first and eighty-second sessions of benchmarks/LOG.md, the layer's
GEMMs against SPECIALIZED_TILE, us, outputs bit-identical): Mixtral w4a16 at 16 an expert
289 against 312, at 32 325 against 340; Mixtral NVFP4 at 16 322 against 323; DeepSeek
w4a16 at 16 2054 / 2221 against 2449 / 2423 (two rounds), at 32 (both formats) within the
rounds' spread; Qwen3 at 32 174 against 196 (w4a16), 207 against 209 (NVFP4)."""
SPECIALIZED_TILE = SpecializedTile()
"""Beyond, up to 80 slots an expert: an expert's slots one part of a block of 128, a
launch bound of two CTAs an SM."""
WIDE_SPECIALIZED_TILE = SpecializedTile(max_width=128)
"""Beyond, up to 128 slots an expert: parts of 128 slots under a launch bound of one CTA an
SM (for the registers, `SpecializedTile.min_ctas_per_sm`), so an expert's weights are
decoded once for every 128 slots rather than every 64 (SPECIALIZED_TILE's blocks of 128 are
two parts). Mixtral M = 4096 on the H200 (seventy-fifth session): 6177 us against 7055
with SPECIALIZED_TILE."""
WIDEST_SPECIALIZED_TILE = SpecializedTile(block_m=256, max_width=256, width_step=32)
"""From 128 slots an expert: parts of 256 (wgmma's widest N), so an expert of 128 slots and
a few more is one part, not a full one and a second that decodes all its weights again
for a few slots, and larger experts decode theirs half as often. On the H200 (seventy-
seventh session, against WIDE_SPECIALIZED_TILE, outputs bit-identical): DeepSeek w4a16 M =
4096 (128 an expert) 6521 against 7461 us, Mixtral w4a16 M = 4096 (1024) 5162 against
6102 (widths in steps of 64 there); NVFP4 (seventy-eighth) DeepSeek 6476 against 7844,
Mixtral 5002 against 6307. Zero points too, though they spill 892 bytes at 256 wide:
DeepSeek 6881 against 7964, Mixtral 5206 against 6445 (seventy-eighth)."""
SPECIALIZED_TILE_NAMES = ("NARROW_SPECIALIZED_TILE", "SPECIALIZED_TILE", "WIDE_SPECIALIZED_TILE",
                          "WIDEST_SPECIALIZED_TILE")
"""The warp-specialised GEMM's tiles above, narrowest first, by name: the module constants
that `specialized_tile` reads, for the tools that list them and the benchmark that replaces
them (`benchmarks/specialized_ab.py`)."""


def specialized_tile(config: MoEConfig, num_tokens: int) -> SpecializedTile:
    """The warp-specialised GEMM's tile at `num_tokens` tokens: NARROW_SPECIALIZED_TILE up
    to NARROW_TOKENS_PER_EXPERT expected slots an expert, SPECIALIZED_TILE while they fit
    one of its parts, WIDE_SPECIALIZED_TILE while they stay under 128, else
    WIDEST_SPECIALIZED_TILE."""
    per_expert = slots_per_expert(config, num_tokens)
    if per_expert <= NARROW_TOKENS_PER_EXPERT:
        return NARROW_SPECIALIZED_TILE
    if per_expert <= SPECIALIZED_TILE.max_width:
        return SPECIALIZED_TILE
    return WIDE_SPECIALIZED_TILE if per_expert < WIDE_SPECIALIZED_TILE.max_width else WIDEST_SPECIALIZED_TILE


def specialized_slots(config: MoEConfig, max_tokens: int, tile: SpecializedTile) -> int:
    """The most slots of a call of up to `max_tokens` tokens that the oracle runs on
    `tile` (what the workspace sizes its buffers for): a narrower tile only up to its
    max_width an expert (`specialized_tile`), the widest at any count."""
    slots = max_tokens * config.top_k
    return slots if tile == WIDEST_SPECIALIZED_TILE else min(slots, tile.max_width * config.num_experts)


def specialized_device() -> bool:
    """Whether the GPU runs the warp-specialised GEMM: wgmma and bulk copies are sm_90a's."""
    return interop.kernel_device().type == "cuda" and torch.cuda.get_device_capability() == (9, 0)


def specialized_allowed(config: MoEConfig, spec: QuantSpec) -> bool:
    """Whether the warp-specialised GEMM can run this layer here: on Hopper
    (`specialized_device`, unless NUMBA_MOE_SPECIALIZED=0), the native layout in whole
    panels and stages (`gemm_specialized.specialized_supported`), not act-order (whose
    inputs are permuted per expert)."""
    if not (USE_SPECIALIZED and specialized_device()) or permutes_inputs(config):
        return False
    h, i, n1 = config.hidden_size, config.intermediate_size, config.gate_up_size
    return all(specialized_supported(spec, n, k, config.dtype) for n, k in ((n1, h), (h, i)))


SPECIALIZED_CANDIDATE_TOKENS_PER_EXPERT = 8
"""Expected slots an expert from which the tuner times the warp-specialised GEMM, half the
decode regime's end: on NARROW_SPECIALIZED_TILE it can win below where the untuned oracle
takes it (`specialized_from`). On the H200 (eighty-fourth session of benchmarks/LOG.md,
DeepSeek at M = 256, 8 an expert, GEMMs us, two rounds): the tuner took it for w4a16, side
by side 1962 / 1905 against the refined tiles' 2032 / 1940; NVFP4 kept its tiles, which
took 1999 / 2116 against its 2323 / 2309 in one process."""


def specialized_candidate(config: MoEConfig, num_tokens: int, spec: QuantSpec) -> bool:
    """Whether the tuner times the warp-specialised GEMM at `num_tokens` tokens: where it
    can run (`specialized_allowed`), from SPECIALIZED_CANDIDATE_TOKENS_PER_EXPERT slots an
    expert up."""
    return (slots_per_expert(config, num_tokens) >= SPECIALIZED_CANDIDATE_TOKENS_PER_EXPERT
            and specialized_allowed(config, spec))


def specialized_from(config: MoEConfig) -> int:
    """Slots an expert from which the untuned oracle takes the warp-specialised GEMM:
    LARGE_EXPERT_TOKENS_PER_EXPERT for experts of LARGE_EXPERT_WEIGHTS or more, else
    SPECIALIZED_TOKENS_PER_EXPERT."""
    weights = (config.gate_up_size + config.intermediate_size) * config.hidden_size
    return LARGE_EXPERT_TOKENS_PER_EXPERT if weights >= LARGE_EXPERT_WEIGHTS else SPECIALIZED_TOKENS_PER_EXPERT


def warp_specialised(tile: SpecializedTile) -> Backend:
    """The backend of both GEMMs warp-specialised with `tile` (its prefill tiles never run)."""
    unused = attrs.evolve(PREFILL_TILE, block_m=tile.block_m)
    return Backend(tile.block_m, unused, unused, tile)


def specialized_backend(config: MoEConfig, num_tokens: int, spec: QuantSpec) -> Backend | None:
    """The untuned choice of the warp-specialised GEMM (`warp_specialised` with
    `specialized_tile`): a candidate (`specialized_candidate`) from `specialized_from`
    slots an expert up; else None."""
    if (specialized_from(config) <= slots_per_expert(config, num_tokens)
            and specialized_candidate(config, num_tokens, spec)):
        return warp_specialised(specialized_tile(config, num_tokens))
    return None


def heuristic_backend(config: MoEConfig, num_tokens: int, spec: QuantSpec | None = None) -> Backend:
    """The untuned choice; with `spec`, prefill tiles only where its weights can be staged."""
    per_expert = slots_per_expert(config, num_tokens)
    decode = _decode_backend(config, num_tokens)
    if per_expert <= DECODE_TOKENS_PER_EXPERT:
        return decode
    prefill = _prefill_backend(config, num_tokens)
    return prefill if spec is None or runs_on(config, spec, prefill) else decode


def runs_on(config: MoEConfig, spec: QuantSpec, backend: Backend) -> bool:
    """Whether `backend`'s tiles can read weights stored as `spec` (a prefill tile stages
    them through shared memory, which some layouts do not allow: `gemm.prefill_supported`)."""
    h, i, n1 = config.hidden_size, config.intermediate_size, config.gate_up_size
    return all(not tile.a_in_shared or prefill_supported(spec, n, k, config.dtype, tile)
               for tile, n, k in ((backend.gemm1, n1, h), (backend.gemm2, h, i)))


def writes_partials(tile: GemmTile) -> bool:
    """Whether the GEMM writes float32 partials (split_k, slots, N) rather than halves:
    a K split, or a decode tile that may finish the reduction itself from them
    (`fused_reduction`; a tile of paired warps finishes it from its half outputs)."""
    return tile.split_k > 1 or (tile.fused_reduction and not tile.pairs_warps)


def activation_finishable(config: MoEConfig, tile: GemmTile) -> bool:
    """Whether gemm1 with `tile` can finish the activation: in its epilogue (a tile of
    paired warps, `gemm.paired_activation`) or from partials (other decode tiles)."""
    n1 = config.gate_up_size
    if tile.pairs_warps:
        return paired_activation(tile, config.activation, n1)
    return activation_fusable(config.activation, n1, tile.block_n)


def fused_activation_kind(config: MoEConfig, tile: GemmTile) -> tuple | None:
    """The `FusedActivation.kind` gemm1 finishes with `tile`, or None (a separate kernel)."""
    if tile.fused_reduction and activation_finishable(config, tile):
        return activation_kind(config.activation)
    return None


def fused_combine_kind(config: MoEConfig, tile: GemmTile) -> tuple | None:
    """The `FusedCombine.kind` gemm2 finishes with `tile`, or None (a separate kernel; a
    tile of paired warps never finishes the combine)."""
    return combine_kind(config.top_k) if tile.fused_reduction and not tile.pairs_warps else None


def fused_routing(config: MoEConfig, num_tokens: int) -> bool:
    """Whether routing and alignment of `num_tokens` tokens run as one launch (in one pass
    of the block's lanes)."""
    return num_tokens <= min(FUSED_ROUTING_TOKENS, max_lanes(config.routing, config.num_experts))


def shape_prefix(config: MoEConfig) -> str:
    """The part of a tuned table's key every format of the shape shares."""
    return f"E={config.num_local_experts},top_k={config.top_k},H={config.hidden_size},I={config.intermediate_size},"


def shape_keys(config: MoEConfig, spec: QuantSpec) -> list[str]:
    """The tuned tables' keys for weights `spec`, its own first. Zero points (AWQ,
    asymmetric compressed-tensors) have a key of their own, then take the entries of the
    same layout without them: their tiles read the same codes and one more small tensor,
    and mostly the same tiles win, but not always (H200: Mixtral at M = 4, the symmetric
    entry 156 us with zero points against 140 for a tile refined on them; eighty-sixth
    session of benchmarks/LOG.md)."""
    plain = f"{shape_prefix(config)}spec={spec.name},group={spec.group_size}"
    return [f"{plain},zero_points=true", plain] if spec.zeros is not None else [plain]


def shape_key(config: MoEConfig, spec: QuantSpec) -> str:
    """The key `moe.tune` saves entries for `spec` under."""
    return shape_keys(config, spec)[0]


def tuned_path(architecture: str, device: str) -> Path:
    return TUNED_DIR / architecture / f"{device}.json"


@functools.cache
def tuned_tables(architecture: str) -> dict:
    """{device: {shape key: {num_tokens: backend dict}}}: the tables measured on GPUs of
    `architecture`, by device name."""
    return {path.stem: json.loads(path.read_text()) for path in sorted((TUNED_DIR / architecture).glob("*.json"))}


# (device, shape keys) -> (the tables merged, their merge: source, entries, and the entries
# as backends): `select_backend` asks on every forward with hooks and every recording of a
# replayed one, and the merge is the same until `tuned_tables` reads the files again.
_MERGED_ENTRIES: dict = {}


def _merge_entries(tables: dict, own: str, keys: tuple[str, ...]) -> tuple[str | None, dict, dict]:
    """`_tuned` of `tables` for device `own` and shape keys `keys`."""
    sources, entries = [], {}
    for key in keys:
        sibling = next((device for device in sorted(tables) if device != own and key in tables[device]), None)
        for device in (own, sibling):
            found = {m: entry for m, entry in tables.get(device, {}).get(key, {}).items() if m not in entries}
            sources += [device] * bool(found)
            entries.update(found)
    backends = {int(m): backend_from_dict(entry) for m, entry in entries.items()}
    return (" + ".join(dict.fromkeys(sources)) or None), entries, backends


def _tuned(config: MoEConfig, spec: QuantSpec) -> tuple[str | None, dict, dict]:
    """`tuned_entries`, and its entries as backends by token count (parsed once: a tile's
    checks cost more than the rest of `select_backend`)."""
    if not USE_TUNED:
        return None, {}, {}
    tables, own, keys = tuned_tables(device_architecture()), device_name(), tuple(shape_keys(config, spec))
    merged = _MERGED_ENTRIES.get((own, keys))
    if merged is None or merged[0] is not tables:  # first asked, or the tables were read again
        merged = _MERGED_ENTRIES[own, keys] = tables, _merge_entries(tables, own, keys)
    return merged[1]


def tuned_entries(config: MoEConfig, spec: QuantSpec) -> tuple[str | None, dict]:
    """(source, {num_tokens: backend dict}): the tuned entries of this shape from this
    device's own table, topped up, token count by token count, by the first (by name)
    table of another GPU of the same architecture that has the shape (tiles carry over
    within an architecture: the same instructions, shared memory and registers per
    multiprocessor; only the best choice may shift with bandwidth and multiprocessor
    count, so a GPU re-tunes the counts where it differs and keeps its sibling's
    elsewhere); then the same for the next of `shape_keys` (zero points: the entries without
    them). `source` names the tables that gave entries, this device's first
    ("NVIDIA_H100_80GB_HBM3 + NVIDIA_H200"); (None, {}) where none has the shape. The
    dictionary is shared between calls: read it, do not change it."""
    source, entries, _ = _tuned(config, spec)
    return source, entries


def backend_from_dict(value: dict) -> Backend:
    specialized = value.get("specialized")
    return Backend(value["block_m"], GemmTile(**value["gemm1"]), GemmTile(**value["gemm2"]),
                   None if specialized is None else SpecializedTile(**specialized))


def backend_to_dict(backend: Backend) -> dict:
    """The tuned tables' form; "specialized" is null for tiles (an entry tuned with the
    warp-specialised GEMM among the candidates, `select_backend`)."""
    return attrs.asdict(backend)


TUNED_REACH = 4
"""A tuned entry measured at m tokens serves calls of m to TUNED_REACH * m - 1 tokens (the
tuner's default counts are powers of 4); beyond, the heuristic, whose decode or prefill
regime follows the token count, rather than a table entry from another regime."""


def heuristic_first(config: MoEConfig, spec: QuantSpec, entry: dict, measured: int, num_tokens: int) -> bool:
    """Whether the untuned choice of the warp-specialised GEMM (`specialized_backend`) comes
    before a tuned `entry`, measured at `measured` tokens, for a call of `num_tokens`: where
    the entry was tuned without it among the candidates (no "specialized" key: the tables
    from before it), and past `measured` where the entry found the tiles faster (null) and
    the untuned choice agreed at `measured`. The GEMM gains with the slots an expert (each
    decoded weight serves more of them), so tiles faster at m say little of the counts up to
    TUNED_REACH * m: on the H200, Qwen3 NVFP4's tiles took 172 against 180 us at 16 slots
    an expert, 277 against 206 at 32 (eighty-second session of benchmarks/LOG.md)."""
    if "specialized" not in entry:
        return True
    return (entry["specialized"] is None and num_tokens > measured
            and specialized_backend(config, measured, spec) is None)


def select_backend(config: MoEConfig, num_tokens: int, spec: QuantSpec, *, specialized: bool = True) -> Backend:
    """The backend for `num_tokens` tokens through weights stored as `spec`: the tuned
    entry (`tuned_entries`) for the largest measured token count m <= num_tokens <
    TUNED_REACH * m, else the heuristic; either only if its tiles can read `spec` (a
    layout sharing a tuned spec's name, act-order's K-sorted tiles, may not be staged).
    The warp-specialised GEMM only where `specialized` (it reads routed slots: not the
    batched layout's, not a call whose hooks see the GEMMs' rows): as the entry says, at
    the tile the token count takes (`specialized_tile`: what the workspace is sized for),
    or by `specialized_backend` where no entry was tuned with it as a candidate or where
    `heuristic_first` says so."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    _, entries, backends = _tuned(config, spec)
    measured = max((m for m in backends if m <= num_tokens < TUNED_REACH * m), default=None)
    entry = None if measured is None else entries[str(measured)]
    if specialized and (entry is None or heuristic_first(config, spec, entry, measured, num_tokens)):
        chosen = specialized_backend(config, num_tokens, spec)
        if chosen is not None:
            return chosen
    if entry is not None:
        backend = backends[measured]
        if backend.specialized is None and runs_on(config, spec, backend):
            return backend
        if backend.specialized is not None and specialized and specialized_allowed(config, spec):
            return warp_specialised(specialized_tile(config, num_tokens))
    return heuristic_backend(config, num_tokens, spec)


def select_batched_backend(config: MoEConfig, tokens_per_expert: int, spec: QuantSpec) -> Backend:
    """The backend of the batched layout: that of a routed call whose slots spread to
    `tokens_per_expert` per local expert (the block size follows the tokens per expert)."""
    if tokens_per_expert < 1:
        raise ValueError(f"tokens_per_expert must be positive, got {tokens_per_expert}")
    equivalent = -(-tokens_per_expert * config.num_experts // config.top_k)
    return select_backend(config, equivalent, spec, specialized=False)


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts whose backends a workspace must fit: powers of two up to max_tokens,
    and max_tokens itself."""
    buckets, m = [], 1
    while m < max_tokens:
        buckets.append(m)
        m *= 2
    return buckets + [max_tokens]
