"""Random logical data that a spec stores losslessly, from a numpy generator: what the
Hypothesis strategies (`strategies.quantized_for`) draw from, and what the demo and the
reference checkpoints use without Hypothesis installed."""

from __future__ import annotations

import numpy as np

from .encodings import E2M1, E4M3_VALUES, FloatFormat
from .quantized import Quantized
from .spec import QuantSpec


def _exact_scales(format: FloatFormat, rng: np.random.Generator, shape, signs: bool = False) -> np.ndarray:
    """Scales exactly representable in `format`, so pack/unpack is lossless: positive, or
    with `signs` one in four negative and one in eight zero (what NVFP4's e4m3 stores and
    float8_ue5m3 folds into the codes)."""
    if format.name in ("float8_e4m3", "float8_ue5m3"):  # e4m3 values: ue5m3 holds them all
        scales = E4M3_VALUES[rng.integers(0x08, 0x78, shape)]
    else:
        scales = format.decode(format.encode(rng.uniform(0.001, 2.0, shape).astype(np.float32)))
    if signs and format.signed:
        draw = rng.integers(0, 8, shape)
        scales = np.where(draw < 2, -scales, np.where(draw == 2, np.float32(0.0), scales)).astype(scales.dtype)
    return scales


def random_quantized(spec: QuantSpec, shape: tuple[int, ...], rng: np.random.Generator) -> Quantized:
    """Random logical data (codes, scales, zeros, g_idx, global scale) that `spec` stores
    losslessly: scales exactly representable in its scale format (e2m1 codes' scales
    negative or zero at times, where the format can hold it)."""
    k = shape[-1]
    groups = spec.groups(k)
    scale_shape = shape[:-1] + (groups,)
    codes = rng.integers(0, 1 << spec.code.bits, shape)
    zeros = None if spec.zeros is None else rng.integers(0, 1 << spec.code.bits, scale_shape)
    g_idx = None
    if spec.g_idx_name is not None:
        g_idx = rng.permutation(np.arange(k) // spec.group_size).astype(np.int32)
    global_scale = None
    if spec.global_scale_name is not None:
        experts = shape[0] if len(shape) == 3 else 1
        # Powers of two keep a stored reciprocal exact.
        global_scale = (2.0 ** rng.integers(-4, 12, experts)).astype(np.float32)
    scales = _exact_scales(spec.scale_format, rng, scale_shape, signs=isinstance(spec.code, E2M1))
    return Quantized(codes, scales, zeros, g_idx, global_scale)
