"""Tensors in, kernels launched on torch's stream, tensors out: the one place that knows
how a torch (or any DLPack) tensor becomes an array a Numba kernel can take.

* On a CUDA machine a tensor becomes a Numba device array over the same memory
  (`cuda.as_cuda_array`, zero copy) and kernels launch on `torch.cuda.current_stream()`
  (wrapped with `cuda.external_stream`), never on the legacy default stream, so launches
  order correctly with torch's work and are captured by `torch.cuda.graph`.
* Under the CUDA simulator (no GPU) tensors live on the CPU and become numpy views
  (`t.numpy()`, zero copy: a kernel's writes land in the tensor).

16-bit floats (bfloat16, float16) always reach kernels as their int16 bit patterns; kernels
decode them with `ptx.half_to_f32` and encode with `ptx.to_half` / `ptx.pack2`.

Validation happens here, once, at the Python boundary (`check_tensor`), with errors that
name the argument and what was expected.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import cuda

from .ptx import SIMULATED

HALF_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
"""torch dtype -> the name the PTX helpers use for it."""

_BIT_VIEWS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.bool: torch.uint8}


def kernel_device() -> torch.device:
    """Where kernel inputs and outputs live: the current CUDA device, or the CPU under
    the simulator."""
    if SIMULATED:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _on_kernel_device(tensor: torch.Tensor) -> bool:
    """Whether `tensor` lives where kernels run: what `kernel_device` says, asked without
    building device objects (a check per input of every eager forward)."""
    if SIMULATED:
        return tensor.device.type == "cpu"
    # A CUDA tensor exists, so CUDA is initialised: the current device may be asked directly.
    return tensor.is_cuda and tensor.get_device() == torch._C._cuda_getDevice()


def as_tensor(value, name: str) -> torch.Tensor:
    """A torch view of `value` (a tensor, or any object with `__dlpack__`), no copy."""
    if isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "__dlpack__"):
        return torch.from_dlpack(value)
    raise TypeError(f"{name} must be a torch tensor or support __dlpack__, got {type(value).__name__}")


def to_kernel(tensor: torch.Tensor):
    """The array a kernel takes for `tensor`: zero copy; half floats as int16 bits."""
    view = tensor.view(_BIT_VIEWS[tensor.dtype]) if tensor.dtype in _BIT_VIEWS else tensor
    if SIMULATED:
        return view.numpy()
    return cuda.as_cuda_array(view)


def launch_stream():
    """The Numba stream for torch's current stream (0, the only stream, in the simulator)."""
    if SIMULATED:
        return 0
    return _external_stream(launch_stream_handle())


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU builds


def launch_stream_handle() -> int:
    """torch's current CUDA stream as a raw handle, for `launch.Launcher` (0 when simulated).
    Asked of torch's C++ side directly where it can (as torch's own generated code does):
    `torch.cuda.current_stream()` builds a Stream object through several layers of Python,
    3.9 us a call on the H200's host against 0.2 asked directly (benchmarks/LOG.md)."""
    if SIMULATED:
        return 0
    if _raw_stream is None:
        return torch.cuda.current_stream().cuda_stream
    return _raw_stream(torch._C._cuda_getDevice())


@functools.lru_cache(maxsize=64)
def _external_stream(handle: int):
    return cuda.external_stream(handle)


def check_count(name: str, value, low: int, high: int | None = None) -> None:
    """Raise unless `value` is an integer (not a bool or a float) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low or (
            high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")


def check_range(name: str, values: torch.Tensor, low: int, high: int | None = None, hint: str = "") -> None:
    """Raise unless every entry of `values` lies in [low, high) (high None: at least low),
    naming the range found and ending with `hint`: ids a kernel would index memory with.
    Reductions and a host sync, so for checked calls, not the hot path."""
    inside = values >= low if high is None else (values >= low) & (values < high)
    if values.numel() and not bool(inside.all()):
        bound = f"be >= {low}" if high is None else f"lie in [{low}, {high})"
        raise ValueError(f"{name} must {bound}, got values from {int(values.min())} to {int(values.max())}{hint}")


def check_disjoint(tensors: dict) -> None:
    """Raise unless the named tensors occupy separate memory: a kernel that writes one while
    it reads or writes another would give wrong results."""
    spans = sorted(((t.data_ptr(), position), t.data_ptr() + t.numel() * t.element_size(), name)
                   for position, (name, t) in enumerate(tensors.items()) if t.numel())
    reach, owner = 0, None
    for (start, _), end, name in spans:
        if start < reach:
            raise ValueError(f"{owner} and {name} share memory: pass separate tensors")
        if end > reach:
            reach, owner = end, name


def _describe_dtypes(dtypes) -> str:
    names = [str(d) for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def check_tensor(name: str, value, *, dtype=None, shape=None, ndim=None, contiguous: bool = True,
                 alignment: int = 1) -> torch.Tensor:
    """Return `value` as a torch tensor after checking it, or raise a clear error.

    dtype:     one torch dtype or a tuple of allowed ones.
    shape:     the exact shape, with None for any size along an axis.
    ndim:      the number of axes (when the sizes are free).
    alignment: the bytes its first element's address must be a multiple of (a view
               starting mid-allocation may not be; the kernels' vector loads need it).
    """
    tensor = as_tensor(value, name)
    if tensor.requires_grad:  # a kernel argument cannot carry a graph, and the output would silently have none
        raise ValueError(f"{name} requires grad, and the kernels are inference only (no autograd): pass "
                         f"{name}.detach() or call under torch.no_grad()")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if tensor.dtype not in allowed:
            raise TypeError(f"{name} must be a {_describe_dtypes(allowed)} tensor, got {tensor.dtype}")
    if not _on_kernel_device(tensor):
        raise ValueError(f"{name} must be on {kernel_device()} (the kernels' device), got {tensor.device}")
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if shape is not None and tensor.shape != shape:  # equal: no per-axis look (a check per eager forward)
        if tensor.dim() != len(shape) or any(want is not None and want != got
                                             for want, got in zip(shape, tensor.shape)):
            sizes = ["*" if s is None else str(s) for s in shape]
            wanted = f"({sizes[0]},)" if len(sizes) == 1 else "(" + ", ".join(sizes) + ")"
            raise ValueError(f"{name} must have shape {wanted}, got {tuple(tensor.shape)}")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first), got strides {tensor.stride()}")
    if alignment > 1 and tensor.data_ptr() % alignment:  # data_ptr() costs: not asked where any address will do
        raise ValueError(f"{name} must start at a {alignment}-byte aligned address, got one "
                         f"{tensor.data_ptr() % alignment} bytes past it (a view into another tensor?): pass a copy")
    return tensor


@functools.lru_cache(maxsize=None)
def stand_in(value, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cached one-element tensor for arguments a kernel takes but a call does not use,
    so launches allocate nothing (CUDA graphs, persistent workspaces)."""
    return torch.full((1,), value, dtype=dtype, device=device)


def empty(shape, dtype) -> torch.Tensor:
    """An uninitialised tensor on the kernels' device."""
    return torch.empty(shape, dtype=dtype, device=kernel_device())
