"""Time the layer's two GEMMs and the whole layer under several source trees, side by side.

A change to a kernel is judged against the code before it in one session on one card:
differences of 1 to 3 % are real but smaller than the spread between benchmark runs. Each
tree (a checkout, or `git archive <commit> numba_kernels moe layouts benchmarks | tar -x
-C DIR`) runs in a process of its own, since the packages cannot be imported twice, and
the trees take turns round by round, so that a drift of the card's clocks shows as a
drift, not as a difference:

    python benchmarks/compare_trees.py --trees before=/tmp/before after=. \\
        --jobs qwen3:w4a16-g128:1 mixtral:nvfp4:4 --rounds 2

A job is shape:format:M (`bench_moe.SHAPES`, `bench_moe.FORMATS`), timed with the tuned
entry of its tree as `bench_moe` times it (GEMMs replayed from a CUDA graph with gemm2
launched early, the L2 flushed, median of 40 replays; then the layer), best of three
attempts a round. Routings are drawn per job from a seed of its own, the same in every
tree. Prints each job's GEMM time as it ends, then one line per job and tree: the best
GEMM time of each round, in us.
`--host` adds, for a change to the host code, the eager layer's host time a forward
(replayed, as the layer runs by default) and the time of a forward with hooks, whose
ordinary launches go through the oracle and the launch path every call
(`bench_moe.eager_host`); with NUMBA_MOE_TUNED=0 in the environment, the untuned oracle's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def parse_job(job: str) -> tuple[str, str, int]:
    """'qwen3:nvfp4:4' -> ('qwen3', 'nvfp4', 4)."""
    parts = job.split(":")
    if len(parts) != 3 or not parts[2].isdigit() or int(parts[2]) < 1:
        raise ValueError(f"a job is shape:format:M with M a positive integer, got {job!r}")
    return parts[0], parts[1], int(parts[2])


def parse_tree(tree: str) -> tuple[str, str]:
    """'before=/tmp/before' -> ('before', '/tmp/before')."""
    name, separator, path = tree.partition("=")
    if not separator or not name or not path:
        raise ValueError(f"a tree is name=path, got {tree!r}")
    return name, path


def worker(tree: str, jobs: list[str], host: bool, attempts: int = 3) -> None:
    """Time `jobs` with the code of `tree` (imported from there); one JSON line per job."""
    sys.path[:0] = [tree, os.path.join(tree, "benchmarks")]
    import torch
    from bench_moe import FORMATS, SHAPES, Timer, best_times, eager_host, routing_for
    from moe import MoEConfig, MoELayer

    timer = Timer()

    def time_job(job: str) -> dict:
        shape, format_name, tokens = parse_job(job)
        config = MoEConfig(**SHAPES[shape], quant=FORMATS[format_name])
        layer = MoELayer(config, max_tokens=tokens)
        layer.weights.fill_random(seed=1)
        generator = torch.Generator(device="cuda").manual_seed(tokens)
        hidden = torch.randn(tokens, config.hidden_size, generator=generator, device="cuda").to(torch.bfloat16)
        logits, topk_weights, topk_ids = routing_for(config, tokens, generator)
        gemm_ms, layer_ms, backend = best_times(timer, layer, hidden, logits, topk_weights, topk_ids, attempts)
        figures = {}
        if host:
            eager = eager_host(layer, hidden, logits)
            figures = dict(host_us=eager["eager_host_us"], hooked_us=eager["eager_ordinary_ms"] * 1e3)
        return dict(job=job, gemm_us=gemm_ms * 1e3, layer_us=layer_ms * 1e3, backend=repr(backend), **figures)

    for job in jobs:
        print(json.dumps(time_job(job)), flush=True)
        torch.cuda.empty_cache()  # the job's layer is gone: its weights go back to the card


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", required=True, help="name=path of each source tree")
    parser.add_argument("--jobs", nargs="+", required=True, help="shape:format:M")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--host", action="store_true", help="also the eager layer's host time a forward")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: time --jobs under this tree
    args = parser.parse_args(argv)
    for job in args.jobs:
        parse_job(job)
    trees = [parse_tree(tree) for tree in args.trees]
    import torch  # here and in `worker` only: the module imports without it

    if not torch.cuda.is_available():
        parser.error("it times the layer under each tree on a CUDA GPU and none is available here "
                     "(python -m moe runs without one)")
    if args.worker:
        worker(args.worker, args.jobs, args.host)
        return
    times = {(job, name): [] for job in args.jobs for name, _ in trees}
    figures = ("gemm_us", "layer_us") + ("host_us", "hooked_us") * args.host
    for round_number in range(1, args.rounds + 1):
        for name, path in trees:
            command = [sys.executable, os.path.abspath(__file__), "--worker", path, "--trees", f"{name}={path}",
                       "--jobs", *args.jobs] + ["--host"] * args.host
            with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
                for line in process.stdout:
                    if line.startswith("{"):
                        row = json.loads(line)
                        times[row["job"], name].append([row[figure] for figure in figures])
                        # Each job as it ends: a run cut short by a time limit still says something.
                        print(f"round {round_number} {name:10s} {row['job']:24s} GEMMs {row['gemm_us']:.2f} us",
                              flush=True)
            if process.returncode:
                raise subprocess.CalledProcessError(process.returncode, command)
    for (job, name), rounds in times.items():
        columns = [" / ".join(f"{value:.2f}" for value in column) for column in zip(*rounds)]
        print(f"{job:24s} {name:10s} GEMMs {columns[0]} us   layer {columns[1]} us"
              + ("   host {} us   hooked forward {} us".format(*columns[2:]) if args.host else ""))


if __name__ == "__main__":
    main()
