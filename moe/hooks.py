"""Typed hooks around the two grouped GEMMs of the kernel sequence.

The runner calls `pre_gemm(step)` before and `post_gemm(step)` after each GEMM, with a
`GemmStep` describing it. Hooks are objects built once outside the hot path (no closures
made inside `run`), so any backend and any weight format gets LoRA (`lora.LoRAHooks`) or
other per-expert additions without a subclass per backend.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen(eq=False)
class GemmStep:
    """One grouped GEMM as a hook sees it.

    name:      "gemm1" (hidden -> gate/up) or "gemm2" (intermediate -> hidden).
    act:       its input: (M, H) per token for gemm1, (M * top_k, I) per slot for gemm2.
    out:       its output, (M * top_k, N) half or (splits, M * top_k, N) float32 partials.
    topk_ids:  (M, top_k) global expert ids of the slots.
    rows_div:  slots per act row (top_k for gemm1, 1 for gemm2).
    """

    name: str
    act: torch.Tensor
    out: torch.Tensor
    topk_ids: torch.Tensor
    rows_div: int


class MoEHooks:
    """Hooks that do nothing; subclass and override what you need."""

    def check(self, config) -> None:
        """Called before a forward's first kernel: raise if these hooks cannot serve a layer
        shaped like `config` (`MoEConfig`)."""

    def pre_gemm(self, step: GemmStep) -> None:
        """Called before the GEMM writes `step.out`."""

    def post_gemm(self, step: GemmStep) -> None:
        """Called after the GEMM wrote `step.out` (may modify it in place)."""
