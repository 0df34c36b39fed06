"""Repack on the device is bit-exact with `layouts.convert` (dst.pack(src.unpack(...))):
for random pairs of layouts, for the engines' own conversions (golden bytes), and at
realistic shapes on the GPU; incompatible pairs are refused with clear errors."""

import time
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st
from numba import cuda

import layouts
from layouts import E2M1, FloatFormat, Quantized, Tensor, formats
from layouts.encodings import e4m3_encode, ue5m3_encode
from layouts.samples import random_quantized
from layouts.strategies import layout, quantized_for, spec_for, weight_shape
from numba_kernels import interop, ptx
from numba_kernels.elements import encode_e4m3, encode_ue5m3
from numba_kernels.repack import destination_tensors, reference_repack, repack
from numba_kernels.weights import KernelWeights

DATA = Path(__file__).parent / "data"
POISON = 0xA5
SCALE_FORMATS = ["float16", "bfloat16", "float32", "float8_e4m3"]


def load(name: str) -> dict:
    return dict(np.load(DATA / f"{name}.npz", allow_pickle=False))


@st.composite
def layout_pair(draw, max_experts: int = 3, max_size: int = 32):
    """(src_spec, dst_spec, Quantized): two specs for the same code, group size, zero
    points and act-order, each with its own random layouts (K sorted or not, zero offset,
    global-scale convention); one pair in two also changes the scale format (e2m1 codes
    to float8_ue5m3 too, which folds the e4m3 scales' signs and zeros into the codes)."""
    shape = draw(weight_shape(max_experts, max_size))
    src = draw(spec_for(shape))
    n, k = shape[-2:]
    groups = src.groups(k)
    zeros = None if src.zeros is None else Tensor("dst_zeros", draw(layout((n, groups), bits=src.code.bits)))
    dst = attrs.evolve(
        src, name="random_dst",
        weight=Tensor("dst_weight", draw(layout((n, k), bits=src.code.bits))),
        scales=Tensor("dst_scales", draw(layout((n, groups)))),
        scale_format=FloatFormat(draw(st.sampled_from(SCALE_FORMATS + ["float8_ue5m3"] * isinstance(src.code, E2M1))))
        if draw(st.booleans()) else src.scale_format,
        zeros=zeros, zero_offset=draw(st.sampled_from([0, -1])) if zeros is not None else 0,
        sort_k_by_group=src.g_idx_name is not None and draw(st.booleans()),
        global_scale_reciprocal=src.global_scale_name is not None and draw(st.booleans()),
        shape_name=draw(st.sampled_from([None, "weight_shape"])),
    )
    return src, dst, draw(quantized_for(src, shape))


def poisoned_destination(dst_spec, shape) -> dict:
    """Destination tensors with every byte POISON, so unwritten elements show."""
    out = {name: interop.empty(tensor_shape, dtype)
           for name, (tensor_shape, dtype) in destination_tensors(dst_spec, shape).items()}
    for tensor in out.values():
        tensor.view(torch.uint8).fill_(POISON)
    return out


def per_expert_bytes(value, experts: int) -> np.ndarray:
    """(experts, bytes) of a tensor, torch or numpy, with a leading expert axis."""
    if isinstance(value, torch.Tensor):
        return value.cpu().contiguous().reshape(experts, -1).view(torch.uint8).numpy()
    return np.ascontiguousarray(value).reshape(experts, -1).view(np.uint8)


def expected_stack(value, experts: int, name: str, dst_spec) -> np.ndarray:
    """dst_spec.pack's array for `name` with a leading expert axis (a dense weight's
    tensors, and g_idx, sort indices or a global scale shared by all experts, broadcast)."""
    value = np.asarray(value)
    if name in (dst_spec.g_idx_name, dst_spec.sort_indices_name):
        per_expert = value.shape[-1:]
    elif name == dst_spec.global_scale_name:
        per_expert = ()
    else:
        per_expert = value.shape[-2:]
    return np.broadcast_to(value.reshape((-1,) + per_expert), (experts,) + per_expert)


def assert_same_bytes(got: dict, expected: dict, dst_spec, experts: int, converted=None):
    """Every destination tensor equals `expected` (numpy, as dst_spec.pack gives it) on the
    converted experts, and still holds POISON on the others."""
    assert set(got) == set(expected)
    converted = list(range(experts)) if converted is None else list(converted)
    others = [e for e in range(experts) if e not in converted]
    for name, value in expected.items():
        if name == dst_spec.shape_name:
            assert got[name].cpu().tolist() == [experts] + list(value[-2:]), name
            continue
        assert got[name].element_size() == np.asarray(value).itemsize, name
        got_bytes = per_expert_bytes(got[name], experts)
        expected_bytes = per_expert_bytes(expected_stack(value, experts, name, dst_spec), experts)
        np.testing.assert_array_equal(got_bytes[converted], expected_bytes[converted], err_msg=name)
        assert np.all(got_bytes[others] == POISON), name


def select(q: Quantized, experts: range) -> Quantized:
    """The selected experts of a stacked logical weight (shared g_idx stays shared)."""
    index = list(experts)
    return Quantized(q.codes[index], q.scales[index], None if q.zeros is None else q.zeros[index], q.g_idx,
                     None if q.global_scale is None else q.global_scale[index])


# -- properties -------------------------------------------------------------------------------

@given(layout_pair(), st.data())
def test_repack_matches_convert_for_random_layout_pairs(case, data):
    src_spec, dst_spec, q = case
    shape = q.codes.shape
    stacked = len(shape) == 3
    experts = shape[0] if stacked else 1
    start = data.draw(st.integers(0, experts - 1), label="first expert")
    stop = data.draw(st.integers(start + 1, experts), label="stop")
    selection = range(start, stop, data.draw(st.sampled_from([1, 2]), label="step"))
    source_holds_selection = stacked and data.draw(st.booleans(), label="source holds only the selection")
    source_q = select(q, selection) if source_holds_selection else q
    src = KernelWeights.from_physical(src_spec, src_spec.pack(source_q), source_q.codes.shape)
    out = poisoned_destination(dst_spec, (experts,) + shape[-2:])

    got = repack(src, dst_spec, out=out, experts=selection)

    expected = reference_repack(src_spec, src_spec.pack(q), dst_spec, shape)
    assert all(got[name].data_ptr() == out[name].data_ptr() for name in out)  # filled in place
    assert_same_bytes(got, expected, dst_spec, experts, converted=selection)


@pytest.mark.parametrize("device_encode, encode", [(encode_e4m3, e4m3_encode), (encode_ue5m3, ue5m3_encode)],
                         ids=["e4m3", "ue5m3"])
def test_fp8_encoder_is_the_numpy_encode_on_every_rounding_class(device_encode, encode):
    """Every float32 whose low 16 bits are 0 or 1: all signs, exponents and top 7 mantissa
    bits (which hold the round bit of every fp8 normal and subnormal), each with the
    sticky bits below clear (exact values and ties) or set; infinities and NaNs too
    (ue5m3, which has no sign, zero or NaN: the positive finite ones)."""
    high = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    values = (high[:, None] | np.array([0, 1], np.uint32)).ravel().view(np.float32)
    if encode is ue5m3_encode:
        values = values[(values > 0) & np.isfinite(values)]
    if ptx.SIMULATED:  # a device function is a Python function here: a launch only adds overhead
        codes = np.array([device_encode(value) for value in values], np.uint8)
    else:
        @ptx.kernel
        def encode_all(values, codes):
            for index in range(cuda.grid(1), values.shape[0], cuda.gridsize(1)):
                codes[index] = device_encode(values[index])

        codes = torch.zeros(values.shape, dtype=torch.uint8, device="cuda")
        encode_all[512, 256](interop.to_kernel(torch.from_numpy(values).cuda()), interop.to_kernel(codes))
        codes = codes.cpu().numpy()
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(codes, encode(values))


def test_nvfp4_with_negative_and_zero_block_scales_repacks_to_the_native_layout():
    """The native layout's ue5m3 scales have no sign or zero: the repack folds them into
    the e2m1 codes as `QuantSpec.pack` does, bit for bit, and the weights stay the same."""
    src_spec, dst_spec, shape = formats.nvfp4(), formats.native(fp4=True), (2, 64, 64)
    rng = np.random.default_rng(3)
    scales = np.array([0.5, -0.5, 0.0, -0.0, 2.0 ** -9, -448.0])[rng.integers(0, 6, (2, 64, 4))]
    q = Quantized(rng.integers(0, 16, shape), scales, global_scale=np.array([1.0, 4.0], np.float32))
    physical = src_spec.pack(q)
    got = repack(KernelWeights.from_physical(src_spec, physical, shape), dst_spec,
                 out=poisoned_destination(dst_spec, shape))
    expected = reference_repack(src_spec, physical, dst_spec, shape)
    assert_same_bytes(got, expected, dst_spec, 2)
    np.testing.assert_array_equal(dst_spec.dequantize(expected, shape), src_spec.dequantize(physical, shape))


def test_repack_refuses_nan_scales_a_destination_cannot_fold():
    src_spec, shape = formats.nvfp4(), (1, 64, 32)
    physical = src_spec.pack(Quantized(np.zeros(shape[1:], np.int64), np.ones((64, 2)), global_scale=[1.0]))
    physical["weight_scale"][3, 1] = 0x7F  # e4m3 NaN
    with pytest.raises(ValueError, match="src scales hold NaN, which dst_spec 'native_nvfp4' cannot store"):
        repack(KernelWeights.from_physical(src_spec, physical, shape[1:]), formats.native(fp4=True))


# -- the engines' conversions: golden bytes ------------------------------------------------------

# The simulator runs ~5,000 threads a second: there the golden weights are cropped to
# their first 64 output and 128 input features. Every layout below is closed under that
# crop at its tile boundaries (Marlin's 16x64 tiles and 64-column scale permutation,
# GPTQ / AWQ / compressed-tensors packing), so the expected bytes are a crop of the golden
# ones; on the GPU the whole tensors are converted.
CROP = (64, 128) if ptx.SIMULATED else None


def crop(physical: dict, spec, shape, keep=CROP) -> dict:
    """The tensors of `spec` in `physical` for the first `keep` (N, K) of a `shape` weight."""
    if keep is None:
        return physical
    n, k = keep
    groups = spec.groups(k)
    cropped = {}
    for tensor, logical in [(spec.weight, (n, k)), (spec.scales, (n, groups))] + (
            [(spec.zeros, (n, groups))] if spec.zeros is not None else []):
        rows, cols = tensor.layout.physical_shape(logical)
        cropped[tensor.name] = physical[tensor.name][..., :rows, :cols]
    return cropped


def cropped_shape(shape):
    return shape if CROP is None else shape[:-2] + CROP


MARLIN_CASES = [
    ("marlin_gptq_int4_g128_N256_K512", formats.gptq(4), formats.marlin(4)),
    ("marlin_gptq_int8_g128_N256_K512", formats.gptq(8), formats.marlin(8)),
    ("marlin_gptq_int4_ch_N256_K512", formats.gptq(4, None), formats.marlin(4, None)),
    ("marlin_awq_int4_zp_g128_N256_K512", formats.awq(), formats.marlin(4, zero_points=True)),
    ("marlin_moe_gptq_int4_g128_E2_N256_K512", formats.gptq(4), formats.marlin(4)),
    ("marlin_moe_awq_int4_zp_g128_E2_N256_K512", formats.awq(), formats.marlin(4, zero_points=True)),
]


@pytest.mark.parametrize("name, src_spec, dst_spec", MARLIN_CASES, ids=[case[0] for case in MARLIN_CASES])
def test_checkpoint_repacks_to_the_engines_marlin_bytes(name, src_spec, dst_spec):
    case = load(name)
    shape = case["in_codes"].shape
    checkpoint = "awq" if src_spec.zeros is not None else "gptq"
    source = {tensor: case[f"out_{checkpoint}_{tensor}"] for tensor in ("qweight", "scales", "qzeros")
              if f"out_{checkpoint}_{tensor}" in case}
    marlin = {tensor: case[f"out_{tensor}"] for tensor in ("qweight", "scales", "qzeros") if f"out_{tensor}" in case}
    src = KernelWeights.from_physical(src_spec, crop(source, src_spec, shape), cropped_shape(shape))
    experts = src.num_experts
    got = repack(src, dst_spec, out=poisoned_destination(dst_spec, src.shape))
    assert_same_bytes(got, crop(marlin, dst_spec, shape), dst_spec, experts)


@pytest.mark.parametrize("name", ["ct_pack_int4_asym_g128_N256_K512", "ct_pack_int4_sym_g128_E2_N256_K512"])
def test_compressed_tensors_repacks_to_gptq(name):
    """compressed-tensors (N, K) packed along K -> GPTQ v1 (K, N) packed along K (zero
    points stored minus one); the GPTQ bytes are the GPTQ format's pack of the same
    logical weight (itself checked against vLLM in test_layouts_golden)."""
    case = load(name)
    symmetric = "in_zeros" not in case
    src_spec, dst_spec = formats.compressed_tensors(4, symmetric=symmetric), formats.gptq(4, symmetric=symmetric)
    shape = case["in_codes"].shape
    source = crop({tensor: case[f"out_{tensor}"] for tensor in ("weight_packed", "weight_scale", "weight_zero_point")
                   if f"out_{tensor}" in case}, src_spec, shape)
    src = KernelWeights.from_physical(src_spec, source, cropped_shape(shape))
    n, k = src.shape[-2:]
    logical = Quantized(case["in_codes"][..., :n, :k], case["in_scales"][..., :n, :src_spec.groups(k)],
                        None if symmetric else case["in_zeros"][..., :n, :src_spec.groups(k)])
    got = repack(src, dst_spec)
    for expected in (dst_spec.pack(logical), layouts.convert(source, src_spec, dst_spec)):
        assert_same_bytes(got, expected, dst_spec, src.num_experts)


def test_nvfp4_compressed_tensors_repacks_to_modelopt_swizzled():
    """Codes and global scale of the NVFP4 golden checkpoint, block scales of the swizzle
    golden case: the packed bytes are kept, the scales land in the cutlass 128x4 swizzle
    and the global scale becomes its reciprocal, all as the engines store them."""
    weights, swizzle = load("c1_nvfp4_pack_ct_N256_K512"), load("c2_swizzle_2d_M256_Ksf32")
    src_spec, dst_spec = formats.nvfp4(), formats.nvfp4(checkpoint="modelopt", swizzled=True)
    rows, scale_cols = (128, 4) if ptx.SIMULATED else swizzle["in_block_scales"].shape
    source = {"weight_packed": weights["out_weight_packed"][:rows, :scale_cols * 8],
              "weight_scale": swizzle["in_block_scales"][:rows, :scale_cols],
              "weight_global_scale": weights["out_weight_global_scale"]}
    expected = {"weight": source["weight_packed"],
                # The first 128-row band of the swizzle is the first 512 * (columns / 4) bytes.
                "weight_scale": swizzle["out_weight_scale_flat"][:rows * scale_cols].reshape(rows, scale_cols),
                "weight_scale_2": weights["out_weight_scale_2_modelopt"]}
    got = repack(KernelWeights.from_physical(src_spec, source, (rows, scale_cols * 16)), dst_spec)
    assert_same_bytes(got, expected, dst_spec, 1)


def test_act_order_gptq_repacks_to_marlin_with_k_sorted_by_group():
    """GPTQ act-order -> Marlin act-order: g_idx and scales are the engine's; the sort is
    the stable argsort of g_idx (the engine's torch.argsort order within a group is
    arbitrary), so the weight is checked against convert and by unpacking it."""
    case = load("marlin_gptq_int4_g128_actorder_N256_K512")
    src_spec, dst_spec = formats.gptq(4, act_order=True), formats.marlin(4, act_order=True)
    n, k = (64, 256) if ptx.SIMULATED else case["in_codes"].shape
    g_idx = case["out_gptq_g_idx"][:k] % src_spec.groups(k)  # a valid g_idx for the cropped K
    source = {"qweight": case["out_gptq_qweight"][:k // 8, :n],
              "scales": case["out_gptq_scales"][:src_spec.groups(k), :n], "g_idx": g_idx}
    got = repack(KernelWeights.from_physical(src_spec, source, (n, k)), dst_spec)
    assert_same_bytes(got, layouts.convert(source, src_spec, dst_spec), dst_spec, 1)
    if not ptx.SIMULATED:
        for tensor in ("scales", "g_idx"):
            expected = case[f"out_{tensor}"]
            np.testing.assert_array_equal(got[tensor].cpu().numpy()[0].view(expected.dtype), expected)
    marlin = {name: tensor.cpu().numpy()[0] for name, tensor in got.items()}
    marlin["scales"] = marlin["scales"].view(np.float16)
    logical = dst_spec.unpack(marlin, (n, k))
    np.testing.assert_array_equal(logical.g_idx, g_idx)
    np.testing.assert_array_equal(logical.codes, src_spec.unpack(source, (n, k)).codes)


# -- what a destination cannot hold --------------------------------------------------------------

def gptq_weights(spec=formats.gptq(4), shape=(64, 256)) -> KernelWeights:
    q = random_quantized(spec, shape, np.random.default_rng(3))
    return KernelWeights.from_physical(spec, spec.pack(q), shape)


@pytest.mark.parametrize("src_spec, dst_spec, message", [
    (formats.gptq(4), formats.gptq(8), r"codes differ \(uint4b8 -> uint8b128\)"),
    (formats.gptq(4), formats.awq(4), "zero points are stored by only one of them"),
    (formats.gptq(4, 128), formats.marlin(4, 64), r"group sizes differ \(128 -> 64\)"),
    (formats.gptq(4, act_order=True), formats.marlin(4), r"act-order \(g_idx\) is used by only one of them"),
    (formats.marlin(4, act_order=True), formats.gptq(4), "act-order"),
], ids=["bits", "zero-points", "group-size", "act-order", "act-order-source"])
def test_repack_refuses_a_destination_that_cannot_hold_the_source(src_spec, dst_spec, message):
    with pytest.raises(ValueError, match=message):
        repack(gptq_weights(src_spec), dst_spec)


def test_repack_refuses_shapes_the_destination_layout_cannot_hold():
    with pytest.raises(ValueError, match=r"dst_spec cannot hold a weight of shape \(N, K\) = \(32, 256\)"):
        repack(gptq_weights(shape=(32, 256)), formats.marlin(4))  # Marlin tiles N by 64


def test_repack_checks_out_and_experts():
    src, dst_spec = gptq_weights(shape=(2, 64, 256)), formats.marlin(4)
    out = poisoned_destination(dst_spec, (4, 64, 256))
    with pytest.raises(ValueError, match=r"out is missing \['scales'\]"):
        repack(src, dst_spec, out={"qweight": out["qweight"]})
    with pytest.raises(TypeError, match=r"out\['scales'\] must be a torch.float16 tensor"):
        repack(src, dst_spec, out={**out, "scales": out["scales"].float()})
    with pytest.raises(ValueError, match=r"out\['scales'\] must have shape \(4, 2, 64\)"):
        repack(src, dst_spec, out={**out, "scales": out["scales"][:, :1]})
    with pytest.raises(ValueError, match="src holds 2 experts: neither the 3 selected ones nor all of range"):
        repack(src, dst_spec, out=out, experts=range(1, 4))
    with pytest.raises(ValueError, match="experts must be an increasing range"):
        repack(src, dst_spec, out=out, experts=[0, 1])
    with pytest.raises(TypeError, match="src must be a KernelWeights"):
        repack({"qweight": out["qweight"]}, dst_spec)


def test_repack_writes_one_checkpoint_expert_into_the_runners_buffers():
    """The runner's loop: expert e of a checkpoint, alone, into preallocated buffers;
    the other experts' bytes are untouched."""
    spec, dst_spec, shape = formats.gptq(4), formats.marlin(4), (3, 64, 128)
    q = random_quantized(spec, shape, np.random.default_rng(9))
    out = poisoned_destination(dst_spec, shape)
    one = select(q, range(2, 3))
    repack(KernelWeights.from_physical(spec, spec.pack(one), one.codes.shape), dst_spec, out=out, experts=range(2, 3))
    assert_same_bytes(out, dst_spec.pack(q), dst_spec, 3, converted=[2])


def test_repack_without_out_returns_just_the_selected_experts():
    spec, dst_spec, shape = formats.awq(4, 64), formats.marlin(4, 64, zero_points=True), (3, 64, 128)
    q = random_quantized(spec, shape, np.random.default_rng(4))
    got = repack(KernelWeights.from_physical(spec, spec.pack(q), shape), dst_spec, experts=range(1, 3))
    assert_same_bytes(got, dst_spec.pack(select(q, range(1, 3))), dst_spec, 2)

def test_gate_and_up_rows_repack_into_one_native_buffer():
    """w1 and w3 converted separately into rows [0, I) and [I, 2I) of one native w13 buffer
    give the bytes of the stacked weight converted at once (I = 40: halves not tile aligned)."""
    spec, dst_spec, experts, i, h = formats.awq(4, 32), formats.native(4, 32, zero_points=True), 2, 40, 64
    rng = np.random.default_rng(12)
    w1, w3 = random_quantized(spec, (experts, i, h), rng), random_quantized(spec, (experts, i, h), rng)
    stacked = Quantized(*(np.concatenate([a, b], axis=1) for a, b in ((w1.codes, w3.codes), (w1.scales, w3.scales),
                                                                        (w1.zeros, w3.zeros))))
    out = poisoned_destination(dst_spec, (experts, 2 * i, h))
    for half, q in enumerate((w1, w3)):
        repack(KernelWeights.from_physical(spec, spec.pack(q), q.codes.shape), dst_spec, out=out,
               row_offset=half * i, dst_rows=2 * i, zero_first=half == 0)
    assert_same_bytes(out, dst_spec.pack(stacked), dst_spec, experts)


def test_act_order_gate_and_up_rows_share_one_k_order():
    """An act-order checkpoint's gate and up projections (one input, so one g_idx) repack
    into rows [0, I) and [I, 2I) of one native w13 buffer as the stacked weight does at
    once; an up projection with another g_idx is refused: one K order serves an expert."""
    spec, dst_spec, experts, i, h = formats.gptq(4, 32, act_order=True), formats.native(4, 32, act_order=True), 2, 40, 64
    stacked = random_quantized(spec, (experts, 2 * i, h), np.random.default_rng(13))

    def rows(part: slice, g_idx=stacked.g_idx) -> KernelWeights:
        q = Quantized(stacked.codes[:, part], stacked.scales[:, part], g_idx=g_idx)
        return KernelWeights.from_physical(spec, spec.pack(q), q.codes.shape)

    out = poisoned_destination(dst_spec, (experts, 2 * i, h))
    for half in range(2):
        repack(rows(slice(half * i, (half + 1) * i)), dst_spec, out=out, row_offset=half * i, dst_rows=2 * i,
               zero_first=half == 0)
    assert_same_bytes(out, dst_spec.pack(stacked), dst_spec, experts)
    with pytest.raises(ValueError, match="one K order per expert"):
        repack(rows(slice(i, 2 * i), g_idx=np.roll(stacked.g_idx, 1, axis=-1)), dst_spec, out=out, row_offset=i,
               dst_rows=2 * i, zero_first=False)


# -- realistic shapes on the GPU -----------------------------------------------------------------

def timed_ms(run, repeats: int = 3) -> float:
    """Best wall time of `run()` over `repeats` calls, after one warm-up (compilation)."""
    run()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) * 1e3)
    return best


def random_gptq_checkpoint(experts: int, n: int, k: int, seed: int) -> dict:
    """A GPTQ int4 g128 checkpoint on the GPU: every int32 word is a valid packed weight."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    qweight = torch.randint(-2**31, 2**31 - 1, (experts, k // 8, n), dtype=torch.int32, device="cuda",
                            generator=generator)
    scales = (torch.rand((experts, k // 128, n), device="cuda", generator=generator) * 0.01 + 1e-3).half()
    return {"qweight": qweight, "scales": scales}


def check_experts_against_convert(checkpoint: dict, got: dict, src_spec, dst_spec, experts: list[int]):
    total = got[dst_spec.weight.name].shape[0]
    for expert in experts:
        source = {name: tensor[expert].cpu().numpy() for name, tensor in checkpoint.items()}
        expected = layouts.convert(source, src_spec, dst_spec)
        for name, value in expected.items():
            got_bytes = per_expert_bytes(got[name], total)[expert]
            np.testing.assert_array_equal(got_bytes, np.ascontiguousarray(value).reshape(-1).view(np.uint8),
                                          err_msg=f"{name} of expert {expert}")


@pytest.mark.gpu
def test_repack_a_qwen3_expert_stack_from_gptq_to_marlin():
    """Qwen3-30B-A3B experts (E=128, N=1536, K=2048), GPTQ int4 g128 -> Marlin: in one call,
    and expert by expert as the runner loads a checkpoint into its buffers."""
    experts, n, k = 128, 1536, 2048
    src_spec, dst_spec = formats.gptq(4), formats.marlin(4)
    checkpoint = random_gptq_checkpoint(experts, n, k, seed=0)
    src = KernelWeights.from_physical(src_spec, checkpoint, (experts, n, k))
    out = poisoned_destination(dst_spec, src.shape)
    stack_ms = timed_ms(lambda: repack(src, dst_spec, out=out))
    check_experts_against_convert(checkpoint, out, src_spec, dst_spec, [0, 63, 127])

    singles = [KernelWeights.from_physical(src_spec, {name: t[e] for name, t in checkpoint.items()}, (n, k))
               for e in range(experts)]
    out = poisoned_destination(dst_spec, src.shape)
    def load_expert_by_expert():
        for expert, one in enumerate(singles):
            repack(one, dst_spec, out=out, experts=range(expert, expert + 1))

    loop_ms = timed_ms(load_expert_by_expert, 1)
    check_experts_against_convert(checkpoint, out, src_spec, dst_spec, [5, 100])
    moved = src.nbytes() + sum(t.numel() * t.element_size() for t in out.values())
    print(f"repack GPTQ -> Marlin {experts}x{n}x{k}: {stack_ms:.2f} ms in one call "
          f"({moved / stack_ms / 1e6:.0f} GB/s read + written), {loop_ms:.1f} ms expert by expert")
    assert stack_ms < 1000


@pytest.mark.gpu
def test_repack_a_mixtral_expert_from_gptq_to_marlin():
    """One Mixtral-8x7B expert matrix (w1 or w3: N=14336, K=4096), every byte checked."""
    n, k = 14336, 4096
    src_spec, dst_spec = formats.gptq(4), formats.marlin(4)
    checkpoint = random_gptq_checkpoint(1, n, k, seed=1)
    src = KernelWeights.from_physical(src_spec, checkpoint, (1, n, k))
    out = poisoned_destination(dst_spec, src.shape)
    elapsed_ms = timed_ms(lambda: repack(src, dst_spec, out=out))
    check_experts_against_convert(checkpoint, out, src_spec, dst_spec, [0])
    print(f"repack GPTQ -> Marlin {n}x{k}: {elapsed_ms:.2f} ms")
    assert elapsed_ms < 1000
