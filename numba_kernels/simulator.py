"""Two repairs to numba's CUDA simulator, the one place this package reaches into its internals.

`ptx` applies both when it runs under the simulator (``NUMBA_ENABLE_CUDASIM=1``); on a GPU
nothing here is imported. Each repair replaces simulator methods and keeps their meaning:

* `share_block_arrays`: one `cuda.shared.array` per declaring line and block, made in one
  step (the simulator could hand two threads two arrays).
* `wake_barriers_on_arrival`: `cuda.syncthreads` as a condition the last arriving thread
  releases, instead of the simulator's main thread polling every thread of the block in a
  loop. The poll took the GIL from the threads doing the work: in the warp-specialised
  GEMM's test, 19 million `is_alive` calls were 64 of its 88 s of CPU.
"""

from __future__ import annotations

import sys
import threading

import numpy as np


def share_block_arrays() -> None:
    """Give every thread of a simulated block one `cuda.shared.array` per line, as a GPU does.

    The simulator keys a block's shared arrays by the line that declares them and makes
    one on first use, but not in one step: two threads reaching the line together could
    each find none and make their own, and the one whose array was replaced kept a
    private copy. Its writes went unseen and the others read uninitialised memory (the
    fused combine read out of bounds in CI once `tests/conftest.py` switched threads 5x
    more often). `dict.setdefault` makes the lookup and the insertion one step."""
    from numba.cuda import types
    from numba.cuda.np import numpy_support
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    dynamic_or_aligned = FakeCUDAShared.array  # one buffer made up front; or an error

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:
            return dynamic_or_aligned(self, shape, dtype, alignment)
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        found = self._allocations.get(key)
        if found is None:
            dtype = numpy_support.as_dtype(dtype) if isinstance(dtype, types.Type) else dtype
            found = self._allocations.setdefault(key, np.empty(shape, dtype))
        return found

    FakeCUDAShared.array = array


class BlockBarrier:
    """The threads of one simulated block and its `syncthreads` barrier.

    As in the simulator it replaces, the barrier waits for the threads still running: one
    that has returned no longer counts (a GPU would hang or be undefined; the simulator
    lets early exits through, and kernels here rely on it). A thread that raises fails the
    launch: waiting threads stop with an error and the launching thread re-raises the
    exception."""

    def __init__(self, size: int):
        self.changed = threading.Condition()
        self.running = size
        self.waiting = 0
        self.generation = 0
        self.failed = None  # the first thread that raised

    def _release_if_all_wait(self) -> None:  # holding `changed`
        if self.waiting and self.waiting == self.running:
            self.waiting, self.generation = 0, self.generation + 1
            self.changed.notify_all()

    def sync(self) -> None:
        with self.changed:
            if self.failed is not None:
                raise RuntimeError("syncthreads: another thread of the block raised")
            generation = self.generation
            self.waiting += 1
            self._release_if_all_wait()
            self.changed.wait_for(lambda: self.generation != generation or self.failed is not None)
            if self.generation == generation:
                raise RuntimeError("syncthreads: another thread of the block raised")

    def leave(self, thread) -> None:
        with self.changed:
            self.running -= 1
            if thread.exception is not None and self.failed is None:
                self.failed = thread
            self._release_if_all_wait()
            self.changed.notify_all()  # the launching thread waits for the last one or a failure

    def wait_for_block(self) -> None:
        """Return when every thread has finished; re-raise the first exception of one."""
        with self.changed:
            self.changed.wait_for(lambda: self.running == 0 or self.failed is not None)
        if self.failed is not None:
            error, traceback = self.failed.exception
            raise error.with_traceback(traceback)


def wake_barriers_on_arrival() -> None:
    """Run each simulated block with a `BlockBarrier` instead of the simulator's polling loop."""
    from numba.cuda.simulator.kernel import BlockManager, BlockThread

    run_thread = BlockThread.run

    def run_block(self, grid_point, *args):
        self.barrier = BlockBarrier(int(np.prod(self._block_dim)))

        def target():
            self._f(*args)

        for block_point in np.ndindex(*self._block_dim):
            BlockThread(target, self, grid_point, block_point, self._debug).start()
        self.barrier.wait_for_block()

    def run(self):
        try:
            run_thread(self)  # keeps an exception in `self.exception`, with the thread's index
        finally:
            self._manager.barrier.leave(self)

    def syncthreads(self):
        self._manager.barrier.sync()

    BlockManager.run, BlockThread.run, BlockThread.syncthreads = run_block, run, syncthreads
