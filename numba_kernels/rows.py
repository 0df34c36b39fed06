"""Chunked row I/O shared by the activation and combine kernels.

Both read rows of float32 split-K partials (S, rows, W) or finished half/float32 rows
(S = 1) and write one finished row each. A thread owns a *chunk* of contiguous elements:
CHUNK_BYTES of input with 16-byte loads (`ptx.load_written`) when rows split into whole chunks
and the input is 16-byte aligned (every real model), else 8 elements with bounds checks.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import cuda, float32, int16, int32, uint32

from . import interop
from .launch import launch_kernel
from .ptx import bits_f32, device, half_to_f32, load_u32x4, pack2, to_half

# ---------------------------------------------------------------------------------------

CHUNK_BYTES = 32
"""Input bytes a thread reads per operand and split: two 16-byte loads, so 8 float32 or 16
half elements. Measured on the H200: 16-byte half chunks ran Mixtral's activation (8192
slots) at 3.1 TB/s, 32-byte ones at 3.5; 64-byte float32 chunks gained 2% there but cost
40% at decode (too few threads), where gemm1/gemm2 write float32 split-K partials."""

BLOCK = 256
MIN_BLOCK = 64
SPREAD_BLOCKS = 264
"""Blocks a small launch aims for (two per SM of an H100 / H200) before blocks shrink."""
MAX_GRID_Y = 65535

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
FLOAT_DTYPES = tuple(DTYPE_NAMES)

ZERO, ONE = np.float32(0.0), np.float32(1.0)


def chunk_size(dtype: str, vectorized: bool) -> int:
    """Elements a thread owns when reading `dtype` (a dtype name): CHUNK_BYTES of them with
    16-byte loads; 8 element by element (16 predicated half loads took 168 registers)."""
    return CHUNK_BYTES // (4 if dtype == "float32" else 2) if vectorized else 8


@device
def _as_f32(x):
    return float32(x)


@functools.cache
def chunk_reader(dtype: str, vectorized: bool):
    """Device function read(src, s, row, col, end, buf, at): buf[at + v] += src[s, row, col + v]
    as float32 for v < chunk_size(dtype, vectorized) and col + v < end. `src` holds `dtype` elements
    (half floats as int16 bits) or, vectorized, 32-bit words; then col is a multiple of the
    chunk, rows start 16-byte aligned, and the chunk is whole (end is not checked)."""
    chunk = chunk_size(dtype, vectorized)
    decode = _as_f32 if dtype == "float32" else half_to_f32(dtype)
    if not vectorized:
        @device
        def read_elements(src, s, row, col, end, buf, at):
            for v in range(chunk):
                if col + v < end:
                    buf[at + v] += decode(src[s, row, col + v])

        return read_elements

    if dtype == "float32":
        @device
        def read_f32_words(src, s, row, col, end, buf, at):
            for q in range(0, chunk, 4):
                w0, w1, w2, w3 = load_u32x4(src, s, row, col + q)
                buf[at + q] += bits_f32(w0)
                buf[at + q + 1] += bits_f32(w1)
                buf[at + q + 2] += bits_f32(w2)
                buf[at + q + 3] += bits_f32(w3)

        return read_f32_words

    @device
    def add_pair(buf, i, word):
        buf[i] += decode(word)
        buf[i + 1] += decode(uint32(word) >> uint32(16))

    @device
    def read_half_words(src, s, row, col, end, buf, at):
        for q in range(0, chunk, 8):
            w0, w1, w2, w3 = load_u32x4(src, s, row, (col + q) // 2)
            add_pair(buf, at + q, w0)
            add_pair(buf, at + q + 2, w1)
            add_pair(buf, at + q + 4, w2)
            add_pair(buf, at + q + 6, w3)

    return read_half_words


@functools.cache
def chunk_writer(dtype: str, vectorized: bool, chunk: int):
    """Device function write(dst, row, col, end, y): dst[row, col + v] = y[v] rounded to
    `dtype`, for v < chunk and col + v < end. Vectorized half outputs are int32 words
    holding pairs (the chunk whole, end not checked)."""
    if dtype == "float32":
        @device
        def write_f32(dst, row, col, end, y):
            for v in range(chunk):
                if vectorized or col + v < end:
                    dst[row, col + v] = y[v]

        return write_f32

    if vectorized:
        pack = pack2(dtype)

        @device
        def write_half_pairs(dst, row, col, end, y):
            for p in range(chunk // 2):
                dst[row, col // 2 + p] = int32(pack(y[2 * p], y[2 * p + 1]))

        return write_half_pairs

    encode = to_half(dtype)

    @device
    def write_halves(dst, row, col, end, y):
        for v in range(chunk):
            if col + v < end:
                dst[row, col + v] = int16(encode(y[v]))

    return write_halves


def check_partials(name: str, value, axes: str) -> torch.Tensor:
    """`value` as (S, rows, width): float32 split-K partials as given, a finished 2-D
    tensor as S = 1 (a view). `axes` names the 2-D shape in errors, e.g. "T, W"."""
    tensor = interop.check_tensor(name, value, dtype=FLOAT_DTYPES)
    if tensor.dim() == 2:
        return tensor.unsqueeze(0)
    if tensor.dim() != 3:
        raise ValueError(f"{name} must be ({axes}) or float32 split-K partials (S, {axes}), "
                         f"got shape {tuple(tensor.shape)}")
    if tensor.dtype != torch.float32:
        raise TypeError(f"{name}: split-K partials (S, {axes}) must be float32, got {tensor.dtype}")
    if tensor.shape[0] == 0:
        raise ValueError(f"{name} has no splits: shape {tuple(tensor.shape)}")
    return tensor


def output_tensor(out, out_dtype, shape: tuple, source_dtype: torch.dtype) -> torch.Tensor:
    """The checked `out`, or a new tensor of `out_dtype`. Without either, half inputs give
    their own dtype; float32 input (partials included) has no safe default (the model may
    be bfloat16 or float16), so out_dtype is then required."""
    if out is not None:
        out = interop.check_tensor("out", out, dtype=FLOAT_DTYPES, shape=shape)
        if out_dtype is not None and out_dtype != out.dtype:
            raise ValueError(f"out_dtype {out_dtype} disagrees with out ({out.dtype}): pass one of them")
        return out
    if out_dtype is None:
        if source_dtype == torch.float32:
            raise ValueError("out_dtype is required for float32 input (the model's dtype, e.g. torch.bfloat16), "
                             "or pass out=")
        out_dtype = source_dtype
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")
    return interop.empty(shape, out_dtype)


def vectorizable(width: int, source: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether the 16-byte path applies: rows of `width` outputs split into whole chunks
    (so every chunk, gate/up offset and row starts on a 16-byte boundary of an aligned
    input) and the output takes 32-bit stores."""
    return (width % chunk_size(DTYPE_NAMES[source.dtype], True) == 0 and source.data_ptr() % 16 == 0
            and target.data_ptr() % 4 == 0)


def source_array(partials: torch.Tensor, vectorized: bool):
    """(S, rows, W) as the kernel reads it: 32-bit words for 16-byte loads, else elements."""
    return interop.to_kernel(partials.view(torch.int32) if vectorized else partials)


def target_array(out: torch.Tensor, vectorized: bool):
    """(rows, width) as the kernel writes it: vectorized half outputs as int32 pairs."""
    pairs = vectorized and out.dtype != torch.float32
    return interop.to_kernel(out.view(torch.int32) if pairs else out)


@device
def grid_position(chunk, rows):
    """(col, first row, rows, row step) of this thread in the grid of `launch_rows`, all
    unsigned 32-bit: a row kernel reads them before its wait and walks its rows with a
    `while` loop (as Numba's signed 64-bit ints, a grid-stride `range` divided for its
    trip count, a call to a 64-bit divide)."""
    col = uint32((uint32(cuda.blockIdx.x) * uint32(cuda.blockDim.x) + uint32(cuda.threadIdx.x)) * chunk)
    return col, uint32(cuda.blockIdx.y), uint32(rows), uint32(cuda.gridDim.y)


def launch_rows(row_kernel, rows: int, width: int, chunk: int, *args) -> None:
    """Launch a chunked row kernel over rows x width outputs on torch's stream. Few rows
    (decode) get blocks of down to MIN_BLOCK threads, so even one row spreads over several
    SMs instead of queueing its loads on one. A row kernel calls `ptx.wait_for_previous`
    before it reads its input, so a replay may launch it early (`launch`)."""
    chunks = -(-width // chunk)
    per_block = -(-chunks * rows // SPREAD_BLOCKS)
    block = min(BLOCK, -(-chunks // 32) * 32, max(MIN_BLOCK, -(-per_block // 32) * 32))
    grid = (-(-chunks // block), min(rows, MAX_GRID_Y))
    launch_kernel(row_kernel, grid, block, *args, waits=True)


def as_float64(value) -> np.ndarray:
    """float64 numpy copy of a tensor (any dtype or device) or array, for references."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", torch.float64).numpy()
    return np.asarray(value, np.float64)
