"""The few instructions Numba's kernel language lacks, one PTX instruction per helper.

Numba has no tensor-core instruction, no packed half-precision arithmetic and no 16-byte
load. This module supplies exactly those, and nothing else:

=======================  ==================================  ==========================
helper                   PTX                                 used for
=======================  ==================================  ==========================
``mma(a, b, c)``         mma.sync.m16n8k16 (bf16 or f16)     the GEMMs' inner product
``fma2(a, b, c)``        fma.rn.{bf16x2,f16x2}               dequantising two codes
``pack2(lo, hi)``        cvt.rn.{bf16x2,f16x2}.f32           float32 pair -> half pair
``to_half(x)``           cvt.rn.{bf16,f16}.f32               one float32 -> half bits
``half_to_f32(h)``       cvt.f32.f16 (bf16: a shift)         half bits -> float32
``f32_bits / bits_f32``  mov.b32 (libdevice bit casts)       integer bit tricks
``load_u32x4(a, ...)``   load_words[4] at a[i, j, k]       16-byte loads by 3-D index
``load_words[n](a, i)``  ld.global.nc{,.v2,.v4}.u32          n words at flat element i
=======================  ==================================  ==========================

Every helper has a pure-Python *twin* with the same semantics, chosen automatically under
the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), so every kernel runs unchanged in CI.
The twin of the warp-collective ``mma`` gathers the 32 lanes' fragments through a
per-warp barrier, so it checks the fragment layout exactly as the hardware defines it:

    lane = 4 * g + t  (g = lane // 4, t = lane % 4), each register a pair of halves
    A (16x16, row-major):  a0 = A[g, 2t:2t+2]   a1 = A[g+8, 2t:2t+2]
                           a2 = A[g, 2t+8:2t+10] a3 = A[g+8, 2t+8:2t+10]
    B (16x8,  k-major):    b0 = B[2t:2t+2, g]    b1 = B[2t+8:2t+10, g]
    C, D (16x8, float32):  c0, c1 = C[g, 2t:2t+2]   c2, c3 = C[g+8, 2t:2t+2]

This is the only module that reaches below Numba's public kernel API (the vector load is
a Numba ``intrinsic``, like numba-cuda's own cache-hint loads); everything else in
``numba_kernels`` is plain ``cuda.jit`` Python. The C++ wrappers are linked with
``cuda.CUSource`` and inlined by link-time optimisation (kernels are built with
``lto=True`` through `kernel`).
"""

from __future__ import annotations

import functools
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
    """`cuda.jit(device=True)`, always inlined into its caller."""
    if SIMULATED:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


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

#define PACK2(NAME, TYPE)                                                                  \
extern "C" __device__ int NAME(unsigned* d, float lo, float hi) {                          \
  asm("cvt.rn." TYPE ".f32 %0, %1, %2;" : "=r"(*d) : "f"(hi), "f"(lo));                    \
  return 0;                                                                                \
}
PACK2(numba_moe_pack_bf16x2, "bf16x2")
PACK2(numba_moe_pack_f16x2, "f16x2")

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
        "pack_bf16": ("numba_moe_pack_bf16x2", pack_sig), "pack_f16": ("numba_moe_pack_f16x2", pack_sig),
        "to_bf16": ("numba_moe_to_bf16", uint32(float32)), "to_f16": ("numba_moe_to_f16", uint32(float32)),
        "f16_to_f32": ("numba_moe_f16_to_f32", float32(uint32)),
    }
    return {key: cuda.declare_device(name, sig, link=source) for key, (name, sig) in names.items()}


# ---------------------------------------------------------------------------------------
# Python twins (simulator): the same numbers through numpy.
# ---------------------------------------------------------------------------------------

def _halves_to_f64(words, half: str) -> np.ndarray:
    """(..., 2) float64 values of the low and high halves of uint32 words."""
    words = np.asarray(words, np.uint64).astype(np.uint32)
    pairs = np.stack([words & 0xFFFF, words >> 16], axis=-1).astype(np.uint16)
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


def _twin_f16_to_f32(h):
    return np.float32(np.uint16(int(h) & 0xFFFF).view(np.float16))


_warp_lock = threading.Lock()


def _warp_state():
    """(lane, per-warp state) of the calling simulated thread; state is per block."""
    thread = threading.current_thread()
    manager = thread._manager  # the simulator's BlockManager of this block
    warp, lane = divmod(thread.thread_id, 32)
    with _warp_lock:
        warps = manager.__dict__.setdefault("_numba_moe_warps", {})
        if warp not in warps:
            warps[warp] = {"slots": [None] * 32, "barrier": threading.Barrier(32, timeout=120), "result": None}
    return lane, warps[warp]


def _twin_mma(half: str):
    """m16n8k16 as the hardware defines its fragments (module docstring); every lane of
    the warp must call it, as with the real instruction."""
    lane_g = np.arange(32) // 4
    lane_t = np.arange(32) % 4

    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        lane, state = _warp_state()
        state["slots"][lane] = (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        state["barrier"].wait()
        if lane == 0:
            regs = np.array([s[:6] for s in state["slots"]], dtype=np.uint64)
            halves = _halves_to_f64(regs, half)  # (32, 6, 2)
            a, b = np.zeros((16, 16)), np.zeros((16, 8))
            for col in (0, 1):
                a[lane_g, 2 * lane_t + col] = halves[:, 0, col]
                a[lane_g + 8, 2 * lane_t + col] = halves[:, 1, col]
                a[lane_g, 2 * lane_t + 8 + col] = halves[:, 2, col]
                a[lane_g + 8, 2 * lane_t + 8 + col] = halves[:, 3, col]
                b[2 * lane_t + col, lane_g] = halves[:, 4, col]
                b[2 * lane_t + 8 + col, lane_g] = halves[:, 5, col]
            c = np.zeros((16, 8))
            accum = np.array([s[6:] for s in state["slots"]], dtype=np.float64)
            for col in (0, 1):
                c[lane_g, 2 * lane_t + col] = accum[:, col]
                c[lane_g + 8, 2 * lane_t + col] = accum[:, 2 + col]
            state["result"] = (a @ b + c).astype(np.float32)
        state["barrier"].wait()
        d = state["result"]
        g, t = divmod(lane, 4)
        return d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1]

    return mma


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


def _gpu_load_words(count: int):
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    vector = {1: "", 2: ".v2", 4: ".v4"}[count]
    outputs = ", ".join(f"${n}" for n in range(count))
    asm = f"ld.global.nc{vector}.u32 {{{outputs}}}, [${count}];" if count > 1 else "ld.global.nc.u32 $0, [$1];"

    @intrinsic
    def load_words(typingctx, array, offset):
        if not (isinstance(array, types.Array) and isinstance(array.dtype, types.Integer)
                and array.layout == "C" and isinstance(offset, types.Integer)):
            raise TypeError(f"load_words needs a C-contiguous integer array and an integer offset, got {array}, {offset}")
        signature = (types.uint32 if count == 1 else types.UniTuple(types.uint32, count))(array, offset)

        def codegen(context, builder, sig, args):
            struct = context.make_array(sig.args[0])(context, builder, value=args[0])
            index = context.cast(builder, args[1], sig.args[1], types.int64)
            pointer = builder.gep(struct.data, [index])
            i32 = ir.IntType(32)
            result_type = i32 if count == 1 else ir.LiteralStructType([i32] * count)
            load = ir.InlineAsm(ir.FunctionType(result_type, [pointer.type]), asm, ",".join(["=r"] * count + ["l"]))
            loaded = builder.call(load, [pointer])
            if count == 1:
                return loaded
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(loaded, n) for n in range(count)])

        return signature, codegen

    return load_words


# ---------------------------------------------------------------------------------------
# Public selection: the helper for this mode.
# ---------------------------------------------------------------------------------------

f32_bits, bits_f32 = (_twin_f32_bits, _twin_bits_f32) if SIMULATED else _gpu_bit_casts()
# load_words[n](array, offset): n = 1, 2 or 4 little-endian 32-bit words starting at flat
# element `offset` of a C-contiguous integer array of any width (the address must be
# aligned to the load's size); read-only cache path. No index arithmetic beyond one add.
load_words = {n: (_twin_load_words if SIMULATED else _gpu_load_words)(n) for n in (1, 2, 4)}
_load4 = load_words[4]


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


@functools.cache
def fma2(half: str):
    """Two half-precision fused multiply-adds on packed pairs, rounded to nearest even."""
    return _helper(half, _twin_fma2, "fma")


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
