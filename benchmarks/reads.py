"""Plain reads of the bytes a pair of decode GEMMs reads: what streaming them costs, timed
as the GEMMs are.

The floor (bytes / copy bandwidth) holds for large transfers. A decode GEMM reads a few
MB to a few hundred MB in a kernel of a few microseconds, where the launch, the first
round trip to DRAM and the ramp to full bandwidth are a large part of the time. So the
benchmark also times, in one CUDA graph with the L2 flushed like the GEMMs, one read
kernel per GEMM over a buffer of that GEMM's bytes: every thread issues its 16-byte loads
at once (`UNROLL` of them), so all the bytes are in flight as early as the card allows.
Nothing a GEMM does beyond reading its weights is in these kernels: no activations, no
tensor-core work, no reduction, no output.
"""

from __future__ import annotations

import torch
from numba import cuda, uint32

from numba_kernels import ptx
from numba_kernels.launch import launch_kernel

UNROLL = 4  # 16-byte loads per thread, all issued before the first is used
LOAD_BYTES = 16
BLOCK = 256
_load4 = ptx.load_words[4]


@cuda.jit
def read_kernel(words, first, sink):
    """Thread t loads words[first + 4 (t + u * threads)] for u < UNROLL, 16 bytes each; the
    XOR of what it read is stored only if it equals a value the zeroed buffer never gives
    (so the loads are not optimised away)."""
    t = cuda.grid(1)
    threads = cuda.gridsize(1)
    acc = uint32(0)
    for u in range(UNROLL):
        w0, w1, w2, w3 = _load4(words, first + 4 * (t + u * threads))
        acc ^= w0 ^ w1 ^ w2 ^ w3
    if acc == uint32(0x5EED):
        sink[0] = acc


def _blocks(nbytes: int) -> int:
    return max(-(-nbytes // (LOAD_BYTES * UNROLL * BLOCK)), 1)


class PlainReads:
    """One read kernel per entry of `byte_counts`, over distinct parts of one zeroed buffer
    (a later kernel does not find an earlier one's lines in the L2)."""

    def __init__(self, byte_counts):
        self.blocks = [_blocks(int(n)) for n in byte_counts]
        sizes = [blocks * BLOCK * UNROLL * LOAD_BYTES // 4 for blocks in self.blocks]  # words each kernel reads
        self.firsts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.words = torch.zeros(sum(sizes), dtype=torch.int32, device="cuda")
        self.sink = torch.zeros(1, dtype=torch.int32, device="cuda")

    def __call__(self) -> None:
        for blocks, first in zip(self.blocks, self.firsts):
            launch_kernel(read_kernel, blocks, BLOCK, self.words, first, self.sink)
