"""Compile Numba CUDA kernels to PTX (sm_90) on a machine without a GPU.

Why: CI and the developers' machines have no GPU, and the CUDA simulator runs kernels as
Python, so it never type-checks them. Compiling to PTX catches Numba typing and lowering
errors (and, with ptxas, register use and spills) before any device time is spent.

It reaches into numba-cuda in one place: device-function compilation asks the current
device for its compute capability, so a stand-in device answers (9, 0). Needs NVVM
(CUDA toolkit) and NVRTC (`pip install nvidia-cuda-nvrtc`); a dev tool, not a dependency.

Use:  ptx = compile_for_sm90(kernel_dispatcher, *example_args)  # numpy example args
"""

import os
import shutil
import subprocess
import tempfile
import types

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    raise RuntimeError("ptx_check needs the real CUDA target: unset NUMBA_ENABLE_CUDASIM")

import numba
import numba.cuda.dispatcher as _dispatcher
from numba import cuda

_dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))


def compile_for_sm90(kernel, *example_args):
    """PTX text of `kernel` (a `cuda.jit` dispatcher) typed for the given example arguments."""
    argtypes = tuple(numba.typeof(a) for a in example_args)
    ptx, _ = cuda.compile_ptx(kernel.py_func, argtypes, cc=(9, 0))
    return ptx


def ptxas_report(ptx: str) -> str:
    """ptxas -v resource report (registers, spills, shared memory) for sm_90, if ptxas exists."""
    ptxas = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
    if not os.path.exists(ptxas):
        return "ptxas not found"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([ptxas, "-arch=sm_90", "-v", f.name, "-o", os.devnull],
                         capture_output=True, text=True)
    os.unlink(f.name)
    return out.stdout + out.stderr
