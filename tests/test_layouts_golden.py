"""Golden vectors: every named format reproduces the engines' own bytes from the same inputs.

The .npz files were made by running vLLM, FlashInfer and compressed-tensors code (see
shared/golden/CASES.md); `in_*` are logical inputs, `out_*` the engine's stored tensors.
"""

from pathlib import Path

import numpy as np
import pytest

from layouts import Layout, Permute, Quantized, Swizzle128x4, formats
from layouts.encodings import E4M3_VALUES

DATA = Path(__file__).parent / "data"


def load(name: str) -> dict:
    return dict(np.load(DATA / f"{name}.npz", allow_pickle=False))


def logical(case: dict, **extra) -> Quantized:
    return Quantized(case["in_codes"], case["in_scales"], case.get("in_zeros"), case.get("in_g_idx"), **extra)


INT_CASES = [
    ("gptq_int4_sym_g128_N256_K512", formats.gptq(4), {"qweight", "scales"}),
    ("gptq_int8_sym_g128_N256_K512", formats.gptq(8), {"qweight", "scales"}),
    ("gptq_int4_asym_g128_N256_K512", formats.gptq(4, symmetric=False), {"qweight", "scales", "qzeros"}),
    ("gptq_int4_sym_g128_actorder_N256_K512", formats.gptq(4, act_order=True), {"qweight", "scales", "g_idx"}),
    ("awq_int4_g128_N256_K512", formats.awq(), {"qweight", "scales", "qzeros"}),
    ("ct_pack_int4_sym_g128_N256_K512", formats.compressed_tensors(4), {"weight_packed", "weight_scale", "weight_shape"}),
    ("ct_pack_int8_sym_ch_N256_K512", formats.compressed_tensors(8, None), {"weight_packed", "weight_scale", "weight_shape"}),
    ("ct_pack_int4_asym_g128_N256_K512", formats.compressed_tensors(4, symmetric=False),
     {"weight_packed", "weight_scale", "weight_zero_point"}),
    ("ct_pack_int4_sym_g128_E2_N256_K512", formats.compressed_tensors(4), {"weight_packed", "weight_scale", "weight_shape"}),
    ("marlin_gptq_int4_g128_N256_K512", formats.marlin(4), {"qweight", "scales"}),
    ("marlin_gptq_int4_ch_N256_K512", formats.marlin(4, None), {"qweight", "scales"}),
    ("marlin_gptq_int8_g128_N256_K512", formats.marlin(8), {"qweight", "scales"}),
    ("marlin_awq_int4_zp_g128_N256_K512", formats.marlin(4, zero_points=True), {"qweight", "scales", "qzeros"}),
    ("marlin_moe_gptq_int4_g128_E2_N256_K512", formats.marlin(4), {"qweight", "scales"}),
    ("marlin_moe_awq_int4_zp_g128_E2_N256_K512", formats.marlin(4, zero_points=True), {"qweight", "scales", "qzeros"}),
]


@pytest.mark.parametrize("name, spec, tensors", INT_CASES, ids=[c[0] for c in INT_CASES])
def test_integer_format_reproduces_engine_bytes(name, spec, tensors):
    case = load(name)
    q = logical(case)
    physical = spec.pack(q)
    for tensor in tensors:
        expected = case[f"out_{tensor}"]
        assert physical[tensor].dtype == expected.dtype, tensor
        np.testing.assert_array_equal(physical[tensor], expected, err_msg=tensor)
    assert spec.unpack(physical).equals(q)


def test_gptq_v2_zero_points_are_stored_without_the_minus_one():
    case = load("gptq_int4_asym_g128_N256_K512")
    physical = formats.gptq(4, symmetric=False, checkpoint_format="gptq_v2").pack(logical(case))
    np.testing.assert_array_equal(physical["qzeros"], case["out_qzeros_v2"])


@pytest.mark.parametrize("name", ["marlin_gptq_int4_g128_N256_K512", "marlin_awq_int4_zp_g128_N256_K512"])
def test_checkpoint_converts_to_marlin_bytes(name):
    """convert(GPTQ or AWQ checkpoint -> Marlin) equals the engine's repacked tensors."""
    import layouts

    case = load(name)
    if "awq" in name:
        source = {"qweight": case["out_awq_qweight"], "qzeros": case["out_awq_qzeros"], "scales": case["out_awq_scales"]}
        src_spec, dst_spec = formats.awq(), formats.marlin(4, zero_points=True)
    else:
        source = {"qweight": case["out_gptq_qweight"], "scales": case["out_gptq_scales"]}
        src_spec, dst_spec = formats.gptq(4), formats.marlin(4)
    converted = layouts.convert(source, src_spec, dst_spec)
    for tensor in ("qweight", "scales", "qzeros") if "awq" in name else ("qweight", "scales"):
        np.testing.assert_array_equal(converted[tensor], case[f"out_{tensor}"], err_msg=tensor)


def test_marlin_act_order_sorts_k_by_group():
    case = load("marlin_gptq_int4_g128_actorder_N256_K512")
    spec, q = formats.marlin(4, act_order=True), logical(case)
    # torch's unstable argsort fixed the in-group order the engine used; take it as given.
    physical = spec.pack(q, sort_indices=case["out_g_idx_sort_indices"])
    for tensor in ("qweight", "scales", "g_idx", "g_idx_sort_indices"):
        np.testing.assert_array_equal(physical[tensor], case[f"out_{tensor}"], err_msg=tensor)
    assert spec.unpack(physical).equals(q)
    # Any other in-group order is an equally valid Marlin weight for the same logical data.
    assert spec.unpack(spec.pack(q)).equals(q)


@pytest.mark.parametrize("checkpoint, global_key", [("compressed_tensors", "out_weight_global_scale"),
                                                    ("modelopt", "out_weight_scale_2_modelopt")])
def test_nvfp4_packing_and_dequant(checkpoint, global_key):
    case = load("c1_nvfp4_pack_ct_N256_K512")
    q = Quantized(case["in_codes"], E4M3_VALUES[case["in_block_scales"]], global_scale=case["in_global_scale"])
    spec = formats.nvfp4(checkpoint=checkpoint)
    physical = spec.pack(q)
    np.testing.assert_array_equal(physical[spec.weight.name], case["out_weight_packed"])
    np.testing.assert_array_equal(physical["weight_scale"], case["out_weight_scale"])
    np.testing.assert_array_equal(physical[spec.global_scale_name], case[global_key])
    np.testing.assert_allclose(spec.dequantize(physical), case["out_dequant_ct"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["c1_nvfp4_quant_ct_N256_K512", "c1_nvfp4_quant_vllm_ref_N256_K512"])
def test_nvfp4_quantized_checkpoints_unpack_to_their_codes(name):
    case = load(name)
    spec = formats.nvfp4()
    global_scale = case.get("out_weight_global_scale", case.get("in_global_scale"))
    physical = {"weight_packed": case["out_weight_packed"], "weight_scale": case["out_weight_scale"],
                "weight_global_scale": global_scale}
    q = spec.unpack(physical)
    np.testing.assert_array_equal(q.codes, case["out_codes"])
    np.testing.assert_array_equal(spec.pack(q)["weight_packed"], case["out_weight_packed"])
    # A faithful quantizer lands near its input: every element within one e2m1 step of its block.
    step = np.repeat(q.scales / global_scale, 16, axis=-1) * 2
    assert np.all(np.abs(spec.dequantize(physical) - case["in_x"]) <= step + 1e-7)


@pytest.mark.parametrize("name", ["c2_swizzle_2d_M256_Ksf32", "c2_swizzle_3d_E2_M256_Ksf32"])
def test_swizzle_128x4(name):
    case = load(name)
    swizzled = Layout((Swizzle128x4(),)).pack(case["in_block_scales"])
    np.testing.assert_array_equal(swizzled, case["out_weight_scale"])
    np.testing.assert_array_equal(swizzled.reshape(-1), case["out_weight_scale_flat"])


def test_swizzled_nvfp4_scales_pad_rows_and_columns_with_zero_bytes():
    rng = np.random.default_rng(7)
    n, k = 100, 48  # 100 rows -> 128; 3 scale columns -> 4
    q = Quantized(rng.integers(0, 16, (n, k)), E4M3_VALUES[rng.integers(0x20, 0x60, (n, 3))], global_scale=[2.0])
    physical = formats.nvfp4(swizzled=True).pack(q)
    assert physical["weight_scale"].shape == (128, 4)
    assert np.count_nonzero(physical["weight_scale"]) == n * 3
    assert formats.nvfp4(swizzled=True).unpack(physical, (n, k)).equals(q)


def test_trtllm_row_shuffles():
    case = load("c3_shuffle_rows_M256_etm128")
    shuffle = Permute(formats.trtllm_shuffle_perm(128), axis=-2)
    np.testing.assert_array_equal(Layout((shuffle,)).pack(case["in_weight_bytes"]), case["out_shuffle_matrix_a"])
    from layouts import InterleaveHalves

    np.testing.assert_array_equal(Layout((InterleaveHalves(),)).pack(case["in_weight_bytes"]),
                                  case["out_reorder_rows_for_gated_act_gemm"])
    np.testing.assert_array_equal(Layout((shuffle, Swizzle128x4())).pack(case["in_block_scales"]).reshape(-1),
                                  case["out_shuffle_matrix_sf_a"])


@pytest.mark.parametrize("spec_factory, name", [(formats.trtllm_fp4_moe, "c3_trtllm_fp4_moe_prepare_E2_H256_I256"),
                                                 (formats.vllm_trtllm_fp4_moe, "c3_vllm_trtllm_nvfp4_moe_pipeline_E2_H256_I128")])
@pytest.mark.parametrize("weight, gated", [("w13", True), ("w2", False)])
def test_trtllm_fp4_moe_weights(spec_factory, name, weight, gated):
    case = load(name)
    spec = spec_factory(gated=gated)
    q = Quantized(case[f"in_{weight}_codes"], E4M3_VALUES[case[f"in_{weight}_block_scales"]],
                  global_scale=np.ones(2, np.float32))
    physical = spec.pack(q)
    gemm = "gemm1" if gated else "gemm2"
    np.testing.assert_array_equal(physical["weight"], case[f"out_{gemm}_weights_fp4_shuffled"])
    np.testing.assert_array_equal(physical["weight_scale"], case[f"out_{gemm}_scales_fp4_shuffled"])
    assert spec.unpack(physical, q.codes.shape).equals(q)


@pytest.mark.parametrize("gated, shape", [(True, (2, 160, 208)), (False, (2, 208, 80))])
def test_vllm_trtllm_pipeline_pads_unaligned_sizes(gated, shape):
    """hidden 208 -> 256 and intermediate 80 -> 128 (each gate/up half padded on its own)."""
    rng = np.random.default_rng(3)
    spec = formats.vllm_trtllm_fp4_moe(gated=gated)
    q = Quantized(rng.integers(0, 16, shape), E4M3_VALUES[rng.integers(0x20, 0x60, shape[:2] + (shape[2] // 16,))],
                  global_scale=np.ones(2, np.float32))
    physical = spec.pack(q)
    assert physical["weight"].shape == ((2, 256, 128) if gated else (2, 256, 64))
    assert spec.unpack(physical, shape).equals(q)
