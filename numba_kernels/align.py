"""Token alignment (vLLM/SGLang `moe_align_block_size`): sort the (token, slot) pairs by
expert and pad each expert's run to a multiple of the GEMM's block size, so that every
block of `block_size` rows belongs to one expert.

Outputs, all int32, for topk_ids (M, k) with N = M * k slots (slot id = token * k + slot):

    sorted_token_ids        (L,)       each expert's slot ids (experts ascending, ids
                                       ascending inside an expert), then N (the sentinel)
                                       up to the next multiple of block_size; N after the end
    expert_ids              (ceil(L / block_size),)   the expert of each block; -1 after them
    num_tokens_post_padded  (1,)       the padded total

L = `align_sizes(N, E, block_size)[0]` bounds the padded total whatever the ids (vLLM's
buffer size). Slots of invalid ids (outside [0, E)) and, with `ignore_invalid_experts`, of
experts the expert map marks -1 are dropped. The output is fully deterministic: unlike
vLLM's atomics-based kernel, the order inside an expert is the slot order (= the torch
reference), so every run of a batch gives the same bytes.

Algorithm: a stable counting sort in one launch with no scratch memory. The N slots are
cut into P contiguous tiles of about 1024, one block each (decode is a single block; at
most 64 blocks, so N = 65536 uses 64). Each block

1. counts all N slots per expert with shared-memory atomics (exact, so deterministic), and
   separately those before its tile. Every block therefore computes the same expert
   offsets (padded sizes, scanned in chunks of 32 experts) and no grid-wide sync or
   second launch is needed;
2. writes its grid-stride share of `expert_ids` (a thread per output block finds its
   expert by binary search over the offsets) and of the sentinels: a single block fills
   the whole buffer with coalesced stores and lets step 3 overwrite the slots after a
   barrier; with several blocks a warp per expert fills its padding, and the tail;
3. places its tile T slots at a time (T = threads). Rows of 32 slots: each slot counts the
   earlier slots of its expert in its row (its rank), the last of them stores the row's
   count in a (T/32, E) shared matrix, and one thread per expert turns its column into
   running write positions. Slot i goes to position[row, expert] + rank.

Work: per block N / T counting steps (the redundant count reads the ids P times, at most
64 x 256 KiB from L2 for N = 65536, in parallel over the blocks), 32 compares + T/32
steps per T placed slots, 4 barriers per T slots; loops have constant trip counts and
unsigned shared-memory indices so they unroll without wraparound code. Memory traffic:
the ids are read P + 1 times, the outputs written once (a single block writes the slots'
positions twice). Shared memory: 2 E' + 3 E + T ints (E' = E rounded up to 32) and the
(T/32, E) matrix, under 48 KiB by the choice of T (1024 for E <= 256, 544 for E = 512).
Measured on an H200, back-to-back launches (about 2 us of which is the launch itself),
E = 256, k = 8: 4.9 us at M = 1, 5.3 us at M = 8, 7.5 us at M = 64, 18 us at M = 4096,
24 us at M = 8192 (torch's stable sort alone of the same ids: 11 to 51 us).

The fused decode routing (`route_align`) aligns with `make_routed_aligner` instead: its
ids come from its own router, distinct within a token, which a bit mask of tokens per
expert turns into counts and ranks with three barriers and no pass over the slots.
"""

from __future__ import annotations

import functools

import attrs
import numpy as np
import torch
from numba import cuda, int32, uint32

from . import interop, ptx
from .launch import launch_kernel

SLOTS_PER_BLOCK = 1024
"""Slots one block places; more slots spread over more blocks (up to MAX_BLOCKS)."""
MAX_BLOCKS = 64
MAX_EXPERTS = 1024
ROW = 32
"""Slots whose ranks are found by direct comparison (one row of the rank matrix)."""
SCAN_CHUNK = 32
SHARED_INTS = 12000
"""Static shared-memory budget in int32s (under the 48 KiB static limit)."""
MAP_MODES = ("none", "drop", "map")
"""No expert map; drop non-local experts before counting; map expert ids after aligning."""


def align_sizes(num_slots: int, num_experts: int, block_size: int) -> tuple[int, int]:
    """(max_num_tokens_padded, max_num_blocks) as vLLM sizes them: num_slots + E * (bs - 1),
    or num_slots * bs when num_slots < E; blocks = ceil(that / bs)."""
    interop.check_count("num_slots", num_slots, 0)
    interop.check_count("num_experts", num_experts, 1)
    interop.check_count("block_size", block_size, 1)
    padded = num_slots + num_experts * (block_size - 1)
    if num_slots < num_experts:
        padded = num_slots * block_size
    return padded, -(-padded // block_size)


def launch_shape(num_slots: int, num_experts: int) -> tuple[int, int]:
    """(blocks, threads) for `num_slots` slots over `num_experts` experts."""
    blocks = min(MAX_BLOCKS, max(1, -(-num_slots // SLOTS_PER_BLOCK)))
    per_block = -(-num_slots // blocks)
    wanted = 1 << (max(num_experts, per_block, 1) - 1).bit_length()
    return blocks, min(max_threads(num_experts), max(64, wanted))


def max_threads(num_experts: int) -> int:
    """The most threads (a multiple of 32, <= 1024) whose shared arrays fit SHARED_INTS:
    2 E' + 3 E + 1 + T + (T / 32) E ints (E' = E rounded up to 32)."""
    fixed = 2 * -(-num_experts // SCAN_CHUNK) * SCAN_CHUNK + 3 * num_experts + 1
    return min(1024, (SHARED_INTS - fixed) // (ROW + num_experts) * ROW)


@functools.cache
def make_align_kernel(num_experts: int, block_size: int, threads: int, map_mode: str):
    """Kernel (topk_ids (N,), expert_map (E,) or any int32 stand-in, sorted_token_ids,
    expert_ids, num_tokens_post_padded, padded_len, block_count), launched with
    `launch_shape(N, E)`; `map_mode` is one of MAP_MODES."""
    align_tile = make_tile_aligner(num_experts, block_size, threads, map_mode)

    @ptx.kernel(launch_bounds=threads)
    def align(topk_ids, expert_map, sorted_ids, expert_ids, num_post, padded_len, block_count):
        align_tile(topk_ids, expert_map, sorted_ids, expert_ids, num_post, padded_len, block_count,
                   int32(cuda.blockIdx.x), int32(cuda.gridDim.x))

    return align


@functools.cache
def make_tile_aligner(num_experts: int, block_size: int, threads: int, map_mode: str):
    """Device function align_tile(topk_ids, expert_map, sorted_ids, expert_ids, num_post,
    padded_len, block_count, block, blocks): block `block` of `blocks` (of `threads` threads)
    does its part of the alignment (all of it when blocks = 1); every thread must call it."""
    if map_mode not in MAP_MODES:
        raise ValueError(f"map_mode must be one of {MAP_MODES}, got {map_mode!r}")
    if threads % ROW or not ROW <= threads <= max_threads(num_experts):
        raise ValueError(f"threads must be a multiple of {ROW} in [{ROW}, {max_threads(num_experts)}] for "
                         f"{num_experts} experts, got {threads}")
    experts, rows, warps = num_experts, threads // ROW, threads // 32
    scan_chunks = -(-experts // SCAN_CHUNK)
    scan_len, offsets_len = scan_chunks * SCAN_CHUNK, experts + 1
    matrix_shape, matrix_len = (rows, experts), rows * experts
    drop_nonlocal, mapped = map_mode == "drop", map_mode != "none"
    u = np.uint32  # unsigned indices: no negative-index wraparound code
    chunk_start_mask = u(0xFFFFFFFF ^ (SCAN_CHUNK - 1))

    @ptx.device
    def expert_of(topk_ids, expert_map, i):
        """The expert slot i counts for, or -1 (invalid id, or dropped non-local expert)."""
        x = int32(topk_ids[i])
        if x < 0 or x >= experts:
            return int32(-1)
        if drop_nonlocal and expert_map[u(x)] < 0:
            return int32(-1)
        return x

    @ptx.device
    def padded(count):
        return int32(u(count + (block_size - 1)) // u(block_size) * u(block_size))

    @ptx.device
    def align_tile(topk_ids, expert_map, sorted_ids, expert_ids, num_post, padded_len, block_count, block, blocks):
        count = cuda.shared.array(scan_len, int32)
        size = cuda.shared.array(scan_len, int32)  # padded count
        inclusive = cuda.shared.array(experts, int32)  # inclusive prefix of sizes in a scan chunk
        cursor = cuda.shared.array(experts, int32)  # slots before the tile, then next position
        offset = cuda.shared.array(offsets_len, int32)
        slot_expert = cuda.shared.array(threads, int32)
        position = cuda.shared.array(matrix_shape, int32)  # row counts, then write positions
        n = int32(topk_ids.shape[0])
        tid = u(cuda.threadIdx.x)
        tile = (n + blocks - 1) // blocks
        start = block * tile
        stop = min(n, start + tile)

        # 1. Count every slot per expert, and the slots before this block's tile.
        for x in range(tid, scan_len, threads):
            count[x] = 0
        for x in range(tid, experts, threads):
            cursor[x] = 0
        cuda.syncthreads()
        for i in range(int32(tid), n, threads):
            x = expert_of(topk_ids, expert_map, i)
            if x >= 0:
                cuda.atomic.add(count, x, 1)
                if i < start:
                    cuda.atomic.add(cursor, x, 1)
        cuda.syncthreads()
        for x in range(tid, scan_len, threads):
            size[x] = padded(count[x])
        cuda.syncthreads()
        for x in range(tid, experts, threads):
            first, s = u(x) & chunk_start_mask, int32(0)
            for j in range(SCAN_CHUNK):
                s += size[first + u(j)] if first + u(j) <= u(x) else int32(0)
            inclusive[x] = s
        cuda.syncthreads()
        for x in range(tid, experts, threads):
            s, before = inclusive[x] - size[x], u(x) // u(SCAN_CHUNK)
            for c in range(scan_chunks - 1):
                s += inclusive[c * SCAN_CHUNK + SCAN_CHUNK - 1] if u(c) < before else int32(0)
            offset[x] = s
            cursor[x] += s
            if x == experts - 1:
                offset[experts] = s + size[x]
        cuda.syncthreads()

        # 2. Spread over the grid: the expert of each valid block (one thread each, binary
        #    search over the offsets) and -1 after them; the sentinels. One block fills
        #    all positions (coalesced; step 3 overwrites the slots' after barriers);
        #    several fill each expert's padding (one warp per expert) and the tail.
        total = offset[experts]
        valid_blocks = total // block_size
        thread, grid = block * threads + int32(tid), blocks * threads
        for q in range(thread, valid_blocks, grid):
            first = q * block_size
            low, high = u(0), u(experts - 1)  # the last expert whose region starts at or before `first`
            while low < high:
                mid = (low + high + u(1)) // u(2)
                if offset[mid] <= first:
                    low = mid
                else:
                    high = mid - u(1)
            expert_ids[q] = expert_map[low] if mapped else int32(low)
        for q in range(valid_blocks + thread, block_count, grid):
            expert_ids[q] = -1
        if blocks == 1:
            for p in range(thread, padded_len, grid):
                sorted_ids[p] = n
        else:
            lane = int32(tid % u(32))
            for x in range(block * warps + int32(tid // u(32)), experts, blocks * warps):
                for p in range(offset[x] + count[x] + lane, offset[x + 1], 32):
                    sorted_ids[p] = n
            for p in range(total + thread, padded_len, grid):
                sorted_ids[p] = n
        if thread == 0:
            num_post[0] = total

        # 3. Place the tile, `threads` slots at a time, in slot order within each expert.
        row = tid // u(ROW)
        for base in range(start, stop, threads):
            i = base + int32(tid)
            x = expert_of(topk_ids, expert_map, i) if i < stop else int32(-1)
            slot_expert[tid] = x
            for entry in range(tid, matrix_len, threads):
                position[u(entry) // u(experts), u(entry) % u(experts)] = 0
            cuda.syncthreads()
            rank = int32(0)
            if x >= 0:
                later = int32(0)
                for j in range(ROW):
                    other = row * u(ROW) + u(j)
                    same = slot_expert[other] == x
                    rank += int32(same & (other < tid))
                    later += int32(same & (other > tid))
                if later == 0:
                    position[row, u(x)] = rank + 1
            cuda.syncthreads()
            for y in range(tid, experts, threads):
                running = cursor[y]
                for r in range(rows):
                    c = position[r, y]
                    position[r, y] = running
                    running += c
                cursor[y] = running
            cuda.syncthreads()
            if x >= 0:
                sorted_ids[position[row, u(x)] + rank] = i
            cuda.syncthreads()

    return align_tile


ROUTED_TOKENS = 32
"""Tokens `make_routed_aligner` takes: a bit per token in a uint32 per expert."""


@functools.cache
def make_routed_aligner(num_experts: int, block_size: int, top_k: int, threads: int, map_mode: str):
    """Device function align_routed(slot_ids, n, expert_map, sorted_ids, expert_ids,
    num_post, padded_len, block_count): a block of `threads` >= E threads aligns the
    n = M * top_k slots of at most ROUTED_TOKENS tokens whose ids, *distinct within each
    token* (a router's top-k), are in `slot_ids`; the outputs of `make_tile_aligner`. Every
    thread must call it; `map_mode` is "none" or "map".

    The decode case. Distinct ids make an expert's slots one per token, so a bit mask of
    tokens per expert (set with shared atomics) gives everything: its count (popc), and a
    slot's rank among its expert's slots (popc of the bits of earlier tokens). The offsets
    are the padded counts scanned in chunks of 32 experts as in `make_tile_aligner`. Three
    barriers, no loop over the slots."""
    if map_mode not in ("none", "map"):
        raise ValueError(f"map_mode must be 'none' or 'map', got {map_mode!r}")
    if threads < num_experts:
        raise ValueError(f"threads must be >= the number of experts ({num_experts}), got {threads}")
    experts, mapped, u = num_experts, map_mode == "map", np.uint32
    scan_chunks = -(-experts // SCAN_CHUNK)
    chunk_start_mask = u(0xFFFFFFFF ^ (SCAN_CHUNK - 1))

    @ptx.device
    def padded_count(tokens):
        return int32(u(cuda.popc(tokens) + (block_size - 1)) // u(block_size) * u(block_size))

    @ptx.device
    def offset_of(inclusive, token_mask, e):
        """Where expert e's region starts: the padded counts of the experts before it."""
        s, before = inclusive[e] - padded_count(token_mask[e]), e // u(SCAN_CHUNK)
        for c in range(scan_chunks - 1):
            s += inclusive[c * SCAN_CHUNK + SCAN_CHUNK - 1] if u(c) < before else int32(0)
        return s

    @ptx.device
    def fill(array, first, end, step, value):
        """array[i] = value for i = first, first + step, ... below end, counted in 32 bits:
        Numba's range loops carry a 64-bit count and index through every iteration."""
        i, stop = u(first), u(end)
        while i < stop:
            array[i] = value
            i = u(i + u(step))

    @ptx.device
    def align_routed(slot_ids, n, expert_map, sorted_ids, expert_ids, num_post, padded_len, block_count):
        token_mask = cuda.shared.array(experts, uint32)  # bit t: token t chose the expert
        inclusive = cuda.shared.array(experts, int32)  # inclusive prefix of padded counts in a scan chunk
        tid = u(cuda.threadIdx.x)
        if tid < experts:
            token_mask[tid] = u(0)
        cuda.syncthreads()
        x, token = int32(-1), tid // u(top_k)
        if tid < n:
            x = int32(slot_ids[tid])
            if x < 0 or x >= experts:
                x = int32(-1)
            else:
                cuda.atomic.or_(token_mask, x, u(1) << token)
        cuda.syncthreads()
        if tid < experts:
            first, s = tid & chunk_start_mask, int32(0)
            for j in range(SCAN_CHUNK):
                e = first + u(j)
                s += padded_count(token_mask[e]) if e <= tid else int32(0)
            inclusive[tid] = s
        cuda.syncthreads()
        if x >= 0:
            earlier = token_mask[x] & ((u(1) << token) - u(1))
            sorted_ids[u(offset_of(inclusive, token_mask, u(x)) + cuda.popc(earlier))] = int32(tid)
        total = int32(0)
        for c in range(scan_chunks):
            total += inclusive[min(c * SCAN_CHUNK + SCAN_CHUNK - 1, experts - 1)]
        if tid < experts:  # the expert's blocks and its padding
            start, count = offset_of(inclusive, token_mask, tid), cuda.popc(token_mask[tid])
            size = padded_count(token_mask[tid])
            fill(expert_ids, u(start) // u(block_size), u(start + size) // u(block_size), 1,
                 expert_map[tid] if mapped else int32(tid))
            fill(sorted_ids, start + count, start + size, 1, n)
        fill(expert_ids, u(total) // u(block_size) + tid, block_count, threads, -1)
        fill(sorted_ids, u(total) + tid, padded_len, threads, n)
        if tid == 0:
            num_post[0] = total

    return align_routed


def check_out_triple(out, lengths) -> list[torch.Tensor]:
    """The prefixes of a preallocated (sorted_token_ids, expert_ids, num_tokens_post_padded)
    of `lengths`, after checking each and that they do not share memory."""
    if not (isinstance(out, (tuple, list)) and len(out) == 3):
        raise TypeError(f"out must be a (sorted_token_ids, expert_ids, num_tokens_post_padded) triple, "
                        f"got {type(out).__name__}")
    names = ("out[0] (sorted_token_ids)", "out[1] (expert_ids)", "out[2] (num_tokens_post_padded)")
    views = []
    for name, tensor, length in zip(names, out, lengths):
        tensor = interop.check_tensor(name, tensor, dtype=torch.int32, ndim=1)
        if tensor.shape[0] < length:
            raise ValueError(f"{name} must hold at least {length} elements, got {tensor.shape[0]}")
        views.append(tensor[:length])
    interop.check_disjoint(dict(zip(names, views)))
    return views


def _check_id_values(ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int) -> None:
    """Validate id values (two reductions and a host sync: not for the hot path)."""
    interop.check_range("topk_ids", ids, 0, num_experts, " (pass check_ids=False to drop invalid ids instead)")
    if expert_map is not None:
        check_expert_map(expert_map, num_experts)


def check_expert_map(expert_map: torch.Tensor, num_experts: int) -> None:
    """Raise unless every entry is a local id in [0, num_experts) or -1 (a host sync)."""
    interop.check_range("expert_map", expert_map, -1, num_experts, " (local ids, -1: an expert of another rank)")


def check_alignment_arrays(sorted_token_ids, expert_ids, num_tokens_post_padded, block_m: int) -> tuple:
    """The three arrays of an alignment for blocks of `block_m` slots, checked (int32,
    1-D; num_tokens_post_padded one element; a block id for each block of slots)."""
    sorted_token_ids = interop.check_tensor("sorted_token_ids", sorted_token_ids, dtype=torch.int32, ndim=1)
    expert_ids = interop.check_tensor("expert_ids", expert_ids, dtype=torch.int32, ndim=1)
    num_tokens_post_padded = interop.check_tensor("num_tokens_post_padded", num_tokens_post_padded,
                                                  dtype=torch.int32, shape=(1,))
    if expert_ids.shape[0] != -(-sorted_token_ids.shape[0] // block_m):
        raise ValueError(f"expert_ids ({expert_ids.shape[0]} blocks) must split sorted_token_ids "
                         f"({sorted_token_ids.shape[0]}) in blocks of block_m = {block_m}: align with block_size "
                         "= block_m")
    return sorted_token_ids, expert_ids, num_tokens_post_padded


def check_alignment_ids(sorted_token_ids, expert_ids, num_tokens_post_padded, block_m: int,
                        experts: int | None) -> None:
    """Raise unless the blocks in use (the first num_tokens_post_padded slots, a host sync)
    name slots at or above 0 and experts in [-1, experts) (None: at least -1), as a kernel
    that reads an alignment indexes with them; past them the arrays may hold anything (a
    workspace's stale entries), which such a kernel never reads."""
    used = min(max(int(num_tokens_post_padded[0]), 0), sorted_token_ids.shape[0])
    interop.check_range("sorted_token_ids (the blocks in use)", sorted_token_ids[:used], 0)
    interop.check_range("expert_ids (the blocks in use)", expert_ids[:-(-used // block_m)], -1, experts)


@attrs.frozen(eq=False)
class AlignCall:
    """A checked alignment call: ids, optional expert map, the output views and the sizes."""

    ids: torch.Tensor
    expert_map: torch.Tensor | None
    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_post: torch.Tensor
    map_mode: str

    def kernel_arguments(self) -> tuple:
        """The aligner's arguments: flat topk_ids, expert_map (or a stand-in), the outputs,
        padded_len and block_count."""
        emap = self.expert_map
        if emap is None:  # a stand-in, never read; not the ids (the simulator copies each argument back)
            emap = interop.stand_in(0, torch.int32, self.ids.device)
        arrays = (self.ids.view(-1), emap, self.sorted_ids, self.expert_ids, self.num_post)
        return (*map(interop.to_kernel, arrays), self.sorted_ids.shape[0], self.expert_ids.shape[0])


def check_alignment(topk_ids, block_size: int, num_experts: int, *, expert_map=None,
                    ignore_invalid_experts: bool = False, out=None, check_ids: bool = True) -> AlignCall:
    """Validate `moe_align_block_size`'s arguments (allocating outputs unless `out` is given)."""
    interop.check_count("block_size", block_size, 1)
    interop.check_count("num_experts", num_experts, 1, MAX_EXPERTS)
    if not isinstance(ignore_invalid_experts, bool):
        raise TypeError(f"ignore_invalid_experts must be a bool, got {ignore_invalid_experts!r}")
    ids = interop.check_tensor("topk_ids", topk_ids, dtype=torch.int32, ndim=2)
    emap = None
    if expert_map is not None:
        emap = interop.check_tensor("expert_map", expert_map, dtype=torch.int32, shape=(num_experts,))
    padded_len, block_count = align_sizes(ids.numel(), num_experts, block_size)
    if out is None:
        sorted_ids, expert_ids, num_post = (interop.empty((length,), torch.int32)
                                            for length in (padded_len, block_count, 1))
    else:
        sorted_ids, expert_ids, num_post = check_out_triple(out, (padded_len, block_count, 1))
    if check_ids:
        _check_id_values(ids, emap, num_experts)
    map_mode = "none" if emap is None else ("drop" if ignore_invalid_experts else "map")
    return AlignCall(ids, emap, sorted_ids, expert_ids, num_post, map_mode)


def moe_align_block_size(topk_ids, block_size: int, num_experts: int, *, expert_map=None,
                         ignore_invalid_experts: bool = False, out=None, check_ids: bool = True):
    """(sorted_token_ids, expert_ids, num_tokens_post_padded), int32 (module docstring).

    topk_ids: (M, k) int32. expert_map: optional (E,) int32, global -> local expert id, -1
    for experts on other ranks; `ignore_invalid_experts=True` drops those experts' slots
    before counting (expert_ids are local ids), False aligns every expert and maps the
    expert ids afterwards (blocks of non-local experts carry -1). out: optional
    preallocated triple, each at least as long as required (`align_sizes`); the required
    prefixes are filled and returned as views (nothing is allocated). check_ids validates
    the id values with torch reductions, a host sync: the hot path passes False, and the
    kernel then drops invalid ids rather than writing out of bounds."""
    call = check_alignment(topk_ids, block_size, num_experts, expert_map=expert_map,
                           ignore_invalid_experts=ignore_invalid_experts, out=out, check_ids=check_ids)
    numel = call.ids.numel()
    if numel == 0:
        call.num_post.zero_()
    else:
        blocks, threads = launch_shape(numel, num_experts)
        kernel = make_align_kernel(num_experts, block_size, threads, call.map_mode)
        launch_kernel(kernel, blocks, threads, *call.kernel_arguments())
    return call.sorted_ids, call.expert_ids, call.num_post


def reference_align(topk_ids, block_size: int, num_experts: int, expert_map=None,
                    ignore_invalid_experts: bool = False):
    """numpy reference of `moe_align_block_size` (same outputs, tails and dropped ids)."""
    ids = np.asarray(topk_ids).reshape(-1).astype(np.int64)
    numel = ids.size
    padded_len, block_count = align_sizes(numel, num_experts, block_size)
    sorted_ids = np.full(padded_len, numel, np.int32)
    expert_ids = np.full(block_count, -1, np.int32)
    valid = (ids >= 0) & (ids < num_experts)
    emap = None if expert_map is None else np.asarray(expert_map).astype(np.int64)
    if emap is not None and ignore_invalid_experts:
        valid &= emap[np.clip(ids, 0, num_experts - 1)] >= 0
    position = 0
    for expert in range(num_experts):
        slots = np.flatnonzero(valid & (ids == expert))
        if slots.size == 0:
            continue
        blocks = -(-slots.size // block_size)
        sorted_ids[position:position + slots.size] = slots
        expert_ids[position // block_size:position // block_size + blocks] = expert if emap is None else emap[expert]
        position += blocks * block_size
    return sorted_ids, expert_ids, np.array([position], np.int32)
