"""Token alignment agrees with vLLM's golden vectors (their canonical parts) and, byte for
byte, with the numpy reference (the kernel is deterministic: slot order inside each
expert, sentinels and -1 in the tails), in one block and spread over several; it never
writes past the required prefix of a longer workspace, and rejects bad input clearly."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from numba_kernels import align, interop
from numba_kernels.align import align_sizes, moe_align_block_size, reference_align

DATA = Path(__file__).parent / "data"
GOLDEN = sorted(path.stem for path in DATA.glob("c4_align_*.npz"))
POISON = -7


def _device(array) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, np.int32)).to(interop.kernel_device())


def _run(topk_ids, block_size, experts, expert_map=None, ignore_invalid=False, spare=0, check_ids=True):
    """Kernel outputs as numpy, through a poisoned workspace `spare` elements too long;
    the spare tails must come back untouched."""
    padded_len, block_count = align_sizes(np.size(topk_ids), experts, block_size)
    out = tuple(interop.empty((length + spare,), torch.int32).fill_(POISON)
                for length in (padded_len, block_count, 1))
    result = moe_align_block_size(_device(topk_ids), block_size, experts,
                                  expert_map=None if expert_map is None else _device(expert_map),
                                  ignore_invalid_experts=ignore_invalid, out=out, check_ids=check_ids)
    for full, view in zip(out, result):
        assert view.data_ptr() == full.data_ptr()
        assert bool((full[view.shape[0]:] == POISON).all())
    return tuple(view.cpu().numpy() for view in result)


def _check(topk_ids, block_size, experts, expert_map=None, ignore_invalid=False, spare=0, check_ids=True):
    got = _run(topk_ids, block_size, experts, expert_map, ignore_invalid, spare, check_ids)
    expected = reference_align(topk_ids, block_size, experts, expert_map, ignore_invalid)
    for name, g, e in zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), got, expected):
        np.testing.assert_array_equal(g, e, err_msg=name)
    return got


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_vectors(name):
    data = np.load(DATA / f"{name}.npz")
    params = json.loads(str(data["meta"]))["params"]
    block_size, experts, sentinel = params["block_size"], params["num_experts"], params["sentinel"]
    expert_map = data["in_expert_map"] if "in_expert_map" in data.files else None
    ignore_invalid = "ignore_invalid" in name
    sorted_ids, expert_ids, num_post = _check(data["in_topk_ids"], block_size, experts, expert_map,
                                              ignore_invalid, spare=5)
    # The canonical parts (CASES.md section 4).
    total = int(data["out_num_tokens_post_padded"][0])
    np.testing.assert_array_equal(num_post, data["out_num_tokens_post_padded"])
    assert sorted_ids.shape == data["out_sorted_token_ids"].shape
    assert expert_ids.shape == data["out_expert_ids"].shape
    blocks = total // block_size
    assert blocks == params["num_valid_blocks"]
    np.testing.assert_array_equal(expert_ids[:blocks], data["out_expert_ids"][:blocks])
    for block in range(blocks):
        rows = slice(block * block_size, (block + 1) * block_size)
        assert set(sorted_ids[rows]) == set(data["out_sorted_token_ids"][rows])
    assert np.all(sorted_ids[total:] == sentinel) and np.all(expert_ids[blocks:] == -1)


@st.composite
def align_cases(draw):
    experts = draw(st.integers(1, 24))
    top_k = draw(st.sampled_from(sorted({1, experts, min(2, experts), min(8, experts)})))
    tokens = draw(st.integers(1, 21))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):  # distinct experts per token, as a router picks them
        topk_ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    else:  # few popular experts: the others receive no tokens
        topk_ids = rng.integers(0, max(1, experts // 3), (tokens, top_k))
    expert_map = None
    if draw(st.booleans()):
        local = rng.random(experts) < 0.5
        expert_map = np.where(local, np.cumsum(local) - 1, -1)
    return dict(topk_ids=topk_ids.astype(np.int32), block_size=draw(st.sampled_from([16, 32, 64])),
                experts=experts, expert_map=expert_map, ignore_invalid=draw(st.booleans()),
                spare=draw(st.integers(0, 3)), slots_per_block=draw(st.sampled_from([align.SLOTS_PER_BLOCK, 24])))


@given(align_cases())
def test_align_matches_reference(case):
    slots_per_block = case.pop("slots_per_block")
    with pytest.MonkeyPatch.context() as patch:  # 24 slots per block: several blocks in the simulator
        patch.setattr(align, "SLOTS_PER_BLOCK", slots_per_block)
        _check(**case)


def test_invalid_ids_are_dropped_without_check():
    topk_ids = np.array([[0, 5], [-1, 2], [9, 2], [5, 100]], np.int32)
    sorted_ids, expert_ids, num_post = _check(topk_ids, 16, 6, check_ids=False)
    assert set(sorted_ids[:num_post[0]]) == {0, 1, 3, 5, 6, 8}  # slots 2, 4, 7 dropped; 8 = sentinel
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 6\), got values from -1 to 100"):
        moe_align_block_size(_device(topk_ids), 16, 6)


def test_align_sizes_follow_vllm():
    assert align_sizes(148, 16, 16) == (388, 25)  # numel + E * (bs - 1)
    assert align_sizes(148, 16, 64) == (1156, 19)
    assert align_sizes(8, 256, 16) == (128, 8)  # numel < E: numel * bs
    assert align_sizes(0, 8, 16) == (0, 0)


def test_empty_batch():
    sorted_ids, expert_ids, num_post = moe_align_block_size(interop.empty((0, 8), torch.int32), 16, 8)
    assert sorted_ids.shape == expert_ids.shape == (0,) and num_post.tolist() == [0]


def test_errors():
    device = interop.kernel_device()
    topk_ids = torch.zeros((4, 2), dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="topk_ids must be a torch.int32 tensor"):
        moe_align_block_size(topk_ids.long(), 16, 8)
    with pytest.raises(ValueError, match="topk_ids must have 2 dimensions"):
        moe_align_block_size(topk_ids[0], 16, 8)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        moe_align_block_size(topk_ids, 0, 8)
    with pytest.raises(ValueError, match=r"num_experts must be an integer in \[1, 1024\]"):
        moe_align_block_size(topk_ids, 16, 2048)
    with pytest.raises(ValueError, match=r"expert_map must have shape \(8,\)"):
        moe_align_block_size(topk_ids, 16, 8, expert_map=torch.zeros(4, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=r"expert_map must lie in \[-1, 8\)"):
        moe_align_block_size(topk_ids, 16, 8, expert_map=torch.full((8,), -2, dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="out must be a"):
        moe_align_block_size(topk_ids, 16, 8, out=topk_ids)
    short = tuple(torch.zeros(n, dtype=torch.int32, device=device) for n in (64, 3, 1))
    with pytest.raises(ValueError, match=r"out\[0\] \(sorted_token_ids\) must hold at least 128 elements, got 64"):
        moe_align_block_size(topk_ids, 16, 8, out=short)


@pytest.mark.gpu
@pytest.mark.parametrize("experts", [128, 256])
@pytest.mark.parametrize("tokens, block_size", [(1, 16), (8, 16), (4096, 16), (4096, 64), (8192, 64)])
def test_realistic_shapes_on_gpu(experts, tokens, block_size):
    generator = torch.Generator().manual_seed(tokens + experts)
    topk_ids = torch.argsort(torch.rand((tokens, experts), generator=generator), dim=1)[:, :8].int().numpy()
    _check(topk_ids, block_size, experts, spare=7)
    expert_map = np.where(np.arange(experts) % 4 == 1, np.arange(experts) // 4, -1)
    for ignore_invalid in (False, True):
        _check(topk_ids, block_size, experts, expert_map, ignore_invalid)
