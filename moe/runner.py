"""The one kernel sequence of an MoE layer, shared by `fused_moe` and `MoELayer`.

    check_inputs: validate the call's tensors against the config, weights and workspace;
    prepare:      pick the backend (oracle), take the workspace's views for this token
                  count, route (top-k of the router logits, unless given) and align the
                  token slots to expert blocks (one launch for a few tokens);
    run:          gemm1 -> hooks -> activation -> gemm2 -> hooks -> combine (weighted
                  sum over each token's experts), each GEMM's input permuted into its
                  experts' K order first for act-order weights (`permute_slots`); a
                  tile with `fused_reduction` makes its GEMM finish the reduction after
                  it, one kernel fewer: a decode tile in its last CTAs
                  (`numba_kernels.epilogue`), a prefill gemm1 tile in its epilogue
                  (`gemm.paired_activation`); unless a post_gemm hook must see the
                  GEMM's output first. A warp-specialised backend (Hopper, from tens of
                  slots an expert: `oracle.specialized_backend`) runs instead: the hidden
                  states gathered into stage blocks, gemm1, the activation into gemm2's
                  stage blocks, gemm2, combine (`specialized_gemm1`, `specialized_gemm2`);
                  calls with hooks take the tiles.

`forward` is what both entry points call: it checks the inputs, then either replays the
launches recorded by an earlier call of the same kind (`replay`: the eager fast path) or
runs prepare + run, recording them. Every buffer comes from the persistent `Workspace`,
every kernel launches on torch's current stream, and nothing synchronises the host (but
the first recording's check in a process, see `replay`), so after a warm-up call a
forward allocates no device memory and can be captured in a CUDA graph. Inputs are
validated once, before any kernel runs.
"""

from __future__ import annotations

import attrs
import torch

from numba_kernels import interop
from numba_kernels.activation import activate
from numba_kernels.align import moe_align_block_size
from numba_kernels.combine import combine
from numba_kernels.epilogue import FusedActivation, FusedCombine
from numba_kernels.gemm import grouped_gemm
from numba_kernels.gemm_specialized import specialized_gemm
from numba_kernels.permute import permute_slots
from numba_kernels.route_align import route_and_align
from numba_kernels.routing import LOGIT_DTYPES, route
from numba_kernels.stage_blocks import activate_blocks, gather_blocks

from .config import MoEConfig, check_config
from .hooks import GemmStep, MoEHooks
from .oracle import Backend, fused_activation_kind, fused_combine_kind, fused_routing, select_backend
from .weights import ExpertWeights
from .workspace import CallBuffers, Workspace

_NO_HOOKS = MoEHooks()
ROW_ALIGNMENT = 16
"""Bytes the hidden states must start aligned to: prefill tiles copy their rows in 16-byte
vectors (`gemm.grouped_gemm`), and a recorded forward may replay on any later input."""


@attrs.frozen(eq=False)
class Inputs:
    """A call's validated tensors: hidden states and either router logits (with an
    optional correction bias) or a given (topk_weights, topk_ids) pair."""

    hidden_states: torch.Tensor
    router_logits: torch.Tensor | None = None
    correction_bias: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None

    @property
    def tensors(self) -> tuple:
        return (self.hidden_states, self.router_logits, self.correction_bias, self.topk_weights, self.topk_ids)

    def kind(self) -> tuple:
        """What a recorded forward depends on besides the weights and the tensors' memory:
        calls of one kind launch the same kernels on the same buffers."""
        dtypes = tuple(None if t is None else t.dtype for t in (self.router_logits, self.correction_bias))
        return self.hidden_states.shape[0], dtypes


def check_weights(config: MoEConfig, weights: ExpertWeights) -> None:
    """Raise unless `weights` were built for `config` and every local expert is loaded."""
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights must be ExpertWeights (MoELayer.weights, or process_weights_after_loading's "
                        f"result), got {type(weights).__name__}")
    check_config(config)
    if weights.config is not config and weights.config != config:  # `is` first: eq compares every field
        raise ValueError("weights were built for another MoEConfig than the one given")
    weights.check_loaded()


def check_inputs(config: MoEConfig, weights: ExpertWeights, workspace: Workspace, hidden_states, router_logits=None, *,
                 topk=None, correction_bias=None, check_ids: bool = True) -> Inputs:
    """Validate a call (see `fused_moe`) before any kernel runs; `check_ids` checks given
    topk_ids' values (a host sync)."""
    check_weights(config, weights)
    if not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must be a Workspace, got {type(workspace).__name__}")
    if workspace.config is not config and workspace.config != config:
        raise ValueError("the workspace was built for another MoEConfig than the one given")
    half = getattr(torch, config.dtype)
    hidden_states = interop.check_tensor("hidden_states", hidden_states, dtype=half, ndim=2, alignment=ROW_ALIGNMENT)
    tokens = hidden_states.shape[0]
    if hidden_states.shape[1] != config.hidden_size:
        raise ValueError(f"hidden_states must be (M, {config.hidden_size}), got {tuple(hidden_states.shape)}")
    if tokens == 0:
        raise ValueError("hidden_states holds no tokens")
    workspace.check_tokens(tokens)
    if (router_logits is None) == (topk is None):
        raise ValueError("pass exactly one of router_logits and topk=(topk_weights, topk_ids)")
    if router_logits is not None:
        router_logits = interop.check_tensor("router_logits", router_logits, dtype=LOGIT_DTYPES,
                                             shape=(tokens, config.num_experts))
        if correction_bias is not None:
            correction_bias = interop.check_tensor("correction_bias", correction_bias, dtype=LOGIT_DTYPES,
                                                   shape=(config.num_experts,))
        return Inputs(hidden_states, router_logits, correction_bias)
    if correction_bias is not None:
        raise ValueError("correction_bias applies to routing: pass it with router_logits, not with topk")
    if not (isinstance(topk, (tuple, list)) and len(topk) == 2):
        raise TypeError("topk must be a (topk_weights, topk_ids) pair")
    shape = (tokens, config.top_k)
    topk_weights = interop.check_tensor("topk_weights", topk[0], dtype=torch.float32, shape=shape)
    topk_ids = interop.check_tensor("topk_ids", topk[1], dtype=torch.int32, shape=shape)
    if check_ids:  # a host sync
        interop.check_range("topk_ids", topk_ids, 0, config.num_experts)
    return Inputs(hidden_states, topk_weights=topk_weights, topk_ids=topk_ids)


@attrs.frozen(eq=False)
class Prepared:
    """A call after `prepare`: routing and alignment launched, buffers chosen."""

    config: MoEConfig
    backend: Backend
    buffers: CallBuffers
    hidden_states: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor


def prepare(config: MoEConfig, weights: ExpertWeights, workspace: Workspace, inputs: Inputs, *,
            hooked: bool = False) -> Prepared:
    """Pick the backend, route and align (see the module docstring). `hooked`: hooks will
    see the GEMMs' inputs and outputs slot by slot, so not the warp-specialised GEMM."""
    tokens = inputs.hidden_states.shape[0]
    backend = select_backend(config, tokens, weights.spec, specialized=not hooked)
    buffers = workspace.buffers(tokens, backend)
    topk = (buffers.topk_weights, buffers.topk_ids)
    alignment = (buffers.sorted_token_ids, buffers.expert_ids, buffers.num_tokens_post_padded)
    if inputs.router_logits is not None and fused_routing(config, tokens):
        route_and_align(inputs.router_logits, config.routing, backend.block_m, correction_bias=inputs.correction_bias,
                        expert_map=workspace.expert_map, out_topk=topk, out_alignment=alignment, check_map=False)
    else:
        if inputs.router_logits is None:
            topk = (inputs.topk_weights, inputs.topk_ids)
        else:
            route(inputs.router_logits, config.routing, correction_bias=inputs.correction_bias, out=topk)
        moe_align_block_size(topk[1], backend.block_m, config.num_experts, expert_map=workspace.expert_map,
                             ignore_invalid_experts=False, check_ids=False, out=alignment)
    return Prepared(config, backend, buffers, inputs.hidden_states, *topk)


def fused_activation(config: MoEConfig, tile, out: torch.Tensor, arrivals: torch.Tensor) -> FusedActivation | None:
    """gemm1's `then=` with `tile`: the activation into `out` where the oracle fuses it."""
    return FusedActivation(config.activation, out, arrivals) if fused_activation_kind(config, tile) else None


def fused_combine(config: MoEConfig, tile, topk_weights: torch.Tensor, out: torch.Tensor,
                  arrivals: torch.Tensor) -> FusedCombine | None:
    """gemm2's `then=` with `tile`: the combine into `out` where the oracle fuses it."""
    return FusedCombine(topk_weights, out, arrivals) if fused_combine_kind(config, tile) else None


def gemm_input(act: torch.Tensor, weights: ExpertWeights, stored, out: torch.Tensor | None, alignment: tuple,
               slots: int, block_m: int) -> torch.Tensor:
    """What a GEMM of `stored` (w13 or w2) reads: `act`, or its rows permuted per slot into
    the experts' K order (`weights.permutes_inputs`) in `out`."""
    if not weights.permutes_inputs:
        return act
    return permute_slots(act, stored.k_order, *alignment, num_slots=slots, block_m=block_m, out=out, check_ids=False)


def specialized_gemm1(config: MoEConfig, weights: ExpertWeights, hidden_states: torch.Tensor, alignment: tuple,
                      num_slots: int, tile, picks: torch.Tensor, stage_blocks: torch.Tensor,
                      gemm1_out: torch.Tensor) -> None:
    """gemm1 of a warp-specialised backend (`tile`), then the activation: the hidden
    states gathered into stage blocks, gemm1 into its blocked output, its activation into
    gemm2's stage blocks (`numba_kernels.stage_blocks`; buffers as `CallBuffers` has them)."""
    gather_blocks(hidden_states, alignment, num_slots, config.top_k, tile, picks, stage_blocks)
    specialized_gemm(stage_blocks, weights.w13, picks, alignment[1], alignment[0], gemm1_out, tile, blocked=True,
                     check_ids=False)
    activate_blocks(gemm1_out, config.activation, tile, picks, stage_blocks)


def specialized_gemm2(weights: ExpertWeights, alignment: tuple, tile, picks: torch.Tensor, stage_blocks: torch.Tensor,
                      gemm2_out: torch.Tensor) -> None:
    """gemm2 of a warp-specialised backend: a row a slot (and the padding's spare row).
    With an expert map no CTA writes the rows of the slots routed to another rank's
    experts (their blocks have no parts): they are zeroed first, for the combine."""
    if weights.config.expert_map is not None:
        gemm2_out.zero_()
    specialized_gemm(stage_blocks, weights.w2, picks, alignment[1], alignment[0], gemm2_out, tile, blocked=False,
                     check_ids=False)


def run(prepared: Prepared, weights: ExpertWeights, hooks: MoEHooks | None = None) -> torch.Tensor:
    """gemm1 -> activation -> gemm2 -> combine into the workspace's output (M, H)."""
    config, backend, buffers = prepared.config, prepared.backend, prepared.buffers
    slots = prepared.topk_ids.numel()
    alignment = (buffers.sorted_token_ids, buffers.expert_ids, buffers.num_tokens_post_padded)
    tile = backend.specialized
    if tile is not None:  # never with hooks (`prepare`)
        specialized_gemm1(config, weights, prepared.hidden_states, alignment, slots, tile, buffers.picks,
                          buffers.stage_blocks, buffers.gemm1_out)
        specialized_gemm2(weights, alignment, tile, buffers.picks, buffers.stage_blocks, buffers.gemm2_out)
        combine(buffers.gemm2_out[:-1], prepared.topk_weights, out=buffers.output)
        return buffers.output
    hooks = _NO_HOOKS if hooks is None else hooks

    then1 = then2 = None
    if type(hooks).post_gemm is MoEHooks.post_gemm:  # a post_gemm hook changes outputs before their reduction
        then1 = fused_activation(config, backend.gemm1, buffers.intermediate, buffers.arrivals)
        then2 = fused_combine(config, backend.gemm2, prepared.topk_weights, buffers.output, buffers.arrivals)

    step = GemmStep("gemm1", prepared.hidden_states, buffers.gemm1_out, prepared.topk_ids, config.top_k)
    hooks.pre_gemm(step)
    act = gemm_input(prepared.hidden_states, weights, weights.w13, buffers.gemm1_in, alignment, slots, backend.block_m)
    grouped_gemm(act, weights.w13, *alignment, num_slots=slots, tile=backend.gemm1, out=buffers.gemm1_out, then=then1,
                 check_ids=False)
    hooks.post_gemm(step)
    if then1 is None:
        activate(buffers.gemm1_out, config.activation, out=buffers.intermediate)

    step = GemmStep("gemm2", buffers.intermediate, buffers.gemm2_out, prepared.topk_ids, 1)
    hooks.pre_gemm(step)
    act = gemm_input(buffers.intermediate, weights, weights.w2, buffers.gemm2_in, alignment, slots, backend.block_m)
    grouped_gemm(act, weights.w2, *alignment, num_slots=slots, tile=backend.gemm2, out=buffers.gemm2_out, then=then2,
                 alignment_ready=True, check_ids=False)  # aligned before gemm1
    hooks.post_gemm(step)
    if then2 is None:
        combine(buffers.gemm2_out, prepared.topk_weights, out=buffers.output)
    return buffers.output


def forward(config: MoEConfig, weights: ExpertWeights, workspace: Workspace, hidden_states, router_logits=None, *,
            topk=None, correction_bias=None, check_ids: bool = True, hooks: MoEHooks | None = None) -> torch.Tensor:
    """The forward of both entry points: check, then replay or prepare + run (and record)."""
    inputs = check_inputs(config, weights, workspace, hidden_states, router_logits, topk=topk,
                          correction_bias=correction_bias, check_ids=check_ids)
    if hooks is not None:  # hooks run arbitrary Python between the kernels: never replayed
        if not isinstance(hooks, MoEHooks):
            raise TypeError(f"hooks (fused_moe's lora) must be MoEHooks, e.g. LoRAHooks(config, adapters, max_tokens), "
                            f"got {type(hooks).__name__}")
        hooks.check(config)
        return run(prepare(config, weights, workspace, inputs, hooked=True), weights, hooks)

    def sequence(tensors):
        return run(prepare(config, weights, workspace, Inputs(*tensors)), weights)

    return workspace.programs.run(inputs.kind(), weights, sequence, inputs.tensors, workspace.owns)


def fused_moe(hidden_states, router_logits, weights: ExpertWeights, config: MoEConfig, *,
              workspace: Workspace | None = None, lora: MoEHooks | None = None, topk=None,
              correction_bias=None, check_ids: bool = True) -> torch.Tensor:
    """The MoE layer as a function: (M, H) hidden states and (M, E) router logits (or
    `topk=(topk_weights, topk_ids)` instead of logits) -> (M, H) output.

    The output is a view of the workspace's output buffer, valid until its next call (as
    with a CUDA graph's static outputs; copy it to keep it). Without a workspace one is
    made for this call (allocating); pass a persistent one in any loop: its first call of
    each token count records the launches, and later calls replay them with little Python
    (`replay`). `lora` takes `LoRAHooks` (or any `MoEHooks`). `check_ids` validates given
    topk_ids (a host sync).
    """
    if workspace is None:
        check_weights(config, weights)  # before weights.spec is read
        workspace = Workspace(config, interop.as_tensor(hidden_states, "hidden_states").shape[0], weights.spec)
    return forward(config, weights, workspace, hidden_states, router_logits, topk=topk,
                   correction_bias=correction_bias, check_ids=check_ids, hooks=lora)
