"""gemm1's activation finished by pairs of warps, in the GEMM's epilogue.

On a tile whose warps come in gate/up pairs (`GemmTile.pairs_warps`, allowed by
`gemm.paired_activation`) the CTA's first warps_n / 2 warps multiply gate chunks and the
others the up chunks of the same features, so the two warps of a pair hold a feature's
gate and up at the same fragment positions. Each hands the half of its tile that its
partner finishes over through shared memory (a prefill tile's idle stage buffers, a
decode tile's own words), rounded to halves as gemm1's output would be, then writes
act(gate) * up for its own half, computed as the activation kernel computes it. gemm1's
output never goes to memory, and no partials, fences or counters are needed.
"""

from __future__ import annotations

import functools

from numba import int16, int32, uint32

from . import ptx
from .activation import Activation, _pointwise
from .fragments import CHUNK_N
from .gemm_plan import GemmPlan, chain
from .rows import ZERO


def pair_roles(plan: GemmPlan, activation: Activation) -> tuple:
    """((hand_over, finish) of the gate warp, (hand_over, finish) of the up warp):

    hand_over(acc, exchange, team, multiplier, lane): write the half of this warp's tile
        that its partner finishes;
    finish(acc, exchange, out, slots, num_slots, partner, gate_chunk, multiplier,
        first_row, lane): write act(gate, up) for this warp's half, the partner's operands
        read from the exchange.
    """
    apply, half_to_f32 = _pointwise(activation), ptx.half_to_f32(plan.half)
    pack2, to_half, m_tiles = ptx.pack2(plan.half), ptx.to_half(plan.half), plan.m_tiles

    def swapped_pair_half(is_up: bool):
        """pair_half for swapped tiles, whose accumulator (j, 0, 2h + r) holds feature
        16 j + 8 h + g of slot 2t + r: the gate warp finishes j = 0, 1, the up warp 2, 3;
        an exchange word holds a feature's two slots."""
        keep, give = (2, 0) if is_up else (0, 2)

        @ptx.device
        def hand_over(acc, exchange, team, multiplier, lane):
            for q in range(2):
                for h in range(2):
                    exchange[((team * 2 + q) * 2 + h) * 32 + lane] = pack2(acc[give + q, 0, 2 * h] * multiplier,
                                                                           acc[give + q, 0, 2 * h + 1] * multiplier)

        @ptx.device
        def finish(acc, exchange, out, slots, num_slots, partner, gate_chunk, multiplier, first_row, lane):
            g, t = lane // 4, lane % 4
            first_slot, second_slot = slots[2 * t], slots[2 * t + 1]
            for q in range(2):
                for h in range(2):
                    own = pack2(acc[keep + q, 0, 2 * h] * multiplier, acc[keep + q, 0, 2 * h + 1] * multiplier)
                    other = exchange[((partner * 2 + q) * 2 + h) * 32 + lane]
                    gate, up = (other, own) if is_up else (own, other)
                    col = uint32(gate_chunk * CHUNK_N + 16 * (keep + q) + 8 * h) + uint32(g)
                    for r in range(2):  # the word's low half is slot 2t, its high half slot 2t + 1
                        slot = first_slot if r == 0 else second_slot
                        if slot < num_slots:
                            shift = uint32(16 * r)
                            value = apply(ZERO + half_to_f32(gate >> shift), ZERO + half_to_f32(up >> shift))
                            out[uint32(slot), col] = int16(to_half(value))

        return hand_over, finish

    def pair_half(is_up: bool):
        """hand_over and finish for the gate (False) or the up (True) warp of a pair: the
        gate warp finishes n8 tiles 0-3, the up warp 4-7. Built per role and per (m tile,
        row half) in Python and chained (`chain`), so every accumulator index is a constant:
        a loop the compiler kept rolled put `acc` in local memory, main loop included."""
        keep, give = (4, 0) if is_up else (0, 4)

        def hand_over_step(mt: int):
            @ptx.device
            def hand_over(acc, a_tiles, team, multiplier, lane):
                """Write the half of this warp's tile that its partner finishes, rounded
                to halves as gemm1's output would be."""
                for q in range(4):
                    for r in range(2):
                        a_tiles[((team * m_tiles + mt) * 8 + 2 * q + r) * 32 + lane] = pack2(acc[mt, give + q, 2 * r] * multiplier,
                                                      acc[mt, give + q, 2 * r + 1] * multiplier)

            return hand_over

        def finish_step(mt: int, r: int):
            @ptx.device
            def finish(acc, a_tiles, out, slots, num_slots, partner, gate_chunk, multiplier, first_row, lane):
                """out[slot, c] = act(gate, up) for this warp's half of one row, its partner's
                operands read from the exchange; computed as the activation kernel computes
                it from gemm1's half outputs (0 + x in float32, `apply`, rounded once)."""
                slot = slots[first_row + 16 * mt + lane // 4 + 8 * r]
                if slot < num_slots:
                    for q in range(4):
                        own = pack2(acc[mt, keep + q, 2 * r] * multiplier, acc[mt, keep + q, 2 * r + 1] * multiplier)
                        other = a_tiles[((partner * m_tiles + mt) * 8 + 2 * q + r) * 32 + lane]
                        gate, up = (other, own) if is_up else (own, other)
                        first = apply(ZERO + half_to_f32(gate), ZERO + half_to_f32(up))
                        second = apply(ZERO + half_to_f32(gate >> uint32(16)), ZERO + half_to_f32(up >> uint32(16)))
                        out[uint32(slot), uint32(gate_chunk * (CHUNK_N // 2) + lane % 4) + uint32(4 * (keep + q))] = int32(
                            pack2(first, second))  # columns gate_chunk * 64 + 8 (keep + q) + 2t, + 1

            return finish

        return (functools.reduce(chain, [hand_over_step(mt) for mt in range(m_tiles)]),
                functools.reduce(chain, [finish_step(mt, r) for mt in range(m_tiles) for r in range(2)]))

    roles = swapped_pair_half if plan.tile.swap_ab else pair_half
    return roles(False), roles(True)
