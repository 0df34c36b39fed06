"""Router: logits (M, E) -> the top-k experts of each token and their weights, one launch.

Semantics (vLLM `fused_topk` and DeepSeek-V3 `grouped_topk`):

    scores   = softmax(logits) or sigmoid(logits)              (float32 on the device)
    key      = scores + correction_bias    if a bias is given   (what selection compares)
             = logits                      otherwise            (same order: scoring is monotone)
    groups   : group score = sum of the two largest keys of the group with a bias (the one key
               of a one-expert group), its largest key without; keep the `topk_group` best
    top-k    : the `top_k` largest keys among the experts of the kept groups
    weights  = scores of the chosen experts (never the biased keys), divided by their sum when
               `renormalize`, times `routed_scaling_factor` last

Ties are deterministic: of equal keys (experts or groups) the lower index wins, and the
output columns are in selection order (descending key, ties by ascending id). Selecting on
the logits when there is no bias makes the order exact (float32 logits are exact in the
float64 reference; float32 scores could round distinct logits to one value). NaN keys rank
as -inf. Weights of experts whose scores sum to 0 (sigmoid of logits below about -88) are NaN.

Work split: one *lane* of T = next power of two >= E threads per token (E <= 1024),
thread e of the lane owns expert e. `route` launches a block of one lane per token; the
fused decode block (`route_align`) holds several lanes, so its tokens route side by side.
No warp shuffles (the simulator has none): top-k is a *rank count*. Each
(key, index) is packed into one uint64 whose unsigned order is the selection order
(`sort_key`), so "a beats b" is one integer compare and the ranks of distinct packed keys
are a permutation. Three rounds, so that no thread compares against all E experts:

1. Each expert counts the experts of its chunk that beat it (chunk = its group, or 32
   consecutive experts without groups, the last padded with (-inf, index >= E)). Rank
   r < k puts it at candidate slot (chunk, r); ranks 0 and 1 give the group scores.
   (Every expert of the global top-k is in its chunk's top-k, so nothing is lost.)
2. With groups: each group counts the groups that beat it; rank < topk_group keeps it.
3. Each candidate of a kept group counts the candidates of kept groups that beat it:
   its rank r < k is its output column.

For E = 256, k = 8 a thread makes 32 compares in round 1 and 64 in round 3, all unrolled
(constant trip counts, unsigned shared-memory indices), with 4-6 barriers in all (softmax
scoring with a bias or without `renormalize` adds two tree reductions for the maximum and
the denominator). Measured on an H200, back-to-back launches (about 2 us of which is the
launch itself): 3.5 us per launch for DeepSeek-V3 routing at M = 1
(2.4 us for E = 128 softmax), 22 us at M = 4096 (9 us for E = 128). Memory traffic: the
logits row is read once, the bias once, k weights and ids written; the rest lives in
shared memory (`RouterShape.shared_bytes`: about 16 E bytes plus 8 bytes per candidate
per lane).
"""

from __future__ import annotations

import functools
import math

import attrs
import numpy as np
import torch
from numba import cuda, float32, int32, uint32, uint64

from . import interop, ptx
from .launch import launch_kernel

SCORINGS = ("softmax", "sigmoid")
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CHUNK = 32
"""Experts per first-round chunk when there are no groups."""
MAX_EXPERTS = 1024
"""One thread per expert, one block per token."""


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@attrs.frozen
class RoutingConfig:
    """How a router turns logits into top-k experts and weights (see the module docstring).

    `num_expert_group` and `topk_group` go together (DeepSeek-V2/V3 grouped routing) or are
    both None. The number of experts is checked against them at call time
    (`check_experts`)."""

    top_k: int = attrs.field()
    scoring: str = attrs.field(default="softmax")
    renormalize: bool = attrs.field(default=False)
    num_expert_group: int | None = attrs.field(default=None)
    topk_group: int | None = attrs.field(default=None)
    routed_scaling_factor: float = attrs.field(default=1.0)

    @top_k.validator
    def _check_top_k(self, attribute, value):
        _positive_int("top_k", value)

    @scoring.validator
    def _check_scoring(self, attribute, value):
        if value not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {value!r}")

    @renormalize.validator
    def _check_renormalize(self, attribute, value):
        if not isinstance(value, bool):
            raise TypeError(f"renormalize must be a bool, got {value!r}")

    @topk_group.validator
    def _check_groups(self, attribute, value):
        groups = self.num_expert_group
        if (groups is None) != (value is None):
            raise ValueError(f"num_expert_group and topk_group must both be set or both be None, "
                             f"got num_expert_group={groups!r}, topk_group={value!r}")
        if groups is None:
            return
        _positive_int("num_expert_group", groups)
        _positive_int("topk_group", value)
        if value > groups:
            raise ValueError(f"topk_group must be <= num_expert_group ({groups}), got {value}")

    @routed_scaling_factor.validator
    def _check_scaling(self, attribute, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"routed_scaling_factor must be a positive finite number, got {value!r}")

    @property
    def grouped(self) -> bool:
        """Whether group selection does anything (one group keeps every expert)."""
        return self.num_expert_group is not None and self.num_expert_group > 1

    def check_experts(self, num_experts: int) -> None:
        """Raise ValueError unless this config can route over `num_experts` experts."""
        _positive_int("the number of experts", num_experts)
        if num_experts > MAX_EXPERTS:
            raise ValueError(f"the number of experts must be <= {MAX_EXPERTS}, got {num_experts}")
        if self.top_k > num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= the number of experts ({num_experts})")
        if self.num_expert_group is None:
            return
        if num_experts % self.num_expert_group:
            raise ValueError(f"num_expert_group ({self.num_expert_group}) must divide the number of experts "
                             f"({num_experts})")
        selectable = self.topk_group * (num_experts // self.num_expert_group)
        if self.top_k > selectable:
            raise ValueError(f"top_k ({self.top_k}) must be <= topk_group * experts per group ({selectable})")


def block_threads(num_experts: int) -> int:
    """Threads of the routing block: the power of two >= `num_experts` (at least 32), one
    expert per thread."""
    return max(32, 1 << (num_experts - 1).bit_length())


def _decoder(dtype_name: str):
    """Device function: one stored logit or bias element -> float32."""
    if dtype_name in ptx.HALF_TYPES:
        return ptx.half_to_f32(dtype_name)

    @ptx.device
    def decode_float32(x):
        return float32(x)

    return decode_float32


def _bias_reader(dtype_name: str | None):
    """Device function (bias, e) -> float32 correction bias (0 without one)."""
    if dtype_name is None:
        @ptx.device
        def no_bias(bias, e):
            return float32(0.0)

        return no_bias
    decode = _decoder(dtype_name)

    @ptx.device
    def read_bias(bias, e):
        return decode(bias[e])

    return read_bias


@ptx.device
def _larger(a, b):
    return max(a, b)


@ptx.device
def _plus(a, b):
    return a + b


@functools.cache
def _lane_reduction(threads: int, combine):
    """Device function (buffer, lane, e, value) -> `combine` over the values of one lane's
    `threads` threads, in tree order (so the result is deterministic); every thread of the
    block must call it (`buffer` is (lanes, threads))."""

    @ptx.device
    def lane_reduce(buffer, lane, e, value):
        buffer[lane, e] = value
        cuda.syncthreads()
        stride = threads // 2
        while stride > 0:
            if e < stride:
                buffer[lane, e] = combine(buffer[lane, e], buffer[lane, e + stride])
            cuda.syncthreads()
            stride //= 2
        result = buffer[lane, 0]
        cuda.syncthreads()
        return result

    return lane_reduce


@ptx.device
def sort_key(key, index):
    """(key, index) packed into a uint64 whose unsigned order is the selection order:
    larger key first, then lower index; NaN ranks as -inf and -0.0 as +0.0."""
    key = key + float32(0.0)
    if key != key:
        key = float32(-np.inf)
    bits = ptx.f32_bits(key)
    ordered = bits ^ (uint32(0xFFFFFFFF) if bits >> uint32(31) else uint32(0x80000000))
    return (uint64(ordered) << uint64(32)) | uint64(uint32(0xFFFFFFFF) - uint32(index))


@ptx.device
def index_of(packed):
    """The index a `sort_key` was packed with."""
    return int32(uint32(0xFFFFFFFF) - uint32(packed & uint64(0xFFFFFFFF)))


@attrs.frozen
class RouterShape:
    """How the routing of one token is split over its threads (module docstring): the
    first round's chunks, the candidate slots, and the shared memory a token takes."""

    config: RoutingConfig
    num_experts: int

    @property
    def threads(self) -> int:
        return block_threads(self.num_experts)

    @property
    def groups(self) -> int:
        return self.config.num_expert_group if self.config.grouped else 1

    @property
    def chunk(self) -> int:
        return self.num_experts // self.groups if self.config.grouped else min(self.num_experts, CHUNK)

    @property
    def chunks(self) -> int:
        return -(-self.num_experts // self.chunk)

    @property
    def per_chunk(self) -> int:
        """Candidates a chunk can hold."""
        return min(self.config.top_k, self.chunk)

    @property
    def shared_bytes(self) -> int:
        """Shared memory of one token's routing (the arrays of `make_token_router`)."""
        padded_experts, candidates = self.chunks * self.chunk, self.chunks * self.per_chunk
        return (4 * self.num_experts + 8 * padded_experts + 4 * self.threads + 8 * candidates
                + 20 * self.groups + 8 * self.config.top_k)


@functools.cache
def make_routing_kernel(config: RoutingConfig, num_experts: int, logits_dtype: str, bias_dtype: str | None):
    """Kernel (logits (M, E), bias (E,) or any stand-in, weights (M * k,) float32, ids
    (M * k,) int32), launched with one block of `block_threads(E)` threads per token."""
    route_one = make_token_router(config, num_experts, logits_dtype, bias_dtype, 1)

    @ptx.kernel(launch_bounds=block_threads(num_experts))
    def routing(logits, bias, weights_out, ids_out):
        route_one(logits, bias, weights_out, ids_out, int32(cuda.blockIdx.x))

    return routing


@functools.cache
def make_token_router(config: RoutingConfig, num_experts: int, logits_dtype: str, bias_dtype: str | None,
                      lanes: int):
    """Device function route_tokens(logits, bias, weights_out, ids_out, first): a block of
    `lanes * block_threads(E)` threads routes tokens first .. first + lanes - 1 (those
    below M) into the flat (M * k,) outputs, one token per lane of threads, side by side;
    every thread must call it."""
    config.check_experts(num_experts)
    shape = RouterShape(config, num_experts)
    experts, top_k, threads = num_experts, config.top_k, shape.threads
    grouped, has_bias = config.grouped, bias_dtype is not None
    groups, chunk, chunks, per_chunk = shape.groups, shape.chunk, shape.chunks, shape.per_chunk
    topk_group = config.topk_group if grouped else 1
    padded_experts = chunks * chunk  # a partial last chunk is padded with (-inf, index >= E)
    candidate_slots = chunks * per_chunk
    chunk_u, per_chunk_u, threads_u = np.uint32(chunk), np.uint32(per_chunk), np.uint32(threads)
    softmax = config.scoring == "softmax"
    normalized_softmax = softmax and (has_bias or not config.renormalize)  # needs the denominator
    renormalize, scale = config.renormalize, float32(config.routed_scaling_factor)
    pair_group_score = has_bias and chunk > 1
    decode_logit, read_bias = _decoder(logits_dtype), _bias_reader(bias_dtype)
    lane_max, lane_sum = _lane_reduction(threads, _larger), _lane_reduction(threads, _plus)
    neg_inf = float32(-np.inf)

    @ptx.device
    def route_tokens(logits, bias, weights_out, ids_out, first):
        logit = cuda.shared.array((lanes, experts), float32)
        expert_key = cuda.shared.array((lanes, padded_experts), uint64)
        reduce_buffer = cuda.shared.array((lanes, threads), float32)
        candidate = cuda.shared.array((lanes, candidate_slots), uint64)
        group_top = cuda.shared.array((lanes, groups, 2), float32)
        group_key = cuda.shared.array((lanes, groups), uint64)
        group_kept = cuda.shared.array((lanes, groups), int32)
        chosen = cuda.shared.array((lanes, top_k), int32)
        chosen_weight = cuda.shared.array((lanes, top_k), float32)
        tid = uint32(cuda.threadIdx.x)
        lane, e = tid // threads_u, tid % threads_u  # thread e of the lane owns expert e
        tokens = logits.shape[0]
        token = first + int32(lane)
        row = min(token, tokens - 1)  # a lane past the last token repeats it and writes nothing

        # Score and selection key of this thread's expert.
        x = neg_inf
        if e < experts:
            x = decode_logit(logits[row, e])
            logit[lane, e] = x
        shift, inv_total = float32(0.0), float32(1.0)
        if normalized_softmax:
            shift = lane_max(reduce_buffer, lane, e, x)
            inv_total = float32(1.0) / lane_sum(reduce_buffer, lane, e,
                                                math.exp(x - shift) if e < experts else float32(0.0))
        key = x
        if has_bias and e < experts:
            if softmax:
                key = math.exp(x - shift) * inv_total + read_bias(bias, e)
            else:
                key = float32(1.0) / (float32(1.0) + math.exp(-x)) + read_bias(bias, e)
        if e < padded_experts:
            expert_key[lane, e] = sort_key(key, e)
        cuda.syncthreads()

        # Round 1: rank within the chunk -> sorted candidate slots (and group tops).
        if e < padded_experts:
            mine = expert_key[lane, e]
            c = e // chunk_u
            first_expert = c * chunk_u
            rank = uint32(0)
            for j in range(chunk):
                rank += uint32(expert_key[lane, first_expert + uint32(j)] > mine)
            if rank < per_chunk:
                candidate[lane, c * per_chunk_u + rank] = mine
            if grouped and rank < 2:
                group_top[lane, c, rank] = key
        cuda.syncthreads()

        # Round 2: keep the best `topk_group` groups.
        if grouped:
            if e < groups:
                score = group_top[lane, e, 0]
                if pair_group_score:
                    score += group_top[lane, e, 1]
                group_key[lane, e] = sort_key(score, e)
            cuda.syncthreads()
            if e < groups:
                mine = group_key[lane, e]
                rank = uint32(0)
                for h in range(groups):
                    rank += uint32(group_key[lane, h] > mine)
                group_kept[lane, e] = 1 if rank < topk_group else 0
            cuda.syncthreads()

        # Round 3: rank among the candidates of kept groups -> output column.
        if e < candidate_slots and (not grouped or group_kept[lane, e // per_chunk_u] != 0):
            mine = candidate[lane, e]
            rank = uint32(0)
            for other in range(chunks):
                if grouped and group_kept[lane, other] == 0:
                    continue
                for s in range(per_chunk):
                    rank += uint32(candidate[lane, other * per_chunk + s] > mine)
            if rank < top_k:
                chosen[lane, rank] = index_of(mine)
        cuda.syncthreads()

        # Weights: the unbiased scores, renormalized, scaled.
        if e < top_k:
            x = logit[lane, chosen[lane, e]]
            if not softmax:
                w = float32(1.0) / (float32(1.0) + math.exp(-x))
            elif normalized_softmax:
                w = math.exp(x - shift) * inv_total
            else:
                w = math.exp(x - logit[lane, chosen[lane, 0]])  # renormalized below: the denominator cancels
            chosen_weight[lane, e] = w
        if renormalize:
            cuda.syncthreads()
        if e < top_k and token < tokens:
            w = chosen_weight[lane, e]
            if renormalize:
                total = float32(0.0)
                for j in range(top_k):
                    total += chosen_weight[lane, j]
                w = w / total
            weights_out[token * top_k + e] = w * scale
            ids_out[token * top_k + e] = chosen[lane, e]
        cuda.syncthreads()  # the shared arrays are reused by the block's next tokens

    return route_tokens


def _dtype_name(dtype: torch.dtype) -> str:
    return interop.HALF_NAMES.get(dtype, "float32")


@attrs.frozen(eq=False)
class RoutingCall:
    """A checked routing call: tensors and the kernel arrays of the routing launch."""

    config: RoutingConfig
    logits: torch.Tensor
    bias: torch.Tensor | None
    weights: torch.Tensor
    ids: torch.Tensor

    def kernel_key(self) -> tuple:
        """(config, experts, logits dtype name, bias dtype name or None): what the routing
        code is generated from (`make_routing_kernel`, `make_token_router`)."""
        return (self.config, self.logits.shape[1], _dtype_name(self.logits.dtype),
                None if self.bias is None else _dtype_name(self.bias.dtype))

    def kernel_arrays(self) -> tuple:
        """(logits, bias, flat weights, flat ids) as the kernel takes them (logits stand in
        for no bias)."""
        logits = interop.to_kernel(self.logits)
        bias = logits if self.bias is None else interop.to_kernel(self.bias)  # a stand-in is never read
        return logits, bias, interop.to_kernel(self.weights.view(-1)), interop.to_kernel(self.ids.view(-1))


def check_routing(router_logits, config: RoutingConfig, *, correction_bias=None, out=None) -> RoutingCall:
    """Validate `route`'s arguments (allocating outputs unless `out` is given)."""
    if not isinstance(config, RoutingConfig):
        raise TypeError(f"config must be a RoutingConfig, got {type(config).__name__}")
    logits = interop.check_tensor("router_logits", router_logits, dtype=LOGIT_DTYPES, ndim=2)
    tokens, experts = logits.shape
    config.check_experts(experts)
    if experts > MAX_EXPERTS:
        raise ValueError(f"router_logits must have at most {MAX_EXPERTS} experts (columns), got {experts}")
    bias = None
    if correction_bias is not None:
        bias = interop.check_tensor("correction_bias", correction_bias, dtype=LOGIT_DTYPES, shape=(experts,))
    shape = (tokens, config.top_k)
    if out is None:
        weights, ids = interop.empty(shape, torch.float32), interop.empty(shape, torch.int32)
    else:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(f"out must be a (topk_weights, topk_ids) pair, got {type(out).__name__}")
        weights = interop.check_tensor("out[0] (topk_weights)", out[0], dtype=torch.float32, shape=shape)
        ids = interop.check_tensor("out[1] (topk_ids)", out[1], dtype=torch.int32, shape=shape)
        interop.check_disjoint({"out[0] (topk_weights)": weights, "out[1] (topk_ids)": ids})
    return RoutingCall(config, logits, bias, weights, ids)


def route(router_logits, config: RoutingConfig, *, correction_bias=None, out=None):
    """Top-k experts of each token: (topk_weights float32 (M, k), topk_ids int32 (M, k)).

    router_logits: (M, E) float32, bfloat16 or float16; correction_bias: optional (E,) of the
    same dtypes (DeepSeek-V3 `e_score_correction_bias`); out: an optional preallocated
    (weights, ids) pair of exactly those shapes, filled and returned (nothing is allocated).
    One launch on torch's current stream, no host synchronisation."""
    call = check_routing(router_logits, config, correction_bias=correction_bias, out=out)
    tokens, experts = call.logits.shape
    if tokens:
        launch_kernel(make_routing_kernel(*call.kernel_key()), tokens, block_threads(experts), *call.kernel_arrays())
    return call.weights, call.ids


def reference_route(logits, config: RoutingConfig, correction_bias=None):
    """float64 numpy reference of `route`: (weights float64 (M, k), ids int32 (M, k)), with
    the same keys and tie rule (lower index first, columns in selection order)."""
    logits = np.asarray(logits, np.float64)
    if logits.ndim != 2:
        raise ValueError(f"logits must have 2 dimensions, got shape {logits.shape}")
    tokens, experts = logits.shape
    config.check_experts(experts)
    if config.scoring == "softmax":
        exp = np.exp(logits - logits.max(axis=1, keepdims=True))
        scores = exp / exp.sum(axis=1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
    keys = logits if correction_bias is None else scores + np.asarray(correction_bias, np.float64)
    keys = np.where(np.isnan(keys), -np.inf, keys)
    index = np.arange(experts)
    ids = np.empty((tokens, config.top_k), np.int32)
    for t in range(tokens):
        allowed = np.ones(experts, bool)
        if config.grouped:
            groups = config.num_expert_group
            grouped_keys = -np.sort(-keys[t].reshape(groups, -1), axis=1)  # descending per group
            pair = correction_bias is not None and grouped_keys.shape[1] > 1
            group_scores = grouped_keys[:, 0] + grouped_keys[:, 1] if pair else grouped_keys[:, 0]
            group_scores = np.where(np.isnan(group_scores), -np.inf, group_scores)
            kept = np.lexsort((np.arange(groups), -group_scores))[:config.topk_group]
            allowed = np.isin(index // (experts // groups), kept)
        candidates = index[allowed]
        order = np.lexsort((candidates, -keys[t, candidates]))
        ids[t] = candidates[order[:config.top_k]]
    weights = np.take_along_axis(scores, ids.astype(np.int64), axis=1)
    if config.renormalize:
        weights = weights / weights.sum(axis=1, keepdims=True)
    return weights * config.routed_scaling_factor, ids
