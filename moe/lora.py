"""LoRA for MoE experts through hooks: W_e' = W_e + scaling * B_e @ A_e for gate_up and down.

`LoRAHooks` stacks any number of adapters once (padding smaller ranks with zeros), keeps a
per-token adapter index in a persistent buffer, and adds each slot's delta to the GEMM
outputs with `numba_kernels.lora.add_lora`. Because the delta is added to the GEMM's
output, it works with every weight format, quantized bases included.

    hooks = LoRAHooks(config, [adapter_a, adapter_b], max_tokens=256)
    hooks.set_token_adapters(token_adapter)          # (M,) int32, -1 = no adapter
    out = fused_moe(hidden, logits, weights, config, lora=hooks)
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from layouts.checks import real_number
from numba_kernels import interop
from numba_kernels.lora import add_lora

from .config import MoEConfig
from .hooks import GemmStep, MoEHooks


@attrs.frozen(eq=False)
class LoRAAdapter:
    """One adapter's per-expert low-rank pairs (local experts, in the model's half dtype).

    gate_up_a: (E, r, H), gate_up_b: (E, 2I, r)  (gemm1; N = 2I for gated activations)
    down_a:    (E, r, I), down_b:    (E, H, r)   (gemm2)
    scaling:   alpha / r as the adapter defines it.
    """

    gate_up_a: torch.Tensor
    gate_up_b: torch.Tensor
    down_a: torch.Tensor
    down_b: torch.Tensor
    scaling: float = attrs.field(default=1.0, converter=real_number("scaling"))

    def __attrs_post_init__(self):
        for field in _RANK_AXES:
            value = getattr(self, field)
            if not isinstance(value, torch.Tensor) or value.dim() != 3:
                raise TypeError(f"{field} must be a 3-D torch tensor (experts first), got {_describe(value)}")
        for field, rank_axis in _RANK_AXES.items():
            if getattr(self, field).shape[rank_axis] != self.rank:
                raise ValueError(f"{field} must hold the rank ({self.rank}, gate_up_a's second axis) along axis "
                                 f"{rank_axis}, got shape {tuple(getattr(self, field).shape)}")

    @property
    def rank(self) -> int:
        return int(self.gate_up_a.shape[1])


_RANK_AXES = {"gate_up_a": 1, "gate_up_b": 2, "down_a": 1, "down_b": 2}


def _describe(value) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def _stack(adapters: Sequence[LoRAAdapter], field: str, shape, dtype) -> torch.Tensor:
    """(adapters, *shape) with each adapter's tensor zero padded along its rank axis (a
    copy: an adapter's parameters may require grad, the kernels' tensors never do)."""
    rank_axis = _RANK_AXES[field]
    stacked = torch.zeros((len(adapters),) + tuple(shape), dtype=dtype, device=interop.kernel_device())
    for index, adapter in enumerate(adapters):
        value = getattr(adapter, field)
        expected = tuple(shape[a] if a != rank_axis else value.shape[a] for a in range(len(shape)))
        if tuple(value.shape) != expected:
            raise ValueError(f"adapter {index}: {field} must be shaped {expected} (rank axis {rank_axis}), "
                             f"got {tuple(value.shape)}")
        target = stacked[index].narrow(rank_axis, 0, value.shape[rank_axis])
        target.copy_(value.detach().to(device=stacked.device, dtype=dtype))
    return stacked


class LoRAHooks(MoEHooks):
    """Adds the deltas of several adapters, chosen per token, after each grouped GEMM."""

    def __init__(self, config: MoEConfig, adapters: Sequence[LoRAAdapter], max_tokens: int):
        if not adapters:
            raise ValueError("LoRAHooks needs at least one adapter")
        for index, adapter in enumerate(adapters):
            if not isinstance(adapter, LoRAAdapter):
                raise TypeError(f"adapter {index} must be a LoRAAdapter, got {type(adapter).__name__}")
        interop.check_count("max_tokens", max_tokens, 1)
        dtype, experts = getattr(torch, config.dtype), config.num_local_experts
        h, i, n1 = config.hidden_size, config.intermediate_size, config.gate_up_size
        rank = max(adapter.rank for adapter in adapters)
        self.config, self.rank, self.max_tokens = config, rank, max_tokens
        self.gate_up_a = _stack(adapters, "gate_up_a", (experts, rank, h), dtype)
        self.gate_up_b = _stack(adapters, "gate_up_b", (experts, n1, rank), dtype)
        self.down_a = _stack(adapters, "down_a", (experts, rank, i), dtype)
        self.down_b = _stack(adapters, "down_b", (experts, h, rank), dtype)
        device = interop.kernel_device()
        self.scaling = torch.tensor([a.scaling for a in adapters], dtype=torch.float32, device=device)
        self.expert_map = None if config.expert_map is None else torch.tensor(
            config.expert_map, dtype=torch.int32, device=device)
        self._token_adapter = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self._num_tokens = 0

    def set_token_adapters(self, token_adapter, *, check: bool = True) -> None:
        """The adapter of each token of the next calls, (M,) int32, -1 for none (copied into a
        persistent buffer, so graphs captured afterwards see later updates). `check`
        validates the ids (a host sync for a GPU tensor): an id past the adapters would
        read another tensor's memory."""
        token_adapter = interop.check_tensor("token_adapter", token_adapter, dtype=torch.int32, ndim=1)
        if token_adapter.shape[0] > self.max_tokens:
            raise ValueError(f"token_adapter has {token_adapter.shape[0]} tokens, the hooks hold {self.max_tokens}")
        adapters = self.scaling.shape[0]
        if check and token_adapter.numel():
            interop.check_range("token_adapter", token_adapter, -1, adapters, " (-1: no adapter)")
        self._token_adapter[:token_adapter.shape[0]].copy_(token_adapter)
        self._num_tokens = token_adapter.shape[0]

    def check(self, config: MoEConfig) -> None:
        if config != self.config:
            raise ValueError("the LoRA hooks were built for another MoEConfig than the layer's (shapes, experts and "
                             "dtype must match)")

    def post_gemm(self, step: GemmStep) -> None:
        tokens = step.topk_ids.shape[0]
        if tokens != self._num_tokens:
            raise ValueError(f"set_token_adapters was given {self._num_tokens} tokens, the call has {tokens}")
        a, b = (self.gate_up_a, self.gate_up_b) if step.name == "gemm1" else (self.down_a, self.down_b)
        add_lora(step.act, step.topk_ids, a, b, self.scaling, self._token_adapter[:tokens], step.out,
                 expert_map=self.expert_map, rows_div=step.rows_div, check_ids=False)
