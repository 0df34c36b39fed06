"""Bad arguments to the MoE layer's public entry points raise a clear error naming the
argument, before anything is converted or launched: checkpoints whose expert count,
g_idx, stored shape or extra tensors disagree with the layer (each once loaded silently
wrong or crashed deep inside), arguments of the wrong kind, tensors that need gradients
or start mid-vector, and LoRA adapters that do not fit."""

import numpy as np
import pytest
import torch

from moe import (BatchedWorkspace, LoRAAdapter, LoRAHooks, MoEConfig, MoELayer, QuantScheme, Workspace, batched_moe,
                 fused_moe, process_weights_after_loading)
from moe.reference import random_checkpoint
from numba_kernels import interop

TINY = dict(num_experts=4, top_k=2, hidden_size=64, intermediate_size=64)
GPTQ = QuantScheme("gptq", group_size=32)
DEVICE = interop.kernel_device()


def _checkpoint(config, seed=0):
    return random_checkpoint(config, np.random.default_rng(seed))


def _expert(projection: dict, expert: int = 0) -> dict:
    return {name: value if np.ndim(value) == 1 else value[expert] for name, value in projection.items()}


@pytest.fixture(scope="module")
def layer():
    config = MoEConfig(**TINY, quant=GPTQ)
    layer = MoELayer(config, max_tokens=2)
    checkpoint = _checkpoint(config)
    layer.load_weights(checkpoint.w1, checkpoint.w2, checkpoint.w3)
    return layer


def _inputs(tokens=2):
    hidden = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(DEVICE)
    return hidden, torch.zeros(tokens, 4, device=DEVICE)


def test_stacked_checkpoints_must_hold_the_layers_local_experts():
    """A rank's layer given the whole model's experts once loaded the first of them into its
    local slots (wrong outputs); too few failed after converting some."""
    full = _checkpoint(MoEConfig(**TINY, quant=GPTQ))
    rank = MoELayer(MoEConfig(**TINY, quant=GPTQ, expert_map=[-1, 0, -1, 1]), max_tokens=1)
    with pytest.raises(ValueError, match=r"w1\['qweight'\] must hold the 2 local experts \(this rank's, in local "
                                         r"order: see expert_map\) along its first axis, got shape \(4, 8, 64\)"):
        rank.load_weights(full.w1, full.w2, full.w3)
    layer = MoELayer(MoEConfig(**TINY, quant=GPTQ), max_tokens=1)
    three = {name: value[:3] for name, value in full.w2.items()}
    with pytest.raises(ValueError, match=r"w2\['qweight'\] must hold the 4 local experts along its first axis"):
        layer.load_weights(full.w1, three, full.w3)
    with pytest.raises(ValueError, match=r"w3\['scales'\] must hold the 4 local experts .* got shape \(\)"):
        layer.load_weights(full.w1, full.w2, dict(full.w3, scales=5))
    assert not layer.weights.loaded.any()


def test_act_order_g_idx_must_be_group_indices_of_every_input_feature():
    config = MoEConfig(**TINY, quant=QuantScheme("gptq", group_size=32, act_order=True))
    checkpoint = _checkpoint(config)
    weights = MoELayer(config, max_tokens=1).weights
    w2 = _expert(checkpoint.w2)
    for g_idx, error, message in (
            (np.arange(64, dtype=np.int32) // 32 - 1, ValueError,
             r"g_idx must lie in \[0, 2\), got values from -1 to 0 \(the scale groups\)"),
            (np.zeros(63, np.int32), ValueError, r"g_idx must be shaped \(64,\) or \(1, 64\), got \(63,\)"),
            (np.zeros(64, np.float32), TypeError, "g_idx must be stored as torch.int32, got torch.float32")):
        with pytest.raises(error, match="expert 0, w1: .*" + message):
            weights.load_expert(0, dict(_expert(checkpoint.w1), g_idx=g_idx), w2, _expert(checkpoint.w3))


def test_tensors_the_format_does_not_read_must_say_nothing():
    """Symmetric GPTQ checkpoints carry constant qzeros, which are skipped; varying ones, a
    g_idx out of K order (an act-order checkpoint), a bias or a stored shape that is not
    the layer's are refused rather than dropped."""
    config = MoEConfig(**TINY, quant=GPTQ)
    checkpoint = _checkpoint(config)
    weights = MoELayer(config, max_tokens=1).weights
    w1, w2, w3 = (_expert(p) for p in (checkpoint.w1, checkpoint.w2, checkpoint.w3))
    weights.load_expert(0, dict(w1, qzeros=np.full((2, 8), 0x77777777, np.int32),
                                g_idx=np.arange(64, dtype=np.int32) // 32), w2, w3)
    assert weights.loaded[0]
    varying = np.arange(16, dtype=np.int32).reshape(2, 8)
    for extra, message in ((dict(qzeros=varying), r"qzeros varies, .* QuantScheme\(symmetric=False\)"),
                           (dict(g_idx=np.arange(64, dtype=np.int32)[::-1] // 32),
                            r"g_idx is not in K order: the checkpoint is act-order"),
                           (dict(bias=np.zeros(64, np.float16)), r"unexpected tensors \['bias'\]")):
        with pytest.raises(ValueError, match="expert 1, w2: " + message):
            weights.load_expert(1, w1, dict(w2, **extra), w3)
    in_k_order = dict(g_idx=np.arange(64, dtype=np.int32) // 32, g_idx_sort_indices=np.arange(64, dtype=np.int32))
    process_weights_after_loading(config, *(dict(p, **in_k_order) for p in (checkpoint.w1, checkpoint.w2,
                                                                             checkpoint.w3)))  # one (K,) for all
    ct = MoEConfig(**TINY, quant=QuantScheme("compressed_tensors", group_size=32))
    stored = _checkpoint(ct)
    with pytest.raises(ValueError, match=r"w2\['weight_shape'\] is \[4, 64, 32\], the layer expects \[4, 64, 64\]"):
        process_weights_after_loading(ct, stored.w1, dict(stored.w2, weight_shape=np.int64([4, 64, 32])), stored.w3)


def test_scales_that_their_format_cannot_hold_exactly_are_refused():
    config = MoEConfig(**TINY, quant=GPTQ)
    checkpoint = _checkpoint(config)
    w1 = dict(_expert(checkpoint.w1), scales=torch.full((2, 64), 0.1, dtype=torch.float32))
    with pytest.raises(ValueError, match="expert 0, w1: scales must be stored as torch.float16, and its torch.float32 "
                                         "values are not all exactly torch.float16 values"):
        MoELayer(config, max_tokens=1).weights.load_expert(0, w1, _expert(checkpoint.w2), _expert(checkpoint.w3))


def test_a_missing_nvfp4_global_scale_is_named():
    config = MoEConfig(**TINY, quant=QuantScheme("nvfp4"))
    checkpoint = _checkpoint(config)
    w1 = {name: value for name, value in checkpoint.w1.items() if name != "weight_global_scale"}
    with pytest.raises(KeyError, match="expert 0, w1: .*no 'weight_global_scale'"):
        process_weights_after_loading(config, w1, checkpoint.w2, checkpoint.w3)


def test_arguments_of_the_wrong_kind(layer):
    config, weights = layer.config, layer.weights
    hidden, logits = _inputs()
    with pytest.raises(TypeError, match="weights must be ExpertWeights .* got MoEConfig"):
        fused_moe(hidden, logits, config, weights)
    with pytest.raises(TypeError, match="workspace must be a Workspace, got BatchedWorkspace"):
        fused_moe(hidden, logits, weights, config, workspace=BatchedWorkspace(config, 1, weights.spec))
    with pytest.raises(TypeError, match="workspace must be a BatchedWorkspace, got Workspace"):
        batched_moe(torch.zeros(4, 1, 64, dtype=torch.bfloat16, device=DEVICE),
                    torch.ones(4, dtype=torch.int32, device=DEVICE), weights, config, workspace=layer.workspace)
    with pytest.raises(TypeError, match=r"spec must be a QuantSpec \(the weights' spec: weights.spec\), got NoneType"):
        Workspace(config, 4, None)
    with pytest.raises(TypeError, match="config must be a MoEConfig, got dict"):
        MoELayer(TINY)
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got 1.5"):
        MoELayer(config, max_tokens=1.5)
    with pytest.raises(ValueError, match="expected_tokens_per_expert must be an integer >= 1, got 0"):
        BatchedWorkspace(config, 2, weights.spec, expected_tokens_per_expert=0)
    checkpoint = _checkpoint(config)
    w1 = _expert(checkpoint.w1)
    with pytest.raises(TypeError, match=r"expert must be an int \(a local expert index\), got 1.0"):
        weights.load_expert(1.0, w1, w1, w1)
    with pytest.raises(TypeError, match=r"experts must yield \(expert, w1, w2, w3\) tuples .* got tuple of 2"):
        weights.load([(0, w1)])
    with pytest.raises(TypeError, match="w1 is required"):
        process_weights_after_loading(config, None, checkpoint.w2, checkpoint.w3)


def test_bad_configurations_fail_when_built():
    with pytest.raises(TypeError, match=r"quant must be a QuantScheme, .* got 'gptq'"):
        MoEConfig(**TINY, quant="gptq")
    with pytest.raises(TypeError, match=r"expert_map must be a sequence of ints .* got \[0.5, 1, -1, -1\]"):
        MoEConfig(**TINY, expert_map=[0.5, 1, -1, -1])
    with pytest.raises(TypeError, match="expert_map must be a sequence of ints, got the string '0123'"):
        MoEConfig(**TINY, expert_map="0123")
    with pytest.raises(ValueError, match="expert_map must keep at least one expert on this rank"):
        MoEConfig(**TINY, expert_map=[-1] * 4)
    with pytest.raises(ValueError, match="the number of experts must be <= 1024, got 2000"):
        MoEConfig(**dict(TINY, num_experts=2000))
    assert MoEConfig(**TINY, expert_map=np.array([0, -1, 1, -1])).expert_map == (0, -1, 1, -1)


def test_inputs_that_need_gradients_or_start_mid_vector(layer):
    """The kernels cannot carry autograd (the output would silently have none), and prefill
    tiles copy the hidden states in 16-byte vectors (a view 2 bytes into a tensor once
    failed inside a torch view; 4 bytes in would fault on the GPU)."""
    hidden, logits = _inputs()
    with pytest.raises(ValueError, match=r"hidden_states requires grad, .* pass hidden_states.detach\(\)"):
        layer(hidden.float().requires_grad_().to(torch.bfloat16), logits)
    with pytest.raises(ValueError, match="router_logits requires grad"):
        layer(hidden, logits.clone().requires_grad_())
    shifted = torch.zeros(2 * 64 + 2, dtype=torch.bfloat16, device=DEVICE)[2:].view(2, 64)
    with pytest.raises(ValueError, match="hidden_states must start at a 16-byte aligned address, got one 4 bytes past"):
        layer(shifted, logits)


def _adapter(config, rank=4, **changes):
    e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
    tensors = dict(gate_up_a=torch.zeros(e, rank, h), gate_up_b=torch.zeros(e, 2 * i, rank),
                   down_a=torch.zeros(e, rank, i), down_b=torch.zeros(e, h, rank))
    return LoRAAdapter(**{**tensors, **changes})


def test_lora_adapters_and_hooks_that_do_not_fit(layer):
    config = layer.config
    with pytest.raises(ValueError, match=r"gate_up_b must hold the rank \(4, gate_up_a's second axis\) along axis 2, "
                                         r"got shape \(4, 128, 6\)"):
        _adapter(config, gate_up_b=torch.zeros(4, 128, 6))
    with pytest.raises(TypeError, match="down_a must be a 3-D torch tensor .* got ndarray"):
        _adapter(config, down_a=np.zeros((4, 4, 64)))
    with pytest.raises(TypeError, match="scaling must be a number"):
        _adapter(config, scaling="2")
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got -1"):
        LoRAHooks(config, [_adapter(config)], max_tokens=-1)
    with pytest.raises(TypeError, match="adapter 1 must be a LoRAAdapter, got NoneType"):
        LoRAHooks(config, [_adapter(config), None], max_tokens=2)
    hidden, logits = _inputs()
    other = MoEConfig(**dict(TINY, intermediate_size=32), quant=GPTQ)
    hooks = LoRAHooks(other, [_adapter(other)], max_tokens=2)
    hooks.set_token_adapters(torch.zeros(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="the LoRA hooks were built for another MoEConfig"):
        fused_moe(hidden, logits, layer.weights, config, workspace=layer.workspace, lora=hooks)
    with pytest.raises(TypeError, match=r"hooks \(fused_moe's lora\) must be MoEHooks, .* got LoRAAdapter"):
        fused_moe(hidden, logits, layer.weights, config, workspace=layer.workspace, lora=_adapter(config))
