"""Routing and alignment fused in one launch give exactly the bytes of `route` followed by
`moe_align_block_size` (each checked against its float64 reference in its own tests), into
poisoned outputs, for drawn configs, token counts, block sizes and expert maps."""

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from numba_kernels import interop
from numba_kernels.align import align_sizes, moe_align_block_size
from numba_kernels.route_align import fusable, route_and_align
from numba_kernels.routing import RoutingConfig, route

DEVICE = interop.kernel_device()


def _poisoned_outputs(tokens, top_k, experts, block_size):
    padded, blocks = align_sizes(tokens * top_k, experts, block_size)
    topk = (torch.full((tokens, top_k), np.nan, device=DEVICE), torch.full((tokens, top_k), -7, dtype=torch.int32,
                                                                          device=DEVICE))
    alignment = tuple(torch.full((n,), -7, dtype=torch.int32, device=DEVICE) for n in (padded, blocks, 1))
    return topk, alignment


@given(experts=st.sampled_from([4, 6, 8, 16, 33]), data=st.data())
def test_fused_routing_and_alignment_equal_the_two_launches(experts, data):
    top_k = data.draw(st.integers(1, min(experts, 8)), label="top_k")
    grouped = experts % 2 == 0 and data.draw(st.booleans(), label="grouped")
    config = RoutingConfig(top_k=top_k, scoring=data.draw(st.sampled_from(["softmax", "sigmoid"])),
                           renormalize=data.draw(st.booleans()), num_expert_group=2 if grouped else None,
                           topk_group=(2 if top_k > experts // 2 else data.draw(st.integers(1, 2))) if grouped else None)
    tokens = data.draw(st.integers(1, 4), label="tokens")
    block_size = data.draw(st.sampled_from([1, 4, 16]), label="block_size")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    logits = torch.from_numpy(rng.standard_normal((tokens, experts)).astype(np.float32)).to(DEVICE)
    logits = logits.to(data.draw(st.sampled_from([torch.float32, torch.bfloat16]), label="dtype"))
    bias = torch.from_numpy(rng.random(experts).astype(np.float32)).to(DEVICE) if data.draw(st.booleans()) else None
    expert_map = None
    if data.draw(st.booleans(), label="expert map"):
        local = rng.random(experts) < 0.5
        expert_map = torch.from_numpy(np.where(local, np.cumsum(local) - 1, -1).astype(np.int32)).to(DEVICE)

    topk, alignment = _poisoned_outputs(tokens, top_k, experts, block_size)
    fused = route_and_align(logits, config, block_size, correction_bias=bias, expert_map=expert_map,
                            out_topk=topk, out_alignment=alignment)
    topk2, alignment2 = _poisoned_outputs(tokens, top_k, experts, block_size)
    weights, ids = route(logits, config, correction_bias=bias, out=topk2)
    separate = (weights, ids, *moe_align_block_size(ids, block_size, experts, expert_map=expert_map, out=alignment2,
                                                    check_ids=False))
    for got, expected in zip(fused, separate):
        np.testing.assert_array_equal(got.cpu().numpy(), expected.cpu().numpy())


def test_too_many_experts_for_one_block_are_refused():
    experts = next(e for e in range(256, 2048, 32) if not fusable(e))
    logits = torch.zeros((1, experts), device=DEVICE)
    with pytest.raises(ValueError, match="call route and moe_align_block_size"):
        route_and_align(logits, RoutingConfig(top_k=2), 16)


@pytest.mark.gpu
@pytest.mark.parametrize("experts, config", [
    (128, RoutingConfig(top_k=8, renormalize=True)),
    (256, RoutingConfig(top_k=8, scoring="sigmoid", renormalize=True, num_expert_group=8, topk_group=4,
                        routed_scaling_factor=2.5)),
], ids=["qwen3", "deepseek-v3"])
@pytest.mark.parametrize("tokens", [1, 4])
def test_fused_routing_at_model_shapes(experts, config, tokens):
    generator = torch.Generator(device=DEVICE).manual_seed(tokens)
    logits = torch.randn(tokens, experts, generator=generator, device=DEVICE)
    bias = torch.rand(experts, generator=generator, device=DEVICE) if config.scoring == "sigmoid" else None
    fused = route_and_align(logits, config, 16, correction_bias=bias)
    weights, ids = route(logits, config, correction_bias=bias)
    separate = (weights, ids, *moe_align_block_size(ids, 16, experts, check_ids=False))
    for got, expected in zip(fused, separate):
        assert torch.equal(got, expected)
