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

The A operand (activations) comes from one of two places, a tile option:

* global memory (decode, `a_in_shared=False`): each lane loads its few A words straight
  from the (L1/L2-resident) activation rows; no barrier in the main loop, so every warp
  streams its weights independently;
* shared memory (prefill, `a_in_shared=True`): per stage of `warps_k * slabs_per_warp`
  slabs the CTA gathers the block's activations as half pairs (rows padded by 4 words so
  fragment reads hit 32 different banks) and every warp reuses them.

The first warp of each `warps_k` team writes the tile: half outputs (one K split) or
float32 partials (split_k, slots, N) that the next kernel sums in a fixed order
(deterministic, no atomics).

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
from .launch import launch_kernel
from .elements import logical_k
from .fragments import CHUNK_N, SLAB_K, fragment_reader
from .weights import KernelWeights


def _positive_power_of_two(instance, attribute, value):
    if not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{attribute.name} must be a positive power of two, got {value!r}")


@attrs.frozen
class GemmTile:
    """Tile configuration of the grouped GEMM (compile-time constants).

    block_m:        token slots per block (the alignment block size), a multiple of 16.
    warps_m:        warps along the slots; each owns block_m / warps_m rows (16 or more).
    warps_n:        warps along output features, 64 each.
    warps_k:        warps that split each stage's slabs and add up at the end.
    slabs_per_warp: slabs of 16 input features a warp takes per stage (loads in flight).
    split_k:        CTAs along K; above 1 the output is float32 partials per split.
    a_in_shared:    stage activations through shared memory (prefill) or read A fragments
                    from global memory (decode).
    """

    block_m: int = attrs.field(default=16, validator=_positive_power_of_two)
    warps_m: int = attrs.field(default=1, validator=_positive_power_of_two)
    warps_n: int = attrs.field(default=1, validator=_positive_power_of_two)
    warps_k: int = attrs.field(default=4, validator=_positive_power_of_two)
    slabs_per_warp: int = attrs.field(default=2, validator=_positive_power_of_two)
    split_k: int = attrs.field(default=1, validator=_positive_power_of_two)
    a_in_shared: bool = False

    def __attrs_post_init__(self):
        if self.block_m < 16 or self.block_m % (16 * self.warps_m):
            raise ValueError(f"block_m ({self.block_m}) must be a multiple of 16 * warps_m ({16 * self.warps_m})")
        if self.threads > 1024:
            raise ValueError(f"a tile of {self.threads} threads exceeds the 1024 a CTA may have")

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n * self.warps_k

    @property
    def block_n(self) -> int:
        return CHUNK_N * self.warps_n

    @property
    def stage_slabs(self) -> int:
        return self.warps_k * self.slabs_per_warp

    def grid(self, num_blocks: int, n: int) -> tuple[int, int, int]:
        return num_blocks, -(-n // self.block_n), self.split_k


@functools.cache
def make_grouped_gemm(spec: QuantSpec, n: int, k: int, tile: GemmTile, half: str, partial_output: bool,
                      mul_routed_weight: bool, pair_loads: bool = False, vector_a: bool = False):
    """The grouped GEMM for weights stored as `spec` (logical (n, k) per expert), `half`
    activations, `tile`; float32 partials or `half` outputs.

    The kernel takes activations as a 3-D (1, rows, cols) array: int32 half pairs
    (cols = K / 2) with `pair_loads`, else int16 halves (cols = K; odd K, or K sorted by
    act-order groups, which gathers each element). `vector_a` stages prefill activations
    with 16-byte loads (pairs, K a multiple of 8, rows 16-byte aligned)."""
    reader = fragment_reader(spec, n, k, half, prefetch_scales=not tile.a_in_shared)
    group_of_slab, column_params, fetch, decode = reader.group_of_slab, reader.column_params, reader.fetch, reader.decode
    output_scale, load_word = reader.output_scale, ptx.load_words[1]
    mma, to_half = ptx.mma(half), ptx.to_half(half)
    stored_k = logical_k(spec)
    block_m, threads, a_in_shared = tile.block_m, tile.threads, tile.a_in_shared
    warps_n, warps_k, depth, stage_slabs = tile.warps_n, tile.warps_k, tile.slabs_per_warp, tile.stage_slabs
    warp_rows = block_m // tile.warps_m
    m_tiles = warp_rows // 16
    teams = warps_n * tile.warps_m  # warps that own distinct output tiles
    total_slabs = -(-k // SLAB_K)
    slabs_per_split = -(-total_slabs // tile.split_k)
    if a_in_shared:  # splits start on stage boundaries
        slabs_per_split = -(-slabs_per_split // stage_slabs) * stage_slabs
    size_n, size_k = n, k
    n_chunks = -(-n // CHUNK_N)
    raw_words = reader.raw_words
    reduce_warps = max(warps_k - 1, 1)
    reduce_values = m_tiles * 8 * 4 * 32 if warps_k > 1 else 1  # accumulators of one warp
    # Prefill staging: a stage is stage_words half pairs per row, moved in units of
    # unit_words words (4: one 16-byte load) by every thread, through registers.
    stage_words = stage_slabs * SLAB_K // 2
    row_words = stage_words + 4  # padding: fragment reads of 8 rows x 4 words hit 32 banks
    unit_words = 4 if vector_a else 1
    units_per_row = stage_words // unit_words
    stage_units = block_m * units_per_row
    units_per_thread = -(-stage_units // threads) if a_in_shared else 1
    shared_rows = block_m if a_in_shared else 1
    # Decode reads A pairs with one flat load each: padding rows read row 0 instead (their
    # outputs are never stored, and an mma row depends on its own A row only).
    flat_a = pair_loads and size_k % SLAB_K == 0
    pairs_per_row = size_k // 2

    @ptx.device
    def activation_pair(act, k_order, expert, row, kp):
        """Half pair act[row, k(kp)], act[row, k(kp + 1)] (zero past K or for padding rows)."""
        pair = uint32(0)
        if row >= 0 and kp < size_k:
            if pair_loads:
                pair = uint32(act[0, row, kp // 2])
            else:
                pair = uint32(act[0, row, stored_k(k_order, expert, kp)]) & uint32(0xFFFF)
                if kp + 1 < size_k:
                    pair |= uint32(act[0, row, stored_k(k_order, expert, kp + 1)]) << uint32(16)
        return pair

    @ptx.device
    def multiply_slab(weights, expert, slab, chunk, lane, raw_slab, params, frags, group, a_words, acc):
        """acc += A(slab) @ B(slab); returns the scale group now in `params`."""
        slab_group = group_of_slab(weights, expert, slab)
        if slab_group != group:
            column_params(weights, expert, slab_group, chunk, lane, params)
        decode(raw_slab, params, weights, expert, slab, chunk, lane, frags)
        for mt in range(m_tiles):
            for nt in range(8):
                acc[mt, nt, 0], acc[mt, nt, 1], acc[mt, nt, 2], acc[mt, nt, 3] = mma(
                    a_words[mt, 0], a_words[mt, 1], a_words[mt, 2], a_words[mt, 3], frags[2 * nt], frags[2 * nt + 1],
                    acc[mt, nt, 0], acc[mt, nt, 1], acc[mt, nt, 2], acc[mt, nt, 3])
        return slab_group

    # -- decode: A words fetched with the weights, straight from global memory -------------------

    @ptx.device
    def a_word(act, weights, expert, row, kp):
        if flat_a:
            return load_word(act, int64(row) * pairs_per_row + (uint32(kp) >> uint32(1)))
        return activation_pair(act, weights[4], expert, row, kp)

    @ptx.device
    def fetch_batch(act, weights, expert, first_slab, end_slab, chunk, lane, rows, raw, a_raw):
        """Issue the loads of `depth` slabs (first_slab + d * warps_k): weight and A words."""
        t = lane % 4
        for d in range(depth):
            slab = first_slab + d * warps_k
            if slab < end_slab:
                fetch(weights, expert, slab, chunk, lane, raw[d])
                kp = slab * SLAB_K + 2 * t
                for mt in range(m_tiles):
                    a_raw[d, mt, 0] = a_word(act, weights, expert, rows[mt, 0], kp)
                    a_raw[d, mt, 1] = a_word(act, weights, expert, rows[mt, 1], kp)
                    a_raw[d, mt, 2] = a_word(act, weights, expert, rows[mt, 0], kp + 8)
                    a_raw[d, mt, 3] = a_word(act, weights, expert, rows[mt, 1], kp + 8)

    @ptx.device
    def multiply_batch(weights, expert, first_slab, end_slab, chunk, lane, raw, a_raw, params, frags, group, acc):
        for d in range(depth):
            slab = first_slab + d * warps_k
            if slab < end_slab:
                group = multiply_slab(weights, expert, slab, chunk, lane, raw[d], params, frags, group, a_raw[d], acc)
        return group

    # -- prefill: activations staged through shared memory, double-buffered ---------------------

    @ptx.device
    def fetch_stage_weights(weights, expert, stage_start, end_slab, warp_k, chunk, lane, raw):
        for d in range(depth):
            slab = stage_start + warp_k * depth + d
            if slab < end_slab:
                fetch(weights, expert, slab, chunk, lane, raw[d])

    @ptx.device
    def load_stage(act, weights, expert, stage_start, slots, num_slots, rows_div, a_regs):
        """This thread's share of a stage's activations, into registers (global loads only)."""
        for u in range(units_per_thread):
            unit = cuda.threadIdx.x + u * threads
            if unit < stage_units:
                m, c = unit // units_per_row, unit % units_per_row
                row = int32(-1)
                if slots[m] < num_slots:
                    row = slots[m] // rows_div
                kp = stage_start * SLAB_K + 2 * c * unit_words
                if vector_a:
                    if row >= 0 and kp < size_k:
                        a_regs[u, 0], a_regs[u, 1], a_regs[u, 2], a_regs[u, 3] = ptx.load_u32x4(act, 0, row, kp // 2)
                    else:
                        for w in range(unit_words):
                            a_regs[u, w] = uint32(0)
                else:
                    a_regs[u, 0] = activation_pair(act, weights[4], expert, row, kp)

    @ptx.device
    def store_stage(a_regs, a_tile):
        for u in range(units_per_thread):
            unit = cuda.threadIdx.x + u * threads
            if unit < stage_units:
                m, c = unit // units_per_row, unit % units_per_row
                for w in range(unit_words):
                    a_tile[m, c * unit_words + w] = a_regs[u, w]

    @ptx.device
    def shared_a_slabs(weights, expert, stage_start, end_slab, warp_k, first_row, chunk, lane, raw, params, frags,
                       group, a_tile, a_words, acc):
        g, t = lane // 4, lane % 4
        for d in range(depth):
            local_slab = warp_k * depth + d
            slab = stage_start + local_slab
            if slab < end_slab:
                column = local_slab * 8 + t
                for mt in range(m_tiles):
                    row = first_row + 16 * mt + g
                    a_words[mt, 0], a_words[mt, 1] = a_tile[row, column], a_tile[row + 8, column]
                    a_words[mt, 2], a_words[mt, 3] = a_tile[row, column + 4], a_tile[row + 8, column + 4]
                group = multiply_slab(weights, expert, slab, chunk, lane, raw[d], params, frags, group, a_words, acc)
        return group

    @ptx.device
    def prefill_step(act, weights, expert, stage, end_slab, weight_end, warp_k, first_row, chunk, lane, slots,
                     num_slots, rows_div, raw_now, raw_next, tile_now, tile_next, a_regs, params, frags, group,
                     a_words, acc):
        """Multiply `stage` (weights in raw_now, activations in tile_now) while the next
        stage's loads are in flight (into raw_next and registers), then store those
        activations to tile_next. Two buffers of each, swapped by the caller."""
        following = stage + stage_slabs
        more = following < end_slab
        if more:
            load_stage(act, weights, expert, following, slots, num_slots, rows_div, a_regs)
            fetch_stage_weights(weights, expert, following, weight_end, warp_k, chunk, lane, raw_next)
        group = shared_a_slabs(weights, expert, stage, weight_end, warp_k, first_row, chunk, lane, raw_now, params,
                               frags, group, tile_now, a_words, acc)
        if more:
            store_stage(a_regs, tile_next)
        cuda.syncthreads()
        return group

    @ptx.kernel
    def grouped_gemm(act, weights, sorted_ids, expert_ids, num_post_padded, topk_weights, out, num_slots, rows_div):
        block = cuda.blockIdx.x
        if block * block_m >= num_post_padded[0]:
            return
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        wk = warp % warps_k
        wn = (warp // warps_k) % warps_n
        wm = warp // (warps_k * warps_n)
        first_row = wm * warp_rows
        chunk = cuda.blockIdx.y * warps_n + wn
        split = cuda.blockIdx.z
        expert = expert_ids[block]

        slots = cuda.shared.array(block_m, int32)
        for i in range(tid, block_m, threads):
            position = block * block_m + i
            slot = num_slots
            if position < sorted_ids.shape[0]:
                slot = sorted_ids[position]
            slots[i] = slot
        cuda.syncthreads()

        acc = cuda.local.array((m_tiles, 8, 4), float32)
        for mt in range(m_tiles):
            for nt in range(8):
                for c in range(4):
                    acc[mt, nt, c] = float32(0.0)

        start_slab = split * slabs_per_split
        end_slab = min(start_slab + slabs_per_split, total_slabs)
        # Warps past the last column chunk (N < warps_n chunks) still stage activations.
        weight_end = end_slab if chunk < n_chunks else start_slab
        if expert >= 0 and start_slab < end_slab:
            raw_a = cuda.local.array((depth, raw_words), uint32)
            raw_b = cuda.local.array((depth, raw_words), uint32)
            params = cuda.local.array(16, uint32)
            frags = cuda.local.array(16, uint32)
            group = int32(-1)
            if a_in_shared:
                a_tiles = cuda.shared.array((2, shared_rows, row_words), uint32)
                a_regs = cuda.local.array((units_per_thread, unit_words), uint32)
                a_words = cuda.local.array((m_tiles, 4), uint32)
                stage_a = start_slab
                load_stage(act, weights, expert, stage_a, slots, num_slots, rows_div, a_regs)
                fetch_stage_weights(weights, expert, stage_a, weight_end, wk, chunk, lane, raw_a)
                store_stage(a_regs, a_tiles[0])
                cuda.syncthreads()
                while stage_a < end_slab:
                    group = prefill_step(act, weights, expert, stage_a, end_slab, weight_end, wk, first_row, chunk,
                                         lane, slots, num_slots, rows_div, raw_a, raw_b, a_tiles[0], a_tiles[1],
                                         a_regs, params, frags, group, a_words, acc)
                    stage_b = stage_a + stage_slabs
                    if stage_b >= end_slab:
                        break
                    group = prefill_step(act, weights, expert, stage_b, end_slab, weight_end, wk, first_row, chunk,
                                         lane, slots, num_slots, rows_div, raw_b, raw_a, a_tiles[1], a_tiles[0],
                                         a_regs, params, frags, group, a_words, acc)
                    stage_a = stage_b + stage_slabs
            else:
                rows = cuda.local.array((m_tiles, 2), int32)
                for mt in range(m_tiles):
                    for half_rows in range(2):
                        slot = slots[first_row + 16 * mt + g + 8 * half_rows]
                        rows[mt, half_rows] = slot // rows_div if slot < num_slots else (0 if flat_a else -1)
                a_raw_a = cuda.local.array((depth, m_tiles, 4), uint32)
                a_raw_b = cuda.local.array((depth, m_tiles, 4), uint32)
                step = warps_k * depth
                slab_a = start_slab + wk
                fetch_batch(act, weights, expert, slab_a, weight_end, chunk, lane, rows, raw_a, a_raw_a)
                while slab_a < weight_end:
                    slab_b = slab_a + step
                    fetch_batch(act, weights, expert, slab_b, weight_end, chunk, lane, rows, raw_b, a_raw_b)
                    group = multiply_batch(weights, expert, slab_a, weight_end, chunk, lane, raw_a, a_raw_a, params,
                                           frags, group, acc)
                    slab_a = slab_b + step
                    fetch_batch(act, weights, expert, slab_a, weight_end, chunk, lane, rows, raw_a, a_raw_a)
                    group = multiply_batch(weights, expert, slab_b, weight_end, chunk, lane, raw_b, a_raw_b, params,
                                           frags, group, acc)

        if warps_k > 1:
            partial = cuda.shared.array((reduce_warps, teams, reduce_values), float32)
            team = warp // warps_k
            if wk > 0:
                for mt in range(m_tiles):
                    for nt in range(8):
                        for c in range(4):
                            partial[wk - 1, team, ((mt * 8 + nt) * 4 + c) * 32 + lane] = acc[mt, nt, c]
            cuda.syncthreads()
            if wk == 0:
                for other in range(warps_k - 1):
                    for mt in range(m_tiles):
                        for nt in range(8):
                            for c in range(4):
                                acc[mt, nt, c] += partial[other, team, ((mt * 8 + nt) * 4 + c) * 32 + lane]

        if wk == 0:
            multiplier = output_scale(weights, expert) if expert >= 0 else float32(0.0)
            for mt in range(m_tiles):
                for half_rows in range(2):
                    slot = slots[first_row + 16 * mt + g + 8 * half_rows]
                    if slot < num_slots:
                        weight = multiplier
                        if mul_routed_weight:
                            weight *= topk_weights[slot]
                        for nt in range(8):
                            for c in range(2):
                                col = chunk * CHUNK_N + 8 * nt + 2 * t + c
                                if col < size_n:
                                    value = acc[mt, nt, 2 * half_rows + c] * weight
                                    if partial_output:
                                        out[split, slot, col] = value
                                    else:
                                        out[slot, col] = int16(to_half(value))

    return grouped_gemm


def activation_loads(k: int, spec: QuantSpec, tile: GemmTile, aligned: bool = True) -> tuple[bool, bool]:
    """(pair_loads, vector_a) for activations of K = `k` whose storage is 16-byte `aligned`:
    how the kernel may read them (see make_grouped_gemm)."""
    pair_loads = k % 2 == 0 and not spec.sort_k_by_group
    return pair_loads, tile.a_in_shared and pair_loads and k % 8 == 0 and aligned


def activation_array(act: torch.Tensor, pair_loads: bool):
    """The kernel's 3-D view of `act`: (1, rows, K / 2) int32 pairs or (1, rows, K) halves."""
    view = act.view(torch.int32) if pair_loads else act
    return interop.to_kernel(view.unsqueeze(0))


def grouped_gemm(act, weights: KernelWeights, sorted_token_ids, expert_ids, num_tokens_post_padded, *,
                 num_slots: int, tile: GemmTile = GemmTile(), topk_weights=None, out=None,
                 partial_output: bool | None = None) -> torch.Tensor:
    """One grouped GEMM over aligned token blocks.

    act:                     (M, K) per token (gemm1) or (num_slots, K) per slot (gemm2),
                             bfloat16 or float16.
    weights:                 the experts' weights (E, N, K) in any spec.
    sorted_token_ids, expert_ids, num_tokens_post_padded: `moe_align_block_size` output for
                             block size tile.block_m (int32).
    num_slots:               M * top_k; slot ids at or above it are padding.
    topk_weights:            (M, top_k) float32 to multiply each slot's output by, or None.
    out / partial_output:    the output, (num_slots, N) in act's dtype, or with
                             partial_output (forced when tile.split_k > 1) float32
                             (split_k, num_slots, N) partial sums over K.
    """
    act = interop.check_tensor("act", act, dtype=(torch.bfloat16, torch.float16), ndim=2)
    half = interop.HALF_NAMES[act.dtype]
    experts, n, k = weights.shape
    if act.shape[1] != k:
        raise ValueError(f"act must have K = {k} columns (the weights' input features), got {tuple(act.shape)}")
    if num_slots < 1 or num_slots % act.shape[0]:
        raise ValueError(f"num_slots ({num_slots}) must be a positive multiple of act's rows ({act.shape[0]})")
    sorted_token_ids = interop.check_tensor("sorted_token_ids", sorted_token_ids, dtype=torch.int32, ndim=1)
    expert_ids = interop.check_tensor("expert_ids", expert_ids, dtype=torch.int32, ndim=1)
    num_tokens_post_padded = interop.check_tensor("num_tokens_post_padded", num_tokens_post_padded,
                                                  dtype=torch.int32, shape=(1,))
    if expert_ids.shape[0] != -(-sorted_token_ids.shape[0] // tile.block_m):
        raise ValueError(f"expert_ids ({expert_ids.shape[0]} blocks) must split sorted_token_ids "
                         f"({sorted_token_ids.shape[0]}) in blocks of {tile.block_m}: align with block_size = block_m")
    partial_output = tile.split_k > 1 if partial_output is None else partial_output
    if tile.split_k > 1 and not partial_output:
        raise ValueError("split_k > 1 produces float32 partials: pass partial_output=True (or leave it unset)")
    if topk_weights is None:
        weights_flat = interop.stand_in(1.0, torch.float32, act.device)
    else:
        topk_weights = interop.check_tensor("topk_weights", topk_weights, dtype=torch.float32)
        if topk_weights.numel() != num_slots:
            raise ValueError(f"topk_weights must hold num_slots = {num_slots} weights, got shape {tuple(topk_weights.shape)}")
        weights_flat = topk_weights.reshape(-1)
    expected = (tile.split_k, num_slots, n) if partial_output else (num_slots, n)
    if out is None:
        out = interop.empty(expected, torch.float32 if partial_output else act.dtype)
    out = interop.check_tensor("out", out, dtype=torch.float32 if partial_output else act.dtype, shape=expected)
    pair_loads, vector_a = activation_loads(k, weights.spec, tile, act.data_ptr() % 16 == 0)
    kernel = make_grouped_gemm(weights.spec, n, k, tile, half, partial_output, topk_weights is not None,
                               pair_loads, vector_a)
    grid = tile.grid(expert_ids.shape[0], n)
    launch_kernel(
        kernel, grid, tile.threads,
        activation_array(act, pair_loads), weights.arrays(), interop.to_kernel(sorted_token_ids), interop.to_kernel(expert_ids),
        interop.to_kernel(num_tokens_post_padded), interop.to_kernel(weights_flat), interop.to_kernel(out),
        np.int32(num_slots), np.int32(num_slots // act.shape[0]))
    return out


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
