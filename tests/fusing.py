"""Test helpers for the fused reductions: force them on every tile, or keep them apart."""

import attrs

import moe.runner
import moe.workspace
from moe import MoEHooks


class SeparateReductions(MoEHooks):
    """A post_gemm hook that changes nothing, but makes the runner launch the activation
    and combine kernels instead of fusing them into the GEMMs."""

    def post_gemm(self, step):
        pass


def fuse_every_tile(monkeypatch, select):
    """Make the runner and the workspace take `select`'s backends with `fused_reduction`
    set on both GEMM tiles; returns that selection."""
    def select_fused(config, tokens, spec):
        backend = select(config, tokens, spec)
        return attrs.evolve(backend, gemm1=attrs.evolve(backend.gemm1, fused_reduction=True),
                            gemm2=attrs.evolve(backend.gemm2, fused_reduction=True))

    monkeypatch.setattr(moe.runner, "select_backend", select_fused)
    monkeypatch.setattr(moe.workspace, "select_backend", select_fused)
    return select_fused
