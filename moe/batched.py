"""The batched (expert-major) MoE: tokens already grouped by expert, as expert parallelism's
all-to-all dispatch delivers them (vLLM's batched experts, DeepEP's low-latency layout).

Input (E, T, H): local expert e's rows 0 .. counts[e] - 1 are its tokens, the remaining
rows padding. Output (E, T, H): each valid row through its expert's gated MLP, without
routing weights (the combine after the return all-to-all applies them); padding rows hold
unspecified (finite) values. The kernels are the routed path's: `batched_align` replaces routing
and sorting, then the runner's `run` does gemm1 -> activation -> gemm2 -> combine with
one slot per row (top_k = 1, weight 1), so the sequence is written once.

    workspace = BatchedWorkspace(config, tokens_per_expert=128, spec=weights.spec)
    out = batched_moe(x, counts, weights, config, workspace=workspace)
"""

from __future__ import annotations

import attrs
import torch

from numba_kernels import interop
from numba_kernels.batched_align import batched_align, batched_sizes, check_count_values

from .config import MoEConfig
from .oracle import select_batched_backend
from .replay import ProgramCache
from .runner import ROW_ALIGNMENT, Prepared, check_weights, run
from .weights import ExpertWeights, gemm_spec
from .workspace import (CallBuffers, arrivals_elements, check_layer_types, gemm_out_elements, gemm_view,
                        permuted_buffer, permuted_views, starts_within)


class BatchedWorkspace:
    """Every buffer of a batched call with up to `tokens_per_expert` rows per local expert.
    `expected_tokens_per_expert` (default: all of them) picks the tiles, once."""

    def __init__(self, config: MoEConfig, tokens_per_expert: int, spec, *, expected_tokens_per_expert: int | None = None):
        check_layer_types(config, spec)
        interop.check_count("tokens_per_expert", tokens_per_expert, 1)
        self.config, self.spec, self.tokens_per_expert = config, gemm_spec(spec), tokens_per_expert
        expected = tokens_per_expert if expected_tokens_per_expert is None else expected_tokens_per_expert
        interop.check_count("expected_tokens_per_expert", expected, 1)
        self.backend = select_batched_backend(config, expected, self.spec)
        experts = config.num_local_experts
        slots = experts * tokens_per_expert
        length, blocks = batched_sizes(experts, tokens_per_expert, self.backend.block_m)
        device, half = interop.kernel_device(), getattr(torch, config.dtype)

        def empty(shape, dtype):  # zeros: padding rows are never written, and stay finite
            return torch.zeros(shape, dtype=dtype, device=device)

        gemm1 = empty(gemm_out_elements(self.backend.gemm1, slots, config.gate_up_size), torch.float32)
        gemm2 = empty(gemm_out_elements(self.backend.gemm2, slots, config.hidden_size), torch.float32)
        self.buffers = CallBuffers(
            topk_weights=torch.ones((slots, 1), dtype=torch.float32, device=device),
            topk_ids=torch.arange(experts, dtype=torch.int32, device=device).repeat_interleave(tokens_per_expert)[:, None],
            sorted_token_ids=empty(length, torch.int32), expert_ids=empty(blocks, torch.int32),
            num_tokens_post_padded=empty(1, torch.int32),
            gemm1_out=gemm_view(gemm1, self.backend.gemm1, slots, config.gate_up_size, half),
            intermediate=empty((slots, config.intermediate_size), half),
            gemm2_out=gemm_view(gemm2, self.backend.gemm2, slots, config.hidden_size, half),
            output=empty((slots, config.hidden_size), half),
            arrivals=empty(arrivals_elements(config, self.backend, blocks, slots), torch.int32),
            **permuted_views(permuted_buffer(config, slots), config, slots),
        )
        self.programs = ProgramCache()  # recorded calls (see replay), one per weights

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` starts inside one of the workspace's buffers."""
        return starts_within(tensor, attrs.astuple(self.buffers, recurse=False))


def batched_moe(hidden_states, counts, weights: ExpertWeights, config: MoEConfig, *,
                workspace: BatchedWorkspace | None = None, check_counts: bool = True) -> torch.Tensor:
    """(E, T, H) expert-major tokens and (E,) int32 valid rows per expert -> (E, T, H)
    expert outputs (a view of the workspace's output; see the module docstring).
    `check_counts` validates the counts (a host sync; pass False in graphs)."""
    check_weights(config, weights)
    experts, half = config.num_local_experts, getattr(torch, config.dtype)
    hidden_states = interop.check_tensor("hidden_states", hidden_states, dtype=half, ndim=3, alignment=ROW_ALIGNMENT)
    if hidden_states.shape[0] != experts or hidden_states.shape[2] != config.hidden_size:
        raise ValueError(f"hidden_states must be (num_local_experts={experts}, T, {config.hidden_size}), "
                         f"got {tuple(hidden_states.shape)}")
    tokens_per_expert = hidden_states.shape[1]
    if workspace is None:
        workspace = BatchedWorkspace(config, tokens_per_expert, weights.spec)
    if not isinstance(workspace, BatchedWorkspace):
        raise TypeError(f"workspace must be a BatchedWorkspace, got {type(workspace).__name__}")
    if workspace.config != config or workspace.tokens_per_expert != tokens_per_expert:
        raise ValueError(f"the workspace was built for tokens_per_expert={workspace.tokens_per_expert} of "
                         f"another config; this call has {tokens_per_expert} rows per expert")
    counts = interop.check_tensor("counts", counts, dtype=torch.int32, shape=(experts,))
    if check_counts:
        check_count_values(counts, tokens_per_expert)
    buffers = workspace.buffers

    def sequence(tensors):
        rows, counts = tensors
        batched_align(counts, tokens_per_expert, workspace.backend.block_m, check_counts=False,
                      out=(buffers.sorted_token_ids, buffers.expert_ids, buffers.num_tokens_post_padded))
        return run(Prepared(config, workspace.backend, buffers, rows, buffers.topk_weights, buffers.topk_ids), weights)

    rows = hidden_states.view(experts * tokens_per_expert, config.hidden_size)
    output = workspace.programs.run(None, weights, sequence, (rows, counts), workspace.owns)
    return output.view(experts, tokens_per_expert, config.hidden_size)
