"""Grouped dequant-GEMM on tensor cores: the two matmuls of an MoE layer.

For every block of `block_m` token slots that `moe_align_block_size` gave to expert
e = expert_ids[b], and every output feature n::

    out[t, n] = (topk_weight[t] *) sum_k act[t // rows_div, k] * W[e, n, k]   (t in block b)

`t` is a flat token slot (token * top_k + j): gemm1 reads the token's hidden state
(rows_div = top_k), gemm2 the slot's own intermediate row (rows_div = 1). Blocks of
experts held by another rank (expert id -1) produce zeros. W is never dequantized to
memory: `fragments` reads it where it is stored, as tensor-core B fragments.

Work split. A CTA owns one token block and `block_n = 64 * warps_n` output features,
over a contiguous range of K slabs (16 input features each; the grid's z axis splits K
in `split_k` parts). Each warp owns a 64-feature chunk and `block_m / warps_m` rows; the
`warps_k` warps that share them split the slabs and add up at the end. Per slab a warp
fetches its lane's weight words (`fragments`), turns them into 8 B fragments and issues
`(block_m / warps_m / 16) x 8` mma.m16n8k16 into float32 accumulators. Weight loads are
double-buffered: `slabs_per_warp` slabs are in flight while the previous ones are used.
With `swap_ab` (decode, blocks of 8 slots) the roles swap: each pair of n8 B fragments is
exactly an A fragment of 16 features (registers reordered, no data moved), the block's
8 slots are the B operand, and a slab costs 4 mma instead of 8. Swapped tiles over 4-bit
integer codes also defer the zero point and scale to once per scale group
(`fragments.DeferredScales`): a slab's dequantisation is then a shift and a `lop3` per
register, plus one mma that sums the activations.

The operands come from one of two places, a tile option, and each has its own main loop:

* global memory (decode, `a_in_shared=False`): `gemm_decode`, every warp streaming its
  own run of slabs with no barrier;
* shared memory (prefill, `a_in_shared=True`): `gemm_prefill`, a `cp.async` pipeline
  feeding the tensor cores by `ldmatrix`.

The warps of a `warps_k` team add up through shared memory, each accumulator tile summed
(in warp order, whichever warp does it: the same bits) and written by one owner warp, so
the epilogue's sums and stores split warps_k ways instead of falling to the first warp
alone (at decode they run back to back in a few warps, with nothing to overlap them). A
tile is written as half outputs (one K split) or float32 partials (split_k, slots, N)
that the next kernel sums in a fixed order (deterministic, no atomics). gemm1 on a tile
of paired warps (every prefill tile; a decode tile with warps_n >= 2 and one K split)
may instead finish the activation itself (`paired_activation`, `gemm_pairs`): gemm1's
output never goes to memory and the activation kernel (which reads it and writes half as
much) is not launched. Every count the kernel is generated from is defined once, in
`gemm_plan.GemmPlan`.

Memory traffic: each weight byte of the touched experts is read once per token block
(once in all at decode); activations are re-read once per 64-feature chunk, from L2.
"""

from __future__ import annotations

import functools

import attrs
import numpy as np
import torch
from numba import cuda, float32, int16, int32, int64, uint32

from layouts import QuantSpec

from . import interop, ptx
from .activation import Activation
from .align import check_alignment_arrays, check_alignment_ids
from .epilogue import FusedActivation, FusedCombine, check_fused, gate_up_halves, make_finisher
from .fragments import CHUNK_N, SLAB_K, copy_offsets_fit, staged_weights, staging_supported
from .gemm_decode import decode_steps
from .gemm_pairs import pair_roles
from .gemm_plan import GemmPlan
from .gemm_prefill import prefill_steps
from .launch import STATIC_SHARED_BYTES, launch_kernel, resident_ctas
from .weights import KernelWeights


def _positive_power_of_two(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{attribute.name} must be a positive power of two, got {value!r}")


def _stage_count(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= 8:
        raise ValueError(f"{attribute.name} must be an int in [2, 8], got {value!r}")


def _flag(instance, attribute, value):  # a truthy string would silently pick the other kernel
    if not isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be a bool, got {value!r}")


@attrs.frozen
class GemmTile:
    """Tile configuration of the grouped GEMM (compile-time constants).

    block_m:        token slots per block (the alignment block size), a multiple of 16.
    warps_m:        warps along the slots; each owns block_m / warps_m rows (16 or more).
    warps_n:        warps along output features, 64 each.
    warps_k:        warps that split each stage's slabs and add up at the end.
    slabs_per_warp: slabs of 16 input features a warp takes per stage (loads in flight).
    split_k:        CTAs along K; above 1 the output is float32 partials per split.
    a_in_shared:    stage both operands through shared memory (prefill) or read them from
                    global memory (decode).
    stages:         buffers of the prefill pipeline (stages - 1 copies in flight).
    swap_ab:        decode with the weights as the mma's A operand (16 features x 16 K)
                    and 8 token slots as its B operand: blocks of 8 slots, half the mma,
                    accumulators and activation loads of a 16-slot block (a few tokens per
                    expert, the decode case).
    fused_reduction: the layer runs this GEMM with `then=` (`epilogue`): it finishes the
                    activation or the combine itself, one kernel fewer but a longer tail
                    per CTA (the tuner picks it where that wins). A prefill tile finishes
                    only gemm1's activation, in its epilogue (`paired_activation`).
    steady_loop:    decode: while whole batches remain, run a copy of the main loop without
                    range checks (none per slab where runs end inside a batch, none per
                    batch where they do not: fewer instructions where dequantisation is
                    issue-bound, but more code and registers).
    chunks_first:   the order CTAs start in: all output chunks of a token block before the
                    next block (its activation rows come from DRAM once, read by CTAs that
                    run together), rather than all blocks of a chunk first (an expert's
                    weight chunk is shared by its blocks that run together). Which order
                    keeps more in L2 depends on the sizes: the tuner times both.
    trim_padding:   prefill, warps_m = 1: a block whose last 16-row m tiles hold padding
                    only (an expert's last block) runs a copy of the main loop without
                    them, one copy per count of tiles in use (fewer mma where experts get a
                    few blocks each, but about twice the code to compile).
    release_early:  under early launch (`launch`), let the next kernel's CTAs start as soon
                    as this one has waited for the kernel before it, not after its main
                    loop: they then start, and gemm2 issues its first weight loads, beside
                    this kernel's main loop rather than in its tail. That gains where the
                    grid leaves room beside it (Qwen3's decode gemm1 at one token, on the
                    H100 and the H200) and costs where the waiting CTAs take the place of
                    this kernel's (the fifteenth session's H200 kernels): `moe.tune
                    --refine` times both.

    A tile whose warps come in gate/up pairs (`pairs_warps`) fuses only gemm1's activation,
    finished in its epilogue (`paired_activation`); others fuse from float32 partials.
    """

    block_m: int = attrs.field(default=16, validator=_positive_power_of_two)
    warps_m: int = attrs.field(default=1, validator=_positive_power_of_two)
    warps_n: int = attrs.field(default=1, validator=_positive_power_of_two)
    warps_k: int = attrs.field(default=4, validator=_positive_power_of_two)
    slabs_per_warp: int = attrs.field(default=2, validator=_positive_power_of_two)
    split_k: int = attrs.field(default=1, validator=_positive_power_of_two)
    a_in_shared: bool = attrs.field(default=False, validator=_flag)
    stages: int = attrs.field(default=3, validator=_stage_count)
    swap_ab: bool = attrs.field(default=False, validator=_flag)
    fused_reduction: bool = attrs.field(default=False, validator=_flag)
    steady_loop: bool = attrs.field(default=False, validator=_flag)
    chunks_first: bool = attrs.field(default=False, validator=_flag)
    trim_padding: bool = attrs.field(default=False, validator=_flag)
    release_early: bool = attrs.field(default=False, validator=_flag)

    def __attrs_post_init__(self):
        if self.steady_loop and self.a_in_shared:
            raise ValueError(f"steady_loop is for decode tiles (no a_in_shared), got {self}")
        if self.trim_padding and not self.trimmable:
            raise ValueError(f"trim_padding is for prefill tiles (a_in_shared) with warps_m = 1 and block_m >= 32, "
                             f"got {self}")
        if self.swap_ab:
            if self.block_m != 8 or self.warps_m != 1 or self.a_in_shared:
                raise ValueError(f"swap_ab takes blocks of 8 slots, warps_m = 1 and no a_in_shared, got {self}")
        elif self.block_m < 16 or self.block_m % (16 * self.warps_m):
            raise ValueError(f"block_m ({self.block_m}) must be a multiple of 16 * warps_m ({16 * self.warps_m})")
        if self.threads > 1024:
            raise ValueError(f"a tile of {self.threads} threads exceeds the 1024 a CTA may have")

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n * self.warps_k

    @property
    def trimmable(self) -> bool:
        """Whether `trim_padding` applies: a prefill tile whose one warp along the rows has
        two m tiles or more."""
        return self.a_in_shared and self.warps_m == 1 and self.block_m >= 32

    @property
    def pairs_warps(self) -> bool:
        """Whether `fused_reduction` means gemm1's activation finished by pairs of warps
        in the epilogue (`paired_activation`), not from partials: every prefill tile, and
        a decode tile with one K split and two or more warps along N."""
        return self.a_in_shared or (self.split_k == 1 and self.warps_n >= 2)

    @property
    def block_n(self) -> int:
        return CHUNK_N * self.warps_n

    @property
    def stage_slabs(self) -> int:
        return self.warps_k * self.slabs_per_warp

    @property
    def row_words(self) -> int:
        """Words per activation row of a prefill stage buffer: the stage's K as half pairs,
        padded by 4 so that `ldmatrix`'s 8 rows x 16 bytes hit 32 banks."""
        return self.stage_slabs * SLAB_K // 2 + 4

    def grid(self, num_blocks: int, n: int) -> tuple[int, int, int]:
        """(x, y, z) CTAs: token blocks and output chunks in `chunks_first` order, K splits."""
        chunks = -(-n // self.block_n)
        return (chunks, num_blocks, self.split_k) if self.chunks_first else (num_blocks, chunks, self.split_k)


def paired_activation(tile: GemmTile, activation: Activation, n: int) -> bool:
    """Whether gemm1 (n = 2I gate/up outputs) with `tile` (`pairs_warps`) can finish
    `activation` in its epilogue, with no counters and no partials: gate and up in halves
    [gate | up] of a row, one K split, and I in whole runs of warps_n / 2 chunks. The
    CTA's first warps_n / 2 warps then multiply gate chunks and the others the up chunks
    of the same features, so the two warps of a pair hold a feature's gate and up at the
    same fragment position; each hands half of its tile to the other through shared
    memory (a prefill tile's idle stage buffers, which must be large enough: the check
    below; a decode tile's own small buffer) and finishes the other half. At decode this
    takes the activation kernel out of the layer with no partials, fences or counters."""
    half_n = tile.warps_n // 2
    exchange_fits = 16 * tile.warps_n <= tile.stages * tile.row_words if tile.a_in_shared else True
    return (tile.pairs_warps and tile.split_k == 1 and half_n >= 1 and gate_up_halves(activation)
            and (n // 2) % (CHUNK_N * half_n) == 0 and exchange_fits)


STAGE_BUFFER_BYTES = 227 * 1024  # a prefill tile's stage buffers (dynamic): the most Hopper grants a CTA
MAX_GRID_YZ = 65535  # CTAs a grid may have along y and along z


def stage_buffer_bytes(spec: QuantSpec, n: int, k: int, half: str, tile: GemmTile) -> int:
    """Dynamic shared memory of a prefill tile's stage buffers (none for a decode tile):
    `stages` buffers of block_m activation rows and a stage of weights, scales and zero
    points each. Dynamic, so that deep pipelines may exceed the 48 KB of static arrays."""
    if not tile.a_in_shared:
        return 0
    staged = staged_weights(spec, n, k, half, tile.warps_n, tile.stage_slabs, tile.threads)
    return 4 * tile.stages * (tile.block_m * tile.row_words + staged.stage_words)


def loads_weights_early(tile: GemmTile, alignment_ready: bool) -> bool:
    """Whether the GEMM's first wave issues weight loads before its wait (see
    make_grouped_gemm): decode tiles only, a prefill tile's first copies include activations."""
    return alignment_ready and not tile.a_in_shared


@functools.cache
def make_grouped_gemm(spec: QuantSpec, n: int, k: int, tile: GemmTile, half: str, partial_output: bool,
                      mul_routed_weight: bool, pair_loads: bool = False, fused: tuple | None = None,
                      alignment_ready: bool = False):
    """The grouped GEMM for weights stored as `spec` (logical (n, k) per expert), `half`
    activations, `tile`; float32 partials or `half` outputs; `fused` (the `kind` of an
    `epilogue.FusedActivation` or `FusedCombine`): the partials' reduction, finished by
    the last CTA of each output tile.

    The kernel takes activations as a 3-D (1, rows, cols) array: int32 half pairs
    (cols = K / 2) with `pair_loads`, else int16 halves (cols = K; odd K, or K sorted by
    act-order groups, which gathers each element). A prefill tile (`a_in_shared`) needs
    pairs, rows 16-byte aligned and weights that `fragments.staging_supported` accepts.

    `alignment_ready`: the alignment was final before the kernel launched ahead of this
    one started (the layer's gemm2: aligned before gemm1). Launched early, a decode tile's
    first wave of CTAs (the kernel's last argument, `early_ctas`: `launch.resident_ctas`)
    then reads it (from the L2: `alignment_entry`) and issues its first weight loads before
    waiting for that kernel, so they overlap its tail; only the activations wait. The
    other CTAs can start only as CTAs ahead of them leave, mostly after the wait has
    returned, so they wait first and read the alignment through the L1 (either order is
    correct wherever a CTA starts): reading it from the L2 in every CTA cost decode grids
    of more than one wave 1.5 to 4 % (Mixtral M = 16, DeepSeek M = 1 on the H200)."""
    plan = GemmPlan(spec, n, k, tile, half, pair_loads)
    output_scale, raw_words = plan.reader.output_scale, plan.reader.raw_words
    to_half, pack2 = ptx.to_half(half), ptx.pack2(half)
    pair_stores = stores_pairs(tile, n, partial_output)
    block_m, threads, stages = tile.block_m, tile.threads, tile.stages
    a_in_shared, swap_ab, chunks_first = tile.a_in_shared, tile.swap_ab, tile.chunks_first
    steady_loop, trims, release_early = tile.steady_loop, tile.trim_padding, tile.release_early
    early_weights = loads_weights_early(tile, alignment_ready)
    warps_n, warps_k, depth, stage_slabs = tile.warps_n, tile.warps_k, tile.slabs_per_warp, tile.stage_slabs
    warp_rows, m_tiles, row_halves, teams = plan.warp_rows, plan.m_tiles, plan.row_halves, plan.teams
    acc_i, acc_j = plan.acc_shape
    total_slabs, slabs_per_split, warp_run = plan.total_slabs, plan.slabs_per_split, plan.warp_run
    gacc_shape = (acc_i, acc_j, 4) if plan.deferred is not None else (1, 1, 1)
    size_n = n
    n_chunks = -(-n // CHUNK_N)
    whole_chunks = n % CHUNK_N == 0  # no column past N in a chunk of N: only warps past N skip their stores
    reduce_values = plan.reduce_values
    reduce_words = warps_k * teams * reduce_values
    flat_a, pairs_per_row = plan.flat_a, plan.pairs_per_row
    row_words, a_copies = tile.row_words, plan.a_copies
    a_stage_words = stages * block_m * row_words  # the activation stage buffers, all stages
    if a_in_shared and not pair_loads:
        raise ValueError("a prefill tile (a_in_shared) reads activations as half pairs: K must be even and "
                         "not sorted by act-order groups")
    staged = plan.staged
    w_copies, plan_weights = (staged.copies_per_thread, staged.plan) if staged else (1, None)
    paired = fused is not None and tile.pairs_warps
    # Accumulator tile (i, j) is summed and stored by warp `owner(i, j)` of its team,
    # (i * acc_j + j) % spread; a tile of paired warps gathers every tile in the team's
    # first warp (its hand-over exchanges whole warps' tiles).
    spread = 1 if paired else warps_k
    # The pairs' exchange: a prefill tile's idle stage buffers, a decode tile's own words
    # (per team: 8 words a lane and m tile, 4 a lane swapped).
    exchange_words = teams * 32 * (4 if swap_ab else 8 * m_tiles) if paired and not a_in_shared else 0
    static_bytes = 4 * (block_m + reduce_words + exchange_words)
    if static_bytes > STATIC_SHARED_BYTES:
        raise ValueError(f"{tile} needs {static_bytes} bytes of static shared memory, more than "
                         f"{STATIC_SHARED_BYTES}: use fewer warps along K or rows")
    buffer_bytes = stage_buffer_bytes(spec, n, k, half, tile)
    if static_bytes + buffer_bytes > STAGE_BUFFER_BYTES:
        raise ValueError(f"{tile} needs {buffer_bytes} bytes of shared memory for the stage buffers of {spec.name}, "
                         f"more than {STAGE_BUFFER_BYTES - static_bytes}: use fewer stages, slabs or rows")
    if paired and not (fused[0] == "activation" and paired_activation(tile, fused[1], n)):
        raise ValueError(f"then: a tile of paired warps (a prefill tile, or a decode tile with split_k = 1 and "
                         f"warps_n >= 2) finishes only a gated [gate | up] activation, with split_k = 1, "
                         f"warps_n >= 2, I = {n // 2} in whole runs of warps_n / 2 chunks of {CHUNK_N} and, "
                         f"prefill, 16 * warps_n <= stages * row_words (gemm.paired_activation); got "
                         f"{fused[1] if fused[0] == 'activation' else 'the combine'} with {tile}: run the reduction after the GEMM instead")
    if paired and partial_output:
        raise ValueError("a tile of paired warps finishes the activation from its half outputs: build with "
                         "partial_output=False")
    if fused is not None and not paired and not partial_output:
        raise ValueError("a fused reduction reads float32 partials: build with partial_output=True")
    finishes = fused is not None and not paired
    finish = make_finisher(fused, n, block_m, tile.block_n, tile.split_k, threads, half) if finishes else None
    half_n = max(warps_n // 2, 1)  # paired: gate warps, then as many up warps
    up_chunks = n // 2 // CHUNK_N  # paired: the first up chunk

    # The main loop (one of two) and the paired epilogue, built only where the tile uses them.
    fetch_batch, two_batches, two_whole_batches, fetch_weight_words, fetch_a_words = (
        (None,) * 5 if a_in_shared else decode_steps(plan))
    plan_activation_copies, issue_stage, wait_first_stage, run_prefill = (
        prefill_steps(plan) if a_in_shared else (None,) * 4)
    (hand_over_gate, finish_gate), (hand_over_up, finish_up) = (
        pair_roles(plan, fused[1]) if paired else ((None, None), (None, None)))

    @ptx.device
    def slots_ready(held):
        """The barrier after the block's slots are staged; with `trim_padding`, also the
        count of 16-row m tiles up to the block's last slot (past it: padding only), voted
        in the barriers themselves: bit mt of `held` says whether this thread staged a
        slot of m tile mt. Reading the staged slots back instead cost each warp a loop
        over all block_m of them, a seventh of gemm2's instructions at Qwen3 M = 4096."""
        if not trims:
            cuda.syncthreads()
            return m_tiles
        used = 1  # trim_padding: m_tiles >= 2, so there is a barrier below
        for mt in range(1, m_tiles):
            if cuda.syncthreads_or(held & (1 << mt)):
                used = mt + 1
        return used

    @ptx.device
    def wait_for_previous():
        """Wait for the kernel before (launched early: `launch.Launcher`); with
        `release_early`, then let the next one's CTAs start."""
        ptx.wait_for_previous()
        if release_early:
            ptx.release_next()

    @ptx.device
    def alignment_entry(array, i, early):
        """Entry `i` of an alignment array. An `early` CTA reads it before the wait, where
        the SM's L1 may still hold a line from an earlier forward (the wait is what
        refreshes it), so from the L2, which holds what the alignment kernel wrote: that
        kernel finished before the kernel ahead of this one started."""
        if early:
            return int32(ptx.load_coherent(array, i))
        return array[i]

    @ptx.device
    def owner(i, j):
        """The warp of the team (along K) that sums and stores accumulator tile (i, j)."""
        return (i * acc_j + j) % spread

    @ptx.device
    def store(row, col, value):
        """Column `col` (unsigned: one immediate offset per column from the row's address)
        of a slot's row of `out`. Where N is whole chunks, the caller checks the chunk once."""
        if whole_chunks or col < uint32(size_n):
            if partial_output:
                row[col] = value
            else:
                row[col] = int16(to_half(value))

    @ptx.device
    def store_pairs(row, chunk, t, acc, mt, r, weight, wk):
        """Row `r` of m tile `mt` (one slot) as 8 words of half pairs (`pair_stores`: the
        slot's `row` of `out` viewed as int32 pairs), columns chunk * 64 + 8 nt + 2t,
        2t + 1, of the tiles warp `wk` owns (`spread`). One row address and unsigned
        offsets, so the stores take immediate offsets: with a bounds check and 64-bit index
        arithmetic per column, a 64 x 64 warp tile's 64 stores took about 1,100
        instructions, two main-loop stages' worth."""
        first = uint32(chunk * (CHUNK_N // 2) + t)
        for nt in range(8):
            pair = first + uint32(4 * nt)
            if owner(mt, nt) == wk and (whole_chunks or pair < uint32(size_n // 2)):
                row[pair] = int32(pack2(acc[mt, nt, 2 * r] * weight, acc[mt, nt, 2 * r + 1] * weight))

    @ptx.kernel
    def grouped_gemm(act, weights, sorted_ids, expert_ids, num_post_padded, topk_weights, out, reduced, arrivals,
                     num_slots, rows_div, early_ctas):
        # Thread and block indices are unsigned 32-bit: as Numba's signed ints, every index,
        # division and remainder derived from them carried a sign's fix-up and a high word.
        grid_x, grid_y = uint32(cuda.blockIdx.x), uint32(cuda.blockIdx.y)
        # early: among the grid's first `early_ctas` CTAs in launch order (make_grouped_gemm)
        early = early_weights and grid_x + uint32(cuda.gridDim.x) * (
            grid_y + uint32(cuda.gridDim.y) * uint32(cuda.blockIdx.z)) < uint32(early_ctas)
        if not early:
            wait_for_previous()  # the alignment and act are final from here
        block, column = (grid_y, grid_x) if chunks_first else (grid_x, grid_y)
        tid = uint32(cuda.threadIdx.x)
        # The block's expert and slots are loaded beside the count of blocks in use, not
        # after it: one round trip to memory before the weights' addresses are known, not
        # two (past the count the loads read stale ids that are never used).
        expert = alignment_entry(expert_ids, block, early)
        slots = cuda.shared.array(block_m, int32)
        held = 0  # bit mt: this thread staged a slot (not padding) of m tile mt
        for r in range(-(-block_m // threads)):  # a constant count (one pass where threads >= block_m), in 32 bits
            i = tid + r * threads
            if i >= block_m:
                break
            position = block * block_m + i
            slot = num_slots
            if position < sorted_ids.shape[0]:
                slot = alignment_entry(sorted_ids, position, early)
            slots[i] = slot
            if trims and slot < num_slots:  # trims is a constant: no code in untrimmed kernels
                held |= 1 << (i // 16)
        if block * block_m >= alignment_entry(num_post_padded, 0, early):
            return
        # The epilogue's multiplier (NVFP4's global scale) loads now, not after the loop.
        multiplier = output_scale(weights, expert) if expert >= 0 else float32(0.0)
        used_tiles = slots_ready(held)
        lane, warp = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        wk = warp % warps_k
        wn = (warp // warps_k) % warps_n
        wm = warp // (warps_k * warps_n)
        first_row = wm * warp_rows
        # The CTA's chunks: warps_n in a row, or (paired) gate chunks and their up chunks.
        gate_chunk, is_up = column * half_n + wn % half_n, wn >= half_n
        chunk = gate_chunk + up_chunks * int32(is_up) if paired else column * warps_n + wn
        split = uint32(cuda.blockIdx.z)
        if a_in_shared:
            stage_buffers = cuda.shared.array(0, uint32)  # dynamic (stage_buffer_bytes), 16-byte aligned
            a_tiles = stage_buffers[:a_stage_words]  # stages x block_m x row_words, by flat offsets
            w_tiles = stage_buffers[a_stage_words:]  # stages x stage_words
        elif paired:
            a_tiles = cuda.shared.array(exchange_words, uint32)  # the pairs' exchange (decode)

        acc = cuda.local.array((acc_i, acc_j, 4), float32)
        for i in range(acc_i):
            for j in range(acc_j):
                for c in range(4):
                    acc[i, j, c] = float32(0.0)

        start_slab = split * slabs_per_split
        end_slab = min(start_slab + slabs_per_split, total_slabs)
        if expert >= 0 and start_slab < end_slab:
            params = cuda.local.array(16, uint32)
            if a_in_shared:
                raw = cuda.local.array(raw_words, uint32)
                a_source = cuda.local.array(a_copies, uint32)
                a_target = cuda.local.array(a_copies, uint32)
                a_slab = cuda.local.array(a_copies, uint32)
                plan_activation_copies(slots, num_slots, rows_div, tid, a_source, a_target, a_slab)
                w_source = cuda.local.array(w_copies, uint32)
                if paired:
                    plan_weights(expert, column * half_n, up_chunks + column * half_n, tid, w_source)
                else:
                    plan_weights(expert, column * warps_n, column * warps_n + warps_n // 2, tid, w_source)
                a_lane = (first_row + lane % 16) * row_words + 4 * (lane // 16)
                # Operands of two slabs live in registers: slot d % 2 is multiplied while the
                # next slab's are loaded and decoded. The stage's barrier comes before its last
                # slab's mma, so the next stage's first loads overlap tensor work too, and the
                # copies refilling the stage's buffer are issued after it.
                frag_slots = cuda.local.array((2, 16), uint32)
                a_slots = cuda.local.array((2, m_tiles, 4), uint32)
                read_chunk = wn if chunk < n_chunks else 0  # warps past N multiply chunk 0 and store nothing
                own = wk * depth  # this warp's first slab in a stage
                # The pipeline counts slabs and buffers in 32 bits: Numba's integers are
                # 64-bit, and so were the main loop's compares, selects and copy bounds.
                first_slab, last_slab = uint32(start_slab), uint32(end_slab)
                for s in range(stages):
                    issue_stage(act, weights, uint32(first_slab + s * stage_slabs), last_slab, a_source, a_target,
                                a_slab, w_source, a_tiles, w_tiles, uint32(s), tid)
                wait_first_stage()
                cuda.syncthreads()
                run_prefill(used_tiles, act, weights, expert, first_slab, last_slab, own, read_chunk, chunk, lane,
                            a_lane, a_tiles, w_tiles, raw, params, frag_slots, a_slots, acc, a_source, a_target, a_slab,
                            w_source, tid)
            else:
                weight_end = end_slab if chunk < n_chunks else start_slab  # no weights past N
                frags = cuda.local.array(16, uint32)
                group = int32(-1)
                raw_a = cuda.local.array((depth, raw_words), uint32)
                raw_b = cuda.local.array((depth, raw_words), uint32)
                rows = cuda.local.array((m_tiles, 2), int64)  # see gemm_decode's a_word
                for mt in range(m_tiles):
                    for half_rows in range(row_halves):
                        slot = slots[first_row + 16 * mt + g + 8 * half_rows]
                        # 32-bit unsigned: Numba's int64 floor division is a call to a 64-bit divide
                        in_use = 0 <= slot < num_slots
                        row = int32(uint32(slot) // uint32(rows_div)) if in_use else (0 if flat_a else -1)
                        rows[mt, half_rows] = int64(row) * pairs_per_row + t if flat_a else row
                a_raw_a = cuda.local.array((depth, m_tiles, 4), uint32)
                a_raw_b = cuda.local.array((depth, m_tiles, 4), uint32)
                gacc = cuda.local.array(gacc_shape, float32)  # the current scale group's sums (defers)
                a_sum = cuda.local.array(4, float32)
                for i in range(gacc_shape[0]):
                    for j in range(gacc_shape[1]):
                        for c in range(gacc_shape[2]):
                            gacc[i, j, c] = float32(0.0)
                for c in range(4):
                    a_sum[c] = float32(0.0)
                slab_a = start_slab + wk * warp_run
                own_end = min(slab_a + warp_run, weight_end)
                if early_weights:  # an early CTA's first weights load while the kernel before it finishes
                    fetch_weight_words(act, weights, expert, slab_a, own_end, chunk, lane, rows, raw_a, a_raw_a)
                    if early:
                        wait_for_previous()
                    fetch_a_words(act, weights, expert, slab_a, own_end, chunk, lane, rows, raw_a, a_raw_a)
                else:
                    fetch_batch(act, weights, expert, slab_a, own_end, chunk, lane, rows, raw_a, a_raw_a)
                if steady_loop:  # while both batches and the next are whole: no per-slab checks
                    while slab_a + 3 * depth <= own_end:
                        slab_a, group = two_whole_batches(act, weights, expert, slab_a, own_end, chunk, lane, rows,
                                                          raw_a, a_raw_a, raw_b, a_raw_b, params, frags, group, acc,
                                                          gacc, a_sum)
                while slab_a < own_end:
                    slab_a, group = two_batches(act, weights, expert, slab_a, own_end, chunk, lane, rows, raw_a,
                                                a_raw_a, raw_b, a_raw_b, params, frags, group, acc, gacc, a_sum)

        if early:
            ptx.wait_for_previous()  # for CTAs that skipped the decode loop (returns at once after a wait)
        # The next kernel may launch now (unless `release_early` let it after the wait): its
        # CTAs start in this one's tail (reduction, stores, fused finish).
        if not release_early:
            ptx.release_next()
        if warps_k > 1:
            # Every warp writes its tiles to shared memory, and each tile's owner sums the
            # warps' copies in warp order, a0 + a1 + ..., its own among them: float sums in
            # another order round differently, and the layer's fused and separate
            # reductions must agree bit for bit whichever warp owns a tile (a paired tile
            # gathers all in warp 0). The loop over warps is outermost: with it innermost,
            # LLVM stopped unrolling the loops over tiles and the accumulators went to local
            # memory.
            partial = cuda.shared.array(reduce_words, float32)
            team_words = uint32(warp // warps_k * warps_k * reduce_values + lane)
            own_words = team_words + uint32(wk * reduce_values)
            for i in range(acc_i):
                for j in range(acc_j):
                    for c in range(4):
                        partial[own_words + uint32(((i * acc_j + j) * 4 + c) * 32)] = acc[i, j, c]
            cuda.syncthreads()
            for other in range(warps_k):
                words = team_words + uint32(other * reduce_values)
                for i in range(acc_i):
                    for j in range(acc_j):
                        if owner(i, j) == wk:
                            for c in range(4):
                                value = partial[words + uint32(((i * acc_j + j) * 4 + c) * 32)]
                                acc[i, j, c] = value if other == 0 else acc[i, j, c] + value

        if paired:
            team = warp // warps_k
            if a_in_shared:  # every copy has landed (the last stage's wait); once no warp reads the stages:
                cuda.syncthreads()
            if wk == 0:
                if is_up:
                    hand_over_up(acc, a_tiles, team, multiplier, lane)
                else:
                    hand_over_gate(acc, a_tiles, team, multiplier, lane)
            cuda.syncthreads()
            if wk == 0:
                if is_up:
                    finish_up(acc, a_tiles, reduced, slots, num_slots, team - half_n, gate_chunk, multiplier, first_row,
                              lane)
                else:
                    finish_gate(acc, a_tiles, reduced, slots, num_slots, team + half_n, gate_chunk, multiplier,
                                first_row, lane)
        elif chunk < n_chunks or not whole_chunks:  # each warp stores the tiles it owns
            for mt in range(m_tiles):
                for r in range(2):  # this lane's slots: rows g and g + 8 of the m tile, or slots 2t, 2t + 1 swapped
                    slot = slots[2 * t + r] if swap_ab else slots[first_row + 16 * mt + g + 8 * r]
                    if slot < num_slots:
                        weight = multiplier
                        if mul_routed_weight:
                            weight *= topk_weights[uint32(slot)]
                        if partial_output:  # one row address per slot, unsigned column offsets
                            row = out[split, uint32(slot)]
                        else:
                            row = out[uint32(slot)]
                        if pair_stores:
                            store_pairs(row, chunk, t, acc, mt, r, weight, wk)
                        elif swap_ab:
                            first = uint32(chunk * CHUNK_N + g)
                            for j in range(acc_i):
                                if owner(j, 0) == wk:
                                    for h in range(2):
                                        store(row, first + uint32(16 * j + 8 * h), acc[j, 0, 2 * h + r] * weight)
                        else:
                            first = uint32(chunk * CHUNK_N + 2 * t)
                            for nt in range(8):
                                if owner(mt, nt) == wk:
                                    for c in range(2):
                                        store(row, first + uint32(8 * nt + c), acc[mt, nt, 2 * r + c] * weight)

        if finishes:
            finish(out, reduced, arrivals, topk_weights, slots, num_slots, block, column, tid)

    return grouped_gemm


def stores_pairs(tile: GemmTile, n: int, partial_output: bool) -> bool:
    """Whether the kernel writes half outputs two columns per store, taking `out` as an
    int32 (rows, N / 2) view: halves, N even, and a lane holding adjacent columns (not
    swap_ab)."""
    return not partial_output and not tile.swap_ab and n % 2 == 0


def pair_loads(k: int, spec: QuantSpec) -> bool:
    """Whether the kernel reads activations of K = `k` as half pairs (see make_grouped_gemm)."""
    return k % 2 == 0 and not spec.sort_k_by_group


def prefill_supported(spec: QuantSpec, n: int, k: int, half: str, tile: GemmTile) -> bool:
    """Whether `tile`, a prefill tile, can run on weights in `spec` (else use a decode tile)."""
    return pair_loads(k, spec) and staging_supported(spec, n, k, half, tile.stage_slabs)


def activation_array(act: torch.Tensor, pair_loads: bool):
    """The kernel's 3-D view of `act`: (1, rows, K / 2) int32 pairs or (1, rows, K) halves."""
    view = act.view(torch.int32) if pair_loads else act
    return interop.to_kernel(view.unsqueeze(0))


def grouped_gemm(act, weights: KernelWeights, sorted_token_ids, expert_ids, num_tokens_post_padded, *,
                 num_slots: int, tile: GemmTile = GemmTile(), topk_weights=None, out=None,
                 partial_output: bool | None = None, then: FusedActivation | FusedCombine | None = None,
                 alignment_ready: bool = False, check_ids: bool = True) -> torch.Tensor:
    """One grouped GEMM over aligned token blocks.

    act:                     (M, K) per token (gemm1) or (num_slots, K) per slot (gemm2),
                             bfloat16 or float16.
    weights:                 the experts' weights (E, N, K) in any spec.
    sorted_token_ids, expert_ids, num_tokens_post_padded: `moe_align_block_size` output for
                             block size tile.block_m and these num_slots (int32). A slot
                             id below num_slots is a real slot (at or above: padding); the
                             expert id of a block lies in [0, E) or is -1 (no expert).
    num_slots:               M * top_k; slot ids at or above it are padding.
    topk_weights:            (M, top_k) float32 to multiply each slot's output by, or None.
    out / partial_output:    the output, (num_slots, N) in act's dtype, or with
                             partial_output (forced when tile.split_k > 1 or with `then`
                             on a decode tile; by default also for a float32 `out`)
                             float32 (split_k, num_slots, N) partial sums over K.
    then:                    the reduction that reads the output, finished by the GEMM
                             itself: on a decode tile from the partials (`epilogue`),
                             `FusedActivation` (gemm1) or `FusedCombine` (gemm2), whose
                             arrival counters must be zeros; on a tile of paired warps
                             (`GemmTile.pairs_warps`) a `FusedActivation` that
                             `paired_activation` allows, finished in the epilogue: `out`
                             is then not written (None allocates nothing).
    alignment_ready:         the alignment was written before the kernel launched ahead of
                             this one started (see make_grouped_gemm): under early launch
                             the first weight loads need not wait for that kernel.
    check_ids:               check the ids of the blocks in use (num_tokens_post_padded's)
                             before the launch: a host sync, so the layer, whose aligning
                             kernels write valid ids, passes False (as inside a CUDA graph
                             capture, where a sync is not allowed).

    Returns `out`, or then.out where `out` was not written.
    """
    if not isinstance(weights, KernelWeights):
        raise TypeError(f"weights must be KernelWeights (KernelWeights.from_physical), got {type(weights).__name__}")
    if not isinstance(tile, GemmTile):
        raise TypeError(f"tile must be a GemmTile, got {type(tile).__name__}")
    experts, n, k = weights.shape
    pairs = pair_loads(k, weights.spec)
    alignment = 16 if tile.a_in_shared else 4 if pairs else 2  # staged in 16-byte copies; read in pairs or halves
    act = interop.check_tensor("act", act, dtype=(torch.bfloat16, torch.float16), ndim=2, alignment=alignment)
    half = interop.HALF_NAMES[act.dtype]
    if act.shape[1] != k:
        raise ValueError(f"act must have K = {k} columns (the weights' input features), got {tuple(act.shape)}")
    if act.shape[0] == 0:
        raise ValueError("act holds no rows")
    interop.check_count("num_slots", num_slots, 1)
    if num_slots % act.shape[0]:
        raise ValueError(f"num_slots ({num_slots}) must be a positive multiple of act's rows ({act.shape[0]})")
    sorted_token_ids, expert_ids, num_tokens_post_padded = check_alignment_arrays(sorted_token_ids, expert_ids,
                                                                                  num_tokens_post_padded, tile.block_m)
    if check_ids:
        check_alignment_ids(sorted_token_ids, expert_ids, num_tokens_post_padded, tile.block_m, experts)
    if out is not None:
        out = interop.as_tensor(out, "out")
    paired = then is not None and tile.pairs_warps  # finished in the epilogue, from half outputs
    if paired and partial_output:
        raise ValueError("a tile of paired warps (GemmTile.pairs_warps) finishes then= from half outputs: pass "
                         "partial_output=False (or leave it unset)")
    if partial_output is None:  # a float32 `out` holds partials (activations, hence outputs, are halves)
        partial_output = (tile.split_k > 1 or (then is not None and not paired)
                          or (out is not None and out.dtype == torch.float32))
    if (tile.split_k > 1 or (then is not None and not paired)) and not partial_output:
        raise ValueError("split_k > 1 and then= on a decode tile produce float32 partials: pass partial_output=True "
                         "(or leave it unset)")
    if topk_weights is None:
        weights_flat = interop.stand_in(1.0, torch.float32, act.device)
    else:
        topk_weights = interop.check_tensor("topk_weights", topk_weights, dtype=torch.float32)
        if topk_weights.numel() != num_slots:
            raise ValueError(f"topk_weights must hold num_slots = {num_slots} weights, got shape {tuple(topk_weights.shape)}")
        weights_flat = topk_weights.reshape(-1)
    expected = (tile.split_k, num_slots, n) if partial_output else (num_slots, n)
    if out is not None or not paired:
        if out is None:
            out = interop.empty(expected, torch.float32 if partial_output else act.dtype)
        out = interop.check_tensor("out", out, dtype=torch.float32 if partial_output else act.dtype, shape=expected,
                                   alignment=4)
    if tile.a_in_shared:
        if not prefill_supported(weights.spec, n, k, half, tile):
            raise ValueError(f"tile.a_in_shared: {weights.spec.name} weights of shape {(n, k)} cannot be staged "
                             f"through shared memory (see fragments.staging_supported): use a decode tile")
        if not copy_offsets_fit(act.view(torch.int32) if pairs else act, *weights.tensors):
            raise ValueError("act and the weights must each hold fewer than 2**32 elements for a prefill tile "
                             "(a_in_shared: its copies use 32-bit offsets): use a decode tile or split the batch")
    if then is None:
        reduced, arrivals = interop.stand_in(0, act.dtype, act.device), interop.stand_in(0, torch.int32, act.device)
    else:
        if topk_weights is not None:
            raise ValueError("topk_weights multiplies the GEMM's output: with then=, pass the weights to FusedCombine")
        reduced, arrivals, combine_weights = check_fused(then, n=n, block_n=tile.block_n, blocks=expert_ids.shape[0],
                                                         num_slots=num_slots, half=act.dtype, counters=not paired)
        if combine_weights is not None:
            weights_flat = combine_weights.reshape(-1)
        if paired and not tile.swap_ab:
            reduced = reduced.view(torch.int32)  # pair stores
    kernel = make_grouped_gemm(weights.spec, n, k, tile, half, partial_output, topk_weights is not None, pairs,
                               None if then is None else then.kind, alignment_ready)
    grid = tile.grid(expert_ids.shape[0], n)
    if max(grid[1:]) > MAX_GRID_YZ:
        raise ValueError(f"{tile} needs a grid of {grid} CTAs: y and z may not exceed {MAX_GRID_YZ} "
                         f"(fewer token blocks: a larger block_m, or chunks_first=False)")
    if out is None:  # paired, nothing to write
        out_words = interop.stand_in(0, torch.int32, act.device)
    else:
        out_words = out.view(torch.int32) if stores_pairs(tile, n, partial_output) else out
    shared_bytes = stage_buffer_bytes(weights.spec, n, k, half, tile)
    args = (activation_array(act, pairs), weights.arrays(), interop.to_kernel(sorted_token_ids),
            interop.to_kernel(expert_ids), interop.to_kernel(num_tokens_post_padded), interop.to_kernel(weights_flat),
            interop.to_kernel(out_words), interop.to_kernel(reduced), interop.to_kernel(arrivals), np.int32(num_slots),
            np.int32(num_slots // act.shape[0]))
    early_ctas = (resident_ctas(kernel, tile.threads, shared_bytes, args + (np.int32(0),))
                  if loads_weights_early(tile, alignment_ready) else 0)
    launch_kernel(kernel, grid, tile.threads, *args, np.int32(early_ctas), waits=True, shared_bytes=shared_bytes)
    return then.out if out is None else out


def reference_grouped_gemm(act: np.ndarray, dense_weights: np.ndarray, sorted_token_ids, expert_ids,
                           num_tokens_post_padded: int, block_m: int, num_slots: int, topk_weights=None) -> np.ndarray:
    """float64 reference: `dense_weights` (E, N, K) dequantized; rows never written stay NaN."""
    rows_div = num_slots // act.shape[0]
    out = np.full((num_slots, dense_weights.shape[1]), np.nan)
    for block in range(int(num_tokens_post_padded) // block_m):
        expert = int(expert_ids[block])
        for slot in sorted_token_ids[block * block_m:(block + 1) * block_m]:
            if slot >= num_slots:
                continue
            if expert < 0:
                out[slot] = 0.0
                continue
            value = dense_weights[expert] @ np.asarray(act[slot // rows_div], np.float64)
            out[slot] = value * (1.0 if topk_weights is None else np.asarray(topk_weights).reshape(-1)[slot])
    return out
