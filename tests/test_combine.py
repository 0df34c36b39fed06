"""`combine` agrees with the float64 `reference_combine` for any split count, top-k,
hidden size and dtype pair, on both the 16-byte and the element-wise path; it sums in the
documented order (splits, then slots), bit for bit; bad inputs raise errors that name the
argument."""

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from numba_kernels import interop
from poison import check_written_and_close, poisoned
from numba_kernels.rows import vectorizable
from numba_kernels.combine import combine, reference_combine

FLOATS = [torch.bfloat16, torch.float16, torch.float32]
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-4), torch.bfloat16: (1e-2, 1e-3)}
"""(rtol, atol) per output dtype: one rounding of a float32 sum (inputs ~N(0, 1))."""


def _expert_out(source, splits: int, slots: int, width: int, seed: int, offset: int = 0) -> torch.Tensor:
    """Random gemm2 output: float32 partials (S, M*k, H) for source "partials", else
    (M*k, H) of that dtype; `offset` elements into a larger buffer (a misaligned view)."""
    device = interop.kernel_device()
    generator = torch.Generator(device).manual_seed(seed)
    shape = (splits, slots, width) if source == "partials" else (slots, width)
    dtype = torch.float32 if source == "partials" else source
    values = torch.randn(int(np.prod(shape)) + offset, generator=generator, device=device).to(dtype)
    return values[offset:].view(shape)


def _topk_weights(tokens: int, top_k: int, seed: int) -> torch.Tensor:
    device = interop.kernel_device()
    logits = torch.randn(tokens, top_k, generator=torch.Generator(device).manual_seed(seed), device=device)
    return torch.softmax(logits, dim=-1)


def _check(got: torch.Tensor, expected: np.ndarray) -> None:
    check_written_and_close(got, expected, TOLERANCES)


def _run(expert_out, weights, out_dtype, weights_applied=False, out_offset: int = 0):
    out = poisoned((weights.shape[0], expert_out.shape[-1]), out_dtype, out_offset)
    assert combine(expert_out, weights, out=out, weights_applied=weights_applied) is out
    _check(out, reference_combine(expert_out, weights, weights_applied=weights_applied))
    return out


@st.composite
def cases(draw):
    source = draw(st.sampled_from(["partials"] + FLOATS))
    splits = draw(st.integers(1, 3)) if source == "partials" else 1
    tokens, top_k = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    width = draw(st.one_of(st.integers(1, 20), st.sampled_from([8, 16, 32])))  # whole chunks: 16-byte path
    seed = draw(st.integers(0, 2**31))
    return (_expert_out(source, splits, tokens * top_k, width, seed), _topk_weights(tokens, top_k, seed),
            draw(st.sampled_from(FLOATS)), draw(st.booleans()))


@given(cases())
def test_combine_matches_reference(case):
    expert_out, weights, out_dtype, weights_applied = case
    _run(expert_out, weights, out_dtype, weights_applied)


@pytest.mark.parametrize("width", [16, 13], ids=["16-byte", "elementwise"])
@pytest.mark.parametrize("out_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("source", ["partials"] + FLOATS, ids=str)
def test_every_dtype_pair_on_both_paths(source, out_dtype, width):
    expert_out = _expert_out(source, 2, 3 * 2, width, seed=width)
    out = _run(expert_out, _topk_weights(3, 2, seed=1), out_dtype)
    assert vectorizable(width, expert_out, out) == (width == 16)


@pytest.mark.parametrize("splits", [1, 4])
def test_one_token_top1_decode(splits):
    _run(_expert_out("partials", splits, 1, 24, seed=splits), _topk_weights(1, 1, seed=3), torch.bfloat16)


@pytest.mark.parametrize("source", [torch.float32, torch.float16])
def test_misaligned_views_take_the_elementwise_path(source):
    expert_out = _expert_out(source, 1, 4, 16, seed=2, offset=1)
    out = _run(expert_out, _topk_weights(2, 2, seed=2), torch.float16, out_offset=1)
    assert not vectorizable(16, expert_out, out)


def test_sums_splits_then_slots_in_order_bit_for_bit():
    # In float32, slot 0 sums to (1e8 - 1e8) + 7 = 7 and slot 1 to (3 + 1e8) - 1e8 = 0: total 7.
    # The exact sum is 10; one flat loop over (s, j) or (j, s) gives 8, splits reversed 11.
    device = interop.kernel_device()
    values = torch.tensor([[1e8, 3.0], [-1e8, 1e8], [7.0, -1e8]]).view(3, 2, 1)  # (S, slots of one token, H)
    partials = values.expand(3, 2, 16).contiguous().to(device)
    out = combine(partials, torch.ones(1, 2, device=device), out_dtype=torch.float32, weights_applied=True)
    assert (out == 7).all()


def test_default_output_dtype_is_the_half_input_dtype_and_empty_batches_work():
    assert combine(_expert_out(torch.bfloat16, 1, 4, 8, seed=0), _topk_weights(2, 2, seed=0)).dtype == torch.bfloat16
    device = interop.kernel_device()
    empty = combine(torch.zeros(0, 8, device=device), torch.zeros(0, 2, device=device), out_dtype=torch.float16)
    assert empty.shape == (0, 8) and empty.dtype == torch.float16


def _errors():
    device = interop.kernel_device()
    x, w = torch.zeros(4, 8, device=device), torch.ones(2, 2, device=device)
    return [
        (lambda: combine(x.to(torch.int32), w, out_dtype=torch.float32), TypeError, "expert_out must be a"),
        (lambda: combine(x.view(4, 8, 1, 1), w, out_dtype=torch.float32), ValueError,
         r"expert_out must be \(M\*k, H\)"),
        (lambda: combine(x.to(torch.float16).view(1, 4, 8), w), TypeError, "partials .* must be float32"),
        (lambda: combine(x.t(), w, out_dtype=torch.float32), ValueError, "expert_out must be contiguous"),
        (lambda: combine(x, w.double(), out_dtype=torch.float32), TypeError, "topk_weights must be a"),
        (lambda: combine(x, w.view(4), out_dtype=torch.float32), ValueError, "topk_weights must have 2 dimensions"),
        (lambda: combine(x, w.t(), out_dtype=torch.float32), ValueError, "topk_weights must be contiguous"),
        (lambda: combine(x, torch.ones(3, 2, device=device), out_dtype=torch.float32), ValueError, "4 token slots"),
        (lambda: combine(x, w), ValueError, "out_dtype is required"),
        (lambda: combine(x, w, out=torch.zeros(4, 8, device=device)), ValueError, r"out must have shape \(2, 8\)"),
        (lambda: combine(x, w, out=torch.zeros(2, 8, dtype=torch.float64, device=device)), TypeError, "out must be a"),
        (lambda: combine(x, w, out=torch.zeros(2, 8, device=device), out_dtype=torch.float16), ValueError,
         "disagrees"),
        (lambda: combine(x, [[1.0, 1.0]], out_dtype=torch.float32), TypeError, "topk_weights must be a torch tensor"),
    ]


@pytest.mark.parametrize("index", range(len(_errors())))
def test_bad_inputs_raise_errors_naming_the_argument(index):
    call, error, match = _errors()[index]
    with pytest.raises(error, match=match):
        call()


# ---------------------------------------------------------------------------------------
# Real GPU, realistic shapes: Qwen3-30B-A3B (H 2048, top-8), Mixtral (H 4096, top-2),
# M tokens up to 4096; split-K partials at decode.
# ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("tokens, top_k, width, splits, source, out_dtype, weights_applied", [
    (1, 8, 2048, 4, "partials", torch.bfloat16, False),
    (64, 8, 2048, 2, "partials", torch.bfloat16, True),
    (4096, 8, 2048, 1, torch.bfloat16, torch.bfloat16, False),
    (4096, 8, 2048, 4, "partials", torch.float32, False),
    (1, 2, 4096, 8, "partials", torch.float16, False),
    (4096, 2, 4096, 1, torch.float16, torch.float16, False),
    (4096, 2, 4096, 1, "partials", torch.bfloat16, True),
    (77, 3, 2051, 3, "partials", torch.bfloat16, False),
])
def test_realistic_shapes_on_the_gpu(tokens, top_k, width, splits, source, out_dtype, weights_applied):
    expert_out = _expert_out(source, splits, tokens * top_k, width, seed=tokens)
    weights = _topk_weights(tokens, top_k, seed=top_k)
    out = _run(expert_out, weights, out_dtype, weights_applied)
    again = poisoned(out.shape, out_dtype)
    combine(expert_out, weights, out=again, weights_applied=weights_applied)
    assert torch.equal(out, again), "not deterministic"
