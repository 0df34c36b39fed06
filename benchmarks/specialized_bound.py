"""What a warp-specialised prefill GEMM could reach at Mixtral's M = 256, on the GPU:

    python3 benchmarks/specialized_bound.py [--variants 2:3 4:3 4:3:act ...]

At 64 slots an expert the prefill tiles are latency-bound (Nsight Compute, fifty-fifth
session of `benchmarks/LOG.md`): each warp decodes its weights and then feeds them to
`mma.sync`, and the whole CTA waits at a barrier a slab. The thirty-eighth session's
warpgroup tile (weights decoded into shared memory, multiplied by Hopper's wgmma) lost
for the same reason, and named the way out: warp specialisation. This script builds its
skeleton and times it beside the layer's own two GEMMs (sixty-sixth session):

* a CTA computes 64 x `tiles` output features of one expert for all of its `slots`
  slots (one wgmma m64nNk16 per 64 features and 16 of K, N = slots);
* 64 x `tiles` *producer* threads (warps 4 on, a feature each) copy a stage of weight
  codes and activations into shared memory (`cp.async`, a ring `stages` deep), then
  decode their own codes (int4, a scale per 128 of K, zero point 8, as
  `formats.native`) into the stage's A tiles: 8 of K a word, one 16-byte store a word
  into wgmma's core matrices;
* warps 0 to 3, the *consumer* warpgroup, multiply each decoded stage by its
  activations (wgmma, both operands in shared memory) and hand the stage back;
* the two sides meet on named barriers (`ptx.barrier_sync`, `ptx.barrier_arrive`), a
  pair per stage, never on a barrier of the whole CTA;
* or, in a `bulk` variant (sixty-seventh session), one producer thread copies a stage's
  activations in one bulk copy (`ptx.bulk_copy`, from activations stored stage by stage
  in the order the stage holds them) counted on an mbarrier the consumers wait for: no
  copy instructions or addresses in every producer thread, and the decode never waits
  for the activations to land.

Its layout is its own (a stage's codes contiguous, the activations as `slots` rows per
expert): an upper bound on what the design gains, not a kernel the layer runs. Every
expert gets exactly `slots` slots (no padding, no routing) and no epilogue beyond
float32 stores. It checks its output against torch before it times. A variant may leave
one part out (timing only, wrong results): the decode, the proxy fence, the wgmma or the
activations' copies, which says where the skeleton's time goes.
"""

from __future__ import annotations

import argparse
import functools

import torch

import numba_kernels  # noqa: F401  (before numba: no simulator on a GPU machine)
from numba import cuda, float32, uint32
from numba_kernels import interop, ptx
from numba_kernels.gemm_plan import chain
from numba_kernels.launch import launch_kernel

STEP_K = 64  # K a pipeline stage: four k16 wgmma for each m64 tile
GROUP = 128  # K a scale
TILE_WORDS = 512  # a decoded 64 x 16 tile of weights (one wgmma's A)
LEFT_OUT = ("", "decode", "fence", "mma", "act")  # what a timing-only variant leaves out ("act": activation copies)
BULK = "bulk"  # a variant's word for the activations' bulk copies
CORE_LBO, CORE_SBO = 128, 256  # bytes: the next 8 of K, the next 8 rows (features or slots)
MAGIC, ONE, MINUS_136, MINUS_ZERO = 0x43004300, 0x3F803F80, 0xC308C308, 0x80008000  # bfloat16 pairs


def stage_words(slots: int, tiles: int) -> int:
    """Words of one stage: decoded weights (`tiles` m64 tiles for each of four k16
    steps), activations (four k16 tiles of `slots` rows), codes (8 a word)."""
    return 4 * tiles * TILE_WORDS + 4 * slots * 8 + 64 * tiles * STEP_K // 8


def shared_words(slots: int, stages: int, tiles: int) -> int:
    """Words of a CTA's dynamic shared memory: the ring, then a stage's mbarrier each
    (two words; used by bulk variants only)."""
    return stages * stage_words(slots, tiles) + 2 * stages


@functools.cache
def make_bound_kernel(slots: int, stages: int, k: int, tiles: int, leave_out: str = "", bulk: bool = False):
    """kernel(act, codes, scales, out) for `slots` slots an expert, `tiles` m64 tiles of
    features a CTA and a `stages`-deep ring (arrays as `bound_inputs` makes them, the
    activations as `stage_blocks` stores them if `bulk`); grid (features / 64 tiles,
    experts), 128 + 64 tiles threads (a producer a feature),
    `4 * shared_words(slots, stages, tiles)` bytes of dynamic shared memory. `leave_out`
    one of LEFT_OUT, timing only (wrong results): what the skeleton costs without it."""
    if k % GROUP or not 2 <= stages <= 7 or slots not in ptx.WARPGROUP_COLUMNS or leave_out not in LEFT_OUT:
        raise ValueError(f"k must be a multiple of {GROUP}, stages in [2, 7] and slots a multiple of 8 up to 256, "
                         f"got k={k}, stages={stages}, slots={slots}; leave_out one of {LEFT_OUT}, got {leave_out!r}")
    steps, ring, groups = k // STEP_K, stage_words(slots, tiles), k // GROUP
    features, threads = 64 * tiles, 128 + 64 * tiles  # a CTA's features; its threads
    a_words, b_words = 4 * tiles * TILE_WORDS, 4 * slots * 8  # a stage's decoded weights, activations
    regs, chunks = slots // 2, -(-slots * 8 // features)  # chunks: activation copies a producer
    accumulators = tiles * regs  # a consumer thread's: `tiles` m64 tiles of slots / 2
    multiply = ptx.shared_warpgroup_mma("bfloat16", slots)
    fma2, decode_ready = ptx.fma2("bfloat16"), ptx.wait_copies[stages - 2]
    load_scale, load_codes = ptx.load_words[1], ptx.load_shared[4]
    decode, fence, multiply_tiles, copy_act = (leave_out != part for part in LEFT_OUT[1:])
    barriers = stages * ring  # the word of stage b's mbarrier: barriers + 2b
    wait_older_mma, wait_all_mma = ptx.warpgroup_wait[1], ptx.warpgroup_wait[0]

    @ptx.device
    def issue_copies(act, codes, step, buffer, expert, ftile, p, shared):
        """Producer thread p's copies of `step` into `buffer` (none past the last step),
        then one commit group: 16 bytes of activations (8 of K of a slot) a copy, and the
        thread's own 8 code words. Bulk: thread 0 copies all of the step's activations
        instead, counted on the buffer's mbarrier."""
        if step < uint32(steps):
            base = uint32(buffer) * uint32(ring)
            if bulk and copy_act and p == uint32(0):
                barrier = uint32(barriers) + uint32(2) * buffer
                ptx.mbarrier_expect_bytes(shared, barrier, 4 * b_words)
                ptx.bulk_copy(shared, base + uint32(a_words), act, (expert * uint32(steps) + step) * uint32(b_words),
                              4 * b_words, barrier)
            for q in range(0 if bulk else chunks):
                c = p + uint32(features * q)
                if copy_act and c < uint32(slots * 8):
                    slot, rest = c // uint32(8), c % uint32(8)
                    sub, half = rest // uint32(2), rest % uint32(2)
                    target = (base + uint32(a_words) + sub * uint32(slots * 8) + (slot // uint32(8)) * uint32(64)
                              + half * uint32(32) + (slot % uint32(8)) * uint32(4))
                    source = ((expert * uint32(slots) + slot) * uint32(k // 2) + step * uint32(STEP_K // 2)
                              + sub * uint32(8) + half * uint32(4))
                    ptx.copy_async(shared, target, act, uint32(0), source, 16)
            ftiles = uint32(codes.shape[1])
            first = ((expert * ftiles + ftile) * uint32(steps) + step) * uint32(8 * features) + uint32(8) * p
            for h in range(2):
                ptx.copy_async(shared, base + uint32(a_words + b_words) + uint32(8) * p + uint32(4 * h), codes, first,
                               uint32(4 * h), 16)
        ptx.commit_copies()

    def word_decoder(word: int):
        """Decode code word `word` of a producer's 8 (8 of K of its feature `row` of m64
        tile `tile`) into one 16-byte row of a core matrix. Built per word in Python, so
        every index is a constant (no loop for the compiler to keep rolled)."""

        @ptx.device
        def decode_word(w, v, scale, shared, base, tile, row):
            code_word = uint32(w[word] if word < 4 else v[word - 4])
            pairs = cuda.local.array(4, uint32)
            for j in range(4):  # halves 2j, 2j + 1: the codes at bits 4j and 16 + 4j
                if decode:
                    magic = ptx.and_or(code_word >> uint32(4 * j), uint32(0x000F000F), uint32(MAGIC))
                    pairs[j] = fma2(fma2(magic, uint32(ONE), uint32(MINUS_136)), scale, uint32(MINUS_ZERO))
                else:
                    pairs[j] = code_word ^ scale
            target = (base + uint32((word // 2) * tiles * TILE_WORDS + (word % 2) * 32) + tile * uint32(TILE_WORDS)
                      + (row // uint32(8)) * uint32(64) + (row % uint32(8)) * uint32(4))
            ptx.store_shared4(shared, target, pairs[0], pairs[1], pairs[2], pairs[3])

        return decode_word

    decode_words = functools.reduce(chain, [word_decoder(word) for word in range(8)])

    def producer_step(b: int):
        """Decode stage b's codes into its A tiles and hand the stage to the consumer;
        then refill the stage before it, once the consumer is done with it."""
        ready, before = ptx.barrier_arrive(1 + b, threads), (b - 1) % stages
        released = ptx.barrier_sync(1 + stages + before, threads)

        @ptx.device
        def step(first, act, codes, scales, expert, ftile, p, shared):
            i = first + uint32(b)
            if i < uint32(steps):
                group = i * uint32(STEP_K) // uint32(GROUP)
                scale = load_scale(scales, (expert * uint32(groups) + group) * uint32(scales.shape[2])
                                   + ftile * uint32(features) + p)
                decode_ready()  # this thread's copies of stage i have landed
                base = uint32(b * ring)
                raw = base + uint32(a_words + b_words) + uint32(8) * p
                w, v = load_codes(shared, raw), load_codes(shared, raw + uint32(4))
                decode_words(w, v, scale, shared, base, p // uint32(64), p % uint32(64))
                if fence:
                    ptx.async_proxy_fence()  # the stores and the landed copies, for the tensor cores
                ready()
                if i >= uint32(1):
                    released()
                    issue_copies(act, codes, i - uint32(1) + uint32(stages), before, expert, ftile, p, shared)
                else:
                    ptx.commit_copies()  # an empty group, so that step s >= stages is group s + 1

        return step

    def tile_multiplier(sub: int, tile: int):
        """acc[tile] += A (m64 tile `tile`, k16 step `sub` of the stage at `base`) @ B."""

        @ptx.device
        def multiply_tile(shared, base, acc):
            multiply(shared, base + uint32((tiles * sub + tile) * TILE_WORDS), CORE_LBO, CORE_SBO,
                     base + uint32(a_words + sub * slots * 8), CORE_LBO, CORE_SBO, acc, tile * regs)

        return multiply_tile

    multiply_stage = functools.reduce(chain, [tile_multiplier(sub, tile) for sub in range(4) for tile in range(tiles)])

    def consumer_step(b: int):
        """Multiply stage b once the producers hand it over; release the stage before it
        once that stage's wgmma are done."""
        ready, before = ptx.barrier_sync(1 + b, threads), (b - 1) % stages
        release = ptx.barrier_arrive(1 + stages + before, threads)

        @ptx.device
        def step(first, shared, acc):
            i = first + uint32(b)
            if i < uint32(steps):
                ready()
                if bulk and copy_act:  # the stage's activations have landed: round i // stages's phase
                    ptx.mbarrier_wait(shared, uint32(barriers + 2 * b), (i // uint32(stages)) % uint32(2))
                ptx.warpgroup_fence()
                if multiply_tiles:
                    multiply_stage(shared, uint32(b * ring), acc)
                ptx.warpgroup_commit()
                wait_older_mma()
                if i >= uint32(1):
                    release()

        return step

    produce_round = functools.reduce(chain, [producer_step(b) for b in range(stages)])
    consume_round = functools.reduce(chain, [consumer_step(b) for b in range(stages)])

    def column_tile(tile: int, c: int):
        """(zero, store) of one n8 column tile's four accumulators: rows (features) `row`
        and row + 8 of m64 tile `tile`, slots 8c + `col` and + 1. Built per tile in
        Python, so every accumulator index is a constant (registers, not the stack)."""
        first = tile * regs + 4 * c

        @ptx.device
        def zero(acc):
            for q in range(4):
                acc[first + q] = float32(0)

        @ptx.device
        def store(acc, out, expert, row, col):
            for q in range(4):
                out[expert, uint32(8 * c + q % 2) + col, row + uint32(64 * tile + 8 * (q // 2))] = acc[first + q]

        return zero, store

    columns = [column_tile(tile, c) for tile in range(tiles) for c in range(slots // 8)]
    zero_accumulators = functools.reduce(chain, [zero for zero, _ in columns])
    store_outputs = functools.reduce(chain, [store for _, store in columns])

    @ptx.kernel(launch_bounds=threads)  # registers for a CTA of `threads` (185 asked for 4 tiles)
    def bound(act, codes, scales, out):
        shared = cuda.shared.array(0, uint32)
        tid, ftile, expert = uint32(cuda.threadIdx.x), uint32(cuda.blockIdx.x), uint32(cuda.blockIdx.y)
        if bulk:
            if tid == uint32(0):
                for b in range(stages):
                    ptx.mbarrier_init(shared, uint32(barriers + 2 * b), 1)
            cuda.syncthreads()
        if tid >= uint32(128):
            p = tid - uint32(128)
            for s in range(stages):
                issue_copies(act, codes, uint32(s), uint32(s), expert, ftile, p, shared)
            first = uint32(0)
            while first < uint32(steps):
                produce_round(first, act, codes, scales, expert, ftile, p, shared)
                first += uint32(stages)
        else:
            acc = cuda.local.array(accumulators, float32)
            zero_accumulators(acc)
            first = uint32(0)
            while first < uint32(steps):
                consume_round(first, shared, acc)
                first += uint32(stages)
            wait_all_mma()
            store_outputs(acc, out, expert, ftile * uint32(features) + (tid // uint32(32)) * uint32(16)
                          + (tid % uint32(32)) // uint32(4), uint32(2) * (tid % uint32(4)))

    return bound


def bound_inputs(experts: int, features: int, k: int, slots: int, tiles: int, generator: torch.Generator):
    """Random (act, codes, scales, weights): activations (experts, slots, k / 2) as bfloat16
    pairs, codes (experts, features / (64 tiles), k / 64, 64 tiles, 8) words, scales
    (experts, k / 128, features) bfloat16 in both halves, and the dequantised weights
    (experts, features, k) in float32 (before rounding to bfloat16) for the reference."""
    device, block = generator.device, 64 * tiles
    act = torch.randn(experts, slots, k, generator=generator, device=device).to(torch.bfloat16)
    q = torch.randint(0, 16, (experts, features, k), generator=generator, device=device, dtype=torch.int32)
    scale = (torch.rand(experts, k // GROUP, features, generator=generator, device=device) * 0.02 + 0.01).to(
        torch.bfloat16)
    weights = (q - 8).float() * scale.float().repeat_interleave(GROUP, dim=1).transpose(1, 2)
    # A word holds 8 of K of one feature: K offsets 2j at bits 4j, 2j + 1 at bits 16 + 4j.
    nibbles = q.to(torch.int64).view(experts, features, k // 8, 4, 2)
    shifts = (4 * torch.arange(4, device=device).view(4, 1) + torch.tensor([0, 16], device=device)).to(torch.int64)
    words = (nibbles << shifts).sum(dim=(3, 4))
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # the same 32 bits as int32
    codes = words.view(experts, features // block, block, k // STEP_K, 8).transpose(2, 3).to(torch.int32)
    bits = scale.view(torch.int16).to(torch.int32) & 0xFFFF
    return act.view(torch.int32), codes.contiguous(), (bits | bits << 16).contiguous(), weights


def stage_blocks(act: torch.Tensor) -> torch.Tensor:
    """Activations (experts, slots, k / 2) words -> (experts, k / 64, stage's words): each
    stage's words in the order its B tiles hold them (k16 step, 8 slots, 8 of K, slot,
    8 halves), so that one bulk copy fills a stage."""
    experts, slots, k = act.shape[0], act.shape[1], 2 * act.shape[2]
    halves = act.view(torch.bfloat16).view(experts, slots // 8, 8, k // STEP_K, 4, 2, 8)
    return halves.permute(0, 3, 4, 1, 5, 2, 6).contiguous().view(torch.int32).view(experts, k // STEP_K, -1)


def run_bound(act, codes, scales, out, slots: int, stages: int, tiles: int, leave_out: str = "", bulk: bool = False):
    """Launch the bound kernel on torch's stream (`act` as `stage_blocks` stores it if `bulk`)."""
    experts, features, k = out.shape[0], out.shape[2], codes.shape[2] * STEP_K
    kernel = make_bound_kernel(slots, stages, k, tiles, leave_out, bulk)
    launch_kernel(kernel, (features // (64 * tiles), experts), 128 + 64 * tiles, *(interop.to_kernel(t) for t in (
        act, codes, scales, out)), shared_bytes=4 * shared_words(slots, stages, tiles))


def bound_error(experts: int, features: int, k: int, slots: int, stages: int, tiles: int,
                generator: torch.Generator, bulk: bool = False) -> float:
    """Largest error of the bound kernel's output against float64 torch, relative to the
    output's largest magnitude."""
    act, codes, scales, weights = bound_inputs(experts, features, k, slots, tiles, generator)
    out = torch.zeros(experts, slots, features, dtype=torch.float32, device=act.device)
    run_bound(stage_blocks(act) if bulk else act, codes, scales, out, slots, stages, tiles, bulk=bulk)
    reference = act.view(torch.bfloat16).double() @ weights.to(torch.bfloat16).double().transpose(1, 2)
    return float((out.double() - reference).abs().max() / reference.abs().max())


def variant(text: str) -> tuple[int, int, str, bool]:
    """'tiles:stages', then ':bulk' and at most one ':left-out part', in any order ->
    (tiles, stages, part, bulk)."""
    parts = text.split(":")
    words = parts[2:]
    left_out = [word for word in words if word != BULK]
    if (len(parts) < 2 or not all(part.isdigit() for part in parts[:2]) or len(left_out) > 1
            or words.count(BULK) > 1 or not set(left_out) <= set(LEFT_OUT[1:])):
        raise argparse.ArgumentTypeError(f"expected tiles:stages, then :{BULK} and at most one part of "
                                         f"{LEFT_OUT[1:]}, got {text!r}")
    return int(parts[0]), int(parts[1]), (left_out or [""])[0], BULK in words


def main(argv=None) -> None:
    from bench_moe import Timer, captured, layer_gemms, matmul_rate, routed_batches

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=64, help="slots an expert (wgmma N)")
    parser.add_argument("--variants", type=variant, nargs="+", default=[(2, 3, "", False), (2, 3, "", True)],
                        help="tiles:stages to time (m64 tiles of features a CTA, ring depth), then :bulk for the "
                             "activations' bulk copies, and :part for the skeleton without `part` (decode, fence, "
                             "mma or act, the activations' copies: timing only)")
    parser.add_argument("--tokens", type=int, default=256, help="Mixtral tokens for the layer's own GEMMs")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("it times kernels on a CUDA GPU and none is available here (its check runs in the simulator: "
                     "tests/test_benchmarks.py)")
    timer, generator = Timer(), torch.Generator(device="cuda").manual_seed(0)
    rate = matmul_rate(timer)
    print(f"{torch.cuda.get_device_name()}; bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    for tiles, stages, bulk in sorted({(tiles, stages, bulk) for tiles, stages, _, bulk in args.variants}):
        error = bound_error(2, 512, 512, args.slots, stages, tiles, generator, bulk)
        print(f"check, {tiles} tiles, {stages} stages{', bulk' if bulk else ''}: largest error {error:.1e} of the "
              f"largest output")
    _, _, _, layer, hidden, topk_weights, topk_ids = next(routed_batches(["mixtral"], ["w4a16-g128"], [args.tokens],
                                                                        generator))
    gemms = layer_gemms(layer, hidden, topk_weights, topk_ids)[:2]
    config = layer.config
    for name, gemm, features, k in (("gemm1", gemms[0], 2 * config.intermediate_size, config.hidden_size),
                                    ("gemm2", gemms[1], config.hidden_size, config.intermediate_size)):
        own = timer(captured(gemm))
        flops = 2 * config.num_experts * args.slots * features * k
        print(f"{name} (N {features}, K {k}): the layer's own {own * 1e3:.1f} us at M = {args.tokens} "
              f"({2 * args.tokens * config.top_k * features * k / (own * 1e-3) / rate:.2f} of the matmul rate)")
        for tiles, stages, leave_out, bulk in args.variants:
            act, codes, scales, _ = bound_inputs(config.num_experts, features, k, args.slots, tiles, generator)
            act = stage_blocks(act) if bulk else act
            out = torch.empty(config.num_experts, args.slots, features, dtype=torch.float32, device="cuda")
            ms = timer(captured(functools.partial(run_bound, act, codes, scales, out, args.slots, stages, tiles,
                                                  leave_out, bulk)))
            without = (", bulk" if bulk else "") + (f", without {leave_out}" if leave_out else "")
            print(f"  bound, {config.num_experts} x {args.slots} slots, {tiles} tiles, {stages} stages{without}: "
                  f"{ms * 1e3:.1f} us ({flops / (ms * 1e-3) / rate:.2f} of the matmul rate)", flush=True)
            del act, codes, scales, out


if __name__ == "__main__":
    main()
