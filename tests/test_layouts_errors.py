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
