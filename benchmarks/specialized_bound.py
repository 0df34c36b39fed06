"""What a warp-specialised prefill GEMM could reach at Mixtral's M = 256, on the GPU:

    python3 benchmarks/specialized_bound.py [--format nvfp4] [--variants 2:3 2:4 2:3:act ...]
        [--image-copies 0 1 tensors] [--steps-first]

At 64 slots an expert the prefill tiles are latency-bound (Nsight Compute, fifty-fifth
session of `benchmarks/LOG.md`): each warp decodes its weights and then feeds them to
`mma.sync`, and the whole CTA waits at a barrier a slab. The thirty-eighth session's
warpgroup tile (weights decoded into shared memory, multiplied by Hopper's wgmma) lost
for the same reason, and named the way out: warp specialisation. This script builds the
main loop of such a GEMM on the layer's own weights and times it beside the layer's two
GEMMs (sixty-sixth and sixty-seventh sessions):

* a CTA computes `chunks` 64-feature chunks of one expert for all of its slots (one
  wgmma m64nNk16 per chunk and slab of 16 of K, N the expert's slots rounded up to a
  multiple of 8: a few widths compiled, one picked a CTA), K in stages of four
  slabs copied into a ring `stages` deep and decoded into two buffers of A tiles;
* one thread copies each stage in a few bulk copies (`ptx.bulk_copy`) counted on the
  stage's mbarrier: the weights as the prefill GEMM stages them
  (`fragments.StagedWeights.copy_panel`: codes, scales, zero points of the native
  layout, a copy each, where a CTA's chunks are one column panel; else `copy_bulk`)
  and the activations, stored stage by stage in the order the stage holds them
  (`stage_blocks`);
* 2 x `chunks` *producer* warps (two slabs of a chunk each) decode the staged codes with
  the GEMM's own reader (`fragments.fragment_reader`: int4 with or without zero points,
  NVFP4) and store the fragments as wgmma's A tiles (`ptx.store_matrix4`);
* warps 0 to 3, the *consumer* warpgroup, multiply each decoded stage by its
  activations (wgmma, both operands in shared memory) and hand the stage back;
* the two sides meet on named barriers (`ptx.barrier_sync`, `ptx.barrier_arrive`), a
  pair per stage, never on a barrier of the whole CTA.

Every expert takes as many slots as the layer's routing gives it (`--slots`: as many
each), in one CTA a group of chunks, so its weights are decoded once; there is no
gather of the slots' activations (they come stored stage by stage) and no epilogue
beyond float32 stores: an upper bound on the design, not a kernel the layer runs. It checks its
output against the spec's own dequantisation before it times. A variant may leave one
part out (timing only, wrong results): the decode, the proxy fence, the wgmma or the
activations' copies, which says where the time goes.

Measured (H200, sixty-seventh session of LOG.md, time against the layer's own GEMMs in
the same call): with every producer thread copying its share of a stage (`cp.async`)
the skeleton lost, 635 us against 448 for gemm1; one thread's bulk copies of the same
bytes won, 385 / 193 us against 448 / 241 (on a code layout of the script's own). On
the native layout, decoded by the GEMM's reader: w4a16 416 / 217 us against 468 / 253
(0.88x the two GEMMs), NVFP4 491 / 253 against 470 / 259 (1.01x); at 80 slots an expert
w4a16 takes 442 / 232. With the layer's own routing (49 to 74 slots an expert, widths
56 to 80 picked a CTA) it keeps most of the gain once two things are right (sixty-eighth
session): a consumer path a width (zeroing, main loop and stores; shared zeroing or
stores serialise the wgmma, ptxas warnings C7519 and C7515), and one activation copy a
stage (each expert's stage blocks packed at its width; a copy a slab cost 11 % of gemm1
at 64 slots an expert). w4a16 433 / 231 us against 469 / 253 (0.92x the two GEMMs);
NVFP4 521 / 268 against 471 / 258 (1.08x: its decode). The weights' layout is the
larger lever: from the weights stored stage by stage (`--image-copies`), w4a16 takes
393 / 201 us in five copies a stage and 337 to 350 / 175 to 180 in one (0.71x to
0.73x the layer's GEMMs; the native layout's five copies 430 / 229 in the same call),
NVFP4 380 / 195 in one (0.79x): both the copies' locality and their count.
`--image-copies tensors` (a copy for the codes and one for the scales, as two tensors
stored stage by stage would be copied) keeps most of it (sixty-ninth session): 360 /
185 (0.75x), NVFP4 391 / 201 (0.81x); `--steps-first` changes nothing. A native layout
storing the codes so (branch `stage-tiles`, its scales a row a group) took 418 / 218
(0.88x); `--image-copies split` (two tensors each stored stage by stage, the codes'
stages exactly 4 KB apart) 356 / 183 (seventieth session). The native layout in column
panels (`formats.NATIVE_PANEL`: a CTA's codes, scales and zero points each one run over
all of K) reaches the image's bound, 355 / 182 (0.74x) and NVFP4 392 / 199 (0.81x), once
each stage's copies are issued from addresses computed straight (`copy_panel`): through
`copy_bulk`'s run-time checks and loops the issuing thread, whose warp's other lanes
decode, took it to 430 / 229. The image's gain was that thread's work, not the
copies' locality.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import numpy as np
import torch

import numba_kernels  # noqa: F401  (before numba: no simulator on a GPU machine)
from layouts import Panels, formats
from layouts.samples import random_quantized
from numba import cuda, float32, int32, uint32
from numba_kernels import interop, ptx
from numba_kernels.fragments import CHUNK_N, SLAB_K, bulk_staging_supported, fragment_reader, staged_weights
from numba_kernels.gemm_plan import chain
from numba_kernels.launch import launch_kernel
from numba_kernels.weights import SLOTS, KernelWeights

HALF = "bfloat16"
STAGE_SLABS = 4  # slabs of 16 of K a pipeline stage
STEP_K = STAGE_SLABS * SLAB_K
TILE_WORDS = 512  # a decoded 64 x 16 tile of weights (one wgmma's A)
A_BUFFERS = 2  # decoded stages in shared memory at once
LEFT_OUT = ("", "decode", "fence", "mma", "act")  # what a timing-only variant leaves out ("act": activation copies)
SPLIT_COPIES = ("tensors", "split")  # a stage of the image in two copies: codes, then scales and zero points
CORE_LBO, CORE_SBO = 128, 256  # bytes: the next 8 of K, the next 8 rows (features or slots)
SPECS = {"w4a16-g128": formats.native(4, 128), "nvfp4": formats.native(fp4=True)}


def widths_for(counts) -> tuple[int, ...]:
    """The wgmma widths (N) the kernel needs for experts of `counts` slots: each count
    rounded up to a multiple of 8, once each (experts without slots need none)."""
    return tuple(sorted({8 * -(-int(count) // 8) for count in counts if count > 0}))


def width_picks(counts, widths) -> list[int]:
    """The index in `widths` of the width each expert multiplies by: the narrowest that
    holds its count (the widest for more), -1 for an expert without slots."""
    return [-1 if count == 0 else min([i for i, w in enumerate(widths) if w >= count] or [len(widths) - 1])
            for count in counts]


@functools.cache
def make_bound_kernel(spec, n: int, k: int, widths: tuple[int, ...], chunks: int, stages: int, leave_out: str = "",
                      image_copies: int | str = 0, steps_first: bool = False):
    """(kernel(act, weights, picks, out), shared words) for weights `spec` of shape (n,
    k) an expert, `chunks` chunks a CTA and a `stages`-deep ring; expert e multiplies
    its stages by widths[picks[e]] (wgmma's N, a multiple of 8: `width_picks`; none for
    -1), so its weights are decoded once however many slots it has (`act` as
    `stage_blocks` stores it, max(widths) rows an expert; `weights` the `KernelWeights`
    arrays); grid (n / (64 chunks), experts), 128 + 64 chunks threads.
    `leave_out` one of LEFT_OUT, timing only (wrong results): what the loop costs
    without it. `image_copies` not 0: each stage's weights from `stage_image`, passed
    after the weights' arrays (what a layout stored stage by stage would give; "split":
    the two tensors of `split_image`), in the copies `image_bounds` gives, instead of
    `copy_panel`'s copy a tensor from the native layout (`steps_first`: the
    image's order, `image_stage`)."""
    if (not bulk_staging_supported(spec, n, k, HALF, chunks, STAGE_SLABS) or not 2 <= stages <= 7 or not widths
            or not set(widths) <= set(ptx.WARPGROUP_COLUMNS) or leave_out not in LEFT_OUT):
        raise ValueError(f"{spec.name} at (n={n}, k={k}) in bulk-copied stages of {STEP_K} of K and {chunks} chunks, "
                         f"stages in [2, 7] and widths multiples of 8 up to 256 expected, got stages={stages}, "
                         f"widths={widths}; leave_out one of {LEFT_OUT}, got {leave_out!r}")
    slots = max(widths)  # rows of an expert's activations (and outputs)
    producers = 64 * chunks
    threads, steps, image_slot = 128 + producers, k // STEP_K, len(SLOTS)
    staged = staged_weights(spec, n, k, HALF, chunks, STAGE_SLABS, producers)
    bounds = image_bounds(spec, n, k, chunks, image_copies) if image_copies else ()
    split, code_words = image_copies == "split", bounds[1] if image_copies else 0
    scale_image_slot = image_slot + 1  # `split`: the scales' tensor (a constant: the tuple's items differ in type)
    stage_of = image_stage(n // (CHUNK_N * chunks), steps, steps_first)
    reader = fragment_reader(spec, n, k, HALF)
    fetch, copy_bulk, copy_panel, decode = staged.fetch, staged.copy_bulk, staged.copy_panel, reader.decode
    output_scale, raw_words = reader.output_scale, reader.raw_words
    w_words, a_words, b_words = staged.stage_words, STAGE_SLABS * chunks * TILE_WORDS, STAGE_SLABS * slots * 8
    # The copies' ring is `stages` deep; the decoded A tiles need only two buffers: the
    # producers decode step i after the consumer released step i - 2 (`producer_step`).
    a_ring, b_ring = stages * w_words, stages * w_words + A_BUFFERS * a_words
    barriers = b_ring + stages * b_words
    regs, accumulators = slots // 2, chunks * slots // 2  # a consumer thread's: of one chunk, of all
    wait_older_mma, wait_all_mma = ptx.warpgroup_wait[1], ptx.warpgroup_wait[0]
    decoding, fence, multiply_tiles, copy_act = (leave_out != part for part in LEFT_OUT[1:])

    @ptx.device
    def issue_stage(act, weights, step, buffer, expert, first_chunk, width, shared):
        """One thread's bulk copies of `step` (none past the last) into `buffer`: the
        weights, and the stage's activations (its slabs at `width` slots, one copy)."""
        if step < uint32(steps):
            barrier = uint32(barriers) + uint32(2) * buffer
            ptx.mbarrier_expect_bytes(shared, barrier, uint32(4 * w_words) + (
                uint32(STAGE_SLABS * 32) * width if copy_act else uint32(0)))
            if image_copies:
                stage = stage_of(expert, first_chunk // uint32(chunks), step)
                if split:  # codes and scales from tensors of their own, each stored stage by stage
                    ptx.bulk_copy(shared, buffer * uint32(w_words), weights[image_slot], stage * uint32(code_words),
                                  uint32(4 * code_words), barrier)
                    ptx.bulk_copy(shared, buffer * uint32(w_words) + uint32(code_words), weights[scale_image_slot],
                                  stage * uint32(w_words - code_words), uint32(4 * (w_words - code_words)), barrier)
                else:
                    for c in range(len(bounds) - 1):
                        ptx.bulk_copy(shared, buffer * uint32(w_words) + uint32(bounds[c]), weights[image_slot],
                                      stage * uint32(w_words) + uint32(bounds[c]),
                                      uint32(4 * (bounds[c + 1] - bounds[c])), barrier)
            elif copy_panel is not None:  # a CTA's chunks one panel (first_chunk a multiple of chunks)
                copy_panel(weights, expert, first_chunk, step * uint32(STAGE_SLABS), shared, buffer * uint32(w_words),
                           barrier)
            else:
                copy_bulk(weights, expert, first_chunk, first_chunk + uint32(chunks // 2), step * uint32(STAGE_SLABS),
                          shared, buffer * uint32(w_words), barrier)
            if copy_act:
                ptx.bulk_copy(shared, uint32(b_ring) + buffer * uint32(b_words), act,
                              (expert * uint32(steps) + step) * uint32(b_words), uint32(STAGE_SLABS * 32) * width,
                              barrier)

    @ptx.device
    def decode_slab(weights, expert, step, b, local_slab, chunk, first_chunk, lane, shared, raw, params, frags):
        """A producer warp's slab `local_slab` of chunk `chunk` of `step`, from copy buffer
        b: staged codes -> fragments -> the chunk's A tile of that slab (A buffer step % 2),
        8 x 8 core matrices."""
        fetch(shared, b, local_slab, chunk, lane, raw)
        if decoding:
            decode(raw, params, weights, expert, step * uint32(STAGE_SLABS) + local_slab, first_chunk + chunk, lane,
                   frags)
        else:
            for i in range(16):
                frags[i] = raw[i % 4]
        # fragment 4j + 2h + r: features 16j + 8h + lane / 4, K 8r + 2 (lane % 4) of the
        # slab; lane l names row l % 8 of matrix l / 8 = 2h + r of each of four stores.
        h, r = (lane // uint32(8)) // uint32(2), (lane // uint32(8)) % uint32(2)
        tile = (uint32(a_ring) + step % uint32(A_BUFFERS) * uint32(a_words)
                + (local_slab * uint32(chunks) + chunk) * uint32(TILE_WORDS))
        row = tile + h * uint32(CORE_SBO // 4) + r * uint32(CORE_LBO // 4) + (lane % uint32(8)) * uint32(4)
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
        def step(first, act, weights, expert, first_chunk, width, p, shared, raw, params, frags):
            i = first + uint32(b)
            if i < uint32(steps):
                ptx.mbarrier_wait(shared, uint32(barriers + 2 * b), (i // uint32(stages)) % uint32(2))
                warp, lane = p // uint32(32), p % uint32(32)
                for s in range(2):
                    decode_slab(weights, expert, i, uint32(b), uint32(2) * (warp % uint32(2)) + uint32(s),
                                warp // uint32(2), first_chunk, lane, shared, raw, params, frags)
                if fence:
                    ptx.async_proxy_fence()  # the stores, for the tensor cores
                ready()
                if i >= uint32(1):
                    released()
                    if p == uint32(0):
                        issue_stage(act, weights, i - uint32(1) + uint32(stages), uint32(before), expert, first_chunk,
                                    width, shared)

        return step

    def tile_multiplier(width: int, slab: int, chunk: int):
        """acc[chunk] += A (chunk `chunk`, slab `slab` of the stage at a_base) @ B (its
        first `width` slots): the first width / 2 of the chunk's accumulators."""
        multiply = ptx.shared_warpgroup_mma(HALF, width)

        @ptx.device
        def multiply_tile(shared, a_base, b_base, acc):
            multiply(shared, a_base + uint32((slab * chunks + chunk) * TILE_WORDS), CORE_LBO, CORE_SBO,
                     b_base + uint32(slab * width * 8), CORE_LBO, CORE_SBO, acc, chunk * regs)

        return multiply_tile

    def consumer_step(b: int, width: int):
        """Multiply stage b at `width` once the producers hand it over; release the
        stage before it once that stage's wgmma are done."""
        ready, before = ptx.barrier_sync(1 + b, threads), (b - 1) % stages
        release = ptx.barrier_arrive(1 + stages + before, threads)
        multiply_stage = functools.reduce(chain, [tile_multiplier(width, s, c) for s in range(STAGE_SLABS)
                                                  for c in range(chunks)])

        @ptx.device
        def step(first, shared, acc):
            i = first + uint32(b)
            if i < uint32(steps):
                ready()
                ptx.mbarrier_wait(shared, uint32(barriers + 2 * b), (i // uint32(stages)) % uint32(2))
                ptx.warpgroup_fence()
                if multiply_tiles:
                    multiply_stage(shared, uint32(a_ring) + i % uint32(A_BUFFERS) * uint32(a_words),
                                   uint32(b_ring + b * b_words), acc)
                ptx.warpgroup_commit()
                wait_older_mma()
                if i >= uint32(1):
                    release()

        return step

    def column_tile(chunk: int, c: int):
        """(zero, store) of one n8 column tile's four accumulators: features `row` and
        row + 8 of chunk `chunk`, slots 8c + `col` and + 1. Built per tile in Python, so
        every accumulator index is a constant (registers, not the stack). Slots past the
        expert's count are stored too (`out` has max(widths) rows an expert): a store
        masked by the count took 34 registers more (80 slots: 144, one CTA an SM)."""
        first = chunk * regs + 4 * c

        @ptx.device
        def zero(acc):
            for q in range(4):
                acc[first + q] = float32(0)

        @ptx.device
        def store(acc, scale, out, expert, row, col):
            for q in range(4):
                out[expert, uint32(8 * c + q % 2) + col, row + uint32(CHUNK_N * chunk + 8 * (q // 2))] = (
                    acc[first + q] * scale)

        return zero, store

    def consumer(index: int, width: int):
        """The consumer's whole part at widths[index], if that is the CTA's width: zero
        the width's accumulators, the main loop, store them. A path a width, so that no
        instruction but that width's wgmma defines its accumulators between them (one
        loop with a branch a stage made ptxas inject warpgroup arrives, C7519; zeroing and
        stores shared by the widths serialised the wgmma, C7515)."""
        consume_round = functools.reduce(chain, [consumer_step(b, width) for b in range(stages)])
        columns = [column_tile(chunk, c) for chunk in range(chunks) for c in range(width // 8)]
        zero_accumulators = functools.reduce(chain, [zero for zero, _ in columns])
        store_outputs = functools.reduce(chain, [store for _, store in columns])

        @ptx.device
        def run(width_index, shared, acc, weights, out, expert, row, col):
            if width_index == uint32(index):
                zero_accumulators(acc)
                first = uint32(0)
                while first < uint32(steps):
                    consume_round(first, shared, acc)
                    first += uint32(stages)
                wait_all_mma()
                store_outputs(acc, output_scale(weights, expert), out, expert, row, col)

        return run

    produce_round = functools.reduce(chain, [producer_step(b) for b in range(stages)])
    consume = functools.reduce(chain, [consumer(i, width) for i, width in enumerate(widths)])

    @ptx.kernel(launch_bounds=threads)
    def bound(act, weights, picks, out):
        shared = cuda.shared.array(0, uint32)
        tid, ftile, expert = uint32(cuda.threadIdx.x), uint32(cuda.blockIdx.x), uint32(cuda.blockIdx.y)
        pick = picks[expert]
        if pick < 0:
            return
        width, width_index = uint32(0), uint32(pick)
        for i in range(len(widths)):
            if width_index == uint32(i):
                width = uint32(widths[i])
        first_chunk = ftile * uint32(chunks)
        if tid == uint32(0):
            for b in range(stages):
                ptx.mbarrier_init(shared, uint32(barriers + 2 * b), 1)
        cuda.syncthreads()
        if tid >= uint32(128):
            p = tid - uint32(128)
            if p == uint32(0):
                for s in range(stages):
                    issue_stage(act, weights, uint32(s), uint32(s), expert, first_chunk, width, shared)
            raw = cuda.local.array(raw_words, uint32)
            params = cuda.local.array(16, uint32)
            frags = cuda.local.array(16, uint32)
            first = uint32(0)
            while first < uint32(steps):
                produce_round(first, act, weights, expert, first_chunk, width, p, shared, raw, params, frags)
                first += uint32(stages)
        else:
            acc = cuda.local.array(accumulators, float32)
            consume(width_index, shared, acc, weights, out, expert,
                    first_chunk * uint32(CHUNK_N) + (tid // uint32(32)) * uint32(16) + (tid % uint32(32)) // uint32(4),
                    uint32(2) * (tid % uint32(4)))

    return bound, barriers + 2 * stages


def image_bounds(spec, n: int, k: int, chunks: int, copies: int | str) -> tuple[int, ...]:
    """The word offsets that split a stage of `stage_image` into its bulk copies:
    `copies` (an int) of about equal size, or "tensors" and "split": the codes, then the
    scales and zero points (`StagedWeights` keeps them in that order), as two tensors
    stored stage by stage would be copied ("split": from two such tensors, `split_image`)."""
    staged = staged_weights(spec, n, k, HALF, chunks, STAGE_SLABS, 64 * chunks)
    stage_words = staged.stage_words
    if copies in SPLIT_COPIES:
        return 0, staged.weight_words, stage_words
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"copies must be a positive integer, 'tensors' or 'split', got {copies!r}")
    return tuple(4 * (i * stage_words // 4 // copies) for i in range(copies + 1))


def image_stage(tiles: int, steps: int, steps_first: bool):
    """stage(expert, feature tile, step): where a stage sits in `stage_image`, in stages.
    A CTA's stages one after another, or (`steps_first`) a step's feature tiles one
    after another: the order a `Tile` of the packed words (a row of slabs a stage) would
    give, each stage one run but a CTA's next one a row of tiles away."""

    @ptx.device
    def stage(expert, tile, step):
        if steps_first:
            return (expert * uint32(steps) + step) * uint32(tiles) + tile
        return (expert * uint32(tiles) + tile) * uint32(steps) + step

    return stage


@functools.cache
def make_image_kernel(spec, n: int, k: int, chunks: int, steps_first: bool):
    """(kernel(weights, image), a stage's words): a CTA (feature tile, expert, step)
    stages its weights with `copy_bulk` and writes the stage's shared words to `image`
    where `image_stage` puts them, so that one copy of a stage's words fills the same
    stage."""
    staged = staged_weights(spec, n, k, HALF, chunks, STAGE_SLABS, 64 * chunks)
    copy_bulk, w_words, tiles, steps = staged.copy_bulk, staged.stage_words, n // (CHUNK_N * chunks), k // STEP_K
    barrier = 2 * -(-w_words // 2)  # the mbarrier's word, even, after the stage
    stage_of = image_stage(tiles, steps, steps_first)

    @ptx.kernel
    def image_kernel(weights, image):
        shared = cuda.shared.array(0, uint32)
        tid, ftile, expert, step = (uint32(cuda.threadIdx.x), uint32(cuda.blockIdx.x), uint32(cuda.blockIdx.y),
                                    uint32(cuda.blockIdx.z))
        if tid == uint32(0):
            ptx.mbarrier_init(shared, barrier, 1)
        cuda.syncthreads()
        if tid == uint32(0):
            ptx.mbarrier_expect_bytes(shared, barrier, 4 * w_words)
            copy_bulk(weights, expert, ftile * uint32(chunks), ftile * uint32(chunks) + uint32(chunks // 2),
                      step * uint32(STAGE_SLABS), shared, uint32(0), barrier)
        ptx.mbarrier_wait(shared, barrier, 0)
        first = stage_of(expert, ftile, step) * uint32(w_words)
        for word in range(tid, w_words, cuda.blockDim.x):
            image[first + uint32(word)] = int32(shared[word])

    return image_kernel, w_words, barrier + 2


def stage_image(weights, chunks: int, steps_first: bool = False) -> torch.Tensor:
    """The weights (`KernelWeights`) stored stage by stage, as `copy_bulk` stages them
    for CTAs of `chunks` chunks, in `image_stage`'s order: one bulk copy a stage
    (`make_bound_kernel`'s `image_copies`)."""
    experts, n, k = weights.shape
    kernel, w_words, words = make_image_kernel(weights.spec, n, k, chunks, steps_first)
    tiles = n // (CHUNK_N * chunks)
    image = torch.empty(experts * tiles * (k // STEP_K) * w_words, dtype=torch.int32, device=weights.tensors[0].device)
    launch_kernel(kernel, (tiles, experts, k // STEP_K), 128, weights.arrays(), interop.to_kernel(image),
                  shared_bytes=4 * words)
    return image


def split_image(image: torch.Tensor, spec, n: int, k: int, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`stage_image` as two tensors each stored stage by stage: the codes (a stage's
    right after the one before, 4 KB apart for two chunks of int4 codes, as a `Tile` of
    the packed words would store them) and the scales and zero points (`image_bounds`'
    "split")."""
    _, codes, stage = image_bounds(spec, n, k, chunks, "split")
    stages = image.view(-1, stage)
    return stages[:, :codes].contiguous().view(-1), stages[:, codes:].contiguous().view(-1)


def stage_blocks(act: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """Activations (experts, slots, k) -> (experts, k / 64, stage's words at `slots`):
    each stage's first widths[e] slots in the order its B tiles hold them (slab, 8
    slots, 8 of K, slot, 8 halves), so that one bulk copy of an expert's width fills a
    stage (0 for an expert without slots)."""
    experts, slots, k = act.shape
    blocks = torch.zeros(experts, k // STEP_K, STAGE_SLABS * slots * 8, dtype=torch.int32, device=act.device)
    for e, width in enumerate(widths):
        tiles = act[e, :width].reshape(width // 8, 8, k // STEP_K, STAGE_SLABS, 2, 8).permute(2, 3, 0, 4, 1, 5)
        blocks[e, :, :STAGE_SLABS * width * 8] = tiles.contiguous().view(torch.int32).view(k // STEP_K, -1)
    return blocks


def bound_inputs(spec, experts: int, n: int, k: int, slots: int, seed: int, device, *, sample_n: int = 256):
    """(act, weights, dense): random activations (experts, slots, k) in bfloat16, and
    weights of `spec` (experts, n, k) as `KernelWeights`, with their dequantised values
    (float32) for the reference. One random expert of `sample_n` features is packed by the
    spec and repeated along N and E (the native layout stores each column panel's words,
    scales and zero points apart from the others': an expert of n features is the
    sample's panels n / sample_n times over; rows as they are, each row's): packing
    Mixtral's experts in numpy would take minutes."""
    sample_n = min(sample_n, n)
    if n % sample_n or sample_n % CHUNK_N:
        raise ValueError(f"n must be a multiple of sample_n, itself a multiple of {CHUNK_N}, got {n} and {sample_n}")
    physical = spec.pack(random_quantized(spec, (1, sample_n, k), np.random.default_rng(seed)))
    dense = torch.from_numpy(spec.dequantize(physical, (1, sample_n, k))).float()
    tensors = list(KernelWeights.from_physical(spec, physical, (1, sample_n, k)).tensors)
    for slot, tensor in zip((0, 1, 2), (spec.weight, spec.scales, spec.zeros)):  # codes, scales, zero points
        if tensor is None:
            continue
        if any(isinstance(step, Panels) for step in tensor.layout.steps):
            rows, row_length = tensors[slot].shape[1:]
            tensors[slot] = tensors[slot].reshape(1, -1).repeat(experts, n // sample_n).view(
                experts, rows, row_length * n // sample_n)
        else:
            tensors[slot] = tensors[slot].repeat(experts, 1, n // sample_n)
    tensors[5] = tensors[5].repeat(experts)  # the global scale (a stand-in for integer codes)
    weights = KernelWeights(spec, (experts, n, k), tuple(t.to(device) for t in tensors))
    act = torch.randn(experts, slots, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).to(device)
    return act, weights, dense.repeat(experts, n // sample_n, 1)


def bound_images(weights, chunks: int, image_copies: int | str, steps_first: bool = False) -> tuple:
    """The tensors `run_bound` copies the weights from with `image_copies` (none for 0)."""
    if not image_copies:
        return ()
    image = stage_image(weights, chunks, steps_first)
    _, n, k = weights.shape
    return split_image(image, weights.spec, n, k, chunks) if image_copies == "split" else (image,)


def run_bound(act, weights, picks, widths, out, chunks: int, stages: int, leave_out: str = "", images=(),
              image_copies: int | str = 0, steps_first: bool = False):
    """Launch the bound kernel on torch's stream: `act` as `stage_blocks` stores it,
    `picks` (experts,) int32 on the GPU, `width_picks` of the experts' slot counts and
    `widths`; `images` (`bound_images` of the weights at `chunks` and `image_copies`, in
    the order `steps_first` says): the weights copied from them in `image_bounds`'
    copies a stage."""
    experts, _, n = out.shape
    kernel, words = make_bound_kernel(weights.spec, n, weights.shape[2], widths, chunks, stages, leave_out,
                                      image_copies, steps_first)
    arrays = weights.arrays() + tuple(interop.to_kernel(tensor) for tensor in images)
    launch_kernel(kernel, (n // (CHUNK_N * chunks), experts), 128 + 64 * chunks, interop.to_kernel(act), arrays,
                  interop.to_kernel(picks), interop.to_kernel(out), shared_bytes=4 * words)


def bound_error(spec, counts: list[int], n: int, k: int, chunks: int, stages: int, device, *,
                image_copies: int | str = 0, steps_first: bool = False) -> float:
    """Largest error of the bound kernel's output (experts of `counts` slots) against
    float64 torch, relative to the output's largest magnitude (`image_copies` not 0: the
    weights from their `stage_image`, in `image_bounds`' copies a stage, in the order
    `steps_first` says)."""
    widths = widths_for(counts)
    act, weights, dense = bound_inputs(spec, len(counts), n, k, max(widths), 0, device, sample_n=n // 2)
    out = torch.zeros(len(counts), max(widths), n, dtype=torch.float32, device=device)
    picks = width_picks(counts, widths)
    run_bound(stage_blocks(act, [widths[p] if p >= 0 else 0 for p in picks]), weights,
              torch.tensor(picks, dtype=torch.int32, device=device), widths, out, chunks, stages,
              images=bound_images(weights, chunks, image_copies, steps_first), image_copies=image_copies,
              steps_first=steps_first)
    reference = act.double().cpu() @ dense.to(torch.bfloat16).double().transpose(1, 2)
    slots = torch.arange(max(widths)).view(1, -1, 1) < torch.tensor(counts).view(-1, 1, 1)  # the rows computed
    return float(torch.where(slots, out.double().cpu() - reference, 0).abs().max()
                 / torch.where(slots, reference, 0).abs().max())


def variant(text: str) -> tuple[int, int, str]:
    """'chunks:stages' or 'chunks:stages:left-out part' -> (chunks, stages, part)."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not all(part.isdigit() for part in parts[:2]) or (parts[2:] or [""])[0] not in LEFT_OUT:
        raise argparse.ArgumentTypeError(f"expected chunks:stages or chunks:stages:part with part one of "
                                         f"{LEFT_OUT[1:]}, got {text!r}")
    return int(parts[0]), int(parts[1]), (parts[2:] or [""])[0]


def image_copies_arg(text: str) -> int | str:
    """'tensors', 'split' or a count of copies (0: the native layout's)."""
    if text not in SPLIT_COPIES and not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a count of copies, 'tensors' or 'split', got {text!r}")
    return text if text in SPLIT_COPIES else int(text)


def main(argv=None) -> None:
    from bench_moe import Timer, captured, layer_gemms, matmul_rate, routed_batches

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", choices=sorted(SPECS), default="w4a16-g128", help="the weights' format")
    parser.add_argument("--slots", type=int, help="slots every expert takes (default: each its count in the "
                                                   "layer's routing of --tokens)")
    parser.add_argument("--variants", type=variant, nargs="+", default=[(2, 3, ""), (2, 4, "")],
                        help="chunks:stages to time (64-feature chunks a CTA, ring depth), or chunks:stages:part "
                             "without `part` (decode, fence, mma or act, the activations' copies: timing only)")
    parser.add_argument("--tokens", type=int, default=256, help="Mixtral tokens for the layer's own GEMMs")
    parser.add_argument("--one-width", action="store_true",
                        help="every expert's wgmma as wide as the most slots an expert has (one compiled width)")
    parser.add_argument("--image-copies", type=image_copies_arg, nargs="+", default=[0],
                        help="copies a stage of the weights: 0 from the native layout (`copy_panel`: a copy a tensor); "
                             "from the weights stored stage by stage (`stage_image`): n > 0 in n about equal copies, "
                             "'tensors' a copy for the codes and one for the scales and zero points, 'split' the "
                             "same from two tensors, each stored stage by stage")
    parser.add_argument("--steps-first", action="store_true",
                        help="the stage image's order: a step's feature tiles one after another (as a Tile of the "
                             "packed words would store them), not a CTA's stages")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("it times kernels on a CUDA GPU and none is available here (its check runs in the simulator: "
                     "tests/test_benchmarks.py)")
    spec, timer, generator = SPECS[args.format], Timer(), torch.Generator(device="cuda").manual_seed(0)
    rate = matmul_rate(timer)
    print(f"{torch.cuda.get_device_name()}; bf16 matmul {rate / 1e12:.0f} TFLOP/s; {args.format}")
    for chunks, stages in sorted({(chunks, stages) for chunks, stages, _ in args.variants}):
        for copies in args.image_copies:
            error = bound_error(spec, [37, 64], 512, 512, chunks, stages, "cuda", image_copies=copies,
                                steps_first=args.steps_first)
            print(f"check, {chunks} chunks, {stages} stages, image copies {copies}: largest error {error:.1e} of the "
                  f"largest output")
    _, _, _, layer, hidden, topk_weights, topk_ids = next(routed_batches(["mixtral"], [args.format], [args.tokens],
                                                                        generator))
    gemms = layer_gemms(layer, hidden, topk_weights, topk_ids)[:2]
    config = layer.config
    counts = (torch.full((config.num_experts,), args.slots) if args.slots else
              torch.bincount(topk_ids.flatten().long(), minlength=config.num_experts)).to(torch.int32).cuda()
    widths = widths_for(counts.tolist())
    widths = widths[-1:] if args.one_width else widths
    picks = width_picks(counts.tolist(), widths)
    print(f"slots an expert {counts.tolist()}: wgmma widths {widths}")
    pick_tensor = torch.tensor(picks, dtype=torch.int32, device="cuda")
    for name, gemm, n, k in (("gemm1", gemms[0], 2 * config.intermediate_size, config.hidden_size),
                             ("gemm2", gemms[1], config.hidden_size, config.intermediate_size)):
        own = timer(captured(gemm))
        flops = 2 * int(counts.sum()) * n * k
        print(f"{name} (N {n}, K {k}): the layer's own {own * 1e3:.1f} us at M = {args.tokens} "
              f"({2 * args.tokens * config.top_k * n * k / (own * 1e-3) / rate:.2f} of the matmul rate)")
        act, weights, _ = bound_inputs(spec, config.num_experts, n, k, max(widths), 1, "cuda")
        act = stage_blocks(act, [widths[p] if p >= 0 else 0 for p in picks])
        out = torch.empty(config.num_experts, max(widths), n, dtype=torch.float32, device="cuda")
        for (chunks, stages, leave_out), copies in itertools.product(args.variants, args.image_copies):
            images = bound_images(weights, chunks, copies, args.steps_first)
            ms = timer(captured(functools.partial(run_bound, act, weights, pick_tensor, widths, out, chunks, stages,
                                                  leave_out, images, copies, args.steps_first)))
            without = f", without {leave_out}" if leave_out else ""
            order = ", steps first" if args.steps_first else ""
            source = f", weights from their stage image ({copies} copies a stage{order})" if copies else ""
            print(f"  bound, {int(counts.sum())} slots, {chunks} chunks, {stages} stages{without}{source}: "
                  f"{ms * 1e3:.1f} us ({flops / (ms * 1e-3) / rate:.2f} of the matmul rate)", flush=True)
            del images
        del act, weights, out


if __name__ == "__main__":
    main()
