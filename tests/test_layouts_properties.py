"""Properties of every spec the strategies can draw: random compositions, not just named formats."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layouts import E2M1, Layout, Panels, Quantized, formats
from layouts.encodings import E4M3_VALUES
from layouts.strategies import spec_and_weight

PROPERTY = settings(max_examples=150, deadline=None)


@PROPERTY
@given(spec_and_weight())
def test_unpack_inverts_pack(case):
    spec, q = case
    assert spec.unpack(spec.pack(q), q.codes.shape).equals(q)


@PROPERTY
@given(spec_and_weight(max_experts=0))
def test_no_two_elements_share_physical_bits(case):
    spec, q = case
    n, k = q.codes.shape
    rows, cols, shifts = spec.weight.layout.locate((n, k))(*np.meshgrid(np.arange(n), np.arange(k), indexing="ij"))
    places = set(zip(rows.ravel().tolist(), cols.ravel().tolist(), shifts.ravel().tolist()))
    assert len(places) == n * k
    word_bits = spec.weight.layout.bitpack.word_bits
    assert shifts.min() >= 0 and shifts.max() + spec.code.bits <= word_bits
    # Distinct slots of one word are `bits` apart, so their bit ranges cannot overlap.
    assert np.all(shifts % spec.code.bits == 0)
    phys_rows, phys_cols = spec.weight.layout.physical_shape((n, k))
    assert rows.max() < phys_rows and cols.max() < phys_cols


@PROPERTY
@given(spec_and_weight(max_experts=0), st.data())
def test_scalar_index_map_agrees_with_pack(case, data):
    """The kernel's view: one element at a time, with Python ints, reads the packed word."""
    spec, q = case
    if spec.sort_k_by_group:
        return  # K order is data-dependent there; covered by the round trip
    physical = spec.pack(q)[spec.weight.name]
    words = physical.view(np.uint32 if physical.dtype.itemsize == 4 else np.uint8)
    locate = spec.weight.layout.locate(q.codes.shape)
    extract = spec.weight.layout.bitpack.extract_fn()
    for _ in range(20):
        n = data.draw(st.integers(0, q.codes.shape[0] - 1))
        k = data.draw(st.integers(0, q.codes.shape[1] - 1))
        row, col, shift = locate(n, k)
        assert extract(int(words[row, col]), int(shift)) == q.codes[n, k]


@PROPERTY
@given(spec_and_weight())
def test_dequantize_matches_the_float_formula(case):
    spec, q = case
    weights = spec.dequantize(spec.pack(q), q.codes.shape)
    codes = q.codes.reshape((-1,) + q.codes.shape[-2:])
    scales = q.scales.reshape((-1,) + q.scales.shape[-2:])
    zeros = None if q.zeros is None else q.zeros.reshape(scales.shape)
    expected = np.empty(codes.shape)
    for e in range(codes.shape[0]):
        for k in range(codes.shape[2]):
            if q.g_idx is not None:
                g = q.g_idx[k]
            else:
                g = 0 if spec.group_size is None else k // spec.group_size
            if isinstance(spec.code, E2M1):
                value = np.array([0, .5, 1, 1.5, 2, 3, 4, 6])[codes[e, :, k] & 7] * np.where(codes[e, :, k] & 8, -1.0, 1.0)
                value = value / float(np.ravel(q.global_scale)[e])
            else:
                zero = spec.code.bias if zeros is None else zeros[e, :, g]
                value = codes[e, :, k] - np.asarray(zero, np.float64)
            expected[e, :, k] = value * scales[e, :, g].astype(np.float64)
    np.testing.assert_array_equal(weights.reshape(expected.shape), expected)


def test_native_nvfp4_folds_scale_signs_and_zeros_into_the_codes():
    """float8_ue5m3 has no sign or zero: negative block scales flip their codes' sign bit,
    zero ones zero their codes, positive ones (every e4m3 value) are stored exactly; the
    weights are the checkpoint's, and the native layout is the engines' nvfp4 otherwise."""
    rng = np.random.default_rng(0)
    e4m3 = E4M3_VALUES[np.r_[0:0x7F, 0x80:0xFF]]  # every value, -0 and both signs of the subnormals
    scales = e4m3[rng.integers(0, e4m3.size, (64, 8))]
    q = Quantized(rng.integers(0, 16, (64, 128)), scales, global_scale=np.array(2.0, np.float32))
    native, checkpoint = formats.native(fp4=True), formats.nvfp4()
    physical = native.pack(q)
    np.testing.assert_array_equal(native.dequantize(physical, (64, 128)), checkpoint.dequantize(checkpoint.pack(q)))
    stored = native.unpack(physical, (64, 128))  # N padded to 128: the logical shape is not recoverable
    assert np.all(stored.scales > 0)
    folded = np.repeat(scales, 16, axis=1)
    np.testing.assert_array_equal(stored.codes, np.where(folded == 0, 0, np.where(folded < 0, q.codes ^ 8, q.codes)))
    np.testing.assert_array_equal(stored.scales, np.where(scales == 0, 1.0, np.abs(scales)))


@pytest.mark.parametrize("k, group_size", [(704, 128), (100, 32), (96, 64), (40, 128)])
def test_partial_last_group_has_its_own_scale_row(k, group_size):
    """K not a multiple of the group: ceil(K / group) scales, the last group short."""
    rng = np.random.default_rng(k)
    spec = formats.compressed_tensors(4, group_size)
    groups = -(-k // group_size)
    q = Quantized(rng.integers(0, 16, (8, k)), rng.uniform(0.1, 1, (8, groups)).astype(np.float16))
    physical = spec.pack(q)
    assert physical["weight_scale"].shape == (8, groups)
    weights = spec.dequantize(physical)
    last = (groups - 1) * group_size
    np.testing.assert_array_equal(weights[:, last:], (q.codes[:, last:] - 8.0) * q.scales[:, -1:].astype(np.float64))


def test_panels_store_each_column_panel_as_one_run():
    """`Panels(2)` of a (3, 4) grid: columns 0-1 over all rows, then columns 2-3, the shape kept."""
    grid = np.arange(12).reshape(3, 4)
    stored = Layout((Panels(2),)).pack(grid)
    assert stored.shape == (3, 4)
    np.testing.assert_array_equal(stored.ravel(), grid[:, :2].ravel().tolist() + grid[:, 2:].ravel().tolist())


@pytest.mark.parametrize("spec", [formats.native(4, 128), formats.native(4, 64, zero_points=True),
                                  formats.native(fp4=True)], ids=lambda spec: spec.name)
def test_native_layout_stores_a_panel_of_features_over_all_of_k_as_one_run(spec):
    """Features 128 .. 255 of three panels (`formats.NATIVE_PANEL`): every byte where
    their codes, scales and zero points differ from the others' lies in the middle third
    of its tensor, which they fill."""
    n, k = 3 * formats.NATIVE_PANEL, 256
    second = (np.arange(n) // formats.NATIVE_PANEL == 1)[:, None]
    ones = np.ones((n, spec.groups(k)))

    def packed(mark: bool) -> dict:
        marked = second & mark
        return spec.pack(Quantized(np.where(marked, 1, 0) * np.ones((1, k), np.int64), np.where(marked, 2.0, 1.0) * ones,
                                   zeros=np.where(marked, 1, 0) * ones.astype(np.int64) if spec.zeros else None,
                                   global_scale=np.array(1.0, np.float32) if spec.global_scale_name else None))

    plain, marked = packed(False), packed(True)
    for tensor in filter(None, (spec.weight, spec.scales, spec.zeros)):
        before, after = (np.ascontiguousarray(p[tensor.name]).view(np.uint8).ravel() for p in (plain, marked))
        changed, third = np.flatnonzero(before != after), before.size // 3
        assert changed.min() >= third and changed.max() < 2 * third and changed.size > third // 4, tensor.name
