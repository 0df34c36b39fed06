"""QuantSpec: the full storage recipe of one quantized weight.

A spec names each physical tensor an engine stores (``qweight``, ``scales``, ``qzeros``,
``g_idx``, ``weight_packed``, ``weight_scale``, ...) and gives each one a `Layout` (a
composition of transforms) plus the meaning of its elements (an encoding). Everything
else is derived:

    pack(Quantized)   -> {name: physical array}     scatter through each layout
    unpack(physical)  -> Quantized                   gather through each layout
    dequantize(phys)  -> float64 (…, N, K)           the reference numbers a kernel must match

The dequantization formula, for an output row n and input column k with group g(k)
(k // group_size, or g_idx[k] with act-order, or 0 when channel-wise)::

    integer codes:  w[n, k] = (code[n, k] - zero[n, g(k)]) * scale[n, g(k)]   (zero = bias if symmetric)
    e2m1 codes:     w[n, k] = e2m1(code[n, k]) * scale[n, g(k)] / global_scale
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import numpy as np

from .checks import check_group_size, check_per_expert, weight_shape
from .encodings import E2M1, FloatFormat, IntCode
from .quantized import Quantized, as_array
from .transforms import Layout


def take_k(array: np.ndarray, index: np.ndarray) -> np.ndarray:
    """array[..., index] along the last axis; `index` is (K,) or per expert (E, K)."""
    index = np.asarray(index)
    if index.ndim == 1:
        return np.take(array, index, axis=-1)
    return np.take_along_axis(array, index.reshape(index.shape[:-1] + (1,) * (array.ndim - index.ndim) + index.shape[-1:]), axis=-1)


@attrs.frozen
class Tensor:
    """One stored tensor: the engine's name for it and the layout of its elements."""

    name: str
    layout: Layout = Layout()

    def __repr__(self) -> str:
        return f"{self.name} = {self.layout!r}"


@attrs.frozen(cache_hash=True)  # a key of caches the oracle reads at every choice: its permutations hash slowly
class QuantSpec:
    """How one quantized weight (N, K) or (E, N, K) is stored; see the module docstring.

    zero_offset:      stored zero = (zero + zero_offset) mod 2**bits (GPTQ v1 checkpoints: -1).
    sort_k_by_group:  Marlin act-order: input features are stored sorted by group; the
                      permutation is stored as `sort_indices_name`.
    global_scale_reciprocal: the stored global scale is 1 / global_scale (ModelOpt).
    shape_name:       a tensor holding the unpacked shape (compressed-tensors' weight_shape).
    """

    name: str
    code: IntCode | E2M1
    weight: Tensor
    scales: Tensor
    scale_format: FloatFormat = FloatFormat("float16")
    group_size: int | None = attrs.field(default=128, validator=check_group_size)
    zeros: Tensor | None = None
    zero_offset: int = 0
    g_idx_name: str | None = None
    sort_k_by_group: bool = False
    sort_indices_name: str = "g_idx_sort_indices"
    global_scale_name: str | None = None
    global_scale_reciprocal: bool = False
    shape_name: str | None = None

    def __attrs_post_init__(self):
        if self.code.symmetric and self.zeros is not None:
            raise ValueError(f"{self.name}: a symmetric code ({self.code!r}) takes no zero points")
        if not self.code.symmetric and self.zeros is None:
            raise ValueError(f"{self.name}: an asymmetric code ({self.code!r}) needs a zeros tensor")
        if self.sort_k_by_group and self.g_idx_name is None:
            raise ValueError(f"{self.name}: sort_k_by_group needs g_idx_name (act-order)")
        if self.g_idx_name is not None and self.group_size is None:
            raise ValueError(f"{self.name}: act-order g_idx needs a group_size")
        if isinstance(self.code, E2M1) and self.global_scale_name is None:
            raise ValueError(f"{self.name}: e2m1 codes need a global scale tensor")
        if not self.scale_format.signed and not isinstance(self.code, E2M1):
            raise ValueError(f"{self.name}: {self.scale_format!r} scales hold no sign or zero, which only "
                             f"e2m1 codes can take over; got {self.code!r} codes")
        bitpack = self.weight.layout.bitpack
        if bitpack is not None and bitpack.bits != self.code.bits:
            raise ValueError(f"{self.name}: weight packs {bitpack.bits}-bit codes but the code is {self.code.bits}-bit")

    # -- shapes ---------------------------------------------------------------------------

    @property
    def tensor_names(self) -> frozenset[str]:
        """The names of the physical tensors this spec stores (what `pack` writes)."""
        optional = (self.zeros.name if self.zeros is not None else None, self.g_idx_name,
                    self.sort_indices_name if self.sort_k_by_group else None, self.global_scale_name, self.shape_name)
        return frozenset((self.weight.name, self.scales.name) + optional) - {None}

    def groups(self, k: int) -> int:
        """Number of scale groups along K: ceil(K / group_size), 1 when channel-wise."""
        return 1 if self.group_size is None else -(-k // self.group_size)

    def check_shape(self, shape: tuple[int, ...]) -> None:
        """Raise ValueError if this spec cannot store a weight of logical `shape`."""
        n, k = weight_shape(f"{self.name}: weight shape", shape)[-2:]
        grid = (n, k)
        for tensor, tensor_shape in self._tensors((n, k)):
            try:
                tensor.layout.physical_shape(tensor_shape)
            except ValueError as error:
                raise ValueError(f"{self.name}: {tensor.name} cannot hold shape {grid}: {error}") from None

    def _tensors(self, shape):
        n, k = shape
        scale_shape = (n, self.groups(k))
        tensors = [(self.weight, (n, k)), (self.scales, scale_shape)]
        if self.zeros is not None:
            tensors.append((self.zeros, scale_shape))
        return tensors

    def logical_shape(self, physical: dict, shape: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """(N, K) or (E, N, K) of the weight stored in `physical`. Layouts that pad cannot
        recover the unpadded shape from the arrays: pass it as `shape` then."""
        if shape is not None:
            return weight_shape(f"{self.name}: shape", shape)
        stored = self._stored(physical, self.weight.name, "iu")
        if self.shape_name is not None and self.shape_name in physical:
            return weight_shape(f"{self.name}: {self.shape_name}", self._stored(physical, self.shape_name, "iu"))
        if stored.ndim not in (2, 3):
            raise ValueError(f"{self.name}: {self.weight.name} must be (rows, cols) or (E, rows, cols), "
                             f"got shape {stored.shape}")
        return stored.shape[:-2] + self.weight.layout.logical_shape(stored.shape[-2:])

    # -- pack / unpack ----------------------------------------------------------------------

    def pack(self, q: Quantized, *, sort_indices: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Physical tensors, keyed by the engine's names, for the logical weight `q`.

        `sort_indices` (act-order Marlin only) fixes the order of input features within a
        group; by default a stable argsort of g_idx.
        """
        self._check_quantized(q)
        codes, scales, g_idx = q.codes, q.scales, q.g_idx
        if not self.scale_format.signed:
            codes, scales = self._fold_scale_signs(codes, scales, g_idx)
        physical: dict[str, np.ndarray] = {}
        if self.sort_k_by_group:
            order = np.argsort(g_idx, axis=-1, kind="stable") if sort_indices is None else \
                self._sort_indices(as_array(sort_indices), g_idx, "sort_indices")
            codes, g_idx = take_k(codes, order), take_k(g_idx, order)
            physical[self.sort_indices_name] = order.astype(np.int32)
        physical[self.weight.name] = self.weight.layout.pack(codes)
        physical[self.scales.name] = self.scales.layout.pack(self.scale_format.encode(scales))
        if self.zeros is not None:
            stored = (np.asarray(q.zeros, np.int64) + self.zero_offset) % (1 << self.code.bits)
            physical[self.zeros.name] = self.zeros.layout.pack(stored)
        if self.g_idx_name is not None:
            physical[self.g_idx_name] = np.asarray(g_idx, np.int32)
        if self.global_scale_name is not None:
            scale = np.asarray(q.global_scale, np.float32)
            physical[self.global_scale_name] = (np.float32(1.0) / scale) if self.global_scale_reciprocal else scale
        if self.shape_name is not None:
            physical[self.shape_name] = np.asarray(q.codes.shape, np.int64)
        return physical

    def unpack(self, physical: dict, shape: tuple[int, ...] | None = None) -> Quantized:
        """The logical weight stored in `physical` (the inverse of `pack`)."""
        shape = self.logical_shape(physical, shape)
        n, k = shape[-2:]
        scale_shape = (n, self.groups(k))
        codes = self._unpack(physical, self.weight, (n, k), "iu")
        experts = codes.shape[:-2]
        scale_kinds = "f" if self.scale_format.storage_dtype.kind == "f" else "iu"
        scales = self.scale_format.decode(self._unpack(physical, self.scales, scale_shape, scale_kinds))
        zeros = g_idx = global_scale = None
        if self.zeros is not None:
            stored = self._unpack(physical, self.zeros, scale_shape, "iu")
            zeros = ((stored.astype(np.int64) - self.zero_offset) % (1 << self.code.bits)).astype(np.int32)
        if self.g_idx_name is not None:
            g_idx = np.asarray(self._stored(physical, self.g_idx_name, "iu", experts, (k,)), np.int32)
        if self.sort_k_by_group:
            order = self._sort_indices(self._stored(physical, self.sort_indices_name, "iu"), g_idx)
            inverse = np.argsort(order, axis=-1)
            codes, g_idx = take_k(codes, inverse), take_k(g_idx, inverse)
        if self.global_scale_name is not None:
            stored = self._stored(physical, self.global_scale_name, "f", experts).astype(np.float32)
            global_scale = (np.float32(1.0) / stored) if self.global_scale_reciprocal else stored
        return Quantized(codes, scales, zeros, g_idx, global_scale)

    def dequantize(self, physical: dict, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """float64 weights (…, N, K): the reference every kernel is checked against."""
        return self.dequantize_logical(self.unpack(physical, shape))

    def dequantize_logical(self, q: Quantized) -> np.ndarray:
        k = q.codes.shape[-1]
        group = self.group_of_k(k, q.g_idx)
        zeros = None if q.zeros is None else take_k(q.zeros, group)
        scales = take_k(q.scales, group)
        weights = self.code.values(q.codes, zeros) * scales.astype(np.float64)
        if self.global_scale_name is not None:
            weights = weights / self._per_expert(np.asarray(q.global_scale, np.float64), weights.ndim)
        return weights

    def group_of_k(self, k: int, g_idx: np.ndarray | None = None) -> np.ndarray:
        """Scale-group index of every input feature: (K,) or (E, K) with act-order."""
        if self.g_idx_name is not None and g_idx is not None:
            return np.asarray(g_idx, np.int64)
        if self.group_size is None:
            return np.zeros(k, np.int64)
        return np.arange(k) // self.group_size

    # -- helpers ----------------------------------------------------------------------------

    @staticmethod
    def _per_expert(values: np.ndarray, ndim: int) -> np.ndarray:
        """Broadcast a (), (1,) or (E,) per-tensor value against a (…, N, K) array."""
        return values.reshape(-1, 1, 1) if values.size > 1 or ndim == 3 else values.reshape(())

    def _fold_scale_signs(self, codes: np.ndarray, scales: np.ndarray, g_idx) -> tuple[np.ndarray, np.ndarray]:
        """(codes, scales) for a scale format without sign or zero, with the same weights:
        a negative scale's sign flips its e2m1 codes' sign bit, a zero scale zeroes its codes."""
        scales = np.asarray(scales, np.float32)
        if np.isnan(scales).any():
            raise ValueError(f"{self.name}: scales hold NaN, which {self.scale_format!r} cannot store")
        per_code = take_k(scales, self.group_of_k(codes.shape[-1], g_idx))
        codes = np.where(per_code < 0, codes ^ 8, codes)
        codes = np.where(per_code == 0, 0, codes)
        return codes, np.where(scales == 0, np.float32(1.0), np.abs(scales))

    def _get(self, physical: dict, name: str):
        if not isinstance(physical, Mapping):
            raise TypeError(f"{self.name}: physical must be a mapping of tensor names to arrays, "
                            f"got {type(physical).__name__}")
        if name not in physical:
            raise KeyError(f"{self.name}: the physical tensors have no {name!r} (got {sorted(physical)})")
        return physical[name]

    def _stored(self, physical: dict, name: str, kinds: str, experts: tuple[int, ...] | None = None,
                tail: tuple[int, ...] = ()) -> np.ndarray:
        """Tensor `name` as an array whose dtype kind is one of `kinds` ("iu": integer words
        or bits, "f": float values): a float array of words would unpack silently wrong.
        Given `experts`, it must be shaped as `check_per_expert` allows."""
        given = self._get(physical, name)
        value = as_array(given, self.scale_format.torch_bytes if name == self.scales.name else None)
        if value.dtype.kind not in kinds:
            expected = "integer words or bits" if kinds == "iu" else "float values"
            raise TypeError(f"{self.name}: {name} must hold {expected}, got {getattr(given, 'dtype', value.dtype)}")
        if experts is not None:
            check_per_expert(f"{self.name}: {name}", value.shape, experts, tail)
        return value

    def _sort_indices(self, order: np.ndarray, g_idx: np.ndarray, name: str | None = None) -> np.ndarray:
        """`order` (int64), if it permutes the K input features, one permutation per row of g_idx."""
        k = g_idx.shape[-1]
        permutes = np.array_equal(np.sort(order, axis=-1), np.broadcast_to(np.arange(k), order.shape))
        if order.shape != g_idx.shape or not permutes:
            raise ValueError(f"{self.name}: {name or self.sort_indices_name} must be shaped like g_idx {g_idx.shape}, "
                             f"each row a permutation of 0..{k - 1} (got shape {order.shape})")
        return order.astype(np.int64)

    def _unpack(self, physical: dict, tensor: Tensor, shape: tuple[int, int], kinds: str) -> np.ndarray:
        """The logical (…, *shape) values of a stored tensor with a layout."""
        return tensor.layout.unpack(self._stored(physical, tensor.name, kinds), shape, f"{self.name}: {tensor.name}")

    def _check_quantized(self, q: Quantized) -> None:
        self.check_shape(q.codes.shape)
        n, k = q.codes.shape[-2:]
        groups = self.groups(k)
        if q.scales.shape[-1] != groups:
            raise ValueError(f"{self.name}: scales need {groups} groups along K (K={k}, group_size={self.group_size}), got {q.scales.shape[-1]}")
        if (self.zeros is None) != (q.zeros is None):
            raise ValueError(f"{self.name}: zeros {'required' if self.zeros is not None else 'not used'} by this format")
        if (self.g_idx_name is None) != (q.g_idx is None):
            raise ValueError(f"{self.name}: g_idx {'required (act-order)' if self.g_idx_name else 'not used'} by this format")
        if q.g_idx is not None and (q.g_idx.min() < 0 or q.g_idx.max() >= groups):
            raise ValueError(f"{self.name}: g_idx values must lie in [0, {groups})")
        if (self.global_scale_name is None) != (q.global_scale is None):
            raise ValueError(f"{self.name}: global_scale {'required' if self.global_scale_name else 'not used'} by this format")
        limit = 1 << self.code.bits
        if q.codes.min() < 0 or q.codes.max() >= limit:
            raise ValueError(f"{self.name}: codes must lie in [0, {limit})")
        if q.zeros is not None and (q.zeros.min() < 0 or q.zeros.max() >= limit):
            raise ValueError(f"{self.name}: zero points must lie in [0, {limit})")

    def __repr__(self) -> str:
        parts = [f"{self.name}: {self.code!r} codes, group {self.group_size or 'channel'}",
                 f"  {self.weight!r}",
                 f"  {self.scales!r}  [{self.scale_format!r}]"]
        if self.zeros is not None:
            offset = f"  [zero {self.zero_offset:+d}]" if self.zero_offset else ""
            parts.append(f"  {self.zeros!r}{offset}")
        if self.g_idx_name is not None:
            parts.append(f"  {self.g_idx_name} = group of each input feature" + (" (K sorted by group)" if self.sort_k_by_group else ""))
        if self.global_scale_name is not None:
            parts.append(f"  {self.global_scale_name} = {'1 / ' if self.global_scale_reciprocal else ''}global_scale")
        return "\n".join(parts)
