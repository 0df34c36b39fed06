"""Hypothesis strategies for layouts: random *specs* (compositions of transforms), not just
random data, so users can property-test their own layout code the way we test ours.

    from hypothesis import given
    from layouts.strategies import spec_and_weight

    @given(spec_and_weight())
    def test_roundtrip(case):
        spec, q = case
        assert spec.unpack(spec.pack(q), q.codes.shape).equals(q)

Shapes stay small (N, K <= 128 by default) so thousands of examples run in seconds.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from .encodings import E2M1, FloatFormat, IntCode
from .samples import random_quantized
from .spec import QuantSpec, Tensor
from .transforms import (BitPack, InterleaveHalves, Layout, Pad, PadHalves, Panels, Permute, SwapHalves, Swizzle128x4,
                         Tile, Transpose)


def _divisors(size: int, candidates=(2, 4, 8, 16, 32)) -> list[int]:
    return [d for d in candidates if size % d == 0]


@st.composite
def transform(draw, shape: tuple[int, int]):
    """One shape-preserving-or-reshaping transform valid for a grid of `shape`."""
    rows, cols = shape
    options = [st.just(Transpose()), st.builds(Pad, st.sampled_from([1, 2, 8]), st.sampled_from([1, 4, 16]))]
    for axis, size in ((-2, rows), (-1, cols)):
        lengths = _divisors(size)
        if lengths:
            options.append(st.sampled_from(lengths).flatmap(
                lambda n, axis=axis: st.permutations(range(n)).map(lambda p, axis=axis: Permute(tuple(p), axis))))
        if size % 2 == 0:
            options += [st.just(InterleaveHalves(axis)), st.just(SwapHalves(axis)),
                        st.builds(PadHalves, st.sampled_from([1, 4, 8]), st.just(axis))]
    if _divisors(rows) and _divisors(cols):
        options.append(st.builds(Tile, st.sampled_from(_divisors(rows)), st.sampled_from(_divisors(cols))))
    if _divisors(cols):
        options.append(st.builds(Panels, st.sampled_from(_divisors(cols))))
    if rows <= 256 and cols <= 64:
        options.append(st.just(Swizzle128x4()))
    return draw(st.one_of(options))


@st.composite
def layout(draw, shape: tuple[int, int], bits: int | None = None, dtype: str | None = None, max_steps: int = 3):
    """A random Layout for a logical grid of `shape`, ending in a BitPack of `bits` if given."""
    steps = []
    for _ in range(draw(st.integers(0, max_steps))):
        step = draw(transform(shape))
        shape = step.out_shape(shape)
        steps.append(step)
    if bits is not None:
        word_bits = draw(st.sampled_from([8, 32]) if bits <= 8 else st.just(32))
        per_word = word_bits // bits
        order = draw(st.none() | st.permutations(range(per_word)).map(tuple))
        places = draw(st.none() | st.permutations(range(word_bits)).map(tuple))
        steps.append(BitPack(bits, axis=draw(st.sampled_from([-1, -2])), word_bits=word_bits, order=order,
                             places=places))
    return Layout(tuple(steps), dtype)


@st.composite
def weight_shape(draw, max_experts: int = 2, max_size: int = 128):
    """(N, K) or (E, N, K) with small sizes, odd ones included."""
    n = draw(st.integers(1, max_size // 8)) * draw(st.sampled_from([1, 2, 8]))
    k = draw(st.integers(1, max_size // 8)) * draw(st.sampled_from([1, 2, 8]))
    experts = draw(st.integers(0, max_experts))
    return (n, k) if experts == 0 else (experts, n, k)


@st.composite
def spec_for(draw, shape: tuple[int, ...]):
    """A random QuantSpec able to store a weight of `shape`."""
    n, k = shape[-2:]
    fp4 = draw(st.sampled_from([False, False, False, True]))  # one spec in four is NVFP4-like
    if fp4:
        code, group_size = E2M1(), 16
        scale_format = FloatFormat(draw(st.sampled_from(["float8_e4m3", "float8_ue5m3"])))
    else:
        bits = draw(st.sampled_from([2, 3, 4, 8]))
        code = IntCode(bits, draw(st.none() | st.just(1 << (bits - 1))))
        group_size = draw(st.sampled_from([None, 16, 32, 64, 128]) | st.integers(1, k + 3))
        scale_format = FloatFormat(draw(st.sampled_from(["float16", "bfloat16", "float32", "float8_e4m3"])))
    groups = 1 if group_size is None else -(-k // group_size)
    zeros = None if code.symmetric else Tensor("zeros", draw(layout((n, groups), bits=code.bits)))
    act_order = group_size is not None and not fp4 and draw(st.booleans())
    return QuantSpec(
        name="random", code=code,
        weight=Tensor("weight", draw(layout((n, k), bits=code.bits))),
        scales=Tensor("scales", draw(layout((n, groups)))),
        scale_format=scale_format, group_size=group_size, zeros=zeros,
        zero_offset=draw(st.sampled_from([0, -1])) if zeros is not None else 0,
        g_idx_name="g_idx" if act_order else None,
        sort_k_by_group=act_order and draw(st.booleans()),
        global_scale_name="global_scale" if fp4 else None,
        global_scale_reciprocal=fp4 and draw(st.booleans()),
    )


@st.composite
def quantized_for(draw, spec: QuantSpec, shape: tuple[int, ...]):
    """Random logical data for `spec` (see `random_quantized`)."""
    return random_quantized(spec, shape, np.random.default_rng(draw(st.integers(0, 2**32 - 1))))


@st.composite
def spec_and_weight(draw, max_experts: int = 2, max_size: int = 128):
    """(spec, Quantized): a random spec and random data it can store."""
    shape = draw(weight_shape(max_experts, max_size))
    spec = draw(spec_for(shape))
    return spec, draw(quantized_for(spec, shape))
