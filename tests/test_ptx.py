"""The PTX helpers compute what their numpy definitions say: on the GPU this checks the
real instructions, under the simulator the Python twins (so both agree with one spec)."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from numba import cuda, float32, int32, uint32

from numba_kernels import ptx, twins
from numba_kernels.twins import round_to_half_bits

HALVES = ["bfloat16", "float16"]


def _halves(bits: np.ndarray, half: str) -> np.ndarray:
    bits = np.asarray(bits, np.uint16)
    if half == "bfloat16":
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return bits.view(np.float16).astype(np.float64)


def _random_half_bits(rng, shape, half, low=-4.0, high=4.0):
    return round_to_half_bits(rng.uniform(low, high, shape), half)


def _words(lo, hi) -> np.ndarray:
    return (np.asarray(hi, np.uint32) << 16 | np.asarray(lo, np.uint32)).view(np.int32)


@pytest.mark.parametrize("half", HALVES)
def test_mma_is_a_times_b_plus_c_with_the_documented_fragments(half):
    mma = ptx.mma(half)

    @ptx.kernel
    def run_mma(a_frag, b_frag, c_frag, d_frag):
        lane = cuda.threadIdx.x
        d0, d1, d2, d3 = mma(uint32(a_frag[lane, 0]), uint32(a_frag[lane, 1]), uint32(a_frag[lane, 2]),
                             uint32(a_frag[lane, 3]), uint32(b_frag[lane, 0]), uint32(b_frag[lane, 1]),
                             c_frag[lane, 0], c_frag[lane, 1], c_frag[lane, 2], c_frag[lane, 3])
        d_frag[lane, 0], d_frag[lane, 1], d_frag[lane, 2], d_frag[lane, 3] = d0, d1, d2, d3

    rng = np.random.default_rng(0)
    a_bits, b_bits = _random_half_bits(rng, (16, 16), half), _random_half_bits(rng, (16, 8), half)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    a_frag = np.stack([_words(a_bits[g, 2 * t], a_bits[g, 2 * t + 1]), _words(a_bits[g + 8, 2 * t], a_bits[g + 8, 2 * t + 1]),
                       _words(a_bits[g, 2 * t + 8], a_bits[g, 2 * t + 9]),
                       _words(a_bits[g + 8, 2 * t + 8], a_bits[g + 8, 2 * t + 9])], axis=1)
    b_frag = np.stack([_words(b_bits[2 * t, g], b_bits[2 * t + 1, g]), _words(b_bits[2 * t + 8, g], b_bits[2 * t + 9, g])], axis=1)
    c_frag = np.stack([c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]], axis=1)
    d_frag = np.full((32, 4), np.nan, np.float32)
    run_mma[1, 32](a_frag, b_frag, c_frag, d_frag)

    expected = _halves(a_bits, half) @ _halves(b_bits, half) + c
    got = np.zeros((16, 8))
    got[g, 2 * t], got[g, 2 * t + 1], got[g + 8, 2 * t], got[g + 8, 2 * t + 1] = d_frag.T
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not ptx.SIMULATED, reason="the twin's check (on the GPU a diverged mma is undefined)")
def test_mma_twin_fails_the_lanes_of_a_diverged_mma_instead_of_hanging(monkeypatch):
    monkeypatch.setattr(twins.Group, "TIMEOUT_SECONDS", 0.5)
    mma = ptx.mma("bfloat16")

    @ptx.kernel
    def half_warp_mma(d):
        lane = cuda.threadIdx.x
        if lane < 16:
            d[lane] = mma(uint32(0), uint32(0), uint32(0), uint32(0), uint32(0), uint32(0),
                          float32(1), float32(1), float32(1), float32(1))[0]

    with pytest.raises(RuntimeError, match="16 of 32 threads never reached a collective instruction"):
        half_warp_mma[1, 32](np.zeros(32, np.float32))


@pytest.mark.parametrize("half", HALVES)
@settings(max_examples=5)
@given(seed=st.integers(0, 2**31 - 1))
def test_packed_half_helpers_round_to_nearest_even(half, seed):
    fma2, pack2, to_half, half_to_f32 = ptx.fma2(half), ptx.pack2(half), ptx.to_half(half), ptx.half_to_f32(half)
    fma2_low, fma2_high = ptx.fma2_splat(half, 0), ptx.fma2_splat(half, 1)

    @ptx.kernel
    def run(a, b, c, x, fma_out, splat_out, pack_out, half_out, back_out):
        i = cuda.threadIdx.x
        fma_out[i] = int32(fma2(uint32(a[i]), uint32(b[i]), uint32(c[i])))
        splat_out[0, i] = int32(fma2_low(uint32(a[i]), uint32(b[i]), uint32(c[i])))
        splat_out[1, i] = int32(fma2_high(uint32(a[i]), uint32(b[i]), uint32(c[i])))
        pack_out[i] = int32(pack2(x[i, 0], x[i, 1]))
        half_out[i] = int32(to_half(x[i, 0]))
        back_out[i] = half_to_f32(half_out[i])

    rng = np.random.default_rng(seed)
    a, b, c = (_words(_random_half_bits(rng, 64, half), _random_half_bits(rng, 64, half)) for _ in range(3))
    x = rng.uniform(-100, 100, (64, 2)).astype(np.float32)
    fma_out, pack_out, half_out = (np.zeros(64, np.int32) for _ in range(3))
    back_out = np.zeros(64, np.float32)
    splat_out = np.zeros((2, 64), np.int32)
    run[1, 64](a, b, c, x, fma_out, splat_out, pack_out, half_out, back_out)

    def split(words):
        words = np.asarray(words).view(np.uint32)
        return _halves(words & 0xFFFF, half), _halves(words >> 16, half)

    (a_lo, a_hi), (b_lo, b_hi), (c_lo, c_hi) = split(a), split(b), split(c)
    expected_fma = _words(round_to_half_bits(a_lo * b_lo + c_lo, half), round_to_half_bits(a_hi * b_hi + c_hi, half))
    np.testing.assert_array_equal(fma_out, expected_fma)
    for which, b_half in enumerate((b_lo, b_hi)):  # one half of b multiplies both lanes
        expected = _words(round_to_half_bits(a_lo * b_half + c_lo, half), round_to_half_bits(a_hi * b_half + c_hi, half))
        np.testing.assert_array_equal(splat_out[which], expected)
    np.testing.assert_array_equal(pack_out, _words(round_to_half_bits(x[:, 0], half), round_to_half_bits(x[:, 1], half)))
    np.testing.assert_array_equal(half_out, round_to_half_bits(x[:, 0], half).astype(np.int32))
    np.testing.assert_array_equal(back_out, _halves(round_to_half_bits(x[:, 0], half), half))


def test_bit_casts_and_sixteen_byte_loads_are_exact():
    @ptx.kernel
    def run(words, floats, loaded, as_bits, as_float):
        i = cuda.threadIdx.x
        w0, w1, w2, w3 = ptx.load_u32x4(words, i // 2, i % 2, 4)
        loaded[i, 0], loaded[i, 1], loaded[i, 2], loaded[i, 3] = w0, w1, w2, w3
        as_bits[i] = ptx.f32_bits(floats[i])
        as_float[i] = ptx.bits_f32(ptx.f32_bits(floats[i]))

    rng = np.random.default_rng(1)
    words = rng.integers(-2**31, 2**31, (4, 2, 8), dtype=np.int64).astype(np.int32)
    floats = rng.standard_normal(8).astype(np.float32)
    loaded, as_bits = np.zeros((8, 4), np.int32), np.zeros(8, np.uint32)
    as_float = np.zeros(8, np.float32)
    run[1, 8](words, floats, loaded, as_bits, as_float)
    np.testing.assert_array_equal(loaded, words.reshape(8, 8)[:, 4:])
    np.testing.assert_array_equal(as_bits, floats.view(np.uint32))
    np.testing.assert_array_equal(as_float, floats)


def test_approximate_exp_and_division_are_within_a_few_ulp():
    """silu's helpers: e^x to 4e-6 relative over [-20, 20] (ex2.approx of x log2 e: the
    rounding of x log2 e grows with |x|), a / b to 2 ulp; exact under the simulator."""
    @ptx.kernel
    def run(x, a, b, exps, quotients):
        i = cuda.grid(1)
        if i < x.shape[0]:
            exps[i] = ptx.exp_approx(x[i])
            quotients[i] = ptx.divide_approx(a[i], b[i])

    rng = np.random.default_rng(2)
    x = rng.uniform(-20, 20, 256).astype(np.float32)
    a = rng.standard_normal(256).astype(np.float32)
    b = rng.uniform(0.5, 1e6, 256).astype(np.float32)
    exps, quotients = np.zeros(256, np.float32), np.zeros(256, np.float32)
    run[2, 128](x, a, b, exps, quotients)
    np.testing.assert_allclose(exps, np.exp(x.astype(np.float64)), rtol=4e-6)
    np.testing.assert_allclose(quotients, a.astype(np.float64) / b, rtol=3e-7)


@pytest.mark.parametrize("loads", ["load_words", "load_written"])
@pytest.mark.parametrize("dtype", [np.int32, np.int16, np.uint8])
def test_flat_word_loads_read_little_endian_words_of_any_integer_width(dtype, loads):
    load4, load2, load1 = (getattr(ptx, loads)[n] for n in (4, 2, 1))

    @ptx.kernel
    def run(values, loaded):
        i = cuda.threadIdx.x
        per_word = 4 // values.itemsize
        start = 4 * i * per_word
        loaded[i, 0], loaded[i, 1], loaded[i, 2], loaded[i, 3] = load4(values, start)
        loaded[i, 4], loaded[i, 5] = load2(values, start)
        loaded[i, 6] = load1(values, start + 2 * per_word)

    rng = np.random.default_rng(2)
    values = rng.integers(0, 256, (3, 4, 16 * 4), dtype=np.int64).astype(np.uint8).view(dtype)
    loaded = np.zeros((16, 7), np.uint32)
    run[1, 16](values, loaded)
    words = values.reshape(-1).view(np.uint32)[:64].reshape(16, 4)  # 16 threads x 4 words (little endian)
    np.testing.assert_array_equal(loaded[:, :4], words)
    np.testing.assert_array_equal(loaded[:, 4:6], words[:, :2])
    np.testing.assert_array_equal(loaded[:, 6], words[:, 2])


@pytest.mark.parametrize("dtype", [np.int32, np.float32])
def test_sixteen_byte_stores_write_four_words_and_nothing_else(dtype):
    """`ptx.store_words4`: thread i's four words (a negative one among them) land at flat
    elements 4i to 4i + 3 of a 2-D 32-bit array, bit for bit; the words past them stay."""
    @ptx.kernel
    def run(words, out):
        i = cuda.threadIdx.x
        ptx.store_words4(out, 4 * i, words[i, 0], words[i, 1], words[i, 2], words[i, 3])

    words = np.random.default_rng(3).integers(-2**31, 2**31, (8, 4), dtype=np.int64).astype(np.int32)
    out = np.full((3, 16), 7, np.int32).view(dtype)
    run[1, 8](words, out)
    np.testing.assert_array_equal(out.view(np.int32).reshape(-1)[:32], words.reshape(-1))
    assert (out.view(np.int32).reshape(-1)[32:] == 7).all()


def test_only_the_weight_readers_load_through_the_read_only_path():
    """`ptx.load_words` (ld.global.nc) promises ptxas that nothing writes the array while
    the kernel runs, so ptxas may issue its loads before `wait_for_previous`: gemm2 once
    read the activation kernel's output before it was written (sixty-first session). What
    an earlier kernel wrote is read with `ptx.load_written`; only the weights (fragments)
    may take the read-only path."""
    import pathlib
    import re

    kernels = pathlib.Path(ptx.__file__).parent
    users = {path.name for path in kernels.glob("*.py")
             if path.name not in ("ptx.py", "twins.py") and re.search(r"\bload_words\b", path.read_text())}
    assert users == {"fragments.py"}, f"{sorted(users)} load through the read-only path (ptx.load_words)"


def _byte_perm_spec(a: int, b: int, selector: int) -> int:
    """prmt.b32 by its PTX definition: bytes 0-3 of a then 4-7 of b; selector nibble i
    picks result byte i, its bit 3 asking for the picked byte's sign replicated."""
    source = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    out = bytearray()
    for i in range(4):
        nibble = selector >> 4 * i & 0xF
        byte = source[nibble & 7]
        out.append((0xFF if byte & 0x80 else 0) if nibble & 8 else byte)
    return int.from_bytes(bytes(out), "little")


def test_bit_operations_match_their_definitions():
    @ptx.kernel
    def run(a, b, c, selectors, anded, permuted):
        i = cuda.threadIdx.x
        anded[i] = ptx.and_or(uint32(a[i]), uint32(b[i]), uint32(c[i]))
        permuted[i] = ptx.byte_perm(uint32(a[i]), uint32(b[i]), uint32(selectors[i]))

    rng = np.random.default_rng(3)
    a, b, c = (rng.integers(0, 2**32, 16, dtype=np.uint64).astype(np.uint32) for _ in range(3))
    selectors = np.array([0x3210, 0x7654, 0x1010, 0x3232, 0x0404, 0x1414, 0x8888, 0xBA98]
                         + list(rng.integers(0, 2**16, 8)), np.uint32)
    anded, permuted = np.zeros(16, np.uint32), np.zeros(16, np.uint32)
    run[1, 16](a, b, c, selectors, anded, permuted)
    np.testing.assert_array_equal(anded, a & b | c)
    expected = [_byte_perm_spec(int(x), int(y), int(s)) for x, y, s in zip(a, b, selectors)]
    np.testing.assert_array_equal(permuted, np.array(expected, np.uint32))
    assert _byte_perm_spec(0x44332211, 0x88776655, 0x3210) == 0x44332211  # identity
    assert _byte_perm_spec(0x000000F0, 0, 0x8888) == 0xFFFFFFFF  # sign of byte 0 replicated


def test_half_rounding_reference_ties_to_even():
    # 1 + 2**-8 lies halfway between two bfloat16 neighbours: it rounds to the even one (1.0)
    assert round_to_half_bits(1 + 2.0**-8, "bfloat16") == 0x3F80
    assert round_to_half_bits(1 + 3 * 2.0**-8, "bfloat16") == 0x3F82
    assert round_to_half_bits(1 + 2.0**-11, "float16") == np.float16(1.0).view(np.uint16)


def test_unknown_half_type_is_rejected():
    with pytest.raises(ValueError, match="half type"):
        ptx.mma("float32")


def test_async_copies_land_only_when_their_group_is_waited_for():
    """Three groups in flight: after wait_copies[n] all but the newest n have landed, and
    a copy of zero source bytes writes zeros."""

    wait_all_but_two, wait_all = ptx.wait_copies[2], ptx.wait_copies[0]

    @ptx.kernel
    def run(source, seen):
        i = cuda.threadIdx.x
        tile = cuda.shared.array((4, 32, 4), uint32)
        for r in range(4):
            for w in range(4):
                tile[r, i, w] = uint32(0xFFFFFFFF)
        cuda.syncthreads()
        for r in range(3):
            ptx.copy_async(tile, (r * 32 + i) * 4, source, r * 128, i * 4, 16)
            ptx.commit_copies()
        ptx.copy_async(tile, (3 * 32 + i) * 4, source, 0, 0, 0)
        ptx.commit_copies()
        wait_all_but_two()
        for r in range(4):
            seen[0, r, i] = tile[r, i, 1]
        wait_all()
        for r in range(4):
            seen[1, r, i] = tile[r, i, 1]

    source = np.arange(4 * 32 * 4, dtype=np.int32).reshape(4, 32, 4) + 1
    seen = np.zeros((2, 4, 32), np.uint32)
    run[1, 32](source, seen)
    # After wait_copies[2] the first two groups are complete; later ones may or may not be
    # (the hardware may finish early, the simulator does not): only the guaranteed is checked.
    np.testing.assert_array_equal(seen[0, :2], source[:2, :, 1])
    np.testing.assert_array_equal(seen[1, :3], source[:3, :, 1])
    np.testing.assert_array_equal(seen[1, 3], 0)
    if ptx.SIMULATED:  # the twin delays every copy to its wait, so early reads are stale
        np.testing.assert_array_equal(seen[0, 2:], 0xFFFFFFFF)


@pytest.mark.parametrize("count", [1, 2, 4])
def test_shared_loads_stay_after_the_wait_that_lands_their_copies(count):
    """A loop that copies a new stage into the same shared words, waits and reads them
    reads each round's words: the shared load is never moved above the wait. (As an
    inline asm without memory effects it once was, out of the loop altogether, where its
    address did not change: the sixty-sixth session's bound kernel.)"""
    rounds, load, wait_all = 3, ptx.load_shared[count], ptx.wait_copies[0]

    @ptx.kernel
    def run(source, seen, rounds):  # a round count unknown when compiled: a loop, not unrolled
        i = cuda.threadIdx.x
        tile = cuda.shared.array(128, uint32)
        for r in range(rounds):  # each thread reads the words it copied: no barrier needed
            ptx.copy_async(tile, 4 * i, source, r * 128, 4 * i, 16)
            ptx.commit_copies()
            wait_all()
            words = load(tile, 4 * i)
            seen[r, i] = words if count == 1 else words[count - 1]

    source = np.arange(rounds * 128, dtype=np.int32) + 1
    seen = np.zeros((rounds, 32), np.uint32)
    run[1, 32](source, seen, rounds)
    np.testing.assert_array_equal(seen, source.reshape(rounds, 32, 4)[:, :, count - 1])


def test_named_barriers_hand_a_buffer_between_producer_and_consumer_warps():
    """Warp 1 fills a shared buffer and arrives on barrier 1 (bar.arrive), warp 0 waits
    on it (bar.sync), reads, and hands the buffer back on barrier 2: every round's words
    reach the consumer, and no fill overwrites a round the consumer has not read."""
    rounds = 5
    filled, read = ptx.barrier_arrive(1, 64), ptx.barrier_sync(1, 64)
    released, wait_released = ptx.barrier_arrive(2, 64), ptx.barrier_sync(2, 64)

    @ptx.kernel
    def run(seen):
        i = cuda.threadIdx.x
        buffer = cuda.shared.array(32, uint32)
        for r in range(rounds):
            if i >= 32:  # the producer warp
                if r > 0:
                    wait_released()
                buffer[i - 32] = uint32(100 * r + i - 32)
                filled()
            else:
                read()
                seen[r, i] = buffer[(i + 1) % 32]  # another lane's word: the barrier orders them
                if r + 1 < rounds:
                    released()

    seen = np.zeros((rounds, 32), np.uint32)
    run[1, 64](seen)
    np.testing.assert_array_equal(seen, 100 * np.arange(rounds)[:, None] + (np.arange(32) + 1) % 32)


@pytest.mark.skipif(not ptx.SIMULATED, reason="the twin's check (on the GPU a mismatch is undefined)")
def test_named_barrier_twin_rejects_arrivals_that_name_different_counts():
    arrive_64, sync_96 = ptx.barrier_arrive(3, 64), ptx.barrier_sync(3, 96)

    @ptx.kernel
    def run():
        if cuda.threadIdx.x < 32:
            arrive_64()
        else:
            sync_96()

    with pytest.raises(RuntimeError, match="name 64 and 96 threads"):
        run[1, 64]()


def test_named_barriers_take_whole_warps_of_one_of_fifteen_barriers():
    for barrier, threads in ((0, 64), (16, 64), (1, 48), (1, 0), (2, 2048)):
        with pytest.raises(ValueError, match="named barrier"):
            ptx.barrier_sync(barrier, threads)
        with pytest.raises(ValueError, match="named barrier"):
            ptx.barrier_arrive(barrier, threads)


def test_bulk_copies_land_by_the_mbarrier_phase_their_waiters_wait_for():
    """One thread copies each round's words (a bulk copy of 512 bytes, counted on an
    mbarrier of one arrival a phase) into one shared buffer; every thread waits for the
    round's phase (parity round % 2) and reads another thread's word: each round's words,
    none early, none from the round before."""
    rounds = 5

    @ptx.kernel
    def run(source, seen):
        i = cuda.threadIdx.x
        shared = cuda.shared.array(130, uint32)  # 128 words of buffer, then the mbarrier
        if i == 0:
            ptx.mbarrier_init(shared, 128, 1)
        cuda.syncthreads()
        for r in range(rounds):
            if i == 0:
                ptx.mbarrier_expect_bytes(shared, 128, 512)
                ptx.bulk_copy(shared, 0, source, 128 * r, 512, 128)
            ptx.mbarrier_wait(shared, 128, r % 2)
            seen[r, i] = shared[(4 * i + 5) % 128]
            cuda.syncthreads()  # every thread has read the round before the next copy

    source = np.arange(rounds * 128, dtype=np.int32) + 1
    seen = np.zeros((rounds, 32), np.uint32)
    run[1, 32](source, seen)
    np.testing.assert_array_equal(seen, source.reshape(rounds, 128)[:, (4 * np.arange(32) + 5) % 128])


@pytest.mark.skipif(not ptx.SIMULATED, reason="the twin's checks (on the GPU these fault or hang)")
def test_mbarrier_twin_rejects_misuse():
    @ptx.kernel
    def run(case, source):
        shared = cuda.shared.array(64, uint32)
        if case == 0:
            ptx.mbarrier_wait(shared, 32, 0)  # never initialised
        elif case == 1:
            ptx.mbarrier_init(shared, 33, 1)  # not 8-byte aligned
        else:
            ptx.mbarrier_init(shared, 32, 1)
            ptx.bulk_copy(shared, 0, source, 0, 24, 32)  # not a multiple of 16 bytes

    source = np.zeros(64, np.int32)
    for case, message in ((0, "before mbarrier_init"), (1, "even word offset"), (2, "multiple of 16 bytes")):
        with pytest.raises((RuntimeError, ValueError), match=message):
            run[1, 1](case, source)


def test_ldmatrix_gives_the_mma_a_fragments_of_a_padded_shared_tile():
    @ptx.kernel
    def run(a_words, frags):
        lane = cuda.threadIdx.x
        tile = cuda.shared.array((16, 12), uint32)  # 16 rows of 8 words, padded by 4
        for w in range(8):
            tile[lane % 16, w] = uint32(a_words[lane % 16, w])
        cuda.syncthreads()
        frags[lane, 0], frags[lane, 1], frags[lane, 2], frags[lane, 3] = ptx.ldmatrix4(
            tile, (lane % 16) * 12 + 4 * (lane // 16))

    rng = np.random.default_rng(3)
    a_words = rng.integers(0, 2**32, (16, 8), dtype=np.uint64).astype(np.uint32)
    frags = np.zeros((32, 4), np.uint32)
    run[1, 32](a_words.view(np.int32), frags)
    g, t = np.arange(32) // 4, np.arange(32) % 4
    expected = np.stack([a_words[g, t], a_words[g + 8, t], a_words[g, t + 4], a_words[g + 8, t + 4]], axis=1)
    np.testing.assert_array_equal(frags, expected)


def test_stmatrix_stores_the_accumulator_tiles_transposed():
    """Lane 4g + t holds (row g, columns 2t, 2t + 1) of four 8 x 8 half matrices, one word
    each, as mma's accumulator tiles do; `store_matrix4t` writes row r of matrix j's
    transpose (its column r) as 16 bytes where lane 8j + r points, and after `sync_warp`
    every lane reads what the others stored."""
    @ptx.kernel
    def run(words, out):
        lane = cuda.threadIdx.x
        tile = cuda.shared.array(160, uint32)
        j, r = lane // 8, lane % 8
        ptx.store_matrix4t(tile, j * 40 + (7 - r) * 4, uint32(words[lane, 0]), uint32(words[lane, 1]),
                           uint32(words[lane, 2]), uint32(words[lane, 3]))  # rows placed in reverse, 40 words apart
        ptx.sync_warp()
        for w in range(5):
            out[(lane + 1) % 32, w] = tile[((lane + 1) % 32) * 5 + w]  # each lane reads another's words

    rng = np.random.default_rng(4)
    words = rng.integers(0, 2**32, (32, 4), dtype=np.uint64).astype(np.uint32)
    out = np.zeros((32, 5), np.uint32)
    run[1, 32](words.view(np.int32), out)
    halves = np.stack([words & 0xFFFF, words >> 16], axis=-1)  # (lane, matrix, half)
    expected = np.zeros(160, np.uint32)
    for j in range(4):
        matrix = halves[:, j].reshape(8, 8)  # (row g, column 2t + h)
        for r in range(8):
            column = matrix[:, r]
            expected[j * 40 + (7 - r) * 4: j * 40 + (7 - r) * 4 + 4] = column[0::2] | column[1::2] << 16
    filled = np.zeros(160, bool)
    for j in range(4):
        filled[j * 40: j * 40 + 32] = True
    np.testing.assert_array_equal(out.reshape(-1)[filled], expected[filled])


def test_grid_dependency_controls_leave_a_kernel_s_results_alone():
    """`wait_for_previous` and `release_next` compile and run anywhere (no-ops before
    Hopper and under the simulator); `test_launch` checks what they order on the GPU."""
    @ptx.kernel
    def wait_release_copy(words, out):
        ptx.wait_for_previous()
        i = cuda.threadIdx.x
        ptx.release_next()
        out[i] = words[i] + 1

    words = np.arange(16, dtype=np.int32)
    out = cuda.to_device(np.zeros(16, np.int32))
    wait_release_copy[1, 16](cuda.to_device(words), out)
    assert np.array_equal(out.copy_to_host(), words + 1)


@ptx.device
def _scaled(x, k):
    return x * k


@ptx.device
def _scaled_by_lane(x):
    return _scaled(x, cuda.threadIdx.x)


def test_device_functions_with_and_without_cuda_run_in_a_kernel():
    """Under the simulator a device function that never names `cuda` is the plain Python
    function (no per-call module swap, see `ptx.device`); one that names it, directly or
    in nested code, is wrapped and sees the simulated thread."""
    @ptx.kernel
    def scale(out):
        i = cuda.threadIdx.x
        out[i] = _scaled_by_lane(_scaled(i, 3))

    out = cuda.to_device(np.zeros(8, np.int32))
    scale[1, 8](out)
    assert np.array_equal(out.copy_to_host(), 3 * np.arange(8) ** 2)
    if ptx.SIMULATED:
        def plus_one(x):
            return x + 1

        def nested_lane(x):
            return (lambda: x + cuda.threadIdx.x)()

        assert ptx.device(plus_one) is plus_one
        assert ptx.device(nested_lane) is not nested_lane


def test_arrive_counts_every_block_once_and_the_last_reads_every_block_s_stores():
    """The arrival pattern of `epilogue`: each block's threads store, the block arrives
    once (`arrive` returns the count before it), and the block that arrives last sums the
    others' stores through `load_coherent`."""
    blocks, threads = 6, 32

    @ptx.kernel
    def publish_then_sum(words, counter, order, total):
        block, tid = cuda.blockIdx.x, cuda.threadIdx.x
        last = cuda.shared.array(1, int32)
        words[block * threads + tid] = block * 100 + tid
        cuda.syncthreads()
        if tid == 0:
            before = ptx.arrive(counter, 0)
            order[block] = before
            last[0] = int32(before == blocks - 1)
        cuda.syncthreads()
        if last[0]:
            column = uint32(0)
            for b in range(blocks):
                column += ptx.load_coherent(words, b * threads + tid)
            total[tid] = column

    words = cuda.to_device(np.zeros(blocks * threads, np.int32))
    counter = cuda.to_device(np.zeros(1, np.int32))
    order = cuda.to_device(np.full(blocks, -1, np.int32))
    total = cuda.to_device(np.zeros(threads, np.uint32))
    publish_then_sum[blocks, threads](words, counter, order, total)
    assert sorted(order.copy_to_host()) == list(range(blocks))
    assert counter.copy_to_host()[0] == blocks
    np.testing.assert_array_equal(total.copy_to_host(), 100 * sum(range(blocks)) + blocks * np.arange(threads))


def _warpgroup_operands(rng, n, lbo, sbo):
    """Random A (64 x 16) and B (16 x n) values; A as each thread's 4 words (warp w rows
    16w.., mma's a0..a3), B's halves in core matrices at lbo / sbo (the module docstring)."""
    a_bits, b_bits = _random_half_bits(rng, (64, 16), "bfloat16"), _random_half_bits(rng, (16, n), "bfloat16")
    thread = np.arange(128)
    rows, t = 16 * (thread // 32) + thread % 32 // 4, thread % 4
    a_frag = np.stack([_words(a_bits[rows, 2 * t], a_bits[rows, 2 * t + 1]),
                       _words(a_bits[rows + 8, 2 * t], a_bits[rows + 8, 2 * t + 1]),
                       _words(a_bits[rows, 2 * t + 8], a_bits[rows, 2 * t + 9]),
                       _words(a_bits[rows + 8, 2 * t + 8], a_bits[rows + 8, 2 * t + 9])], axis=1)
    return a_frag, _core_matrices(b_bits, lbo, sbo), _halves(a_bits, "bfloat16"), _halves(b_bits, "bfloat16")


def _core_matrices(bits: np.ndarray, lbo: int, sbo: int) -> np.ndarray:
    """Words of a K-major operand (16 x n halves, (k, col)) in core matrices at lbo / sbo."""
    n = bits.shape[1]
    k, col = np.meshgrid(np.arange(16), np.arange(n), indexing="ij")
    halves = np.zeros(((n // 8 - 1) * sbo + lbo + 128) // 2, np.uint16)
    halves[((col // 8) * sbo + (k // 8) * lbo + (col % 8) * 16 + (k % 8) * 2) // 2] = bits
    return halves.view(np.uint32)


def _warpgroup_result(frags: np.ndarray, n: int) -> np.ndarray:
    """(128, n / 2) accumulators of a warpgroup -> D (64 x n)."""
    thread = np.arange(128)
    rows = (16 * (thread // 32) + thread % 32 // 4)[:, None]
    cols = 2 * (thread % 4)[:, None] + 8 * np.arange(n // 8)[None, :]
    frag, d = frags.reshape(128, n // 8, 4), np.zeros((64, n))
    d[rows, cols], d[rows, cols + 1], d[rows + 8, cols], d[rows + 8, cols + 1] = (frag[:, :, r] for r in range(4))
    return d


@ptx.device
def _stage_tile_words(tiles, source, count):
    """tiles[:count] = source[:count], stored by the block's threads and visible to a
    warpgroup mma issued after this."""
    for w in range(cuda.threadIdx.x, count, cuda.blockDim.x):
        tiles[w] = uint32(source[w])
    ptx.async_proxy_fence()
    cuda.syncthreads()


def _warpgroup_kernel(n, tile_words, overwrite=False):
    """Two warpgroups g, two mma each: thread i's first A words on tile g, then its
    second on tile 1 - g, into the same accumulators; with `overwrite`, a word of the
    second tile changes before the wait."""
    mma, wait_all = ptx.warpgroup_mma("bfloat16", n), ptx.warpgroup_wait[0]
    words, regs, acc_size = 2 * tile_words, n // 2, n // 2 + 1  # accumulators from element 1: an offset

    @ptx.kernel
    def run(a_frag, b_words, out, lbo, sbo):
        i = cuda.threadIdx.x
        group = i // 128
        tiles = cuda.shared.array(words, uint32)
        _stage_tile_words(tiles, b_words, words)
        acc = cuda.local.array(acc_size, float32)
        for r in range(acc_size):
            acc[r] = float32(0.0)
        ptx.warpgroup_fence()
        mma(uint32(a_frag[0, i, 0]), uint32(a_frag[0, i, 1]), uint32(a_frag[0, i, 2]), uint32(a_frag[0, i, 3]),
            tiles, group * tile_words, lbo, sbo, acc, 1)
        mma(uint32(a_frag[1, i, 0]), uint32(a_frag[1, i, 1]), uint32(a_frag[1, i, 2]), uint32(a_frag[1, i, 3]),
            tiles, (1 - group) * tile_words, lbo, sbo, acc, 1)
        ptx.warpgroup_commit()
        if overwrite:
            tiles[(1 - group) * tile_words] = uint32(0)
        wait_all()
        for r in range(regs):
            out[i, r] = acc[r + 1]

    return run


def _run_warpgroups(n, lbo, sbo, overwrite=False):
    rng = np.random.default_rng(n)
    first, second = ([_warpgroup_operands(rng, n, lbo, sbo) for _ in range(2)] for _ in range(2))
    tiles = [_warpgroup_operands(rng, n, lbo, sbo) for _ in range(2)]
    a_frag = np.stack([np.concatenate([first[g][0] for g in range(2)]), np.concatenate([second[g][0] for g in range(2)])])
    out = np.full((256, n // 2), np.nan, np.float32)
    _warpgroup_kernel(n, tiles[0][1].size, overwrite)[1, 256](a_frag, np.concatenate([t[1] for t in tiles]), out, lbo, sbo)
    return out, [first[g][2] @ tiles[g][3] + second[g][2] @ tiles[1 - g][3] for g in range(2)]


needs_warpgroups = pytest.mark.skipif(not ptx.SIMULATED and not ptx.hopper(), reason="wgmma needs sm_90a")


@needs_warpgroups
@pytest.mark.parametrize("n, lbo, sbo", [(16, 128, 256), (24, 3 * 128, 128), (16, 144, 288)])
def test_warpgroup_mma_accumulates_a_times_b_with_b_in_core_matrices(n, lbo, sbo):
    """Two warpgroups, two B tiles in one shared array: a tile's K halves 128 bytes apart
    and its 8-column groups 256, its columns' core matrices side by side and the K halves
    128 x n / 8 bytes apart, or padded core matrices (strides that are not multiples of
    128 bytes: any multiple of 16 is a descriptor stride)."""
    out, expected = _run_warpgroups(n, lbo, sbo)
    for group in range(2):
        np.testing.assert_allclose(_warpgroup_result(out[128 * group: 128 * group + 128], n), expected[group],
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not ptx.SIMULATED, reason="the twin's check (the hardware just reads stale or new words)")
def test_warpgroup_twin_rejects_a_b_tile_overwritten_before_its_wait():
    with pytest.raises(RuntimeError, match="overwritten before the warpgroup_wait"):
        _run_warpgroups(8, 128, 128, overwrite=True)


@needs_warpgroups
@pytest.mark.parametrize("n, a_lbo, a_sbo", [(16, 128, 256), (32, 1024, 128), (8, 144, 288)])
def test_shared_warpgroup_mma_reads_a_from_core_matrices_too(n, a_lbo, a_sbo):
    """A (64 x 16) and B in one shared array, each in core matrices at its own strides;
    two mma on two A tiles and two B tiles accumulate; the twin rejects an A tile
    overwritten before the wait."""
    mma, wait_all = ptx.shared_warpgroup_mma("bfloat16", n), ptx.warpgroup_wait[0]
    rng = np.random.default_rng(n)
    a_bits = [_random_half_bits(rng, (64, 16), "bfloat16") for _ in range(2)]
    b_bits = [_random_half_bits(rng, (16, n), "bfloat16") for _ in range(2)]
    a_words = [_core_matrices(a.T, a_lbo, a_sbo) for a in a_bits]
    b_words = [_core_matrices(b, 128, 256) for b in b_bits]
    a_size, b_size = a_words[0].size, b_words[0].size  # multiples of 16 bytes, as the strides
    size = 2 * (a_size + b_size)
    words = np.zeros(size, np.uint32)
    for i in range(2):
        words[i * a_size:i * a_size + a_words[i].size] = a_words[i]
        words[2 * a_size + i * b_size:2 * a_size + i * b_size + b_words[i].size] = b_words[i]

    regs = n // 2

    def run(overwrite):
        @ptx.kernel
        def multiply_twice(source, out):
            i = cuda.threadIdx.x
            tiles = cuda.shared.array(size, uint32)
            _stage_tile_words(tiles, source, size)
            acc = cuda.local.array(regs, float32)
            for r in range(regs):
                acc[r] = float32(0.0)
            ptx.warpgroup_fence()
            for j in range(2):
                mma(tiles, j * a_size, a_lbo, a_sbo, 2 * a_size + j * b_size, 128, 256, acc, 0)
            ptx.warpgroup_commit()
            if overwrite:
                tiles[a_size] = uint32(0x3F803F80)
            wait_all()
            for r in range(regs):
                out[i, r] = acc[r]

        out = np.full((128, regs), np.nan, np.float32)
        multiply_twice[1, 128](words, out)
        return out

    expected = sum(_halves(a, "bfloat16") @ _halves(b, "bfloat16") for a, b in zip(a_bits, b_bits))
    np.testing.assert_allclose(_warpgroup_result(run(False), n), expected, rtol=1e-5, atol=1e-5)
    if ptx.SIMULATED:
        with pytest.raises(RuntimeError, match="overwritten before the warpgroup_wait"):
            run(True)


def test_warpgroup_mma_rejects_column_counts_the_instruction_lacks():
    with pytest.raises(ValueError, match="multiple of 8 from 8 to 256"):
        ptx.warpgroup_mma("bfloat16", 12)
    with pytest.raises(ValueError, match="multiple of 8 from 8 to 256"):
        ptx.shared_warpgroup_mma("bfloat16", 264)


@pytest.mark.skipif(not ptx.SIMULATED, reason="the twin's check (on the GPU a partial warpgroup is undefined)")
def test_warpgroup_twin_rejects_blocks_of_partial_warpgroups():
    a_frag, b_words, _, _ = _warpgroup_operands(np.random.default_rng(2), 8, 128, 128)
    with pytest.raises(ValueError, match="its warpgroup's 128 threads in the block"):
        _warpgroup_kernel(8, b_words.size)[1, 64](np.stack([a_frag[:64]] * 2), np.concatenate([b_words] * 2),
                                                  np.zeros((64, 4), np.float32), 128, 128)


# Around the smallest normal numbers, the largest finite ones and the halves' own grids.
_EDGES = [2.0**-14, 2.0**-14 - 2.0**-25, 2.0**-14 - 2.0**-26, 2.0**-126, 2.0**-126 * (1 - 2.0**-9), 65504.0, 65519.0,
          65520.0, 3.3895e38, 3.3961e38, 1 + 2.0**-8, 1 + 2.0**-11, 0.0, -0.0]


@pytest.mark.parametrize("half", HALVES)
@given(value=st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(_EDGES + [-v for v in _EDGES]))
def test_scalar_rounding_of_the_twins_equals_the_vector_reference(half, value):
    """`twins.round_half` (integer arithmetic, the GEMM twins' every weight) gives the bits
    numpy's `round_to_half_bits` does, for any float64."""
    assert twins.round_half(value, half) == int(round_to_half_bits(value, half))
