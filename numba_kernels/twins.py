"""Pure-Python twins of `ptx`'s instructions: what each one computes, in numpy.

Under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) `ptx` hands kernels these functions
instead of its inline PTX, so every kernel runs unchanged in CI and its results can be
checked against a reference. A twin follows the instruction's definition, not a
convenient approximation: halves round to nearest even as the hardware rounds, an
asynchronous copy lands only when a wait lets its group complete, and the
warp-collective instructions (mma, ldmatrix, the warpgroup mma and its commit and wait)
take every lane's operands at one meeting of the warp or warpgroup (`Group`), so a
fragment in the wrong lane gives a wrong product here too. The fragment layouts are in
`ptx`'s module docstring.

The simulator runs each thread of a block as a Python thread; these functions never
name `cuda`, so `ptx.device` keeps the kernels' helpers that call them plain Python (no
module swap, no lock per call). One serves the GPU's host side too:
`round_to_half_bits`, for the half constants that kernels are compiled with.
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np


def halves_to_f64(words, half: str) -> np.ndarray:
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
    with np.errstate(over="ignore"):  # past the half's range: infinity, as the hardware rounds
        if half == "float16":
            return values.astype(np.float16).view(np.uint16)
        mantissa, exponent = np.frexp(values)  # values = mantissa * 2**exponent, 0.5 <= |mantissa| < 1
        rounded = np.ldexp(np.round(mantissa * 256.0), exponent - 8)  # 8 significant bits, ties to even
        bits = rounded.astype(np.float32).view(np.uint32) >> 16
    return np.where(np.isnan(values), 0x7FC0, bits).astype(np.uint16)


_HALF_BITS = {"bfloat16": (8, 127, 254), "float16": (11, 15, 30)}  # significant bits, exponent bias, largest exponent


def round_half(value: float, half: str) -> int:
    """`round_to_half_bits` of one float: in integer arithmetic where the result is zero or a
    normal number (every weight a simulated GEMM dequantises: fma2 calls this for each),
    through numpy elsewhere (infinities, NaNs, subnormals)."""
    if value == 0.0:
        return 0x8000 if math.copysign(1.0, value) < 0 else 0
    if math.isfinite(value):
        bits, bias, largest = _HALF_BITS[half]
        mantissa, exponent = math.frexp(abs(value))  # 0.5 <= mantissa < 1
        significand = round(mantissa * (1 << bits))  # `bits` significant bits, ties to even
        if significand == 1 << bits:
            significand, exponent = significand >> 1, exponent + 1
        field = exponent - 1 + bias
        if 1 <= field <= largest:
            return (value < 0) << 15 | field << (bits - 1) | significand - (1 << (bits - 1))
    return int(round_to_half_bits(value, half))


def _pair(lo_bits, hi_bits) -> np.uint32:
    return np.uint32((int(hi_bits) << 16) | int(lo_bits))


@functools.cache
def _half_values(half: str) -> list[float]:
    """The value of each of the 65,536 half bit patterns: fma2 dequantises every weight of a
    simulated GEMM, and with look-ups and `round_half` a call takes 2 us against 54 in numpy."""
    return halves_to_f64(np.arange(1 << 16), half)[:, 0].tolist()


def fma2(half: str):
    value = _half_values(half)

    def fma2(a, b, c):
        a, b, c = int(a) & 0xFFFFFFFF, int(b) & 0xFFFFFFFF, int(c) & 0xFFFFFFFF
        lo = value[a & 0xFFFF] * value[b & 0xFFFF] + value[c & 0xFFFF]
        hi = value[a >> 16] * value[b >> 16] + value[c >> 16]
        return _pair(round_half(lo, half), round_half(hi, half))

    return fma2


def fma2_splat(which: int):
    def factory(half: str):
        multiply_add = fma2(half)

        def fma2_splat(a, b, c):
            picked = (int(b) >> (16 * which)) & 0xFFFF
            return multiply_add(a, np.uint32(picked | picked << 16), c)

        return fma2_splat

    return factory


def pack2(half: str):
    def pack2(lo, hi):
        return _pair(round_half(float(np.float32(lo)), half), round_half(float(np.float32(hi)), half))

    return pack2


def to_half(half: str):
    def to_half(x):
        return np.uint32(round_half(float(np.float32(x)), half))

    return to_half


def and_or(a, mask, bits):
    return np.uint32((int(a) & int(mask) | int(bits)) & 0xFFFFFFFF)


def byte_perm(a, b, selector):
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


def f16_to_f32(h):
    return np.float32(np.uint16(int(h) & 0xFFFF).view(np.float16))


class Group:
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


_block_state_lock = threading.Lock()


def _block_state(key: str, make):
    """The calling simulated thread's block's state under `key` (the simulator's
    BlockManager holds it), made by `make()` on first use."""
    manager = threading.current_thread()._manager
    state = manager.__dict__.get(key)
    if state is None:  # the lock only to create: taken per call, its unfairness convoys
        with _block_state_lock:
            state = manager.__dict__.setdefault(key, make())
    return state


def _group(size: int) -> tuple[int, Group]:
    """(index in its group, the group) of the calling simulated thread, for groups of `size`
    consecutive threads of its block (a warp, a warpgroup)."""
    number, index = divmod(threading.current_thread().thread_id, size)
    groups = _block_state(f"_numba_moe_groups_of_{size}", dict)
    group = groups.get(number)
    if group is None:
        with _block_state_lock:
            group = groups.setdefault(number, Group(size))
    return index, group


def _warp():
    """(lane, warp) of the calling simulated thread."""
    return _group(32)


_LANE_G, _LANE_T = np.arange(32) // 4, np.arange(32) % 4


def _a_tile(halves: np.ndarray) -> np.ndarray:
    """The 16 x 16 A tile of a warp's fragments a0..a3, (32 lanes, 4, 2 halves) as values
    (`ptx`'s module docstring: mma's and a warpgroup mma's warp share the layout)."""
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


def mma(half: str):
    """m16n8k16 as the hardware defines its fragments (`ptx`'s module docstring); every lane of
    the warp must call it, as with the real instruction."""

    def multiply(lanes):
        halves = halves_to_f64(np.array([s[:6] for s in lanes], dtype=np.uint64), half)  # (32, 6, 2)
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
    """(thread in warpgroup, warpgroup) of the calling simulated thread, whose warpgroup
    (four warps from a multiple of four) must lie whole in its block."""
    thread = threading.current_thread()
    block_dim = thread._manager._block_dim
    if (thread.thread_id // 128 + 1) * 128 > int(np.prod(block_dim)):
        raise ValueError(f"warpgroup_mma needs its warpgroup's 128 threads in the block, got thread "
                         f"{thread.thread_id} of a block of {block_dim}")
    return _group(128)


def _core_matrix_words(offset: int, lbo: int, sbo: int, n: int) -> np.ndarray:
    """(16, n) flat word indices and half (0 low, 1 high) of a K-major operand's elements
    (k, col) in shared memory: B's columns, or A's rows (col = row)."""
    k, col = np.meshgrid(np.arange(16), np.arange(n), indexing="ij")
    byte = 4 * offset + (col // 8) * sbo + (k // 8) * lbo + (col % 8) * 16 + (k % 8) * 2
    return byte // 4, (byte // 2) % 2


def _read_core_matrices(flat, offset, lbo, sbo, n: int, half: str, group: Group) -> np.ndarray:
    """The (16, n) values a descriptor names, remembered with the words read (for the
    wait's check that they are not overwritten while the mma may still read them)."""
    if (4 * int(offset)) % 16 or int(lbo) % 16 or int(sbo) % 16:
        raise ValueError("warpgroup_mma: a shared tile's address, lbo and sbo must be multiples of 16 bytes")
    words, which = _core_matrix_words(int(offset), int(lbo), int(sbo), n)
    read = np.array(flat[words], np.uint32)
    group.open.append((flat, words, read))
    return halves_to_f64(read, half)[np.arange(16)[:, None], np.arange(n)[None, :], which]


def warpgroup(half: str, n: int, a_in_shared: bool):
    """wgmma m64nNk16 with A from registers or shared memory (`ptx`'s module docstring), computed
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
                    halves = halves_to_f64(np.array([s[0] for s in lanes], dtype=np.uint64), half)  # (32, 4, 2)
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


def warpgroup_commit():
    index, group = _warpgroup()

    def commit(_):
        group.committed.append(group.open)
        group.open = []

    group.meet(index, None, commit)


def warpgroup_wait(newest: int):
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


def load_words(count: int):
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


def store_words4(array, offset, w0, w1, w2, w3):
    flat = array.reshape(-1)
    if flat.dtype.itemsize != 4:
        raise TypeError(f"store_words4 stores to a 32-bit array, got {flat.dtype}")
    for w, word in enumerate((w0, w1, w2, w3)):
        flat[offset + w] = np.uint32(int(word) & 0xFFFFFFFF).view(flat.dtype)


def load_bits(array, offset):
    return np.array(array.reshape(-1)[offset]).view(np.uint32)[()]


_arrival_lock = threading.Lock()


def arrive(array, offset):
    with _arrival_lock:
        flat = array.reshape(-1)
        old = np.uint32(flat[offset])
        flat[offset] = old + np.uint32(1)
    return old


_pending = threading.local()


def async_copies():
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


def ldmatrix4(shared, offset):
    lane, warp = _warp()
    flat = shared.reshape(-1)

    def load(rows):  # every lane's words read at once, as the instruction reads them
        return [tuple(np.uint32(flat[rows[8 * j + r // 4] + r % 4]) for j in range(4)) for r in range(32)]

    return warp.meet(lane, int(offset), load)[lane]


def store_matrix4t(shared, offset, w0, w1, w2, w3):
    lane, warp = _warp()
    flat = shared.reshape(-1)

    def store(lanes):  # every lane's words and row address taken at once, as the instruction does
        for j in range(4):
            halves = np.array([[int(lanes[lane][1 + j]) >> 16 * h & 0xFFFF for h in (0, 1)] for lane in range(32)])
            matrix = halves.reshape(8, 8)  # (row g, column 2t + h): lane 4g + t, half h
            for r in range(8):
                column = matrix[:, r]
                for w in range(4):
                    flat[lanes[8 * j + r][0] + w] = np.uint32(column[2 * w] | column[2 * w + 1] << 16)

    warp.meet(lane, (int(offset), w0, w1, w2, w3), store)


class NamedBarrier:
    """One of a simulated block's 16 hardware barriers: `threads` arrivals complete a
    phase; an arriving thread waits for its phase to complete (bar.sync) or goes on
    (bar.arrive). Every arrival of a phase must name the same count, as the hardware
    requires (it leaves a mismatch undefined; here it raises)."""

    def __init__(self):
        self.arrived, self.generation, self.threads = 0, 0, None
        self.error = None  # a mismatch, raised in every thread that waits on the phase
        self.done = threading.Condition()

    def arrive(self, threads: int, wait: bool):
        with self.done:
            if self.arrived and threads != self.threads:
                self.error = RuntimeError(f"a named barrier's arrivals name {self.threads} and {threads} threads "
                                          f"in one phase")
                self.done.notify_all()
            if self.error is not None:
                raise self.error
            generation, self.threads = self.generation, threads
            self.arrived += 1
            if self.arrived == threads:
                self.arrived, self.generation = 0, generation + 1
                self.done.notify_all()
            elif wait:
                if not self.done.wait_for(lambda: self.generation != generation or self.error is not None,
                                          Group.TIMEOUT_SECONDS):
                    raise RuntimeError(f"a named barrier's phase never completed: {threads - self.arrived} of "
                                       f"{threads} threads never arrived")
                if self.error is not None:
                    raise self.error


def named_barrier(barrier: int, threads: int, wait: bool):
    """bar.sync (wait) or bar.arrive (not) on barrier `barrier` of the calling thread's
    block, a phase `threads` arrivals long."""

    def arrive():
        _block_state("_numba_moe_barriers", lambda: [NamedBarrier() for _ in range(16)])[barrier].arrive(threads, wait)

    return arrive


class MBarrier:
    """An mbarrier of a simulated block: a phase completes when its `count` arrivals have
    come and the bytes they expect have been copied; the copies land at that moment, so
    a thread that reads before its wait reads the old words."""

    def __init__(self, count: int):
        self.count, self.pending, self.expected, self.phase = count, count, 0, 0
        self.copies = []  # (flat shared words, word offset, words): this phase's, not landed
        self.done = threading.Condition()

    def _complete_if_due(self):
        if self.pending == 0 and self.expected == sum(4 * len(words) for _, _, words in self.copies):
            for flat, offset, words in self.copies:
                flat[offset:offset + len(words)] = words
            self.copies, self.expected, self.pending = [], 0, self.count
            self.phase += 1
            self.done.notify_all()

    def expect(self, size: int):
        with self.done:
            if self.pending == 0:
                raise RuntimeError(f"an mbarrier's phase has {self.count} arrivals, got one more")
            self.expected += size
            self.pending -= 1
            self._complete_if_due()

    def copy(self, flat, offset: int, words: np.ndarray):
        with self.done:
            self.copies.append((flat, offset, words))
            self._complete_if_due()

    def wait(self, parity: int):
        with self.done:
            if not self.done.wait_for(lambda: self.phase % 2 != parity, Group.TIMEOUT_SECONDS):
                raise RuntimeError(f"an mbarrier's phase never completed: {self.pending} of {self.count} arrivals "
                                   f"and {self.expected} expected bytes missing")


def mbarriers():
    """mbarrier_init, mbarrier_expect_bytes, mbarrier_wait and bulk_copy (`ptx`'s module
    docstring): a block's mbarriers are kept by the address of their shared word."""

    def barrier(shared, offset, create_with=None):
        if int(offset) % 2:
            raise ValueError(f"an mbarrier is 8 bytes at an even word offset, got word {offset}")
        key = shared.__array_interface__["data"][0] + 4 * int(offset)
        barriers = _block_state("_numba_moe_mbarriers", dict)
        if create_with is not None:
            with _block_state_lock:
                barriers[key] = MBarrier(create_with)
        elif key not in barriers:
            raise RuntimeError(f"mbarrier at word {offset} used before mbarrier_init")
        return barriers[key]

    def mbarrier_init(shared, offset, count):
        barrier(shared, offset, int(count))

    def mbarrier_expect_bytes(shared, offset, size):
        barrier(shared, offset).expect(int(size))

    def mbarrier_wait(shared, offset, parity):
        barrier(shared, offset).wait(int(parity) % 2)

    def bulk_copy(shared, shared_offset, source, source_offset, size, barrier_offset):
        flat = source.reshape(-1)
        first, size = int(source_offset) * flat.dtype.itemsize, int(size)
        if size <= 0 or size % 16 or (4 * int(shared_offset)) % 16 or first % 16:
            raise ValueError(f"bulk_copy copies a positive multiple of 16 bytes between 16-byte aligned addresses, "
                             f"got {size} bytes from byte {first} to shared word {shared_offset}")
        words = np.ascontiguousarray(flat.view(np.uint8)[first:first + size]).view(np.uint32).copy()
        barrier(shared, barrier_offset).copy(shared.reshape(-1), int(shared_offset), words)

    return mbarrier_init, mbarrier_expect_bytes, mbarrier_wait, bulk_copy


def f32_bits(x):
    return np.float32(x).view(np.uint32)


def bits_f32(u):
    return np.uint32(int(u) & 0xFFFFFFFF).view(np.float32)


def exp_approx(x):
    with np.errstate(over="ignore"):
        return np.exp(np.float32(x))


def divide_approx(a, b):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.float32(a) / np.float32(b)


def no_op():
    pass
