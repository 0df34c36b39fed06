"""The few instructions Numba's kernel language lacks, one PTX instruction per helper.

Numba has no tensor-core instruction, no packed half-precision arithmetic and no 16-byte
load. This module supplies exactly those, and nothing else:

=======================  ==================================  ==========================
helper                   PTX                                 used for
=======================  ==================================  ==========================
``mma(a, b, c)``         mma.sync.m16n8k16 (bf16 or f16)     the GEMMs' inner product
``fma2(a, b, c)``        fma.rn.{bf16x2,f16x2}               dequantising two codes
``fma2_splat(...)``      fma.rn, b's half in both lanes      one scale of a scale pair
``pack2(lo, hi)``        cvt.rn.{bf16x2,f16x2}.f32           float32 pair -> half pair
``and_or(a, m, b)``      lop3.b32 (a & m) | b                codes -> half bits, one op
``byte_perm(a, b, s)``   prmt.b32                            scale bytes -> half pairs
``to_half(x)``           cvt.rn.{bf16,f16}.f32               one float32 -> half bits
``half_to_f32(h)``       cvt.f32.f16 (bf16: a shift)         half bits -> float32
``f32_bits / bits_f32``  mov.b32 (libdevice bit casts)       integer bit tricks
``exp_approx(x)``        ex2.approx (libdevice fast_expf)    silu's exponential
``divide_approx(a, b)``  div.approx (libdevice fdividef)     silu's division
``load_u32x4(a, ...)``   load_words[4] at a[i, j, k]       16-byte loads by 3-D index
``load_words[n](a, i)``  ld.global.nc{,.v2,.v4}.u32          n words at flat element i
``load_shared[n](s, i)`` ld.shared{,.v2,.v4}.u32             n words of a shared array
``load_coherent(a, i)``  ld.global.cg.u32                    a word other CTAs wrote
``arrive(a, i)``         atom.acq_rel.gpu.global.add.u32     publish a CTA's stores
``copy_async(s, i, a,    cp.async.cg.shared.global 16        prefill: global -> shared
base, j, bytes)``                                            without registers
``commit_copies()``      cp.async.commit_group               close a pipeline stage
``wait_copies[n]()``     cp.async.wait_group n               all but the newest n stages
``ldmatrix4(s, i)``      ldmatrix.sync.m8n8.x4.shared.b16    A fragments from shared
``wait_for_previous()``  griddepcontrol.wait                 early-launched kernels
``release_next()``       griddepcontrol.launch_dependents    let the next kernel start
``warpgroup_mma(h, n)``  wgmma.mma_async.m64nNk16, A in      Hopper's asynchronous
(a0..a3, s, i, lbo,      registers, B in shared memory       tensor cores (measured by
sbo, acc, j)             (a matrix descriptor)               ``benchmarks/tensor_rates``)
``shared_warpgroup_mma  the same, A in shared memory too    a decoded A tile shared
(h, n)(s, i, lbo, sbo,   (a second descriptor)               by many slots (prefill)
j, lbo, sbo, acc, j)``
``async_proxy_fence()``  fence.proxy.async.shared::cta       threads' stores -> wgmma
``warpgroup_fence()``    wgmma.fence                         before a group's first mma
``warpgroup_commit()``   wgmma.commit_group                  close a group of mma
``warpgroup_wait[n]()``  wgmma.wait_group n                  all but the newest n groups
=======================  ==================================  ==========================

``wait_for_previous`` and ``release_next`` are Hopper instructions (sm_90) of
*programmatic dependent launch*: a
kernel launched with that attribute (`launch.Launcher`) may start while the kernel
before it still runs, once that one's CTAs have all called ``release_next`` or exited;
``wait_for_previous`` then blocks until the earlier kernel has finished and its writes
are visible. A kernel so launched must wait before it reads anything an earlier kernel
of the stream wrote, or writes anything one reads. On older GPUs, and under the
simulator, both are no-ops (there kernels run in stream order anyway).

Shared-memory addresses are flat word offsets into a ``uint32`` shared array (the
helpers address it in the shared window, see `_shared_pointer`). The asynchronous copies
follow the hardware's rules, and so do their twins: a copy lands only when a
``wait_copies`` lets its committed group complete, so a kernel that reads a stage too
early reads stale words under the simulator too. ``ldmatrix4`` is warp-collective: lane
``l`` names row ``l % 8`` of matrix ``l // 8`` (four words of 16 bytes); register ``j``
of lane ``l`` receives word ``l % 4`` of row ``l // 4`` of matrix ``j`` -- for an A tile
whose lanes 0-15 name rows 0-15 at column word c and lanes 16-31 the same rows at c + 4,
exactly the mma's a0..a3.

Every helper has a pure-Python *twin* with the same semantics, chosen automatically under
the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), so every kernel runs unchanged in CI.
The twin of the warp-collective ``mma`` gathers the 32 lanes' fragments (the last lane to
arrive multiplies for the warp, `_Group`), so it checks the fragment layout exactly as the
hardware defines it:

    lane = 4 * g + t  (g = lane // 4, t = lane % 4), each register a pair of halves
    A (16x16, row-major):  a0 = A[g, 2t:2t+2]   a1 = A[g+8, 2t:2t+2]
                           a2 = A[g, 2t+8:2t+10] a3 = A[g+8, 2t+8:2t+10]
    B (16x8,  k-major):    b0 = B[2t:2t+2, g]    b1 = B[2t+8:2t+10, g]
    C, D (16x8, float32):  c0, c1 = C[g, 2t:2t+2]   c2, c3 = C[g+8, 2t:2t+2]

``warpgroup_mma`` (sm_90a) is collective over a warpgroup, the 4 warps of threads 128w to
128w + 127: D (64 x n, float32) = A (64 x 16) @ B (16 x n) + D. Warp w of the group holds
rows 16w to 16w + 15 of A and of D, with mma's fragments: a0..a3 as above, and for each
n8 column tile c accumulators acc[j + 4c .. j + 4c + 3] as mma's c0..c3 of that tile (n / 2
a thread, from flat element j of a float32 array, updated in place).
B is read by the tensor cores from shared memory, in 8 x 8 *core matrices* of 128
contiguous bytes (no swizzle): element (k, col) at byte 4 * i + (col // 8) * sbo + (k // 8) *
lbo + (col % 8) * 16 + (k % 8) * 2 of the uint32 shared array (i a word offset; lbo, sbo and
the address multiples of 16). ``shared_warpgroup_mma`` reads A from shared memory the
same way, row r of A as column r of B (K-major core matrices, its own lbo and sbo). The
tensor cores read shared memory through the *async proxy*: a thread that stored words of
an A or B tile calls ``async_proxy_fence`` before the barrier after which the mma is
issued, or the mma may read the old words. The instruction is asynchronous: a thread may
go on (dequantising the next operands, say) while it runs; ``warpgroup_fence`` must come before
the first mma of a group whose A or accumulators other instructions wrote, and the
accumulators may be read, and the shared tiles overwritten, only after a ``warpgroup_wait``
that covers it. ptxas enforces the register half of that rule itself, bluntly: where an
instruction writes registers that an mma in flight may read (the next slab's A fragments
decoded into registers an earlier mma reads), it serialises every wgmma of the kernel
(warning C7513), so wait for the older group (``warpgroup_wait[1]``) before overwriting
them. The twin computes at issue and checks the shared half: it raises if an A or B tile
changed between an mma and the wait that covers it.

This is the only module that reaches below Numba's public kernel API (the vector load is
a Numba ``intrinsic``, like numba-cuda's own cache-hint loads); everything else in
``numba_kernels`` is plain ``cuda.jit`` Python. The C++ wrappers are linked with
``cuda.CUSource`` and inlined by link-time optimisation (kernels are built with
``lto=True`` through `kernel`).
"""

from __future__ import annotations

import functools
import inspect
import threading

import numpy as np
from numba import config, cuda, float32, int32, int64, types, uint32

SIMULATED = bool(config.ENABLE_CUDASIM)

HALF_TYPES = ("bfloat16", "float16")


def kernel(fn=None, **options):
    """`cuda.jit` for kernels: link-time optimisation on the GPU (so the PTX helpers
    inline), plain simulation otherwise. Options the simulator lacks are dropped there."""
    if fn is None:
        return functools.partial(kernel, **options)
    if SIMULATED:
        return cuda.jit(fn)
    return cuda.jit(lto=True, **options)(fn)


def device(fn):
    """`cuda.jit(device=True)`, always inlined into its caller.

    Under the simulator a device function that never names `cuda` stays a plain Python
    function: the simulator's wrapper swaps its module's ``cuda`` for the fake one on every
    call, under a global and a per-module lock, and with a block's threads calling such
    functions per element the unfair locks convoyed (one test went from 20 s to 20 min)."""
    if SIMULATED:
        return cuda.jit(device=True)(fn) if _names_cuda(fn) else fn
    return cuda.jit(device=True, forceinline=True)(fn)


def _names_cuda(fn) -> bool:
    """Whether `fn`'s code, or code nested in it, reads a global bound to the `cuda` module
    (what the simulator's swap replaces)."""
    codes = [fn.__code__]
    while codes:
        code = codes.pop()
        if any(fn.__globals__.get(name) is cuda for name in code.co_names):
            return True
        codes.extend(const for const in code.co_consts if inspect.iscode(const))
    return False


def _check_half(half: str) -> None:
    if half not in HALF_TYPES:
        raise ValueError(f"half type must be one of {HALF_TYPES}, got {half!r}")


# ---------------------------------------------------------------------------------------
# CUDA C++ wrappers, one instruction each (Numba ABI: status return, result through *out).
# ---------------------------------------------------------------------------------------

_SOURCE = r"""
struct f32x4 { float x, y, z, w; };

#define MMA(NAME, TYPE)                                                                    \
extern "C" __device__ int NAME(f32x4* d, unsigned a0, unsigned a1, unsigned a2,            \
                               unsigned a3, unsigned b0, unsigned b1,                      \
                               float c0, float c1, float c2, float c3) {                   \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 "              \
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"                 \
               : "=f"(d->x), "=f"(d->y), "=f"(d->z), "=f"(d->w)                            \
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1),                     \
                 "f"(c0), "f"(c1), "f"(c2), "f"(c3));                                      \
  return 0;                                                                                \
}
MMA(numba_moe_mma_bf16, "bf16")
MMA(numba_moe_mma_f16, "f16")

#define FMA2(NAME, TYPE)                                                                   \
extern "C" __device__ int NAME(unsigned* d, unsigned a, unsigned b, unsigned c) {          \
  asm("fma.rn." TYPE " %0, %1, %2, %3;" : "=r"(*d) : "r"(a), "r"(b), "r"(c));              \
  return 0;                                                                                \
}
FMA2(numba_moe_fma_bf16x2, "bf16x2")
FMA2(numba_moe_fma_f16x2, "f16x2")

/* fma with one half of b in both lanes: ptxas folds the splat into HFMA2's operand swizzle. */
#define FMA2_SPLAT(NAME, TYPE, PICK)                                                       \
extern "C" __device__ int NAME(unsigned* d, unsigned a, unsigned b, unsigned c) {          \
  asm("{ .reg .b16 l, h; .reg .b32 s; mov.b32 {l, h}, %2; mov.b32 s, " PICK "; "          \
      "fma.rn." TYPE " %0, %1, s, %3; }" : "=r"(*d) : "r"(a), "r"(b), "r"(c));            \
  return 0;                                                                                \
}
FMA2_SPLAT(numba_moe_fma_lo_bf16x2, "bf16x2", "{l, l}")
FMA2_SPLAT(numba_moe_fma_hi_bf16x2, "bf16x2", "{h, h}")
FMA2_SPLAT(numba_moe_fma_lo_f16x2, "f16x2", "{l, l}")
FMA2_SPLAT(numba_moe_fma_hi_f16x2, "f16x2", "{h, h}")

#define PACK2(NAME, TYPE)                                                                  \
extern "C" __device__ int NAME(unsigned* d, float lo, float hi) {                          \
  asm("cvt.rn." TYPE ".f32 %0, %1, %2;" : "=r"(*d) : "f"(hi), "f"(lo));                    \
  return 0;                                                                                \
}
PACK2(numba_moe_pack_bf16x2, "bf16x2")
PACK2(numba_moe_pack_f16x2, "f16x2")

extern "C" __device__ int numba_moe_and_or(unsigned* d, unsigned a, unsigned mask, unsigned bits) {
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(*d) : "r"(a), "r"(mask), "r"(bits));
  return 0;
}
extern "C" __device__ int numba_moe_byte_perm(unsigned* d, unsigned a, unsigned b, unsigned selector) {
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(*d) : "r"(a), "r"(b), "r"(selector));
  return 0;
}

extern "C" __device__ int numba_moe_to_bf16(unsigned* d, float x) {
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
  *d = h;
  return 0;
}
extern "C" __device__ int numba_moe_to_f16(unsigned* d, float x) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  *d = h;
  return 0;
}
extern "C" __device__ int numba_moe_f16_to_f32(float* d, unsigned h) {
  unsigned short s = (unsigned short)h;
  asm("cvt.f32.f16 %0, %1;" : "=f"(*d) : "h"(s));
  return 0;
}
"""


@functools.cache
def _declared():
    """Declare every C++ wrapper once (GPU only)."""
    source = cuda.CUSource(_SOURCE)
    mma_sig = types.UniTuple(float32, 4)(*([uint32] * 6 + [float32] * 4))
    fma_sig = uint32(uint32, uint32, uint32)
    pack_sig = uint32(float32, float32)
    names = {
        "mma_bf16": ("numba_moe_mma_bf16", mma_sig), "mma_f16": ("numba_moe_mma_f16", mma_sig),
        "fma_bf16": ("numba_moe_fma_bf16x2", fma_sig), "fma_f16": ("numba_moe_fma_f16x2", fma_sig),
        **{f"fma_{pick}_{name}": (f"numba_moe_fma_{pick}_{name}x2", fma_sig)
           for pick in ("lo", "hi") for name in ("bf16", "f16")},
        "pack_bf16": ("numba_moe_pack_bf16x2", pack_sig), "pack_f16": ("numba_moe_pack_f16x2", pack_sig),
        "to_bf16": ("numba_moe_to_bf16", uint32(float32)), "to_f16": ("numba_moe_to_f16", uint32(float32)),
        "f16_to_f32": ("numba_moe_f16_to_f32", float32(uint32)),
        "and_or": ("numba_moe_and_or", fma_sig), "byte_perm": ("numba_moe_byte_perm", fma_sig),
    }
    return {key: cuda.declare_device(name, sig, link=source) for key, (name, sig) in names.items()}


# ---------------------------------------------------------------------------------------
# Python twins (simulator): the same numbers through numpy.
# ---------------------------------------------------------------------------------------

def _halves_to_f64(words, half: str) -> np.ndarray:
    """(..., 2) float64 values of the low and high halves of uint32 words."""
    words = np.asarray(words, np.uint64).astype(np.uint32)
    pairs = np.stack([words & 0xFFFF, words >> 16], axis=-1).astype(np.uint16)
    with np.errstate(invalid="ignore"):  # any bits, NaNs too (padding rows hold whatever was there)
        if half == "bfloat16":
            return (pairs.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return pairs.view(np.float16).astype(np.float64)


def round_to_half_bits(values, half: str) -> np.ndarray:
    """float64 -> half bit patterns (uint16), one round-to-nearest-even step (normal range)."""
    values = np.asarray(values, np.float64)
    if half == "float16":
        return values.astype(np.float16).view(np.uint16)
    mantissa, exponent = np.frexp(values)  # values = mantissa * 2**exponent, 0.5 <= |mantissa| < 1
    rounded = np.ldexp(np.round(mantissa * 256.0), exponent - 8)  # 8 significant bits, ties to even
    with np.errstate(over="ignore"):  # past bfloat16's range: infinity, as the hardware rounds
        bits = rounded.astype(np.float32).view(np.uint32) >> 16
    return np.where(np.isnan(values), 0x7FC0, bits).astype(np.uint16)


def _pair(lo_bits, hi_bits) -> np.uint32:
    return np.uint32((int(hi_bits) << 16) | int(lo_bits))


def _twin_fma2(half: str):
    def fma2(a, b, c):
        x, y, z = (_halves_to_f64(v, half) for v in (a, b, c))
        lo, hi = round_to_half_bits(x * y + z, half)
        return _pair(lo, hi)

    return fma2


def _twin_fma2_splat(which: int):
    def factory(half: str):
        fma2 = _twin_fma2(half)

        def fma2_splat(a, b, c):
            picked = (int(b) >> (16 * which)) & 0xFFFF
            return fma2(a, np.uint32(picked | picked << 16), c)

        return fma2_splat

    return factory


def _twin_pack2(half: str):
    def pack2(lo, hi):
        lo_bits, hi_bits = round_to_half_bits(np.float64(np.float32(lo)), half), round_to_half_bits(
            np.float64(np.float32(hi)), half)
        return _pair(lo_bits, hi_bits)

    return pack2


def _twin_to_half(half: str):
    def to_half(x):
        return np.uint32(round_to_half_bits(np.float64(np.float32(x)), half))

    return to_half


def _twin_and_or(a, mask, bits):
    return np.uint32((int(a) & int(mask) | int(bits)) & 0xFFFFFFFF)


def _twin_byte_perm(a, b, selector):
    """prmt.b32's default mode: result byte i is byte (selector nibble i) & 7 of b:a,
    replicated sign bit where the nibble's bit 3 is set."""
    source, result = (int(b) & 0xFFFFFFFF) << 32 | int(a) & 0xFFFFFFFF, 0
    for i in range(4):
        nibble = (int(selector) >> 4 * i) & 0xF
        byte = (source >> 8 * (nibble & 7)) & 0xFF
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        result |= byte << 8 * i
    return np.uint32(result)


def _twin_f16_to_f32(h):
    return np.float32(np.uint16(int(h) & 0xFFFF).view(np.float16))


class _Group:
    """The threads of one warp or warpgroup of a simulated block, meeting in collective
    instructions. Each member hands `meet` its operands; the last to arrive computes the
    instruction from all of them, and every member gets that result back. One wait a member
    per instruction: the simulator runs each thread as a Python thread, and every extra
    barrier phase is another round of wake-ups for all of them."""

    # A member that never arrives (a diverged mma) fails the others after this long instead
    # of hanging the simulator. Generous: on a loaded 2-core CI machine the simulator's
    # hundreds of Python threads once took over 120 s to bring a warp's lanes together.
    TIMEOUT_SECONDS = 600

    def __init__(self, size: int):
        self.size = size
        self.operands = [None] * size
        self.arrived = 0
        self.generation = 0
        self.result = self.error = None
        self.done = threading.Condition()
        self.open, self.committed = [], []  # a warpgroup's mma reads, not yet waited for

    def meet(self, member: int, operands, compute):
        """compute(operands of every member, in member order), computed once."""
        with self.done:
            self.operands[member] = operands
            self.arrived += 1
            generation = self.generation
            if self.arrived == self.size:
                try:
                    self.result, self.error = compute(self.operands), None
                except Exception as error:  # every member raises it, none waits for ever
                    self.result, self.error = None, error
                self.arrived, self.generation = 0, generation + 1
                self.done.notify_all()
            elif not self.done.wait_for(lambda: self.generation != generation, self.TIMEOUT_SECONDS):
                raise RuntimeError(f"{self.size - self.arrived} of {self.size} threads never reached a collective "
                                   f"instruction (mma, ldmatrix, wgmma) that every one of them must execute")
            if self.error is not None:
                raise self.error
            return self.result  # the next instruction cannot complete before this member arrives


_groups_lock = threading.Lock()


def _group(size: int) -> tuple[int, _Group]:
    """(index in its group, the group) of the calling simulated thread, for groups of `size`
    consecutive threads of its block (a warp, a warpgroup)."""
    thread = threading.current_thread()
    manager = thread._manager  # the simulator's BlockManager of this block
    number, index = divmod(thread.thread_id, size)
    key = f"_numba_moe_groups_of_{size}"
    group = manager.__dict__.get(key, {}).get(number)
    if group is None:  # the lock only to create: taken per call, its unfairness convoys
        with _groups_lock:
            group = manager.__dict__.setdefault(key, {}).setdefault(number, _Group(size))
    return index, group


def _warp():
    """(lane, warp) of the calling simulated thread."""
    return _group(32)


_LANE_G, _LANE_T = np.arange(32) // 4, np.arange(32) % 4


def _a_tile(halves: np.ndarray) -> np.ndarray:
    """The 16 x 16 A tile of a warp's fragments a0..a3, (32 lanes, 4, 2 halves) as values
    (module docstring: mma's and a warpgroup mma's warp share the layout)."""
    a = np.zeros((16, 16))
    for col in (0, 1):
        a[_LANE_G, 2 * _LANE_T + col] = halves[:, 0, col]
        a[_LANE_G + 8, 2 * _LANE_T + col] = halves[:, 1, col]
        a[_LANE_G, 2 * _LANE_T + 8 + col] = halves[:, 2, col]
        a[_LANE_G + 8, 2 * _LANE_T + 8 + col] = halves[:, 3, col]
    return a


def _c_tile(accum: np.ndarray) -> np.ndarray:
    """The 16 x 8 C tile of a warp's accumulators c0..c3, (32 lanes, 4)."""
    c = np.zeros((16, 8))
    for col in (0, 1):
        c[_LANE_G, 2 * _LANE_T + col] = accum[:, col]
        c[_LANE_G + 8, 2 * _LANE_T + col] = accum[:, 2 + col]
    return c


def _twin_mma(half: str):
    """m16n8k16 as the hardware defines its fragments (module docstring); every lane of
    the warp must call it, as with the real instruction."""

    def multiply(lanes):
        halves = _halves_to_f64(np.array([s[:6] for s in lanes], dtype=np.uint64), half)  # (32, 6, 2)
        b = np.zeros((16, 8))
        for col in (0, 1):
            b[2 * _LANE_T + col, _LANE_G] = halves[:, 4, col]
            b[2 * _LANE_T + 8 + col, _LANE_G] = halves[:, 5, col]
        c = _c_tile(np.array([s[6:] for s in lanes], dtype=np.float64))
        return (_a_tile(halves) @ b + c).astype(np.float32)

    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        lane, warp = _warp()
        d = warp.meet(lane, (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), multiply)
        g, t = divmod(lane, 4)
        return d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1]

    return mma


def _warpgroup():
    """(thread in warpgroup, warpgroup) of the calling simulated thread."""
    block_dim = threading.current_thread()._manager._block_dim
    if int(np.prod(block_dim)) % 128:
        raise ValueError(f"warpgroup_mma needs blocks of whole warpgroups (128 threads), got {block_dim}")
    return _group(128)


def _core_matrix_words(offset: int, lbo: int, sbo: int, n: int) -> np.ndarray:
    """(16, n) flat word indices and half (0 low, 1 high) of a K-major operand's elements
    (k, col) in shared memory: B's columns, or A's rows (col = row)."""
    k, col = np.meshgrid(np.arange(16), np.arange(n), indexing="ij")
    byte = 4 * offset + (col // 8) * sbo + (k // 8) * lbo + (col % 8) * 16 + (k % 8) * 2
    return byte // 4, (byte // 2) % 2


def _read_core_matrices(flat, offset, lbo, sbo, n: int, half: str, group: _Group) -> np.ndarray:
    """The (16, n) values a descriptor names, remembered with the words read (for the
    wait's check that they are not overwritten while the mma may still read them)."""
    if (4 * int(offset)) % 16 or int(lbo) % 16 or int(sbo) % 16:
        raise ValueError("warpgroup_mma: a shared tile's address, lbo and sbo must be multiples of 16 bytes")
    words, which = _core_matrix_words(int(offset), int(lbo), int(sbo), n)
    read = np.array(flat[words], np.uint32)
    group.open.append((flat, words, read))
    return _halves_to_f64(read, half)[np.arange(16)[:, None], np.arange(n)[None, :], which]


def _twin_warpgroup(half: str, n: int, a_in_shared: bool):
    """wgmma m64nNk16 with A from registers or shared memory (module docstring), computed
    at issue; each mma remembers the shared words it read so that `warpgroup_wait` can
    check them."""
    regs = n // 2

    def multiply(a_words, shared, a_tile, b_tile, acc, first):
        index, group = _warpgroup()
        flat_acc = acc.reshape(-1)

        def compute(threads):
            a, d = np.zeros((64, 16)), np.zeros((64, n))
            flat = shared.reshape(-1)
            if a_in_shared:
                a = _read_core_matrices(flat, *a_tile, 64, half, group).T
            for warp in range(4):
                lanes = threads[32 * warp: 32 * warp + 32]
                accs = np.array([s[1] for s in lanes], dtype=np.float64).reshape(32, regs // 4, 4)
                if not a_in_shared:  # each warp a 16-row m16n8k16 A tile...
                    halves = _halves_to_f64(np.array([s[0] for s in lanes], dtype=np.uint64), half)  # (32, 4, 2)
                    a[16 * warp:16 * warp + 16] = _a_tile(halves)
                for j in range(n // 8):  # ...and a C tile per n8 column tile
                    d[16 * warp:16 * warp + 16, 8 * j:8 * j + 8] = _c_tile(accs[:, j])
            b = _read_core_matrices(flat, *b_tile, n, half, group)
            return (a @ b + d).astype(np.float32)

        d = group.meet(index, (a_words, tuple(flat_acc[first:first + regs])), compute)
        warp, lane = divmod(index, 32)
        rows = 16 * warp + lane // 4
        cols = 2 * (lane % 4) + 8 * np.arange(n // 8)
        out = np.stack([d[rows, cols], d[rows, cols + 1], d[rows + 8, cols], d[rows + 8, cols + 1]], axis=1)
        flat_acc[first:first + regs] = out.reshape(-1)

    if a_in_shared:
        def shared_warpgroup_mma(shared, a_offset, a_lbo, a_sbo, b_offset, b_lbo, b_sbo, acc, first):
            multiply(None, shared, (a_offset, a_lbo, a_sbo), (b_offset, b_lbo, b_sbo), acc, first)

        return shared_warpgroup_mma

    def warpgroup_mma(a0, a1, a2, a3, shared, offset, lbo, sbo, acc, first):
        multiply((a0, a1, a2, a3), shared, None, (offset, lbo, sbo), acc, first)

    return warpgroup_mma


def _twin_warpgroup_commit():
    index, group = _warpgroup()

    def commit(_):
        group.committed.append(group.open)
        group.open = []

    group.meet(index, None, commit)


def _twin_warpgroup_wait(newest: int):
    def warpgroup_wait():
        index, group = _warpgroup()

        def check(_):
            overwritten = False
            while len(group.committed) > newest:
                for flat, words, read in group.committed.pop(0):
                    overwritten |= not np.array_equal(flat[words], read)
            if overwritten:
                raise RuntimeError("warpgroup_mma: a shared tile it read was overwritten before the warpgroup_wait "
                                   "that covers it")

        group.meet(index, None, check)

    return warpgroup_wait


def _twin_load_words(count: int):
    def load(array, offset):
        flat = array.reshape(-1)
        size = flat.dtype.itemsize
        per_word, mask = 4 // size, (1 << 8 * size) - 1
        words = []
        for w in range(count):
            value = 0
            for b in range(per_word):
                value |= (int(flat[offset + w * per_word + b]) & mask) << (8 * size * b)
            words.append(np.uint32(value))
        return words[0] if count == 1 else tuple(words)

    return load


def _twin_load_bits(array, offset):
    return np.array(array.reshape(-1)[offset]).view(np.uint32)[()]


_arrival_lock = threading.Lock()


def _twin_arrive(array, offset):
    with _arrival_lock:
        flat = array.reshape(-1)
        old = np.uint32(flat[offset])
        flat[offset] = old + np.uint32(1)
    return old


_pending = threading.local()


def _twin_async_copies():
    """Copies are queued per thread and land when a wait lets their group complete."""

    def queue():
        if not hasattr(_pending, "groups"):
            _pending.open, _pending.groups = [], []
        return _pending

    def copy_async(shared, shared_offset, source, source_base, source_offset, source_bytes):
        chunk = np.zeros(16, np.uint8)
        if source_bytes:
            flat = source.reshape(-1)
            count = 16 // flat.dtype.itemsize
            first = int(source_base) + int(source_offset)
            chunk[:] = np.ascontiguousarray(flat[first:first + count]).view(np.uint8)
        queue().open.append((shared, int(shared_offset), chunk.view(np.uint32)))

    def commit_copies():
        state = queue()
        state.groups.append(state.open)
        state.open = []

    def wait(newest: int):
        def wait_copies():
            state = queue()
            while len(state.groups) > newest:
                for shared, offset, words in state.groups.pop(0):
                    shared.reshape(-1)[offset:offset + 4] = words

        return wait_copies

    return copy_async, commit_copies, {n: wait(n) for n in range(8)}


def _twin_ldmatrix4(shared, offset):
    lane, warp = _warp()
    flat = shared.reshape(-1)

    def load(rows):  # every lane's words read at once, as the instruction reads them
        return [tuple(np.uint32(flat[rows[8 * j + r // 4] + r % 4]) for j in range(4)) for r in range(32)]

    return warp.meet(lane, int(offset), load)[lane]


def _twin_f32_bits(x):
    return np.float32(x).view(np.uint32)


def _twin_bits_f32(u):
    return np.uint32(int(u) & 0xFFFFFFFF).view(np.float32)


# ---------------------------------------------------------------------------------------
# The GPU side: libdevice bit casts and the 16-byte load intrinsic.
# ---------------------------------------------------------------------------------------

def _gpu_bit_casts():
    from numba.cuda import libdevice

    @device
    def f32_bits(x):
        return uint32(libdevice.float_as_int(float32(x)))

    @device
    def bits_f32(u):
        return libdevice.int_as_float(int32(u))

    return f32_bits, bits_f32


def _gpu_fast_math():
    from numba.cuda import libdevice

    @device
    def exp_approx(x):
        return libdevice.fast_expf(float32(x))

    @device
    def divide_approx(a, b):
        return libdevice.fast_fdividef(float32(a), float32(b))

    return exp_approx, divide_approx


def _twin_exp_approx(x):
    with np.errstate(over="ignore"):
        return np.exp(np.float32(x))


def _twin_divide_approx(a, b):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.float32(a) / np.float32(b)


def _element_pointer(context, builder, array_type, array, offset_type, offset):
    """Generic address of flat element `offset` of a C-contiguous array."""
    struct = context.make_array(array_type)(context, builder, value=array)
    return builder.gep(struct.data, [context.cast(builder, offset, offset_type, types.int64)])


def _shared_pointer(context, builder, array_type, array, offset_type, offset):
    """Shared-window address of flat element `offset` of a shared array. Numba hands
    kernels a shared array's generic pointer; casting it back lets LLVM fold the pair of
    casts into the array's symbol, so the address is a constant plus the offset."""
    from llvmlite import ir

    struct = context.make_array(array_type)(context, builder, value=array)
    shared = builder.addrspacecast(struct.data, ir.PointerType(struct.data.type.pointee, addrspace=3))
    return builder.gep(shared, [context.cast(builder, offset, offset_type, types.int64)])


def _check_flat(array, *offsets):
    if not (isinstance(array, types.Array) and isinstance(array.dtype, (types.Integer, types.Float))
            and array.layout == "C"
            and all(isinstance(offset, types.Integer) for offset in offsets)):
        raise TypeError(f"needs a C-contiguous integer or float array and integer offsets, got {array}, {offsets}")


def _gpu_read(asm: str, count: int, address, in_place: bool = False):
    """An intrinsic (array, flat offset) -> `count` uint32 words, the result of `asm`
    ($0 .. $count-1 the words, $count the address from `address`). An `in_place`
    instruction (the warp's collective ldmatrix, an atomic) is never moved across a
    barrier or another memory access, nor dropped."""
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    constraints = ",".join(["=r"] * count + ["l"] + (["~{memory}"] if in_place else []))

    @intrinsic
    def read(typingctx, array, offset):
        _check_flat(array, offset)
        signature = (types.uint32 if count == 1 else types.UniTuple(types.uint32, count))(array, offset)

        def codegen(context, builder, sig, args):
            pointer = address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            i32 = ir.IntType(32)
            result_type = i32 if count == 1 else ir.LiteralStructType([i32] * count)
            loaded = builder.call(ir.InlineAsm(ir.FunctionType(result_type, [pointer.type]), asm, constraints,
                                               side_effect=in_place), [pointer])
            if count == 1:
                return loaded
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(loaded, n) for n in range(count)])

        return signature, codegen

    return read


def _gpu_word_load(count: int, space: str):
    """Load `count` words from an array in `space` ("global": read-only path; "shared")."""
    vector = {1: "", 2: ".v2", 4: ".v4"}[count]
    outputs = ", ".join(f"${n}" for n in range(count))
    outputs = f"{{{outputs}}}" if count > 1 else outputs
    asm = f"ld.{'global.nc' if space == 'global' else 'shared'}{vector}.u32 {outputs}, [${count}];"
    return _gpu_read(asm, count, _element_pointer if space == "global" else _shared_pointer)


def _statement(asm, operand_types=(), constraints=""):
    """Emitter of an instruction with no result, kept in place: a compiler barrier to memory."""
    from llvmlite import ir

    def emit(builder, operands=()):
        clobbers = ",".join(filter(None, [constraints, "~{memory}"]))
        builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), list(operand_types)), asm, clobbers,
                                  side_effect=True), list(operands))
    return emit


def _gpu_async_copies():
    """copy_async, commit_copies and wait_copies[n] (n = 0 .. 7) as intrinsics."""
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    @intrinsic
    def copy_async(typingctx, shared, shared_offset, source, source_base, source_offset, source_bytes):
        _check_flat(shared, shared_offset)
        _check_flat(source, source_base, source_offset, source_bytes)

        def codegen(context, builder, sig, args):
            target = _shared_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            # Two steps: the pointer to `source_base` is one value that every copy from the
            # same base shares (computed once), each copy then adds its own offset. The move
            # hides the pointer from LLVM, which would otherwise fold the two offsets into one
            # 64-bit sum per copy.
            base = _element_pointer(context, builder, sig.args[2], args[2], sig.args[3], args[3])
            base = builder.call(ir.InlineAsm(ir.FunctionType(base.type, [base.type]), "mov.b64 $0, $1;", "=l,l"),
                                [base])
            origin = builder.gep(base, [context.cast(builder, args[4], sig.args[4], types.int64)])
            size = context.cast(builder, args[5], sig.args[5], types.uint32)
            emit = _statement("cp.async.cg.shared.global [$0], [$1], 16, $2;", (target.type, origin.type, ir.IntType(32)),
                             "l,l,r")
            emit(builder, (target, origin, size))
            return context.get_dummy_value()

        return types.void(shared, shared_offset, source, source_base, source_offset, source_bytes), codegen

    @intrinsic
    def commit_copies(typingctx):
        def codegen(context, builder, sig, args):
            _statement("cp.async.commit_group;")(builder)
            return context.get_dummy_value()

        return types.void(), codegen

    def wait(newest: int):
        @intrinsic
        def wait_copies(typingctx):
            def codegen(context, builder, sig, args):
                _statement(f"cp.async.wait_group {newest};")(builder)
                return context.get_dummy_value()

            return types.void(), codegen

        return wait_copies

    return copy_async, commit_copies, {n: wait(n) for n in range(8)}


def _gpu_warpgroup(half: str, n: int, a_in_shared: bool):
    """warpgroup_mma (A words in registers) or shared_warpgroup_mma (A in shared memory)
    for `half` operands and n columns, an intrinsic: the accumulators are loaded from
    their array, pass through one inline-asm statement (each tied to its output) and are
    stored back; in a local array indexed by constants they are registers, which ptxas
    keeps in place from one mma to the next (no moves between HGMMA)."""
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    regs, kind = n // 2, "bf16" if half == "bfloat16" else "f16"
    outputs = ",".join(f"${i}" for i in range(regs))
    if a_in_shared:  # operands: A's and B's descriptors; scale-d, scale-a, scale-b, both K-major
        asm = (f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind} {{{outputs}}}, ${2 * regs}, "
               f"${2 * regs + 1}, 1, 1, 1, 0, 0;")
        constraints = ",".join(["=f"] * regs + [str(i) for i in range(regs)] + ["l", "l"])
    else:  # operands: A's 4 words, B's descriptor; scale-d, scale-a, scale-b, B K-major
        a = ",".join(f"${2 * regs + i}" for i in range(4))
        asm = (f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind} {{{outputs}}}, {{{a}}}, ${2 * regs + 4}, "
               f"1, 1, 1, 0;")
        constraints = ",".join(["=f"] * regs + [str(i) for i in range(regs)] + ["r"] * 4 + ["l"])

    def descriptor(context, builder, arg_types, values):
        """The 64-bit matrix descriptor of (shared, offset, lbo, sbo): bits 17 .. 4 of the
        shared address, of lbo (at bit 16) and of sbo (at 32)."""
        i64 = ir.IntType(64)
        address = builder.ptrtoint(_shared_pointer(context, builder, arg_types[0], values[0], arg_types[1], values[1]), i64)

        def field(value, shift):
            return builder.shl(builder.and_(builder.lshr(value, ir.Constant(i64, 4)), ir.Constant(i64, 0x3FFF)),
                               ir.Constant(i64, shift))

        lbo, sbo = (context.cast(builder, values[i], arg_types[i], types.int64) for i in (2, 3))
        return builder.or_(builder.or_(field(address, 0), field(lbo, 16)), field(sbo, 32))

    def multiply(context, builder, sig, args, operands, acc: int):
        """The asm statement on `operands`, the accumulators of args[acc], args[acc + 1]."""
        i64, f32 = ir.IntType(64), ir.FloatType()
        base = _element_pointer(context, builder, sig.args[acc], args[acc], sig.args[acc + 1], args[acc + 1])
        slots = [builder.gep(base, [ir.Constant(i64, i)]) for i in range(regs)]
        fn = ir.FunctionType(ir.LiteralStructType([f32] * regs), [f32] * regs + [o.type for o in operands])
        new = builder.call(ir.InlineAsm(fn, asm, constraints, side_effect=True),
                           [builder.load(slot) for slot in slots] + operands)
        for i, slot in enumerate(slots):
            builder.store(builder.extract_value(new, i), slot)
        return context.get_dummy_value()

    def check_accumulators(acc, first, integers):
        _check_flat(acc, first)
        if acc.dtype != float32 or not all(isinstance(x, types.Integer) for x in integers):
            raise TypeError(f"warpgroup mma needs integer A words or offsets, lbo and sbo, and a float32 "
                            f"accumulator array with an integer offset, got {acc}")

    if a_in_shared:
        @intrinsic
        def shared_warpgroup_mma(typingctx, shared, a_offset, a_lbo, a_sbo, b_offset, b_lbo, b_sbo, acc, first):
            _check_flat(shared, a_offset)
            _check_flat(shared, b_offset)
            check_accumulators(acc, first, (a_lbo, a_sbo, b_lbo, b_sbo))

            def codegen(context, builder, sig, args):
                a = descriptor(context, builder, sig.args[:4], args[:4])
                b = descriptor(context, builder, (sig.args[0],) + sig.args[4:7], (args[0],) + tuple(args[4:7]))
                return multiply(context, builder, sig, args, [a, b], 7)

            return types.void(shared, a_offset, a_lbo, a_sbo, b_offset, b_lbo, b_sbo, acc, first), codegen

        return shared_warpgroup_mma

    @intrinsic
    def warpgroup_mma(typingctx, a0, a1, a2, a3, shared, offset, lbo, sbo, acc, first):
        _check_flat(shared, offset)
        check_accumulators(acc, first, (a0, a1, a2, a3, lbo, sbo))

        def codegen(context, builder, sig, args):
            words = [context.cast(builder, args[i], sig.args[i], types.uint32) for i in range(4)]
            return multiply(context, builder, sig, args, words + [descriptor(context, builder, sig.args[4:8], args[4:8])], 8)

        return types.void(a0, a1, a2, a3, shared, offset, lbo, sbo, acc, first), codegen

    return warpgroup_mma


@functools.cache
def hopper() -> bool:
    """Whether the GPU has the sm_90 instructions of programmatic dependent launch (kernels
    compile for the current device; the first one asked answers for the process)."""
    return cuda.get_current_device().compute_capability >= (9, 0)


def _gpu_statement(asm: str, emitted=lambda: True):
    """An intrinsic () -> None emitting `asm`, kept in place, where `emitted()` (checked
    at compile time) says so: the grid-dependency controls are emitted on Hopper and
    later, nothing before."""
    from numba.cuda.extending import intrinsic

    @intrinsic
    def statement(typingctx):
        def codegen(context, builder, sig, args):
            if emitted():
                _statement(asm)(builder)
            return context.get_dummy_value()

        return types.void(), codegen

    return statement


def _twin_no_op():
    pass


# ---------------------------------------------------------------------------------------
# Public selection: the helper for this mode.
# ---------------------------------------------------------------------------------------

f32_bits, bits_f32 = (_twin_f32_bits, _twin_bits_f32) if SIMULATED else _gpu_bit_casts()
# exp_approx(x), divide_approx(a, b): float32 e^x and a / b from the special-function unit
# (ex2.approx of x log2 e; a times rcp.approx b), a few ulp from the correctly rounded
# results, in four instructions instead of libdevice's expf and IEEE division (tens, and
# a slow-path branch). divide_approx gives 0 for 2^126 < |b| < 2^128. The twins compute
# exactly: the GPU tests hold the approximations to the references' tolerances.
exp_approx, divide_approx = (_twin_exp_approx, _twin_divide_approx) if SIMULATED else _gpu_fast_math()
# load_words[n](array, offset): n = 1, 2 or 4 little-endian 32-bit words starting at flat
# element `offset` of a C-contiguous integer array of any width (the address must be
# aligned to the load's size); read-only cache path. No index arithmetic beyond one add.
load_words = {n: _twin_load_words(n) if SIMULATED else _gpu_word_load(n, "global") for n in (1, 2, 4)}
# load_shared[n](shared, offset): the same from a uint32 shared array.
load_shared = {n: _twin_load_words(n) if SIMULATED else _gpu_word_load(n, "shared") for n in (1, 2, 4)}
# load_coherent(array, offset): the 32-bit word at flat element `offset` of a 32-bit array,
# cached in L2 only: words another CTA of the same launch wrote (published by `arrive`) are
# read as written, never from a stale L1 line (`epilogue`).
load_coherent = _twin_load_bits if SIMULATED else _gpu_read("ld.global.cg.u32 $0, [$1];", 1, _element_pointer)
# arrive(counters, i): adds 1 to flat element `i` of a 32-bit counter array and returns the
# old value, as a release and an acquire at GPU scope. After a `syncthreads`, one thread's
# arrive publishes the stores of its whole CTA (the barrier orders them before it), and
# the CTA that sees the last arrival reads every other CTA's stores after a `syncthreads`:
# no `threadfence` (a sequentially consistent fence, in every thread) on either side. The
# pattern of CUTLASS's semaphore (`epilogue`).
arrive = _twin_arrive if SIMULATED else _gpu_read("atom.acq_rel.gpu.global.add.u32 $0, [$1], 1;", 1, _element_pointer,
                                                  in_place=True)
# copy_async(shared, i, source, base, j, source_bytes): 16 bytes from flat element base + j
# of a global array to shared word i (both 16-byte aligned); bytes past source_bytes (0 or
# 16) are zero. `base` is what a stage's copies share (its offset along K): the pointer to
# it is derived once, and each copy adds its own `j`, so 32-bit offsets cost one address
# computation per copy.
# commit_copies() closes a group; wait_copies[n]() waits for all groups but the newest n.
copy_async, commit_copies, wait_copies = _twin_async_copies() if SIMULATED else _gpu_async_copies()
# ldmatrix4(shared, i): the warp's four 8x8 half matrices, lane l naming a row at word i.
ldmatrix4 = _twin_ldmatrix4 if SIMULATED else _gpu_read(
    "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];", 4, _shared_pointer, in_place=True)
# Programmatic dependent launch (module docstring): wait_for_previous() blocks until the
# kernel before has finished; release_next() lets the kernel after start launching.
wait_for_previous = _twin_no_op if SIMULATED else _gpu_statement("griddepcontrol.wait;", hopper)
release_next = _twin_no_op if SIMULATED else _gpu_statement("griddepcontrol.launch_dependents;", hopper)
# Warpgroup mma (module docstring): fence, commit and wait for `warpgroup_mma`'s groups.
warpgroup_fence = _twin_no_op if SIMULATED else _gpu_statement("wgmma.fence.sync.aligned;")
warpgroup_commit = _twin_warpgroup_commit if SIMULATED else _gpu_statement("wgmma.commit_group.sync.aligned;")
warpgroup_wait = {n: _twin_warpgroup_wait(n) if SIMULATED else _gpu_statement(f"wgmma.wait_group.sync.aligned {n};")
                  for n in range(8)}
# async_proxy_fence(): this thread's shared-memory stores (words of an A or B tile) become
# visible to the tensor cores' reads of a later warpgroup mma (after a barrier for other
# threads' stores).
async_proxy_fence = _twin_no_op if SIMULATED else _gpu_statement("fence.proxy.async.shared::cta;")
_load4 = load_words[4]
# and_or(a, mask, bits) = (a & mask) | bits in one instruction (ptxas splits the pair when
# both constants are immediates): the int4 code -> magic-half step of dequantisation.
# byte_perm(a, b, selector): bytes of b:a picked by the selector's nibbles (prmt.b32).
and_or = _twin_and_or if SIMULATED else _declared()["and_or"]
byte_perm = _twin_byte_perm if SIMULATED else _declared()["byte_perm"]


@device
def load_u32x4(array, i, j, k):
    """array[i, j, k:k+4] of a 3-D C-contiguous 32-bit array as one 16-byte load (k a
    multiple of 4, rows 16-byte aligned), as int32 words."""
    w0, w1, w2, w3 = _load4(array, (int64(i) * array.shape[1] + j) * array.shape[2] + k)
    return int32(w0), int32(w1), int32(w2), int32(w3)


def _helper(half: str, twin, stem: str):
    """The helper `stem` for `half` operands: its simulator twin, or the linked PTX wrapper."""
    _check_half(half)
    return twin(half) if SIMULATED else _declared()[f"{stem}_{'bf16' if half == 'bfloat16' else 'f16'}"]


@functools.cache
def mma(half: str):
    """Warp-collective D = A @ B + C, m16n8k16, `half` operands, float32 accumulators."""
    return _helper(half, _twin_mma, "mma")


WARPGROUP_COLUMNS = tuple(range(8, 257, 8))


def _check_columns(n: int) -> None:
    if n not in WARPGROUP_COLUMNS:
        raise ValueError(f"warpgroup mma columns n must be a multiple of 8 from 8 to 256, got {n!r}")


@functools.cache
def warpgroup_mma(half: str, n: int):
    """Warpgroup-collective D = A @ B + D, m64nNk16, A in registers, B in shared memory
    (module docstring), n / 2 float32 accumulators a thread, in place; sm_90a."""
    _check_half(half)
    _check_columns(n)
    return _twin_warpgroup(half, n, False) if SIMULATED else _gpu_warpgroup(half, n, False)


@functools.cache
def shared_warpgroup_mma(half: str, n: int):
    """warpgroup_mma with A (64 x 16) in shared memory too, K-major core matrices like B's
    (module docstring): (shared, a_offset, a_lbo, a_sbo, b_offset, b_lbo, b_sbo, acc, first)."""
    _check_half(half)
    _check_columns(n)
    return _twin_warpgroup(half, n, True) if SIMULATED else _gpu_warpgroup(half, n, True)


@functools.cache
def fma2(half: str):
    """Two half-precision fused multiply-adds on packed pairs, rounded to nearest even."""
    return _helper(half, _twin_fma2, "fma")


@functools.cache
def fma2_splat(half: str, which: int):
    """fma2(a, (b's half `which`, the same), c): b's low (0) or high (1) half multiplies
    both lanes, in the one instruction (HFMA2's operand swizzle)."""
    return _helper(half, _twin_fma2_splat(which), ("fma_lo", "fma_hi")[which])


@functools.cache
def pack2(half: str):
    """Two float32 -> one uint32 holding (lo, hi) as halves, rounded to nearest even."""
    return _helper(half, _twin_pack2, "pack")


@functools.cache
def to_half(half: str):
    """float32 -> half bit pattern (in a uint32), rounded to nearest even."""
    return _helper(half, _twin_to_half, "to")


@functools.cache
def half_to_f32(half: str):
    """Half bit pattern (any integer holding 16 bits) -> float32, exactly."""
    _check_half(half)
    if half == "float16":
        return _twin_f16_to_f32 if SIMULATED else _declared()["f16_to_f32"]

    @device
    def bf16_to_f32(h):
        return bits_f32((uint32(h) & uint32(0xFFFF)) << uint32(16))

    return bf16_to_f32
