"""LoRA deltas of the expert GEMMs: out[t] += scaling[a] * B[a, e] @ (A[a, e] @ x[t]).

For every token slot t (token m = t // top_k, routed to global expert topk_ids[t], local
expert e = expert_map[...]) whose token has an adapter a = token_adapter[m] >= 0, the
delta of adapter a's low-rank pair for expert e is added to the GEMM output row of t in
place. Several adapters share one batch through `token_adapter`; slots of experts on
other ranks or tokens without an adapter are left untouched. The base weights can be in
any format: the delta is added to the GEMM's output, after it.

Work split: one CTA per slot. Its threads first compute the `rank` products
v = A[a, e] @ x (each thread a strided part of K for every rank row, summed through
shared memory), then each thread adds B[a, e, n] . v to its output features n. Memory
traffic per slot: one activation row, A (rank x K) and B (N x rank) of one expert; the
adapters are small, so they stay in L2 across slots.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import cuda, float32, int16

from . import interop, ptx
from .launch import launch_kernel

THREADS = 128


@functools.cache
def make_lora_kernel(rank: int, half: str, partial_output: bool, mapped: bool):
    """The LoRA delta kernel for adapters of `rank`, `half` tensors, a GEMM output that is
    half (slots, N) or float32 partials (splits, slots, N) (the delta goes to split 0), and
    global expert ids translated through an expert map (`mapped`) or used as they are."""
    to_f32, to_half = ptx.half_to_f32(half), ptx.to_half(half)

    @ptx.kernel
    def add_lora(x, topk_ids, expert_map, token_adapter, lora_a, lora_b, scaling, out, top_k, rows_div):
        slot = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        token = slot // top_k
        adapter = token_adapter[token]
        expert = topk_ids[token, slot % top_k]
        if mapped:
            expert = expert_map[expert]
        if adapter < 0 or expert < 0:
            return
        row = slot // rows_div
        k = x.shape[1]
        sums = cuda.shared.array((rank, THREADS), float32)
        for j in range(rank):
            total = float32(0.0)
            for kk in range(tid, k, THREADS):
                total += to_f32(lora_a[adapter, expert, j, kk]) * to_f32(x[row, kk])
            sums[j, tid] = total
        cuda.syncthreads()
        products = cuda.shared.array(rank, float32)
        for j in range(tid, rank, THREADS):
            total = float32(0.0)
            for other in range(THREADS):
                total += sums[j, other]
            products[j] = total * scaling[adapter]
        cuda.syncthreads()
        for n in range(tid, lora_b.shape[2], THREADS):
            delta = float32(0.0)
            for j in range(rank):
                delta += to_f32(lora_b[adapter, expert, n, j]) * products[j]
            if partial_output:
                out[0, slot, n] += delta
            else:
                out[slot, n] = int16(to_half(to_f32(out[slot, n]) + delta))

    return add_lora


def add_lora(x, topk_ids, lora_a, lora_b, scaling, token_adapter, out, *, expert_map=None, rows_div: int,
             check_ids: bool = True) -> None:
    """Add the LoRA deltas of every slot to `out` in place (see the module docstring).

    x:             (M, K) (gemm1, rows_div = top_k) or (M * top_k, K) (gemm2, rows_div = 1), half.
    topk_ids:      (M, top_k) int32 global expert ids.
    lora_a:        (adapters, local experts, rank, K) in x's dtype.
    lora_b:        (adapters, local experts, N, rank) in x's dtype.
    scaling:       (adapters,) float32.
    token_adapter: (M,) int32 adapter of each token, -1 for none.
    out:           (M * top_k, N) in x's dtype, or float32 partials (splits, M * top_k, N).
    expert_map:    (num_experts,) int32 global -> local expert (-1: not on this rank), or None.
    check_ids:     check the ids' values before the launch: topk_ids in [0, num_experts)
                   (num_experts = local experts without a map), the map's in [-1, local
                   experts), token_adapter in [-1, adapters). A host sync: the layer's
                   hooks pass False (its router writes valid ids, and
                   `LoRAHooks.set_token_adapters` checks the adapters when they are set).
    """
    x = interop.check_tensor("x", x, dtype=(torch.bfloat16, torch.float16), ndim=2)
    topk_ids = interop.check_tensor("topk_ids", topk_ids, dtype=torch.int32, ndim=2)
    lora_a = interop.check_tensor("lora_a", lora_a, dtype=x.dtype, ndim=4)
    lora_b = interop.check_tensor("lora_b", lora_b, dtype=x.dtype, ndim=4)
    adapters, experts, rank, k = lora_a.shape
    if k != x.shape[1]:
        raise ValueError(f"lora_a must have K = {x.shape[1]} (x's columns), got {tuple(lora_a.shape)}")
    if lora_b.shape[0] != adapters or lora_b.shape[1] != experts or lora_b.shape[3] != rank:
        raise ValueError(f"lora_b must be ({adapters}, {experts}, N, {rank}) to match lora_a, got {tuple(lora_b.shape)}")
    scaling = interop.check_tensor("scaling", scaling, dtype=torch.float32, shape=(adapters,))
    tokens, top_k = topk_ids.shape
    token_adapter = interop.check_tensor("token_adapter", token_adapter, dtype=torch.int32, shape=(tokens,))
    slots, n = tokens * top_k, lora_b.shape[2]
    partial = interop.as_tensor(out, "out").dtype == torch.float32
    out = interop.check_tensor("out", out, dtype=torch.float32 if partial else x.dtype,
                               shape=(None, slots, n) if partial else (slots, n))
    interop.check_count("rows_div", rows_div, 1)
    if x.shape[0] * rows_div != slots:
        raise ValueError(f"x must have {slots // rows_div} rows for rows_div = {rows_div}, got {x.shape[0]}")
    mapped = expert_map is not None
    if mapped:
        expert_map = interop.check_tensor("expert_map", expert_map, dtype=torch.int32, ndim=1)
    if check_ids:
        interop.check_range("topk_ids", topk_ids, 0, expert_map.shape[0] if mapped else experts)
        interop.check_range("token_adapter", token_adapter, -1, adapters)
        if mapped:
            interop.check_range("expert_map", expert_map, -1, experts)
    if not mapped:
        expert_map = interop.stand_in(0, torch.int32, x.device)
    kernel = make_lora_kernel(rank, interop.HALF_NAMES[x.dtype], partial, mapped)
    to = interop.to_kernel
    launch_kernel(
        kernel, slots, THREADS,
        to(x), to(topk_ids), to(expert_map), to(token_adapter), to(lora_a), to(lora_b), to(scaling), to(out),
        np.int32(top_k), np.int32(rows_div))


def reference_lora(x, topk_ids, lora_a, lora_b, scaling, token_adapter, *, expert_map=None, rows_div: int) -> np.ndarray:
    """float64 deltas (M * top_k, N) that `add_lora` adds."""
    x, lora_a, lora_b = (np.asarray(v, np.float64) for v in (x, lora_a, lora_b))
    tokens, top_k = topk_ids.shape
    delta = np.zeros((tokens * top_k, lora_b.shape[2]))
    for slot in range(tokens * top_k):
        token, adapter = slot // top_k, int(token_adapter[slot // top_k])
        expert = int(topk_ids[token, slot % top_k])
        expert = expert if expert_map is None else int(expert_map[expert])
        if adapter >= 0 and expert >= 0:
            delta[slot] = scaling[adapter] * lora_b[adapter, expert] @ (lora_a[adapter, expert] @ x[slot // rows_div])
    return delta

