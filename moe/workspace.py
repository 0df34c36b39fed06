"""The persistent workspace: every scratch buffer of a forward pass, allocated once.

Buffers are sized for a maximum token count from the worst launch of every kernel over
all the backends the oracle may pick up to that count (a K split multiplies the GEMM
outputs; a smaller alignment block pads more), never from the current input, so a
forward pass allocates nothing and can be captured in a CUDA graph and replayed. One
workspace can serve every layer of a model with the same shapes. A call with more tokens
than planned raises `WorkspaceTooSmall`; `grow` enlarges it explicitly.
"""

from __future__ import annotations

import attrs
import torch

from layouts import QuantSpec
from numba_kernels import interop
from numba_kernels.align import align_sizes
from numba_kernels.epilogue import arrivals_needed
from numba_kernels.gemm import GemmTile
from numba_kernels.gemm_specialized import SpecializedTile

from .config import MoEConfig, check_config
from .oracle import (Backend, fused_activation_kind, fused_combine_kind, select_backend, specialized_slots,
                     token_buckets, writes_partials)
from .replay import ProgramCache
from .weights import gemm_spec, permutes_inputs


class WorkspaceTooSmall(ValueError):
    """A call needs more tokens than the workspace was sized for."""


@attrs.frozen(eq=False)
class CallBuffers:
    """Views of the workspace for one call of `num_tokens` tokens."""

    topk_weights: torch.Tensor  # (M, top_k) float32
    topk_ids: torch.Tensor  # (M, top_k) int32
    sorted_token_ids: torch.Tensor  # int32
    expert_ids: torch.Tensor  # int32
    num_tokens_post_padded: torch.Tensor  # (1,) int32
    gemm1_out: torch.Tensor  # (slots, 2I) half, or (split, slots, 2I) float32
    intermediate: torch.Tensor  # (slots, I) half
    gemm2_out: torch.Tensor  # (slots, H) half, or (split, slots, H) float32
    output: torch.Tensor  # (M, H) half
    arrivals: torch.Tensor  # int32 zeros: the fused reductions' counters (numba_kernels.epilogue)
    gemm1_in: torch.Tensor | None = None  # (slots, H) half: act-order inputs permuted (numba_kernels.permute)
    gemm2_in: torch.Tensor | None = None  # (slots, I) half, on the same memory (used after gemm1_in)
    # A warp-specialised backend's (`Backend.specialized`; gemm1_out is then (blocks x
    # block_m, 2I) half, a row a slot of each block, gemm2_out (slots + 1, H) half, the
    # last row the padding's): its blocks' parts' width indices, and the stage blocks of gemm1's
    # input, then of gemm2's (numba_kernels.stage_blocks), int32.
    picks: torch.Tensor | None = None
    stage_blocks: torch.Tensor | None = None


def starts_within(tensor: torch.Tensor, buffers) -> bool:
    """Whether `tensor`'s first element lies inside one of `buffers` (None: no buffer)."""
    address = tensor.data_ptr()
    return any(0 <= address - b.data_ptr() < b.numel() * b.element_size() for b in buffers if b is not None)


def gemm_out_elements(tile: GemmTile, slots: int, width: int) -> int:
    """float32 elements of a GEMM output: partials per split, or half values (2 per float)."""
    return tile.split_k * slots * width if writes_partials(tile) else -(-slots * width // 2)


def gemm_view(buffer: torch.Tensor, tile: GemmTile, slots: int, width: int, half: torch.dtype) -> torch.Tensor:
    """A GEMM output inside a float32 buffer: (split, slots, width) float32 partials
    (`oracle.writes_partials`), or (slots, width) half values."""
    if writes_partials(tile):
        return buffer[:tile.split_k * slots * width].view(tile.split_k, slots, width)
    return half_rows(buffer, slots, width, half)


def specialized_sizes(config: MoEConfig, tile: SpecializedTile, slots: int) -> tuple[int, int, int, int]:
    """(gemm1 rows, gemm2 rows, stage-block words, parts) of a warp-specialised call of
    `slots` slots with `tile` (`CallBuffers`): gemm1's output a row a slot of each block,
    gemm2's a row a slot and one for the padding, the stage blocks of every part over the
    wider of the two K."""
    blocks = align_sizes(slots, config.num_experts, tile.block_m)[1]
    parts = blocks * tile.sub_blocks
    return (blocks * tile.block_m, slots + 1,
            tile.stage_words(parts, max(config.hidden_size, config.intermediate_size)), parts)


def specialized_elements(config: MoEConfig, backend: Backend, max_tokens: int) -> tuple[int, int, int, int]:
    """float32 elements of gemm1's and gemm2's outputs, int32 words of the stage blocks
    and the parts' count (`picks`), for a warp-specialised backend of up to `max_tokens`
    tokens (`specialized_sizes` at `oracle.specialized_slots`); zeros for another."""
    tile = backend.specialized
    if tile is None:
        return 0, 0, 0, 0
    rows1, rows2, words, parts = specialized_sizes(config, tile, specialized_slots(config, max_tokens, tile))
    return -(-rows1 * config.gate_up_size // 2), -(-rows2 * config.hidden_size // 2), words, parts


def half_rows(buffer: torch.Tensor, rows: int, width: int, half: torch.dtype) -> torch.Tensor:
    """(rows, width) half values at the start of a float32 buffer."""
    return buffer.view(half)[:rows * width].view(rows, width)


def permuted_buffer(config: MoEConfig, slots: int) -> torch.Tensor | None:
    """Memory for the permuted inputs of both GEMMs (`weights.permutes_inputs`), or None."""
    if not permutes_inputs(config):
        return None
    return torch.empty(slots * max(config.hidden_size, config.intermediate_size), dtype=getattr(torch, config.dtype),
                       device=interop.kernel_device())


def permuted_views(buffer: torch.Tensor | None, config: MoEConfig, slots: int) -> dict:
    """`CallBuffers`' gemm1_in and gemm2_in for `slots` slots inside `permuted_buffer`."""
    if buffer is None:
        return {}
    return {"gemm1_in": buffer[:slots * config.hidden_size].view(slots, config.hidden_size),
            "gemm2_in": buffer[:slots * config.intermediate_size].view(slots, config.intermediate_size)}


def arrivals_elements(config: MoEConfig, backend: Backend, blocks: int, tokens: int) -> int:
    """Arrival counters the fused reductions of `backend` use (none: one stand-in)."""
    needed = [1]
    kind = fused_activation_kind(config, backend.gemm1)
    if kind:
        needed.append(arrivals_needed(kind, config.gate_up_size, backend.gemm1.block_n, blocks, tokens))
    kind = fused_combine_kind(config, backend.gemm2)
    if kind:
        needed.append(arrivals_needed(kind, config.hidden_size, backend.gemm2.block_n, blocks, tokens))
    return max(needed)


def check_layer_types(config: MoEConfig, spec: QuantSpec) -> None:
    """A workspace is built from a config and a weights' spec (arguments swapped or left
    out would fail far from here)."""
    check_config(config)
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"spec must be a QuantSpec (the weights' spec: weights.spec), got {type(spec).__name__}")


class Workspace:
    """Scratch buffers for up to `max_tokens` tokens of layers shaped like `config` whose
    weights are stored as `spec` (`weights.spec` or `weights.stored_spec`): the oracle
    picks tiles for what the GEMMs read (`weights.gemm_spec`), and the buffers fit them."""

    def __init__(self, config: MoEConfig, max_tokens: int, spec: QuantSpec):
        check_layer_types(config, spec)
        interop.check_count("max_tokens", max_tokens, 1)
        self.config, self.spec = config, gemm_spec(spec)
        self.expert_map = None if config.expert_map is None else torch.tensor(
            config.expert_map, dtype=torch.int32, device=interop.kernel_device())
        self._allocate(max_tokens)

    def _allocate(self, max_tokens: int) -> None:
        config = self.config
        backends = [select_backend(config, m, self.spec, specialized=specialized)  # hooked calls take plain tiles
                    for m in token_buckets(max_tokens) for specialized in (True, False)]
        slots = max_tokens * config.top_k
        sizes = [align_sizes(slots, config.num_experts, b.block_m) for b in backends]
        half = getattr(torch, config.dtype)
        specialized = [specialized_elements(config, b, max_tokens) for b in backends]
        gemm1 = max(max(gemm_out_elements(b.gemm1, slots, config.gate_up_size) for b in backends),
                    *(e[0] for e in specialized))
        gemm2 = max(max(gemm_out_elements(b.gemm2, slots, config.hidden_size) for b in backends),
                    *(e[1] for e in specialized))
        stage_words, parts = max(e[2] for e in specialized), max(e[3] for e in specialized)
        arrivals = max(arrivals_elements(config, b, s[1], max_tokens) for b, s in zip(backends, sizes))
        device = interop.kernel_device()
        self.max_tokens = max_tokens
        self._topk_weights = torch.empty((max_tokens, config.top_k), dtype=torch.float32, device=device)
        self._topk_ids = torch.empty((max_tokens, config.top_k), dtype=torch.int32, device=device)
        self._sorted_ids = torch.empty(max(s[0] for s in sizes), dtype=torch.int32, device=device)
        self._expert_ids = torch.empty(max(s[1] for s in sizes), dtype=torch.int32, device=device)
        self._num_post_padded = torch.empty(1, dtype=torch.int32, device=device)
        self._gemm1 = torch.empty(gemm1, dtype=torch.float32, device=device)
        self._intermediate = torch.empty((slots, config.intermediate_size), dtype=half, device=device)
        self._gemm2 = torch.empty(gemm2, dtype=torch.float32, device=device)
        self._output = torch.empty((max_tokens, config.hidden_size), dtype=half, device=device)
        self._arrivals = torch.zeros(arrivals, dtype=torch.int32, device=device)
        self._permuted = permuted_buffer(config, slots)
        self._picks = self._stage_blocks = None
        if stage_words:
            self._picks = torch.empty(parts, dtype=torch.int32, device=device)
            self._stage_blocks = torch.empty(stage_words, dtype=torch.int32, device=device)
        self.programs = ProgramCache()  # recorded forwards (see replay); they point into these buffers

    def grow(self, max_tokens: int) -> None:
        """Reallocate for a larger maximum (explicit: calls never grow the workspace)."""
        interop.check_count("max_tokens", max_tokens, 1)
        if max_tokens > self.max_tokens:
            self._allocate(max_tokens)

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (self._topk_weights, self._topk_ids, self._sorted_ids, self._expert_ids, self._num_post_padded,
                self._gemm1, self._intermediate, self._gemm2, self._output, self._arrivals, self._permuted,
                self._picks, self._stage_blocks)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors() if t is not None)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` starts inside one of the workspace's buffers."""
        return starts_within(tensor, self._tensors())

    def check_tokens(self, num_tokens: int) -> None:
        if num_tokens > self.max_tokens:
            raise WorkspaceTooSmall(f"the workspace holds {self.max_tokens} tokens, the call has {num_tokens}: "
                                    f"create it with a larger max_tokens or call grow({num_tokens})")

    def buffers(self, num_tokens: int, backend: Backend) -> CallBuffers:
        """Views for a call of `num_tokens` tokens run by `backend`."""
        self.check_tokens(num_tokens)
        config = self.config
        slots = num_tokens * config.top_k
        padded, blocks = align_sizes(slots, config.num_experts, backend.block_m)
        half = getattr(torch, config.dtype)
        if backend.specialized is None:
            outputs = dict(gemm1_out=gemm_view(self._gemm1, backend.gemm1, slots, config.gate_up_size, half),
                           gemm2_out=gemm_view(self._gemm2, backend.gemm2, slots, config.hidden_size, half),
                           **permuted_views(self._permuted, config, slots))
        else:
            rows1, rows2, _, parts = specialized_sizes(config, backend.specialized, slots)
            outputs = dict(gemm1_out=half_rows(self._gemm1, rows1, config.gate_up_size, half),
                           gemm2_out=half_rows(self._gemm2, rows2, config.hidden_size, half),
                           picks=self._picks[:parts], stage_blocks=self._stage_blocks)
        return CallBuffers(
            topk_weights=self._topk_weights[:num_tokens], topk_ids=self._topk_ids[:num_tokens],
            sorted_token_ids=self._sorted_ids[:padded], expert_ids=self._expert_ids[:blocks],
            num_tokens_post_padded=self._num_post_padded, intermediate=self._intermediate[:slots],
            output=self._output[:num_tokens], arrivals=self._arrivals, **outputs)
