"""The few instructions Numba's kernel language lacks, one PTX instruction per helper.

Numba has no tensor-core instruction, no packed half-precision arithmetic and no 16-byte
load or store. This module supplies exactly those, and nothing else:

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
``load_u32x4(a, ...)``   load_written[4] at a[i, j, k]     16-byte loads by 3-D index
``load_words[n](a, i)``  ld.global.nc{,.v2,.v4}.u32          n weight words at flat element i
``load_written[n](a, i)`` ld.global{,.v2,.v4}.u32            n words an earlier kernel wrote
``load_shared[n](s, i)`` ld.shared{,.v2,.v4}.u32             n words of a shared array
``store_words4(a, i,     st.global.v4.u32                    16-byte stores (stage
w0, w1, w2, w3)``                                            blocks)
``load_coherent(a, i)``  ld.global.cg.u32                    a word other CTAs wrote
``arrive(a, i)``         atom.acq_rel.gpu.global.add.u32     publish a CTA's stores
``copy_async(s, i, a,    cp.async.cg.shared.global 16        prefill: global -> shared
base, j, bytes)``                                            without registers
``commit_copies()``      cp.async.commit_group               close a pipeline stage
``wait_copies[n]()``     cp.async.wait_group n               all but the newest n stages
``ldmatrix4(s, i)``      ldmatrix.sync.m8n8.x4.shared.b16    A fragments from shared
``store_matrix4t(s, i,   stmatrix.sync.m8n8.x4.trans         accumulators to shared
w0, w1, w2, w3)``        .shared.b16                         memory, transposed
``sync_warp()``          bar.warp.sync                       the warp's lanes' stores
                                                             seen by its other lanes
``wait_for_previous()``  griddepcontrol.wait                 early-launched kernels
``release_next()``       griddepcontrol.launch_dependents    let the next kernel start
``warpgroup_mma(h, n)``  wgmma.mma_async.m64nNk16, A in      Hopper's asynchronous
(a0..a3, s, i, lbo,      registers, B in shared memory       tensor cores (measured by
sbo, acc, j)             (a matrix descriptor)               ``benchmarks/tensor_rates``)
``shared_warpgroup_mma  the same, A in shared memory too    its rate beside A in
(h, n)(s, i, lbo, sbo,   (a second descriptor)               registers (tensor_rates)
j, lbo, sbo, acc, j)``
``async_proxy_fence()``  fence.proxy.async.shared::cta       threads' stores -> wgmma
``barrier_sync(b, n)()``  bar.sync b, n                    producer and consumer
``barrier_arrive(b, n)()`` bar.arrive b, n                  warps handing buffers over
``warpgroup_fence()``    wgmma.fence                         before a group's first mma
``warpgroup_commit()``   wgmma.commit_group                  close a group of mma
``warpgroup_wait[n]()``  wgmma.wait_group n                  all but the newest n groups
``mbarrier_init(s, i,    mbarrier.init.shared::cta.b64       a transaction barrier of
count)``                                                     `count` arrivals a phase
``mbarrier_expect_bytes  mbarrier.arrive.expect_tx           arrive; the phase also
(s, i, bytes)``                                              waits for `bytes` of copies
``bulk_copy(s, i, a, j,  cp.async.bulk.shared::cluster       one copy of many bytes,
bytes, m)``              .global.mbarrier::complete_tx       counted on barrier m
``mbarrier_wait(s, i,    mbarrier.try_wait.parity, in a      until the phase of that
parity)``                loop                                parity has completed
=======================  ==================================  ==========================

``wait_for_previous`` and ``release_next`` are Hopper instructions (sm_90) of
*programmatic dependent launch*: a
kernel launched with that attribute (`launch.Launcher`) may start while the kernel
before it still runs, once that one's CTAs have all called ``release_next`` or exited;
``wait_for_previous`` then blocks until the earlier kernel has finished and its writes
are visible. A kernel so launched must wait before it reads anything an earlier kernel
of the stream wrote, or writes anything one reads; even what a kernel that finished long
before wrote: until the wait the SM's L1 may hold an older copy of the line (the one such
read, gemm2's alignment in its first wave, goes to the L2: ``load_coherent``). And it
reads such data with plain loads (``load_written``), never the read-only path
(``load_words``, for weights), whose loads ptxas may issue before the wait. On older
GPUs, and under the simulator, both are no-ops (there kernels run in stream order anyway).

Shared-memory addresses are flat word offsets into a ``uint32`` shared array (the
helpers address it in the shared window, see `_shared_pointer`). The asynchronous copies
follow the hardware's rules, and so do their twins: a copy lands only when a
``wait_copies`` lets its committed group complete, so a kernel that reads a stage too
early reads stale words under the simulator too. An *mbarrier* is a 64-bit word of
shared memory (at an even word offset) that counts a phase's arrivals and the bytes of
the bulk copies that complete on it: ``mbarrier_init`` sets the arrivals a phase (one
thread inits, then a ``syncthreads`` before any thread uses it), ``mbarrier_expect_bytes``
arrives and adds the bytes the phase waits for, and ``bulk_copy`` counts its bytes
(a multiple of 16, both addresses 16-byte aligned) off when they land. A phase
completes when both counts reach zero; ``mbarrier_wait(parity)`` returns once the phase
of that parity (the phase number mod 2) has completed. The twin lands a phase's copies
when the phase completes, so a thread that reads before its wait reads stale words. A
bulk copy writes through the async proxy, as the tensor cores read: shared words that
threads wrote and a bulk copy then overwrites need an ``async_proxy_fence`` (and a
barrier) between the two.
``ldmatrix4`` is warp-collective: lane
``l`` names row ``l % 8`` of matrix ``l // 8`` (four words of 16 bytes); register ``j``
of lane ``l`` receives word ``l % 4`` of row ``l // 4`` of matrix ``j`` -- for an A tile
whose lanes 0-15 name rows 0-15 at column word c and lanes 16-31 the same rows at c + 4,
exactly the mma's a0..a3.

Every helper has a pure-Python *twin* with the same semantics (`twins`), chosen
automatically under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), so every kernel runs
unchanged in CI. The twin of the warp-collective ``mma`` gathers the 32 lanes' fragments
(the last lane to arrive multiplies for the warp, `twins.Group`), so it checks the
fragment layout exactly as the hardware defines it:

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
them. The read half it does not always keep: a ``warpgroup_wait[0]`` after a main loop
that left a group in flight, in the block of the accumulators' stores, had the stores'
reads placed above it in the SASS (``gemm_specialized``, seventy-second session), so
wait for the last group in a last round peeled off the loop, straight-line code before
the stores, and check the SASS (``python -m tools.gemm_resources --specialized``). The
twin computes at issue and checks the shared half: it raises if an A or B tile changed
between an mma and the wait that covers it.

This is the only kernel code that reaches below Numba's public kernel API (the vector load is
a Numba ``intrinsic``, like numba-cuda's own cache-hint loads); everything else in
``numba_kernels`` is plain ``cuda.jit`` Python. The C++ wrappers are linked with
``cuda.CUSource`` and inlined by link-time optimisation (kernels are built with
``lto=True`` through `kernel`).
"""

from __future__ import annotations

import functools
import inspect

from numba import config, cuda, float32, int32, int64, types, uint32

from . import lean_compile, twins

SIMULATED = bool(config.ENABLE_CUDASIM)
if SIMULATED:
    from . import simulator

    simulator.share_block_arrays()
    simulator.wake_barriers_on_arrival()

HALF_TYPES = ("bfloat16", "float16")


def kernel(fn=None, **options):
    """`cuda.jit` for kernels: link-time optimisation on the GPU (so the PTX helpers
    inline; compiled without numba-cuda's unused PTX, `lean_compile`), plain simulation
    otherwise. Options the simulator lacks are dropped there."""
    if fn is None:
        return functools.partial(kernel, **options)
    if SIMULATED:
        return cuda.jit(fn)
    lean_compile.register(fn)
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


def _element_pointer(context, builder, array_type, array, offset_type, offset):
    """Generic address of flat element `offset` of a C-contiguous array."""
    struct = context.make_array(array_type)(context, builder, value=array)
    return builder.gep(struct.data, [context.cast(builder, offset, offset_type, types.int64)])


def _shared_base(context, builder, array_type, array):
    """Shared-window pointer to a shared array's first element. Numba hands kernels a
    shared array's generic pointer; casting it back lets LLVM fold the pair of casts into
    the array's symbol, so an address from it is a constant plus the offset."""
    from llvmlite import ir

    struct = context.make_array(array_type)(context, builder, value=array)
    return builder.addrspacecast(struct.data, ir.PointerType(struct.data.type.pointee, addrspace=3))


def _shared_pointer(context, builder, array_type, array, offset_type, offset):
    """Shared-window address of flat element `offset` of a shared array (`_shared_base`)."""
    return builder.gep(_shared_base(context, builder, array_type, array),
                       [context.cast(builder, offset, offset_type, types.int64)])


def _check_flat(array, *offsets):
    if not (isinstance(array, types.Array) and isinstance(array.dtype, (types.Integer, types.Float))
            and array.layout == "C"
            and all(isinstance(offset, types.Integer) for offset in offsets)):
        raise TypeError(f"needs a C-contiguous integer or float array and integer offsets, got {array}, {offsets}")


def _gpu_read(asm: str, count: int, address, in_place: bool = False, ordered: bool = False):
    """An intrinsic (array, flat offset) -> `count` uint32 words, the result of `asm`
    ($0 .. $count-1 the words, $count the address from `address`). An `in_place`
    instruction (the warp's collective ldmatrix, an atomic) is never moved across a
    barrier or another memory access, nor dropped; an `ordered` one is never moved across
    one (a load of what another kernel wrote stays after `wait_for_previous`)."""
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    constraints = ",".join(["=r"] * count + ["l"] + (["~{memory}"] if in_place or ordered else []))

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
    """Load `count` words from an array in `space`: "global.nc" (the read-only path, free
    to move), "global" (kept after `wait_for_previous`) or "shared" (kept after the
    copies' waits and the barriers)."""
    vector = {1: "", 2: ".v2", 4: ".v4"}[count]
    outputs = ", ".join(f"${n}" for n in range(count))
    outputs = f"{{{outputs}}}" if count > 1 else outputs
    asm = f"ld.{space}{vector}.u32 {outputs}, [${count}];"
    return _gpu_read(asm, count, _shared_pointer if space == "shared" else _element_pointer, ordered=space != "global.nc")


def _gpu_store4(name: str, asm: str, address):
    """An intrinsic (array, flat offset, w0, w1, w2, w3) -> None emitting `asm` ($0 the
    address from `address`, $1 .. $4 the words) on a C-contiguous 32-bit array, kept in
    place."""
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    @intrinsic
    def store4(typingctx, array, offset, w0, w1, w2, w3):
        _check_flat(array, offset)
        if array.dtype.bitwidth != 32 or not all(isinstance(word, types.Integer) for word in (w0, w1, w2, w3)):
            raise TypeError(f"{name} stores integer words to a 32-bit array, got {array}, {(w0, w1, w2, w3)}")

        def codegen(context, builder, sig, args):
            pointer = address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            words = [context.cast(builder, word, kind, types.uint32) for word, kind in zip(args[2:], sig.args[2:])]
            i32 = ir.IntType(32)
            _statement(asm, (pointer.type, i32, i32, i32, i32), "l,r,r,r,r")(builder, (pointer, *words))
            return context.get_dummy_value()

        return types.void(array, offset, w0, w1, w2, w3), codegen

    return store4


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
        shared address (at bit 0), of lbo (at 16) and of sbo (at 32). A CTA's shared memory
        is below 2**18 bytes, and wgmma's operands and the arrays start at multiples of 16
        bytes, so the address field is the array's base over 16 plus the offset's bytes
        over 16, no mask: with a constant offset, a wgmma's descriptor is one 32-bit add
        to a word computed once (each masked and shifted, as a 64-bit sum, it had taken
        seven uniform instructions a wgmma)."""
        i32, i64 = ir.IntType(32), ir.IntType(64)
        base = builder.ptrtoint(_shared_base(context, builder, arg_types[0], values[0]), i32)
        item_bytes = context.get_abi_sizeof(context.get_data_type(arg_types[0].dtype))
        offset_bytes = builder.mul(context.cast(builder, values[1], arg_types[1], types.uint32),
                                   ir.Constant(i32, item_bytes))

        def field(value, type_):
            value = context.cast(builder, value, type_, types.uint32)
            return builder.and_(builder.lshr(value, ir.Constant(i32, 4)), ir.Constant(i32, 0x3FFF))

        four = ir.Constant(i32, 4)
        low = builder.add(builder.add(builder.lshr(base, four), builder.shl(field(values[2], arg_types[2]), ir.Constant(i32, 16))),
                          builder.lshr(offset_bytes, four))
        high = builder.shl(builder.zext(field(values[3], arg_types[3]), i64), ir.Constant(i64, 32))
        return builder.or_(builder.zext(low, i64), high)

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


def _gpu_mbarriers():
    """mbarrier_init, mbarrier_expect_bytes, mbarrier_wait and bulk_copy as intrinsics
    (module docstring)."""
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    def barrier_statement(asm: str, check):
        """An intrinsic (shared, i, value) emitting `asm` on the shared address of word i
        ($0) and the 32-bit value ($1)."""

        @intrinsic
        def statement(typingctx, shared, offset, value):
            _check_flat(shared, offset)
            check(value)

            def codegen(context, builder, sig, args):
                barrier = _shared_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
                value = context.cast(builder, args[2], sig.args[2], types.uint32)
                _statement(asm, (barrier.type, ir.IntType(32)), "l,r")(builder, (barrier, value))
                return context.get_dummy_value()

            return types.void(shared, offset, value), codegen

        return statement

    def integer(value):
        if not isinstance(value, types.Integer):
            raise TypeError(f"an mbarrier's count, bytes or parity is an integer, got {value}")

    init = barrier_statement("mbarrier.init.shared::cta.b64 [$0], $1;", integer)
    expect = barrier_statement("mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", integer)
    # try_wait suspends the thread for a while if the phase is not complete; the loop
    # tries again until it is (the label is local to the braces' scope).
    wait = barrier_statement("{ .reg .pred complete; waiting: mbarrier.try_wait.parity.shared::cta.b64 complete, "
                             "[$0], $1; @!complete bra waiting; }", integer)

    @intrinsic
    def bulk_copy(typingctx, shared, shared_offset, source, source_offset, size, barrier_offset):
        _check_flat(shared, shared_offset, barrier_offset)
        _check_flat(source, source_offset, size)

        def codegen(context, builder, sig, args):
            target = _shared_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            origin = _element_pointer(context, builder, sig.args[2], args[2], sig.args[3], args[3])
            barrier = _shared_pointer(context, builder, sig.args[0], args[0], sig.args[5], args[5])
            size = context.cast(builder, args[4], sig.args[4], types.uint32)
            _statement("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
                       (target.type, origin.type, ir.IntType(32), barrier.type), "l,l,r,l")(
                builder, (target, origin, size, barrier))
            return context.get_dummy_value()

        return types.void(shared, shared_offset, source, source_offset, size, barrier_offset), codegen

    return init, expect, wait, bulk_copy


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



# ---------------------------------------------------------------------------------------
# Public selection: the helper for this mode.
# ---------------------------------------------------------------------------------------

f32_bits, bits_f32 = (twins.f32_bits, twins.bits_f32) if SIMULATED else _gpu_bit_casts()
# exp_approx(x), divide_approx(a, b): float32 e^x and a / b from the special-function unit
# (ex2.approx of x log2 e; a times rcp.approx b), a few ulp from the correctly rounded
# results, in four instructions instead of libdevice's expf and IEEE division (tens, and
# a slow-path branch). divide_approx gives 0 for 2^126 < |b| < 2^128. The twins compute
# exactly: the GPU tests hold the approximations to the references' tolerances.
exp_approx, divide_approx = (twins.exp_approx, twins.divide_approx) if SIMULATED else _gpu_fast_math()
# load_words[n](array, offset): n = 1, 2 or 4 little-endian 32-bit words starting at flat
# element `offset` of a C-contiguous integer array of any width (the address must be
# aligned to the load's size); read-only cache path. No index arithmetic beyond one add.
# For the weights only: the read-only path promises ptxas that nothing writes the array
# while the kernel runs, so it may issue such loads before `wait_for_previous`.
load_words = {n: twins.load_words(n) if SIMULATED else _gpu_word_load(n, "global.nc") for n in (1, 2, 4)}
# load_written[n](array, offset): the same for what an earlier kernel of the forward wrote
# (activations, partials): plain loads, which neither LLVM nor ptxas moves above
# `wait_for_previous`. As read-only loads, ptxas hoisted gemm2's first activation loads
# above its wait, and CUDA-graph replays beside other work now and then read the
# activation kernel's output before it was written (sixty-first session).
load_written = {n: twins.load_words(n) if SIMULATED else _gpu_word_load(n, "global") for n in (1, 2, 4)}
# load_shared[n](shared, offset): the same from a uint32 shared array, kept in order with
# the waits and barriers around it: words that copies (`copy_async`) or other threads
# write are read after the wait that lands them. As an asm without memory effects, LLVM
# moved a load whose address a loop did not change out of the loop, above every wait
# (sixty-sixth session; the tiles' machine code is the same either way).
load_shared = {n: twins.load_words(n) if SIMULATED else _gpu_word_load(n, "shared") for n in (1, 2, 4)}
# store_words4(array, offset, w0, w1, w2, w3): the four words to flat elements offset to
# offset + 3 of a C-contiguous 32-bit array, one 16-byte store (offset a multiple of 4,
# the array 16-byte aligned): four scalar stores at a 16-byte stride across a warp's
# lanes made the L2 take each warp's 512 bytes four times over.
store_words4 = twins.store_words4 if SIMULATED else _gpu_store4(
    "store_words4", "st.global.v4.u32 [$0], {$1, $2, $3, $4};", _element_pointer)
# store_matrix4t(shared, i, w0, w1, w2, w3): four 8x8 half matrices of the warp, each lane
# holding (row g, columns 2t, 2t + 1) of matrix j in word j as mma's accumulator tiles
# do, stored transposed: row r of matrix j (column r of the lane's view) as 16 bytes at
# word i of lane 8j + r of a uint32 shared array (a multiple of 4).
store_matrix4t = twins.store_matrix4t if SIMULATED else _gpu_store4(
    "store_matrix4t", "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [$0], {$1, $2, $3, $4};", _shared_pointer)
# sync_warp(): the warp's lanes meet, and each one's shared-memory stores before it are
# seen by the others' loads after it (the simulator's twins write at once: a no-op there).
sync_warp = twins.no_op if SIMULATED else _gpu_statement("bar.warp.sync -1;")
# load_coherent(array, offset): the 32-bit word at flat element `offset` of a 32-bit array,
# cached in L2 only: words another CTA of the same launch wrote (published by `arrive`:
# `epilogue`), or an earlier kernel wrote and this one reads before `wait_for_previous`
# (`gemm`'s alignment), are read as written, never from a stale L1 line. Ordered, as
# `load_shared`: never moved above the arrival that tells a CTA the words are there (the
# decode tiles' machine code is the same, sixty-sixth session).
load_coherent = twins.load_bits if SIMULATED else _gpu_read("ld.global.cg.u32 $0, [$1];", 1, _element_pointer,
                                                         ordered=True)
# arrive(counters, i): adds 1 to flat element `i` of a 32-bit counter array and returns the
# old value, as a release and an acquire at GPU scope. After a `syncthreads`, one thread's
# arrive publishes the stores of its whole CTA (the barrier orders them before it), and
# the CTA that sees the last arrival reads every other CTA's stores after a `syncthreads`:
# no `threadfence` (a sequentially consistent fence, in every thread) on either side. The
# pattern of CUTLASS's semaphore (`epilogue`).
arrive = twins.arrive if SIMULATED else _gpu_read("atom.acq_rel.gpu.global.add.u32 $0, [$1], 1;", 1, _element_pointer,
                                                  in_place=True)
# copy_async(shared, i, source, base, j, source_bytes): 16 bytes from flat element base + j
# of a global array to shared word i (both 16-byte aligned); bytes past source_bytes (0 or
# 16) are zero. `base` is what a stage's copies share (its offset along K): the pointer to
# it is derived once, and each copy adds its own `j`, so 32-bit offsets cost one address
# computation per copy.
# commit_copies() closes a group; wait_copies[n]() waits for all groups but the newest n.
copy_async, commit_copies, wait_copies = twins.async_copies() if SIMULATED else _gpu_async_copies()
# ldmatrix4(shared, i): the warp's four 8x8 half matrices, lane l naming a row at word i.
ldmatrix4 = twins.ldmatrix4 if SIMULATED else _gpu_read(
    "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];", 4, _shared_pointer, in_place=True)
# Programmatic dependent launch (module docstring): wait_for_previous() blocks until the
# kernel before has finished; release_next() lets the kernel after start launching.
wait_for_previous = twins.no_op if SIMULATED else _gpu_statement("griddepcontrol.wait;", hopper)
release_next = twins.no_op if SIMULATED else _gpu_statement("griddepcontrol.launch_dependents;", hopper)
# Warpgroup mma (module docstring): fence, commit and wait for `warpgroup_mma`'s groups.
warpgroup_fence = twins.no_op if SIMULATED else _gpu_statement("wgmma.fence.sync.aligned;")
warpgroup_commit = twins.warpgroup_commit if SIMULATED else _gpu_statement("wgmma.commit_group.sync.aligned;")
warpgroup_wait = {n: twins.warpgroup_wait(n) if SIMULATED else _gpu_statement(f"wgmma.wait_group.sync.aligned {n};")
                  for n in range(8)}
# async_proxy_fence(): this thread's shared-memory stores (words of an A or B tile) become
# visible to the tensor cores' reads of a later warpgroup mma (after a barrier for other
# threads' stores).
async_proxy_fence = twins.no_op if SIMULATED else _gpu_statement("fence.proxy.async.shared::cta;")
# mbarrier_init(shared, i, count), mbarrier_expect_bytes(shared, i, bytes),
# mbarrier_wait(shared, i, parity) on the mbarrier at word i of a uint32 shared array, and
# bulk_copy(shared, i, source, j, bytes, m): `bytes` from flat element j of a global array
# to shared word i in one copy, counted on the mbarrier at word m (module docstring).
mbarrier_init, mbarrier_expect_bytes, mbarrier_wait, bulk_copy = twins.mbarriers() if SIMULATED else _gpu_mbarriers()
_load4 = load_written[4]
# and_or(a, mask, bits) = (a & mask) | bits in one instruction (ptxas splits the pair when
# both constants are immediates): the int4 code -> magic-half step of dequantisation.
# byte_perm(a, b, selector): bytes of b:a picked by the selector's nibbles (prmt.b32).
and_or = twins.and_or if SIMULATED else _declared()["and_or"]
byte_perm = twins.byte_perm if SIMULATED else _declared()["byte_perm"]


@device
def load_u32x4(array, i, j, k):
    """array[i, j, k:k+4] of a 3-D C-contiguous 32-bit array (an earlier kernel's output) as
    one 16-byte load (k a multiple of 4, rows 16-byte aligned), as int32 words."""
    w0, w1, w2, w3 = _load4(array, (int64(i) * array.shape[1] + j) * array.shape[2] + k)
    return int32(w0), int32(w1), int32(w2), int32(w3)


def _helper(half: str, twin, stem: str):
    """The helper `stem` for `half` operands: its simulator twin, or the linked PTX wrapper."""
    _check_half(half)
    return twin(half) if SIMULATED else _declared()[f"{stem}_{'bf16' if half == 'bfloat16' else 'f16'}"]


@functools.cache
def mma(half: str):
    """Warp-collective D = A @ B + C, m16n8k16, `half` operands, float32 accumulators."""
    return _helper(half, twins.mma, "mma")


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
    return twins.warpgroup(half, n, False) if SIMULATED else _gpu_warpgroup(half, n, False)


@functools.cache
def shared_warpgroup_mma(half: str, n: int):
    """warpgroup_mma with A (64 x 16) in shared memory too, K-major core matrices like B's
    (module docstring): (shared, a_offset, a_lbo, a_sbo, b_offset, b_lbo, b_sbo, acc, first)."""
    _check_half(half)
    _check_columns(n)
    return twins.warpgroup(half, n, True) if SIMULATED else _gpu_warpgroup(half, n, True)


NAMED_BARRIERS = range(1, 16)  # barrier 0 is `cuda.syncthreads`


def _check_barrier(barrier: int, threads: int) -> None:
    if barrier not in NAMED_BARRIERS or threads < 32 or threads % 32 or threads > 1024:
        raise ValueError(f"a named barrier is one of 1 to 15 and counts a multiple of 32 threads (at most 1024), "
                         f"got barrier {barrier!r} of {threads!r} threads")


@functools.cache
def barrier_sync(barrier: int, threads: int):
    """bar.sync: arrive at named barrier `barrier` and wait until `threads` threads (whole
    warps) have arrived. With `barrier_arrive`, producer and consumer warps hand a buffer
    back and forth without stopping the whole CTA."""
    _check_barrier(barrier, threads)
    if SIMULATED:
        return twins.named_barrier(barrier, threads, True)
    return _gpu_statement(f"bar.sync {barrier}, {threads};")


@functools.cache
def barrier_arrive(barrier: int, threads: int):
    """bar.arrive: count this thread's warp toward the barrier's `threads` and go on."""
    _check_barrier(barrier, threads)
    if SIMULATED:
        return twins.named_barrier(barrier, threads, False)
    return _gpu_statement(f"bar.arrive {barrier}, {threads};")


@functools.cache
def fma2(half: str):
    """Two half-precision fused multiply-adds on packed pairs, rounded to nearest even."""
    return _helper(half, twins.fma2, "fma")


@functools.cache
def fma2_splat(half: str, which: int):
    """fma2(a, (b's half `which`, the same), c): b's low (0) or high (1) half multiplies
    both lanes, in the one instruction (HFMA2's operand swizzle)."""
    return _helper(half, twins.fma2_splat(which), ("fma_lo", "fma_hi")[which])


@functools.cache
def pack2(half: str):
    """Two float32 -> one uint32 holding (lo, hi) as halves, rounded to nearest even."""
    return _helper(half, twins.pack2, "pack")


@functools.cache
def to_half(half: str):
    """float32 -> half bit pattern (in a uint32), rounded to nearest even."""
    return _helper(half, twins.to_half, "to")


@functools.cache
def half_to_f32(half: str):
    """Half bit pattern (any integer holding 16 bits) -> float32, exactly."""
    _check_half(half)
    if half == "float16":
        return twins.f16_to_f32 if SIMULATED else _declared()["f16_to_f32"]

    @device
    def bf16_to_f32(h):
        return bits_f32((uint32(h) & uint32(0xFFFF)) << uint32(16))

    return bf16_to_f32
