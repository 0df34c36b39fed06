"""Test session set-up: pick the CUDA simulator when there is no GPU.

This must run before anything imports numba, so it lives at the top of conftest. On a
machine with a CUDA GPU the real device is used; everywhere else (CI) kernels run in
numba's CUDA simulator, and tests marked ``gpu`` are skipped.
"""

import os


def _has_cuda_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1" and not _has_cuda_gpu():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"

# The simulator runs ~5,000 threads a second: kernel properties get few examples there.
settings.register_profile(
    "sim", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("gpu", max_examples=40, deadline=None)
settings.load_profile("sim" if SIMULATED else "gpu")


def pytest_collection_modifyitems(config, items):
    if not SIMULATED:
        return
    skip = pytest.mark.skip(reason="needs a real CUDA GPU (run `pytest -m gpu` there)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
