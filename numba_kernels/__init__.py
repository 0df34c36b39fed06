"""Numba CUDA kernels for the quantized MoE pipeline, generated from `layouts` specs.

Every kernel family lives in its own module with a factory (cached per spec and tile
configuration), a Python wrapper that validates torch tensors once and launches on
torch's current stream, and a numpy reference the tests compare against. `ptx` holds
the few PTX instructions Numba lacks (each with a simulator twin); `interop` turns
tensors into kernel arrays.
"""
