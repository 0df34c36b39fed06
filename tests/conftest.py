"""Test session set-up: the CUDA simulator when there is no GPU, Hypothesis profiles.

Importing `numba_kernels` first selects numba's CUDA simulator on a machine without a
CUDA GPU (it must happen before numba is imported). On a GPU machine the real device is
used; everywhere else (CI) kernels run in the simulator and tests marked `gpu` are skipped.
"""

import gc
import os
import sys

import numba_kernels  # noqa: F401  (selects the simulator before numba loads)
import pytest
import torch
from hypothesis import HealthCheck, settings

from long_first import start_long_tests_first
from numba_kernels.ptx import SIMULATED

# The simulator runs ~5,000 threads a second: kernel properties get few examples there.
settings.register_profile(
    "sim", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("gpu", max_examples=40, deadline=None)
settings.load_profile("sim" if SIMULATED else "gpu")

# The simulator runs a block's threads as Python threads, which hand the GIL on in turns; the
# warps' collective instructions and barriers make them wait on one another often. In 1 ms
# turns instead of Python's default 5 ms, on the 2-core CI machine, the whole suite took
# 346 s instead of 401 (ninety-fifth session; before `numba_kernels.simulator` stopped the
# simulator's polling loop, whose share of the GIL the shorter turns mostly cut, 1 ms had
# halved the warp-specialised layer's replay test).
if SIMULATED:
    sys.setswitchinterval(0.001)


@pytest.hookimpl(trylast=True)  # after `-m gpu` has deselected the rest
def pytest_collection_modifyitems(config, items):
    if not SIMULATED:
        start_long_tests_first(items, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
        return
    skip = pytest.mark.skip(reason="needs a real CUDA GPU (run `pytest -m gpu` there)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _return_cached_gpu_memory():
    """After each test on the GPU, hand the blocks torch's allocator keeps cached back to
    the driver: `pytest -m gpu` runs sixteen workers on one card, and a worker that had
    cached a DeepSeek layer's weights (several GB) kept them from the others (CUDA out of
    memory in two runs of the forty-ninth session)."""
    yield
    if not SIMULATED:
        gc.collect()  # a test's layers may sit in reference cycles until collected
        torch.cuda.empty_cache()
