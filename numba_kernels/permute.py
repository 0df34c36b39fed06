"""Act-order activations: each token slot's row in its expert's stored K order.

GPTQ's act-order quantizes input features in order of decreasing importance, so the
scale group g_idx[k] of feature k jumps about along K. Stored sorted by group
(`QuantSpec.sort_k_by_group`: Marlin's act-order, and the native layout's), stored
feature kp is logical feature order[kp] (the stored sort indices, one order per expert).
When every group holds group_size features, as GPTQ makes them, the groups are runs of
group_size in the stored order, and the stored tensors are exactly the plain layout
(`plain_spec`) of the weight with its columns permuted, W[:, order]. Since

    x @ W.T = x[order] @ W[:, order].T

the MoE layer writes each slot's activations in its expert's order with this kernel and
the GEMMs read the weights as plain tiles: activations as 16-byte half pairs, prefill
tiles included, instead of a gather of every element inside the GEMM (which only decode
tiles can do). The cost is one pass over the slots' activations per GEMM.

Work split: one CTA per entry of the alignment (`moe_align_block_size`'s sorted slot
ids, blocks of block_m slots of one expert), as the GEMM walks them; padding entries
and blocks past the padded total return at once. The CTA stages the slot's source row
in shared memory (16-byte loads where rows allow), then each thread gathers pairs of
stored features through the expert's order and writes them as one word.
"""

from __future__ import annotations

import functools

import attrs
import numpy as np
import torch
from numba import cuda, int16, int32, uint32

from layouts import QuantSpec

from . import interop
from .align import check_alignment_arrays, check_alignment_ids
from .launch import launch_kernel
from .ptx import kernel, load_written, wait_for_previous

_load4 = load_written[4]  # a kernel calls the helper itself, not the dict it lives in

MAX_THREADS = 256


def plain_spec(spec: QuantSpec) -> QuantSpec | None:
    """The spec that reads `spec`'s stored tensors as the plain weight W[:, order], for a
    spec that stores K sorted by act-order group (else None); valid for weights whose
    groups are runs of group_size (`groups_are_runs`)."""
    if not spec.sort_k_by_group:
        return None
    return attrs.evolve(spec, g_idx_name=None, sort_k_by_group=False)


def groups_are_runs(stored_g_idx: torch.Tensor, group_size: int) -> bool:
    """Whether stored (K sorted by group) g_idx rows (E, K) or (K,) are kp // group_size:
    every group holds group_size features (the last one the rest), as GPTQ makes them."""
    k = stored_g_idx.shape[-1]
    runs = torch.arange(k, device=stored_g_idx.device, dtype=stored_g_idx.dtype) // group_size
    return bool(torch.equal(stored_g_idx, runs.expand_as(stored_g_idx)))


def _threads(k: int) -> int:
    """A warp multiple near one 16-byte load of the row per thread, at most MAX_THREADS."""
    return min(MAX_THREADS, max(32, -(-k // 8 + 31) // 32 * 32))


@functools.cache
def make_permute_kernel(k: int, block_m: int, vectorized: bool):
    """Kernel (act, order, sorted_token_ids, expert_ids, num_tokens_post_padded, out,
    num_slots, rows_per_token) for rows of K = `k` halves: act (tokens or slots, K) and out
    (slots, K) as int16 halves, or `vectorized` (K % 8 == 0, rows 16-byte aligned) as
    int32 half pairs; order (E or 1, K) int32. Dynamic shared memory: the row, 2K bytes."""
    pairs, threads = k // 2, _threads(k)

    @kernel
    def permute_kernel(act, order, sorted_token_ids, expert_ids, num_tokens_post_padded, out, num_slots,
                       rows_per_token):
        row = cuda.shared.array(0, int16)
        entry, tid = uint32(cuda.blockIdx.x), uint32(cuda.threadIdx.x)
        wait_for_previous()  # the alignment and the activations are final from here
        if entry >= uint32(num_tokens_post_padded[0]):
            return
        slot, expert = sorted_token_ids[entry], expert_ids[entry // uint32(block_m)]
        if slot >= num_slots or expert < 0:  # padding, or an expert of another rank
            return
        source, expert = uint32(slot // rows_per_token), uint32(expert) % uint32(order.shape[0])  # one order for all, or one each
        c = tid
        if vectorized:  # four half pairs per load
            while c < uint32(pairs // 4):
                words = _load4(act, source * uint32(pairs) + uint32(4) * c)
                for w in range(4):
                    row[8 * c + 2 * w] = int16(words[w] & uint32(0xFFFF))
                    row[8 * c + 2 * w + 1] = int16(words[w] >> uint32(16))
                c += uint32(threads)
        else:
            while c < uint32(k):
                row[c] = act[source, c]
                c += uint32(threads)
        cuda.syncthreads()
        c = tid
        if vectorized:
            while c < uint32(pairs):
                low = uint32(row[order[expert, 2 * c]]) & uint32(0xFFFF)
                out[slot, c] = int32(low | (uint32(row[order[expert, 2 * c + 1]]) << uint32(16)))
                c += uint32(threads)
        else:
            while c < uint32(k):
                out[slot, c] = row[order[expert, c]]
                c += uint32(threads)

    return permute_kernel


def _words(tensor: torch.Tensor, vectorized: bool):
    return interop.to_kernel(tensor.view(torch.int32) if vectorized else tensor.view(torch.int16))


def permute_slots(act, order, sorted_token_ids, expert_ids, num_tokens_post_padded, *, num_slots: int,
                  block_m: int, out=None, check_ids: bool = True) -> torch.Tensor:
    """out[slot, kp] = act[slot // (num_slots / rows), order[e, kp]] for every slot the
    alignment assigns to local expert e; one launch on torch's stream.

    act:    (M, K) per token (gemm1's input) or (num_slots, K) per slot, bfloat16 or float16.
    order:  (E, K) or (1, K) int32, the stored sort indices of act-order weights
            (`KernelWeights.k_order`, which checks each row permutes 0..K-1): logical
            input feature of each stored one.
    sorted_token_ids, expert_ids, num_tokens_post_padded: the alignment for block_m, as
            the GEMM after it reads it.
    out:    (num_slots, K) in act's dtype; rows of slots the alignment skips are not written.
    check_ids: check the values the kernel indexes with before the launch (a host sync; the
            layer passes False): order's in [0, K), the blocks in use's slots >= 0 and
            experts in [-1, E) (any >= -1 for one order for all).
    """
    act = interop.check_tensor("act", act, dtype=(torch.bfloat16, torch.float16), ndim=2)
    rows, k = act.shape
    if rows == 0:
        raise ValueError("act holds no rows")
    interop.check_count("num_slots", num_slots, 1)
    interop.check_count("block_m", block_m, 1)
    if num_slots % rows:
        raise ValueError(f"num_slots ({num_slots}) must be a positive multiple of act's rows ({rows})")
    order = interop.check_tensor("order", order, dtype=torch.int32, ndim=2)
    if order.shape[1] != k:
        raise ValueError(f"order must be (E, {k}) or (1, {k}), orders of act's K = {k} columns, "
                         f"got {tuple(order.shape)}")
    sorted_token_ids, expert_ids, num_tokens_post_padded = check_alignment_arrays(sorted_token_ids, expert_ids,
                                                                                  num_tokens_post_padded, block_m)
    if check_ids:
        interop.check_range("order", order, 0, k)
        check_alignment_ids(sorted_token_ids, expert_ids, num_tokens_post_padded, block_m,
                            order.shape[0] if order.shape[0] > 1 else None)
    if out is None:
        out = interop.empty((num_slots, k), act.dtype)
    out = interop.check_tensor("out", out, dtype=act.dtype, shape=(num_slots, k), alignment=4)
    vectorized = k % 8 == 0 and act.data_ptr() % 16 == 0
    launch_kernel(make_permute_kernel(k, block_m, vectorized), sorted_token_ids.shape[0], _threads(k),
                  _words(act, vectorized), interop.to_kernel(order), interop.to_kernel(sorted_token_ids),
                  interop.to_kernel(expert_ids), interop.to_kernel(num_tokens_post_padded), _words(out, vectorized),
                  np.int32(num_slots), np.int32(num_slots // rows), waits=True, shared_bytes=2 * k)
    return out


def reference_permute_slots(act, order, sorted_token_ids, expert_ids, num_tokens_post_padded, *, num_slots: int,
                            block_m: int, out: np.ndarray) -> np.ndarray:
    """numpy `permute_slots` into a copy of `out` (rows it does not write keep their values)."""
    act, order, ids, experts, total, out = (a.cpu().numpy().copy() if isinstance(a, torch.Tensor) else np.array(a) for a
                                            in (act, order, sorted_token_ids, expert_ids, num_tokens_post_padded, out))
    total = int(total.reshape(-1)[0])
    rows_per_token = num_slots // act.shape[0]
    for entry in range(min(total, ids.shape[0])):
        slot, expert = int(ids[entry]), int(experts[entry // block_m])
        if slot < num_slots and expert >= 0:
            out[slot] = act[slot // rows_per_token, order[expert % order.shape[0]]]
    return out
