"""The warp-specialised grouped GEMM (Hopper): an expert's weights decoded once for all its slots.

At tens of slots an expert (Mixtral at M = 256: 49 to 74) the prefill tiles of `gemm` are
latency-bound: each warp decodes its weights and then feeds them to `mma.sync`, and the
whole CTA waits at a barrier a stage (Nsight Compute, fifty-fifth session of
`benchmarks/LOG.md`). Here the two jobs run side by side in different warps:

* a CTA computes one column panel of the native layout (two 64-feature chunks,
  `formats.NATIVE_PANEL`) for one part of a block of the alignment (up to
  `SpecializedTile.max_width` slots of one expert), at the *width* its slots need
  (their count rounded up to `width_step`: wgmma's N), so an expert of up to
  max_width slots is decoded once;
* one thread copies each stage (64 of K) in bulk copies counted on the stage's
  mbarrier: the weights' codes, scales and zero points, a run each
  (`StagedWeights.copy_panel`), and the part's activations, which `stage_blocks`
  stored stage by stage in the order wgmma reads them (one copy);
* four *producer* warps decode the staged codes with the GEMM's own reader
  (`fragments.fragment_reader`) into wgmma's A tiles in shared memory;
* the *consumer* warpgroup (warps 0 to 3) multiplies each decoded stage by its
  activations (wgmma m64nWk16, both operands in shared memory) and hands the stage back;
* the two sides meet on named barriers, a pair per stage, never on one of the whole CTA.

The epilogue stores the outputs as halves, a row per slot: `blocked`, row block *
block_m + the slot's place in its block (gemm1, whose output
`stage_blocks.activate_blocks` turns into gemm2's stage blocks), or scattered to the
slot's id in the alignment (gemm2, for the combine; the padding's sentinel id names a
spare last row). Measured on the H200 against
the layer's prefill tiles (`benchmarks/LOG.md`, sixty-sixth to seventy-first sessions).
"""

from __future__ import annotations

import functools
import itertools

import attrs
import torch
from numba import cuda, float32, int16, int32, uint32

from . import interop, ptx
from .fragments import CHUNK_N, SLAB_K, bulk_staging_supported, fragment_reader, staged_weights
from .gemm_plan import chain
from .launch import launch_kernel
from .weights import KernelWeights

STAGE_SLABS = 4  # slabs of 16 of K a pipeline stage
STEP_K = STAGE_SLABS * SLAB_K
CHUNKS = 2  # 64-feature chunks a CTA: one column panel of the native layout
TILE_WORDS = 512  # a decoded 64 x 16 tile of weights (one wgmma's A)
A_BUFFERS = 2  # decoded stages in shared memory at once
CORE_LBO, CORE_SBO = 128, 256  # bytes: the next 8 of K, the next 8 rows (features or slots)
CONSUMERS = 128  # the consumer warpgroup's threads


@attrs.frozen
class SpecializedTile:
    """The warp-specialised GEMM's configuration: alignment blocks of `block_m` slots,
    each cut into `sub_blocks` parts of at most `max_width` slots (a CTA each: an expert's
    weights are decoded once a part, and up to max_width slots two CTAs fit on a
    multiprocessor, their registers and shared memory), wgmma widths in steps of
    `width_step` up to max_width, and a ring of `stages` stages of 64 of K."""

    block_m: int = 128
    max_width: int = 80
    width_step: int = 16
    stages: int = 4

    def __attrs_post_init__(self):
        if (self.width_step % 8 or not 8 <= self.width_step <= self.max_width or self.max_width % self.width_step
                or not self.max_width <= self.block_m <= CONSUMERS or not 2 <= self.stages <= 7):
            raise ValueError(f"width_step must be a multiple of 8 dividing max_width <= block_m <= {CONSUMERS}, and "
                             f"stages in [2, 7], got block_m={self.block_m}, max_width={self.max_width}, "
                             f"width_step={self.width_step}, stages={self.stages}")

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(range(self.width_step, self.max_width + 1, self.width_step))

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
    layout; `copy_panel`) and N in whole panels, the reader decoding from shared memory."""
    if n % (CHUNKS * CHUNK_N) or not bulk_staging_supported(spec, n, k, half, CHUNKS, STAGE_SLABS):
        return False
    return staged_weights(spec, n, k, half, CHUNKS, STAGE_SLABS, 64 * CHUNKS).copy_panel is not None


@functools.cache
def make_specialized_kernel(spec, n: int, k: int, half: str, tile: SpecializedTile, blocked: bool):
    """(kernel(act, weights, picks, expert_ids, rows, out), shared words, threads) for
    weights `spec` of shape (n, k) an expert: `act` the stage blocks (`stage_blocks`),
    `picks` each part's width index in `tile.widths` (-1: no slots), `expert_ids` and
    `rows` (sorted_token_ids) the alignment's, `out` halves; grid (n / 128, blocks x
    tile.sub_blocks)."""
    if not specialized_supported(spec, n, k, half):
        raise ValueError(f"{spec.name} at (n={n}, k={k}) cannot run on the warp-specialised GEMM: the native layout "
                         f"in column panels of {CHUNKS * CHUNK_N}, K in stages of {STEP_K} expected")
    widths, stages, block_m = tile.widths, tile.stages, tile.block_m
    max_width, sub_blocks = tile.max_width, tile.sub_blocks
    producers = 64 * CHUNKS
    threads, steps = CONSUMERS + producers, k // STEP_K
    staged = staged_weights(spec, n, k, half, CHUNKS, STAGE_SLABS, producers)
    reader = fragment_reader(spec, n, k, half)
    fetch, copy_panel, decode = staged.fetch, staged.copy_panel, reader.decode
    output_scale, raw_words, to_half = reader.output_scale, reader.raw_words, ptx.to_half(half)
    w_words, a_words, b_words = staged.stage_words, STAGE_SLABS * CHUNKS * TILE_WORDS, tile.block_words()
    # The copies' ring is `stages` deep; the decoded A tiles need only two buffers: the
    # producers decode step i after the consumer released step i - 2 (`producer_step`).
    a_ring, b_ring = stages * w_words, stages * w_words + A_BUFFERS * a_words
    row_table = b_ring + stages * b_words  # the block's output rows, a word a slot
    barriers = row_table + max_width
    regs = max(widths) // 2  # a consumer thread's accumulators of one chunk
    accumulators = CHUNKS * regs
    # One group of wgmma stays in flight (the newest stage's) while the next is issued;
    # the last step waits for all of them (`consumer`).
    wait_in_flight, wait_all = ptx.warpgroup_wait[1], ptx.warpgroup_wait[0]

    @ptx.device
    def issue_stage(act, weights, step, buffer, part, expert, first_chunk, width, shared):
        """One thread's bulk copies of `step` (none past the last) into `buffer`: the
        weights' runs, and the stage's activations (its slabs at `width` slots)."""
        if step < uint32(steps):
            barrier = uint32(barriers) + uint32(2) * buffer
            ptx.mbarrier_expect_bytes(shared, barrier, uint32(4 * w_words) + uint32(STAGE_SLABS * 32) * width)
            copy_panel(weights, expert, first_chunk, step * uint32(STAGE_SLABS), shared, buffer * uint32(w_words),
                       barrier)
            ptx.bulk_copy(shared, uint32(b_ring) + buffer * uint32(b_words), act,
                          (part * uint32(steps) + step) * uint32(b_words), uint32(STAGE_SLABS * 32) * width, barrier)

    @ptx.device
    def decode_slab(weights, expert, step, b, local_slab, chunk, first_chunk, lane, shared, raw, params, frags):
        """A producer warp's slab `local_slab` of chunk `chunk` of `step`, from copy buffer
        b: staged codes -> fragments -> the chunk's A tile of that slab (A buffer step % 2),
        8 x 8 core matrices."""
        fetch(shared, b, local_slab, chunk, lane, raw)
        decode(raw, params, weights, expert, step * uint32(STAGE_SLABS) + local_slab, first_chunk + chunk, lane, frags)
        # fragment 4j + 2h + r: features 16j + 8h + lane / 4, K 8r + 2 (lane % 4) of the
        # slab; lane l names row l % 8 of matrix l / 8 = 2h + r of each of four stores.
        h, r = (lane // uint32(8)) // uint32(2), (lane // uint32(8)) % uint32(2)
        tile_at = (uint32(a_ring) + step % uint32(A_BUFFERS) * uint32(a_words)
                   + (local_slab * uint32(CHUNKS) + chunk) * uint32(TILE_WORDS))
        row = tile_at + h * uint32(CORE_SBO // 4) + r * uint32(CORE_LBO // 4) + (lane % uint32(8)) * uint32(4)
        for j in range(4):
            ptx.store_matrix4(shared, row + uint32(j * 2 * CORE_SBO // 4), frags[4 * j], frags[4 * j + 1],
                              frags[4 * j + 2], frags[4 * j + 3])

    def producer_step(b: int):
        """Decode stage b's codes into its A tiles and hand the stage to the consumer;
        then refill the stage before it, once the consumer is done with it. That wait
        (for step i - 1's wgmma) comes before the decode of step i + 1, which so
        overwrites the A buffer of step i - 1 only once its wgmma are done."""
        ready, before = ptx.barrier_arrive(1 + b, threads), (b - 1) % stages
        released = ptx.barrier_sync(1 + stages + before, threads)

        @ptx.device
        def step(first, act, weights, part, expert, first_chunk, width, p, shared, raw, params, frags):
            i = first + uint32(b)
            if i < uint32(steps):
                ptx.mbarrier_wait(shared, uint32(barriers + 2 * b), (i // uint32(stages)) % uint32(2))
                warp, lane = p // uint32(32), p % uint32(32)
                for s in range(2):
                    decode_slab(weights, expert, i, uint32(b), uint32(2) * (warp % uint32(2)) + uint32(s),
                                warp // uint32(2), first_chunk, lane, shared, raw, params, frags)
                ptx.async_proxy_fence()  # the stores, for the tensor cores
                ready()
                if i >= uint32(1):
                    released()
                    if p == uint32(0):
                        issue_stage(act, weights, i - uint32(1) + uint32(stages), uint32(before), part, expert,
                                    first_chunk, width, shared)

        return step

    @functools.cache
    def stage_multiplier(width: int):
        """acc += A (the stage at a_base: its slabs x chunks) @ B (the stage at b_base, its
        first `width` slots): the first width / 2 accumulators of each chunk. One a width,
        shared by the ring's stages (a device function is compiled once)."""
        multiply = ptx.shared_warpgroup_mma(half, width)

        def tile_multiplier(slab: int, chunk: int):
            @ptx.device
            def multiply_tile(shared, a_base, b_base, acc):
                multiply(shared, a_base + uint32((slab * CHUNKS + chunk) * TILE_WORDS), CORE_LBO, CORE_SBO,
                         b_base + uint32(slab * width * 8), CORE_LBO, CORE_SBO, acc, chunk * regs)

            return multiply_tile

        return functools.reduce(chain, [tile_multiplier(s, c) for s in range(STAGE_SLABS) for c in range(CHUNKS)])

    def consumer_step(b: int, width: int, wait_mma):
        """Multiply stage b at `width` once the producers hand it over; wait (`wait_mma`)
        and release the stage before it, whose wgmma are then done."""
        ready, before = ptx.barrier_sync(1 + b, threads), (b - 1) % stages
        release = ptx.barrier_arrive(1 + stages + before, threads)
        multiply_stage = stage_multiplier(width)

        @ptx.device
        def step(first, shared, acc):
            i = first + uint32(b)
            if i < uint32(steps):
                ready()
                ptx.mbarrier_wait(shared, uint32(barriers + 2 * b), (i // uint32(stages)) % uint32(2))
                ptx.warpgroup_fence()
                multiply_stage(shared, uint32(a_ring) + i % uint32(A_BUFFERS) * uint32(a_words),
                               uint32(b_ring + b * b_words), acc)
                ptx.warpgroup_commit()
                wait_mma()
                if i >= uint32(1):
                    release()

        return step

    def column_tile(c: int, chunk: int):
        """(zero, store) of one n8 column tile's four accumulators: features `feature` and
        feature + 8 of chunk `chunk`, slots 8c + `col` and + 1 (their output rows from the
        row table). Built per tile in Python, so every accumulator index is a constant
        (registers, not the stack)."""
        first = chunk * regs + 4 * c

        @ptx.device
        def zero(acc):
            for q in range(4):
                acc[first + q] = float32(0)

        @ptx.device
        def store(acc, scale, out, shared, feature, col):
            for q in range(4):
                row = shared[uint32(row_table + 8 * c + q % 2) + col]
                out[row, feature + uint32(CHUNK_N * chunk + 8 * (q // 2))] = int16(to_half(acc[first + q] * scale))

        return zero, store

    # The column tiles of width w are the first 2 w / 8 (column-major): each width's
    # zeroing and stores are a prefix of one chain, so the widths share their functions.
    columns = [column_tile(c, chunk) for c in range(max(widths) // 8) for chunk in range(CHUNKS)]
    zero_prefix, store_prefix = list(itertools.accumulate([zero for zero, _ in columns], chain)), list(
        itertools.accumulate([store for _, store in columns], chain))

    def consumer(index: int, width: int):
        """The consumer's whole part at widths[index], if that is the CTA's width: zero
        the width's accumulators, the main loop, store them. A path a width, so that no
        instruction but that width's wgmma defines its accumulators between them (one
        loop with a branch a stage made ptxas inject warpgroup arrives, C7519; zeroing and
        stores shared by the widths serialised the wgmma, C7515). The round of the last
        step comes after the loop, that step waiting for all groups: with that wait after
        the loop ptxas placed the stores' reads of the accumulators above it, and the
        outputs missed the last stage (seventy-second session of benchmarks/LOG.md); a
        branch in the loop to wait at the last step serialised every wgmma (C7517)."""
        last_b = (steps - 1) % stages
        consume_round = functools.reduce(chain, [consumer_step(b, width, wait_in_flight) for b in range(stages)])
        last_round = functools.reduce(chain, [consumer_step(b, width, wait_all if b == last_b else wait_in_flight)
                                              for b in range(last_b + 1)])
        zero_accumulators, store_outputs = zero_prefix[width // 8 * CHUNKS - 1], store_prefix[width // 8 * CHUNKS - 1]

        @ptx.device
        def run(width_index, shared, acc, weights, out, expert, feature, col):
            if width_index == uint32(index):
                zero_accumulators(acc)
                first = uint32(0)
                while first < uint32(steps - 1 - last_b):
                    consume_round(first, shared, acc)
                    first += uint32(stages)
                last_round(first, shared, acc)
                store_outputs(acc, output_scale(weights, expert), out, shared, feature, col)

        return run

    produce_round = functools.reduce(chain, [producer_step(b) for b in range(stages)])
    consume = functools.reduce(chain, [consumer(i, width) for i, width in enumerate(widths)])

    @ptx.kernel(launch_bounds=(threads, 2))  # two CTAs a multiprocessor: one decodes while the other waits
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
        if tid >= uint32(CONSUMERS):
            p = tid - uint32(CONSUMERS)
            if p == uint32(0):
                for s in range(stages):
                    issue_stage(act, weights, uint32(s), uint32(s), part, expert, first_chunk, width, shared)
            raw = cuda.local.array(raw_words, uint32)
            params = cuda.local.array(16, uint32)
            frags = cuda.local.array(16, uint32)
            first = uint32(0)
            while first < uint32(steps):
                produce_round(first, act, weights, part, expert, first_chunk, width, p, shared, raw, params, frags)
                first += uint32(stages)
        else:
            acc = cuda.local.array(accumulators, float32)
            consume(width_index, shared, acc, weights, out, expert,
                    first_chunk * uint32(CHUNK_N) + (tid // uint32(32)) * uint32(16) + (tid % uint32(32)) // uint32(4),
                    uint32(2) * (tid % uint32(4)))

    return specialized, barriers + 2 * stages, threads


def check_stage_blocks(name: str, blocks, parts: int, k: int, tile: SpecializedTile) -> torch.Tensor:
    """`blocks` checked as the stage blocks of `parts` parts over K = k (int32, 1-D, large
    enough): what the gather writes and a GEMM of that K reads."""
    blocks = interop.check_tensor(name, blocks, dtype=torch.int32, ndim=1)
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
    out = interop.check_tensor("out", out, dtype=tuple(interop.HALF_NAMES), shape=(None, n))
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
                  interop.to_kernel(out), shared_bytes=4 * words)
