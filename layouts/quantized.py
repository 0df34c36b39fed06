"""The logical side of a quantized weight, independent of any engine's storage."""

from __future__ import annotations

import sys

import attrs
import numpy as np

from .checks import check_per_expert, integers


def as_array(value, torch_bytes: str | None = None) -> np.ndarray:
    """np.asarray, also of torch bfloat16 tensors (checkpoints store scales so; numpy has no
    bfloat16): their values, exact in float32; and of a torch tensor of dtype `torch_bytes`
    (`FloatFormat.torch_bytes`, a float8 numpy lacks): its bytes, as uint8."""
    dtype = str(getattr(value, "dtype", ""))
    if torch_bytes is not None and dtype == f"torch.{torch_bytes}":
        return np.asarray(value.view(sys.modules["torch"].uint8).cpu())  # a torch tensor: torch is imported
    if dtype == "torch.bfloat16":
        value = value.float()
    return np.asarray(value)


def _array_or_none(value):
    return None if value is None else as_array(value)


@attrs.frozen(eq=False)
class Quantized:
    """A quantized weight in canonical N-first orientation.

    codes:        (N, K) or (E, N, K) stored unsigned integer codes (symmetric 4-bit: value + 8;
                  fp4: e2m1 nibble codes 0..15).
    scales:       (..., N, G) float values, G = ceil(K / group_size) (1 when channel-wise).
    zeros:        (..., N, G) integer zero points in code space, for asymmetric formats.
    g_idx:        (K,), (1, K) or (E, K) integer group of each input feature (GPTQ act-order).
    global_scale: (), (1,) or (E,) per-tensor divisor of NVFP4 (w = e2m1 * scale / global_scale).
    """

    codes: np.ndarray = attrs.field(converter=as_array, validator=integers("the stored codes, not dequantized values"))
    scales: np.ndarray = attrs.field(converter=as_array)
    zeros: np.ndarray | None = attrs.field(default=None, converter=_array_or_none,
                                           validator=integers("zero points in code space"))
    g_idx: np.ndarray | None = attrs.field(default=None, converter=_array_or_none,
                                           validator=integers("the group of each input feature"))
    global_scale: np.ndarray | None = attrs.field(default=None, converter=_array_or_none)

    def __attrs_post_init__(self):
        if self.codes.ndim not in (2, 3):
            raise ValueError(f"codes must be (N, K) or (E, N, K), got shape {self.codes.shape}")
        if self.scales.shape[:-1] != self.codes.shape[:-1]:
            raise ValueError(f"scales must be shaped {self.codes.shape[:-1]} + (groups,), got {self.scales.shape}")
        if self.zeros is not None and self.zeros.shape != self.scales.shape:
            raise ValueError(f"zeros must have the scales' shape {self.scales.shape}, got {self.zeros.shape}")
        experts = self.codes.shape[:-2]
        if self.g_idx is not None:
            check_per_expert("g_idx", self.g_idx.shape, experts, self.codes.shape[-1:])
        if self.global_scale is not None:
            check_per_expert("global_scale", self.global_scale.shape, experts)

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
