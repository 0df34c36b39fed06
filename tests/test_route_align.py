"""Routing and alignment fused in one launch give exactly the bytes of `route` followed by
`moe_align_block_size` (each checked against its float64 reference in its own tests), into
poisoned outputs, for drawn configs, token counts, block sizes and expert maps."""

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from moe import MoEConfig
from moe.oracle import fused_routing
from numba_kernels import interop
from numba_kernels.align import align_sizes, moe_align_block_size
from numba_kernels.launch import STATIC_SHARED_BYTES
from numba_kernels.route_align import max_lanes, max_tokens, route_and_align
from numba_kernels.routing import RouterShape, RoutingConfig, block_threads, route

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
    tokens = data.draw(st.integers(1, 5), label="tokens")
    fewest = -(-tokens * top_k // block_threads(experts))  # a thread per slot
    lanes = data.draw(st.none() | st.integers(fewest, 3), label="lanes")  # 2 and 3: passes with idle lanes
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
                            out_topk=topk, out_alignment=alignment, lanes=lanes)
    topk2, alignment2 = _poisoned_outputs(tokens, top_k, experts, block_size)
    weights, ids = route(logits, config, correction_bias=bias, out=topk2)
    separate = (weights, ids, *moe_align_block_size(ids, block_size, experts, expert_map=expert_map, out=alignment2,
                                                    check_ids=False))
    for got, expected in zip(fused, separate):
        np.testing.assert_array_equal(got.cpu().numpy(), expected.cpu().numpy())


def test_a_full_block_of_tokens_equals_the_two_launches():
    """32 tokens (the aligner's last token bit) routed two at a time, ties included."""
    config, experts = RoutingConfig(top_k=2, renormalize=True), 6
    logits = torch.from_numpy(np.random.default_rng(3).integers(-2, 3, (32, experts)).astype(np.float32)).to(DEVICE)
    topk, alignment = _poisoned_outputs(32, 2, experts, 4)
    fused = route_and_align(logits, config, 4, out_topk=topk, out_alignment=alignment, lanes=2)
    weights, ids = route(logits, config)
    separate = (weights, ids, *moe_align_block_size(ids, 4, experts, check_ids=False))
    for got, expected in zip(fused, separate):
        np.testing.assert_array_equal(got.cpu().numpy(), expected.cpu().numpy())


def test_more_tokens_than_one_block_aligns_are_refused():
    config = RoutingConfig(top_k=8)
    assert max_tokens(config, 128) == 32 and max_tokens(RoutingConfig(top_k=64), 64) == 16  # a slot per thread
    with pytest.raises(ValueError, match="one block routes and aligns at most 32 for 128 experts"):
        route_and_align(torch.zeros((33, 128), device=DEVICE), config, 16)
    one_expert_groups = RoutingConfig(top_k=8, num_expert_group=1024, topk_group=8)
    assert max_lanes(one_expert_groups, 1024) == 0
    with pytest.raises(ValueError, match="at most 0 for 1024 experts"):
        route_and_align(torch.zeros((1, 1024), device=DEVICE), one_expert_groups, 16)


@pytest.mark.parametrize("lanes, match", [(0, r"in \[1, 8\]"), (9, r"in \[1, 8\]"), (2.0, r"in \[1, 8\]"),
                                          (True, r"in \[1, 8\]"), (1, "need >= 2 lanes of 128 threads")])
def test_lanes_outside_what_fits_are_refused(lanes, match):
    with pytest.raises(ValueError, match=match):
        route_and_align(torch.zeros((20, 128), device=DEVICE), RoutingConfig(top_k=8), 16, lanes=lanes)


def test_lanes_fit_the_static_shared_memory():
    """The lane bound is what fits: one lane more breaks a limit (threads or shared memory)."""
    for config, experts, expected in [(RoutingConfig(top_k=8), 128, 8), (RoutingConfig(top_k=2), 8, 32),
                                      (RoutingConfig(top_k=8, num_expert_group=8, topk_group=4), 256, 4),
                                      (RoutingConfig(top_k=8), 1024, 1)]:
        lanes, threads = max_lanes(config, experts), block_threads(experts)
        assert lanes == expected

        def shared(lanes):  # the routing lanes, then a slot id per thread and the aligner's two words per expert
            return lanes * RouterShape(config, experts).shared_bytes + 4 * lanes * threads + 8 * experts

        assert lanes * threads <= 1024 and shared(lanes) <= STATIC_SHARED_BYTES
        assert (lanes + 1) * threads > 1024 or shared(lanes + 1) > STATIC_SHARED_BYTES


def test_the_oracle_fuses_routing_done_in_one_pass():
    """Fused up to 16 tokens and as many as one block routes side by side."""
    def fused_up_to(**shape):
        config = MoEConfig(hidden_size=64, intermediate_size=64, **shape)
        return max(m for m in range(1, 40) if fused_routing(config, m))

    assert fused_up_to(num_experts=8, top_k=2) == 16  # 32 lanes, capped
    assert fused_up_to(num_experts=128, top_k=8) == 8
    assert fused_up_to(num_experts=256, top_k=8, num_expert_group=8, topk_group=4, scoring="sigmoid") == 4


@pytest.mark.gpu
@pytest.mark.parametrize("experts, config", [
    (128, RoutingConfig(top_k=8, renormalize=True)),
    (256, RoutingConfig(top_k=8, scoring="sigmoid", renormalize=True, num_expert_group=8, topk_group=4,
                        routed_scaling_factor=2.5)),
], ids=["qwen3", "deepseek-v3"])
@pytest.mark.parametrize("tokens", [1, 4, 16, 32])
def test_fused_routing_at_model_shapes(experts, config, tokens):
    generator = torch.Generator(device=DEVICE).manual_seed(tokens)
    logits = torch.randn(tokens, experts, generator=generator, device=DEVICE)
    bias = torch.rand(experts, generator=generator, device=DEVICE) if config.scoring == "sigmoid" else None
    fused = route_and_align(logits, config, 16, correction_bias=bias)
    weights, ids = route(logits, config, correction_bias=bias)
    separate = (weights, ids, *moe_align_block_size(ids, 16, experts, check_ids=False))
    for got, expected in zip(fused, separate):
        assert torch.equal(got, expected)
