"""The logical side of a quantized weight, independent of any engine's storage."""

from __future__ import annotations

import attrs
import numpy as np


def _array_or_none(value):
    return None if value is None else np.asarray(value)


@attrs.frozen(eq=False)
class Quantized:
    """A quantized weight in canonical N-first orientation.

    codes:        (N, K) or (E, N, K) stored unsigned integer codes (symmetric 4-bit: value + 8;
                  fp4: e2m1 nibble codes 0..15).
    scales:       (..., N, G) float values, G = ceil(K / group_size) (1 when channel-wise).
    zeros:        (..., N, G) integer zero points in code space, for asymmetric formats.
    g_idx:        (K,) or (E, K) group of each input feature (GPTQ act-order).
    global_scale: (), (1,) or (E,) per-tensor divisor of NVFP4 (w = e2m1 * scale / global_scale).
    """

    codes: np.ndarray = attrs.field(converter=np.asarray)
    scales: np.ndarray = attrs.field(converter=np.asarray)
    zeros: np.ndarray | None = attrs.field(default=None, converter=_array_or_none)
    g_idx: np.ndarray | None = attrs.field(default=None, converter=_array_or_none)
    global_scale: np.ndarray | None = attrs.field(default=None, converter=_array_or_none)

    def __attrs_post_init__(self):
        if self.codes.ndim not in (2, 3):
            raise ValueError(f"codes must be (N, K) or (E, N, K), got shape {self.codes.shape}")
        if self.codes.dtype.kind not in "iu":
            raise TypeError(f"codes must be integers (the stored codes, not dequantized values), got {self.codes.dtype}")
        if self.scales.shape[:-1] != self.codes.shape[:-1]:
            raise ValueError(f"scales must be shaped {self.codes.shape[:-1]} + (groups,), got {self.scales.shape}")
        if self.zeros is not None and self.zeros.shape != self.scales.shape:
            raise ValueError(f"zeros must have the scales' shape {self.scales.shape}, got {self.zeros.shape}")
        if self.g_idx is not None and self.g_idx.shape[-1] != self.codes.shape[-1]:
            raise ValueError(f"g_idx must have K = {self.codes.shape[-1]} entries, got shape {self.g_idx.shape}")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    def equals(self, other: "Quantized") -> bool:
        """Exact equality of every field (NaN-free data; float fields compared bitwise)."""
        def same(a, b):
            if a is None or b is None:
                return a is None and b is None
            return a.shape == b.shape and np.array_equal(np.asarray(a), np.asarray(b))

        return all(same(getattr(self, f.name), getattr(other, f.name)) for f in attrs.fields(Quantized))
