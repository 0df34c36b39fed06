"""Test helpers for tile options: force one on every tile (the fused reductions, an early
release), or keep the reductions apart."""

import attrs

import moe.runner
import moe.workspace
from moe import MoEHooks


class SeparateReductions(MoEHooks):
    """A post_gemm hook that changes nothing, but makes the runner launch the activation
    and combine kernels instead of fusing them into the GEMMs."""

    def post_gemm(self, step):
        pass


def evolve_every_tile(monkeypatch, select, **options):
    """Make the runner and the workspace take `select`'s backends with `options` set on
    both GEMM tiles; returns that selection. `specialized` is not passed on (the
    selections wrapped here, the heuristic and tests' lambdas, take none): a test that
    must run tiles on Hopper turns the warp-specialised GEMM off (`USE_SPECIALIZED`)."""
    def select_evolved(config, tokens, spec, *, specialized=True):
        backend = select(config, tokens, spec)
        return attrs.evolve(backend, gemm1=attrs.evolve(backend.gemm1, **options),
                            gemm2=attrs.evolve(backend.gemm2, **options))

    monkeypatch.setattr(moe.runner, "select_backend", select_evolved)
    monkeypatch.setattr(moe.workspace, "select_backend", select_evolved)
    return select_evolved


def fuse_every_tile(monkeypatch, select):
    """`evolve_every_tile` with `fused_reduction` set on both GEMM tiles."""
    return evolve_every_tile(monkeypatch, select, fused_reduction=True)
