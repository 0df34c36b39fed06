"""A quantized weight as kernels see it: a spec, a logical shape, and six arrays.

Every kernel that reads quantized weights takes them as one tuple argument, always in
this order, whatever the format (a 1-element stand-in where a spec lacks a tensor):

    weight        (E, rows, cols)  the packed codes, as the spec stores them
    scales        (E, rows, cols)  stored scales (half floats as int16 bits, fp8 as uint8)
    zeros         (E, rows, cols)  stored zero points (asymmetric formats)
    g_idx         (E, K)           scale group of each *stored* input feature (act-order)
    k_order       (E, K)           logical input feature of each stored one (K sorted by group)
    global_scale  (E,)             per-expert NVFP4 global scale, as stored

Two-dimensional (dense) weights are the E = 1 case. `KernelWeights.from_physical` checks
every tensor against the spec before anything reaches a kernel.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import numpy as np
import torch

from layouts import QuantSpec
from layouts.checks import check_per_expert

from . import interop

SLOTS = ("weight", "scales", "zeros", "g_idx", "k_order", "global_scale")
"""The six arrays' names, in their order (module docstring)."""

_STORAGE_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.uint8): torch.uint8,
                   np.dtype(np.float16): torch.float16, np.dtype(np.uint16): torch.bfloat16,
                   np.dtype(np.float32): torch.float32}


def _as_device_tensor(name: str, value, dtype: torch.dtype, torch_bytes: str | None = None) -> torch.Tensor:
    """A tensor of `dtype` on the kernels' device; numpy input is copied there (uint16
    bfloat16 bits and unsigned words reinterpreted, never converted), as is a torch tensor
    of dtype `torch_bytes` (`FloatFormat.torch_bytes`: fp8 scales) for uint8 bytes."""
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        if array.dtype == np.uint16:
            array = array.view(np.int16)
        elif array.dtype == np.uint32:
            array = array.view(np.int32)
        tensor = torch.from_numpy(array)
        if tensor.dtype == torch.int16 and dtype == torch.bfloat16:
            tensor = tensor.view(torch.bfloat16)
        value = tensor.to(interop.kernel_device())
    tensor = interop.as_tensor(value, name)
    if torch_bytes is not None and tensor.dtype == getattr(torch, torch_bytes) and dtype == torch.uint8:
        tensor = tensor.view(torch.uint8)
    if tensor.dtype != dtype and tensor.dtype.is_floating_point and dtype.is_floating_point:
        tensor = _exactly_as(name, tensor, dtype)
    if tensor.dtype != dtype:
        raise TypeError(f"{name} must be stored as {dtype}, got {tensor.dtype}")
    if tensor.device != interop.kernel_device():
        raise ValueError(f"{name} must be on {interop.kernel_device()}, got {tensor.device}")
    return tensor.contiguous()


def _exactly_as(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor`'s values in another float dtype, if every one survives the conversion: an
    engine keeps a checkpoint's float16 scales in the model's dtype (bfloat16), or a
    quantiser writes them in float32."""
    converted = tensor.to(dtype)
    if not torch.allclose(converted.double(), tensor.double(), rtol=0, atol=0, equal_nan=True):  # exact
        raise ValueError(f"{name} must be stored as {dtype}, and its {tensor.dtype} values are not all exactly "
                         f"{dtype} values (out of its range, or finer)")
    return converted


def _check_permutations(name: str, order: torch.Tensor) -> None:
    k = order.shape[-1]
    identity = torch.arange(k, dtype=order.dtype, device=order.device).expand_as(order)
    if not torch.equal(order.sort(dim=-1).values, identity):
        raise ValueError(f"{name} must order the {k} input features: each row a permutation of 0..{k - 1}")


def _as_3d(tensor: torch.Tensor, experts: int, name: str) -> torch.Tensor:
    if tensor.dim() == 2:
        tensor = tensor.unsqueeze(0)
    if tensor.dim() != 3 or tensor.shape[0] not in (1, experts):
        raise ValueError(f"{name} must be (rows, cols) or ({experts}, rows, cols), got {tuple(tensor.shape)}")
    return tensor


@attrs.frozen(eq=False)
class KernelWeights:
    """A spec's physical tensors on the kernels' device, shaped for kernels.

    spec:    the layout (hashable: kernels are compiled per spec).
    shape:   logical (E, N, K) (E = 1 for a dense weight).
    tensors: the six slot tensors (see the module docstring).
    """

    spec: QuantSpec
    shape: tuple[int, int, int]
    tensors: tuple[torch.Tensor, ...]
    _arrays: tuple = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self):
        # Converted once: a view per launch would cost host time on every call; reloads
        # write into the same tensors, so the views stay valid.
        object.__setattr__(self, "_arrays", tuple(interop.to_kernel(t) for t in self.tensors))

    @classmethod
    def from_physical(cls, spec: QuantSpec, physical: dict, shape: tuple[int, ...] | None = None, *,
                      check_indices: bool = True) -> "KernelWeights":
        """Check the engine-named tensors in `physical` (torch or numpy) against `spec` and
        arrange them for kernels. `shape` is the logical (N, K) or (E, N, K); it can be
        omitted where the arrays determine it (no padding in the layout). `check_indices`
        checks act-order's g_idx and sort indices (a host sync): kernels index memory with
        them. Buffers not yet written pass False."""
        if not isinstance(spec, QuantSpec):
            raise TypeError(f"spec must be a QuantSpec (layouts.formats), got {type(spec).__name__}")
        if not isinstance(physical, Mapping):
            raise TypeError(f"physical must map tensor names to tensors, got {type(physical).__name__}")
        if shape is None:
            shape = _stored_shape(spec, physical)
        shape = tuple(int(s) for s in shape)
        spec.check_shape(shape)
        experts = shape[0] if len(shape) == 3 else 1
        n, k = shape[-2:]
        groups = spec.groups(k)
        device = interop.kernel_device()

        def tensor(name, layout, logical, storage, torch_bytes=None):
            expected = layout.physical_shape(logical)
            value = _as_3d(_as_device_tensor(name, spec._get(physical, name), storage, torch_bytes), experts, name)
            if tuple(value.shape[-2:]) != expected:
                raise ValueError(f"{spec.name}: {name} must have trailing shape {expected} for a weight of "
                                 f"shape {shape}, got {tuple(value.shape)}")
            return value

        word = spec.weight.layout.bitpack
        weight = tensor(spec.weight.name, spec.weight.layout, (n, k),
                        torch.int32 if word is None or word.word_bits == 32 else torch.uint8)
        scales = tensor(spec.scales.name, spec.scales.layout, (n, groups),
                        _STORAGE_DTYPES[spec.scale_format.storage_dtype], spec.scale_format.torch_bytes)
        if spec.zeros is not None:
            zero_word = spec.zeros.layout.bitpack
            zero_storage = (torch.int32 if zero_word.word_bits == 32 else torch.uint8) if zero_word else \
                _STORAGE_DTYPES[np.dtype(spec.zeros.layout.dtype or np.int32)]
            zeros = tensor(spec.zeros.name, spec.zeros.layout, (n, groups), zero_storage)
        else:
            zeros = torch.zeros((1, 1, 1), dtype=torch.int32, device=device)

        def per_feature(name):  # act-order's (K,) tensors: one for every expert, or one each
            value = _as_device_tensor(name, spec._get(physical, name), torch.int32)
            check_per_expert(f"{spec.name}: {name}", value.shape, (experts,), (k,))
            return value.reshape(-1, k)

        g_idx = torch.zeros((1, 1), dtype=torch.int32, device=device)
        if spec.g_idx_name is not None:
            g_idx = per_feature(spec.g_idx_name)
            if check_indices:
                interop.check_range(f"{spec.name}: {spec.g_idx_name}", g_idx, 0, groups, " (the scale groups)")
        k_order = torch.zeros((1, 1), dtype=torch.int32, device=device)
        if spec.sort_k_by_group:
            k_order = per_feature(spec.sort_indices_name)
            if check_indices:
                _check_permutations(f"{spec.name}: {spec.sort_indices_name}", k_order)
        global_scale = torch.ones(1, dtype=torch.float32, device=device)
        if spec.global_scale_name is not None:
            global_scale = _as_device_tensor(spec.global_scale_name, spec._get(physical, spec.global_scale_name),
                                             torch.float32).reshape(-1)
        if global_scale.shape[0] not in (1, experts):
            raise ValueError(f"{spec.name}: {spec.global_scale_name} must hold 1 or {experts} experts, got shape "
                             f"{tuple(global_scale.shape)}")
        return cls(spec, (experts, n, k), (weight, scales, zeros, g_idx, k_order, global_scale))

    def arrays(self) -> tuple:
        """The six kernel arrays (zero-copy views, made once)."""
        return self._arrays

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    @property
    def k_order(self) -> torch.Tensor:
        """(E, K) int32: the logical input feature of each stored one (K sorted by group)."""
        return self.tensors[4]

    def nbytes(self) -> int:
        """Bytes of every stored tensor (what a kernel streams to read the whole weight)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)


def _stored_shape(spec: QuantSpec, physical: dict) -> tuple[int, ...]:
    """The logical shape the arrays determine (compressed-tensors stores it outright)."""
    if spec.shape_name is not None and spec.shape_name in physical:
        value = physical[spec.shape_name]
        value = value.cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        return tuple(int(v) for v in value)
    stored = tuple(spec._get(physical, spec.weight.name).shape)
    return stored[:-2] + spec.weight.layout.logical_shape(stored[-2:])
