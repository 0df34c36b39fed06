"""A float64 reference of the whole MoE layer, and random checkpoints to test it with.

`reference_moe` is the definition the kernels are checked against: route (or take the
given top-k), then for every token and each of its experts on this rank
W2_e @ act(W13_e @ x), weighted by the routing weight and summed. `random_checkpoint`
makes quantized expert weights in any checkpoint layout, scaled like trained layers
(weights with standard deviation about 1/sqrt(input features)), together with their exact
dequantized values.
"""

from __future__ import annotations

import attrs
import numpy as np

from layouts import E2M1, QuantSpec, Quantized
from layouts.samples import random_quantized
from numba_kernels.activation import reference_activate
from numba_kernels.routing import reference_route

from .config import MoEConfig


@attrs.frozen(eq=False)
class Checkpoint:
    """Random expert weights of a layer: stacked checkpoint tensors (numpy, engine names)
    and their dequantized float64 values (logical (E, N, K))."""

    w1: dict
    w2: dict
    w3: dict | None
    dense_w13: np.ndarray  # (E, 2I or I, H): [w1; w3]
    dense_w2: np.ndarray  # (E, H, I)


def random_logical(spec: QuantSpec, shape: tuple[int, int, int], rng: np.random.Generator) -> Quantized:
    """A random (E, N, K) weight for `spec` whose values have a standard deviation of about
    1 / sqrt(K), like a trained layer's."""
    q = random_quantized(spec, shape, rng)
    factor = (1.0 / np.sqrt(shape[-1])) / max(float(spec.dequantize_logical(q).std()), 1e-30)
    if isinstance(spec.code, E2M1):
        # NVFP4 divides by the global scale: scale it by a power of two (exact both ways).
        return attrs.evolve(q, global_scale=(q.global_scale / 2.0 ** np.round(np.log2(factor))).astype(np.float32))
    return Quantized(q.codes, q.scales * factor, q.zeros, q.g_idx, q.global_scale)


def _rows(q: Quantized, rows: slice) -> Quantized:
    """The output rows `rows` of every expert of `q` (per-expert global scale and g_idx kept)."""
    return Quantized(q.codes[:, rows], q.scales[:, rows], None if q.zeros is None else q.zeros[:, rows],
                     q.g_idx, q.global_scale)


def random_checkpoint(config: MoEConfig, rng: np.random.Generator) -> Checkpoint:
    """Random weights for the local experts of `config`, in its checkpoint layout. Gate and
    up come from one (E, 2I, H) weight, so they share per-expert tensors such as NVFP4's
    global scale, as checkpoint exporters quantize fused projections."""
    spec = config.quant.checkpoint_spec(config.dtype)
    experts, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
    q13 = random_logical(spec, (experts, config.gate_up_size, h), rng)
    q2 = random_logical(spec, (experts, h, i), rng)
    w1, w3 = spec.pack(_rows(q13, slice(0, i))), None
    if config.activation.gated:
        w3 = spec.pack(_rows(q13, slice(i, 2 * i)))
    return Checkpoint(w1, spec.pack(q2), w3, spec.dequantize_logical(q13), spec.dequantize_logical(q2))


def reference_moe(config: MoEConfig, hidden_states: np.ndarray, dense_w13: np.ndarray, dense_w2: np.ndarray, *,
                  router_logits: np.ndarray | None = None, topk=None, correction_bias=None,
                  lora_deltas=None) -> np.ndarray:
    """float64 (M, H) output of the layer for float hidden states.

    lora_deltas: optional (delta_w13, delta_w2) float64 (E, ...) per token, as a function
    (token) -> pair or None, added to the local experts' weights for that token."""
    x = np.asarray(hidden_states, np.float64)
    if topk is None:
        topk_weights, topk_ids = reference_route(router_logits, config.routing, correction_bias)
    else:
        topk_weights, topk_ids = (np.asarray(t) for t in topk)
    expert_map = None if config.expert_map is None else np.asarray(config.expert_map)
    out = np.zeros((x.shape[0], config.hidden_size))
    for token in range(x.shape[0]):
        deltas = lora_deltas(token) if lora_deltas is not None else None
        for slot in range(config.top_k):
            expert = int(topk_ids[token, slot])
            local = expert if expert_map is None else int(expert_map[expert])
            if local < 0:
                continue
            w13, w2 = dense_w13[local], dense_w2[local]
            if deltas is not None:
                w13, w2 = w13 + deltas[0][local], w2 + deltas[1][local]
            intermediate = reference_activate((w13 @ x[token])[None], config.activation)[0]
            out[token] += float(topk_weights[token, slot]) * (w2 @ intermediate)
    return out
