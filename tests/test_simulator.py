"""`numba_kernels.simulator`'s repairs to numba's CUDA simulator keep its meaning: one shared
array a declaring line and block; `syncthreads` a barrier of the threads still running,
released by the last to arrive (the launching thread no longer polls); an exception in one
thread fails the launch with that thread's index instead of hanging the others."""

import threading
import time

import numpy as np
import pytest
from numba import cuda, int32

from numba_kernels import ptx

pytestmark = pytest.mark.skipif(not ptx.SIMULATED, reason="repairs to the CUDA simulator")

THREADS = 64


@cuda.jit
def _rotate_through_shared(out, running):
    """Three rounds: each running thread writes its slot, then reads a neighbour's."""
    shared = cuda.shared.array(THREADS, int32)
    tid = cuda.threadIdx.x
    if tid >= running:
        return  # no longer counted by the barrier
    for r in range(3):
        shared[tid] = 10 * tid + r
        cuda.syncthreads()
        out[r, tid] = shared[(tid + 1 + r) % running]
        cuda.syncthreads()


@pytest.mark.parametrize("running", [THREADS, 40])
def test_syncthreads_waits_for_every_running_thread(running, monkeypatch):
    from numba.cuda.simulator.kernel import BlockThread

    polls = []
    monkeypatch.setattr(BlockThread, "is_alive", lambda self: polls.append(self) or threading.Thread.is_alive(self),
                        raising=False)
    out = np.full((3, THREADS), -1, np.int32)
    _rotate_through_shared[1, THREADS](out, running)
    neighbour = (np.arange(running)[None, :] + 1 + np.arange(3)[:, None]) % running
    assert np.array_equal(out[:, :running], 10 * neighbour + np.arange(3)[:, None])
    assert (out[:, running:] == -1).all() and not polls


@cuda.jit
def _count_multiples_of_three(out):
    out[cuda.threadIdx.x] = cuda.syncthreads_count(cuda.threadIdx.x % 3 == 0)


def test_syncthreads_count_sees_every_threads_predicate():
    out = np.zeros(THREADS, np.int32)
    _count_multiples_of_three[1, THREADS](out)
    assert (out == len(range(0, THREADS, 3))).all()


@cuda.jit
def _seventh_thread_reads_past_the_end(out):
    tid = cuda.threadIdx.x
    out[tid + (100 if tid == 7 else 0)] = tid
    cuda.syncthreads()
    out[tid] = tid


def test_an_exception_fails_the_launch_naming_its_thread_without_hanging():
    started = time.monotonic()
    with pytest.raises(IndexError, match=r"tid=\[7, 0, 0\]"):
        _seventh_thread_reads_past_the_end[1, THREADS](np.zeros(THREADS, np.int32))
    assert time.monotonic() - started < 30
    out = np.zeros((3, THREADS), np.int32)  # the failed block's other threads were released: none left waiting
    _rotate_through_shared[1, THREADS](out, THREADS)
    assert out[2, 0] == 10 * 3 + 2 and threading.active_count() < THREADS


def test_threads_declaring_a_shared_array_together_get_the_same_one():
    """The simulator made a block's shared array on first use in two steps; threads that
    reached the declaration together could each get one of their own."""
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    class SlowLookups(dict):  # every other thread looks up too before any answer comes back
        def get(self, key, default=None):
            found = super().get(key, default)
            time.sleep(0.02)
            return found

    shared, got = FakeCUDAShared(0), []
    shared._allocations = SlowLookups()
    meet = threading.Barrier(8)

    def declare():
        meet.wait()
        got.append(shared.array(4, int32))  # one line: one array of the block

    threads = [threading.Thread(target=declare) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(got) == 8 and all(array is got[0] for array in got)
    assert got[0].shape == (4,) and got[0].dtype == np.int32
