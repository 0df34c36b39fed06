"""Dequantize: dense (E, N, K) weights from ANY spec's physical tensors.

What it is for: the torch reference of the benchmarks (dequantised bf16 experts) and an
independent check of the element readers. It is generated from the spec, not written per
format: `elements.element_reader` evaluates the spec's index maps for one element.

Algorithm: every output element is computed on its own,

    out[e, n, logical_k(kp)] = element_reader(weights, e, n, kp)

where kp is the *stored* input-feature position (logical k = k_order[e, kp] for specs that
store K sorted by group, kp itself otherwise). Half outputs are rounded to nearest even
from the float32 value (`ptx.to_half`).

Work split: one launch; a grid-stride loop over the E * N * K elements, kp fastest, one
element per thread per step. Consecutive threads write consecutive outputs (coalesced;
act-order specs scatter within a row of K) and read neighbouring codes, so the packed
words are fetched once per warp and the scales once per group.

Memory traffic: the stored weight once (plus the scales, L1/L2-cached across a group) and
E * N * K * (4 or 2) output bytes. The per-element index maps and, for act-order, the
scattered writes cost more than the bytes: 7 ms for 128 x 1536 x 2048 Marlin act-order
experts to bf16 on an H200 (~120 GB/s written). It is a reference, not a fast path.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import cuda, int16

from layouts import QuantSpec

from . import interop, ptx
from .launch import launch_kernel
from .elements import element_reader, logical_k
from .weights import KernelWeights

OUT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
THREADS = 256
MAX_BLOCKS = 4 if ptx.SIMULATED else 65536
"""Grid cap: the grid-stride loop covers the rest (few simulated blocks: each one is slow)."""


@functools.cache
def make_dequantize_kernel(spec: QuantSpec, n: int, k: int, out_dtype_name: str):
    """Kernel (arrays, out, total) writing float32 / half-bit outputs of a (E, n, k) weight
    stored as `spec`; `arrays` is `KernelWeights.arrays()`, `total` = E * n * k."""
    if out_dtype_name not in OUT_DTYPES.values():
        raise ValueError(f"out_dtype_name must be one of {sorted(OUT_DTYPES.values())}, got {out_dtype_name!r}")
    read, stored_to_logical = element_reader(spec, n, k), logical_k(spec)
    half = out_dtype_name != "float32"
    to_half = ptx.to_half(out_dtype_name) if half else None

    @ptx.kernel
    def dequantize_kernel(arrays, out, total):
        k_order = arrays[4]
        start = cuda.grid(1)
        for index in range(start, total, cuda.gridsize(1)):
            row, kp = index // k, index % k
            e, n_ = row // n, row % n
            value = read(arrays, e, n_, kp)
            k_ = stored_to_logical(k_order, e, kp)
            if half:
                out[e, n_, k_] = int16(to_half(value))
            else:
                out[e, n_, k_] = value

    return dequantize_kernel


def dequantize(weights: KernelWeights, out_dtype=torch.float32, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense weights (E, N, K) of `out_dtype` (float32, bfloat16 or float16) in logical K
    order, from any spec's `KernelWeights`. `out`: a preallocated (E, N, K) tensor of
    `out_dtype` on the kernels' device to fill instead of allocating one."""
    if not isinstance(weights, KernelWeights):
        raise TypeError(f"weights must be a KernelWeights, got {type(weights).__name__}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {list(OUT_DTYPES)}, got {out_dtype}")
    experts, n, k = weights.shape
    if out is None:
        out = interop.empty((experts, n, k), out_dtype)
    else:
        out = interop.check_tensor("out", out, dtype=out_dtype, shape=(experts, n, k))
    total = experts * n * k
    if total == 0:
        return out
    kernel = make_dequantize_kernel(weights.spec, n, k, OUT_DTYPES[out_dtype])
    blocks = min(-(-total // THREADS), MAX_BLOCKS)
    launch_kernel(kernel, blocks, THREADS, weights.arrays(), interop.to_kernel(out), total)
    return out


def reference_dequantize(spec: QuantSpec, physical: dict, shape) -> np.ndarray:
    """float64 (E, N, K) weights in logical K order: `spec.dequantize` with a leading E."""
    values = spec.dequantize(physical, shape)
    return values.reshape((-1,) + values.shape[-2:])
