"""Alignment for the batched (expert-major) token layout that expert parallelism ships.

After an all-to-all dispatch a rank holds its tokens as (E, T, H): expert e's rows
0 .. counts[e] - 1 are valid, the rest of its T rows are padding. Row r of expert e is
token slot e * T + r. The grouped GEMM then needs the same three outputs as
`moe_align_block_size`, but no sort: every expert owns ceil(T / block_size) blocks, so

    sorted_token_ids[e * B * block_size + r] = e * T + r    if r < counts[e]
                                             = E * T        (the sentinel) otherwise
    expert_ids[e * B + b]                    = e            if b * block_size < counts[e]
                                             = -1           (the GEMM skips the block)
    num_tokens_post_padded[0]                = E * B * block_size

with B = ceil(T / block_size). One thread per sorted entry; the launch shape depends only
on (E, T, block_size), so a CUDA graph replays it with new counts.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import cuda, int32

from . import interop, ptx
from .align import check_out_triple
from .launch import launch_kernel

THREADS = 256


def batched_sizes(num_experts: int, tokens_per_expert: int, block_size: int) -> tuple[int, int]:
    """(length of sorted_token_ids, number of blocks) for the batched layout."""
    blocks = num_experts * -(-tokens_per_expert // block_size)
    return blocks * block_size, blocks


@functools.cache
def make_batched_align_kernel(tokens_per_expert: int, block_size: int):
    blocks_per_expert = -(-tokens_per_expert // block_size)
    rows_per_expert = blocks_per_expert * block_size

    @ptx.kernel
    def batched_align(counts, sorted_ids, expert_ids, num_post):
        i = cuda.grid(1)
        num_experts = counts.shape[0]
        if i == 0:
            num_post[0] = num_experts * rows_per_expert
        if i < num_experts * rows_per_expert:
            expert, row = i // rows_per_expert, i % rows_per_expert
            count = min(max(counts[expert], int32(0)), int32(tokens_per_expert))
            valid = row < count
            sorted_ids[i] = expert * tokens_per_expert + row if valid else num_experts * tokens_per_expert
            if row % block_size == 0:
                expert_ids[i // block_size] = expert if valid else -1

    return batched_align


def check_count_values(counts: torch.Tensor, tokens_per_expert: int) -> None:
    """Raise unless every count lies in [0, tokens_per_expert] (synchronises the host)."""
    interop.check_range("counts", counts, 0, tokens_per_expert + 1,
                        f" (at most tokens_per_expert = {tokens_per_expert})")


def batched_align(counts, tokens_per_expert: int, block_size: int, *, out=None, check_counts: bool = True):
    """(sorted_token_ids, expert_ids, num_tokens_post_padded) for the batched layout.

    counts: (E,) int32 valid rows per expert, each in [0, tokens_per_expert]; `check_counts`
    validates them (a host sync: the hot path passes False; the kernel then clamps them).
    out: optional preallocated triple at least `batched_sizes(...)` long; filled prefixes
    are returned as views."""
    interop.check_count("tokens_per_expert", tokens_per_expert, 1)
    interop.check_count("block_size", block_size, 1)
    counts = interop.check_tensor("counts", counts, dtype=torch.int32, ndim=1)
    num_experts = counts.shape[0]
    if num_experts == 0:
        raise ValueError("counts must hold one entry per local expert, got none")
    if check_counts:
        check_count_values(counts, tokens_per_expert)
    length, blocks = batched_sizes(num_experts, tokens_per_expert, block_size)
    if out is None:
        out = tuple(interop.empty((size,), torch.int32) for size in (length, blocks, 1))
    views = check_out_triple(out, (length, blocks, 1))
    kernel = make_batched_align_kernel(int(tokens_per_expert), int(block_size))
    launch_kernel(
        kernel, -(-length // THREADS), THREADS,
        interop.to_kernel(counts), *(interop.to_kernel(v) for v in views))
    return tuple(views)


def reference_batched_align(counts, tokens_per_expert: int, block_size: int):
    """numpy twin of `batched_align`."""
    counts = np.clip(np.asarray(counts, np.int64), 0, tokens_per_expert)
    num_experts = counts.size
    per = -(-tokens_per_expert // block_size) * block_size
    row = np.arange(per)
    valid = row[None, :] < counts[:, None]
    sorted_ids = np.where(valid, np.arange(num_experts)[:, None] * tokens_per_expert + row, num_experts * tokens_per_expert)
    expert_ids = np.where(valid[:, ::block_size], np.arange(num_experts)[:, None], -1)
    return (sorted_ids.reshape(-1).astype(np.int32), expert_ids.reshape(-1).astype(np.int32),
            np.array([num_experts * per], np.int32))
