"""Show a spec: its formula, and a drawing of where the elements of a small tile land.

CuTe's `print_layout` idea: a layout is a function, so draw it. For each physical word of
a small weight, list the logical (n, k) elements it holds, in slot order.
"""

from __future__ import annotations

import numpy as np

from .checks import weight_shape
from .spec import QuantSpec


def where(spec: QuantSpec, shape: tuple[int, int], n: int, k: int) -> tuple[str, int, int, int]:
    """(tensor name, row, col, bit offset) of logical code (n, k) of a weight of `shape`;
    with `BitPack.places` the offset is its slot's, the bits are places[offset:offset + bits]."""
    if spec.sort_k_by_group:
        raise ValueError("act-order Marlin stores K in a data-dependent order; unpack to locate")
    shape = weight_shape("shape", shape, (2,))
    row, col, shift = spec.weight.layout.locate(shape)(n, k)
    return spec.weight.name, int(row), int(col), int(shift)


def render(spec: QuantSpec, shape: tuple[int, int], max_rows: int = 8, max_cols: int = 4) -> str:
    """A table of the first physical words of the weight tensor and the (n, k) each slot holds."""
    shape = weight_shape("shape", shape, (2,))
    rows, cols, shifts = spec.weight.layout.locate(shape)(*np.meshgrid(np.arange(shape[0]), np.arange(shape[1]), indexing="ij"))
    bits = spec.code.bits
    lines = [f"{spec.weight.name}{spec.weight.layout.physical_shape(shape)} for logical codes (N, K) = {shape}; "
             f"each cell lists the (n,k) in its {bits}-bit slots, slot 0 (the low bits unless placed) first:"]
    for r in range(min(max_rows, spec.weight.layout.physical_shape(shape)[0])):
        cells = []
        for c in range(min(max_cols, spec.weight.layout.physical_shape(shape)[1])):
            n_idx, k_idx = np.nonzero((rows == r) & (cols == c))
            order = np.argsort(shifts[n_idx, k_idx])
            cells.append(" ".join(f"{n_idx[o]},{k_idx[o]}" for o in order))
        lines.append(f"[{r:3d}] " + " | ".join(cells))
    return "\n".join(lines)


def explain(spec: QuantSpec, shape: tuple[int, int] = (16, 64)) -> str:
    """The spec's formula followed by a rendering of a small tile."""
    return f"{spec!r}\n\n{render(spec, shape)}"
