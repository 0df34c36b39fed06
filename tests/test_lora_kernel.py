"""The LoRA delta kernel adds scaling * B @ (A @ x) to every slot with an adapter, and
nothing elsewhere."""

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from numba_kernels import interop
from numba_kernels.lora import add_lora, reference_lora


def _case(seed, tokens, top_k, experts, adapters, rank, k, n, half, partial, mapped, per_slot):
    rng = np.random.default_rng(seed)
    device = interop.kernel_device()
    slots = tokens * top_k
    x = torch.from_numpy(rng.standard_normal((slots if per_slot else tokens, k))).to(half)
    topk_ids = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]).astype(np.int32)
    expert_map = None
    local = experts
    if mapped:
        expert_map = np.where(np.arange(experts) % 2 == 0, np.arange(experts) // 2, -1).astype(np.int32)
        local = int((expert_map >= 0).sum())
    lora_a = torch.from_numpy(rng.standard_normal((adapters, local, rank, k)) * 0.1).to(half)
    lora_b = torch.from_numpy(rng.standard_normal((adapters, local, n, rank)) * 0.1).to(half)
    scaling = torch.from_numpy(rng.uniform(0.5, 2.0, adapters).astype(np.float32))
    token_adapter = rng.integers(-1, adapters, tokens).astype(np.int32)
    base = rng.standard_normal((2, slots, n) if partial else (slots, n))
    out = torch.from_numpy(base).to(torch.float32 if partial else half)
    before = out.double().numpy().copy()
    out = out.to(device)
    add_lora(x.to(device), torch.from_numpy(topk_ids).to(device), lora_a.to(device), lora_b.to(device),
             scaling.to(device), torch.from_numpy(token_adapter).to(device), out,
             expert_map=None if expert_map is None else torch.from_numpy(expert_map).to(device),
             rows_div=1 if per_slot else top_k)
    delta = reference_lora(x.float().numpy(), topk_ids, lora_a.float().numpy(), lora_b.float().numpy(),
                           scaling.numpy(), token_adapter, expert_map=expert_map, rows_div=1 if per_slot else top_k)
    expected = before.copy()
    if partial:
        expected[0] += delta
    else:
        expected += delta
    return out.double().cpu().numpy(), expected


@given(seed=st.integers(0, 2**16), tokens=st.integers(1, 3), top_k=st.integers(1, 2), adapters=st.integers(1, 2),
       rank=st.sampled_from([1, 4]), half=st.sampled_from([torch.bfloat16, torch.float16]), partial=st.booleans(),
       mapped=st.booleans(), per_slot=st.booleans())
def test_lora_delta_matches_the_float_reference(seed, tokens, top_k, adapters, rank, half, partial, mapped, per_slot):
    got, expected = _case(seed, tokens, top_k, 4, adapters, rank, 24, 20, half, partial, mapped, per_slot)
    tolerance = 1e-5 if partial else 2e-2
    np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)


def test_mismatched_adapter_shapes_are_rejected():
    device = interop.kernel_device()
    x = torch.zeros(2, 8, dtype=torch.bfloat16, device=device)
    ids = torch.zeros(2, 1, dtype=torch.int32, device=device)
    a = torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16, device=device)
    b = torch.zeros(1, 1, 6, 3, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="lora_b must be"):
        add_lora(x, ids, a, b, torch.ones(1, device=device), torch.zeros(2, dtype=torch.int32, device=device),
                 torch.zeros(2, 6, dtype=torch.bfloat16, device=device), rows_div=1)
