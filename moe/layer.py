"""`MoELayer`: the MoE layer as a `torch.nn.Module`, on the runner's one kernel sequence."""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

from .config import MoEConfig
from .hooks import MoEHooks
from .runner import forward
from .weights import ExpertWeights
from .workspace import Workspace


class MoELayer(torch.nn.Module):
    """A quantized MoE layer.

    config:     the layer (shapes, routing, activation, experts on this rank, quantization).
    max_tokens: the largest batch the layer's workspace is sized for.
    workspace:  share one `Workspace` between layers of the same shapes (optional).
    hooks:      `LoRAHooks` or any `MoEHooks` (optional; settable later as `layer.hooks`).

    `forward` returns a view of the workspace's output, valid until the workspace's next
    call (copy it to keep it): that is what lets a forward allocate nothing.
    """

    def __init__(self, config: MoEConfig, *, max_tokens: int = 256, workspace: Workspace | None = None,
                 hooks: MoEHooks | None = None):
        super().__init__()
        self.config = config
        self.weights = ExpertWeights(config)
        self.workspace = workspace if workspace is not None else Workspace(config, max_tokens, self.weights.spec)
        self.hooks = hooks

    def load_weights(self, w1: Mapping | None = None, w2: Mapping | None = None, w3: Mapping | None = None, *,
                     experts: Iterable[tuple[int, Mapping, Mapping, Mapping | None]] | None = None) -> None:
        """Convert checkpoint tensors into the layer's kernel buffers: stacked (E, ...) w1,
        w2, w3 (engine names), or an iterable of (expert, w1, w2, w3) per-expert tensors.
        Calling it again reloads into the same buffers."""
        if experts is None:
            if w1 is None or w2 is None:
                raise ValueError("load_weights needs w1 and w2 (and w3 for gated activations), or experts=")
            self.weights.load_stacked(w1, w2, w3)
        else:
            self.weights.load(experts)
            self.weights.release_scratch()

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor | None = None, *, topk=None,
                correction_bias: torch.Tensor | None = None) -> torch.Tensor:
        return forward(self.config, self.weights, self.workspace, hidden_states, router_logits, topk=topk,
                       correction_bias=correction_bias, hooks=self.hooks)
