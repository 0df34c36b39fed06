"""Declarative layouts of quantized weights: where each quantized element lives.

A `QuantSpec` composes small invertible transforms (`layouts.transforms`) and element
encodings (`layouts.encodings`); pack, unpack, dequantize and the index maps kernels use
all derive from it. Named engine formats live in `layouts.formats`.

    >>> from layouts import formats, Quantized
    >>> spec = formats.gptq(bits=4, group_size=128)
    >>> physical = spec.pack(quantized)            # {'qweight': ..., 'scales': ...}
    >>> spec.unpack(physical).equals(quantized)    # True
"""

from . import formats
from .encodings import E2M1, FloatFormat, IntCode
from .explain import explain
from .quantized import Quantized
from .spec import QuantSpec, Tensor
from .transforms import (BitPack, InterleaveHalves, Layout, Pad, PadHalves, Panels, Permute, SwapHalves,
                         Swizzle128x4, Tile, Transpose)


def convert(physical: dict, src: QuantSpec, dst: QuantSpec) -> dict:
    """Re-store a weight from one format in another, through the logical form."""
    return dst.pack(src.unpack(physical))


__all__ = [
    "BitPack", "E2M1", "FloatFormat", "IntCode", "InterleaveHalves", "Layout", "Pad", "PadHalves", "Panels",
    "Permute", "QuantSpec", "Quantized", "SwapHalves", "Swizzle128x4", "Tensor", "Tile", "Transpose", "convert", "explain",
    "formats",
]
