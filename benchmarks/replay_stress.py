"""Replayed forwards against plain launches, many times, with the GPU busy beside them.

    python3 benchmarks/replay_stress.py --rounds 100 --load

Every kernel of the layer is deterministic, so a forward replayed from its recorded CUDA
graph must give, bit for bit, what the same inputs give through plain launches (the
first call of a fresh workspace). A race between kernels that overlap (early launch:
`numba_kernels.launch`) shows up as a replay that differs now and then, more often when
CTAs are scheduled unevenly: `--load` keeps bf16 matmuls running on a stream of their
own meanwhile. Each case keeps a pool of inputs with their plain outputs; a round replays
every case on one of its inputs (fresh copies, so replays re-point their arguments) and
compares. Exits 1 if any replay differed, after printing where (rows, largest error).

It found one (sixty-first session, H200): gemm2 loaded its activations through the
read-only path, which promises ptxas that nothing writes them while the kernel runs, so
ptxas issued the first ones before the wait for the activation kernel. With load, 3 to 5
in 800 to 2500 replays of Qwen3 w4a16 M = 1 differed, 13 % with gemm1 releasing late
(`--evolve gemm1.release_early=false`), always in the columns of the CTAs launched first.
Activations and partials are read with plain loads since (`ptx.load_written`).
"""

import argparse
import random

import attrs
import torch

import numba_kernels  # noqa: F401  (before numba: no simulator on a GPU machine)
from bench_moe import SHAPES, FORMATS
import moe.oracle
import moe.runner
import moe.workspace
from moe import BatchedWorkspace, ExpertWeights, MoEConfig, QuantScheme, Workspace, batched_moe, fused_moe
from moe.oracle import select_batched_backend
from numba_kernels import interop

DEVICE = interop.kernel_device()  # the CPU under the simulator (tiny cases only: --cases)

SMALL = dict(num_experts=16, top_k=4, hidden_size=512, intermediate_size=256)
ACT_ORDER = QuantScheme("native", bits=4, group_size=128, act_order=True)
# (label, shape, quant, layout, tokens: per call (routed) or per expert (batched))
CASES = [
    ("qwen3 w4a16 M=1", SHAPES["qwen3"], FORMATS["w4a16-g128"], "routed", 1),
    ("qwen3 nvfp4 M=1", SHAPES["qwen3"], FORMATS["nvfp4"], "routed", 1),
    ("qwen3 w4a16 M=16", SHAPES["qwen3"], FORMATS["w4a16-g128"], "routed", 16),
    ("qwen3 w4a16 M=256", SHAPES["qwen3"], FORMATS["w4a16-g128"], "routed", 256),
    ("qwen3 act-order M=1", SHAPES["qwen3"], ACT_ORDER, "routed", 1),
    ("qwen3 act-order M=256", SHAPES["qwen3"], ACT_ORDER, "routed", 256),
    ("mixtral w4a16 M=4", SHAPES["mixtral"], FORMATS["w4a16-g128"], "routed", 4),
    ("small batched T=5", SMALL, QuantScheme("gptq", group_size=128), "batched", 5),
    ("small batched T=96", SMALL, QuantScheme("gptq", group_size=128), "batched", 96),
    ("small act-order batched T=5", SMALL, ACT_ORDER, "batched", 5),
    ("qwen3 w4a16 batched T=2", SHAPES["qwen3"], FORMATS["w4a16-g128"], "batched", 2),
]


class Case:
    """One layer kind: its weights, a persistent workspace (recorded once, then replayed),
    and a pool of inputs with the outputs of their plain launches."""

    def __init__(self, label, shape, quant, layout, tokens, pool: int, generator):
        self.label, self.layout, self.tokens = label, layout, tokens
        self.config = config = MoEConfig(**shape, quant=quant)
        self.weights = weights = ExpertWeights(config)
        weights.fill_random(seed=1)
        spec = weights.spec
        self.workspace = (Workspace(config, tokens, spec) if layout == "routed"
                          else BatchedWorkspace(config, tokens, spec))
        backend = (moe.runner.select_backend(config, tokens, spec) if layout == "routed"  # --evolve's too
                   else select_batched_backend(config, tokens, spec))
        self.tiles = (f"block {backend.block_m}, gemm1 {'prefill' if backend.gemm1.a_in_shared else 'decode'}, "
                      f"{'act-order permutes, ' if weights.permutes_inputs else ''}"
                      f"{'fused activation' if backend.gemm1.fused_reduction else 'activation kernel'}, "
                      f"{'fused combine' if backend.gemm2.fused_reduction else 'combine kernel'}"
                      f"{', gemm1 releases early' if backend.gemm1.release_early else ''}")
        self.inputs = [self.draw(generator) for _ in range(pool)]
        self.plain = [self.call(inputs, fresh=True).clone() for inputs in self.inputs]
        self.call(self.inputs[0])  # records the persistent workspace's program

    def draw(self, generator):
        config, tokens = self.config, self.tokens
        if self.layout == "routed":
            hidden = torch.randn(tokens, config.hidden_size, generator=generator, device=DEVICE)
            logits = torch.randn(tokens, config.num_experts, generator=generator, device=DEVICE)
            return hidden.to(torch.bfloat16), logits
        experts = config.num_local_experts
        hidden = torch.randn(experts, tokens, config.hidden_size, generator=generator, device=DEVICE)
        counts = torch.randint(0, tokens + 1, (experts,), generator=generator, device=DEVICE, dtype=torch.int32)
        return hidden.to(torch.bfloat16), counts

    def call(self, inputs, fresh: bool = False):
        """The forward on fresh copies of `inputs`; `fresh`: through a new workspace (plain launches)."""
        first, second = (tensor.clone() for tensor in inputs)
        if self.layout == "routed":
            workspace = Workspace(self.config, self.tokens, self.weights.spec) if fresh else self.workspace
            return fused_moe(first, second, self.weights, self.config, workspace=workspace)
        workspace = BatchedWorkspace(self.config, self.tokens, self.weights.spec) if fresh else self.workspace
        out = batched_moe(first, second, self.weights, self.config, workspace=workspace, check_counts=False)
        # padding rows hold whatever the kernels left there: compare valid rows only
        valid = torch.arange(self.tokens, device=DEVICE)[None, :] < second[:, None]
        return torch.where(valid[..., None], out, torch.zeros((), dtype=out.dtype, device=DEVICE))


def where_they_differ(got, expected) -> str:
    """Which rows of two outputs differ, in how many elements, by how much at most, and
    the first such row's columns (as runs first-last)."""
    differs = (got.view(torch.int16) != expected.view(torch.int16)).flatten(0, -2)
    rows = differs.any(dim=-1).nonzero().flatten().tolist()
    columns = differs[rows[0]].nonzero().flatten().tolist()
    runs = []
    for c in columns:
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    error = (got.float() - expected.float()).abs().max().item()
    return (f"{int(differs.sum())} elements in rows {rows[:12]}{'...' if len(rows) > 12 else ''}, max |diff| "
            f"{error:.3g}; row {rows[0]}'s columns {' '.join(f'{a}-{b}' for a, b in runs[:24])}")


def evolve_tiles(changes: list[str]) -> None:
    """Make the runner and the workspaces take the oracle's tiles with `changes` applied,
    each 'gemm1.FIELD=VALUE' or 'gemm2.FIELD=VALUE' (e.g. gemm1.release_early=false):
    which tile option a race needs."""
    fields = {"gemm1": {}, "gemm2": {}}
    for change in changes:
        target, value = change.split("=")
        gemm, field = target.split(".")
        flags = {"true": True, "false": False}
        fields[gemm][field] = flags[value.lower()] if value.lower() in flags else int(value)
    select = moe.oracle.select_backend

    def evolved(config, tokens, spec, *, specialized=True):
        backend = select(config, tokens, spec, specialized=specialized)
        return attrs.evolve(backend, **{gemm: attrs.evolve(getattr(backend, gemm), **fields[gemm]) for gemm in fields})

    moe.runner.select_backend = moe.workspace.select_backend = evolved


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--pool", type=int, default=4, help="inputs per case")
    parser.add_argument("--load", action="store_true", help="bf16 matmuls on another stream meanwhile")
    parser.add_argument("--cases", nargs="*", help="labels to run (default: all)")
    parser.add_argument("--evolve", nargs="*", default=[], help="tile changes, e.g. gemm1.release_early=false")
    args = parser.parse_args(argv)
    evolve_tiles(args.evolve)
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    chosen = [case for case in CASES if not args.cases or case[0] in args.cases]
    cases = []
    for spec in chosen:
        cases.append(Case(*spec, pool=args.pool, generator=generator))
        print(f"{cases[-1].label:28s} {cases[-1].tiles}", flush=True)
    if args.load:
        side, a = torch.cuda.Stream(), torch.randn(4096, 4096, device=DEVICE, dtype=torch.bfloat16)
    picker = random.Random(0)
    failures = {case.label: [] for case in cases}
    for round_ in range(args.rounds):
        for case in cases:
            if args.load:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(picker.randint(0, 3)):
                        torch.mm(a, a)
            index = picker.randrange(len(case.inputs))
            got = case.call(case.inputs[index])
            if not torch.equal(got.view(torch.int16), case.plain[index].view(torch.int16)):
                where = where_they_differ(got, case.plain[index])
                failures[case.label].append(f"round {round_} input {index}: {where}")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "the simulator"
    print(f"{device}: {args.rounds} rounds, {'with' if args.load else 'without'} load")
    for case in cases:
        found = failures[case.label]
        print(f"{case.label:28s} {len(found)} of {args.rounds} replays differed from plain launches")
        for line in found[:5]:
            print(f"    {line}")
    return int(any(failures.values()))


if __name__ == "__main__":
    raise SystemExit(main())
