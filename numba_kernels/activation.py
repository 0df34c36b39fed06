"""The activation between the MoE GEMMs: y = act(gate) * up, read straight from gemm1's output.

gemm1 writes the 2I gate/up projections of each token slot either finished, (T, 2I) in
bfloat16/float16/float32, or, when it splits K across thread blocks, as float32 partial
sums (S, T, 2I). One launch sums the splits in a fixed order (s = 0, 1, ..., S-1: the
result does not depend on scheduling), applies the activation in float32 and rounds once
to the output dtype. Where gate and up sit among the 2I inputs of a row:

    halves       [gate | up]: gate = x[:I], up = x[I:]   vLLM silu_and_mul, gelu_and_mul, ...
    interleaved  gate = x[0::2], up = x[1::2]            gpt-oss swigluoai
    not gated    y = act(x): I inputs, I outputs

Work split: a thread owns a *chunk* of one row, the outputs whose gate (and up) inputs
fill 32 bytes (8 outputs for float32 input, 16 for halves; 8 on the element-wise path);
a block covers up to 256 chunks of a row; blockIdx.x walks along the row and blockIdx.y
over the rows (grid-striding past 65535 rows). Memory traffic is the minimum, each input
read once and each output written once (S*T*2I*in_bytes + T*I*out_bytes), with no shared
memory: the kernel is bandwidth-bound. When rows split into whole chunks and the input
is 16-byte aligned (every real model: I % 16 == 0), each chunk is read with 16-byte
loads (`ptx.load_written`) and half outputs are stored as packed pairs; otherwise (odd widths,
misaligned views) element by element with bounds checks.

The chunked row I/O (`numba_kernels.rows`) is shared with `numba_kernels.combine`.
"""

from __future__ import annotations

import functools
import math

import attrs
import numpy as np
import torch
from numba import cuda, float32, uint32

from layouts.checks import one_of, real_number

from .ptx import device, divide_approx, exp_approx, kernel, release_next, wait_for_previous
from .rows import (DTYPE_NAMES, ONE, ZERO, as_float64, check_partials, chunk_reader, chunk_size, chunk_writer,
                   grid_position, launch_rows, output_tensor, source_array, target_array, vectorizable)

NAMES = ("silu", "gelu", "gelu_tanh", "relu", "swigluoai")


def _positive_finite(instance, attribute, value):
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a positive finite number, got {value!r}")


@attrs.frozen
class Activation:
    """Which activation, and whether it is gated (2I inputs -> I outputs, y = act(gate) * up).

    name: silu (with the hardware's approximate exp and division, `ptx.exp_approx`: a few
    float32 ulp), gelu (exact, erf), gelu_tanh, relu, or swigluoai (gpt-oss: gated only,
    gate and up interleaved, gate <= limit, |up| <= limit, y = (up + 1) * gate * sigmoid(alpha * gate)).
    alpha and limit belong to swigluoai and must stay at their defaults for the others.
    """

    name: str = attrs.field(validator=one_of(NAMES))
    gated: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    alpha: float = attrs.field(default=1.702, converter=real_number("alpha"), validator=_positive_finite)
    limit: float = attrs.field(default=7.0, converter=real_number("limit"), validator=_positive_finite)

    def __attrs_post_init__(self):
        if self.name == "swigluoai" and not self.gated:
            raise ValueError("swigluoai is gated only (gated=True)")
        if self.name != "swigluoai" and (self.alpha, self.limit) != (1.702, 7.0):
            raise ValueError(f"alpha and limit apply to swigluoai only, not {self.name}")

    @property
    def interleaved(self) -> bool:
        """Gate and up alternate along the row (gpt-oss) instead of forming two halves."""
        return self.name == "swigluoai"

    def output_width(self, input_width: int) -> int:
        return input_width // 2 if self.gated else input_width


# ---------------------------------------------------------------------------------------
# The activation kernel.
# ---------------------------------------------------------------------------------------

HALF = np.float32(0.5)
SQRT1_2 = np.float32(math.sqrt(0.5))
SQRT_2_OVER_PI = np.float32(math.sqrt(2.0 / math.pi))
GELU_CUBIC = np.float32(0.044715)


@device
def _silu(x):
    # The special-function unit's exp and division (`ptx.exp_approx`): a prefill gemm1
    # finishing silu in its epilogue (`gemm.paired_activation`), two CTAs of four warps per
    # multiprocessor, could not hide libdevice's expf and IEEE division (Qwen3 M = 4096 on
    # the H200: 727 against 660 us with relu); the separate kernel is memory-bound either way.
    return divide_approx(x, ONE + exp_approx(-x))


@device
def _gelu(x):
    return HALF * x * (ONE + math.erf(x * SQRT1_2))


@device
def _gelu_tanh(x):
    return HALF * x * (ONE + math.tanh(SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x)))


@device
def _relu(x):
    return max(x, ZERO)


_UNARY = {"silu": _silu, "gelu": _gelu, "gelu_tanh": _gelu_tanh, "relu": _relu}


def _pointwise(activation: Activation):
    """Device function (gate, up) -> float32 output (up is ignored when not gated)."""
    if activation.name == "swigluoai":
        alpha, limit = np.float32(activation.alpha), np.float32(activation.limit)

        @device
        def swigluoai(gate, up):
            gate = min(gate, limit)
            up = min(max(up, -limit), limit)
            return (up + ONE) * gate / (ONE + math.exp(-alpha * gate))

        return swigluoai
    act = _UNARY[activation.name]
    if activation.gated:
        @device
        def gated(gate, up):
            return act(gate) * up

        return gated

    @device
    def plain(gate, up):
        return act(gate)

    return plain


@functools.cache
def make_activation_kernel(activation: Activation, source: str, target: str, vectorized: bool, splits: int):
    """Kernel (gate_up, out, width): gate_up (splits, T, W) from `source_array`, out (T, width)
    from `target_array`; `source`/`target` are dtype names. splits is compile-time, so
    the loop over them unrolls and a thread's loads are all in flight together."""
    apply = _pointwise(activation)
    chunk = chunk_size(source, vectorized)
    read, write = chunk_reader(source, vectorized), chunk_writer(target, vectorized, chunk)
    gated, interleaved = activation.gated, activation.interleaved
    # Output v of a chunk takes gate x[gate_step * v] and up x[up_at + gate_step * v] of the
    # chunk's 2 * chunk inputs x: the interleaved pairs, or the gate chunk then the up chunk.
    gate_step, up_at = (2, 1) if interleaved else (1, chunk)
    inputs = 2 * chunk  # a constant for cuda.local.array

    @kernel
    def activation_kernel(gate_up, out, width):
        col, row, rows, row_step = grid_position(chunk, gate_up.shape[1])
        wait_for_previous()  # launched early (rows.launch_rows): the partials are final from here
        # The layer's gemm2 may launch now: its CTAs read their routing and first weights
        # while this short kernel runs, and wait for it before reading its output. Not
        # before the wait: with gemm1 still running, three kernels in flight, gemm2 read
        # stale activations in CUDA-graph replays of the batched layout (H200, sixtieth
        # session: every row wrong; right with this kernel or gemm2 launched late).
        release_next()
        x = cuda.local.array(inputs, float32)
        y = cuda.local.array(chunk, float32)
        if col >= uint32(width):
            return
        while row < rows:
            for v in range(inputs):
                x[v] = ZERO
            for s in range(splits):
                if interleaved:
                    read(gate_up, s, row, 2 * col, 2 * width, x, 0)
                    read(gate_up, s, row, 2 * col + chunk, 2 * width, x, chunk)
                else:
                    read(gate_up, s, row, col, width, x, 0)
                    if gated:
                        read(gate_up, s, row, width + col, 2 * width, x, chunk)
            for v in range(chunk):
                y[v] = apply(x[gate_step * v], x[up_at + gate_step * v])
            write(out, row, col, width, y)
            row = uint32(row + row_step)

    return activation_kernel


def activate(gate_up, activation: Activation, *, out=None, out_dtype=None) -> torch.Tensor:
    """out[t] = activation(sum over s of gate_up[s, t]) in one launch on torch's stream.

    gate_up: (T, W) float32/bfloat16/float16, or float32 split-K partials (S, T, W),
        summed in the order s = 0..S-1. W = 2I for a gated activation, I otherwise.
    out: preallocated (T, I) bfloat16/float16/float32 (then nothing is allocated).
    out_dtype: the dtype of a new `out`; defaults to gate_up's dtype for half inputs and
        is required for float32 input.
    """
    if not isinstance(activation, Activation):
        raise TypeError(f"activation must be an Activation, got {type(activation).__name__}")
    partials = check_partials("gate_up", gate_up, "T, W")
    _, rows, input_width = partials.shape
    if activation.gated and input_width % 2:
        raise ValueError(f"gate_up's last dimension must be even for gated {activation.name} "
                         f"(gate and up), got {input_width}")
    width = activation.output_width(input_width)
    out = output_tensor(out, out_dtype, (rows, width), partials.dtype)
    if rows and width:
        vectorized = vectorizable(width, partials, out)
        source = DTYPE_NAMES[partials.dtype]
        activation_kernel = make_activation_kernel(activation, source, DTYPE_NAMES[out.dtype], vectorized,
                                                   partials.shape[0])
        launch_rows(activation_kernel, rows, width, chunk_size(source, vectorized), source_array(partials, vectorized),
               target_array(out, vectorized), width)
    return out


def _unary_reference(name: str, x: np.ndarray) -> np.ndarray:
    if name == "silu":
        return x / (1.0 + np.exp(-x))
    if name == "gelu":
        return 0.5 * x * (1.0 + torch.special.erf(torch.from_numpy(x * math.sqrt(0.5))).numpy())
    if name == "gelu_tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    return np.maximum(x, 0.0)


def reference_activate(gate_up, activation: Activation) -> np.ndarray:
    """float64 (T, I) result of `activate` (splits summed in float64)."""
    x = as_float64(gate_up)
    if x.ndim == 3:
        x = x.sum(axis=0)
    if not activation.gated:
        return _unary_reference(activation.name, x)
    if activation.interleaved:
        gate = np.minimum(x[..., 0::2], activation.limit)
        up = np.clip(x[..., 1::2], -activation.limit, activation.limit)
        return (up + 1.0) * gate / (1.0 + np.exp(-activation.alpha * gate))
    half = x.shape[-1] // 2
    return _unary_reference(activation.name, x[..., :half]) * x[..., half:]
