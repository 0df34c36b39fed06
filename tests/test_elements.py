"""Device element readers, generated from any spec's index maps, agree with the numpy
reference `spec.dequantize` (in stored K order)."""

import numpy as np
import pytest
from hypothesis import given
from numba import cuda

from layouts import formats
from layouts.samples import random_quantized
from layouts.strategies import spec_and_weight
from numba_kernels import ptx
from numba_kernels.elements import element_reader, reference_values
from numba_kernels.weights import KernelWeights


def _read_all(spec, physical, shape):
    weights = KernelWeights.from_physical(spec, physical, shape)
    experts, n, k = weights.shape
    read = element_reader(spec, n, k)

    @ptx.kernel
    def read_every_element(arrays, out):
        e, row = cuda.blockIdx.x, cuda.blockIdx.y
        for kp in range(cuda.threadIdx.x, k, cuda.blockDim.x):
            out[e, row, kp] = read(arrays, e, row, kp)

    out = np.full((experts, n, k), np.nan, np.float32)
    read_every_element[(experts, n), 32](weights.arrays(), out)
    return out


def _check(spec, q):
    shape = q.codes.shape
    physical = spec.pack(q)
    expected = reference_values(spec, physical, shape)
    np.testing.assert_allclose(_read_all(spec, physical, shape), expected, rtol=1e-6, atol=1e-30)


@given(spec_and_weight(max_experts=2, max_size=32))
def test_element_reader_matches_dequantize_for_random_specs(case):
    spec, q = case
    _check(spec, q)


@pytest.mark.parametrize("spec, shape", [
    (formats.gptq(4, 32, symmetric=False), (2, 16, 64)),
    (formats.gptq(8, None, act_order=False), (16, 32)),
    (formats.awq(4, 64), (16, 128)),
    (formats.compressed_tensors(4, 32, symmetric=False), (16, 70)),
    (formats.marlin(4, 64, act_order=True), (64, 128)),
    (formats.marlin(4, 32, zero_points=True), (2, 64, 64)),
    (formats.marlin(8, None), (64, 64)),
    (formats.nvfp4(checkpoint="modelopt", swizzled=True), (2, 16, 64)),
    (formats.trtllm_fp4_moe(gated=False), (2, 128, 32)),
], ids=lambda value: getattr(value, "name", None))
def test_element_reader_matches_dequantize_for_named_formats(spec, shape):
    q = random_quantized(spec, shape, np.random.default_rng(7))
    _check(spec, q)
