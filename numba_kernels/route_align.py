"""Routing and token alignment in one launch, for decode.

At a handful of tokens `route` and `moe_align_block_size` are each a few microseconds of
mostly fixed cost (a launch, a few barriers). So one block does both: it routes the tokens
with the routing code (`routing.make_token_router`), several side by side, one lane of
`block_threads(E)` threads per token, into a shared array of slot ids; then, after the
routing's last barrier, it copies the ids out and aligns them straight from shared memory
with the decode aligner (`align.make_routed_aligner`: a router's ids are distinct within a
token, so a bit mask of tokens per expert ranks the slots). Outputs and tie rules are
exactly those of `route` followed by `moe_align_block_size`; the backend oracle picks this
path up to `oracle.FUSED_ROUTING_TOKENS` tokens routed in one pass. The block lets the
next kernel (gemm1, launched early) start at once: its CTAs are resident and waiting when
the alignment lands (H200, Qwen3 M = 1: the layer 0.7 us faster).

The lanes share the block's static shared memory, so their number is bounded per routing
config (`max_lanes`): 32 for Mixtral's 8 experts, 8 for Qwen3-30B-A3B's 128, 4 for
DeepSeek-V3's 256 (grouped), 1 for 1024 experts. A block takes at most one slot per
thread and `align.ROUTED_TOKENS` (32) tokens (`max_tokens`).
"""

from __future__ import annotations

import functools

from numba import cuda, int32

from . import interop, ptx
from .align import ROUTED_TOKENS, check_alignment, check_expert_map, make_routed_aligner
from .launch import STATIC_SHARED_BYTES, launch_kernel
from .routing import RouterShape, RoutingConfig, block_threads, check_routing, make_token_router


def _fits(shape: RouterShape, lanes: int) -> bool:
    threads = lanes * shape.threads
    # the lanes, then the slot ids (a word per thread) and the aligner's two words per expert
    shared = lanes * shape.shared_bytes + 4 * threads + 8 * shape.num_experts
    return threads <= 1024 and shared <= STATIC_SHARED_BYTES


@functools.cache  # the oracle asks on every forward
def max_lanes(config: RoutingConfig, num_experts: int) -> int:
    """The most tokens one fused block routes side by side (0: not even one fits)."""
    shape = RouterShape(config, num_experts)
    lanes = 0
    while _fits(shape, lanes + 1):
        lanes += 1
    return lanes


def max_tokens(config: RoutingConfig, num_experts: int) -> int:
    """The most tokens one fused block takes: ROUTED_TOKENS, and a slot per thread of
    `max_lanes` lanes (0 where not even one lane fits, e.g. 1024 one-expert groups)."""
    return min(ROUTED_TOKENS, max_lanes(config, num_experts) * block_threads(num_experts) // config.top_k)


def default_lanes(tokens: int, config: RoutingConfig, num_experts: int) -> int:
    """Lanes for `tokens` tokens: the power of two >= tokens (few variants compile), at
    most `max_lanes`."""
    return min(1 << (max(tokens, 1) - 1).bit_length(), max_lanes(config, num_experts))


@functools.cache
def make_route_align_kernel(routing_key: tuple, block_size: int, map_mode: str, lanes: int):
    """Kernel (logits, bias, weights, ids, expert_map, sorted_ids, expert_ids, num_post,
    padded_len, block_count) with flat (M * k,) weights and ids, M * k <= the block's
    threads, one block of `lanes * block_threads(E)` threads; `routing_key` is
    `RoutingCall.kernel_key()`."""
    num_experts = routing_key[1]
    threads = lanes * block_threads(num_experts)
    route_tokens = make_token_router(*routing_key, lanes)
    align_routed = make_routed_aligner(num_experts, block_size, routing_key[0].top_k, threads, map_mode)

    @ptx.kernel(launch_bounds=threads)
    def route_and_align(logits, bias, weights, ids, expert_map, sorted_ids, expert_ids, num_post, padded_len,
                        block_count):
        ptx.release_next()  # gemm1 (launched early) takes its place beside this one block now
        slot_ids = cuda.shared.array(threads, int32)
        for first in range(0, logits.shape[0], lanes):
            route_tokens(logits, bias, weights, slot_ids, first)  # ends with a barrier
        n = ids.shape[0]
        i = cuda.threadIdx.x
        if i < n:
            ids[i] = slot_ids[i]
        align_routed(slot_ids, n, expert_map, sorted_ids, expert_ids, num_post, padded_len, block_count)

    return route_and_align


def route_and_align(router_logits, config: RoutingConfig, block_size: int, *, correction_bias=None, expert_map=None,
                    out_topk=None, out_alignment=None, lanes: int | None = None, check_map: bool = True):
    """`route(router_logits, config, ...)` then `moe_align_block_size(topk_ids, block_size,
    E, expert_map=...)` in one launch: returns (topk_weights, topk_ids, sorted_token_ids,
    expert_ids, num_tokens_post_padded). out_topk / out_alignment: optional preallocated
    outputs as those functions take them. At most `max_tokens(config, E)` tokens. lanes:
    tokens routed side by side, 1 to `max_lanes(config, E)`, at least a thread per slot
    (default `default_lanes`). check_map validates expert_map's values (a host sync; the
    layer's own map, checked when its config was built, skips it)."""
    routing = check_routing(router_logits, config, correction_bias=correction_bias, out=out_topk)
    tokens, experts = routing.logits.shape
    most, limit = max_lanes(config, experts), max_tokens(config, experts)
    if tokens > limit:
        raise ValueError(f"router_logits has {tokens} tokens; one block routes and aligns at most {limit} for "
                         f"{experts} experts and this routing config: call route and moe_align_block_size")
    if lanes is None:
        lanes = default_lanes(tokens, config, experts)
    elif isinstance(lanes, bool) or not isinstance(lanes, int) or not 1 <= lanes <= most:
        raise ValueError(f"lanes must be an integer in [1, {most}] for {experts} experts and this routing config, "
                         f"got {lanes!r}")
    elif tokens * config.top_k > lanes * block_threads(experts):
        raise ValueError(f"lanes must give a thread per slot: {tokens} tokens x top_k {config.top_k} need "
                         f">= {-(-tokens * config.top_k // block_threads(experts))} lanes of "
                         f"{block_threads(experts)} threads, got {lanes}")
    alignment = check_alignment(routing.ids, block_size, experts, expert_map=expert_map, out=out_alignment,
                                check_ids=False)  # the routing writes valid ids
    if check_map and alignment.expert_map is not None:
        check_expert_map(alignment.expert_map, experts)
    if out_topk is not None and out_alignment is not None:  # each checked alone above
        interop.check_disjoint({"out_topk[0]": routing.weights, "out_topk[1]": routing.ids,
                                "out_alignment[0]": alignment.sorted_ids, "out_alignment[1]": alignment.expert_ids,
                                "out_alignment[2]": alignment.num_post})
    if tokens == 0:
        alignment.num_post.zero_()
    else:
        kernel = make_route_align_kernel(routing.kernel_key(), int(block_size), alignment.map_mode, lanes)
        after_ids = alignment.kernel_arguments()[1:]  # its first, the flat ids, are the routing's last
        launch_kernel(kernel, 1, lanes * block_threads(experts), *routing.kernel_arrays(), *after_ids)
    return routing.weights, routing.ids, alignment.sorted_ids, alignment.expert_ids, alignment.num_post
