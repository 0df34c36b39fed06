"""Tensor-core B fragments of the grouped GEMM, read from a spec's physical tensors.

The GEMM computes ``out = act @ W.T`` with ``mma.m16n8k16``: activations are the A
operand (tokens x K), weights the B operand (K x output features). One warp owns a
*chunk* of 64 output features; for every *slab* of 16 stored input features a lane
(``lane = 4 g + t``) needs eight n8 fragments, two registers each::

    fragment[4 j + 2 h + r] = half pair W[n, k], W[n, k + 1]
        n = 64 c + 16 j + 8 h + g,   k = 16 s + 2 t + 8 r      (j < 4, h < 2, r < 2)

Two readers produce exactly these 16 registers, behind one interface:

* `MarlinTileReader`, for the kernel-native layout (`formats.native`, Marlin's tiles in
  column panels of two chunks, `panel_place`; Marlin's own rows alike): a lane's 32
  codes of a slab-chunk are 16 contiguous bytes (32 for 8-bit codes), so one
  ``ld.global.nc.v4`` fetches them; codes become half pairs with integer bit tricks
  (``(word >> 4i) & 0x000F000F | magic`` is the pair 128 + q, or 1024 + q in float16),
  then two packed FMAs subtract the zero point and apply the scale. e2m1 codes have
  their bits moved to a half's sign, exponent and mantissa by shifts and masks generated
  from the layout's `BitPack.places` (`e2m1_moves`: one of each for three codes in four
  of the native layout, in bfloat16; the fourth's three pieces by one multiply,
  `bit_spread`), then one packed FMA scales them.
* `IndexMapReader`, for ANY spec: each of the 32 values through
  `elements.element_reader` (the spec's own index maps), packed with ``cvt.rn``. Slow,
  exact, and what makes the GEMM work on every checkpoint layout as stored.

Interface (device functions, closure constants baked in; the caller owns the small
local arrays, which the compiler keeps in registers once its loops are unrolled)::

    group = group_of_slab(weights, e, s)                       # scale group of slab s
    column_params(weights, e, group, c, lane, params)          # params[16]: scale, offset
    fetch(weights, e, s, c, lane, raw)                         # raw[raw_words]: the words
    decode(raw, params, weights, e, s, c, lane, frags)         # frags[16]: half pairs
    multiplier = output_scale(weights, e)                      # float32 for the epilogue

`fetch` is split from `decode` so the GEMM can issue the next slabs' loads before it
spends time on the current ones. A Marlin-tile reader whose scales (and 4-bit zero
points) sit lane-contiguous, as in `formats.native` (`lane_scales`), fetches the lane's
eight scales with the weights (one 16- or 8-byte load) and builds the scale pairs in
`decode`: no dependent load waits on a scale-group change, and the prefill GEMM stages
those same words through shared memory (`staged_weights`). NVFP4's per-expert global
scale then moves to the epilogue (`output_scale`), so an e2m1 code times its block scale
is exact in the half type. The native layout stores those scales as float8_ue5m3 bytes
(no sign, 5 exponent bits): one ``prmt`` and one shift make two columns' scales a half
pair, and one multiply per register applies both the scale and the e2m1 bits' exponent
bias. Other scale layouts go through `column_params`, which reads the scales one by one
when the group changes.

`DeferredScales` (4-bit integer codes with lane-contiguous 16-bit scales): decode at
few tokens per expert is bound by instruction issue as much as by memory, and half of
a slab's dequantisation is applying the zero point and the scale. The reader can
instead hand out the codes as the magic pairs ``M + q`` (one shift and one ``lop3``
per register) and let the GEMM apply both per scale group, in float32::

    sum_k (q - z) s a  =  s (sum_k (M + q) a  -  (M + z) sum_k a)

where ``sum_k a`` comes from one more mma per slab (A = ones). Exact in real arithmetic;
in floating point the weights are never rounded to the half type (closer to the
float64 reference than dequantising first).
"""

from __future__ import annotations

import functools

import attrs
import numpy as np
from numba import float32, int32, int64, uint32, uint64

from layouts import E2M1, BitPack, Panels, Permute, QuantSpec, Tile, Transpose
from layouts.encodings import UE5M3_BIAS
from layouts.formats import marlin_weight_perm
from layouts.transforms import Pad

from . import ptx
from .elements import element_reader, global_scale_reader, scale_reader, zero_reader
from .ptx import device
from .twins import round_to_half_bits

CHUNK_N = 64  # output features per warp chunk
SLAB_K = 16  # stored input features per slab
# The prefill copies address their sources by 32-bit element offsets (a 64-bit offset
# costs each copy two more instructions in the main loop); NO_COPY marks a copy a thread
# does not make. `copy_offsets_fit` says which arrays qualify.
NO_COPY = np.uint32(0xFFFFFFFF)
COPY_OFFSET_LIMIT = 0xFFFFFFFF  # elements: offsets stay below the sentinel


def copy_offsets_fit(*arrays) -> bool:
    """Whether every array is small enough for 32-bit element offsets (the prefill copies',
    the stage-block kernels')."""
    return all(array.numel() <= COPY_OFFSET_LIMIT for array in arrays)


@attrs.frozen
class HalfConstants:
    """Bit patterns of one half type, packed as pairs."""

    one: int
    int4_magic: int  # half pair whose mantissa holds a 4-bit code in its low bits (its low byte zero)
    int4_magic_value: float
    fp4_shift: int  # e2m1 magnitude bits -> half bits
    fp4_unbias_pair: int  # 2**126 (bfloat16) or 2**14 (float16): shifted e2m1 bits -> value
    # A ue5m3 byte (bias 22) under `ue5m3_top`, shifted left by `ue5m3_shift`, lands in a
    # half's exponent and mantissa: the scale times 2**119 (bfloat16: exponent 224 + e) or
    # 2**7 (float16: exponent e). Times the shifted e2m1 bits, the value times 2**-7.
    ue5m3_shift: int
    ue5m3_top: int

    @property
    def minus_magic_top(self) -> int:
        """The top byte of -magic, which `zero_point_byte`'s permute puts above a zero point."""
        return (self.int4_magic ^ 0x80008000) >> 8 & 0xFF

HALF_CONSTANTS = {
    "bfloat16": HalfConstants(one=0x3F803F80, int4_magic=0x43004300, int4_magic_value=128.0,
                              fp4_shift=6, fp4_unbias_pair=0x7E807E80, ue5m3_shift=4, ue5m3_top=0x07),
    "float16": HalfConstants(one=0x3C003C00, int4_magic=0x64006400, int4_magic_value=1024.0,
                             fp4_shift=9, fp4_unbias_pair=0x74007400, ue5m3_shift=7, ue5m3_top=0x00),
}

# NVFP4 with prefetched block scales: a fragment is the e2m1 value times its block scale
# times 2**-FP4_DOWNSCALE, exact in either half type for every code and scale (at most
# 21, at least 2**-17); the epilogue multiplies by 2**FP4_DOWNSCALE with the global scale.
FP4_DOWNSCALE = 7
# A ue5m3 scale made a half (`HalfConstants`) times the shifted e2m1 bits is the weight times
# 2**(UE5M3_BIAS - 29) in either half type (float16: 2**(bias - 15) x 2**-14; bfloat16:
# 2**(bias + 97) x 2**-126): the bias is what sets the downscale.
assert UE5M3_BIAS - 29 == -FP4_DOWNSCALE


def marlin_tile_bits(spec: QuantSpec) -> int | None:
    """Code width if `spec`'s weight has Marlin's tile layout (optionally padded, its
    slab-chunks optionally in column panels; e2m1 bits optionally placed, see
    `e2m1_moves`), else None. Recognised by structure, so a checkpoint already in Marlin
    form reads fast as it is."""
    steps = list(spec.weight.layout.steps)
    if len(steps) > 1 and isinstance(steps[1], Pad):
        if steps[1].rows % SLAB_K or steps[1].cols % CHUNK_N:
            return None
        del steps[1]
    if len(steps) > 2 and isinstance(steps[2], Panels):
        if steps[2].cols % (SLAB_K * CHUNK_N):  # whole slab-chunks
            return None
        del steps[2]
    if len(steps) != 4:
        return None
    bits = spec.code.bits
    if bits not in (4, 8):
        return None
    *tiles, pack = steps
    if (tuple(tiles) != (Transpose(), Tile(16, 16), Permute(marlin_weight_perm(bits))) or not isinstance(pack, BitPack)
            or attrs.evolve(pack, places=None) != BitPack(bits, axis=-1)):
        return None
    if pack.places is not None and not (isinstance(spec.code, E2M1) and e2m1_moves(pack.places, "bfloat16")):
        return None  # (movable or not alike in both half types)
    return bits


def e2m1_moves(places: tuple[int, ...] | None, half: str) -> tuple | None:
    """How the tile reader turns the e2m1 codes of a word into `half` bits, or None if the
    codes' bits cannot be moved two halves at once (`places`: the weight's `BitPack.places`).

    Slot i < 4 of each 16-bit half (slot i + 4 alike, 16 bits up) has its four bits moved
    to their targets in the half: mantissa, exponent low, exponent high at `fp4_shift`
    + 0, 1, 2 and the sign at 15 (the value times 2**-126 in bfloat16, 2**-14 in float16).
    Bits that move by the same distance move together, one shift and one mask each:
    per slot, a tuple of (left shift, right shift, mask of both halves)."""
    places = tuple(range(32)) if places is None else places
    targets = tuple(HALF_CONSTANTS[half].fp4_shift + b for b in range(3)) + (15,)
    moves = []
    for slot in range(4):
        low, high = places[4 * slot:4 * slot + 4], places[4 * (slot + 4):4 * (slot + 4) + 4]
        if any(p >= 16 or q != p + 16 for p, q in zip(low, high)):
            return None
        masks = {}
        for place, target in zip(low, targets):
            masks[target - place] = masks.get(target - place, 0) | (0x10001 << target)
        moves.append(tuple((max(d, 0), max(-d, 0), mask) for d, mask in sorted(masks.items())))
    return tuple(moves)


def fast_path_supported(spec: QuantSpec, half: str) -> bool:
    """Whether `MarlinTileReader` can read `spec` for `half` activations: Marlin tiles,
    one scale group per slab (group sizes multiples of 16, channel-wise, or NVFP4's 16),
    K not sorted by act-order groups (act-order weights go through the index maps)."""
    bits = marlin_tile_bits(spec)
    if bits is None or spec.sort_k_by_group or spec.g_idx_name is not None:
        return False
    if spec.group_size is not None and spec.group_size % SLAB_K:
        return False
    if isinstance(spec.code, E2M1):
        return bits == 4
    return half in HALF_CONSTANTS


@attrs.frozen
class FragmentReader:
    """The five device functions of the module docstring, plus how many raw words `fetch`
    returns per lane (4 for 4-bit Marlin tiles, 8 for 8-bit, plus the scale words it
    prefetches; 1 for index maps); with prefetched scales, `decode_group(raw, frags,
    first)`: frags[first .. first + 3], the four registers of n16 group 0 alone (a warp of
    a warpgroup supplies one group, 16 rows, of wgmma's A; `StagedWeights.fetch_group`
    hands it its group's words as if they were group 0's)."""

    group_of_slab: object
    column_params: object
    fetch: object
    decode: object
    output_scale: object
    raw_words: int
    deferred: "DeferredScales | None" = None
    decode_group: object = None


@attrs.frozen
class DeferredScales:
    """Zero point and scale applied per group to float32 accumulators (module docstring).

    codes(raw, frags):      frags[16] = the slab's codes (`fetch`'s raw words) as half pairs M + q
    scale(raw, column):     float32 scale of the lane's column (0..7) in the slab's group
    offset(raw, column):    float32 M + zero point (M + bias without zero points)
    group_slabs:            slabs per scale group (None: one group, channel-wise)
    """

    codes: object
    scale: object
    offset: object
    group_slabs: int | None


@functools.cache
def fragment_reader(spec: QuantSpec, n: int, k: int, half: str) -> FragmentReader:
    """The fastest reader of `spec` (logical shape (n, k)) for `half` activations."""
    if fast_path_supported(spec, half):
        return _marlin_tile_reader(spec, n, k, half, lane_scales(spec, n, k, half))
    return _index_map_reader(spec, n, k, half)


@attrs.frozen
class LaneScales:
    """Where a lane's eight scales of a (group, 64-column chunk) sit when they are
    contiguous: row `group` of the (E * groups, row_elements) scales, elements
    64 c + 8 g .. + 8 (g = lane // 4), in column order 2 j + h; 4-bit zero points, if
    any, in word 8 c + g of their row, column m at bit `zero_shifts[m]`. The rows may be
    stored in column panels (`panel_place`): `panel_elements` and `zero_panel_words` wide."""

    groups: int  # scale rows per expert (ceil(K / group_size), 1 channel-wise)
    row_elements: int
    scale_words: int  # 4 (16-bit scales) or 2 (ue5m3 bytes)
    zero_row_words: int  # 0 without zero points
    zero_shifts: tuple[int, ...]
    panel_elements: int
    zero_panel_words: int

    def scale_place(self):
        return panel_place(self.groups, self.row_elements, self.panel_elements)

    def zero_place(self):
        return panel_place(self.groups, self.zero_row_words, self.zero_panel_words)


def panel_width(layout, row_length: int, per_element: int = 1) -> int:
    """Width in physical elements of the column panels `layout` stores its rows in (its
    `Panels` step's columns, `per_element` of them packed in an element), or `row_length`
    where it has none: rows as they are."""
    panel = next((step.cols for step in layout.steps if isinstance(step, Panels)), None)
    return row_length if panel is None else panel // per_element


def panel_place(rows: int, row_length: int, panel: int):
    """Device function (e, row, element) -> int64 flat place of an element of row `row` of
    expert `e`'s (rows, row_length) grid stored in column panels `panel` wide (the layout
    language's `Panels`; `panel == row_length`: rows as they are)."""
    if panel == row_length:
        @device
        def in_rows(e, row, element):
            return (int64(e) * rows + row) * row_length + element

        return in_rows

    panel_size = rows * panel

    @device
    def in_panels(e, row, element):
        element = uint32(element)  # unsigned: the divisions by a power of two are shifts
        return (int64(e) * rows * row_length + int64(element // uint32(panel)) * panel_size + int64(row) * panel
                + element % uint32(panel))

    return in_panels


def _panel_flat(row, element, rows: int, panel: int):
    """`panel_place` within an expert, on numpy arrays (the placement checks)."""
    return element // panel * rows * panel + row * panel + element % panel


def _chunk_columns(n: int):
    """Logical column n_, chunk c, lane group g and column slot m (= 2 j + h) of every n_ < n."""
    n_ = np.arange(n)
    return n_, n_ // CHUNK_N, n_ % 8, (n_ % CHUNK_N) // 8


@functools.cache
def lane_scales(spec: QuantSpec, n: int, k: int, half: str) -> LaneScales | None:
    """The lane-contiguous scale placement of `spec`, checked through its own index maps
    for every column and group, or None (then the reader reads scales one by one)."""
    if spec.g_idx_name is not None:
        return None
    ue5m3 = spec.scale_format.name == "float8_ue5m3"  # NVFP4 block scales as the native layout stores them
    if not (ue5m3 and isinstance(spec.code, E2M1)) and spec.scale_format.name != half:
        return None
    if spec.code.bits == 8 and half == "bfloat16":
        return None
    groups = spec.groups(k)
    n_, c, g, m = _chunk_columns(n)
    group = np.arange(groups)[:, None]
    rows, cols, _ = spec.scales.layout.locate((n, groups))(n_[None, :], group)
    physical_rows, row_elements = spec.scales.layout.physical_shape((n, groups))
    panel = panel_width(spec.scales.layout, row_elements)
    if not (physical_rows == groups and row_elements % CHUNK_N == 0 and panel % CHUNK_N == 0
            and np.all(rows * row_elements + cols == _panel_flat(group, 64 * c + 8 * g + m, groups, panel))):
        return None
    zero_row_words, zero_shifts, zero_panel = 0, (), 0
    if spec.zeros is not None:
        pack = spec.zeros.layout.bitpack
        if spec.code.bits != 4 or (pack is not None and pack.places is not None):  # the decode shifts zero points out
            return None
        rows, cols, shifts = spec.zeros.layout.locate((n, groups))(n_[None, :], group)
        zero_rows, zero_row_words = spec.zeros.layout.physical_shape((n, groups))
        zero_panel = panel_width(spec.zeros.layout, zero_row_words, 8)
        if zero_rows != groups or zero_panel * CHUNK_N != panel * 8:  # panels as wide as the scales'
            return None
        shift_of_slot = [int(shifts[0, m == slot][0]) if np.any(m == slot) else 4 * slot for slot in range(8)]
        if not (np.all(rows * zero_row_words + cols == _panel_flat(group, 8 * c + g, groups, zero_panel))
                and np.all(shifts == np.array(shift_of_slot)[m][None, :])):
            return None
        zero_shifts = tuple(shift_of_slot)
    return LaneScales(groups, row_elements, 2 if ue5m3 else 4, zero_row_words, zero_shifts, panel, zero_panel)


def _group_of_slab(spec: QuantSpec):
    group_size = spec.group_size

    @device
    def group_of_slab(weights, e, slab):
        if group_size is None:
            return int32(0)
        return int32(slab * SLAB_K // group_size)

    return group_of_slab


@attrs.frozen
class TileGeometry:
    """Where a Marlin-tile weight keeps its words: (E * slab_rows, slab_words) int32, a
    slab-chunk's words contiguous, a lane's `words_per_lane` of them contiguous; the slab
    rows stored in column panels `panel_words` wide (`slab_words`: rows as they are)."""

    bits: int
    slab_rows: int
    slab_words: int
    panel_words: int
    words_per_chunk: int
    words_per_lane: int

    @classmethod
    def of(cls, spec: QuantSpec, n: int, k: int) -> "TileGeometry":
        bits = marlin_tile_bits(spec)
        slab_rows, slab_words = spec.weight.layout.physical_shape((n, k))
        words_per_chunk = CHUNK_N * SLAB_K * bits // 32
        panel_words = panel_width(spec.weight.layout, slab_words, 32 // bits)
        return cls(bits, slab_rows, slab_words, panel_words, words_per_chunk, words_per_chunk // 32)

    def word_of(self):
        """Device function (e, slab, chunk) -> int64 word where the slab-chunk starts."""
        place, words_per_chunk = panel_place(self.slab_rows, self.slab_words, self.panel_words), self.words_per_chunk

        @device
        def word_of(e, slab, chunk):
            return place(e, slab, chunk * words_per_chunk)

        return word_of


def bit_spread(moves: tuple) -> tuple[int, int, int, int] | None:
    """One slot's `e2m1_moves` as a single multiply, where that is shorter: (right, gather,
    multiplier, mask) such that ``((word >> right) & gather) * multiplier & mask`` moves
    every piece at once (shift right by the largest right move, then one copy of the
    gathered bits per left move, the multiplier's bits). Four instructions at most
    against two a moving piece; None where it saves nothing, or where two copies of the
    gathered bits would meet (a carry could reach a kept bit)."""
    if len(moves) < 2:
        return None
    right = max(0, *(r - l for l, r, _ in moves))
    lefts = [l - r + right for l, r, _ in moves]
    gather = sum(mask >> left for left, (_, _, mask) in zip(lefts, moves))
    copies = [bit + left for left in set(lefts) for bit in range(32) if gather >> bit & 1 and bit + left < 32]
    if len(copies) != len(set(copies)) or _spread_instructions(right) >= _piece_instructions(moves):
        return None
    return right, gather, sum(1 << left for left in set(lefts)), sum(mask for _, _, mask in moves)


def _spread_instructions(right: int) -> int:
    """`bit_spread`'s mask, multiply and mask, and a shift where it moves right."""
    return 3 + (right > 0)


def _piece_instructions(moves: tuple) -> int:
    """A shift and a `lop3` per moving piece, a `lop3` per piece that stays."""
    return sum(1 + (left > 0 or right > 0) for left, right, _ in moves)


def move_instructions(moves: tuple) -> int:
    """Integer instructions that turn one slot of a word into half bits: the pieces', or
    `bit_spread`'s shift, two masks and multiply where it takes that."""
    spread = bit_spread(moves)
    return _piece_instructions(moves) if spread is None else _spread_instructions(spread[0])


def _bit_mover(moves: tuple, and_or):
    """Device function word -> the bits `moves` select, moved: by `bit_spread`'s multiply
    where it is shorter, else one (left, right, mask) shift and `and_or` each (a zero
    shift costs nothing once compiled)."""
    spread = bit_spread(moves)
    if spread is not None:
        right, gather, multiplier, mask = (uint32(value) for value in spread)

        @device
        def spread_bits(word):  # 64-bit product (no wrap in the simulator); the GPU keeps 32 bits
            return uint32((uint64((word >> right) & gather) * multiplier) & mask)

        return spread_bits
    return _bit_chain(moves, and_or)


def _bit_chain(moves: tuple, and_or):
    """`_bit_mover`'s pieces one at a time."""
    if not moves:
        @device
        def no_bits(word):
            return uint32(0)

        return no_bits
    (left, right, mask), rest = moves[0], _bit_chain(moves[1:], and_or)
    left, right, mask = uint32(left), uint32(right), uint32(mask)

    @device
    def move(word):
        return and_or((word << left) >> right, mask, rest(word))

    return move


def zero_point_byte(shift: int) -> tuple[int, int]:
    """(right shift, `byte_perm` selector) that take a 4-bit zero point at bit `shift` of
    its word to the low byte of both halves of a pair, with the second operand's byte 0
    above it in each: the word shifted right by `shift` % 8 puts the nibble at the bottom
    of byte `shift` // 8, a mask keeps each byte's low nibble, and the selector picks that
    byte twice. The half types' magics have a zero low byte, so the pair is then the
    magic plus the zero point (with the sign of the byte above)."""
    return shift % 8, 0x4040 + 0x0101 * (shift // 8)


def _marlin_tile_reader(spec: QuantSpec, n: int, k: int, half: str, lane: LaneScales | None) -> FragmentReader:
    geometry = TileGeometry.of(spec, n, k)
    bits, words_per_lane, word_of = geometry.bits, geometry.words_per_lane, geometry.word_of()
    fp4 = isinstance(spec.code, E2M1)
    constants = HALF_CONSTANTS[half]
    fma2, pack2 = ptx.fma2(half), ptx.pack2(half)
    fma2_low, fma2_high = ptx.fma2_splat(half, 0), ptx.fma2_splat(half, 1)
    load4, load2, load1 = ptx.load_words[4], ptx.load_words[2], ptx.load_words[1]
    and_or, byte_perm = ptx.and_or, ptx.byte_perm
    read_scale, read_zero = scale_reader(spec, n, k), zero_reader(spec, n, k)
    global_multiplier = global_scale_reader(spec)
    size_n = n
    one, magic = uint32(constants.one), uint32(constants.int4_magic)
    magic_value = float32(constants.int4_magic_value)
    unbias_pair = uint32(constants.fp4_unbias_pair)
    slot0_bits, slot1_bits, slot2_bits, slot3_bits = (  # e2m1 codes (places: None for integer codes)
        _bit_mover(moves, and_or) for moves in e2m1_moves(spec.weight.layout.bitpack.places, half))
    # 128 + q does not hold an 8-bit code exactly in bfloat16: those go through float32
    # (params then hold float32 bits of the scale and the zero point).
    float32_codes = bits == 8 and half == "bfloat16"
    zero_pair = uint32(0)
    # Prefetched scales (`lane`, see LaneScales): raw[words_per_lane:] holds them, then the zero word.
    group_size = spec.group_size or SLAB_K * -(-k // SLAB_K)  # channel-wise: one group
    scale_words = lane.scale_words if lane else 0
    zero_words = 1 if lane and lane.zero_row_words else 0
    groups, zero_shifts = (lane.groups, lane.zero_shifts) if lane else (1, ())
    scale_place, zero_place = (lane.scale_place(), lane.zero_place()) if lane else (None, None)
    zero_bytes = tuple(zero_point_byte(shift) for shift in zero_shifts)
    minus_magic_top = uint32(constants.minus_magic_top * 0x01010101)
    fixed_bits = int(round_to_half_bits(np.float64(-(constants.int4_magic_value + (spec.code.bias or 0))), half))
    fixed_offset_pair = uint32(fixed_bits | fixed_bits << 16)
    # ue5m3 scale bytes, as half pairs in two instructions (`fp4_scales`).
    ue5m3_shift, ue5m3_top = constants.ue5m3_shift, uint32(constants.ue5m3_top * 0x01010101)

    @device
    def column_params(weights, e, group, chunk, lane_id, params):
        """params[2 c], params[2 c + 1]: the scale pair and the minus (magic + zero point)
        pair of the lane's column c (c = 2 j + h). Unused when scales are prefetched."""
        if scale_words:
            return
        weight, scales, zeros, g_idx, k_order, global_scale = weights
        g = lane_id // 4
        multiplier = global_multiplier(global_scale, e)
        for column in range(8):
            n_ = chunk * CHUNK_N + 16 * (column // 2) + 8 * (column % 2) + g
            scale = float32(0.0)
            offset = magic_value
            if n_ < size_n:
                scale = read_scale(scales, e, n_, group) * multiplier
                offset += float32(read_zero(zeros, e, n_, group))
            if float32_codes:
                params[2 * column] = ptx.f32_bits(scale)
                params[2 * column + 1] = ptx.f32_bits(offset - magic_value)
            else:
                params[2 * column] = pack2(scale, scale)
                params[2 * column + 1] = pack2(-offset, -offset)

    @device
    def fetch(weights, e, slab, chunk, lane_id, raw):
        first = word_of(e, slab, chunk) + lane_id * words_per_lane
        raw[0], raw[1], raw[2], raw[3] = load4(weights[0], first)
        if words_per_lane == 8:
            raw[4], raw[5], raw[6], raw[7] = load4(weights[0], first + 4)
        if scale_words:
            if group_size == SLAB_K:  # a group a slab (NVFP4): a batch's rows a constant apart, one address
                group = slab
            else:
                group = uint32(slab) * uint32(SLAB_K) // uint32(group_size)
            column = chunk * CHUNK_N + 8 * (lane_id // 4)
            if scale_words == 4:
                (raw[words_per_lane], raw[words_per_lane + 1], raw[words_per_lane + 2],
                 raw[words_per_lane + 3]) = load4(weights[1], scale_place(e, group, column))
            else:
                raw[words_per_lane], raw[words_per_lane + 1] = load2(weights[1], scale_place(e, group, column))
            if zero_words:
                raw[words_per_lane + scale_words] = load1(weights[2], zero_place(e, group, column // 8))

    @device
    def lane_scale_pair(raw, column):
        """The prefetched 16-bit scale of `column`, replicated into both halves."""
        half_index = column % 2
        return byte_perm(uint32(raw[words_per_lane + column // 2]), uint32(0), uint32(0x1010 + 0x2222 * half_index))

    @device
    def lane_offset_pair(raw, column):
        """Minus (magic + zero point) of `column` as a half pair: its nibble masked into a
        byte of the word (one mask serves every column at that shift), and one byte permute
        puts that byte under the minus magic's top byte in both halves."""
        if zero_words:
            right, selector = zero_bytes[column]
            nibbles = (uint32(raw[words_per_lane + scale_words]) >> uint32(right)) & uint32(0x0F0F0F0F)
            return byte_perm(nibbles, minus_magic_top, uint32(selector))
        return fixed_offset_pair

    @device
    def magic_pair(raw, column, r):
        """The 4-bit codes of fragment register r of `column` as the half pair M + q."""
        return and_or(uint32(raw[column // 2]) >> uint32(4 * (2 * (column % 2) + r)), uint32(0x000F000F), magic)

    @device
    def int_pair(raw, column, r, scale_pair, offset_pair):
        """Fragment register r of `column` from integer codes: (q - zero) * scale."""
        if bits == 4:
            return fma2(fma2(magic_pair(raw, column, r), one, offset_pair), scale_pair, zero_pair)
        codes = (uint32(raw[column]) >> uint32(8 * r)) & uint32(0x00FF00FF)
        if not float32_codes:
            return fma2(fma2(codes | magic, one, offset_pair), scale_pair, zero_pair)
        zero, scale = ptx.bits_f32(offset_pair), ptx.bits_f32(scale_pair)
        return pack2((float32(codes & uint32(0xFFFF)) - zero) * scale, (float32(codes >> uint32(16)) - zero) * scale)

    @device
    def fp4_bits(raw, column, r):
        """The e2m1 codes of fragment register r of `column`, sign and magnitude bits moved
        into a half's sign, exponent and top mantissa bit (`e2m1_moves`): the values times
        2**-126 (bfloat16) or 2**-14 (float16)."""
        slot = 2 * (column % 2) + r  # the codes' slot in each 16-bit half of the word
        word = uint32(raw[column // 2])
        if slot == 0:
            return slot0_bits(word)
        if slot == 1:
            return slot1_bits(word)
        if slot == 2:
            return slot2_bits(word)
        return slot3_bits(word)

    @device
    def fp4_pair(raw, column, r, scale_pair):
        """Fragment register r of `column` from e2m1 codes, scaled back exactly."""
        return fma2(fma2(fp4_bits(raw, column, r), unbias_pair, zero_pair), scale_pair, zero_pair)

    @device
    def fp4_scales(raw, pair):
        """The prefetched ue5m3 scales of columns 2 pair and 2 pair + 1 as one half pair,
        times 2**(e2m1 unbias - FP4_DOWNSCALE): one byte permute and one shift."""
        byte = 2 * (pair % 2)
        spread = byte_perm(uint32(raw[words_per_lane + pair // 2]), ue5m3_top,
                           uint32(0x4040 + byte + ((byte + 1) << 8)))
        return spread << uint32(ue5m3_shift)

    def lane_decoder(groups: int):
        """Device function (raw, frags, first): frags[first + 4 j + 2 h + r] for the first
        `groups` n16 groups j, from prefetched scales (`lane`)."""

        @device
        def decode_lane(raw, frags, first):
            if fp4:  # e2m1 bits times (scale, scale) picked from the two columns' pair
                for pair in range(groups):
                    scales = fp4_scales(raw, pair)
                    for r in range(2):
                        frags[first + 4 * pair + r] = fma2_low(fp4_bits(raw, 2 * pair, r), scales, zero_pair)
                        frags[first + 4 * pair + 2 + r] = fma2_high(fp4_bits(raw, 2 * pair + 1, r), scales, zero_pair)
                return
            for column in range(2 * groups):
                scale_pair, offset_pair = lane_scale_pair(raw, column), lane_offset_pair(raw, column)
                for r in range(2):
                    frags[first + 2 * column + r] = int_pair(raw, column, r, scale_pair, offset_pair)

        return decode_lane

    decode_slab, decode_group = lane_decoder(4), lane_decoder(1)

    @device
    def decode(raw, params, weights, e, slab, chunk, lane_id, frags):
        if scale_words:
            decode_slab(raw, frags, 0)
            return
        for column in range(8):
            scale_pair, offset_pair = params[2 * column], params[2 * column + 1]
            for r in range(2):
                if fp4:
                    frags[2 * column + r] = fp4_pair(raw, column, r, scale_pair)
                else:
                    frags[2 * column + r] = int_pair(raw, column, r, scale_pair, offset_pair)

    epilogue_factor = float32(2.0 ** FP4_DOWNSCALE if fp4 else 1.0)

    @device
    def output_scale(weights, e):
        if scale_words:
            return global_multiplier(weights[5], e) * epilogue_factor
        return float32(1.0)

    deferred = None
    if bits == 4 and not fp4 and scale_words == 4:
        half_to_f32 = ptx.half_to_f32(half)
        fixed_offset = float32(magic_value + (spec.code.bias or 0))

        @device
        def codes(raw, frags):
            for column in range(8):
                for r in range(2):
                    frags[2 * column + r] = magic_pair(raw, column, r)

        @device
        def column_scale(raw, column):
            return half_to_f32(uint32(raw[words_per_lane + column // 2]) >> uint32(16 * (column % 2)))

        @device
        def column_offset(raw, column):
            if zero_words:
                return magic_value + float32((uint32(raw[words_per_lane + scale_words]) >> uint32(zero_shifts[column]))
                                             & uint32(0xF))
            return fixed_offset

        deferred = DeferredScales(codes, column_scale, column_offset,
                                  spec.group_size // SLAB_K if spec.group_size else None)

    return FragmentReader(_group_of_slab(spec) if not scale_words else _no_groups(), column_params, fetch, decode,
                          output_scale, words_per_lane + scale_words + zero_words, deferred,
                          decode_group if scale_words else None)


@attrs.frozen
class StagedWeights:
    """One pipeline stage of a CTA's weights in shared memory (the prefill GEMM): the
    weight words of `slabs` slabs x `chunks` 64-feature chunks, as stored (a lane's 16
    bytes stay contiguous), then the scale rows of the stage's groups restricted to those
    chunks, then their zero-point words; `stage_words` uint32 words per stage buffer, the
    first `weight_words` of them the weight words.

    plan(e, first_chunk, second_chunk, thread, sources): once per CTA, fill this
        thread's `copies_per_thread` source offsets (uint32, `NO_COPY` for none) for the CTA's
        chunks: its first `chunks // 2` from `first_chunk` on, the rest from
        `second_chunk` on (contiguous: first_chunk + chunks // 2; apart: gemm1's gate and
        up chunks, `gemm.paired_activation`);
    copy(weights, sources, first_slab, tiles, base, thread) / copy_partial(..., remaining):
        this thread's share of a stage's 16-byte `copy_async` copies into the stage buffer
        at word `base`; `copy_partial` for the last stage of a K range, `remaining` slabs
        long (the rest zero-filled). Chunks past N are not copied, and no warp reads them;
    fetch(tiles, buffer, local_slab, local_chunk, lane, raw): the lane's words of one
        slab-chunk in the order the reader's `fetch` gives them, so its `decode` applies;
    copy_panel(weights, e, first_chunk, first_slab, tiles, base, barrier): the same stage
        (a whole one, `bulk_staging_supported`) in bulk copies from one thread, where the
        CTA's chunks are one column panel of each tensor (from `first_chunk`, a multiple
        of `chunks`): straight-line, a copy a tensor (`ptx.bulk_copy`, counted on the
        mbarrier at word `barrier`, which the caller has told to expect `4 * stage_words`
        bytes), no copy instructions or addresses in the other threads; None where the
        chunks cannot be one panel;
    fetch_group(tiles, buffer, local_slab, local_chunk, lane, group, raw) and
    fetch_group_scales(...): `fetch`'s codes, and its scales and zero points, of the
        slab-chunk's n16 group `group` alone, placed as group 0's are (for
        `FragmentReader.decode_group`); the scales change every `scale_slabs` slabs of a
        stage, and raw keeps them in between. fetch_group_scales is None where a group's
        zero points are not one shift of the word from group 0's.
    """

    stage_words: int
    weight_words: int
    copies_per_thread: int
    plan: object
    copy: object
    copy_partial: object
    fetch: object
    copy_panel: object
    fetch_group: object
    fetch_group_scales: object
    scale_slabs: int


@attrs.frozen
class CopyStream:
    """The 16-byte units one source array contributes to a stage: `per_row` units of each
    of its rows the stage covers (a row: one slab of weight words, or one scale group of
    scales or zero points), `elements_per_chunk` elements of a row per 64-feature chunk,
    the rows stored in column panels `panel_length` elements wide (`panel_place`)."""

    array: int  # index in the kernel's weights tuple
    units: int
    per_row: int
    slabs_per_row: int
    rows_per_expert: int
    row_length: int  # elements
    panel_length: int
    elements_per_chunk: int
    elements_per_unit: int
    first_word: int  # where the stream starts in a stage buffer
    first_copy: int  # where its copies start in a thread's sources


def _stream_copies(stream: CopyStream, threads: int, n_chunks: int, chunks: int):
    """plan, copy and copy_partial of one stream (see StagedWeights)."""
    copies, whole = -(-stream.units // threads), stream.units // threads
    every_chunk = n_chunks % chunks == 0  # no CTA has a chunk past N: every whole copy exists
    array, units, per_row, slabs_per_row = stream.array, stream.units, stream.per_row, stream.slabs_per_row
    first_word, first_copy, panel_length = stream.first_word, stream.first_copy, stream.panel_length
    place = panel_place(stream.rows_per_expert, stream.row_length, panel_length)
    per_chunk, per_unit = stream.elements_per_chunk, stream.elements_per_unit
    copy_async = ptx.copy_async

    first_half = chunks // 2 * per_chunk  # elements of a row from the first run of chunks

    @device
    def plan(e, first_chunk, second_chunk, thread, sources):
        for i in range(copies):
            unit = uint32(thread) + uint32(i * threads)  # unsigned: divisions by constants stay cheap
            sources[first_copy + i] = NO_COPY
            if unit < uint32(units):
                local = per_unit * (unit % uint32(per_row))  # element of the CTA's row
                run = first_chunk if local < first_half else second_chunk - chunks // 2
                element = run * per_chunk + local
                if element < n_chunks * per_chunk:
                    sources[first_copy + i] = uint32(place(e, unit // uint32(per_row), element))

    def make_copy(checked: bool):
        """Copies of a stage; `checked`: zero-fill rows at or past `remaining` slabs."""

        @device
        def copy(weights, sources, first_slab, remaining, tiles, base, thread):
            advance = uint32(first_slab) // uint32(slabs_per_row) * uint32(panel_length)  # rows further down a panel
            for i in range(copies):
                unit = uint32(thread) + uint32(i * threads)
                source = sources[first_copy + i]
                if (i < whole and every_chunk) or source != NO_COPY:
                    target = base + first_word + 4 * unit
                    if checked:
                        present = (unit // uint32(per_row)) * uint32(slabs_per_row) < remaining
                        copy_async(tiles, target, weights[array], advance if present else uint32(0),
                                   source if present else uint32(0), 16 if present else 0)
                    else:
                        copy_async(tiles, target, weights[array], advance, source, 16)

        return copy

    return plan, make_copy(False), make_copy(True)


@functools.cache
def staging_supported(spec: QuantSpec, n: int, k: int, half: str, stage_slabs: int) -> bool:
    """Whether the prefill GEMM can stage `spec` through shared memory: Marlin tiles whose
    scales sit lane-contiguous (`lane_scales`), rows of whole 16-byte units, K in whole
    slabs and scale groups that a stage never straddles. Kept: the oracle asks at every
    choice, and `lane_scales` checks every column and group."""
    lane = lane_scales(spec, n, k, half) if fast_path_supported(spec, half) else None
    if lane is None or k % SLAB_K or lane.zero_row_words % 4:
        return False
    stage_k, group_size = stage_slabs * SLAB_K, spec.group_size
    return group_size is None or group_size % stage_k == 0 or stage_k % group_size == 0


def bulk_staging_supported(spec: QuantSpec, n: int, k: int, half: str, chunks: int, stage_slabs: int) -> bool:
    """Whether bulk copies (`StagedWeights.copy_panel`) can fill every stage: staging as
    `staging_supported`, K in whole stages and N in whole runs of `chunks` chunks (a bulk
    copy's bytes are fixed when compiled: no partial stage, no chunk past N)."""
    return (staging_supported(spec, n, k, half, stage_slabs) and k % (stage_slabs * SLAB_K) == 0
            and -(-n // CHUNK_N) % chunks == 0)


@functools.cache
def staged_weights(spec: QuantSpec, n: int, k: int, half: str, chunks: int, slabs: int, threads: int) -> StagedWeights:
    """The stage copies and shared-memory fetches of `spec` for CTAs of `threads` threads
    owning `chunks` chunks, `slabs` slabs per stage (see `staging_supported`)."""
    if not staging_supported(spec, n, k, half, slabs):
        raise ValueError(f"{spec.name} (N={n}, K={k}) cannot be staged through shared memory in stages of {slabs} slabs")
    lane, geometry = lane_scales(spec, n, k, half), TileGeometry.of(spec, n, k)
    words_per_chunk, words_per_lane = geometry.words_per_chunk, geometry.words_per_lane
    shared4, shared2, shared1 = ptx.load_shared[4], ptx.load_shared[2], ptx.load_shared[1]
    n_chunks = -(-n // CHUNK_N)
    stage_k = slabs * SLAB_K
    group_size = spec.group_size or stage_k * -(-k // stage_k)  # channel-wise: one group
    stage_groups = max(1, stage_k // group_size)
    slabs_per_group = group_size // SLAB_K
    scale_words, zero_words = lane.scale_words, int(lane.zero_row_words > 0)
    chunk_scale_words = CHUNK_N * scale_words // 8  # a chunk's 64 scales (2 or 1 bytes each), in words
    # Weight words per slab, then scales and zero points per group, each in 16-byte units.
    weights = CopyStream(0, slabs * chunks * words_per_chunk // 4, chunks * words_per_chunk // 4, 1, geometry.slab_rows,
                         geometry.slab_words, geometry.panel_words, words_per_chunk, 4, 0, 0)
    scales = CopyStream(1, stage_groups * chunks * chunk_scale_words // 4, chunks * chunk_scale_words // 4,
                        slabs_per_group, lane.groups, lane.row_elements, lane.panel_elements, CHUNK_N,
                        16 // (2 if scale_words == 4 else 1), 4 * weights.units, -(-weights.units // threads))
    zeros = CopyStream(2, stage_groups * chunks * 2 * zero_words, chunks * 2, slabs_per_group, lane.groups,
                       lane.zero_row_words, lane.zero_panel_words, 8, 4, scales.first_word + 4 * scales.units,
                       scales.first_copy + -(-scales.units // threads))
    weight_words, scale_total = 4 * weights.units, 4 * scales.units
    stage_words = zeros.first_word + 4 * zeros.units
    copies_per_thread = zeros.first_copy + -(-zeros.units // threads)
    (plan_w, copy_w, partial_w), (plan_s, copy_s, partial_s), (plan_z, copy_z, partial_z) = (
        _stream_copies(stream, threads, n_chunks, chunks) for stream in (weights, scales, zeros))
    full_stage = uint32(slabs)

    @device
    def plan(e, first_chunk, second_chunk, thread, sources):
        """Once per CTA: the flat source element of each of this thread's copies in the
        stage of slab 0 (-1: none, or past N), so a stage's copy is one add away."""
        plan_w(e, first_chunk, second_chunk, thread, sources)
        plan_s(e, first_chunk, second_chunk, thread, sources)
        plan_z(e, first_chunk, second_chunk, thread, sources)

    @device
    def copy(weights, sources, first_slab, tiles, base, thread):
        copy_w(weights, sources, first_slab, full_stage, tiles, base, thread)
        copy_s(weights, sources, first_slab, full_stage, tiles, base, thread)
        copy_z(weights, sources, first_slab, full_stage, tiles, base, thread)

    @device
    def copy_partial(weights, sources, first_slab, remaining, tiles, base, thread):
        partial_w(weights, sources, first_slab, remaining, tiles, base, thread)
        partial_s(weights, sources, first_slab, remaining, tiles, base, thread)
        partial_z(weights, sources, first_slab, remaining, tiles, base, thread)

    @device
    def code_word(buffer, local_slab, local_chunk, lane_id):
        """Where the lane's codes of a slab-chunk of stage buffer `buffer` start."""
        return buffer * stage_words + (local_slab * chunks + local_chunk) * words_per_chunk + lane_id * words_per_lane

    @device
    def scale_word(buffer, local_slab, local_chunk, lane_id):
        """(where the lane's scales start, its zero-point word) in the slab's group."""
        base = buffer * stage_words + weight_words
        column = (local_slab * SLAB_K // group_size if stage_groups > 1 else 0) * chunks + local_chunk
        # The lane's eight columns among the stage's runs of eight: scale_words words of
        # scales and one zero-point word each. One index for both addresses, which the
        # warp-specialised GEMM keeps in a register under its cap of 96 (ptxas recomputed
        # the two separate ones from the thread index every stage).
        place = column * 8 + lane_id // 4
        return base + place * scale_words, base + scale_total + place

    @device
    def fetch(tiles, buffer, local_slab, local_chunk, lane_id, raw):
        first = code_word(buffer, local_slab, local_chunk, lane_id)
        raw[0], raw[1], raw[2], raw[3] = shared4(tiles, first)
        if words_per_lane == 8:
            raw[4], raw[5], raw[6], raw[7] = shared4(tiles, first + 4)
        scales, zeros = scale_word(buffer, local_slab, local_chunk, lane_id)
        if scale_words == 4:
            (raw[words_per_lane], raw[words_per_lane + 1], raw[words_per_lane + 2],
             raw[words_per_lane + 3]) = shared4(tiles, scales)
        else:
            raw[words_per_lane], raw[words_per_lane + 1] = shared2(tiles, scales)
        if zero_words:
            raw[words_per_lane + scale_words] = shared1(tiles, zeros)

    # A group's two columns' zero points go where group 0's are: one shift of the word
    # where the groups' nibbles are a fixed distance apart (the native layout's are 4).
    zero_shifts = lane.zero_shifts or (0,) * 8
    distance = zero_shifts[2] - zero_shifts[0]
    zeros_shift = distance >= 0 and all(zero_shifts[2 * j + h] - zero_shifts[h] == j * distance
                                        for j in range(4) for h in range(2))
    group_shift = uint32(max(distance, 0))

    @device
    def fetch_group(tiles, buffer, local_slab, local_chunk, lane_id, group, raw):
        first = code_word(buffer, local_slab, local_chunk, lane_id) + group * (words_per_lane // 4)
        if words_per_lane == 4:
            raw[0] = shared1(tiles, first)
        else:
            raw[0], raw[1] = shared2(tiles, first)

    @device
    def fetch_group_scales(tiles, buffer, local_slab, local_chunk, lane_id, group, raw):
        scales, zeros = scale_word(buffer, local_slab, local_chunk, lane_id)
        if scale_words == 4:  # 16-bit scales: group j's two in word j
            raw[words_per_lane] = shared1(tiles, scales + group)
        else:  # ue5m3 bytes: group j's two in half j % 2 of word j / 2
            raw[words_per_lane] = uint32(shared1(tiles, scales + group // 2)) >> (uint32(16) * (group % 2))
        if zero_words:
            raw[words_per_lane + scale_words] = uint32(shared1(tiles, zeros)) >> (group_shift * group)

    chunk_zero_words = 8 * zero_words
    # Chunks whose scales (and zero points) are stored one after another: a panel's (the
    # zero points' panels are as wide: `lane_scales`).
    scale_panel_chunks = lane.panel_elements // CHUNK_N
    word_of, scale_place, zero_place = geometry.word_of(), lane.scale_place(), lane.zero_place()
    panel_chunks = geometry.panel_words // words_per_chunk  # chunks of a slab stored one after another
    bulk_copy = ptx.bulk_copy

    one_panel = chunks == panel_chunks == scale_panel_chunks  # a CTA's chunks can be one panel of each tensor

    @device
    def copy_panel(weights, e, chunk, first_slab, tiles, base, barrier):
        """The stage of a CTA whose chunks are one panel: a run of each tensor, as the
        stage buffer holds them (slabs, then groups, one after another)."""
        first_group = uint32(first_slab) * uint32(SLAB_K) // uint32(group_size)
        bulk_copy(tiles, base, weights[0], word_of(e, first_slab, chunk), 4 * weight_words, barrier)
        bulk_copy(tiles, base + weight_words, weights[1], scale_place(e, first_group, chunk * CHUNK_N), 4 * scale_total,
                  barrier)
        if zero_words:
            bulk_copy(tiles, base + weight_words + scale_total, weights[2], zero_place(e, first_group, chunk * 8),
                      4 * stage_groups * chunks * chunk_zero_words, barrier)

    return StagedWeights(stage_words, weight_words, copies_per_thread, plan, copy, copy_partial, fetch,
                         copy_panel if one_panel else None, fetch_group, fetch_group_scales if zeros_shift else None,
                         min(slabs, group_size // SLAB_K))


def _no_groups():
    @device
    def group_of_slab(weights, e, slab):
        return int32(0)

    return group_of_slab


def _index_map_reader(spec: QuantSpec, n: int, k: int, half: str) -> FragmentReader:
    read = element_reader(spec, n, k)
    pack2 = ptx.pack2(half)
    size_n, size_k = n, k

    @device
    def column_params(weights, e, group, chunk, lane, params):
        pass

    @device
    def fetch(weights, e, slab, chunk, lane, raw):
        pass

    @device
    def value(weights, e, n_, kp):
        if n_ < size_n and kp < size_k:
            return read(weights, e, n_, kp)
        return float32(0.0)

    @device
    def output_scale(weights, e):
        return float32(1.0)

    @device
    def decode(raw, params, weights, e, slab, chunk, lane, frags):
        g, t = lane // 4, lane % 4
        for column in range(8):
            n_ = chunk * CHUNK_N + 16 * (column // 2) + 8 * (column % 2) + g
            for r in range(2):
                kp = slab * SLAB_K + 2 * t + 8 * r
                frags[2 * column + r] = pack2(value(weights, e, n_, kp), value(weights, e, n_, kp + 1))

    return FragmentReader(_no_groups(), column_params, fetch, decode, output_scale, 1)
