"""Act-order GEMMs side by side on the GPU: a gather inside the GEMM against permuted inputs.

    python3 benchmarks/act_order.py --shapes qwen3 mixtral --tokens 1 16 256 4096

Act-order int4 weights, group 128, stored with K sorted by group as the kernel layout
stores them (random bits, every group a run of 128), timed three ways in one run, each
the two grouped GEMMs from a CUDA graph with the L2 flushed (`bench_moe.Timer`), writing
partials or outputs only (no fused reductions), routing and alignment done beforehand:

* gathered: the GEMMs read the stored layout through its index maps and gather each
  activation along K (the layer's path until the sixtieth session; decode tiles only);
* permuted: `permute_slots` before each GEMM, then the tiles the oracle picks for plain
  weights (the layer's path now);
* plain:    those GEMMs on the inputs as they come (by difference, what the permutes cost).

Then the whole act-order layer (routing to combine) from a CUDA graph.
"""

import argparse

import torch

import numba_kernels  # noqa: F401  (before numba: no simulator on a GPU machine)
from bench_moe import SHAPES, Timer, captured, routing_for
from moe import MoEConfig, MoELayer, QuantScheme
from moe.oracle import heuristic_backend, select_backend
from numba_kernels.align import moe_align_block_size
from numba_kernels.gemm import grouped_gemm
from numba_kernels.launch import replaying
from numba_kernels.permute import permute_slots
from numba_kernels.weights import KernelWeights


def two_gemms(pair, backend, hidden, intermediate, topk_ids, num_experts, permute: bool):
    """A function launching the two grouped GEMMs of `pair` (w13, w2) with `backend`'s
    tiles, each input permuted into the experts' K order first where `permute`. It owns
    the buffers its launches use: keep it while a replay of them runs."""
    slots, block_m = topk_ids.numel(), backend.block_m
    alignment = moe_align_block_size(topk_ids, block_m, num_experts)
    inputs = (hidden, intermediate)
    permuted = [torch.empty(slots, act.shape[1], dtype=act.dtype, device=act.device) for act in inputs]
    outputs = [None, None]

    def launch():
        for g, (weights, tile) in enumerate(zip(pair, (backend.gemm1, backend.gemm2))):
            act = inputs[g]
            if permute:
                act = permute_slots(act, weights.k_order, *alignment, num_slots=slots, block_m=block_m,
                                    out=permuted[g], check_ids=False)
            outputs[g] = grouped_gemm(act, weights, *alignment, num_slots=slots, tile=tile, out=outputs[g],
                                      alignment_ready=g == 1, check_ids=False)

    return launch


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3", "mixtral"], choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 256, 4096])
    parser.add_argument("--no-gathered", dest="gathered", action="store_false", help="skip the gathering GEMMs")
    args = parser.parse_args(argv)
    timer = Timer()
    generator = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: act-order w4a16 g128, two GEMMs (ms, L2 flushed): gathered / "
          "permuted / plain (the permuted path's tiles on unpermuted inputs); the act-order layer")
    for shape in args.shapes:
        config = MoEConfig(**SHAPES[shape], quant=QuantScheme("native", bits=4, group_size=128, act_order=True))
        layer = MoELayer(config, max_tokens=max(args.tokens))
        layer.weights.fill_random(seed=1)
        weights = layer.weights
        plain = (weights.w13, weights.w2)
        stored = tuple(KernelWeights(weights.stored_spec, w.shape, w.tensors) for w in plain)
        for tokens in args.tokens:
            hidden = torch.randn(tokens, config.hidden_size, generator=generator, device="cuda").to(torch.bfloat16)
            logits, _, topk_ids = routing_for(config, tokens, generator)
            intermediate = torch.randn(topk_ids.numel(), config.intermediate_size, generator=generator,
                                       device="cuda").to(torch.bfloat16)
            gathered_backend = heuristic_backend(config, tokens, weights.stored_spec)
            backend = select_backend(config, tokens, weights.spec)
            ways = [(plain, backend, True, 30), (plain, backend, False, 30)]
            if args.gathered:
                ways.append((stored, gathered_backend, False, 30 if tokens < 1024 else 5))  # seconds at M = 4096
            times = []
            for pair, chosen, permute, repeats in ways:
                launch = two_gemms(pair, chosen, hidden, intermediate, topk_ids, config.num_experts, permute)
                times.append(timer(captured(replaying(launch)), repeats=repeats))  # `launch` holds the buffers
            times += [float("nan")] * (not args.gathered)
            layer_ms = timer(captured(lambda: layer(hidden, logits)))
            print(f"{shape:8s} M={tokens:5d}  gathered {times[2]:8.4f}  permuted {times[0]:8.4f}  plain "
                  f"{times[1]:8.4f}  ({times[2] / times[0]:5.2f}x faster, permutes {times[0] - times[1]:7.4f})  "
                  f"layer {layer_ms:8.4f}  tiles: {'prefill' if backend.gemm1.a_in_shared else 'decode'}",
                  flush=True)
        del layer, weights, plain, stored
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
