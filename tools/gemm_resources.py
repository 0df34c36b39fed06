"""Registers, spills and wide loads of the grouped GEMM for the oracle's tiles, compiled
for sm_90a without a GPU (see `tools/ptx_check.py` for what it needs).

    python -m tools.gemm_resources                # resources
    python -m tools.gemm_resources --digest       # a digest of each kernel's code
    python -m tools.gemm_resources --before-wait  # global loads issued before the wait
    python -m tools.gemm_resources --specialized  # the warp-specialised GEMM's wgmma waits

Prints one line per (layout, tile): registers per thread, stack / spill bytes, local
loads, mma and 16-byte global loads in the PTX. Run it after changing a kernel's main
loop, before spending device time: a spill or a lost vector load shows here. With
`--digest`, a hash of each kernel's PTX with the names that vary between processes
normalised: a change meant to move code around without changing it (a refactor of
`gemm` and its loops) must leave every digest as it was. With `--before-wait`, the global
loads the SASS (needs nvdisasm) places before each `griddepcontrol.wait` (ACQBULK), as
the layer's gemm2 runs launched early. Its later CTAs take the first wait, at the start;
its first wave branches past it and takes the second, after its first weight loads (a
third, after the main loop, is for first-wave CTAs with no slabs). So before the second
only weights (`.CONSTANT`, and NVFP4's global scale), the first wave's alignment from the
L2 (`.STRONG.GPU`, under the predicate that skipped the first wait) and the later CTAs'
alignment (plain `LDG.E`, under the other predicate) belong; an activation load there
would read it unfinished (the sixty-first session's race). A listing to read beside the
SASS, not a verdict: it does not follow branches (a plain `LDG.E` without a predicate may
sit in a block only later CTAs run). With `--specialized`, the warp-specialised GEMM
(`gemm_specialized`, the oracle's tiles; int4 with and without zero points, NVFP4) at
Mixtral's two GEMMs: its HGMMA, its waits for all but the newest group (the main loop,
pipelined) and for all groups, and the reads of accumulators (F2FP, FMUL) that the SASS
places after an HGMMA but before a wait for all groups; that count must be 0 (the
seventy-second session found ptxas had moved the stores' reads above a wait that came
after the main loop). And the instructions a wgmma of its widest path: every SASS
instruction from the first HGMMA of the tile's max_width to the last, over the HGMMA
between them. That is the consumer warps' work a slab, which bounds the GEMM where
decoding, not the tensor cores, is the limit (eighty-seventh session: zero points at
34.5 against symmetric int4's 27.2, and what brought them down).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import re

import attrs
import numpy as np

from .ptx_check import compile_kernel, sass  # first: numba_kernels would pick the simulator without a GPU

from layouts import QuantSpec, formats  # noqa: E402
from layouts.samples import random_quantized  # noqa: E402
import moe.oracle  # noqa: E402
from moe.oracle import DECODE_TILE, PREFILL_TILE, SWAPPED_DECODE_TILE, writes_partials  # noqa: E402
from numba_kernels.activation import Activation  # noqa: E402
from numba_kernels.epilogue import activation_kind, combine_kind  # noqa: E402
from numba_kernels.gemm import GemmTile, make_grouped_gemm, stores_pairs  # noqa: E402
from numba_kernels.gemm_specialized import make_specialized_kernel  # noqa: E402

DECODE = attrs.evolve(DECODE_TILE, split_k=2)
SWAPPED = attrs.evolve(SWAPPED_DECODE_TILE, split_k=2, fused_reduction=True)
PREFILL_64 = PREFILL_TILE
PREFILL_128 = attrs.evolve(PREFILL_TILE, block_m=128, warps_m=2, slabs_per_warp=2, stages=3)
PAIRED_64 = attrs.evolve(PREFILL_TILE, fused_reduction=True)
# 8 warps along K (tuned Mixtral entries): the reduction's loops must unroll, or the
# accumulators go to local memory (the fortieth session's flaw, seen here as ld.local).
WIDE_K = GemmTile(block_m=16, warps_k=8, slabs_per_warp=2, steady_loop=True)
STEADY_SWAPPED = attrs.evolve(SWAPPED, steady_loop=True, fused_reduction=False)
PAIRED_DECODE = attrs.evolve(SWAPPED_DECODE_TILE, warps_n=2, warps_k=2, split_k=1, fused_reduction=True)
CASES = [(formats.native(4, 128), tile) for tile in (DECODE, SWAPPED, STEADY_SWAPPED, WIDE_K, PAIRED_DECODE, PREFILL_64,
                                                      PAIRED_64, PREFILL_128)] + [
    (formats.native(fp4=True), tile) for tile in (DECODE, SWAPPED, PAIRED_DECODE, PREFILL_64, PAIRED_64)]


def _kernel_arrays(spec: QuantSpec, shape: tuple[int, int, int]) -> tuple:
    """The six weight arrays as the kernel receives them (3-D, halves as int16)."""
    physical = spec.pack(random_quantized(spec, shape, np.random.default_rng(0)))

    def as_3d(value):
        value = np.asarray(value)
        value = value.view(np.int16) if value.dtype in (np.uint16, np.float16) else value
        return value if value.ndim == 3 else value[None]

    zeros = as_3d(physical[spec.zeros.name]) if spec.zeros else np.zeros((1, 1, 1), np.int32)
    global_scale = (np.asarray(physical[spec.global_scale_name], np.float32).reshape(-1) if spec.global_scale_name
                    else np.ones(1, np.float32))
    return (as_3d(physical[spec.weight.name]), as_3d(physical[spec.scales.name]), zeros,
            np.zeros((1, 1), np.int32), np.zeros((1, 1), np.int32), global_scale)


def compile_gemm(spec: QuantSpec, tile: GemmTile, n: int = 256, k: int = 512):
    """The GEMM as the layer's gemm2 runs it: decode tiles with the fused combine
    (top_k = 2), prefill tiles multiplying routed weights; tiles of paired warps with
    `fused_reduction` as gemm1 finishing silu in the epilogue."""
    paired = tile.fused_reduction and tile.pairs_warps
    partial = writes_partials(tile)
    fused = activation_kind(Activation("silu")) if paired else combine_kind(2) if tile.fused_reduction else None
    kernel = make_grouped_gemm(spec, n, k, tile, "bfloat16", partial, fused is None, True, fused,
                               alignment_ready=not paired)  # gemm2: aligned before gemm1
    ids = np.zeros(4, np.int32)
    if partial:
        out = np.zeros((tile.split_k, 8, n), np.float32)
    else:
        out = np.zeros((8, n // 2), np.int32) if stores_pairs(tile, n, partial) else np.zeros((8, n), np.int16)
    if paired:  # the activation's output: pairs from unswapped tiles, halves from swapped ones
        reduced = np.zeros((8, n // 2), np.int16) if tile.swap_ab else np.zeros((8, n // 4), np.int32)
    else:  # the combine's output
        reduced = np.zeros((4, n), np.int16)
    return compile_kernel(kernel, np.zeros((1, 4, k // 2), np.int32), _kernel_arrays(spec, (2, n, k)), ids, ids,
                          ids[:1], np.zeros(8, np.float32), out, reduced, np.zeros(64, np.int32), np.int32(8),
                          np.int32(2), np.int32(0))


def resources(spec: QuantSpec, tile: GemmTile) -> str:
    """One line of figures for the GEMM of `compile_gemm`."""
    compiled = compile_gemm(spec, tile)
    registers = re.findall(r"Used (\d+) registers", compiled.report)
    stack = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores", compiled.report)
    ptx = compiled.ptx
    return (f"registers {registers}, stack/spill {stack}, ld.local {ptx.count('ld.local')}, "
            f"mma {ptx.count('mma.sync')}, 16-byte loads {ptx.count('ld.global.nc.v4')}, cp.async {ptx.count('cp.async.cg')}, "
            f"ldmatrix {ptx.count('ldmatrix')}, ld.shared.v4 {ptx.count('ld.shared.v4')}")


def digest(spec: QuantSpec, tile: GemmTile) -> str:
    """A hash of the PTX of `compile_gemm`, with mangled names, the numbering of shared
    arrays (by first use) and of constant arrays (by content) normalised."""
    ptx = re.sub(r"_Z[0-9A-Za-z_$]+", "NAME", compile_gemm(spec, tile).ptx)
    names = {name: "CONST" + hashlib.sha256(body.encode()).hexdigest()[:8]
             for name, body in re.findall(r"(_cudapy_cmem(?:\$\d+)?)(\[\d+\] = \{[^}]*\})", ptx)}
    ptx = re.sub(r"_cudapy_smem_\d+|_cudapy_cmem(?:\$\d+)?",
                 lambda m: names.setdefault(m.group(0), f"SHARED{len(names)}"), ptx)
    lines = [line for line in ptx.splitlines() if not line.startswith("//")]
    constants = sorted(line for line in lines if line.startswith(".const"))
    code = "\n".join(constants + [line for line in lines if not line.startswith(".const")])
    return hashlib.sha256(code.encode()).hexdigest()[:16]


def loads_before_wait(spec: QuantSpec, tile: GemmTile) -> str:
    """The global loads in the SASS of `compile_gemm` before each of its waits, in layout
    order, with their predicates: "wait 1: ... | wait 2: ..." (each the loads since the
    wait before it)."""
    segments, kinds = [], set()
    for line in sass(compile_gemm(spec, tile).ptx).splitlines():
        if "ACQBULK" in line:
            segments.append(f"wait {len(segments) + 1}: " + (" ".join(sorted(kinds)) or "none"))
            kinds = set()
        kinds.update(" ".join(filter(None, load)) for load in re.findall(r"(@!?P\d+)?\s*(LDG\S*)", line))
    return " | ".join(segments) or "no wait"


def specialized_waits(spec: QuantSpec, n: int, k: int, tile, blocked: bool) -> str:
    """Registers, HGMMA, waits, accumulator reads before a full wait and instructions a
    wgmma in the SASS of the warp-specialised GEMM with `tile` for weights (n, k) an expert."""
    kernel, _, _ = make_specialized_kernel(spec, n, k, "bfloat16", tile, blocked)
    ids = np.zeros(16, np.int32)
    compiled = compile_kernel(kernel, ids, _kernel_arrays(spec, (2, 256, 256)), ids, ids, ids,
                              np.zeros((16, n // 2), np.int32))
    code = sass(compiled.ptx)
    pending, early, counts = False, 0, {"HGMMA": 0, "gsb0, 0x1": 0, "gsb0, 0x0": 0}
    for line in code.splitlines():
        counts.update({key: counts[key] + 1 for key in counts if key in line})
        if "HGMMA" in line or "DEPBAR.LE gsb0, 0x0" in line:
            pending = "HGMMA" in line
        elif pending and re.search(r"\b(F2FP|FMUL)\b", line):
            early += 1
    registers = re.findall(r"Used (\d+) registers", compiled.report)
    spills = re.findall(r"(\d+) bytes spill stores", compiled.report)
    return (f"registers {registers}, spill stores {spills}, HGMMA {counts['HGMMA']}, waits for all but one "
            f"{counts['gsb0, 0x1']}, for all {counts['gsb0, 0x0']}, accumulator reads before a wait for all {early}, "
            f"instructions a wgmma at {tile.max_width} wide {instructions_per_wgmma(code, tile.max_width):.1f}")


def instructions_per_wgmma(code: str, width: int) -> float:
    """SASS instructions from the first HGMMA of `width` columns to the last, per HGMMA
    between them (the main loop's and its last round's, unrolled)."""
    lines = [line for line in code.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/\s+\S", line)]
    wgmma = [i for i, line in enumerate(lines) if f"HGMMA.64x{width}x16" in line]
    return (wgmma[-1] - wgmma[0]) / (len(wgmma) - 1) if len(wgmma) > 1 else float("nan")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.gemm_resources", description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--digest", action="store_true", help="a hash of each kernel's PTX instead of its resources")
    which.add_argument("--before-wait", action="store_true",
                       help="the global loads the SASS issues before each wait (needs nvdisasm)")
    which.add_argument("--specialized", action="store_true",
                       help="the warp-specialised GEMM's wgmma waits in its SASS (needs nvdisasm)")
    args = parser.parse_args(argv)
    if args.specialized:
        tiles = [getattr(moe.oracle, name) for name in moe.oracle.SPECIALIZED_TILE_NAMES]
        specs = (formats.native(4, 128), formats.native(4, 128, zero_points=True), formats.native(fp4=True))
        for spec, tile in itertools.product(specs, tiles):
            label = spec.name + (" zero points" if spec.zeros else "")
            for name, n, k, blocked in (("gemm1", 28672, 4096, True), ("gemm2", 4096, 14336, False)):
                print(f"{label:24s} {tile.max_width} wide {name} (N={n}, K={k}): "
                      f"{specialized_waits(spec, n, k, tile, blocked)}", flush=True)
        return
    report = digest if args.digest else loads_before_wait if args.before_wait else resources
    for spec, tile in CASES:
        print(f"{spec.name:12s} {tile}: {report(spec, tile)}", flush=True)


if __name__ == "__main__":
    main()
