"""Reductions a grouped GEMM finishes itself: the activation after gemm1, the combine after gemm2.

At decode the activation and the combine read a few kilobytes each, yet each is one more
kernel in the layer's sequence, and a kernel boundary costs microseconds whatever the
kernel does: on the H200 the two took about 6 of Qwen3's 31 us per layer at M = 1. So a
GEMM can take the reduction that reads its output (`then=` of `gemm.grouped_gemm`):

1. every CTA writes its float32 partials (split_k, slots, N) as usual;
2. after a `syncthreads` it publishes them and counts itself in one atomic (`ptx.arrive`,
   a release and an acquire at GPU scope) in the arrival counter of every output tile its
   partials feed;
3. the CTA whose arrival completes a counter is the last writer of that tile: it sums the
   partials in the separate kernel's fixed order (splits ascending, slots ascending), so
   the result is bitwise the same, writes the finished halves and resets the counter to
   zero for the next call (the counters start as zeros and every call leaves them so).

    activation (gemm1): an output tile is `block_n` outputs of one token block; it needs
                        the gate and the up tile of every split. Halves [gate | up]: the
                        CTA columns y and y + I / block_n (2 S arrivals; I must divide
                        into block_n columns); interleaved (gpt-oss) or not gated: one
                        column (S arrivals).
    combine (gemm2):    an output tile is a token's row of one CTA column; it needs each
                        of the token's top_k slots from every split: top_k S arrivals, one
                        per slot, counted by whichever block holds the slot.

Every CTA's tail grows by a barrier, a counter round trip and (the last) a round of L2
reads: on the H200 that paid at 1 to 4 tokens, where the grid is one wave, and lost
where it is several (`moe.oracle`: only the tuner sets `GemmTile.fused_reduction`). The last CTA reads partials that
other CTAs wrote during this launch, so it loads them past the incoherent L1
(`ptx.load_coherent`). This is the serial split-K reduction of
CUTLASS's semaphore epilogue, with the counters in the caller's workspace.

A tile of paired warps (every prefill tile, whose grid is many waves; a decode tile with
two or more warps along N and no K split) finishes only the activation, and without
counters: its CTAs hold both halves of their outputs (`gemm.paired_activation`);
`check_fused(counters=False)` validates that case.
"""

from __future__ import annotations

import functools

import attrs
import torch
from numba import cuda, float32, int16, int32, int64, uint32

from . import interop
from .activation import Activation, _pointwise
from .ptx import arrive, bits_f32, device, load_coherent, to_half
from .rows import ZERO


@attrs.frozen(eq=False)
class FusedActivation:
    """gemm1's `then`: out (slots, I) = activation(gate, up) of the summed partials."""

    activation: Activation
    out: torch.Tensor
    arrivals: torch.Tensor

    @property
    def kind(self) -> tuple:
        return activation_kind(self.activation)


@attrs.frozen(eq=False)
class FusedCombine:
    """gemm2's `then`: out (M, H) = the topk_weights-weighted sum of each token's slots."""

    topk_weights: torch.Tensor
    out: torch.Tensor
    arrivals: torch.Tensor

    @property
    def kind(self) -> tuple:
        return combine_kind(self.topk_weights.shape[1])


def activation_kind(activation: Activation) -> tuple:
    """The compile-time part of a `FusedActivation` (what `make_finisher` takes)."""
    return ("activation", activation)


def combine_kind(top_k: int) -> tuple:
    """The compile-time part of a `FusedCombine`."""
    return ("combine", top_k)


def gate_up_halves(activation: Activation) -> bool:
    """Gate and up in two halves [gate | up] of the row, so in two CTA columns."""
    return activation.gated and not activation.interleaved


def activation_fusable(activation: Activation, n: int, block_n: int) -> bool:
    """Whether gemm1 (n = 2I gate/up outputs, CTAs of block_n columns) can finish
    `activation`: halves need the gate and up tiles of a feature in two whole columns."""
    return not gate_up_halves(activation) or (n // 2) % block_n == 0


def activation_tiles(activation: Activation, n: int, block_n: int) -> int:
    """Output tiles per token block of gemm1 (n gate/up outputs): arrival counters per block."""
    return n // 2 // block_n if gate_up_halves(activation) else -(-n // block_n)


def arrivals_needed(kind: tuple, n: int, block_n: int, blocks: int, tokens: int) -> int:
    """Arrival counters a fused GEMM of `blocks` token blocks over `tokens` tokens uses."""
    if kind[0] == "activation":
        return blocks * activation_tiles(kind[1], n, block_n)
    return tokens * -(-n // block_n)


def check_fused(then, *, n: int, block_n: int, blocks: int, num_slots: int, half: torch.dtype,
                counters: bool = True):
    """Validate `then` of a GEMM with n outputs (raises ValueError/TypeError naming the
    argument); returns its kernel arrays (out, arrivals, topk_weights or None). Without
    `counters` (the epilogue of paired warps, `gemm.paired_activation`) no CTA columns need
    splitting and no arrival counters are read."""
    if isinstance(then, FusedActivation):
        if not isinstance(then.activation, Activation):
            raise TypeError(f"then.activation must be an Activation, got {type(then.activation).__name__}")
        if counters and not activation_fusable(then.activation, n, block_n):
            raise ValueError(f"a fused {then.activation.name} needs I = {n // 2} to split into whole CTA columns of "
                             f"{block_n}: run numba_kernels.activation.activate after the GEMM instead")
        width = then.activation.output_width(n)
        out = interop.check_tensor("then.out", then.out, dtype=half, shape=(num_slots, width))
        tokens, weights = 0, None
    elif isinstance(then, FusedCombine):
        weights = interop.check_tensor("then.topk_weights", then.topk_weights, dtype=torch.float32, ndim=2)
        tokens, top_k = weights.shape
        if tokens * top_k != num_slots:
            raise ValueError(f"then.topk_weights {tuple(weights.shape)} must hold num_slots = {num_slots} weights")
        out = interop.check_tensor("then.out", then.out, dtype=half, shape=(tokens, n))
    else:
        raise TypeError(f"then must be a FusedActivation or a FusedCombine, got {type(then).__name__}")
    needed = arrivals_needed(then.kind, n, block_n, blocks, tokens) if counters else 0
    arrivals = interop.check_tensor("then.arrivals", then.arrivals, dtype=torch.int32, ndim=1)
    if arrivals.shape[0] < needed:
        raise ValueError(f"then.arrivals holds {arrivals.shape[0]} counters, this GEMM needs {needed} (zeros)")
    return out, arrivals, weights


@functools.cache
def make_finisher(kind: tuple, n: int, block_m: int, block_n: int, split_k: int, threads: int, half: str):
    """Device function finish(partials, out, arrivals, topk_weights, slots, num_slots,
    block, column, tid) that every thread of a CTA calls after writing its partials:
    `partials` (split_k, slots, n) float32, `slots` the block's slot ids (shared),
    `column` the CTA's column index; see the module docstring."""
    encode = to_half(half)

    @device
    def partial(partials, s, slot, col):
        return bits_f32(load_coherent(partials, (int64(s) * partials.shape[1] + slot) * partials.shape[2] + col))

    if kind[0] == "activation":
        activation = kind[1]
        apply = _pointwise(activation)
        gated, interleaved = activation.gated, activation.interleaved
        tiles = activation_tiles(activation, n, block_n)
        expected = (2 if gate_up_halves(activation) else 1) * split_k
        outputs = block_n // 2 if interleaved else block_n  # finished outputs per tile
        per_thread = -(-block_m * outputs // threads)
        width = activation.output_width(n)
        gate_step, up_at = (2, 1) if interleaved else (1, n // 2)  # output c: gate gate_step * c, up + up_at

        @device
        def finish_activation(partials, out, arrivals, topk_weights, slots, num_slots, block, column, tid):
            last = cuda.shared.array(1, int32)
            cuda.syncthreads()
            tile = column % tiles
            counter = block * tiles + tile
            if tid == 0:
                last[0] = int32(arrive(arrivals, counter) == expected - 1)
            cuda.syncthreads()
            if last[0]:
                if tid == 0:
                    arrivals[counter] = 0
                gate = cuda.local.array(per_thread, float32)
                up = cuda.local.array(per_thread, float32)
                for r in range(per_thread):  # every load first: the stores below could alias them
                    e = tid + r * threads
                    gate[r], up[r] = ZERO, ZERO
                    if e < block_m * outputs:
                        slot = slots[e // outputs]
                        c = tile * outputs + e % outputs
                        if slot < num_slots and c < width:
                            for s in range(split_k):
                                gate[r] += partial(partials, s, slot, gate_step * c)
                                if gated:
                                    up[r] += partial(partials, s, slot, gate_step * c + up_at)
                for r in range(per_thread):
                    e = tid + r * threads
                    if e < block_m * outputs:
                        slot = slots[e // outputs]
                        c = tile * outputs + e % outputs
                        if slot < num_slots and c < width:
                            out[slot, c] = int16(encode(apply(gate[r], up[r])))

        return finish_activation

    top_k = kind[1]
    expected = top_k * split_k
    columns_per_thread = -(-block_n // threads)

    @device
    def finish_combine(partials, out, arrivals, topk_weights, slots, num_slots, block, column, tid):
        last = cuda.shared.array(block_m, int32)
        cuda.syncthreads()
        columns = -(-n // block_n)
        if tid < block_m:
            slot = uint32(slots[tid])  # unsigned: a slot in use is below num_slots, its token a 32-bit division
            finished = 0
            if slot < uint32(num_slots):
                counter = slot // uint32(top_k) * uint32(columns) + column
                if arrive(arrivals, counter) == expected - 1:
                    arrivals[counter] = 0
                    finished = 1
            last[tid] = finished
        cuda.syncthreads()
        total = cuda.local.array((block_m, columns_per_thread), float32)
        for i in range(block_m):  # every load first: the stores below could alias them
            for q in range(columns_per_thread):
                total[i, q] = ZERO
                c = column * block_n + tid + q * threads
                if last[i] and tid + q * threads < block_n and c < n:
                    first = uint32(slots[i]) // uint32(top_k) * uint32(top_k)  # the token's first slot
                    for j in range(top_k):
                        slot_sum = ZERO
                        for s in range(split_k):
                            slot_sum += partial(partials, s, first + uint32(j), c)
                        total[i, q] += topk_weights[first + uint32(j)] * slot_sum
        for i in range(block_m):
            for q in range(columns_per_thread):
                c = column * block_n + tid + q * threads
                if last[i] and tid + q * threads < block_n and c < n:
                    out[uint32(slots[i]) // uint32(top_k), c] = int16(encode(total[i, q]))

    return finish_combine
