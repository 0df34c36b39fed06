"""A lean launch path: a compiled kernel plus a pre-packed argument buffer.

A Numba launch costs tens of microseconds of Python (type the arguments, convert every
array, pack a parameter list), while a decode-time MoE kernel runs for a few
microseconds on the GPU. A `Launcher` pays that once: it compiles the kernel for the
argument types, keeps the CUDA function handle and a ctypes buffer holding every kernel
parameter, and launches with one `cuLaunchKernel` call. Buffers that change between calls
(the user's input, the token count) are re-pointed in place with `set_array` /
`set_scalar`, which rewrite a few ctypes fields.

This module and `ptx` are the only ones that reach below numba-cuda's public kernel API:
the parameter layout mirrors how numba-cuda flattens arguments (an array is meminfo,
parent, size, itemsize, data pointer, shape, strides; a tuple is its members in order;
scalars by value), and the function handle comes from the compiled overload. A GPU test
checks it against ordinary launches. Under the CUDA simulator a `Launcher` simply calls
the kernel.
"""

from __future__ import annotations

import ctypes

import numpy as np
from .ptx import SIMULATED

_SCALAR_CTYPES = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
                  np.dtype(np.uint32): ctypes.c_uint32, np.dtype(np.float32): ctypes.c_float,
                  np.dtype(np.float64): ctypes.c_double}


def _flatten(value) -> list:
    """numba-cuda's flattened kernel parameters of one argument, as ctypes objects."""
    if isinstance(value, tuple):
        return [field for member in value for field in _flatten(member)]
    if hasattr(value, "__cuda_array_interface__") or isinstance(value, np.ndarray):
        array = value
        fields = [ctypes.c_void_p(0), ctypes.c_void_p(0), ctypes.c_int64(array.size),
                  ctypes.c_int64(array.dtype.itemsize), ctypes.c_void_p(_data_pointer(array))]
        fields += [ctypes.c_int64(s) for s in array.shape]
        fields += [ctypes.c_int64(s) for s in array.strides]
        return fields
    scalar = np.asarray(value)
    if scalar.dtype not in _SCALAR_CTYPES:
        raise TypeError(f"unsupported kernel argument type {scalar.dtype} (pass numpy scalars or arrays)")
    return [_SCALAR_CTYPES[scalar.dtype](scalar.item())]


def _data_pointer(array) -> int:
    if isinstance(array, np.ndarray):
        return array.ctypes.data
    return array.__cuda_array_interface__["data"][0]


class Launcher:
    """`kernel[grid, block, stream](*args)` with the Python work done once.

    args: the kernel's arguments (Numba device arrays, tuples of them, numpy scalars);
          their types fix the compiled overload.
    """

    def __init__(self, kernel, grid, block, args: tuple, shared_memory: int = 0):
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(tuple(grid)))
        self.block = (block, 1, 1) if isinstance(block, int) else tuple(block) + (1,) * (3 - len(tuple(block)))
        self.shared_memory = shared_memory
        self.args = list(args)
        if SIMULATED:
            return
        from cuda.bindings import driver

        self._driver = driver
        dispatcher = kernel.specialize(*args) if hasattr(kernel, "specialize") else kernel
        compiled = next(iter(dispatcher.overloads.values()))
        function = compiled._codelibrary.get_cufunc()
        self._function = driver.CUfunction(int(function.handle))
        self._fields = [_flatten(arg) for arg in args]
        flat = [field for fields in self._fields for field in fields]
        self._params = (ctypes.c_void_p * len(flat))(*[ctypes.addressof(f) for f in flat])
        self._params_address = ctypes.addressof(self._params)

    def set_array(self, index: int, array) -> None:
        """Point argument `index` (an array of the same dtype and rank) at `array`."""
        self.args[index] = array
        if SIMULATED:
            return
        fields = self._fields[index]
        ndim = len(array.shape)
        if len(fields) != 5 + 2 * ndim:
            raise ValueError(f"argument {index} needs an array of rank {(len(fields) - 5) // 2}, got rank {ndim}")
        fields[2].value = int(np.prod(array.shape))
        fields[4].value = _data_pointer(array)
        for axis in range(ndim):
            fields[5 + axis].value = int(array.shape[axis])
            fields[5 + ndim + axis].value = int(array.strides[axis])

    def set_scalar(self, index: int, value) -> None:
        """Change scalar argument `index`."""
        self.args[index] = value
        if not SIMULATED:
            self._fields[index][0].value = value

    def launch(self, stream_handle: int, grid=None) -> None:
        """Launch on the CUDA stream `stream_handle` (an int), optionally with another grid."""
        grid = self.grid if grid is None else tuple(grid) + (1,) * (3 - len(tuple(grid)))
        if SIMULATED:
            self.kernel[grid, self.block](*self.args)
            return
        (error,) = self._driver.cuLaunchKernel(self._function, *grid, *self.block, self.shared_memory,
                                               self._driver.CUstream(stream_handle), self._params_address, 0)
        if error != self._driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernel failed: {error}")

