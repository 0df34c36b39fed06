"""The compile-time numbers of one grouped GEMM, and the pieces its loops share.

A `GemmPlan` is a `gemm.GemmTile` laid over one problem: weights stored as `spec` with
logical shape (n, k) per expert, `half` activations read as pairs or single halves. Every
count the kernel is generated from (m tiles per warp, accumulator tiles, slabs per K
split and per warp, copies per thread, ...) is defined here once; `gemm.make_grouped_gemm`
and the loops it is built from (`gemm_decode`, `gemm_prefill`, `gemm_pairs`) read them as
closure constants.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
from numba import uint32

from layouts import QuantSpec

from . import ptx
from .fragments import CHUNK_N, HALF_CONSTANTS, SLAB_K, FragmentReader, StagedWeights, fragment_reader, staged_weights

if TYPE_CHECKING:
    from .gemm import GemmTile


@attrs.frozen
class GemmPlan:
    """`tile` on weights `spec` of logical shape (n, k) per expert, `half` activations,
    read as half pairs (`pair_loads`) or one half at a time."""

    spec: QuantSpec
    n: int
    k: int
    tile: GemmTile
    half: str
    pair_loads: bool

    @property
    def reader(self) -> FragmentReader:
        """How a lane reads and decodes its weights (`fragments`)."""
        return fragment_reader(self.spec, self.n, self.k, self.half)

    @property
    def warp_rows(self) -> int:
        return self.tile.block_m // self.tile.warps_m

    @property
    def m_tiles(self) -> int:
        """16-row A tiles of activations per warp (one 8-slot B tile when swapped)."""
        return 1 if self.tile.swap_ab else self.warp_rows // 16

    @property
    def acc_shape(self) -> tuple[int, int]:
        """Accumulator tiles (i, j) of a warp: (m tile, n8 tile of features), or (16
        features, the 8 slots) swapped."""
        return (CHUNK_N // 16, 1) if self.tile.swap_ab else (self.m_tiles, 8)

    @property
    def row_halves(self) -> int:
        """Activation rows a lane reads per m tile: g (and g + 8)."""
        return 1 if self.tile.swap_ab else 2

    @property
    def teams(self) -> int:
        """Warps that own distinct output tiles (the warps along K of each share them)."""
        return self.tile.warps_n * self.tile.warps_m

    @property
    def total_slabs(self) -> int:
        return -(-self.k // SLAB_K)

    @property
    def slabs_per_split(self) -> int:
        """Slabs of each K split (a prefill tile's splits start on stage boundaries)."""
        per_split = -(-self.total_slabs // self.tile.split_k)
        stage = self.tile.stage_slabs
        return -(-per_split // stage) * stage if self.tile.a_in_shared else per_split

    @property
    def warp_run(self) -> int:
        """Decode: each warp takes a contiguous run of its split's slabs."""
        return -(-self.slabs_per_split // self.tile.warps_k)

    @property
    def whole_batches(self) -> bool:
        """Whether every run's length is a multiple of `slabs_per_warp` (the runs' ends,
        splits' ends and K's end all on batch boundaries): each batch is then whole or past
        the run, the loop checks a batch at a time, and ptxas gets a batch's slabs as one
        block to interleave."""
        depth = self.tile.slabs_per_warp
        return not (self.total_slabs % depth or self.slabs_per_split % depth or self.warp_run % depth)

    @property
    def deferred(self):
        """`fragments.DeferredScales` where a swapped decode tile applies zero points and
        scales once per group, else None."""
        return self.reader.deferred if self.tile.swap_ab else None

    @property
    def group_slabs(self) -> int:
        """Slabs per scale group where scales are deferred (past K for one group), else 1."""
        deferred = self.deferred
        return (deferred.group_slabs or self.total_slabs + 1) if deferred is not None else 1

    @property
    def run_end_folds(self) -> bool:
        """Whether a run may end inside a scale group, which then folds at the run's end too."""
        group = self.group_slabs
        return bool(self.total_slabs % group or self.slabs_per_split % group or self.warp_run % group)

    @property
    def reduce_values(self) -> int:
        """Accumulators of one warp, as the warps along K hand them over (1: no hand-over)."""
        acc_i, acc_j = self.acc_shape
        return acc_i * acc_j * 4 * 32 if self.tile.warps_k > 1 else 1

    @property
    def flat_a(self) -> bool:
        """Decode reads A pairs with one flat load each: padding rows read row 0 instead
        (their outputs are never stored, and an mma row depends on its own A row only)."""
        return self.pair_loads and self.k % SLAB_K == 0

    @property
    def pairs_per_row(self) -> int:
        """Half pairs per activation row (the kernel's view of act with `pair_loads`)."""
        return self.k // 2

    @property
    def a_units_per_row(self) -> int:
        """Prefill: 16-byte copies of one activation row per stage (4 per slab)."""
        return self.tile.stage_slabs * SLAB_K // 8

    @property
    def a_units(self) -> int:
        """Prefill: 16-byte copies of the block's activation rows per stage."""
        return self.tile.block_m * self.a_units_per_row

    @property
    def a_copies(self) -> int:
        """Prefill: activation copies per thread per stage."""
        return -(-self.a_units // self.tile.threads)

    @property
    def staged(self) -> StagedWeights | None:
        """Prefill: how a stage's weights, scales and zero points are copied and read."""
        tile = self.tile
        if not tile.a_in_shared:
            return None
        return staged_weights(self.spec, self.n, self.k, self.half, tile.warps_n, tile.stage_slabs, tile.threads)

    @property
    def one_pair(self):
        """A half pair of ones: the A operand of the mma that sums activations."""
        return uint32(HALF_CONSTANTS[self.half].one)


def multiplier(plan: GemmPlan, tiles: int):
    """multiply(frags, a_words, acc): acc += A @ B for one slab's fragments, over the
    first `tiles` m tiles (unswapped)."""
    mma, swap_ab = ptx.mma(plan.half), plan.tile.swap_ab
    acc_i = plan.acc_shape[0]

    @ptx.device
    def multiply(frags, a_words, acc):
        if swap_ab:  # A = 16 features: the B fragments of two n8 tiles, interleaved (fragments docstring)
            for j in range(acc_i):
                acc[j, 0, 0], acc[j, 0, 1], acc[j, 0, 2], acc[j, 0, 3] = mma(
                    frags[4 * j], frags[4 * j + 2], frags[4 * j + 1], frags[4 * j + 3], a_words[0, 0],
                    a_words[0, 1], acc[j, 0, 0], acc[j, 0, 1], acc[j, 0, 2], acc[j, 0, 3])
        else:
            for mt in range(tiles):
                for nt in range(8):
                    acc[mt, nt, 0], acc[mt, nt, 1], acc[mt, nt, 2], acc[mt, nt, 3] = mma(
                        a_words[mt, 0], a_words[mt, 1], a_words[mt, 2], a_words[mt, 3], frags[2 * nt],
                        frags[2 * nt + 1], acc[mt, nt, 0], acc[mt, nt, 1], acc[mt, nt, 2], acc[mt, nt, 3])

    return multiply


def chain(first, second):
    """A device function that calls `first`, then `second`, with the same arguments: steps
    built per index in Python and chained, so that no loop is left for the compiler to
    decide whether to unroll (a loop it kept rolled put the accumulators in local memory)."""

    @ptx.device
    def both(*args):
        first(*args)
        second(*args)

    return both
