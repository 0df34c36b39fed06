"""The grouped GEMM's decode main loop: operands straight from global memory.

A decode tile (`a_in_shared=False`) has each lane load its weight words and its few
activation words straight from global memory (activations are L1/L2-resident), with no
barrier in the main loop, so every warp streams its weights independently: a contiguous
run of its K split's slabs (whole scale groups), `slabs_per_warp` slabs a batch, two
batches in flight (the one multiplied while the next loads). The run is checked against
its end a batch at a time where every run is whole batches (K, split and run multiples of
`slabs_per_warp`), else a slab at a time; with `GemmTile.steady_loop` a copy of the loop
without checks runs while whole batches remain.

Swapped tiles over 4-bit integer codes defer the zero point and scale to once per scale
group (`fragments.DeferredScales`): a slab's dequantisation is then a shift and a `lop3`
per register, plus one mma that sums the activations, and each group folds its sums into
the accumulators in float32.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from numba import float32, uint32

from . import ptx
from .elements import logical_k
from .fragments import SLAB_K
from .gemm_plan import GemmPlan, multiplier


class DecodeSteps(NamedTuple):
    """The decode loop's device functions (see `decode_steps`)."""

    fetch_batch: Callable
    two_batches: Callable
    two_whole_batches: Callable
    fetch_weight_words: Callable
    fetch_a_words: Callable


def decode_steps(plan: GemmPlan) -> DecodeSteps:
    """The device functions of `plan`'s decode loop, each taking (act, weights, expert,
    first slab, end slab, chunk, lane, rows, ...):

    fetch_batch:        issue the loads of one batch (weight and A words);
    two_batches:        multiply the loaded batch while the next loads, twice; returns the
                        next batch's slab and the scale group held;
    two_whole_batches:  the same without range checks (`GemmTile.steady_loop`);
    fetch_weight_words, fetch_a_words: fetch_batch's two halves, for a kernel that issues
                        its first weight loads before it waits (`alignment_ready`).
    """
    reader, tile = plan.reader, plan.tile
    group_of_slab, column_params = reader.group_of_slab, reader.column_params
    fetch, decode = reader.fetch, reader.decode
    load_word, mma, stored_k = ptx.load_written[1], ptx.mma(plan.half), logical_k(plan.spec)  # activations
    depth, m_tiles, row_halves, acc_i = tile.slabs_per_warp, plan.m_tiles, plan.row_halves, plan.acc_shape[0]
    size_k, pair_loads, flat_a = plan.k, plan.pair_loads, plan.flat_a
    deferred = plan.deferred
    defers = deferred is not None
    codes, group_scale, group_offset = (deferred.codes, deferred.scale, deferred.offset) if defers else (None,) * 3
    one_pair, group_slabs, run_end_folds = plan.one_pair, uint32(plan.group_slabs), plan.run_end_folds
    multiply = multiplier(plan, m_tiles)

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
        multiply(frags, a_words, acc)
        return slab_group

    @ptx.device
    def multiply_codes(raw, a_words, frags, gacc, a_sum):
        """gacc += (M + q) @ B for one slab, and a_sum += the slab's activations summed
        over k (an mma whose A is all ones: every row the same sums)."""
        codes(raw, frags)
        multiply(frags, a_words, gacc)
        a_sum[0], a_sum[1], a_sum[2], a_sum[3] = mma(one_pair, one_pair, one_pair, one_pair, a_words[0, 0],
                                                     a_words[0, 1], a_sum[0], a_sum[1], a_sum[2], a_sum[3])

    @ptx.device
    def fold_group(raw, acc, gacc, a_sum):
        """acc += s (gacc - (M + z) a_sum) for the group whose scale words `raw` holds
        (accumulator (j, 0, 2 h + r): feature 16 j + 8 h + g, the lane's column 2 j + h,
        slot 2 t + r); then start the next group from zero."""
        for j in range(acc_i):
            for h in range(2):
                scale, offset = group_scale(raw, 2 * j + h), group_offset(raw, 2 * j + h)
                for r in range(2):
                    acc[j, 0, 2 * h + r] += scale * (gacc[j, 0, 2 * h + r] - offset * a_sum[r])
                    gacc[j, 0, 2 * h + r] = float32(0.0)
        for c in range(4):
            a_sum[c] = float32(0.0)

    def range_check(check: str | None):
        """in_range(first_slab, slab, end_slab): whether `slab` of the batch at first_slab
        is short of end_slab, as far as `check` (batch_steps) needs to know."""
        per_slab, per_batch = check == "slab", check == "batch"

        @ptx.device
        def in_range(first_slab, slab, end_slab):
            if per_slab:
                return slab < end_slab
            if per_batch:
                return first_slab < end_slab
            return True

        return in_range

    @ptx.device
    def a_word(act, weights, expert, row, slab, t, r):
        """The lane's activation pair of `row` at k = 16 slab + 2t + 8r. With flat loads
        `row` is already the pair offset of (row, 2t): one add per slab, the rest immediate."""
        if flat_a:
            return load_word(act, row + slab * (SLAB_K // 2) + 4 * r)
        return activation_pair(act, weights[4], expert, row, slab * SLAB_K + 2 * t + 8 * r)

    def batch_fetcher(check: str | None, weight_words: bool = True, a_words: bool = True):
        """fetch_batch(act, weights, expert, first_slab, end_slab, chunk, lane, rows, raw,
        a_raw): issue the loads of `depth` slabs (first_slab + d), their weight words and/or
        A words; `check`: see batch_steps."""
        in_range = range_check(check)

        @ptx.device
        def fetch_batch(act, weights, expert, first_slab, end_slab, chunk, lane, rows, raw, a_raw):
            t = lane % 4
            for d in range(depth):
                slab = first_slab + d
                if in_range(first_slab, slab, end_slab):
                    if weight_words:
                        fetch(weights, expert, slab, chunk, lane, raw[d])
                    if a_words:
                        for mt in range(m_tiles):  # word w: row w % row_halves at k + 8 (w // row_halves)
                            for w in range(2 * row_halves):  # A: a0..a3; swapped B: b0, b1 of slot g
                                a_raw[d, mt, w] = a_word(act, weights, expert, rows[mt, w % row_halves], slab, t,
                                                         w // row_halves)

        return fetch_batch

    def batch_steps(check: str | None):
        """fetch_batch and two_batches for `depth` slabs per batch; `check`: "slab" skips
        the slabs at or past end_slab (a run's last batches), "batch" the batches at or past
        it (`whole_batches`: one compare and branch a batch), None none (every slab in
        range and short of the run's last: `GemmTile.steady_loop`)."""
        fetch_batch, in_range = batch_fetcher(check), range_check(check)
        folds_at_end = run_end_folds and check is not None

        @ptx.device
        def multiply_batch(weights, expert, first_slab, end_slab, chunk, lane, raw, a_raw, params, frags, group, acc,
                           gacc, a_sum):
            for d in range(depth):
                slab = first_slab + d
                if in_range(first_slab, slab, end_slab):
                    if defers:
                        multiply_codes(raw[d], a_raw[d], frags, gacc, a_sum)
                        if (uint32(slab) + uint32(1)) % group_slabs == 0 or (
                                folds_at_end and slab + 1 == end_slab):
                            fold_group(raw[d], acc, gacc, a_sum)  # the group's last slab in this run
                    else:
                        group = multiply_slab(weights, expert, slab, chunk, lane, raw[d], params, frags, group,
                                              a_raw[d], acc)
            return group

        @ptx.device
        def two_batches(act, weights, expert, slab_a, end_slab, chunk, lane, rows, raw_a, a_raw_a, raw_b, a_raw_b,
                        params, frags, group, acc, gacc, a_sum):
            """Multiply the loaded batch at slab_a while the next one loads, then that one
            while the batch after it loads (into a's registers); returns its slab and the group."""
            slab_b = slab_a + depth
            fetch_batch(act, weights, expert, slab_b, end_slab, chunk, lane, rows, raw_b, a_raw_b)
            group = multiply_batch(weights, expert, slab_a, end_slab, chunk, lane, raw_a, a_raw_a, params, frags,
                                   group, acc, gacc, a_sum)
            slab_a = slab_b + depth
            fetch_batch(act, weights, expert, slab_a, end_slab, chunk, lane, rows, raw_a, a_raw_a)
            group = multiply_batch(weights, expert, slab_b, end_slab, chunk, lane, raw_b, a_raw_b, params, frags,
                                   group, acc, gacc, a_sum)
            return slab_a, group

        return fetch_batch, two_batches

    edge = "batch" if plan.whole_batches else "slab"
    (fetch_batch, two_batches), (_, two_whole_batches) = batch_steps(edge), batch_steps(None)
    return DecodeSteps(fetch_batch, two_batches, two_whole_batches, batch_fetcher(edge, a_words=False),
                       batch_fetcher(edge, weight_words=False))
