"""Compiling the package's kernels without the PTX that numba-cuda makes and throws away.

numba-cuda 0.30's kernel constructor (`dispatcher._Kernel.__init__`) compiles the whole
kernel to PTX with NVVM only to search that text for the names of helpers it may have to
link (its reshape functions; NRT, when enabled). For a kernel compiled with `lto=True`
(every `ptx.kernel`) that PTX is never used: the cubin is linked from LTO-IR by nvJitLink.
Yet it is most of a large kernel's compile: for the warp-specialised GEMM 256 slots wide,
73 s of about 120 (typing and lowering 32 s, LTO-IR and linking 11 s, ptxas 5 s; sm_90a,
offline, seventy-seventh session of benchmarks/LOG.md). So while one of the package's
kernels is constructed, an LTO code library's `get_asm_str` answers with its LLVM IR
instead, which declares by name every function the kernel calls.

Like `launch`, this module reaches below numba-cuda's public API, and only here: it wraps
`_Kernel.__init__` and `CUDACodeLibrary.get_asm_str` of numba-cuda 0.30, with NRT off,
and leaves other versions and kernels that are not the package's as they are. Set
NUMBA_MOE_LEAN_COMPILE=0 to compile the ordinary way.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import threading
import weakref

LEAN_COMPILE = os.environ.get("NUMBA_MOE_LEAN_COMPILE", "1") != "0"
SUPPORTED_PREFIX = "0.30."  # the numba-cuda versions whose constructor this module knows

_package_functions = weakref.WeakSet()  # the Python functions of the package's kernels
_constructing = threading.local()  # .lean: a package kernel with lto=True is being constructed


def register(py_func) -> None:
    """Compile the LTO kernels of `py_func` (a `ptx.kernel`'s function) the lean way."""
    if _install():
        _package_functions.add(py_func)


@functools.cache
def _install() -> bool:
    """Wrap numba-cuda's constructor and `get_asm_str` once; False where they stay as
    they are (switched off, another numba-cuda, or a CUDA target not installed as the
    numba-cuda distribution: its successor keeps the kernel API, not these internals)."""
    try:
        version = importlib.metadata.version("numba-cuda")
    except importlib.metadata.PackageNotFoundError:
        return False
    if not LEAN_COMPILE or not version.startswith(SUPPORTED_PREFIX):
        return False
    from numba.cuda import codegen, dispatcher
    from numba.cuda.core import config

    dispatcher._Kernel.__init__ = _marking_construction(dispatcher._Kernel.__init__)
    codegen.CUDACodeLibrary.get_asm_str = _names_while_constructing(codegen.CUDACodeLibrary.get_asm_str, config)
    return True


def _marking_construction(init):
    @functools.wraps(init)
    def construct(self, py_func, *args, **kwargs):
        _constructing.lean = bool(kwargs.get("lto")) and py_func in _package_functions
        try:
            init(self, py_func, *args, **kwargs)
        finally:
            _constructing.lean = False

    return construct


def _names_while_constructing(get_asm_str, config):
    @functools.wraps(get_asm_str)
    def asm_or_names(self, cc=None):
        if getattr(_constructing, "lean", False) and self._lto and not getattr(config, "CUDA_ENABLE_NRT", False):
            return "\n".join(self.llvm_strs)
        return get_asm_str(self, cc)

    return asm_or_names
