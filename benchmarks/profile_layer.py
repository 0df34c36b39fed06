"""Run one benchmark layer a few times, for Nsight Compute on the GPU machine:

    ncu --clock-control none --kernel-name regex:grouped_gemm --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section SourceCounters -o gemm \
        python3 benchmarks/profile_layer.py --shape mixtral --format w4a16-g128 --tokens 1

The first forward compiles and records the kernels; the later ones are what a profiler
should look at (skip the first forward's launches). `--set full` adds the per-instruction
stall samples; as text, for reading off the machine:

    ncu -i gemm.ncu-rep --page details --csv > details.csv
    ncu -i gemm.ncu-rep --page source --csv --print-source sass > source.csv
"""

import argparse

import torch

import numba_kernels  # noqa: F401  (before numba: no simulator on a GPU machine)
from bench_moe import FORMATS, SHAPES, routing_for
from moe import MoEConfig, MoELayer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="mixtral", choices=list(SHAPES))
    parser.add_argument("--format", default="w4a16-g128", choices=list(FORMATS))
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--forwards", type=int, default=3)
    args = parser.parse_args(argv)
    config = MoEConfig(**SHAPES[args.shape], quant=FORMATS[args.format])
    layer = MoELayer(config, max_tokens=args.tokens)
    layer.weights.fill_random(seed=1)
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(args.tokens, config.hidden_size, generator=generator, device="cuda").to(torch.bfloat16)
    logits = routing_for(config, args.tokens, generator)[0]
    for _ in range(args.forwards):
        layer(hidden, logits)
    torch.cuda.synchronize()
    print(f"{args.shape} {args.format} M={args.tokens}: {args.forwards} forwards")


if __name__ == "__main__":
    main()
