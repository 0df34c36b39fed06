"""Dense tensor-core ceilings a Numba kernel reaches on this GPU: mma.sync m16n8k16 (the
prefill GEMM's instruction, a 64 x 64 tile a warp as in its main loop) against Hopper's
warpgroup mma (`ptx.warpgroup_mma`: A from registers, B from shared memory;
`ptx.shared_warpgroup_mma`: both from shared memory), each in a loop with no memory traffic, beside torch's bf16 matmul. It bounds what the prefill
GEMMs could gain by moving to wgmma (LOG.md, twenty-ninth session).

    python benchmarks/tensor_rates.py
"""

from __future__ import annotations

import argparse
import datetime

import numpy as np
import torch
from numba import cuda, float32, uint32

from numba_kernels import interop, ptx
from bench_moe import Timer, matmul_rate

ITERATIONS = 2000
UNROLL = 4  # warpgroup mma issued between two commits


def mma_sync_kernel():
    """Each warp: 4 x 8 m16n8k16 tiles (a 64 x 64 block of accumulators) a k step."""
    mma = ptx.mma("bfloat16")

    @ptx.kernel
    def run(words, out, iterations):
        lane = cuda.threadIdx.x % 32
        w = uint32(words[lane])
        acc = cuda.local.array((4, 8, 4), float32)
        for i in range(4):
            for j in range(8):
                for r in range(4):
                    acc[i, j, r] = 0.0
        for _ in range(iterations):
            for i in range(4):
                for j in range(8):
                    acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3] = mma(
                        w, w ^ uint32(i), w ^ uint32(4 + i), w ^ uint32(8 + i), w ^ uint32(16 + j), w ^ uint32(24 + j),
                        acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3])
        total = float32(0.0)
        for i in range(4):
            for j in range(8):
                for r in range(4):
                    total += acc[i, j, r]
        out[cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x] = total

    return run, 4 * 8 * 2 * 16 * 8 * 16 / 32  # flops a thread and iteration


def warpgroup_kernel(n: int, a_in_shared: bool = False):
    """Each warpgroup: UNROLL m64nNk16 mma a commit, on one B tile (and A tile) in shared
    memory."""
    mma = (ptx.shared_warpgroup_mma if a_in_shared else ptx.warpgroup_mma)("bfloat16", n)
    wait_all = ptx.warpgroup_wait[0]
    b_words, regs = n * 8, n // 2  # 16 x n halves
    tile_words = b_words + 512  # and A, 64 x 16 halves, after it

    @ptx.kernel
    def run(words, out, iterations):
        i = cuda.threadIdx.x
        tile = cuda.shared.array(tile_words, uint32)
        for w in range(i, tile_words, cuda.blockDim.x):
            tile[w] = uint32(words[w % 32])
        ptx.async_proxy_fence()
        cuda.syncthreads()
        w = uint32(words[i % 32])
        acc = cuda.local.array(regs, float32)
        for r in range(regs):
            acc[r] = float32(0.0)
        ptx.warpgroup_fence()
        for _ in range(iterations):
            for _ in range(UNROLL):
                if a_in_shared:
                    mma(tile, b_words, 128, 256, 0, 128, 256, acc, 0)
                else:
                    mma(w, w ^ uint32(1), w ^ uint32(2), w ^ uint32(3), tile, 0, 128, 256, acc, 0)
            ptx.warpgroup_commit()
        wait_all()
        total = float32(0.0)
        for r in range(regs):
            total += acc[r]
        out[cuda.blockIdx.x * cuda.blockDim.x + i] = total

    return run, UNROLL * 2 * 64 * n * 16 / 128


def tflops(timer: Timer, kernel, flops_per_thread: float, blocks: int, threads: int, words) -> float:
    """TFLOP/s of `kernel`'s ITERATIONS, launched on torch's stream (the timer's events')."""
    out = cuda.device_array(blocks * threads, np.float32)
    ms = timer(lambda: kernel[blocks, threads, interop.launch_stream()](words, out, ITERATIONS), repeats=5, flush=False)
    return blocks * threads * ITERATIONS * flops_per_thread / ms / 1e9


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    if ptx.SIMULATED or not ptx.hopper():
        raise SystemExit("tensor_rates needs a Hopper GPU (sm_90a)")
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    # bf16 bit pairs of modest values, so that the sums stay finite
    words = cuda.to_device(np.random.default_rng(0).integers(0x3C003C00, 0x3F003F00, 32, dtype=np.uint32))
    timer = Timer(flush_bytes=8)  # nothing to flush: the loops read no memory
    reference = matmul_rate(timer) / 1e12
    print(f"{torch.cuda.get_device_name()}, {datetime.date.today()}: torch bf16 matmul 8192^3 {reference:.0f} TFLOP/s")
    rows = [("mma.sync m16n8k16, 64 x 64 a warp", *mma_sync_kernel())]
    rows += [(f"warpgroup mma m64n{n}k16, A in registers", *warpgroup_kernel(n)) for n in (64, 128, 256)]
    rows += [(f"warpgroup mma m64n{n}k16, A in shared", *warpgroup_kernel(n, True)) for n in (64, 128, 256)]
    for name, kernel, flops in rows:
        for per_sm, threads in ((1, 256), (2, 256)):
            rate = tflops(timer, kernel, flops, per_sm * sms, threads, words)
            print(f"{name:42s} {per_sm} x {threads} threads an SM: {rate:5.0f} TFLOP/s ({rate / reference:.2f}x torch)")


if __name__ == "__main__":
    main()
