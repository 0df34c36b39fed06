"""Launch every kernel family once at small shapes, for compute-sanitizer on the GPU:

    compute-sanitizer --tool memcheck python3 benchmarks/sanitize.py
    compute-sanitizer --tool racecheck python3 benchmarks/sanitize.py

Covers routing (softmax and grouped sigmoid), alignment, routing and alignment fused (3
tokens), repack (checkpoint conversion), the grouped GEMM with decode and prefill tiles,
activation, combine, LoRA and dequantize, each layer call twice (recorded, then replayed).
"""

import numpy as np
import torch

import numba_kernels  # noqa: F401
from moe import LoRAAdapter, LoRAHooks, MoEConfig, MoELayer, QuantScheme
from moe.reference import random_checkpoint
from numba_kernels.dequant import dequantize
from numba_kernels.routing import RoutingConfig, route


def main() -> None:
    config = MoEConfig(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128,
                       quant=QuantScheme("gptq", group_size=128))
    checkpoint = random_checkpoint(config, np.random.default_rng(0))
    layer = MoELayer(config, max_tokens=128)
    layer.load_weights(checkpoint.w1, checkpoint.w2, checkpoint.w3)
    generator = torch.Generator(device="cuda").manual_seed(0)
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
    torch.cuda.synchronize()
    print("all kernel families launched")


if __name__ == "__main__":
    main()
