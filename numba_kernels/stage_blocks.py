"""Stage blocks: each alignment block's activations stored stage by stage, in the order the
warp-specialised GEMM's wgmma reads them (`gemm_specialized`), so that one bulk copy fills
a stage of a block.

A block of the alignment holds up to block_m slots of one expert, in parts of up to
`SpecializedTile.max_width` slots (a CTA of the GEMM each); a part's *width* is its count
rounded up to the tile's width step (wgmma's N). A stage (64 of K) of a part at width w
is 8 w pieces of 16 bytes: for each slab of 16 of K, each 8 slots, each half of the
slab's K, 8 slots x 8 halves (wgmma's K-major core matrices). Stages sit part by part,
step by step, `SpecializedTile.block_words()` apart; slots from the count to w are zeros,
so the GEMM's extra columns compute zeros.

* `gather_blocks`: gemm1's input, the hidden state of each slot's token, gathered; it
  also writes each part's width index (`picks`, -1 for a part without slots), which
  both GEMMs and `activate_blocks` read;
* `activate_blocks`: gemm2's input, the activation of gemm1's output (blocked: a row a
  slot of each block), computed as `activation.activate` computes it.
"""

from __future__ import annotations

import functools

import torch
from numba import cuda, int32, uint32

from . import interop, ptx
from .activation import Activation, _pointwise
from .align import check_alignment_arrays
from .fragments import copy_offsets_fit
from .gemm_specialized import STEP_K, SpecializedTile, check_picks, check_stage_blocks
from .launch import launch_kernel

# 16-byte loads and stores: a piece a thread, the pieces of a warp's lanes one run of the
# stage blocks (a kernel calls the helpers themselves, not the dict they live in).
load4, store4, byte_perm = ptx.load_written[4], ptx.store_words4, ptx.byte_perm
# byte_perm selectors: the low halves of two words as one word, and the high halves
GATES, UPS = uint32(0x5410), uint32(0x7632)


@ptx.device
def piece_of(p, width):
    """(slot, K within the stage) of the 16-byte piece `p` of a stage at `width`."""
    groups, rest = width // uint32(8), p // uint32(16)
    slot = (rest % groups) * uint32(8) + p % uint32(8)
    return slot, (rest // groups) * uint32(16) + (p // uint32(8)) % uint32(2) * uint32(8)


@ptx.device
def piece_at(slot, kk, width):
    """The piece of a stage at `width` that holds K `kk` (a multiple of 8) of `slot`:
    `piece_of`'s inverse."""
    slab, half = kk // uint32(16), kk // uint32(8) % uint32(2)
    return (slab * (width // uint32(8)) + slot // uint32(8)) * uint32(16) + half * uint32(8) + slot % uint32(8)


@functools.cache
def make_gather_kernel(tile: SpecializedTile, k: int, divisor: int):
    """kernel(source, rows, expert_ids, num_post_padded, num_slots, picks, blocks), grid
    (blocks x tile.sub_blocks, k / 64), block_m threads: `source` (tokens, k / 2) int32
    words of halves, slot id s reading row s // divisor."""
    block_m, max_width, sub_blocks = tile.block_m, tile.max_width, tile.sub_blocks
    step, steps, block_words = tile.width_step, k // STEP_K, tile.block_words()

    @ptx.kernel
    def gather(source, rows, expert_ids, num_post_padded, num_slots, picks, blocks):
        part, stage, t = uint32(cuda.blockIdx.x), uint32(cuda.blockIdx.y), uint32(cuda.threadIdx.x)
        block, skipped = part // uint32(sub_blocks), part % uint32(sub_blocks) * uint32(max_width)
        ids = cuda.shared.array(block_m, uint32)
        first = block * uint32(block_m)
        slot = uint32(num_slots)
        if first < uint32(num_post_padded[0]) and expert_ids[block] >= 0:
            slot = uint32(rows[first + t])
        ids[t] = slot
        count = uint32(cuda.syncthreads_count(int32(slot < uint32(num_slots))))  # the block's, then the part's
        count = min(count - min(count, skipped), uint32(max_width))
        pick = int32((count + uint32(step - 1)) // uint32(step)) - 1
        if stage == uint32(0) and t == uint32(0):
            picks[part] = pick
        width = uint32(pick + 1) * uint32(step)
        base = (part * uint32(steps) + stage) * uint32(block_words)
        # In piece order a warp's stores are one 512-byte run, and its loads mostly hit the L2
        # (each token's row is read top_k times); the activation's row order was slower here
        # (DeepSeek M = 4096: 200 -> 244 us).
        for p in range(t, uint32(8) * width, uint32(block_m)):
            s, kk = piece_of(uint32(p), width)
            w0 = w1 = w2 = w3 = uint32(0)
            if s < count:
                row = ids[skipped + s] // uint32(divisor)
                w0, w1, w2, w3 = load4(source, row * uint32(k // 2) + (stage * uint32(STEP_K) + kk) // uint32(2))
            store4(blocks, base + uint32(4) * uint32(p), w0, w1, w2, w3)

    return gather


@functools.cache
def make_activate_kernel(tile: SpecializedTile, width_in: int, activation: Activation, half: str):
    """kernel(gate_up, picks, blocks), grid (blocks x tile.sub_blocks x I / 64), block_m
    threads: `gate_up` (blocks x block_m, width_in / 2) int32 words of gemm1's halves."""
    block_m, max_width, sub_blocks = tile.block_m, tile.max_width, tile.sub_blocks
    step, block_words = tile.width_step, tile.block_words()
    intermediate = activation.output_width(width_in)
    steps = intermediate // STEP_K
    apply, to_f32, pack2 = _pointwise(activation), ptx.half_to_f32(half), ptx.pack2(half)
    gated, interleaved = activation.gated, activation.interleaved

    @ptx.device
    def halves(word):
        return to_f32(word), to_f32(uint32(word) >> uint32(16))

    @ptx.device
    def output_word(gate, up):
        """The activation of two features as a word, from the word of their two gate halves
        and that of their two up halves."""
        gate0, gate1 = halves(gate)
        up0, up1 = halves(up)
        return pack2(apply(gate0, up0), apply(gate1, up1))

    @ptx.device
    def output_words(gate_up, row, feature):
        """The activation of features `feature` to + 7 (a multiple of 8) of one row, as four
        words, from 16-byte loads."""
        at = row * uint32(width_in // 2)
        if interleaved:  # a word a feature, (gate, up): each pair's two gates and two ups regrouped
            a0, a1, a2, a3 = load4(gate_up, at + feature)
            b0, b1, b2, b3 = load4(gate_up, at + feature + uint32(4))
            return (output_word(byte_perm(a0, a1, GATES), byte_perm(a0, a1, UPS)),
                    output_word(byte_perm(a2, a3, GATES), byte_perm(a2, a3, UPS)),
                    output_word(byte_perm(b0, b1, GATES), byte_perm(b0, b1, UPS)),
                    output_word(byte_perm(b2, b3, GATES), byte_perm(b2, b3, UPS)))
        g0, g1, g2, g3 = load4(gate_up, at + feature // uint32(2))
        u0, u1, u2, u3 = g0, g1, g2, g3  # an activation without a gate reads no up half
        if gated:
            u0, u1, u2, u3 = load4(gate_up, at + uint32(intermediate // 2) + feature // uint32(2))
        return output_word(g0, u0), output_word(g1, u1), output_word(g2, u2), output_word(g3, u3)

    @ptx.kernel
    def activate(gate_up, picks, blocks):
        # Stages vary fastest over the grid, so that CTAs running together read neighbouring
        # lines of the same rows; within a CTA, thread u reads K 8 (u % 8) of slot u // 8, so
        # a warp reads whole 128-byte lines of four rows (and stores four slots' pieces, 64
        # bytes, together).
        stage, part = uint32(cuda.blockIdx.x) % uint32(steps), uint32(cuda.blockIdx.x) // uint32(steps)
        t = uint32(cuda.threadIdx.x)
        pick = picks[part]
        if pick < 0:
            return
        width = uint32(pick + 1) * uint32(step)
        first_row = part // uint32(sub_blocks) * uint32(block_m) + part % uint32(sub_blocks) * uint32(max_width)
        base = (part * uint32(steps) + stage) * uint32(block_words)
        for u in range(t, uint32(8) * width, uint32(block_m)):
            s, kk = uint32(u) // uint32(8), uint32(u) % uint32(8) * uint32(8)
            w0, w1, w2, w3 = output_words(gate_up, first_row + s, stage * uint32(STEP_K) + kk)
            store4(blocks, base + uint32(4) * piece_at(s, kk, width), w0, w1, w2, w3)

    return activate


def check_offsets(**words) -> None:
    """The kernels address these int32 arrays by 32-bit element offsets: each must fit."""
    too_large = [name for name, array in words.items() if not copy_offsets_fit(array)]
    if too_large:
        raise ValueError(f"{' and '.join(too_large)} must each hold fewer than 2**32 32-bit words (the stage-block "
                         f"kernels use 32-bit offsets): split the batch")


def gather_blocks(source, alignment: tuple, num_slots: int, divisor: int, tile: SpecializedTile, picks,
                  blocks) -> None:
    """Stage blocks of `source` (tokens, K) halves for the alignment (sorted_token_ids,
    expert_ids, num_tokens_post_padded; blocks of tile.block_m) into `blocks` (int32),
    slot s reading row s // divisor (num_slots = tokens x divisor), and each part's width
    index into `picks` (int32, `tile.sub_blocks` a block of expert_ids)."""
    if not isinstance(tile, SpecializedTile):
        raise TypeError(f"tile must be a SpecializedTile, got {type(tile).__name__}")
    source = interop.check_tensor("source", source, dtype=tuple(interop.HALF_NAMES), ndim=2, alignment=16)
    tokens, k = source.shape
    interop.check_count("divisor", divisor, 1)
    if k % STEP_K or num_slots != tokens * divisor:
        raise ValueError(f"source must be (tokens, K) with K a multiple of {STEP_K} and tokens x divisor = num_slots, "
                         f"got {tuple(source.shape)}, divisor {divisor} and num_slots {num_slots}")
    sorted_ids, expert_ids, post_padded = check_alignment_arrays(*alignment, tile.block_m)
    picks = check_picks(picks, expert_ids.shape[0], tile)
    blocks = check_stage_blocks("blocks", blocks, picks.shape[0], k, tile)
    check_offsets(source=source.view(torch.int32), blocks=blocks)
    kernel = make_gather_kernel(tile, k, divisor)
    launch_kernel(kernel, (picks.shape[0], k // STEP_K), tile.block_m, interop.to_kernel(source.view(torch.int32)),
                  interop.to_kernel(sorted_ids), interop.to_kernel(expert_ids), interop.to_kernel(post_padded),
                  num_slots, interop.to_kernel(picks), interop.to_kernel(blocks))


def activate_blocks(gate_up, activation: Activation, tile: SpecializedTile, picks, blocks) -> None:
    """Stage blocks of activation(gate_up) for gemm2: `gate_up` gemm1's blocked output
    (blocks x block_m, 2I or I) halves, `picks` as `gather_blocks` wrote them."""
    if not isinstance(tile, SpecializedTile):
        raise TypeError(f"tile must be a SpecializedTile, got {type(tile).__name__}")
    if not isinstance(activation, Activation):
        raise TypeError(f"activation must be an Activation, got {type(activation).__name__}")
    gate_up = interop.check_tensor("gate_up", gate_up, dtype=tuple(interop.HALF_NAMES), ndim=2, alignment=16)
    rows, width_in = gate_up.shape
    k = activation.output_width(width_in)
    if rows % tile.block_m or k % STEP_K or (activation.gated and width_in % 2):
        raise ValueError(f"gate_up must be (blocks x {tile.block_m}, width) with the activation's {k} outputs a "
                         f"multiple of {STEP_K}, got {tuple(gate_up.shape)}")
    picks = check_picks(picks, rows // tile.block_m, tile)
    blocks = check_stage_blocks("blocks", blocks, picks.shape[0], k, tile)
    check_offsets(gate_up=gate_up.view(torch.int32), blocks=blocks)
    kernel = make_activate_kernel(tile, width_in, activation, interop.HALF_NAMES[gate_up.dtype])
    launch_kernel(kernel, picks.shape[0] * (k // STEP_K), tile.block_m, interop.to_kernel(gate_up.view(torch.int32)),
                  interop.to_kernel(picks), interop.to_kernel(blocks))
