"""The warp-specialised grouped GEMM (Hopper): an expert's weights decoded once for all its slots.

At tens of slots an expert (Mixtral at M = 256: 49 to 74) the prefill tiles of `gemm` are
latency-bound: each warp decodes its weights and then feeds them to `mma.sync`, and the
whole CTA waits at a barrier a stage (Nsight Compute, fifty-fifth session of
`benchmarks/LOG.md`). Here copying, decoding and multiplying overlap in different warps:

* a CTA computes one column panel of the native layout (two 64-feature chunks,
  `formats.NATIVE_PANEL`) for one part of a block of the alignment (up to
  `SpecializedTile.max_width` slots of one expert), at the *width* its slots need
  (their count rounded up to `width_step`: wgmma's N), so an expert of up to
  max_width slots is decoded once;
* a *copy warp* (warp 8) brings each stage (64 of K) in with bulk copies from one
  thread, counted on the stage's mbarrier: the weights' codes, scales and zero points,
  a run each (`StagedWeights.copy_panel`), and the part's activations, which
  `stage_blocks` stored stage by stage in the order wgmma reads them (one copy);
* two *multiplying* warpgroups, a chunk each: warp w of warpgroup c decodes n16 group w
  of chunk c (`StagedWeights.fetch_group`, `FragmentReader.decode_group`) straight into
  the four A registers wgmma takes from it (m64nWk16, A in registers, the activations
  in shared memory), a slab a wgmma group, decoding the next slab while one multiplies;
* each warpgroup releases a stage on a named barrier once its wgmma are done, and the
  copy warp refills the stage when both have: no barrier of the whole CTA in the loop.

The decoded weights never pass through shared memory. In the first form of this kernel
four producer warps stored them there for one multiplying warpgroup, and shared memory
was its limit (570 wavefronts a stage against 320 cycles of tensor work, 256 of them the
decoded weights stored and read back; seventy-third session): A in registers took Mixtral
M = 256's two GEMMs from 604 to 447 us (w4a16) and from 659 to 461 us (NVFP4) on the
H200 (seventy-fourth session). A warp reads its group's code word of each lane's 16
bytes (four wavefronts a warp, as many as the whole 16 bytes).

The epilogue stores the outputs as halves, a row per slot: `blocked`, row block *
block_m + the slot's place in its block (gemm1, whose output
`stage_blocks.activate_blocks` turns into gemm2's stage blocks), or scattered to the
slot's id in the alignment (gemm2, for the combine; the padding's sentinel id names a
spare last row). Each warp stages its tile of outputs in the ring, free once the main
loop is done, and writes it back in 16-byte stores along the rows (`_epilogue`).
"""

from __future__ import annotations

import functools
import itertools

import attrs
import torch
from numba import cuda, float32, uint32

from . import interop, ptx
from .fragments import CHUNK_N, SLAB_K, bulk_staging_supported, fragment_reader, staged_weights
from .gemm_plan import chain
from .launch import launch_kernel
from .weights import KernelWeights

STAGE_SLABS = 4  # slabs of 16 of K a pipeline stage
STEP_K = STAGE_SLABS * SLAB_K
CHUNKS = 2  # 64-feature chunks a CTA: one column panel of the native layout, a warpgroup each
WARPGROUP = 128  # threads
MULTIPLIERS = CHUNKS * WARPGROUP  # the multiplying warpgroups' threads; the copy warp follows
MAX_WIDTH = max(ptx.WARPGROUP_COLUMNS)  # wgmma's widest N
CORE_LBO, CORE_SBO = 128, 256  # bytes: the next 8 of K, the next 8 slots of B's core matrices


@attrs.frozen
class SpecializedTile:
    """The warp-specialised GEMM's configuration: alignment blocks of `block_m` slots,
    each cut into `sub_blocks` parts of at most `max_width` slots (a CTA each: an expert's
    weights are decoded once a part), wgmma widths in steps of `width_step` up to
    max_width, and a ring of `stages` stages of 64 of K."""

    block_m: int = 128
    max_width: int = 80
    width_step: int = 16
    stages: int = 4

    def __attrs_post_init__(self):
        if (self.width_step % 8 or not 8 <= self.width_step <= self.max_width or self.max_width % self.width_step
                or not self.max_width <= self.block_m <= MAX_WIDTH or not 2 <= self.stages <= 7):
            raise ValueError(f"width_step must be a multiple of 8 dividing max_width <= block_m <= {MAX_WIDTH}, and "
                             f"stages in [2, 7], got block_m={self.block_m}, max_width={self.max_width}, "
                             f"width_step={self.width_step}, stages={self.stages}")

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(range(self.width_step, self.max_width + 1, self.width_step))

    @property
    def min_ctas_per_sm(self) -> int:
        """The kernel's launch bound: CTAs a multiprocessor must hold, which caps the
        registers ptxas may give a thread. Two up to 80 slots wide: ptxas then keeps to 96,
        enough at 80 (74 w4a16, 79 NVFP4; zero points 96 and 172 bytes spilled). One
        beyond: at 128 wide and a bound of two it serialised every wgmma; with one it
        takes 98 (w4a16) and 110 (NVFP4) and pipelines them (seventy-fifth session of
        benchmarks/LOG.md). Whatever the bound, nine warps put three on one of an SM's
        four schedulers, so a thread gets at most 168: enough at 256 wide for w4a16 (162)
        and NVFP4 (168); zero points reach it from 128 wide up, and spill (at 128, 276
        bytes, after the main loop; seventy-sixth session). Zero points at 80 wide with a
        bound of one take 136 and spill nothing, but Mixtral M = 256 and Qwen3 M = 1024
        ran 13 % and 18 % slower (eighty-seventh session). How many CTAs the GPU then
        places is its own count."""
        return 2 if self.max_width <= 80 else 1

    @property
    def sub_blocks(self) -> int:
        return -(-self.block_m // self.max_width)

    def block_words(self) -> int:
        """int32 words of a stage of a part's activations, at the widest width."""
        return STAGE_SLABS * self.max_width * 8

    def stage_words(self, parts: int, k: int) -> int:
        """int32 words of the stage blocks of `parts` parts over K = k (`stage_blocks`)."""
        return parts * (k // STEP_K) * self.block_words()


def specialized_supported(spec, n: int, k: int, half: str) -> bool:
    """Whether weights `spec` of shape (n, k) an expert can run on the warp-specialised
    GEMM: bulk-staged in whole stages, a CTA's two chunks one column panel (the native
    layout; `copy_panel`) and N in whole panels, a warp's n16 group fetched alone
    (`fetch_group_scales`)."""
    if n % (CHUNKS * CHUNK_N) or not bulk_staging_supported(spec, n, k, half, CHUNKS, STAGE_SLABS):
        return False
    staged = staged_weights(spec, n, k, half, CHUNKS, STAGE_SLABS, 64 * CHUNKS)
    return staged.copy_panel is not None and staged.fetch_group_scales is not None


@functools.cache
def make_specialized_kernel(spec, n: int, k: int, half: str, tile: SpecializedTile, blocked: bool):
    """(kernel(act, weights, picks, expert_ids, rows, out), shared words, threads) for
    weights `spec` of shape (n, k) an expert: `act` the stage blocks (`stage_blocks`),
    `picks` each part's width index in `tile.widths` (-1: no slots), `expert_ids` and
    `rows` (sorted_token_ids) the alignment's, `out` the output halves as int32 words (a
    row of n / 2 words, 16-byte aligned); grid (n / 128, blocks x tile.sub_blocks)."""
    if not specialized_supported(spec, n, k, half):
        raise ValueError(f"{spec.name} at (n={n}, k={k}) cannot run on the warp-specialised GEMM: the native layout "
                         f"in column panels of {CHUNKS * CHUNK_N}, K in stages of {STEP_K} expected")
    widths, stages, block_m = tile.widths, tile.stages, tile.block_m
    max_width, sub_blocks = tile.max_width, tile.sub_blocks
    threads, steps = MULTIPLIERS + 32, k // STEP_K
    staged = staged_weights(spec, n, k, half, CHUNKS, STAGE_SLABS, 64 * CHUNKS)
    reader = fragment_reader(spec, n, k, half)
    fetch_group, fetch_scales, decode_group = staged.fetch_group, staged.fetch_group_scales, reader.decode_group
    scale_slabs = staged.scale_slabs  # a scale row's slabs in a stage
    output_scale, raw_words = reader.output_scale, reader.raw_words
    w_words, b_words = staged.stage_words, tile.block_words()
    b_ring = stages * w_words
    row_table = b_ring + stages * b_words  # the block's output rows, a word a slot
    barriers = row_table + max_width
    regs = max(widths) // 2  # a thread's accumulators: its warpgroup's chunk
    frag_words = 8  # two slabs' A registers
    issue_stage = _stage_issuer(staged.copy_panel, steps, w_words, b_ring, b_words, barriers)
    wait_in_flight, wait_all = ptx.warpgroup_wait[1], ptx.warpgroup_wait[0]

    @functools.cache
    def slab_multiplier(s: int, width: int, last: bool):
        """Slab s of the stage in buffer b, a wgmma group of its own: the warp's n16 group
        of `chunk` decoded into four registers (wgmma's a0 .. a3 are those of (h, r) =
        (0, 0), (1, 0), (0, 1), (1, 1): h rows + 8, r K + 8), times B (its first `width`
        slots), then wait for all groups but this one (`last`: for all of them). So the
        warp decodes the next slab while this one multiplies, and only two slabs' A
        registers are live (a whole stage's in flight left ptxas short of registers: it
        serialised every wgmma, C7512)."""
        multiply, wait_mma = ptx.warpgroup_mma(half, width), wait_all if last else wait_in_flight

        @ptx.device
        def multiply_slab(shared, b, chunk, group, lane, raw, frags, acc):
            if s % scale_slabs == 0:
                fetch_scales(shared, b, uint32(s), chunk, lane, group, raw)
            fetch_group(shared, b, uint32(s), chunk, lane, group, raw)
            decode_group(raw, frags, 4 * (s % 2))
            ptx.warpgroup_fence()  # the A registers, written above
            multiply(frags[4 * (s % 2)], frags[4 * (s % 2) + 2], frags[4 * (s % 2) + 1], frags[4 * (s % 2) + 3],
                     shared, uint32(b_ring) + b * uint32(b_words) + uint32(s * width * 8), CORE_LBO, CORE_SBO, acc, 0)
            ptx.warpgroup_commit()
            wait_mma()

        return multiply_slab

    def multiplier_step(b: int, width: int, last: bool):
        """Step first + b (every step the caller runs exists): once its copies land,
        multiply its slabs at `width` (the last step waits for all groups at its end);
        after the first slab, release the step before, whose wgmma are then done (step 0
        releases a step -1 the copy warp waits for too: no branch between the wgmma)."""
        release = ptx.barrier_arrive(1 + (b - 1) % stages, threads)
        first_slab = slab_multiplier(0, width, False)
        other_slabs = functools.reduce(chain, [slab_multiplier(s, width, last and s == STAGE_SLABS - 1)
                                               for s in range(1, STAGE_SLABS)])

        @ptx.device
        def step(first, shared, acc, raw, frags, chunk, group, lane):
            i = first + uint32(b)
            ptx.mbarrier_wait(shared, uint32(barriers + 2 * b), (i // uint32(stages)) % uint32(2))
            first_slab(shared, uint32(b), chunk, group, lane, raw, frags, acc)
            release()
            other_slabs(shared, uint32(b), chunk, group, lane, raw, frags, acc)

        return step

    def copier_step(b: int):
        """Wait for the release of the step before first + b (the warpgroups release one a
        step), then refill its buffer with the step `stages` after it, if there is one."""
        released = ptx.barrier_sync(1 + (b - 1) % stages, threads)

        @ptx.device
        def step(first, act, weights, part, expert, first_chunk, width, lane, shared):
            i = first + uint32(b)
            if i < uint32(steps):
                released()
                if lane == uint32(0) and i >= uint32(1):
                    issue_stage(act, weights, i - uint32(1) + uint32(stages), uint32((b - 1) % stages), part, expert,
                                first_chunk, width, shared)

        return step

    zero_prefix, store_paths = _epilogue(max_width, row_table, n // 2, stages, ptx.pack2(half))
    assert 64 * max_width <= b_ring + stages * b_words  # the staged outputs fit in the ring

    def multiplier(index: int, width: int):
        """A warpgroup's whole part at widths[index], if that is the CTA's width: zero the
        width's accumulators, the main loop, store them. A path a width, so that no
        instruction but that width's wgmma defines its accumulators between them (one
        loop with a branch a stage made ptxas inject warpgroup arrives, C7519; zeroing and
        stores shared by the widths serialised the wgmma, C7515). The round of the last
        step comes after the loop, that step waiting for all groups: with that wait after
        the loop ptxas placed the stores' reads of the accumulators above it, and the
        outputs missed the last stage (seventy-second session of benchmarks/LOG.md)."""
        last_b = (steps - 1) % stages
        multiply_round = functools.reduce(chain, [multiplier_step(b, width, False) for b in range(stages)])
        last_round = functools.reduce(chain, [multiplier_step(b, width, b == last_b) for b in range(last_b + 1)])
        zero_accumulators, store_outputs = zero_prefix[width // 8 - 1], store_paths[width // 8 - 1]

        @ptx.device
        def run(width_index, shared, acc, raw, frags, weights, out, expert, warp, out_word, chunk, group, lane):
            if width_index == uint32(index):
                zero_accumulators(acc)
                first = uint32(0)
                while first < uint32(steps - 1 - last_b):
                    multiply_round(first, shared, acc, raw, frags, chunk, group, lane)
                    first += uint32(stages)
                last_round(first, shared, acc, raw, frags, chunk, group, lane)
                store_outputs(acc, output_scale(weights, expert), shared, out, warp, out_word, lane)

        return run

    copy_round = functools.reduce(chain, [copier_step(b) for b in range(stages)])
    multiply = functools.reduce(chain, [multiplier(i, width) for i, width in enumerate(widths)])

    @ptx.kernel(launch_bounds=(threads, tile.min_ctas_per_sm))
    def specialized(act, weights, picks, expert_ids, rows, out):
        shared = cuda.shared.array(0, uint32)
        tid, panel, part = uint32(cuda.threadIdx.x), uint32(cuda.blockIdx.x), uint32(cuda.blockIdx.y)
        pick = picks[part]
        if pick < 0:
            return
        block = part // uint32(sub_blocks)
        expert, width, width_index = uint32(expert_ids[block]), uint32(0), uint32(pick)
        for i in range(len(widths)):
            if width_index == uint32(i):
                width = uint32(widths[i])
        first_chunk = panel * uint32(CHUNKS)
        if tid == uint32(0):
            for b in range(stages):
                ptx.mbarrier_init(shared, uint32(barriers + 2 * b), 1)
        if tid < width:  # the part's slots' rows: in the block, or their slot ids
            place = block * uint32(block_m) + part % uint32(sub_blocks) * uint32(max_width) + tid
            shared[uint32(row_table) + tid] = place if blocked else uint32(rows[place])
        cuda.syncthreads()
        if tid >= uint32(MULTIPLIERS):
            lane = tid - uint32(MULTIPLIERS)
            if lane == uint32(0):
                for s in range(stages):
                    issue_stage(act, weights, uint32(s), uint32(s), part, expert, first_chunk, width, shared)
            first = uint32(0)
            while first < uint32(steps):
                copy_round(first, act, weights, part, expert, first_chunk, width, lane, shared)
                first += uint32(stages)
        else:
            acc = cuda.local.array(regs, float32)
            raw = cuda.local.array(raw_words, uint32)
            frags = cuda.local.array(frag_words, uint32)
            lane = tid % uint32(32)
            warp = tid // uint32(32)  # its 16 features of the panel: 8 words of an output row
            multiply(width_index, shared, acc, raw, frags, weights, out, expert, warp,
                     first_chunk * uint32(CHUNK_N // 2) + warp * uint32(8), tid // uint32(WARPGROUP), warp % uint32(4),
                     lane)

    return specialized, barriers + 2 * stages, threads


def _stage_issuer(copy_panel, steps: int, w_words: int, b_ring: int, b_words: int, barriers: int):
    """issue_stage(act, weights, step, buffer, part, expert, first_chunk, width, shared):
    one thread's bulk copies of `step` (none past the last) into ring buffer `buffer`: the
    weights' runs (`copy_panel`, at buffer x w_words), and the stage's activations (its
    slabs at `width` slots, at b_ring + buffer x b_words), counted on the buffer's mbarrier."""

    @ptx.device
    def issue_stage(act, weights, step, buffer, part, expert, first_chunk, width, shared):
        if step < uint32(steps):
            barrier = uint32(barriers) + uint32(2) * buffer
            ptx.mbarrier_expect_bytes(shared, barrier, uint32(4 * w_words) + uint32(STAGE_SLABS * 32) * width)
            copy_panel(weights, expert, first_chunk, step * uint32(STAGE_SLABS), shared, buffer * uint32(w_words),
                       barrier)
            ptx.bulk_copy(shared, uint32(b_ring) + buffer * uint32(b_words), act,
                          (part * uint32(steps) + step) * uint32(b_words), uint32(STAGE_SLABS * 32) * width, barrier)

    return issue_stage


def _epilogue(max_width: int, row_table: int, row_words: int, stages: int, pack2):
    """(zero_prefix, store_paths): for each width w (a multiple of 8), entry w / 8 - 1
    zeroes, or stores, a thread's accumulators at that width. Built per n8 column tile in
    Python, so every accumulator index is a constant (registers, not the stack).

    A warp's outputs are 16 features (8 words of an output row of `row_words` words) by w
    slots. Stored straight from the accumulators they took 2-byte stores, each of a warp's
    instructions four rows of 16 bytes: a 256-wide CTA's fixed time was 6.5 us, 4.3
    without them (eighty-ninth session of benchmarks/LOG.md). So once both warpgroups'
    wgmma are done (bar.sync stages + 1) the ring is free: each warp stages its tile there,
    a slot's 16 features one row of 8 words (`stmatrix`, transposed: accumulator tile
    (c, 2 h + r) is features g + 8 h, slots 8 c + 2 t + r), and writes it back in 16-byte
    stores, 16 rows of 32 bytes an instruction. A slot's two 16-byte halves swap places
    every 4 slots, so that a matrix's 8 rows fall in 32 distinct banks."""
    consumers_done = ptx.barrier_sync(stages + 1, MULTIPLIERS)
    load4, store4 = ptx.load_shared[4], ptx.store_words4
    tile_words = 8 * max_width  # a warp's staged tile

    @ptx.device
    def staged(warp, slot, half):
        """The word of `half` (features 8 half ..) of `slot` in the warp's staged tile."""
        return warp * uint32(tile_words) + slot * uint32(8) + uint32(4) * (half ^ ((slot >> uint32(2)) & uint32(1)))

    def column_zero(c: int):
        @ptx.device
        def zero(acc):
            for q in range(4):
                acc[4 * c + q] = float32(0)

        return zero

    def column_pair(c: int, d: int):
        """Stage column tiles c and d (one stmatrix of four matrices: (c, features 0..7),
        (c, 8..15), (d, 0..7), (d, 8..15)); d = c stores tile c twice."""

        @ptx.device
        def stage(acc, scale, shared, warp, lane):
            j = lane // uint32(8)  # the matrix whose row this lane addresses
            slot = uint32(8 * c) + (j // uint32(2)) * uint32(8 * (d - c)) + lane % uint32(8)
            ptx.store_matrix4t(shared, staged(warp, slot, j % uint32(2)),
                               pack2(acc[4 * c] * scale, acc[4 * c + 1] * scale),
                               pack2(acc[4 * c + 2] * scale, acc[4 * c + 3] * scale),
                               pack2(acc[4 * d] * scale, acc[4 * d + 1] * scale),
                               pack2(acc[4 * d + 2] * scale, acc[4 * d + 3] * scale))

        return stage

    def store_path(width: int):
        tiles, pieces = width // 8, 2 * width  # n8 column tiles; 16-byte pieces of a warp's tile
        stage_tile = functools.reduce(chain, [column_pair(c, min(c + 1, tiles - 1)) for c in range(0, tiles, 2)])

        @ptx.device
        def store(acc, scale, shared, out, warp, out_word, lane):
            consumers_done()
            stage_tile(acc, scale, shared, warp, lane)
            ptx.sync_warp()
            for j in range(-(-pieces // 32)):
                piece = uint32(32 * j) + lane
                if pieces % 32 == 0 or piece < uint32(pieces):
                    slot, half = piece >> uint32(1), piece & uint32(1)
                    w0, w1, w2, w3 = load4(shared, staged(warp, slot, half))
                    row = shared[uint32(row_table) + slot]
                    store4(out, row * uint32(row_words) + out_word + uint32(4) * half, w0, w1, w2, w3)

        return store

    zero_prefix = list(itertools.accumulate([column_zero(c) for c in range(max_width // 8)], chain))
    return zero_prefix, [store_path(width) for width in range(8, max_width + 1, 8)]


def check_stage_blocks(name: str, blocks, parts: int, k: int, tile: SpecializedTile) -> torch.Tensor:
    """`blocks` checked as the stage blocks of `parts` parts over K = k (int32, 1-D, large
    enough, 16-byte aligned): what the gather writes and a GEMM of that K reads."""
    blocks = interop.check_tensor(name, blocks, dtype=torch.int32, ndim=1, alignment=16)
    needed = tile.stage_words(parts, k)
    if blocks.numel() < needed:
        raise ValueError(f"{name} must hold {needed} int32 words ({parts} parts x {k // STEP_K} stages of "
                         f"{tile.block_words()}), got {blocks.numel()}")
    return blocks


def check_picks(picks, blocks: int, tile: SpecializedTile) -> torch.Tensor:
    """`picks` checked: a width index (int32) for each part of `blocks` alignment blocks."""
    return interop.check_tensor("picks", picks, dtype=torch.int32, shape=(blocks * tile.sub_blocks,))


def specialized_gemm(act, weights, picks, expert_ids, rows, out, tile: SpecializedTile, *, blocked: bool,
                     check_ids: bool = True) -> None:
    """Launch the warp-specialised GEMM on torch's stream: `act` the stage blocks of the
    alignment's blocks' parts (`stage_blocks.gather_blocks` or `activate_blocks`), `picks`
    their widths, `expert_ids` and `rows` (sorted_token_ids) the alignment's, `weights` the
    `KernelWeights` of the native layout (experts, N, K); halves into `out` (N wide):
    blocks x block_m rows when `blocked`, else a row per slot id and a last one for the
    padding's sentinel (num_slots + 1 rows). `check_ids` checks the experts of the blocks
    (a host sync)."""
    if not isinstance(weights, KernelWeights):
        raise TypeError(f"weights must be KernelWeights (KernelWeights.from_physical), got {type(weights).__name__}")
    if not isinstance(tile, SpecializedTile):
        raise TypeError(f"tile must be a SpecializedTile, got {type(tile).__name__}")
    experts, n, k = weights.shape
    expert_ids = interop.check_tensor("expert_ids", expert_ids, dtype=torch.int32, ndim=1)
    rows = interop.check_tensor("rows", rows, dtype=torch.int32, ndim=1)
    blocks = expert_ids.shape[0]
    picks = check_picks(picks, blocks, tile)
    act = check_stage_blocks("act", act, picks.shape[0], k, tile)
    out = interop.check_tensor("out", out, dtype=tuple(interop.HALF_NAMES), shape=(None, n), alignment=16)
    if blocked and out.shape[0] != blocks * tile.block_m:
        raise ValueError(f"out must have a row per slot of each block ({blocks} x {tile.block_m}), got "
                         f"{out.shape[0]} rows")
    if blocks != -(-rows.shape[0] // tile.block_m):
        raise ValueError(f"expert_ids ({blocks} blocks) must split rows (sorted_token_ids, {rows.shape[0]}) in "
                         f"blocks of block_m = {tile.block_m}")
    if check_ids:
        interop.check_range("expert_ids", expert_ids, -1, experts)
    half = interop.HALF_NAMES[out.dtype]
    kernel, words, threads = make_specialized_kernel(weights.spec, n, k, half, tile, blocked)
    launch_kernel(kernel, (n // (CHUNKS * CHUNK_N), picks.shape[0]), threads, interop.to_kernel(act),
                  weights.arrays(), interop.to_kernel(picks), interop.to_kernel(expert_ids), interop.to_kernel(rows),
                  interop.to_kernel(out.view(torch.int32)), shared_bytes=4 * words)
