"""Dequantize, generated from any spec, equals the spec's own float64 dequantization (in
logical K order), for float32, bfloat16 and float16 outputs."""

import time

import numpy as np
import pytest
import torch
from hypothesis import given

from layouts import formats
from layouts.samples import random_quantized
from layouts.strategies import spec_and_weight
from numba_kernels import interop
from numba_kernels.dequant import dequantize, reference_dequantize
from numba_kernels.twins import round_to_half_bits
from numba_kernels.weights import KernelWeights

OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HALF_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def poisoned(shape, dtype) -> torch.Tensor:
    """An output buffer full of NaN, so unwritten elements show."""
    return torch.full(shape, float("nan"), dtype=dtype, device=interop.kernel_device())


def assert_dequantizes(spec, physical, shape, out_dtype):
    weights = KernelWeights.from_physical(spec, physical, shape)
    got = dequantize(weights, out_dtype, out=poisoned(weights.shape, out_dtype)).cpu()
    expected = reference_dequantize(spec, physical, shape)
    if out_dtype == torch.float32:
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-30)
    else:
        # The kernel rounds its float32 value once to the half format: do the same.
        rounded = round_to_half_bits(expected.astype(np.float32).astype(np.float64), HALF_NAMES[out_dtype])
        np.testing.assert_array_equal(got.view(torch.int16).numpy().view(np.uint16), rounded)


@given(spec_and_weight(max_experts=2, max_size=32))
def test_dequantize_matches_the_spec_for_random_specs(case):
    spec, q = case
    physical = spec.pack(q)
    for out_dtype in OUT_DTYPES:
        assert_dequantizes(spec, physical, q.codes.shape, out_dtype)


@pytest.mark.parametrize("spec, shape", [
    (formats.gptq(4, 32, symmetric=False), (2, 16, 64)),
    (formats.awq(4, 64), (16, 64)),
    (formats.marlin(4, 64, act_order=True), (64, 64)),
    (formats.nvfp4(checkpoint="modelopt", swizzled=True), (2, 16, 32)),
], ids=lambda value: getattr(value, "name", None))
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
def test_dequantize_named_formats(spec, shape, out_dtype):
    q = random_quantized(spec, shape, np.random.default_rng(11))
    assert_dequantizes(spec, spec.pack(q), shape, out_dtype)


def test_dequantize_allocates_its_output_in_logical_k_order():
    spec, shape = formats.marlin(4, 64, act_order=True), (64, 64)
    q = random_quantized(spec, shape, np.random.default_rng(5))
    out = dequantize(KernelWeights.from_physical(spec, spec.pack(q), shape))
    assert out.shape == (1, 64, 64) and out.dtype == torch.float32
    np.testing.assert_allclose(out.cpu().numpy()[0], spec.dequantize_logical(q), rtol=1e-6)


def test_dequantize_rejects_bad_arguments():
    spec, shape = formats.gptq(4, 32), (16, 64)
    physical = spec.pack(random_quantized(spec, shape, np.random.default_rng(0)))
    weights = KernelWeights.from_physical(spec, physical, shape)
    with pytest.raises(TypeError, match="weights must be a KernelWeights"):
        dequantize(physical)
    with pytest.raises(TypeError, match="out_dtype"):
        dequantize(weights, torch.int8)
    with pytest.raises(TypeError, match="out must be a torch.bfloat16"):
        dequantize(weights, torch.bfloat16, out=poisoned((1, 16, 64), torch.float16))
    with pytest.raises(ValueError, match=r"out must have shape \(1, 16, 64\)"):
        dequantize(weights, out=poisoned((16, 64), torch.float32))


@pytest.mark.gpu
def test_dequantize_a_qwen3_expert_stack_to_bfloat16():
    """E=128, N=1536, K=2048 Marlin act-order int4 -> bf16; a few experts checked."""
    experts, n, k = 128, 1536, 2048
    spec = formats.marlin(4, 128, act_order=True)
    rng = np.random.default_rng(1)
    checked = [0, 77, 127]
    q = random_quantized(spec, (len(checked), n, k), rng)
    physical = spec.pack(q)
    # Tile the checked experts' tensors over the whole stack (the kernel's cost is the same).
    stacked = {name: np.resize(value, (experts,) + value.shape[1:]) if value.ndim == 3 else value
               for name, value in physical.items()}
    weights = KernelWeights.from_physical(spec, stacked, (experts, n, k))
    out = poisoned((experts, n, k), torch.bfloat16)
    dequantize(weights, torch.bfloat16, out=out)
    torch.cuda.synchronize()
    start = time.perf_counter()
    dequantize(weights, torch.bfloat16, out=out)
    torch.cuda.synchronize()
    elapsed_ms = (time.perf_counter() - start) * 1e3
    print(f"dequantize {experts}x{n}x{k} -> bf16: {elapsed_ms:.2f} ms, "
          f"{out.numel() * 2 / elapsed_ms / 1e6:.0f} GB/s written")
    expected = reference_dequantize(spec, physical, q.codes.shape)
    for expert in checked:
        rounded = round_to_half_bits(expected[expert % len(checked)].astype(np.float32).astype(np.float64), "bfloat16")
        np.testing.assert_array_equal(out[expert].view(torch.int16).cpu().numpy().view(np.uint16), rounded)
