"""Reads shaped like a decode GEMM: how much of the GEMMs' gap to plain reads comes from
their access pattern and residency, and how much from their arithmetic.

A swapped decode GEMM (`numba_kernels.gemm`) gives each CTA one 64-feature chunk of one
expert and 4 warps along K; each warp loads its run of slabs in batches of 4 (16 bytes a
lane per slab, 512 bytes a warp). The kernels here do only those loads, with the GEMM's
grid and loop, over a buffer of the same bytes:

* slab-major: the weights as `formats.native` stores them (a slab's chunks side by side,
  so a warp's consecutive slabs lie N / 64 x 512 bytes apart);
* chunk-major: each chunk's slabs contiguous instead;
* N/SM: slab-major, with dynamic shared memory that lets at most N CTAs share an SM, as
  registers limit the GEMMs (4 CTAs of 128 threads at 120 registers a thread);

beside a plain read of the bytes (`reads.PlainReads`); and for Qwen3 at M = 16, with integer
work on every loaded word and 1 to 4 batch buffers a warp (the GEMM holds 2): whether a
warp's work per slab hides behind its loads when more batches are in flight. Everything
is timed as bench_moe times the GEMMs: one CUDA graph, L2 flushed, median.

    python benchmarks/read_patterns.py
"""

from __future__ import annotations

import argparse
import functools

import torch
from numba import cuda, int64, uint32

from bench_moe import SHAPES as MODELS, Timer, captured
from numba_kernels import ptx
from numba_kernels.fragments import CHUNK_N, SLAB_K
from numba_kernels.launch import launch_kernel, replaying
from reads import PlainReads

WARPS_K, BATCH = 4, 4  # the GEMM's warps along K and slabs per batch
WARP_WORDS = CHUNK_N * SLAB_K * 4 // 32  # a warp's words of a slab: 4-bit codes of 64 features x 16 K
BATCH_WORDS = 4 * BATCH  # a lane's words of a batch
SHARED_PER_SM = 228 * 1024
ROWS = [("qwen3", 16, 80), ("mixtral", 1, 2)]  # (model, tokens, experts they touch): the rows measured
WORKED_ROWS = ROWS[:1]  # the rows also timed with work per slab (Qwen3 at M = 16)
ROUNDS, BUFFERS = (0, 2, 4), (1, 2, 3, 4)  # rounds of work per word, batch buffers per warp


def gemm_shapes(model: str) -> list[tuple[str, int, int]]:
    """(GEMM, 64-feature chunks, slabs of 16 K) of gemm1 (N = 2 I, K = H) and gemm2 (N = H, K = I)."""
    hidden, intermediate = MODELS[model]["hidden_size"], MODELS[model]["intermediate_size"]
    return [("gemm1", 2 * intermediate // CHUNK_N, hidden // SLAB_K),
            ("gemm2", hidden // CHUNK_N, intermediate // SLAB_K)]


_load4 = ptx.load_words[4]


@functools.cache
def shaped_reads(chunk_major: bool, buffers: int = 2, rounds: int = 0):
    """A kernel whose CTA (expert, chunk) loads what the GEMM's CTA loads, warp by warp.

    buffers: batches a warp holds in registers, rotating as the GEMM's do (2, as the
             GEMM): the next buffers - 1 batches are loading while the warp works on one
             (1: each batch is loaded, then used);
    rounds:  rounds of dependent integer work on each loaded word (a shift, a multiply
             and an xor each: 12 instructions a slab per round), standing in for the
             GEMM's work per slab (about 90 instructions a warp in the
             twenty-fourth session's profile, LOG.md)."""

    @cuda.jit(device=True)
    def load_batch(words, expert, chunk, chunks, slabs, first, lane, raw, slot):
        for d in range(BATCH):
            if chunk_major:
                slab_chunk = (int64(expert) * chunks + chunk) * slabs + first + d
            else:
                slab_chunk = (int64(expert) * slabs + first + d) * chunks + chunk
            at = slab_chunk * WARP_WORDS + 4 * lane
            raw[slot, 4 * d], raw[slot, 4 * d + 1], raw[slot, 4 * d + 2], raw[slot, 4 * d + 3] = _load4(words, at)

    @cuda.jit(device=True)
    def use_batch(raw, slot, acc):
        for i in range(BATCH_WORDS):
            word = raw[slot, i]
            for _ in range(rounds):
                word = (word >> uint32(3)) ^ (word * uint32(5))
            acc ^= word
        return acc

    @cuda.jit
    def read(words, sink, chunks, slabs):
        cuda.shared.array(0, uint32)  # only its size matters: CTAs per SM
        expert, chunk = cuda.blockIdx.x // chunks, cuda.blockIdx.x % chunks
        lane, warp = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
        run = slabs // WARPS_K
        first, end = warp * run, (warp + 1) * run
        raw = cuda.local.array((buffers, BATCH_WORDS), uint32)
        for j in range(buffers - 1):  # the batches that load while the first is used
            if first + j * BATCH < end:
                load_batch(words, expert, chunk, chunks, slabs, first + j * BATCH, lane, raw, j)
        acc = uint32(0)
        while first < end:
            for j in range(buffers):  # unrolled: constant slots, kept in registers
                ahead = first + (j + buffers - 1) * BATCH
                if ahead < end:  # into the slot used last
                    load_batch(words, expert, chunk, chunks, slabs, ahead, lane, raw, (j + buffers - 1) % buffers)
                if first + j * BATCH < end:
                    acc = use_batch(raw, j, acc)
            first += buffers * BATCH
        if acc == uint32(0x5EED):  # never, on a zeroed buffer: keeps the loads
            sink[0] = acc

    return read


def held_to(per_sm: int) -> int:
    """Dynamic shared memory a CTA asks for so that at most `per_sm` share an SM (0: no limit)."""
    return (SHARED_PER_SM // per_sm - 1024) // 16 * 16 if per_sm else 0  # 1 KB a CTA the system keeps


def timed(timer, kernel, grid: int, words, sink, chunks: int, slabs: int, per_sm: int) -> float:
    """Milliseconds of one launch of a read kernel over `grid` CTAs, as bench_moe times GEMMs."""
    shared = held_to(per_sm)

    def run():
        launch_kernel(kernel, grid, 32 * WARPS_K, words, sink, chunks, slabs, shared_bytes=shared)

    return timer(captured(replaying(run)))


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    timer = Timer()
    print(f"{torch.cuda.get_device_name()}: us (TB/s) of reads shaped like a decode GEMM")
    for model, tokens, experts in ROWS:
        for gemm, chunks, slabs in gemm_shapes(model):
            name = f"{model} {gemm} M={tokens}"
            if slabs % (WARPS_K * BATCH):  # each warp reads whole batches
                raise ValueError(f"{name}: {slabs} slabs do not split into {WARPS_K} warps' batches of {BATCH}")
            words = torch.zeros(experts * chunks * slabs * WARP_WORDS, dtype=torch.int32, device="cuda")
            sink = torch.zeros(1, dtype=torch.int32, device="cuda")
            nbytes, grid = 4 * words.numel(), experts * chunks
            variants = [("slab-major", False, 0), ("chunk-major", True, 0)] + [
                (f"{per_sm}/SM", False, per_sm) for per_sm in (4, 6, 8)]
            figures = [(label, timed(timer, shaped_reads(chunk_major), grid, words, sink, chunks, slabs, per_sm))
                       for label, chunk_major, per_sm in variants]
            plain = PlainReads([nbytes])  # held: the graph does not keep its buffer alive
            figures.append(("plain", timer(captured(replaying(plain)))))
            print(f"{name} ({nbytes / 1e6:.1f} MB): " + ", ".join(
                f"{label} {ms * 1e3:.1f} ({nbytes / ms / 1e9:.2f})" for label, ms in figures), flush=True)
            if (model, tokens, experts) in WORKED_ROWS:  # work per slab against batches in flight, at 4 CTAs / SM
                for rounds in ROUNDS:
                    times = [timed(timer, shaped_reads(False, buffers, rounds), grid, words, sink, chunks, slabs, 4)
                             for buffers in BUFFERS]
                    print(f"  4/SM, {12 * rounds} instructions of work a slab: " + ", ".join(
                        f"{buffers} buffers {ms * 1e3:.1f}" for buffers, ms in zip(BUFFERS, times)), flush=True)


if __name__ == "__main__":
    main()
