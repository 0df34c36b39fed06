"""`python -m moe`: run a Qwen3-30B-A3B-shaped MoE layer from a quantized checkpoint.

Builds the layer (E=128 experts, top-8, hidden 2048, intermediate 768; a tiny layer with
the same structure under the CUDA simulator, which says so), loads random weights of the
chosen checkpoint format (GPTQ int4 group 128 by default) through the checkpoint path
(converted on the device into the kernel layout), runs it, and checks the error against
the float64 reference; on a GPU it also prints the time per forward and the weight
bandwidth it achieved (the simulator's timings mean nothing).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from numba_kernels import interop
from numba_kernels.ptx import SIMULATED
from numba_kernels.routing import reference_route

from . import MoEConfig, MoELayer, QuantScheme
from .oracle import tuned_entries
from .reference import random_checkpoint, reference_moe

QWEN3 = dict(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768)
TINY = dict(num_experts=8, top_k=2, hidden_size=64, intermediate_size=64)
TOLERANCE = 2e-2  # relative error a bfloat16 forward stays under (8 significant bits in activations and outputs)


def touched_weight_bytes(layer: MoELayer, topk_ids: np.ndarray) -> int:
    """Bytes of the weights of the experts the batch routes to (what a forward must read)."""
    touched = np.unique(topk_ids).size
    per_expert = (layer.weights.w13.nbytes() + layer.weights.w2.nbytes()) / layer.config.num_local_experts
    return int(touched * per_expert)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moe", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    parser.add_argument("--tokens", type=int, default=4 if SIMULATED else 16,
                        help="tokens in the batch (default: %(default)s)")
    parser.add_argument("--format", default="gptq", choices=["gptq", "awq", "compressed_tensors", "nvfp4"],
                        help="checkpoint format the random weights are stored in (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=1 if SIMULATED else 50,
                        help="forwards timed after the first (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.repeats < 1:
        parser.error("--tokens and --repeats must be positive")

    shapes = TINY if SIMULATED else QWEN3
    where = "the CUDA simulator (no GPU found): a tiny layer of the same structure" if SIMULATED else \
        torch.cuda.get_device_name()
    print(f"numba-moe main job on {where}")
    config = MoEConfig(**shapes, quant=QuantScheme(args.format, bits=4, group_size=16 if args.format == "nvfp4" else 128))
    print(f"layer: {shapes}, checkpoint {config.quant.checkpoint_spec().name}, "
          f"kernel layout {config.quant.native_spec().name}")

    rng = np.random.default_rng(0)
    checkpoint = random_checkpoint(config, rng)
    layer = MoELayer(config, max_tokens=args.tokens)
    tuned_on = tuned_entries(config, layer.weights.spec)[0]
    untuned = "tuned tables are measured on GPUs" if SIMULATED else \
        "no tuned table for this shape on this GPU's architecture: `python -m moe.tune` writes one"
    print(f"tiles: tuned on {tuned_on}" if tuned_on else f"tiles: the oracle's heuristic ({untuned})")
    print("converting the checkpoint to the kernel layout ...", flush=True)
    start = time.perf_counter()
    layer.load_weights(checkpoint.w1, checkpoint.w2, checkpoint.w3)
    print(f"weights converted to the kernel layout in {time.perf_counter() - start:.2f} s")
    print(f"first forward of {args.tokens} tokens (it records the kernel launches) ...", flush=True)

    device = interop.kernel_device()
    hidden = torch.from_numpy(rng.standard_normal((args.tokens, config.hidden_size))).to(torch.bfloat16)
    logits = torch.from_numpy(rng.standard_normal((args.tokens, config.num_experts)).astype(np.float32))
    output = layer(hidden.to(device), logits.to(device)).float().cpu().numpy()
    expected = reference_moe(config, hidden.float().numpy(), checkpoint.dense_w13, checkpoint.dense_w2,
                             router_logits=logits.numpy())
    error = np.linalg.norm(output - expected) / np.linalg.norm(expected)
    print(f"relative error against the float64 reference: {error:.2e}")

    hidden, logits = hidden.to(device), logits.to(device)
    if not SIMULATED:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.repeats):  # the first call recorded the launches: these replay them
        replayed = layer(hidden, logits)
    if not SIMULATED:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.repeats
    if SIMULATED:
        print(f"a replayed forward ran in the simulator (its time, {seconds:.1f} s, says nothing about a GPU)")
    else:
        weight_bytes = touched_weight_bytes(layer, reference_route(logits.cpu().numpy(), config.routing)[1])
        print(f"time per forward ({args.tokens} tokens, eager, launches replayed): {seconds * 1e3:.3f} ms; "
              f"weights read {weight_bytes / 1e6:.3f} MB -> {weight_bytes / seconds / 1e9:.3f} GB/s")
    replay_error = np.linalg.norm(replayed.float().cpu().numpy() - expected) / np.linalg.norm(expected)
    print(f"relative error of a replayed forward: {replay_error:.2e}")
    worst = max(error, replay_error)
    if worst > TOLERANCE:
        raise SystemExit(f"FAILED: error {worst:.2e} is above the bfloat16 tolerance {TOLERANCE:g}")
    print(f"OK: both errors are below the bfloat16 tolerance {TOLERANCE:g}")


if __name__ == "__main__":
    main()
