"""Named formats of the inference engines, each only a composition of transforms.

Read each one as a formula on the logical codes (N, K) (the last step applies last):

    gptq:                qweight = BitPack(b, rows) ∘ Transpose              (K/(32/b), N)
    awq:                 qweight = BitPack(4, cols, awq order) ∘ Transpose   (K, N/8)
    compressed_tensors:  weight_packed = BitPack(b, cols)                    (N, ceil(K/(32/b)))
    marlin:              qweight = BitPack(b, cols) ∘ Permute(weight perm) ∘ Tile(16, 16) ∘ Transpose
    native:              BitPack ∘ Permute ∘ Panels(2 chunks) ∘ Tile(16, 16) ∘ Pad(16, 128) ∘ Transpose;
                         scales Permute ∘ Panels(128) ∘ Pad: the kernels' layout (NVFP4 too, bits placed)
    nvfp4:               weight_packed = BitPack(4, cols, bytes);  weight_scale = [Swizzle128x4]
    trtllm_fp4_moe:      rows: Permute(32-row shuffle) ∘ [InterleaveHalves]; scales then Swizzle128x4

Every format takes the MoE stacking (E, ...) in stride: transforms act on the last two axes.
The byte-exactness of each is checked against the engines' own code in tests/test_layouts_golden.py.
"""

from __future__ import annotations

import functools

from .encodings import E2M1, FloatFormat, IntCode
from .spec import QuantSpec, Tensor
from .transforms import (BitPack, InterleaveHalves, Layout, Pad, PadHalves, Panels, Permute, SwapHalves,
                         Swizzle128x4, Tile, Transpose)

AWQ_ORDER = {4: (0, 2, 4, 6, 1, 3, 5, 7), 8: (0, 2, 1, 3)}
"""In-word order of AWQ (and of Marlin's zero points): slot s holds element AWQ_ORDER[s]."""


def _check_bits(bits: int, allowed=(4, 8)) -> None:
    if bits not in allowed:
        raise ValueError(f"bits must be one of {allowed} for this format, got {bits!r}")


def _int_code(bits: int, symmetric: bool) -> IntCode:
    return IntCode(bits, bias=1 << (bits - 1) if symmetric else None)


def gptq(bits: int = 4, group_size: int | None = 128, *, symmetric: bool = True,
         act_order: bool = False, checkpoint_format: str = "gptq") -> QuantSpec:
    """GPTQ (AutoGPTQ / vLLM): (K, N) matrices packed along K; asymmetric zero points packed
    along N and stored minus one in v1 checkpoints (`checkpoint_format='gptq'`), as is
    in 'gptq_v2'; act-order stores `g_idx` (the group of every input feature)."""
    _check_bits(bits)
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"checkpoint_format must be 'gptq' or 'gptq_v2', got {checkpoint_format!r}")
    zeros = None if symmetric else Tensor("qzeros", Layout((Transpose(), BitPack(bits, axis=-1))))
    return QuantSpec(
        name=f"gptq_int{bits}", code=_int_code(bits, symmetric),
        weight=Tensor("qweight", Layout((Transpose(), BitPack(bits, axis=-2)))),
        scales=Tensor("scales", Layout((Transpose(),))), group_size=group_size,
        zeros=zeros, zero_offset=-1 if (zeros and checkpoint_format == "gptq") else 0,
        g_idx_name="g_idx" if act_order else None,
    )


def awq(bits: int = 4, group_size: int | None = 128) -> QuantSpec:
    """AWQ: (K, N) matrices packed along N with the interleaved in-word order; zero points
    (true ones, no offset) packed the same way."""
    _check_bits(bits, (4,))
    packed = Layout((Transpose(), BitPack(bits, axis=-1, order=AWQ_ORDER[bits])))
    return QuantSpec(
        name=f"awq_int{bits}", code=_int_code(bits, symmetric=False),
        weight=Tensor("qweight", packed), scales=Tensor("scales", Layout((Transpose(),))),
        group_size=group_size, zeros=Tensor("qzeros", packed),
    )


def compressed_tensors(bits: int = 4, group_size: int | None = 128, *, symmetric: bool = True) -> QuantSpec:
    """compressed-tensors pack-quantized: (N, K) as stored, codes packed along K (last word
    zero padded); asymmetric zero points packed along N; `weight_shape` holds (N, K)."""
    _check_bits(bits)
    zeros = None if symmetric else Tensor("weight_zero_point", Layout((BitPack(bits, axis=-2),)))
    return QuantSpec(
        name=f"compressed_tensors_int{bits}", code=_int_code(bits, symmetric),
        weight=Tensor("weight_packed", Layout((BitPack(bits, axis=-1),))),
        scales=Tensor("weight_scale"), group_size=group_size, zeros=zeros, shape_name="weight_shape",
    )


@functools.cache
def marlin_weight_perm(bits: int) -> tuple[int, ...]:
    """Marlin's permutation of each 1024-code chunk (4 tiles of 16x16): the order in which
    the tensor-core fragments consume codes, then an in-word interleave that lets the
    kernel convert two codes at a time."""
    perm = []
    for i in range(32):
        col, block_rows = i // 4, []
        for block in (0, 1):
            for row in (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1):
                block_rows.append(16 * row + col + 8 * block)
        for j in range(4):
            perm.extend(p + 256 * j for p in block_rows)
    interleave = AWQ_ORDER[bits]
    width = len(interleave)
    return tuple(perm[c * width + interleave[s]] for c in range(len(perm) // width) for s in range(width))


E2M1_HALF_PLACES = (0, 1, 2, 9, 3, 4, 5, 12, 6, 7, 8, 15, 14, 10, 11, 13)
NVFP4_PLACES = E2M1_HALF_PLACES + tuple(16 + p for p in E2M1_HALF_PLACES)
"""Where the native NVFP4 layout stores the bits of the four e2m1 codes of each 16-bit
half (mantissa, exponent low, exponent high, sign; slot by slot). A bfloat16 wants a
code's magnitude in bits 6..8 and its sign in bit 15: slots 0..2 keep that shape, moved
down by 6, 3 and 0 bits, so one shift and one mask decode them (two per code otherwise);
slot 3 takes the four bits left, ordered so that one shift, one mask, one multiply (three
copies, none overlapping) and one mask move them: 9 instructions a word, against 13 for
codes in order. Its exponent sits where a float16 wants it (bits 10, 11): float16 takes
14, against 15. See `numba_kernels.fragments` (`e2m1_moves`, `bit_spread`)."""

MARLIN_SCALE_PERM = tuple(i + 8 * j for i in range(8) for j in range(8))
MARLIN_SCALE_PERM_SINGLE = tuple(2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25))


def marlin(bits: int = 4, group_size: int | None = 128, *, zero_points: bool = False,
           act_order: bool = False, scale_dtype: str = "float16") -> QuantSpec:
    """Marlin (vLLM gptq_marlin / awq_marlin, dense and MoE): 16x16 tiles of the (K, N)
    codes, each 1024-code chunk permuted, packed along N; scales permuted by 64-column
    chunks (32 when channel-wise: pass group_size=None); AWQ-style zero points
    (`zero_points=True`, raw uint4 codes) permuted like scales and interleaved like AWQ;
    act-order stores K sorted by group with `g_idx_sort_indices`. Scales are stored in the
    activations' half type (`scale_dtype`: float16 or bfloat16)."""
    _check_bits(bits)
    if zero_points and act_order:
        raise ValueError("Marlin has no act-order variant with zero points")
    return _marlin_tiles(f"marlin_int{bits}", _int_code(bits, symmetric=not zero_points), bits, group_size,
                         zero_points=zero_points, act_order=act_order, scale_format=FloatFormat(scale_dtype))


NATIVE_PANEL = 128
"""Output features of a column panel of the native layout: every tensor stores two
64-feature chunks over all of K as one run (`Panels`), so that a CTA of those chunks
reads its weights in order, a prefill stage of them in one piece (codes, scales and zero
points each)."""


def _marlin_tiles(name: str, code, bits: int, group_size: int | None, *, zero_points: bool = False,
                  act_order: bool = False, scale_format: FloatFormat, pad: tuple[int, int] | None = None,
                  panel: int | None = None, global_scale_name: str | None = None,
                  places: tuple[int, ...] | None = None) -> QuantSpec:
    """Marlin's tensor-core tile layout, optionally zero padded along (K, N) first and
    stored in column panels `panel` output features wide; `places` scatters the bits of
    each word (`BitPack.places`)."""
    padding = () if pad is None else (Pad(*pad),)
    scale_padding = () if pad is None else (Pad(1, pad[1]),)
    panels, code_panels = ((), ()) if panel is None else ((Panels(panel),), (Panels(panel * 16),))  # a slab: 16 codes
    scale_perm = MARLIN_SCALE_PERM if group_size is not None else MARLIN_SCALE_PERM_SINGLE
    zeros = None
    if zero_points:
        zeros = Tensor("qzeros", Layout((Transpose(),) + scale_padding + panels + (
            Permute(MARLIN_SCALE_PERM), BitPack(bits, axis=-1, order=AWQ_ORDER[bits]))))
    return QuantSpec(
        name=name, code=code,
        weight=Tensor("qweight", Layout((Transpose(),) + padding + (Tile(16, 16),) + code_panels + (
            Permute(marlin_weight_perm(bits)), BitPack(bits, axis=-1, places=places)))),
        scales=Tensor("scales", Layout((Transpose(),) + scale_padding + panels + (Permute(scale_perm),))),
        scale_format=scale_format, group_size=group_size, zeros=zeros,
        g_idx_name="g_idx" if act_order else None, sort_k_by_group=act_order,
        global_scale_name=global_scale_name,
    )


def native(bits: int = 4, group_size: int | None = 128, *, zero_points: bool = False, act_order: bool = False,
           half: str = "bfloat16", fp4: bool = False) -> QuantSpec:
    """The kernels' own layout, which weight processing converts every checkpoint into once:
    Marlin's tile layout (a lane's tensor-core B fragments for a 16 x 64 slab of (K, N) sit
    in 16 contiguous bytes) in column panels of two chunks (`NATIVE_PANEL`), zero padded so
    any shape fits (K to 16, N to 128), scales in the activations' `half` type. The same
    layout serves decode (a CTA's chunks read down their panels) and prefill (a stage a
    run of each panel).

    `fp4=True` is NVFP4 in the same tiles: e2m1 codes with their bits placed for bfloat16
    (`NVFP4_PLACES`), one scale byte per 16 input features (permuted like Marlin's), and
    a per-expert global-scale divisor. The scale bytes are e4m3's values re-stored as
    float8_ue5m3 (no sign, five exponent bits), which the kernel turns into half pairs in
    two instructions instead of six."""
    if fp4:
        return _marlin_tiles("native_nvfp4", E2M1(), 4, 16, scale_format=FloatFormat("float8_ue5m3"),
                             pad=(16, NATIVE_PANEL), panel=NATIVE_PANEL, global_scale_name="weight_global_scale",
                             places=NVFP4_PLACES)
    _check_bits(bits)
    if zero_points and act_order:
        raise ValueError("the native layout has no act-order variant with zero points")
    return _marlin_tiles(f"native_int{bits}", _int_code(bits, symmetric=not zero_points), bits, group_size,
                         zero_points=zero_points, act_order=act_order, scale_format=FloatFormat(half),
                         pad=(16, NATIVE_PANEL), panel=NATIVE_PANEL)


# NVFP4 checkpoints by exporter: the packed weight's name, the global scale's, and whether
# the global scale is stored as its reciprocal.
NVFP4_CHECKPOINTS = {"compressed_tensors": ("weight_packed", "weight_global_scale", False),
                     "modelopt": ("weight", "weight_scale_2", True)}


def nvfp4(*, checkpoint: str = "compressed_tensors", swizzled: bool = False) -> QuantSpec:
    """NVFP4: e2m1 nibbles two per byte (even element in the low nibble), one fp8 e4m3
    scale per 16 elements, and a per-tensor global scale: a divisor in compressed-tensors
    (`weight_global_scale`), its reciprocal in ModelOpt (`weight_scale_2`). `swizzled=True`
    stores the scales in the 128x4 layout the cutlass / TensorRT-LLM kernels read."""
    if checkpoint not in NVFP4_CHECKPOINTS:
        raise ValueError(f"checkpoint must be one of {sorted(NVFP4_CHECKPOINTS)}, got {checkpoint!r}")
    weight_name, global_name, reciprocal = NVFP4_CHECKPOINTS[checkpoint]
    return QuantSpec(
        name=f"nvfp4_{checkpoint}" + ("_swizzled" if swizzled else ""), code=E2M1(),
        weight=Tensor(weight_name, Layout((BitPack(4, axis=-1, word_bits=8),))),
        scales=Tensor("weight_scale", Layout((Swizzle128x4(),) if swizzled else ())),
        scale_format=FloatFormat("float8_e4m3"), group_size=16,
        global_scale_name=global_name, global_scale_reciprocal=reciprocal,
    )


def trtllm_shuffle_perm(epilogue_tile_m: int = 128) -> tuple[int, ...]:
    """TensorRT-LLM's row shuffle inside blocks of 32 rows (16 unless epilogue_tile_m % 128 == 0):
    new row n takes old row (B/8) * (n % 8) + n // 8."""
    block = 32 if epilogue_tile_m % 128 == 0 else 16
    return tuple((block // 8) * (n % 8) + n // 8 for n in range(block))


def trtllm_fp4_moe(*, gated: bool = True, epilogue_tile_m: int = 128, swap_w1_w3: bool = False,
                   hidden_alignment: int = 1, intermediate_alignment: int = 1) -> QuantSpec:
    """NVFP4 weights as FlashInfer's TensorRT-LLM MoE kernels read them (vLLM's
    prepare_static_weights_for_trtllm_fp4_moe): gated (w13, rows = 2 x intermediate) rows
    interleaved gate/up, then shuffled in 32-row blocks; the scales get the same row
    permutation, then the 128x4 swizzle. Use gated=False for w2 (rows = hidden).

    vLLM's whole FLASHINFER_TRTLLM path (`vllm_trtllm_fp4_moe`) first swaps [w1; w3] to
    [w3; w1] and zero-pads hidden and (each half of) intermediate to its alignments. The
    shuffled rows must be multiples of 128 after padding (the engines assert it)."""
    hidden_axis, intermediate_axis = (-1, -2) if gated else (-2, -1)

    def pad(axis, multiple, per_element):
        if multiple == 1:
            return None
        if axis == -1 and multiple % 16:
            raise ValueError(f"an alignment along K must be a multiple of 16 (one scale block), got {multiple}")
        return Pad(multiple, 1) if axis == -2 else Pad(1, multiple // per_element)

    def steps(per_element):
        pads = [SwapHalves(axis=-2) if swap_w1_w3 else None, pad(hidden_axis, hidden_alignment, per_element)]
        if intermediate_alignment > 1:
            pads.append(PadHalves(intermediate_alignment, axis=intermediate_axis) if gated
                        else pad(intermediate_axis, intermediate_alignment, per_element))
        if gated:
            pads.append(InterleaveHalves(axis=-2))
        return tuple(p for p in pads if p is not None) + (Permute(trtllm_shuffle_perm(epilogue_tile_m), axis=-2),)

    if swap_w1_w3 and not gated:
        raise ValueError("swap_w1_w3 applies to the gated w13 weight only")
    return QuantSpec(
        name="trtllm_fp4_moe_" + ("w13" if gated else "w2"), code=E2M1(),
        weight=Tensor("weight", Layout(steps(1) + (BitPack(4, axis=-1, word_bits=8),))),
        scales=Tensor("weight_scale", Layout(steps(16) + (Swizzle128x4(),))),
        scale_format=FloatFormat("float8_e4m3"), group_size=16,
        global_scale_name="weight_scale_2", global_scale_reciprocal=True,
    )


def vllm_trtllm_fp4_moe(*, gated: bool = True) -> QuantSpec:
    """vLLM's FLASHINFER_TRTLLM NVFP4 MoE weights: w1/w3 swapped, hidden padded to 256,
    intermediate to 64 per half, then `trtllm_fp4_moe`. Unpack with the logical shape."""
    return trtllm_fp4_moe(gated=gated, swap_w1_w3=gated, hidden_alignment=256, intermediate_alignment=64)
