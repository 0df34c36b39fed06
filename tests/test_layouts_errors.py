"""Impossible parameters and mismatched arrays raise clear errors naming what is wrong."""

import numpy as np
import pytest

import attrs

from layouts import BitPack, FloatFormat, IntCode, Layout, Permute, Quantized, Tile, explain, formats
from layouts.encodings import ue5m3_encode
from layouts.explain import where


@pytest.mark.parametrize("make, message", [
    (lambda: BitPack(5), "bits must be one of 2, 3, 4, 8"),
    (lambda: IntCode(6), "bits must be one of 2, 3, 4, 8"),
    (lambda: BitPack(4, axis=0), "axis must be -1"),
    (lambda: BitPack(4, order=(0, 1, 2)), "order must have 8 entries"),
    (lambda: BitPack(4, word_bits=8, places=tuple(range(32))), "places must have 8 entries"),
    (lambda: BitPack(4, word_bits=8, places=(0, 1, 2, 3, 4, 5, 6, 6)), "places must be a permutation"),
    (lambda: Permute((0, 0, 1)), "must be a permutation"),
    (lambda: Tile(0, 16), "rows must be a positive int"),
    (lambda: Layout((BitPack(4), Tile(2, 2))), "BitPack must be the last step"),
    (lambda: formats.gptq(3), "bits must be one of (4, 8)"),
    (lambda: formats.gptq(4, group_size=0), "group_size must be a positive int or None"),
    (lambda: formats.awq(8), "bits must be one of (4,)"),
    (lambda: formats.nvfp4(checkpoint="gguf"), "checkpoint must be one of"),
    (lambda: formats.marlin(4, zero_points=True, act_order=True), "no act-order variant with zero points"),
])
def test_bad_parameters_are_rejected(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


def _weight(n=64, k=256, groups=2, **extra):
    rng = np.random.default_rng(0)
    return Quantized(rng.integers(0, 16, (n, k)), np.ones((n, groups), np.float16), **extra)


def test_shape_a_layout_cannot_hold_is_rejected():
    with pytest.raises(ValueError, match="qweight cannot hold shape .*multiple of 16"):
        formats.marlin(4).pack(_weight(n=64, k=200))


def test_wrong_number_of_scale_groups_is_rejected():
    with pytest.raises(ValueError, match="scales need 4 groups along K"):
        formats.gptq(4, 64).pack(_weight(groups=2))


def test_codes_out_of_range_are_rejected():
    q = _weight()
    q.codes[0, 0] = 16
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 16\)"):
        formats.gptq(4).pack(q)


def test_missing_or_unexpected_zero_points_are_rejected():
    with pytest.raises(ValueError, match="zeros required"):
        formats.awq().pack(_weight())
    with pytest.raises(ValueError, match="zeros not used"):
        formats.gptq(4).pack(_weight(zeros=np.zeros((64, 2), int)))


def test_g_idx_out_of_range_is_rejected():
    with pytest.raises(ValueError, match=r"g_idx values must lie in \[0, 2\)"):
        formats.gptq(4, act_order=True).pack(_weight(g_idx=np.full(256, 2)))


def test_missing_physical_tensor_is_named():
    with pytest.raises(KeyError, match="no 'scales'"):
        formats.gptq(4).unpack({"qweight": np.zeros((32, 64), np.int32)})


def test_arrays_of_the_wrong_kind_are_named():
    """Float codes or float-typed words would be truncated into silently wrong weights."""
    q = _weight()
    with pytest.raises(TypeError, match="codes must be integers"):
        Quantized(q.codes + 0.5, q.scales)
    physical = formats.gptq(4, 128).pack(q)
    with pytest.raises(TypeError, match="gptq_int4: qweight must hold integer words or bits, got float32"):
        formats.gptq(4, 128).unpack({**physical, "qweight": physical["qweight"].astype(np.float32)})
    with pytest.raises(TypeError, match="scales must hold float values, got int32"):
        formats.gptq(4, 128).unpack({**physical, "scales": physical["scales"].astype(np.int32)})


def test_mismatched_logical_arrays_are_rejected():
    with pytest.raises(ValueError, match="scales must be shaped"):
        Quantized(np.zeros((4, 8), int), np.zeros((5, 1)))


def test_unsigned_scales_need_e2m1_codes_and_no_nan():
    with pytest.raises(ValueError, match="float8_ue5m3 scales hold no sign or zero, which only e2m1 codes can take over"):
        attrs.evolve(formats.gptq(4), scale_format=FloatFormat("float8_ue5m3"))
    with pytest.raises(ValueError, match="native_nvfp4: scales hold NaN"):
        formats.native(fp4=True).pack(Quantized(np.zeros((64, 32), int), np.full((64, 2), np.nan), global_scale=[1.0]))
    with pytest.raises(ValueError, match="ue5m3 holds positive scales only"):
        ue5m3_encode(np.array([1.0, 0.0]))


def test_explain_draws_where_elements_land():
    text = explain(formats.awq(), (8, 16))
    assert "BitPack(4, axis=-1, word_bits=32, order=[0, 2, 4, 6, 1, 3, 5, 7]) ∘ Transpose()" in text
    # AWQ word (k=0, word 0) holds columns 0, 2, 4, 6, 1, 3, 5, 7 of input feature 0.
    assert "[  0] 0,0 2,0 4,0 6,0 1,0 3,0 5,0 7,0" in text
    assert where(formats.gptq(4), (16, 64), n=3, k=9) == ("qweight", 1, 3, 4)


def test_float_zero_points_and_groups_are_rejected():
    """They would be truncated (3.7 -> 3, 0.9 -> 0) into silently wrong weights."""
    with pytest.raises(TypeError, match="zeros must be integers"):
        _weight(zeros=np.full((64, 2), 3.7))
    with pytest.raises(TypeError, match="g_idx must be integers"):
        _weight(g_idx=np.full(256, 0.9))


def test_per_expert_tensors_must_match_the_experts():
    codes, scales = np.zeros((2, 64, 32), int), np.ones((2, 64, 2), np.float32)
    with pytest.raises(ValueError, match=r"g_idx must be shaped \(32,\) or \(1, 32\) or \(2, 32\), got \(3, 32\)"):
        Quantized(codes, scales, g_idx=np.zeros((3, 32), int))
    with pytest.raises(ValueError, match=r"global_scale must be shaped \(\) or \(1,\) or \(2,\), got \(3,\)"):
        Quantized(codes, scales, global_scale=np.ones(3))
    spec = formats.nvfp4(checkpoint="modelopt")
    physical = spec.pack(Quantized(codes, scales, global_scale=np.ones(2)))
    with pytest.raises(ValueError, match=r"nvfp4_modelopt: weight_scale_2 must be shaped \(\) or \(1,\) or \(2,\), "
                                         r"got \(3,\)"):
        spec.dequantize({**physical, "weight_scale_2": np.ones(3, np.float32)})


def test_unpack_names_the_tensor_of_a_bad_shape():
    spec = formats.gptq(4, 128)
    physical = spec.pack(_weight())
    with pytest.raises(ValueError, match=r"gptq_int4: qweight must be \(rows, cols\) or \(E, rows, cols\), "
                                         r"got shape \(2048,\)"):
        spec.unpack({**physical, "qweight": physical["qweight"].ravel()})
    with pytest.raises(ValueError, match=r"gptq_int4: scales has shape \(1, 64\), expected \(\.\.\., 2, 64\)"):
        spec.unpack({**physical, "scales": physical["scales"][:1]})
    with pytest.raises(TypeError, match="gptq_int4: physical must be a mapping of tensor names to arrays, "
                                        "got NoneType"):
        spec.unpack(None)


def test_bfloat16_torch_scales_are_read_as_values():
    torch = pytest.importorskip("torch")
    spec, q = formats.gptq(4, 128), _weight()
    physical = {**spec.pack(q), "scales": torch.full((2, 64), 0.5, dtype=torch.bfloat16)}
    assert (spec.unpack(physical).scales == 0.5).all()


def test_float8_torch_scales_are_read_as_their_bytes():
    torch = pytest.importorskip("torch")
    spec = formats.nvfp4()
    physical = spec.pack(Quantized(np.zeros((64, 32), int), np.full((64, 2), 0.5, np.float32), global_scale=1.0))
    in_float8 = {**physical, "weight_scale": torch.from_numpy(physical["weight_scale"]).view(torch.float8_e4m3fn)}
    assert (spec.unpack(in_float8).scales == 0.5).all()


@pytest.mark.parametrize("shape", [(8,), (-8, 16), (8, 16.0)])
def test_explain_needs_a_positive_n_k(shape):
    with pytest.raises(ValueError, match=r"shape must be \(N, K\) of positive ints"):
        explain(formats.awq(), shape)


def test_sort_indices_must_permute_k():
    spec = formats.marlin(4, 128, act_order=True)
    physical = spec.pack(_weight(g_idx=np.arange(256) // 128))
    with pytest.raises(ValueError, match=r"marlin_int4: g_idx_sort_indices must be shaped like g_idx \(256,\), "
                                         r"each row a permutation of 0..255"):
        spec.unpack({**physical, "g_idx_sort_indices": np.zeros(256, np.int32)})
