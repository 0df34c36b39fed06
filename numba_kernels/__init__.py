"""Numba CUDA kernels for the quantized MoE pipeline, generated from `layouts` specs.

Every kernel family lives in its own module with a factory (cached per spec and tile
configuration), a Python wrapper that validates torch tensors once and launches on
torch's current stream, and a numpy reference the tests compare against. `ptx` holds
the few PTX instructions Numba lacks (each with a simulator twin); `interop` turns
tensors into kernel arrays; `launch` launches every kernel and records and replays
launches (the lean launch path); `route_align` fuses routing and alignment for decode.

On a machine without a CUDA GPU, importing this package selects numba's CUDA simulator
(unless NUMBA_ENABLE_CUDASIM is set either way), so every kernel still runs, slowly.
"""

import os
import sys


def _select_simulator_without_gpu() -> None:
    if "NUMBA_ENABLE_CUDASIM" in os.environ or "numba" in sys.modules:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


_select_simulator_without_gpu()
