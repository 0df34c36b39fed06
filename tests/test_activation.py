"""`activate` agrees with the float64 `reference_activate` for every activation, gate/up
layout, split count and dtype pair, on both the 16-byte and the element-wise path; it
reproduces vLLM's gpt-oss swigluoai (golden vector); it sums splits in order; bad inputs
raise errors that name the argument."""

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from numba_kernels import interop
from poison import check_written_and_close, poisoned
from numba_kernels.activation import Activation, activate, reference_activate
from numba_kernels.rows import vectorizable

DATA = Path(__file__).parent / "data"

ACTIVATIONS = [Activation(name, gated) for name in ("silu", "gelu", "gelu_tanh", "relu") for gated in (True, False)]
ACTIVATIONS.append(Activation("swigluoai"))
FLOATS = [torch.bfloat16, torch.float16, torch.float32]
TOLERANCES = {torch.float32: (1e-5, 1e-4), torch.float16: (1e-3, 1e-4), torch.bfloat16: (1e-2, 1e-3)}
"""(rtol, atol) per output dtype: one rounding of a float32 result (inputs are ~N(0, 9))."""


def _gate_up(source, splits: int, rows: int, width: int, seed: int, offset: int = 0) -> torch.Tensor:
    """Random gate/up input: float32 partials (S, T, W) for source "partials", else (T, W)
    of that dtype; `offset` elements into a larger buffer (a misaligned view)."""
    device = interop.kernel_device()
    generator = torch.Generator(device).manual_seed(seed)
    shape = (splits, rows, width) if source == "partials" else (rows, width)
    dtype = torch.float32 if source == "partials" else source
    values = (3 * torch.randn(int(np.prod(shape)) + offset, generator=generator, device=device)).to(dtype)
    return values[offset:].view(shape)


def _check(got: torch.Tensor, expected: np.ndarray) -> None:
    check_written_and_close(got, expected, TOLERANCES)


def _run(activation, gate_up, out_dtype, out_offset: int = 0):
    rows, width = gate_up.shape[-2], activation.output_width(gate_up.shape[-1])
    out = poisoned((rows, width), out_dtype, out_offset)
    assert activate(gate_up, activation, out=out) is out
    _check(out, reference_activate(gate_up, activation))
    return out


@st.composite
def cases(draw):
    activation = draw(st.sampled_from(ACTIVATIONS))
    source = draw(st.sampled_from(["partials"] + FLOATS))
    splits = draw(st.integers(1, 3)) if source == "partials" else 1
    rows = draw(st.integers(1, 4))
    width = draw(st.one_of(st.integers(1, 20), st.sampled_from([8, 16, 32])))  # whole chunks: 16-byte path
    input_width = 2 * width if activation.gated else width
    return activation, _gate_up(source, splits, rows, input_width, draw(st.integers(0, 2**31))), draw(
        st.sampled_from(FLOATS))


@given(cases())
def test_activate_matches_reference(case):
    activation, gate_up, out_dtype = case
    _run(activation, gate_up, out_dtype)


@pytest.mark.parametrize("width", [16, 13], ids=["16-byte", "elementwise"])
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=repr)
def test_every_activation_on_both_paths(activation, width):
    input_width = 2 * width if activation.gated else width
    gate_up = _gate_up("partials", 2, 2, input_width, seed=width)
    out = _run(activation, gate_up, torch.bfloat16)
    assert vectorizable(width, gate_up, out) == (width == 16)


@pytest.mark.parametrize("width", [16, 5], ids=["16-byte", "elementwise"])
@pytest.mark.parametrize("out_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("source", ["partials"] + FLOATS, ids=str)
def test_every_dtype_pair_for_one_token(source, out_dtype, width):
    gate_up = _gate_up(source, 3, 1, 2 * width, seed=5)
    out = _run(Activation("silu"), gate_up, out_dtype)
    assert vectorizable(width, gate_up, out) == (width == 16)


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_misaligned_views_take_the_elementwise_path(source):
    gate_up = _gate_up(source, 1, 3, 32, seed=2, offset=1)
    out = _run(Activation("swigluoai"), gate_up, torch.bfloat16, out_offset=1)
    assert not vectorizable(16, gate_up, out)


def test_swigluoai_matches_vllm_golden_vector():
    golden = np.load(DATA / "c6_swigluoai_M16_D128.npz")
    gate_up = torch.from_numpy(golden["in_x"]).to(interop.kernel_device())
    swigluoai = Activation("swigluoai", alpha=1.702, limit=7.0)
    np.testing.assert_allclose(reference_activate(gate_up, swigluoai), golden["out_y"], rtol=1e-6, atol=1e-6)
    for out_dtype in (torch.float32, torch.bfloat16):
        out = poisoned(golden["out_y"].shape, out_dtype)
        activate(gate_up, swigluoai, out=out)
        rtol, atol = TOLERANCES[out_dtype]
        np.testing.assert_allclose(out.to("cpu", torch.float64).numpy(), golden["out_y"], rtol=rtol, atol=atol)


def test_splits_are_summed_in_order():
    # float32: (3 + 1e8) - 1e8 = 0; splits reversed or exact give 3. relu passes the sum through.
    partials = torch.tensor([3.0, 1e8, -1e8]).repeat_interleave(8).view(3, 1, 8).to(interop.kernel_device())
    out = activate(partials, Activation("relu", gated=False), out_dtype=torch.float32)
    assert (out == 0).all()


def test_default_output_dtype_is_the_half_input_dtype_and_empty_batches_work():
    gate_up = _gate_up(torch.float16, 1, 2, 6, seed=1)
    assert activate(gate_up, Activation("gelu")).dtype == torch.float16
    empty = activate(torch.zeros(0, 6, device=interop.kernel_device()), Activation("silu"), out_dtype=torch.bfloat16)
    assert empty.shape == (0, 3) and empty.dtype == torch.bfloat16


def _errors():
    device = interop.kernel_device()
    x = torch.zeros(4, 16, device=device)
    silu = Activation("silu")
    return [
        (lambda: activate(x.to(torch.int32), silu, out_dtype=torch.float32), TypeError, "gate_up must be a"),
        (lambda: activate(x.view(1, 1, 4, 16), silu, out_dtype=torch.float32), ValueError, r"gate_up must be \(T, W\)"),
        (lambda: activate(x.to(torch.bfloat16).view(2, 2, 16), silu), TypeError, "partials .* must be float32"),
        (lambda: activate(torch.zeros(0, 4, 16, device=device), silu, out_dtype=torch.float32), ValueError,
         "no splits"),
        (lambda: activate(x.t(), silu, out_dtype=torch.float32), ValueError, "gate_up must be contiguous"),
        (lambda: activate(x[:, :15].contiguous(), silu, out_dtype=torch.float32), ValueError, "must be even"),
        (lambda: activate(x, "silu", out_dtype=torch.float32), TypeError, "must be an Activation"),
        (lambda: activate(x, silu), ValueError, "out_dtype is required"),
        (lambda: activate(x, silu, out_dtype=torch.int8), TypeError, "out_dtype must be"),
        (lambda: activate(x, silu, out=torch.zeros(4, 16, device=device)), ValueError, r"out must have shape \(4, 8\)"),
        (lambda: activate(x, silu, out=torch.zeros(4, 8, dtype=torch.int32, device=device)), TypeError,
         "out must be a"),
        (lambda: activate(x, silu, out=torch.zeros(4, 8, device=device), out_dtype=torch.bfloat16), ValueError,
         "disagrees"),
        (lambda: activate(x, silu, out=torch.zeros(8, 4, device=device).t()), ValueError, "out must be contiguous"),
        (lambda: activate(np.zeros((4, 16), np.float32)[:, ::2], silu, out_dtype=torch.float32),
         (TypeError, ValueError), "gate_up"),
    ]


@pytest.mark.parametrize("index", range(len(_errors())))
def test_bad_inputs_raise_errors_naming_the_argument(index):
    call, error, match = _errors()[index]
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="swish"), "name"),
    (dict(name="swigluoai", gated=False), "gated only"),
    (dict(name="silu", alpha=1.0), "swigluoai only"),
    (dict(name="swigluoai", limit=-1.0), "limit must be a positive"),
    (dict(name="swigluoai", alpha=float("nan")), "alpha must be a positive"),
    (dict(name="relu", gated=1), "gated"),
])
def test_activation_config_is_validated(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        Activation(**kwargs)


# ---------------------------------------------------------------------------------------
# Real GPU, realistic shapes: Qwen3-30B-A3B (I 768, top-8), Mixtral (I 14336, top-2),
# gpt-oss-20b (I 2880, top-4, swigluoai); T = M * top_k slots up to 32768.
# ---------------------------------------------------------------------------------------

def _sampled_rows(rows: int) -> np.ndarray:
    """The first, last and some random rows: the reference runs on those only."""
    picked = np.random.default_rng(rows).choice(rows, size=min(rows, 64), replace=False)
    return np.unique(np.concatenate([picked, [0, rows - 1]]))


@pytest.mark.gpu
@pytest.mark.parametrize("activation, width, rows, splits, source, out_dtype", [
    (Activation("silu"), 768, 8, 4, "partials", torch.bfloat16),
    (Activation("silu"), 768, 32768, 1, torch.bfloat16, torch.bfloat16),
    (Activation("silu"), 14336, 2, 4, "partials", torch.float16),
    (Activation("silu"), 14336, 8192, 1, "partials", torch.bfloat16),
    (Activation("silu"), 14336, 32768, 1, torch.bfloat16, torch.bfloat16),
    (Activation("gelu"), 14336, 1, 1, torch.float16, torch.float32),
    (Activation("swigluoai"), 2880, 16384, 1, "partials", torch.bfloat16),
    (Activation("gelu_tanh", gated=False), 2051, 333, 2, "partials", torch.float16),
])
def test_realistic_shapes_on_the_gpu(activation, width, rows, splits, source, out_dtype):
    gate_up = _gate_up(source, splits, rows, 2 * width if activation.gated else width, seed=width)
    out = poisoned((rows, width), out_dtype)
    activate(gate_up, activation, out=out)
    assert torch.isfinite(out).all()
    picked = torch.from_numpy(_sampled_rows(rows)).to(gate_up.device)
    _check(out[picked], reference_activate(gate_up.index_select(-2, picked), activation))
    again = poisoned((rows, width), out_dtype)
    activate(gate_up, activation, out=again)
    assert torch.equal(out, again), "not deterministic"
