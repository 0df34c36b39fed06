"""Compile Numba CUDA kernels for sm_90 on a machine without a GPU, and report resources.

Why: CI and the developers' machines have no GPU, and the CUDA simulator runs kernels as
plain Python, so it never type-checks them. Compiling for the real target catches Numba
typing and lowering errors, and the PTX after link-time optimisation (what the GPU runs)
plus ptxas's report show registers, spills, local memory, and whether the PTX helpers
inlined, before any device time is spent.

Needs libNVVM (the CUDA toolkit), NVRTC and nvJitLink:
    pip install "nvidia-cuda-nvrtc==13.0.*" "nvidia-nvjitlink==13.0.*"
It reaches into numba-cuda in one place: compilation asks the current device for its
compute capability, so a stand-in context answers (9, 0), to `numba_kernels.ptx.hopper`
too. A dev tool, not a dependency.

    from tools.ptx_check import compile_kernel, sass
    result = compile_kernel(my_kernel, *example_args)      # numpy example arguments
    print(result.report)                                   # ptxas -v
    assert "ld.local" not in result.ptx
    print(sass(result.ptx))                                # the machine code (wide loads?)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import types

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    raise RuntimeError("ptx_check needs the real CUDA target: unset NUMBA_ENABLE_CUDASIM")

import numba
import numba.cuda.cudadrv.devices as _devices
import numba.cuda.dispatcher as _dispatcher

_FAKE_CONTEXT = types.SimpleNamespace(device=types.SimpleNamespace(compute_capability=(9, 0), id=0))
_devices.get_context = lambda devnum=None: _FAKE_CONTEXT
_dispatcher.get_current_device = numba.cuda.get_current_device = lambda: _FAKE_CONTEXT.device

CC = (9, 0, "a")


class Compiled(types.SimpleNamespace):
    """ptx: the PTX after link-time optimisation; report: ptxas -v output."""


def compile_kernel(kernel, *example_args, lto: bool = True) -> Compiled:
    """Compile `kernel` (a `ptx.kernel` / `cuda.jit` dispatcher, with its launch bounds)
    for the argument types of `example_args`; raise on typing or lowering errors."""
    argtypes = tuple(numba.typeof(a) for a in example_args)
    launch_bounds = kernel.targetoptions.get("launch_bounds")
    compiled = _dispatcher._Kernel(kernel.py_func, argtypes, lto=lto, launch_bounds=launch_bounds)
    library = compiled._codelibrary
    ptx = library.get_lto_ptx(cc=CC) if lto else library.get_asm_str(cc=CC)
    ptx = ptx.rstrip("\x00") + "\n"
    return Compiled(ptx=ptx, report=ptxas_report(ptx))


def ptxas_report(ptx: str) -> str:
    """ptxas -v resource report (registers, spills, shared memory) for sm_90a."""
    ptxas = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
    if not os.path.exists(ptxas):
        return "ptxas not found"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    return out.stdout + out.stderr


def sass(ptx: str) -> str:
    """The SASS ptxas makes of `ptx` for sm_90a (needs nvdisasm: pip install nvidia-cuda-nvdisasm)."""
    ptxas = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
    nvdisasm = shutil.which("nvdisasm")
    if nvdisasm is None:
        import nvidia

        found = [os.path.join(p, "cu13", "bin", "nvdisasm") for p in nvidia.__path__]
        nvdisasm = next((f for f in found if os.path.exists(f)), None)
    if nvdisasm is None:
        return "nvdisasm not found"
    with tempfile.TemporaryDirectory() as folder:
        source, cubin = os.path.join(folder, "k.ptx"), os.path.join(folder, "k.cubin")
        with open(source, "w") as f:
            f.write(ptx)
        subprocess.run([ptxas, "-arch=sm_90a", source, "-o", cubin], check=True, capture_output=True)
        return subprocess.run([nvdisasm, "-c", "-g", cubin], capture_output=True, text=True).stdout
