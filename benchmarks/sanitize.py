"""Launch every kernel family once at small shapes, for compute-sanitizer on the GPU:

    compute-sanitizer --tool memcheck python3 benchmarks/sanitize.py
    compute-sanitizer --tool racecheck python3 benchmarks/sanitize.py

Covers routing (softmax and grouped sigmoid), alignment, routing and alignment fused (3
tokens), repack (checkpoint conversion), the grouped GEMM with decode and prefill tiles
(the unchecked steady loop over 4-bit and NVFP4 weights, warps along K adding up),
activation, combine, LoRA, dequantize and the act-order permutes (half pairs in an act-order
layer, elements for an odd K), each layer call twice (recorded, then replayed).
"""

import argparse

import attrs
import numpy as np
import torch

import numba_kernels  # noqa: F401
from moe import LoRAAdapter, LoRAHooks, MoEConfig, MoELayer, QuantScheme
from moe.reference import random_checkpoint
from moe.weights import ExpertWeights
from numba_kernels.align import moe_align_block_size
from numba_kernels.dequant import dequantize
from numba_kernels.gemm import GemmTile, grouped_gemm
from numba_kernels.permute import permute_slots
from numba_kernels.routing import RoutingConfig, route


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    config = MoEConfig(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128,
                       quant=QuantScheme("gptq", group_size=128))
    generator = torch.Generator(device="cuda").manual_seed(0)
    for quant in (QuantScheme("gptq", group_size=128, act_order=True), config.quant):  # the plain layer stays
        layer_config = attrs.evolve(config, quant=quant)
        checkpoint = random_checkpoint(layer_config, np.random.default_rng(0))
        layer = MoELayer(layer_config, max_tokens=128)
        layer.load_weights(checkpoint.w1, checkpoint.w2, checkpoint.w3)
        for tokens in (3, 128):  # decode tiles, then prefill tiles
            hidden = torch.randn(tokens, 256, generator=generator, device="cuda").to(torch.bfloat16)
            logits = torch.randn(tokens, 8, generator=generator, device="cuda")
            layer(hidden, logits)  # records the launches
            layer(hidden, logits)  # replays them
    adapter = LoRAAdapter(*(torch.randn(shape, device="cuda").to(torch.bfloat16) * 0.1 for shape in
                            ((8, 4, 256), (8, 256, 4), (8, 4, 128), (8, 256, 4))))
    layer.hooks = LoRAHooks(config, [adapter], max_tokens=128)
    layer.hooks.set_token_adapters(torch.zeros(3, dtype=torch.int32, device="cuda"))
    layer(hidden[:3], logits[:3])
    route(torch.randn(5, 64, device="cuda"), RoutingConfig(4, "sigmoid", True, 8, 2, 2.5),
          correction_bias=torch.randn(64, device="cuda"))
    dequantize(layer.weights.w2, torch.bfloat16)
    # K = 256 is 16 slabs: slabs 0-11 in the unchecked loop, 12-15 in the checked one.
    steady = GemmTile(block_m=8, warps_k=1, slabs_per_warp=2, swap_ab=True, steady_loop=True)
    alignment = moe_align_block_size(torch.tensor([[0, 5], [5, 7], [2, 0]], dtype=torch.int32, device="cuda"), 8, 8)
    nvfp4 = ExpertWeights(MoEConfig(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128,
                                    quant=QuantScheme("nvfp4")))
    nvfp4.fill_random()
    for weights in (layer.weights.w13, nvfp4.w13):
        grouped_gemm(hidden[:3], weights, *alignment, num_slots=6, tile=steady)
    # Warps along K add up through shared memory, each tile summed and stored by its owner.
    for tile in (GemmTile(block_m=8, warps_k=4, slabs_per_warp=2, swap_ab=True, split_k=2),
                 GemmTile(block_m=16, warps_k=2, slabs_per_warp=2)):
        aligned = moe_align_block_size(torch.tensor([[0, 5], [5, 7], [2, 0]], dtype=torch.int32, device="cuda"),
                                       tile.block_m, 8)
        grouped_gemm(hidden[:3], layer.weights.w13, *aligned, num_slots=6, tile=tile)
    orders = torch.stack([torch.randperm(250, generator=generator, device="cuda") for _ in range(8)]).int()
    permute_slots(hidden[:3, :250].contiguous(), orders, *alignment, num_slots=6, block_m=8)
    torch.cuda.synchronize()
    print("all kernel families launched")


if __name__ == "__main__":
    main()
