"""The grouped GEMM's prefill main loop: both operands staged through shared memory.

A prefill tile (`a_in_shared=True`) runs a `stages`-deep pipeline of `cp.async` copies
that brings each stage of `warps_k * slabs_per_warp` slabs into shared memory (dynamic
shared memory, `gemm.stage_buffer_bytes`): the block's activation rows, padded by 4 words
so that `ldmatrix` rows hit 32 different banks, and the CTA's weight words, scales and
zero points as stored (`fragments.staged_weights`). Meanwhile the warps multiply an
earlier stage: A fragments by `ldmatrix`, B fragments decoded from shared words. Each
warp's 16-row m tiles reuse every decoded B fragment, so wide warps (64 rows) amortise
the dequantisation; with `trim_padding`, only the tiles up to the block's last slot run
(an expert's last block is part padding).

Two slabs' operands live in registers: a slab's mma are issued while the next slab is
loaded and decoded, and a stage's barrier comes before its last slab's mma, so the
integer work of dequantisation fills the tensor pipe's gaps (on the H200 the two Mixtral
GEMMs at M = 4096 went from 9.8 to 8.6 ms with 64-feature stages).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

from numba import cuda, uint32

from . import ptx
from .fragments import NO_COPY, SLAB_K
from .gemm_plan import GemmPlan, chain, multiplier


class PrefillSteps(NamedTuple):
    """The prefill pipeline's device functions (see `prefill_steps`)."""

    plan_activation_copies: Callable
    issue_stage: Callable
    wait_first_stage: Callable
    run_prefill: Callable


def prefill_steps(plan: GemmPlan) -> PrefillSteps:
    """The device functions of `plan`'s prefill pipeline:

    plan_activation_copies: once per CTA, where this thread's activation copies come from
                            and go to;
    issue_stage:            start the copies of one stage into a buffer (one commit group);
    wait_first_stage:       wait until the first stage has landed (this thread's copies);
    run_prefill:            the main loop (`used` m tiles first: one copy of the loop per
                            count with `trim_padding`, else one).
    """
    tile, staged = plan.tile, plan.staged
    decode, copy_async, ldmatrix4 = plan.reader.decode, ptx.copy_async, ptx.ldmatrix4
    block_m, threads, stages = tile.block_m, tile.threads, tile.stages
    depth, stage_slabs = tile.slabs_per_warp, tile.stage_slabs
    m_tiles, row_words, pairs_per_row = plan.m_tiles, tile.row_words, plan.pairs_per_row
    a_units_per_row, a_units, a_copies = plan.a_units_per_row, plan.a_units, plan.a_copies
    stage_words = staged.stage_words
    copy_weights, copy_weights_partial, fetch_weights = staged.copy, staged.copy_partial, staged.fetch
    wait_copies = ptx.wait_copies[max(stages - 2, 0)]

    @ptx.device
    def plan_activation_copies(slots, num_slots, rows_div, thread, a_source, a_target, a_slab):
        """Once per CTA: where this thread's 16-byte activation copies come from (flat pair
        offset at stage 0, NO_COPY for none), go to (word in a stage buffer) and which slab of
        the stage they belong to; the same for every stage, shifted by the stage's K."""
        for i in range(a_copies):
            unit = uint32(thread) + uint32(i * threads)
            a_source[i], a_target[i], a_slab[i] = NO_COPY, 0, 0
            if unit < uint32(a_units):
                m, c = unit // uint32(a_units_per_row), unit % uint32(a_units_per_row)
                slot = slots[m]
                row = slot // rows_div if slot < num_slots else 0  # padding rows read row 0
                a_source[i] = uint32(row) * uint32(pairs_per_row) + 4 * c
                a_target[i] = m * uint32(row_words) + 4 * c
                a_slab[i] = c // uint32(2)

    def activation_copier(checked: bool):
        """This thread's copies of the block's activations for a stage at word `base`;
        `checked`: zero-fill the slabs at or past `remaining`."""

        @ptx.device
        def copy_activations(act, stage, remaining, a_source, a_target, a_slab, a_tiles, base):
            advance = stage * uint32(SLAB_K // 2)  # the stage's first pair along K
            for i in range(a_copies):
                if i < a_units // threads or a_source[i] != NO_COPY:
                    if checked:
                        present = a_slab[i] < remaining
                        copy_async(a_tiles, base + a_target[i], act, advance if present else uint32(0),
                                   a_source[i] if present else uint32(0), 16 if present else 0)
                    else:
                        copy_async(a_tiles, base + a_target[i], act, advance, a_source[i], 16)

        return copy_activations

    copy_activations, copy_activations_partial = activation_copier(False), activation_copier(True)

    @ptx.device
    def issue_stage(act, weights, stage, end_slab, a_source, a_target, a_slab, w_source, a_tiles, w_tiles, buffer,
                    thread):
        """Start the copies of `stage` into `buffer`: one commit group, empty past the end."""
        if stage < end_slab:
            remaining = uint32(end_slab - stage)
            a_base, w_base = uint32(buffer) * uint32(block_m * row_words), uint32(buffer) * uint32(stage_words)
            if remaining >= uint32(stage_slabs):
                copy_activations(act, stage, remaining, a_source, a_target, a_slab, a_tiles, a_base)
                copy_weights(weights, w_source, stage, w_tiles, w_base, thread)
            else:
                copy_activations_partial(act, stage, remaining, a_source, a_target, a_slab, a_tiles, a_base)
                copy_weights_partial(weights, w_source, stage, remaining, w_tiles, w_base, thread)
        ptx.commit_copies()


    def prefill_loop(tiles: int):
        """run(weights, expert, start_slab, end_slab, ...): the prefill main loop over the
        first `tiles` m tiles of each warp, from the first staged slab to the last."""
        multiply_tiles = multiplier(plan, tiles)

        @ptx.device
        def load_slab(weights, expert, slab, local_slab, read_chunk, chunk, lane, a_lane, a_tiles, w_tiles, buffer,
                      raw, params, frags, a_words):
            """This warp's operands of one staged slab into registers: A by ldmatrix, B
            decoded from the shared words of its chunk `read_chunk` (`a_lane`: the word of
            this lane's ldmatrix row in a stage buffer)."""
            fetch_weights(w_tiles, buffer, local_slab, read_chunk, lane, raw)
            first = buffer * (block_m * row_words) + a_lane + local_slab * (SLAB_K // 2)
            for mt in range(tiles):
                a_words[mt, 0], a_words[mt, 1], a_words[mt, 2], a_words[mt, 3] = ldmatrix4(
                    a_tiles, first + mt * (16 * row_words))
            decode(raw, params, weights, expert, slab, chunk, lane, frags)

        def slab_step(d: int):
            """Step d of a stage's slabs: load slab d + 1 into the free register slot (for
            the last step: wait for the next stage, then load its first slab), multiply
            slab d. Built per d in Python and chained (`chain`: same arguments), so no loop
            is left for the compiler to decide whether to unroll: it kept a 4-slab loop
            rolled for NVFP4, with the slots in local memory."""
            slot, free, last = d % 2, (d + 1) % 2, d + 1 == depth

            @ptx.device
            def step(weights, expert, stage, own, read_chunk, chunk, lane, a_lane, a_tiles, w_tiles, buffer, after,
                     raw, params, frag_slots, a_slots, acc):
                if last:
                    wait_copies()  # the next stage has landed (every older group)...
                    cuda.syncthreads()  # ...for every thread, and no warp reads `buffer` any more
                    # The next stage's first slab (past the end: unused words of a spare buffer).
                    load_slab(weights, expert, stage + stage_slabs + own, own, read_chunk, chunk, lane, a_lane,
                              a_tiles, w_tiles, after, raw, params, frag_slots[free], a_slots[free])
                else:
                    load_slab(weights, expert, stage + own + d + 1, own + d + 1, read_chunk, chunk, lane, a_lane,
                              a_tiles, w_tiles, buffer, raw, params, frag_slots[free], a_slots[free])
                multiply_tiles(frag_slots[slot], a_slots[slot], acc)

            return step

        multiply_stage = functools.reduce(chain, [slab_step(d) for d in range(depth)])

        @ptx.device
        def run(act, weights, expert, start_slab, end_slab, own, read_chunk, chunk, lane, a_lane, a_tiles, w_tiles,
                raw, params, frag_slots, a_slots, acc, a_source, a_target, a_slab, w_source, tid):
            load_slab(weights, expert, start_slab + own, own, read_chunk, chunk, lane, a_lane, a_tiles, w_tiles, 0,
                      raw, params, frag_slots[0], a_slots[0])
            stage, buffer = start_slab, uint32(0)  # 32-bit counters (the caller's uint32 bounds)
            while stage < end_slab:
                after = uint32(buffer + 1) if buffer < uint32(stages - 1) else uint32(0)
                multiply_stage(weights, expert, stage, own, read_chunk, chunk, lane, a_lane, a_tiles, w_tiles,
                               buffer, after, raw, params, frag_slots, a_slots, acc)
                issue_stage(act, weights, uint32(stage + stages * stage_slabs), end_slab, a_source, a_target, a_slab,
                            w_source, a_tiles, w_tiles, buffer, tid)
                if depth % 2:  # the next stage's first slab went to slot 1
                    for i in range(16):
                        frag_slots[0, i] = frag_slots[1, i]
                    for mt in range(tiles):
                        for w in range(4):
                            a_slots[0, mt, w] = a_slots[1, mt, w]
                stage = uint32(stage + stage_slabs)
                buffer = after

        return run

    def loop_choice(tiles: int, fewer):
        """run_prefill(used, ...): the loop over `tiles` m tiles if `used` is that many,
        else `fewer` (the choice for fewer tiles; None: this loop whatever `used` is)."""
        loop = prefill_loop(tiles)
        if fewer is None:
            @ptx.device
            def only(used, *args):
                loop(*args)

            return only

        @ptx.device
        def choose(used, *args):
            if used == tiles:
                loop(*args)
            else:
                fewer(used, *args)

        return choose

    # trim_padding: a block whose last m tiles hold padding only runs a copy of the loop
    # without them, one copy per count of tiles in use: no branch inside a loop (a branch
    # per m tile in the loop made every prefill GEMM slower, BENCHMARKS.md).
    trims = tile.trim_padding
    run_prefill = functools.reduce(lambda fewer, tiles: loop_choice(tiles, fewer),
                                   range(1 if trims else m_tiles, m_tiles + 1), None)
    return PrefillSteps(plan_activation_copies, issue_stage, ptx.wait_copies[stages - 1], run_prefill)
