"""Tensor-core B fragments of the grouped GEMM, read from a spec's physical tensors.

The GEMM computes ``out = act @ W.T`` with ``mma.m16n8k16``: activations are the A
operand (tokens x K), weights the B operand (K x output features). One warp owns a
*chunk* of 64 output features; for every *slab* of 16 stored input features a lane
(``lane = 4 g + t``) needs eight n8 fragments, two registers each::

    fragment[4 j + 2 h + r] = half pair W[n, k], W[n, k + 1]
        n = 64 c + 16 j + 8 h + g,   k = 16 s + 2 t + 8 r      (j < 4, h < 2, r < 2)

Two readers produce exactly these 16 registers, behind one interface:

* `MarlinTileReader`, for the kernel-native layout (`formats.native`, Marlin's tiles):
  a lane's 32 codes of a slab-chunk are 16 contiguous bytes (32 for 8-bit codes), so one
  ``ld.global.nc.v4`` fetches them; codes become half pairs with integer bit tricks
  (``(word >> 4i) & 0x000F000F | magic`` is the pair 128 + q, or 1024 + q in float16),
  then two packed FMAs subtract the zero point and apply the scale.
* `IndexMapReader`, for ANY spec: each of the 32 values through
  `elements.element_reader` (the spec's own index maps), packed with ``cvt.rn``. Slow,
  exact, and what makes the GEMM work on every checkpoint layout as stored.

Interface (device functions, closure constants baked in; the caller owns the small
local arrays, which the compiler keeps in registers once its loops are unrolled)::

    group = group_of_slab(weights, e, s)                       # scale group of slab s
    column_params(weights, e, group, c, lane, params)          # params[16]: scale, offset
    fetch(weights, e, s, c, lane, raw)                         # raw[raw_words]: the words
    decode(raw, params, weights, e, s, c, lane, frags)         # frags[16]: half pairs

`fetch` is split from `decode` so the GEMM can issue the next slabs' loads before it
spends time on the current ones.
"""

from __future__ import annotations

import functools

import attrs
from numba import float32, int32, uint32

from layouts import E2M1, BitPack, Permute, QuantSpec, Tile, Transpose
from layouts.formats import marlin_weight_perm
from layouts.transforms import Pad

from . import ptx
from .elements import element_reader, global_scale_reader, scale_reader, zero_reader
from .ptx import device

CHUNK_N = 64  # output features per warp chunk
SLAB_K = 16  # stored input features per slab


@attrs.frozen
class HalfConstants:
    """Bit patterns of one half type, packed as pairs."""

    one: int
    int4_magic: int  # half pair whose mantissa holds a 4-bit code in its low bits
    int4_magic_value: float
    fp4_shift: int  # e2m1 magnitude bits -> half bits
    fp4_unbias_pair: int  # 2**126 (bfloat16) or 2**14 (float16): shifted e2m1 bits -> value


HALF_CONSTANTS = {
    "bfloat16": HalfConstants(one=0x3F803F80, int4_magic=0x43004300, int4_magic_value=128.0,
                              fp4_shift=6, fp4_unbias_pair=0x7E807E80),
    "float16": HalfConstants(one=0x3C003C00, int4_magic=0x64006400, int4_magic_value=1024.0,
                             fp4_shift=9, fp4_unbias_pair=0x74007400),
}


def marlin_tile_bits(spec: QuantSpec) -> int | None:
    """Code width if `spec`'s weight has Marlin's tile layout (optionally padded), else None.
    Recognised by structure, so a checkpoint already in Marlin form reads fast as it is."""
    steps = spec.weight.layout.steps
    if len(steps) == 5 and isinstance(steps[1], Pad):
        if steps[1].rows % SLAB_K or steps[1].cols % CHUNK_N:
            return None
        steps = steps[:1] + steps[2:]
    if len(steps) != 4:
        return None
    bits = spec.code.bits
    if bits not in (4, 8):
        return None
    expected = (Transpose(), Tile(16, 16), Permute(marlin_weight_perm(bits)), BitPack(bits, axis=-1))
    return bits if steps == expected else None


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
    """The four device functions of the module docstring, plus how many raw words `fetch`
    returns per lane (4 for 4-bit Marlin tiles, 8 for 8-bit, 1 for index maps)."""

    group_of_slab: object
    column_params: object
    fetch: object
    decode: object
    raw_words: int
    fast: bool


@functools.cache
def fragment_reader(spec: QuantSpec, n: int, k: int, half: str) -> FragmentReader:
    """The fastest reader of `spec` (logical shape (n, k)) for `half` activations."""
    if fast_path_supported(spec, half):
        return _marlin_tile_reader(spec, n, k, half)
    return _index_map_reader(spec, n, k, half)


def _group_of_slab(spec: QuantSpec):
    group_size = spec.group_size

    @device
    def group_of_slab(weights, e, slab):
        if group_size is None:
            return int32(0)
        return int32(slab * SLAB_K // group_size)

    return group_of_slab


def _marlin_tile_reader(spec: QuantSpec, n: int, k: int, half: str) -> FragmentReader:
    bits = marlin_tile_bits(spec)
    fp4 = isinstance(spec.code, E2M1)
    constants = HALF_CONSTANTS[half]
    fma2, pack2 = ptx.fma2(half), ptx.pack2(half)
    read_scale, read_zero = scale_reader(spec, n, k), zero_reader(spec, n, k)
    global_multiplier = global_scale_reader(spec)
    size_n = n
    words_per_chunk = CHUNK_N * SLAB_K * bits // 32
    words_per_lane = words_per_chunk // 32
    one, magic = uint32(constants.one), uint32(constants.int4_magic)
    magic_value = float32(constants.int4_magic_value)
    fp4_shift, unbias_pair, fp4_sign_shift = constants.fp4_shift, uint32(constants.fp4_unbias_pair), 12
    # 128 + q does not hold an 8-bit code exactly in bfloat16: those go through float32
    # (params then hold float32 bits of the scale and the zero point).
    float32_codes = bits == 8 and half == "bfloat16"
    zero_pair = uint32(0)

    @device
    def column_params(weights, e, group, chunk, lane, params):
        """params[2 c], params[2 c + 1]: the scale pair and the minus (magic + zero point)
        pair of the lane's column c (c = 2 j + h)."""
        weight, scales, zeros, g_idx, k_order, global_scale = weights
        g = lane // 4
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
    def fetch(weights, e, slab, chunk, lane, raw):
        weight = weights[0]
        first = chunk * words_per_chunk + lane * words_per_lane
        raw[0], raw[1], raw[2], raw[3] = ptx.load_u32x4(weight, e, slab, first)
        if words_per_lane == 8:
            raw[4], raw[5], raw[6], raw[7] = ptx.load_u32x4(weight, e, slab, first + 4)

    @device
    def int_pair(raw, column, r, scale_pair, offset_pair):
        """Fragment register r of `column` from integer codes: (q - zero) * scale."""
        if bits == 4:
            codes = (uint32(raw[column // 2]) >> uint32(4 * (2 * (column % 2) + r))) & uint32(0x000F000F)
            return fma2(fma2(codes | magic, one, offset_pair), scale_pair, zero_pair)
        codes = (uint32(raw[column]) >> uint32(8 * r)) & uint32(0x00FF00FF)
        if not float32_codes:
            return fma2(fma2(codes | magic, one, offset_pair), scale_pair, zero_pair)
        zero, scale = ptx.bits_f32(offset_pair), ptx.bits_f32(scale_pair)
        return pack2((float32(codes & uint32(0xFFFF)) - zero) * scale, (float32(codes >> uint32(16)) - zero) * scale)

    @device
    def fp4_pair(raw, column, r, scale_pair):
        """Fragment register r of `column` from e2m1 codes: sign and magnitude bits moved
        into a half's sign, exponent and top mantissa bit, then scaled back exactly."""
        codes = (uint32(raw[column // 2]) >> uint32(4 * (2 * (column % 2) + r))) & uint32(0x000F000F)
        shifted = ((codes & uint32(0x00080008)) << uint32(fp4_sign_shift)) | (
            (codes & uint32(0x00070007)) << uint32(fp4_shift))
        return fma2(fma2(shifted, unbias_pair, zero_pair), scale_pair, zero_pair)

    @device
    def decode(raw, params, weights, e, slab, chunk, lane, frags):
        for column in range(8):
            for r in range(2):
                if fp4:
                    frags[2 * column + r] = fp4_pair(raw, column, r, params[2 * column])
                else:
                    frags[2 * column + r] = int_pair(raw, column, r, params[2 * column], params[2 * column + 1])

    return FragmentReader(_group_of_slab(spec), column_params, fetch, decode, words_per_lane, True)


def _index_map_reader(spec: QuantSpec, n: int, k: int, half: str) -> FragmentReader:
    read = element_reader(spec, n, k)
    pack2 = ptx.pack2(half)
    size_n, size_k = n, k

    @device
    def group_of_slab(weights, e, slab):
        return int32(0)

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
    def decode(raw, params, weights, e, slab, chunk, lane, frags):
        g, t = lane // 4, lane % 4
        for column in range(8):
            n_ = chunk * CHUNK_N + 16 * (column // 2) + 8 * (column % 2) + g
            for r in range(2):
                kp = slab * SLAB_K + 2 * t + 8 * r
                frags[2 * column + r] = pack2(value(weights, e, n_, kp), value(weights, e, n_, kp + 1))

    return FragmentReader(group_of_slab, column_params, fetch, decode, 1, False)
