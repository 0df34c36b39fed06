"""Combine: each token's output is the routing-weighted sum of its top-k experts' outputs.

gemm2 writes one row per token slot (slot t = m * k + j is token m's j-th expert), either
finished, (M*k, H) in bfloat16/float16/float32, or as float32 split-K partial sums
(S, M*k, H). Then

    out[m, h] = sum_j w[m, j] * sum_s expert_out[s, m*k + j, h]

(with weights_applied, gemm2 already scaled each slot by its routing weight: just the
sums). The order is fixed, splits s ascending inside slots j ascending, and accumulation
is float32 in registers with no atomics, so results are bitwise reproducible.

Work split: a thread owns a chunk of contiguous hidden features of one token (8 for
float32 input, 16 for halves, 8 element by element: `rows.chunk_size`) and walks
its k slots and S splits; a block covers up to 256 chunks of a token row, blockIdx.x
walks along H and blockIdx.y over tokens (grid-striding past 65535). Memory traffic:
every partial read once (S*M*k*H*in_bytes), each output written once, the k weights of
a token read by every thread of its row (cached). As in the activation, 16-byte loads
and paired half stores when H divides into chunks and the input is aligned, element by
element otherwise; the chunked row I/O is `numba_kernels.rows`.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import cuda, float32, uint32

from . import interop
from .rows import (DTYPE_NAMES, ONE, ZERO, as_float64, check_partials, chunk_reader, chunk_size, chunk_writer,
                   grid_position, launch_rows, output_tensor, source_array, target_array, vectorizable)
from .ptx import kernel, wait_for_previous


@functools.cache
def make_combine_kernel(source: str, target: str, vectorized: bool, weights_applied: bool, splits: int, top_k: int):
    """Kernel (expert_out, topk_weights, out, width): expert_out (splits, M*top_k, H) from
    `source_array`, topk_weights (M, top_k) float32, out (M, H) from `target_array`.
    splits and top_k are compile-time: the loops over them unroll, so a thread issues all
    its splits x top_k loads before it adds (at decode this is a latency chain otherwise)."""
    chunk = chunk_size(source, vectorized)
    read, write = chunk_reader(source, vectorized), chunk_writer(target, vectorized, chunk)

    @kernel
    def combine_kernel(expert_out, topk_weights, out, width):
        col, token, tokens, token_step = grid_position(chunk, topk_weights.shape[0])
        wait_for_previous()  # launched early (rows.launch_rows): the partials are final from here
        slot_sum = cuda.local.array(chunk, float32)
        total = cuda.local.array(chunk, float32)
        if col >= uint32(width):
            return
        while token < tokens:
            for v in range(chunk):
                total[v] = ZERO
            for j in range(top_k):
                for v in range(chunk):
                    slot_sum[v] = ZERO
                for s in range(splits):
                    read(expert_out, s, token * top_k + j, col, width, slot_sum, 0)
                weight = ONE if weights_applied else topk_weights[token, j]
                for v in range(chunk):
                    total[v] += weight * slot_sum[v]
            write(out, token, col, width, total)
            token = uint32(token + token_step)

    return combine_kernel


def combine(expert_out, topk_weights, *, out=None, out_dtype=None, weights_applied: bool = False) -> torch.Tensor:
    """out[m] = sum_j topk_weights[m, j] * sum_s expert_out[s, m*k + j], one launch on torch's stream.

    expert_out: (M*k, H) float32/bfloat16/float16, or float32 split-K partials (S, M*k, H).
    topk_weights: (M, k) float32; with weights_applied (gemm2 already multiplied them in)
        only its shape is used.
    out: preallocated (M, H) bfloat16/float16/float32 (then nothing is allocated).
    out_dtype: the dtype of a new `out`; defaults to expert_out's dtype for half inputs and
        is required for float32 input.
    """
    partials = check_partials("expert_out", expert_out, "M*k, H")
    weights = interop.check_tensor("topk_weights", topk_weights, dtype=torch.float32, ndim=2)
    _, slots, width = partials.shape
    tokens, top_k = weights.shape
    if slots != tokens * top_k:
        raise ValueError(f"expert_out has {slots} token slots but topk_weights {tuple(weights.shape)} "
                         f"needs M*k = {tokens * top_k}")
    out = output_tensor(out, out_dtype, (tokens, width), partials.dtype)
    if tokens and width:
        vectorized = vectorizable(width, partials, out)
        source = DTYPE_NAMES[partials.dtype]
        combine_kernel = make_combine_kernel(source, DTYPE_NAMES[out.dtype], vectorized, bool(weights_applied),
                                             partials.shape[0], top_k)
        launch_rows(combine_kernel, tokens, width, chunk_size(source, vectorized), source_array(partials, vectorized),
               interop.to_kernel(weights), target_array(out, vectorized), width)
    return out


def reference_combine(expert_out, topk_weights, *, weights_applied: bool = False) -> np.ndarray:
    """float64 (M, H) result of `combine`."""
    x = as_float64(expert_out)
    if x.ndim == 3:
        x = x.sum(axis=0)
    weights = as_float64(topk_weights)
    per_slot = x.reshape(weights.shape + x.shape[-1:])
    if weights_applied:
        return per_slot.sum(axis=1)
    return np.einsum("mk,mkh->mh", weights, per_slot)
