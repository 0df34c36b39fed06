"""The batched (expert-major) layout: its alignment equals the numpy twin for any counts,
and `batched_moe` runs each valid row through its expert's MLP, as the float reference
(act-order weights too, their inputs permuted per row)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from moe import BatchedWorkspace, MoEConfig, QuantScheme, batched_moe, process_weights_after_loading
from moe.reference import random_checkpoint
from numba_kernels import interop
from numba_kernels.activation import reference_activate
from numba_kernels.batched_align import batched_align, reference_batched_align

DEVICE = interop.kernel_device()


@settings(max_examples=15, deadline=None)
@given(experts=st.integers(1, 5), tokens_per_expert=st.integers(1, 40), block_size=st.sampled_from([1, 16, 64]),
       data=st.data())
def test_batched_alignment_matches_its_numpy_twin(experts, tokens_per_expert, block_size, data):
    counts = np.array(data.draw(st.lists(st.integers(0, tokens_per_expert), min_size=experts, max_size=experts)),
                      np.int32)
    got = batched_align(torch.from_numpy(counts).to(DEVICE), tokens_per_expert, block_size)
    for got_part, expected in zip(got, reference_batched_align(counts, tokens_per_expert, block_size)):
        np.testing.assert_array_equal(got_part.cpu().numpy(), expected)


def test_batched_alignment_rejects_counts_beyond_the_rows():
    with pytest.raises(ValueError, match="counts must lie in"):
        batched_align(torch.tensor([3, 9], dtype=torch.int32, device=DEVICE), 8, 16)
    with pytest.raises(TypeError, match="counts must be a torch.int32"):
        batched_align(torch.tensor([3, 4], dtype=torch.int64, device=DEVICE), 8, 16)


@pytest.mark.parametrize("tokens_per_expert, expected, calls, act_order",
                         [(5, None, 2, False), (40, 40, 1, False), (5, None, 2, True)])
def test_batched_moe_runs_each_valid_row_through_its_expert(tokens_per_expert, expected, calls, act_order):
    config = MoEConfig(num_experts=3, top_k=2, hidden_size=64, intermediate_size=64,
                       quant=QuantScheme("gptq", group_size=32, act_order=act_order))
    checkpoint = random_checkpoint(config, np.random.default_rng(0))
    weights = process_weights_after_loading(config, checkpoint.w1, checkpoint.w2, checkpoint.w3)
    rng = np.random.default_rng(1)
    workspace = BatchedWorkspace(config, tokens_per_expert, weights.spec, expected_tokens_per_expert=expected)
    for call in range(calls):  # the first call records its launches, a second replays them on new inputs
        hidden = torch.from_numpy(rng.standard_normal((3, tokens_per_expert, 64))).to(torch.bfloat16)
        counts = np.array([tokens_per_expert, 0, min(3, tokens_per_expert)], np.int32)[::1 - 2 * call].copy()
        out = batched_moe(hidden.to(DEVICE), torch.from_numpy(counts).to(DEVICE), weights, config,
                          workspace=workspace).float().cpu().numpy()
        x = hidden.double().numpy()
        for expert, count in enumerate(counts):
            rows = x[expert, :count]
            intermediate = reference_activate(rows @ checkpoint.dense_w13[expert].T, config.activation)
            expected_rows = intermediate @ checkpoint.dense_w2[expert].T
            if count:
                error = np.linalg.norm(out[expert, :count] - expected_rows) / np.linalg.norm(expected_rows)
                assert error < 2e-2
    assert len(workspace.programs) == 1
    with pytest.raises(ValueError, match="tokens_per_expert"):
        batched_moe(hidden[:, :1].contiguous().to(DEVICE), torch.from_numpy(counts).to(DEVICE), weights, config,
                    workspace=workspace)
