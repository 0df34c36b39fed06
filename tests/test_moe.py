"""The MoE runner: the layer equals its float64 definition for every checkpoint format, the
function and the module share one path, LoRA hooks add B @ A per expert and adapter,
expert-parallel ranks sum to the full layer, weights reload in place, bad inputs fail
before any kernel runs, and the main job needs no test extra."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from fusing import evolve_every_tile
from ranks import rank_layers

from layouts import formats
from moe import (LoRAAdapter, LoRAHooks, MoEConfig, MoELayer, QuantScheme, Workspace, WorkspaceTooSmall, fused_moe,
                 process_weights_after_loading)
from moe.oracle import Backend
from moe.reference import random_checkpoint, reference_moe
from numba_kernels import interop
from numba_kernels.gemm import GemmTile

TINY = dict(num_experts=4, top_k=2, hidden_size=64, intermediate_size=64)
DEVICE = interop.kernel_device()


def _inputs(config, tokens, seed=0):
    rng = np.random.default_rng(seed)
    hidden = torch.from_numpy(rng.standard_normal((tokens, config.hidden_size))).to(torch.bfloat16)
    logits = torch.from_numpy(rng.standard_normal((tokens, config.num_experts)).astype(np.float32))
    return hidden, logits


def _relative_error(got, expected):
    got = got.float().cpu().numpy() if isinstance(got, torch.Tensor) else got
    assert not np.isnan(got).any()
    return np.linalg.norm(got - expected) / np.linalg.norm(expected)


def _layer(config, seed=0, max_tokens=4):
    checkpoint = random_checkpoint(config, np.random.default_rng(seed))
    layer = MoELayer(config, max_tokens=max_tokens)
    layer.load_weights(checkpoint.w1, checkpoint.w2, checkpoint.w3)
    return layer, checkpoint


@pytest.mark.parametrize("quant", [
    QuantScheme("gptq", bits=4, group_size=32), QuantScheme("awq", bits=4, group_size=64),
    QuantScheme("compressed_tensors", bits=8, group_size=None), QuantScheme("nvfp4", nvfp4_checkpoint="modelopt"),
    QuantScheme("gptq", bits=4, group_size=32, act_order=True),  # g_idx shared by the experts, (K,)
    QuantScheme("marlin", bits=4, group_size=32, act_order=True),  # and the K sort indices
], ids=lambda q: q.format + ("_act_order" if q.act_order else ""))
def test_layer_matches_the_float_reference_for_each_checkpoint_format(quant):
    config = MoEConfig(**TINY, quant=quant)
    layer, checkpoint = _layer(config)
    hidden, logits = _inputs(config, 3)
    out = layer(hidden.to(DEVICE), logits.to(DEVICE))
    expected = reference_moe(config, hidden.float().numpy(), checkpoint.dense_w13, checkpoint.dense_w2,
                             router_logits=logits.numpy())
    assert _relative_error(out, expected) < 2e-2


def test_function_and_layer_run_the_same_sequence():
    config = MoEConfig(**TINY, quant=QuantScheme("gptq", group_size=32))
    layer, checkpoint = _layer(config)
    hidden, logits = _inputs(config, 2, seed=1)
    from_layer = layer(hidden.to(DEVICE), logits.to(DEVICE)).clone()
    weights = process_weights_after_loading(config, checkpoint.w1, checkpoint.w2, checkpoint.w3)
    from_function = fused_moe(hidden.to(DEVICE), logits.to(DEVICE), weights, config)
    torch.testing.assert_close(from_function, from_layer, rtol=0, atol=0)


def test_precomputed_top_k_replaces_the_logits():
    config = MoEConfig(**TINY, scoring="sigmoid", renormalize=True, quant=QuantScheme("gptq", group_size=32))
    layer, checkpoint = _layer(config)
    hidden, _ = _inputs(config, 3, seed=2)
    topk_ids = torch.tensor([[0, 3], [2, 1], [3, 3]], dtype=torch.int32)
    topk_weights = torch.tensor([[0.7, 0.3], [0.5, 0.5], [1.0, 0.25]])
    out = layer(hidden.to(DEVICE), topk=(topk_weights.to(DEVICE), topk_ids.to(DEVICE)))
    expected = reference_moe(config, hidden.float().numpy(), checkpoint.dense_w13, checkpoint.dense_w2,
                             topk=(topk_weights.numpy(), topk_ids.numpy()))
    assert _relative_error(out, expected) < 2e-2


def test_lora_hooks_add_each_tokens_adapter():
    config = MoEConfig(**TINY, quant=QuantScheme("awq", group_size=32))
    layer, checkpoint = _layer(config)
    rng = np.random.default_rng(5)
    experts, h, i = config.num_experts, config.hidden_size, config.intermediate_size

    def adapter(rank, scaling):
        tensors = [rng.standard_normal(shape) * 0.1 for shape in
                   ((experts, rank, h), (experts, 2 * i, rank), (experts, rank, i), (experts, h, rank))]
        return LoRAAdapter(*(torch.from_numpy(t).to(torch.bfloat16).to(DEVICE) for t in tensors), scaling=scaling)

    adapters = [adapter(4, 0.5), adapter(2, 2.0)]
    hooks = LoRAHooks(config, adapters, max_tokens=4)
    token_adapter = torch.tensor([1, -1, 0], dtype=torch.int32)
    hooks.set_token_adapters(token_adapter.to(DEVICE))
    layer.hooks = hooks
    hidden, logits = _inputs(config, 3, seed=3)
    out = layer(hidden.to(DEVICE), logits.to(DEVICE))

    def deltas(token):
        index = int(token_adapter[token])
        if index < 0:
            return None
        a = adapters[index]
        b13, a13, b2, a2 = (t.float().cpu().numpy().astype(np.float64) for t in
                            (a.gate_up_b, a.gate_up_a, a.down_b, a.down_a))
        return a.scaling * b13 @ a13, a.scaling * b2 @ a2

    expected = reference_moe(config, hidden.float().numpy(), checkpoint.dense_w13, checkpoint.dense_w2,
                             router_logits=logits.numpy(), lora_deltas=deltas)
    assert _relative_error(out, expected) < 2e-2
    for bad in ([2, -1, 0], [0, -2, 1]):  # past the two adapters; below "none"
        with pytest.raises(ValueError, match=r"token_adapter must lie in \[-1, 2\)"):
            hooks.set_token_adapters(torch.tensor(bad, dtype=torch.int32).to(DEVICE))


def test_expert_parallel_ranks_sum_to_the_full_layer():
    base = dict(TINY, quant=QuantScheme("gptq", group_size=32))
    full_config = MoEConfig(**base)
    checkpoint = random_checkpoint(full_config, np.random.default_rng(7))
    hidden, logits = _inputs(full_config, 3, seed=4)
    total = np.zeros((3, full_config.hidden_size))
    for layer in rank_layers(full_config, checkpoint, 2, max_tokens=4):
        total += layer(hidden.to(DEVICE), logits.to(DEVICE)).float().cpu().numpy()
    expected = reference_moe(full_config, hidden.float().numpy(), checkpoint.dense_w13, checkpoint.dense_w2,
                             router_logits=logits.numpy())
    assert _relative_error(total, expected) < 2e-2


def test_reloading_weights_converts_into_the_same_buffers():
    config = MoEConfig(**TINY, quant=QuantScheme("compressed_tensors", group_size=32))
    layer, _ = _layer(config, seed=0)
    buffers = [t.data_ptr() for t in layer.weights.w13.tensors + layer.weights.w2.tensors]
    second = random_checkpoint(config, np.random.default_rng(11))
    layer.load_weights(second.w1, second.w2, second.w3)
    assert [t.data_ptr() for t in layer.weights.w13.tensors + layer.weights.w2.tensors] == buffers
    hidden, logits = _inputs(config, 2, seed=5)
    expected = reference_moe(config, hidden.float().numpy(), second.dense_w13, second.dense_w2,
                             router_logits=logits.numpy())
    assert _relative_error(layer(hidden.to(DEVICE), logits.to(DEVICE)), expected) < 2e-2


def test_act_order_layer_runs_prefill_tiles_on_permuted_inputs(monkeypatch):
    """Act-order weights are read as plain tiles of the column-permuted weight, with each
    slot's inputs permuted first, so the shared-memory prefill tiles take them too."""
    config = MoEConfig(**TINY, quant=QuantScheme("gptq", bits=4, group_size=32, act_order=True))
    tile = GemmTile(block_m=32, warps_n=2, warps_k=1, slabs_per_warp=2, a_in_shared=True)
    evolve_every_tile(monkeypatch, lambda config, tokens, spec: Backend(32, tile, tile))  # runner and workspace
    layer, checkpoint = _layer(config, max_tokens=6)
    assert layer.weights.permutes_inputs and layer.weights.spec == formats.native(4, 32)
    assert Workspace(config, 6, layer.weights.stored_spec).spec == layer.weights.spec  # sized for what the GEMMs read
    hidden, logits = _inputs(config, 6, seed=6)
    out = layer(hidden.to(DEVICE), logits.to(DEVICE))
    expected = reference_moe(config, hidden.float().numpy(), checkpoint.dense_w13, checkpoint.dense_w2,
                             router_logits=logits.numpy())
    assert _relative_error(out, expected) < 2e-2


def test_act_order_groups_must_each_hold_group_size_features():
    config = MoEConfig(**TINY, quant=QuantScheme("gptq", bits=4, group_size=32, act_order=True))
    layer, checkpoint = _layer(config)
    uneven = dict(checkpoint.w2, g_idx=np.repeat(np.int32([0, 1]), [40, 24]))
    with pytest.raises(ValueError, match=r"expert 0: the act-order groups of w2 must hold group_size = 32 input "
                                         r"features each .* groups of \[40, 24\]"):
        layer.load_weights(checkpoint.w1, uneven, checkpoint.w3)
    assert not layer.weights.loaded[0]  # half converted: refused until loaded again
    hidden, logits = _inputs(config, 1)
    with pytest.raises(RuntimeError, match=r"experts \[0\] have no weights"):
        layer(hidden.to(DEVICE), logits.to(DEVICE))


@pytest.fixture(scope="module")
def small_layer():
    return _layer(MoEConfig(**TINY, quant=QuantScheme("gptq", group_size=32)), max_tokens=2)[0]


@pytest.mark.parametrize("hidden, logits, topk, error, message", [
    (torch.zeros(2, 64), torch.zeros(2, 4), None, TypeError, "hidden_states must be a torch.bfloat16"),
    (torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(2, 4), None, ValueError, r"hidden_states must be \(M, 64\)"),
    (torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, 5), None, ValueError, "router_logits must have shape"),
    (torch.zeros(2, 64, dtype=torch.bfloat16), None, (torch.ones(2, 2), torch.full((2, 2), 4, dtype=torch.int32)),
     ValueError, r"topk_ids must lie in \[0, 4\)"),
    (torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, 4), (torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.int32)),
     ValueError, "exactly one of"),
    (torch.zeros(3, 64, dtype=torch.bfloat16), torch.zeros(3, 4), None, WorkspaceTooSmall, "holds 2 tokens"),
])
def test_bad_inputs_fail_before_any_kernel(small_layer, hidden, logits, topk, error, message):
    move = (lambda t: t.to(DEVICE)) if DEVICE.type == "cuda" else (lambda t: t)
    with pytest.raises(error, match=message):
        small_layer(move(hidden), None if logits is None else move(logits),
                    topk=None if topk is None else tuple(move(t) for t in topk))


def test_bad_configurations_are_rejected():
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(num_experts=4, top_k=5, hidden_size=64, intermediate_size=64)
    with pytest.raises(ValueError, match="expert_map"):
        MoEConfig(**TINY, expert_map=[0, 0, -1, -1])
    with pytest.raises(ValueError, match="format"):
        QuantScheme("exl2")
    with pytest.raises(ValueError, match=r"group_size must be a positive int or None \(channel-wise\), got 0"):
        QuantScheme("gptq", group_size=0)
    with pytest.raises(ValueError, match="nvfp4_checkpoint must be one of"):
        QuantScheme("nvfp4", nvfp4_checkpoint="gguf")
    with pytest.raises(ValueError, match=r"^dtype must be one of \('bfloat16', 'float16'\), got 'float32'$"):
        MoEConfig(**TINY, dtype="float32")
    with pytest.raises(ValueError, match=r"^name must be one of \(.*'silu'.*\), got 'tanhx'$"):
        MoEConfig(**TINY, activation="tanhx")


def test_unloaded_experts_are_reported():
    config = MoEConfig(**TINY, quant=QuantScheme("gptq", group_size=32))
    layer = MoELayer(config, max_tokens=2)
    hidden, logits = _inputs(config, 1)
    with pytest.raises(RuntimeError, match="have no weights"):
        layer(hidden.to(DEVICE), logits.to(DEVICE))


def test_weights_must_come_as_named_tensors():
    """A bare tensor (a dense weight, or the packed codes alone) is refused with the names
    the checkpoint format expects, by both ways of loading, before anything is converted."""
    config = MoEConfig(**TINY, quant=QuantScheme("gptq", group_size=32))
    layer = MoELayer(config, max_tokens=2)
    checkpoint = random_checkpoint(config, np.random.default_rng(0))
    dense = torch.zeros(4, 64, 64)
    with pytest.raises(TypeError, match=r"w2 must map the checkpoint's tensor names .*'qweight', 'scales'.*got Tensor"):
        layer.load_weights(checkpoint.w1, dense, checkpoint.w3)
    one = {name: value[0] for name, value in checkpoint.w1.items()}
    with pytest.raises(TypeError, match="w3 must map the checkpoint's tensor names"):
        layer.load_weights(experts=[(0, one, one, dense[0])])
    assert not layer.weights.loaded.any()


def test_workspace_grows_only_when_asked():
    config = MoEConfig(**TINY, quant=QuantScheme("gptq", group_size=32))
    workspace = Workspace(config, 2, config.quant.native_spec())
    before = workspace.nbytes
    workspace.grow(64)
    assert workspace.max_tokens == 64 and workspace.nbytes > before
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got -3"):
        workspace.grow(-3)


def test_random_kernel_layout_weights_give_finite_outputs():
    config = MoEConfig(**TINY, quant=QuantScheme("native", bits=4, group_size=32))
    layer = MoELayer(config, max_tokens=2)
    layer.weights.fill_random(seed=3)
    hidden, logits = _inputs(config, 2)
    out = layer(hidden.to(DEVICE), logits.to(DEVICE))
    assert torch.isfinite(out.float()).all() and out.float().abs().max() > 0


def test_the_main_job_needs_no_test_extra():
    """`python -m moe` is the README's first command, run before the test extras are
    installed: nothing it imports may need Hypothesis (the reference checkpoints once did,
    through `layouts.strategies`; CI's machine had Hypothesis installed and ran it anyway)."""
    imports = "import sys; sys.modules['hypothesis'] = None; import layouts, numba_kernels, moe, moe.__main__"
    result = subprocess.run([sys.executable, "-c", imports], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_nvfp4_scales_load_from_torch_float8_tensors():
    """Checkpoints hold NVFP4 block scales as torch.float8_e4m3fn tensors (numpy has no
    float8): they are read as their bytes, into the same kernel buffers as uint8 ones."""
    config = MoEConfig(**TINY, quant=QuantScheme("nvfp4"))
    checkpoint = random_checkpoint(config, np.random.default_rng(0))

    def in_torch(projection):
        return {name: torch.as_tensor(value).view(torch.float8_e4m3fn) if name == "weight_scale" else
                torch.as_tensor(value) for name, value in projection.items()}

    as_bytes = process_weights_after_loading(config, checkpoint.w1, checkpoint.w2, checkpoint.w3)
    as_float8 = process_weights_after_loading(config, *(in_torch(p) for p in (checkpoint.w1, checkpoint.w2,
                                                                                checkpoint.w3)))
    for ours, theirs in ((as_float8.w13, as_bytes.w13), (as_float8.w2, as_bytes.w2)):
        assert all(torch.equal(a, b) for a, b in zip(ours.tensors, theirs.tensors))


def test_scales_in_the_models_dtype_load_when_every_value_survives():
    """An engine keeps a checkpoint's float16 scales in the model's dtype (bfloat16): they
    are converted back where every value is exact (the error case: test_moe_errors)."""
    config = MoEConfig(**TINY, quant=QuantScheme("compressed_tensors", group_size=32))
    checkpoint = random_checkpoint(config, np.random.default_rng(0))

    def in_bfloat16(projection):
        return {name: torch.as_tensor(value).to(torch.bfloat16) if name == "weight_scale" else value
                for name, value in projection.items()}

    stored = process_weights_after_loading(config, checkpoint.w1, checkpoint.w2, checkpoint.w3)
    converted = process_weights_after_loading(config, *(in_bfloat16(p) for p in (checkpoint.w1, checkpoint.w2,
                                                                                  checkpoint.w3)))
    assert all(torch.equal(a, b) for a, b in zip(converted.w13.tensors, stored.w13.tensors))
