"""Device functions that read one element of ANY spec, generated from its index maps.

`layouts` defines each physical tensor by an index map (logical (i, j) -> physical
(row, col, bit shift)); `Layout.locate(shape, wrap=device)` turns the same map into a
chain of Numba device functions. So a kernel reads a weight in whatever layout it is
stored, without a line of format-specific code:

    value = read(weights, e, n, kp)     # float32 W[e, n, k(kp)], dequantized

`kp` is the *stored* input-feature position: the logical k itself, except for specs that
store K sorted by group (act-order Marlin), where logical k = k_order[e, kp]. Kernels walk
stored positions and gather activations through `logical_k`.

These readers are correct for every spec the layout language can express and are what
the dequantize and repack kernels and the generic GEMM use. They are not fast (one
index-map evaluation and one scattered load per element); the GEMM's fast path reads the
kernel-native layout with 16-byte loads instead (`numba_kernels.fragments`).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import float32, int16, int32, uint8, uint32

from layouts import E2M1, QuantSpec
from layouts.encodings import E2M1_VALUES, UE5M3_BIAS, UE5M3_FIRST, UE5M3_LAST, FloatFormat

from .ptx import device, f32_bits, half_to_f32, to_half


def scale_decoder(scale_format: FloatFormat):
    """Device function: one stored scale element -> float32."""
    if scale_format.name in ("bfloat16", "float16"):
        return half_to_f32(scale_format.name)
    table = scale_format.byte_values
    if table is not None:

        @device
        def decode_fp8(x):
            return table[uint32(x) & uint32(0xFF)]

        return decode_fp8

    @device
    def decode_float32(x):
        return float32(x)

    return decode_float32


@device
def encode_e4m3(x):
    """float32 -> float8_e4m3fn byte (uint32), as `layouts.encodings.e4m3_encode`: round to
    nearest even, saturate at ±448 (infinities too), NaN -> 0x7F, the sign kept (-0 -> 0x80).

    Integer rounding on the float32 bits: keep the e4m3 bits of the significand, round up
    when the dropped bits exceed half a step (or equal it with an odd kept part). Normals
    (>= 2^-6) keep 3 mantissa bits and re-bias the exponent; subnormals are k * 2^-9, k from
    the significand shifted by 14 - exponent. A carry rolls into the exponent by itself."""
    bits = f32_bits(x)
    sign = int32((bits >> uint32(24)) & uint32(0x80))
    magnitude = int32(bits & uint32(0x7FFFFFFF))
    if magnitude > 0x7F800000:
        return uint32(0x7F)
    if magnitude >= 0x43E00000:  # 448.0
        return uint32(sign | 0x7E)
    exponent = magnitude >> 23
    if exponent >= 121:  # 2^-6 and up, normal: exponent and 3 mantissa bits, re-biased 127 -> 7
        shift, source, rebias = int32(20), magnitude, int32(120 << 3)
    elif exponent >= 117:  # 2^-10 up to 2^-6: a subnormal k * 2^-9 (k = 0 .. 8 after rounding)
        shift, source, rebias = int32(141 - exponent), int32((magnitude & 0x7FFFFF) | 0x800000), int32(0)
    else:  # below 2^-10: rounds to zero
        return uint32(sign)
    kept = (source >> shift) - rebias
    dropped = source & ((int32(1) << shift) - 1)
    half_step = int32(1) << (shift - 1)
    if dropped > half_step or (dropped == half_step and (kept & 1) == 1):
        kept += 1
    return uint32(sign | kept)


@device
def encode_ue5m3(x):
    """float32 -> float8_ue5m3 byte (uint32) of |x|, as `layouts.encodings.ue5m3_encode`
    (nearest even, clamped to [2**-21, 480]); zero and NaN give 1.0. Signs and zeros are
    the caller's to fold into the codes (the repack kernel does)."""
    magnitude = int32(f32_bits(x) & uint32(0x7FFFFFFF))
    if magnitude == 0 or magnitude > 0x7F800000:
        return uint32(UE5M3_BIAS << 3)
    exponent = magnitude >> 23
    if exponent < 127 + 1 - UE5M3_BIAS:  # below 2**-21 (exponent bits 1)
        return uint32(UE5M3_FIRST)
    if exponent > 127 + 30 - UE5M3_BIAS:  # 512 and up (past exponent bits 30)
        return uint32(UE5M3_LAST)
    kept = (magnitude >> 20) - ((127 - UE5M3_BIAS) << 3)
    dropped = magnitude & 0xFFFFF
    if dropped > 0x80000 or (dropped == 0x80000 and (kept & 1) == 1):
        kept += 1
    return uint32(min(kept, UE5M3_LAST))


def scale_encoder(scale_format: FloatFormat):
    """Device function: float32 -> one stored scale element (the inverse of
    `scale_decoder`, rounding to nearest even as `FloatFormat.encode` does). Half formats
    give their bits as int16, the float8 formats a uint8 byte, float32 the value."""
    if scale_format.name in ("bfloat16", "float16"):
        round_to_half = to_half(scale_format.name)

        @device
        def encode_half(x):
            return int16(round_to_half(x))

        return encode_half
    if scale_format.name in ("float8_e4m3", "float8_ue5m3"):
        encode_byte = encode_e4m3 if scale_format.name == "float8_e4m3" else encode_ue5m3

        @device
        def encode_fp8(x):
            return uint8(encode_byte(x))

        return encode_fp8

    @device
    def encode_float32(x):
        return float32(x)

    return encode_float32


def _code_extractor(layout, bits: int):
    """Device function (word, shift) -> the uint32 code `locate` placed at `shift` of a
    stored word (a BitPack's scattered `places` applied; one code per element without one)."""
    pack = layout.bitpack
    if pack is None:
        mask = uint32((1 << bits) - 1)

        @device
        def whole(word, shift):
            return uint32(word) & mask

        return whole
    extract = device(pack.extract_fn())

    @device
    def packed(word, shift):
        return uint32(extract(uint32(word), uint32(shift)))

    return packed


def group_reader(spec: QuantSpec):
    """Device function (g_idx, e, kp) -> scale group of stored input feature kp."""
    if spec.g_idx_name is not None:
        @device
        def group_from_g_idx(g_idx, e, kp):
            return int32(g_idx[e % g_idx.shape[0], kp])

        return group_from_g_idx
    if spec.group_size is None:
        @device
        def group_channel(g_idx, e, kp):
            return int32(0)

        return group_channel
    group_size = spec.group_size

    @device
    def group_block(g_idx, e, kp):
        return int32(kp // group_size)

    return group_block


@functools.cache
def logical_k(spec: QuantSpec):
    """Device function (k_order, e, kp) -> the logical input feature stored at kp."""
    if spec.sort_k_by_group:
        @device
        def sorted_k(k_order, e, kp):
            return int32(k_order[e % k_order.shape[0], kp])

        return sorted_k

    @device
    def same_k(k_order, e, kp):
        return int32(kp)

    return same_k


@functools.cache
def code_reader(spec: QuantSpec, n: int, k: int):
    """Device function (weight, e, n, kp) -> the stored integer code (uint32)."""
    locate = spec.weight.layout.locate((n, k), wrap=device)
    extract = _code_extractor(spec.weight.layout, spec.code.bits)

    @device
    def read_code(weight, e, n_, kp):
        row, col, shift = locate(n_, kp)
        return extract(weight[e, row, col], shift)

    return read_code


@functools.cache
def scale_reader(spec: QuantSpec, n: int, k: int):
    """Device function (scales, e, n, group) -> float32 scale (before any global scale)."""
    locate = spec.scales.layout.locate((n, spec.groups(k)), wrap=device)
    decode = scale_decoder(spec.scale_format)

    @device
    def read_scale(scales, e, n_, group):
        row, col, _ = locate(n_, group)
        return decode(scales[e, row, col])

    return read_scale


@functools.cache
def zero_reader(spec: QuantSpec, n: int, k: int):
    """Device function (zeros, e, n, group) -> the logical zero point (uint32); for
    symmetric codes, the fixed bias."""
    mask = (1 << spec.code.bits) - 1
    if spec.zeros is None:
        bias = spec.code.bias or 0

        @device
        def fixed_bias(zeros, e, n_, group):
            return uint32(bias)

        return fixed_bias
    locate = spec.zeros.layout.locate((n, spec.groups(k)), wrap=device)
    extract = _code_extractor(spec.zeros.layout, spec.code.bits)
    offset = spec.zero_offset

    @device
    def read_zero(zeros, e, n_, group):
        row, col, shift = locate(n_, group)
        stored = int32(extract(zeros[e, row, col], shift))
        return uint32((stored - offset) & mask)

    return read_zero


@functools.cache
def global_scale_reader(spec: QuantSpec):
    """Device function (global_scale, e) -> float32 multiplier of the block scales
    (1 / global_scale, as the layouts define it; the stored reciprocal for ModelOpt)."""
    if spec.global_scale_name is None:
        @device
        def no_global(global_scale, e):
            return float32(1.0)

        return no_global
    reciprocal_stored = spec.global_scale_reciprocal

    @device
    def global_multiplier(global_scale, e):
        stored = float32(global_scale[uint32(e) % uint32(global_scale.shape[0])])  # e >= 0: a 32-bit remainder
        return stored if reciprocal_stored else float32(1.0) / stored

    return global_multiplier


@functools.cache
def element_reader(spec: QuantSpec, n: int, k: int):
    """Device function (weights, e, n, kp) -> float32 dequantized weight at stored kp.

    `weights` is the six-array tuple of `KernelWeights`. Follows `QuantSpec.dequantize`:
    (code - zero) * scale for integer codes, e2m1(code) * scale / global_scale for fp4.
    """
    read_code, read_scale = code_reader(spec, n, k), scale_reader(spec, n, k)
    read_zero, group_of = zero_reader(spec, n, k), group_reader(spec)
    global_multiplier = global_scale_reader(spec)
    fp4 = isinstance(spec.code, E2M1)
    e2m1 = E2M1_VALUES

    @device
    def read(weights, e, n_, kp):
        weight, scales, zeros, g_idx, k_order, global_scale = weights
        code = read_code(weight, e, n_, kp)
        group = group_of(g_idx, e, kp)
        scale = read_scale(scales, e, n_, group)
        if fp4:
            return e2m1[code] * scale * global_multiplier(global_scale, e)
        zero = read_zero(zeros, e, n_, group)
        return (float32(code) - float32(zero)) * scale

    return read


def reference_values(spec: QuantSpec, physical: dict, shape) -> np.ndarray:
    """float64 (E, N, K) values in *stored* K order (what `element_reader` returns)."""
    values = spec.dequantize(physical, shape)
    values = values.reshape((-1,) + values.shape[-2:])
    if spec.sort_k_by_group:
        order = np.asarray(physical[spec.sort_indices_name]).reshape(-1, values.shape[-1])
        values = np.take_along_axis(values, np.broadcast_to(order[:, None, :], values.shape), axis=-1)
    return values
