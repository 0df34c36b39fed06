"""Routing and token alignment in one launch, for decode.

At a handful of tokens `route` and `moe_align_block_size` are each a few microseconds of
mostly fixed cost (a launch, a few barriers). So one block does both: it routes the tokens
one after another with the routing code (`routing.make_token_router`, the block that
`route` runs per token), then, its writes visible to itself after a barrier, aligns their
slots as the single-block case of the alignment code (`align.make_tile_aligner`). Outputs
and tie rules are exactly those of `route` followed by `moe_align_block_size`; the backend
oracle picks this path up to `oracle.FUSED_ROUTING_TOKENS` tokens.
"""

from __future__ import annotations

import functools

from . import ptx
from .align import check_alignment, make_tile_aligner, max_threads
from .launch import launch_kernel
from .routing import RoutingConfig, block_threads, check_routing, make_token_router


def fusable(num_experts: int) -> bool:
    """Whether the routing block (one thread per expert) is also a valid alignment block."""
    return block_threads(num_experts) <= max_threads(num_experts)


@functools.cache
def make_route_align_kernel(routing_key: tuple, block_size: int, map_mode: str):
    """Kernel (logits, bias, weights, ids, expert_map, sorted_ids, expert_ids, num_post,
    padded_len, block_count) with flat (M * k,) weights and ids, one block of
    `block_threads(E)` threads; `routing_key` is `RoutingCall.kernel_key()`."""
    num_experts = routing_key[1]
    threads = block_threads(num_experts)
    route_token = make_token_router(*routing_key)
    align_tile = make_tile_aligner(num_experts, block_size, threads, map_mode)

    @ptx.kernel(launch_bounds=threads)
    def route_and_align(logits, bias, weights, ids, expert_map, sorted_ids, expert_ids, num_post, padded_len,
                        block_count):
        for token in range(logits.shape[0]):
            route_token(logits, bias, weights, ids, token)  # ends with a barrier: ids visible to the block
        align_tile(ids, expert_map, sorted_ids, expert_ids, num_post, padded_len, block_count, 0, 1)

    return route_and_align


def route_and_align(router_logits, config: RoutingConfig, block_size: int, *, correction_bias=None, expert_map=None,
                    out_topk=None, out_alignment=None):
    """`route(router_logits, config, ...)` then `moe_align_block_size(topk_ids, block_size,
    E, expert_map=...)` in one launch: returns (topk_weights, topk_ids, sorted_token_ids,
    expert_ids, num_tokens_post_padded). out_topk / out_alignment: optional preallocated
    outputs as those functions take them."""
    routing = check_routing(router_logits, config, correction_bias=correction_bias, out=out_topk)
    experts = routing.logits.shape[1]
    if not fusable(experts):
        raise ValueError(f"{experts} experts need more routing threads than one alignment block allows: "
                         "call route and moe_align_block_size")
    alignment = check_alignment(routing.ids, block_size, experts, expert_map=expert_map, out=out_alignment,
                                check_ids=False)
    if routing.logits.shape[0] == 0:
        alignment.num_post.zero_()
    else:
        kernel = make_route_align_kernel(routing.kernel_key(), int(block_size), alignment.map_mode)
        after_ids = alignment.kernel_arguments()[1:]  # its first, the flat ids, are the routing's last
        launch_kernel(kernel, 1, block_threads(experts), *routing.kernel_arrays(), *after_ids)
    return routing.weights, routing.ids, alignment.sorted_ids, alignment.expert_ids, alignment.num_post
