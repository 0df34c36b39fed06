"""Bad arguments to the kernel-level functions raise a clear error naming the argument
before a launch: arguments of the wrong kind or size (once AttributeError or
ZeroDivisionError inside), act-order indices and alignment, LoRA and permutation ids a
kernel would read or write out of bounds with, expert maps the routing kernel trusted,
outputs sharing memory (once silently wrong results), and tile options of the wrong type
(a truthy string picked another kernel)."""

import numpy as np
import pytest
import torch

from layouts import formats
from layouts.samples import random_quantized
from numba_kernels import interop
from numba_kernels.activation import Activation
from numba_kernels.align import moe_align_block_size
from numba_kernels.batched_align import batched_align
from numba_kernels.gemm import GemmTile, grouped_gemm
from numba_kernels.lora import add_lora
from numba_kernels.permute import permute_slots
from numba_kernels.repack import repack
from numba_kernels.route_align import route_and_align
from numba_kernels.routing import RoutingConfig, route
from numba_kernels.weights import KernelWeights

DEVICE = interop.kernel_device()


def _ints(*shape):
    return torch.zeros(shape, dtype=torch.int32, device=DEVICE)


def _problem():
    spec, shape = formats.native(4, 32), (2, 64, 64)
    weights = KernelWeights.from_physical(spec, spec.pack(random_quantized(spec, shape, np.random.default_rng(0))),
                                          shape)
    alignment = moe_align_block_size(torch.tensor([[0], [1]], dtype=torch.int32, device=DEVICE), 16, 2)
    return torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE), weights, alignment


def test_grouped_gemm_arguments():
    act, weights, alignment = _problem()
    for kwargs, error, message in (
            (dict(weights=torch.zeros(2, 64, 64)), TypeError, r"weights must be KernelWeights .* got Tensor"),
            (dict(tile=None), TypeError, "tile must be a GemmTile, got NoneType"),
            (dict(act=act[:0]), ValueError, "act holds no rows"),
            (dict(num_slots=2.0), ValueError, "num_slots must be an integer >= 1, got 2.0"),
            (dict(act=torch.zeros(2 * 64 + 1, dtype=torch.bfloat16, device=DEVICE)[1:].view(2, 64)), ValueError,
             "act must start at a 4-byte aligned address, got one 2 bytes past it")):
        arguments = dict(act=act, weights=weights, num_slots=2, tile=GemmTile(block_m=16)) | kwargs
        with pytest.raises(error, match=message):
            grouped_gemm(arguments.pop("act"), arguments.pop("weights"), *alignment, **arguments)


def test_alignment_ids_are_checked_before_the_gemm_indexes_memory_with_them():
    """Ids of the blocks in use must name real experts (or -1) and slots >= 0; entries past
    num_tokens_post_padded (a workspace's stale ones) are never read, so never refused."""
    act, weights, (sorted_ids, expert_ids, num_post) = _problem()
    used = int(num_post[0])
    expected = grouped_gemm(act, weights, sorted_ids, expert_ids, num_post, num_slots=2, tile=GemmTile(block_m=16))
    for name, index, value, message in (
            ("expert", 0, 2, r"expert_ids \(the blocks in use\) must lie in \[-1, 2\), got values from 1 to 2"),
            ("expert", 1, -2, r"expert_ids \(the blocks in use\) must lie in \[-1, 2\), got values from -2 to 0"),
            ("slot", 0, -5, r"sorted_token_ids \(the blocks in use\) must be >= 0, got values from -5 to")):
        bad_sorted, bad_experts = sorted_ids.clone(), expert_ids.clone()
        (bad_experts if name == "expert" else bad_sorted)[index] = value
        with pytest.raises(ValueError, match=message):
            grouped_gemm(act, weights, bad_sorted, bad_experts, num_post, num_slots=2, tile=GemmTile(block_m=16))
    stale_sorted = torch.cat([sorted_ids[:used], torch.full((16,), -7, dtype=torch.int32, device=DEVICE)])
    stale_experts = torch.cat([expert_ids[:used // 16], torch.full((1,), 99, dtype=torch.int32, device=DEVICE)])
    out = grouped_gemm(act, weights, stale_sorted, stale_experts, num_post, num_slots=2, tile=GemmTile(block_m=16))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_permute_checks_the_order_and_the_alignment_it_indexes_with():
    act, _, (sorted_ids, expert_ids, num_post) = _problem()
    order = torch.arange(64, dtype=torch.int32, device=DEVICE).repeat(2, 1)
    bad_order = order.clone()
    bad_order[1, 5] = 64
    with pytest.raises(ValueError, match=r"order must lie in \[0, 64\), got values from 0 to 64"):
        permute_slots(act, bad_order, sorted_ids, expert_ids, num_post, num_slots=2, block_m=16)
    bad_experts = expert_ids.clone()
    bad_experts[0] = 2
    with pytest.raises(ValueError, match=r"expert_ids \(the blocks in use\) must lie in \[-1, 2\)"):
        permute_slots(act, order, sorted_ids, bad_experts, num_post, num_slots=2, block_m=16)
    permute_slots(act, order[:1], sorted_ids, bad_experts, num_post, num_slots=2, block_m=16)  # one order for all
    bad_sorted = sorted_ids.clone()
    bad_sorted[0] = -1
    with pytest.raises(ValueError, match=r"sorted_token_ids \(the blocks in use\) must be >= 0"):
        permute_slots(act, order, bad_sorted, expert_ids, num_post, num_slots=2, block_m=16)


def test_lora_ids_are_checked_before_the_kernel_indexes_memory_with_them():
    act = torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE)
    lora_a = torch.zeros(1, 2, 4, 64, dtype=torch.bfloat16, device=DEVICE)
    lora_b = torch.zeros(1, 2, 64, 4, dtype=torch.bfloat16, device=DEVICE)
    out = torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE)

    def call(topk_ids, token_adapter, expert_map=None):
        add_lora(act, topk_ids, lora_a, lora_b, torch.ones(1, device=DEVICE), token_adapter, out,
                 expert_map=expert_map, rows_div=1)

    ids, adapters = _ints(2, 1), _ints(2)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 2\), got values from 0 to 2"):
        call(torch.tensor([[0], [2]], dtype=torch.int32, device=DEVICE), adapters)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 4\), got values from 0 to 4"):
        call(torch.tensor([[0], [4]], dtype=torch.int32, device=DEVICE), adapters, expert_map=_ints(4))
    with pytest.raises(ValueError, match=r"token_adapter must lie in \[-1, 1\), got values from -2 to 0"):
        call(ids, torch.tensor([0, -2], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"expert_map must lie in \[-1, 2\), got values from -1 to 3"):
        call(ids, adapters, expert_map=torch.tensor([0, 3, -1], dtype=torch.int32, device=DEVICE))


def test_act_order_indices_are_checked_before_a_kernel_indexes_memory_with_them():
    spec, shape = formats.marlin(4, 32, act_order=True), (1, 64, 64)
    q = random_quantized(spec, shape, np.random.default_rng(0))
    physical = spec.pack(q)
    with pytest.raises(ValueError, match=r"marlin_int4: g_idx must lie in \[0, 2\), got values "
                                         r"from 50 to 50"):
        KernelWeights.from_physical(spec, {**physical, "g_idx": np.full_like(physical["g_idx"], 50)}, shape)
    repeated = physical["g_idx_sort_indices"].copy()
    repeated[..., 1] = repeated[..., 0]
    with pytest.raises(ValueError, match="g_idx_sort_indices must order the 64 input features"):
        KernelWeights.from_physical(spec, {**physical, "g_idx_sort_indices": repeated}, shape)
    with pytest.raises(ValueError, match=r"g_idx must be shaped \(64,\) or \(1, 64\), got \(10,\)"):
        KernelWeights.from_physical(spec, {**physical, "g_idx": np.zeros(10, np.int32)}, shape)
    with pytest.raises(TypeError, match="spec must be a QuantSpec .* got str"):
        KernelWeights.from_physical("gptq", physical, shape)


def test_permute_and_lora_counts():
    act, weights, alignment = _problem()
    order = _ints(1, 64)
    with pytest.raises(ValueError, match="act holds no rows"):
        permute_slots(act[:0], order, *alignment, num_slots=2, block_m=16)
    for block_m in (0, None):
        with pytest.raises(ValueError, match=f"block_m must be an integer >= 1, got {block_m}"):
            permute_slots(act, order, *alignment, num_slots=2, block_m=block_m)
    lora_a, lora_b = torch.zeros(1, 2, 4, 64, dtype=torch.bfloat16), torch.zeros(1, 2, 64, 4, dtype=torch.bfloat16)
    lora = (act, _ints(2, 1), lora_a.to(DEVICE), lora_b.to(DEVICE), torch.ones(1, device=DEVICE), _ints(2))
    with pytest.raises(ValueError, match="rows_div must be an integer >= 1, got 0"):
        add_lora(*lora, torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE), rows_div=0)
    with pytest.raises(TypeError, match="out must be a torch tensor .* got NoneType"):
        add_lora(*lora, None, rows_div=1)


def test_route_and_align_checks_the_expert_map():
    logits = torch.zeros(2, 4, device=DEVICE)
    with pytest.raises(ValueError, match=r"expert_map must lie in \[-1, 4\), got values from 9 to 9 \(local ids"):
        route_and_align(logits, RoutingConfig(top_k=2), 16, expert_map=torch.full((4,), 9, dtype=torch.int32,
                                                                                  device=DEVICE))


def test_outputs_that_share_memory_are_refused():
    buffer = _ints(64)
    with pytest.raises(ValueError, match=r"out\[0\] \(sorted_token_ids\) and out\[1\] \(expert_ids\) share memory"):
        moe_align_block_size(_ints(2, 2), 16, 4, out=(buffer, buffer, buffer))
    with pytest.raises(ValueError, match="share memory"):
        batched_align(_ints(2), 4, 16, out=(buffer, buffer[8:], buffer[16:]))
    weights = torch.zeros(2, 2, device=DEVICE)
    with pytest.raises(ValueError, match=r"out\[0\] \(topk_weights\) and out\[1\] \(topk_ids\) share memory"):
        route(torch.zeros(2, 4, device=DEVICE), RoutingConfig(top_k=2), out=(weights, weights.view(torch.int32)))
    _, kernel_weights, _ = _problem()
    in_place = dict(zip(("qweight", "scales"), kernel_weights.tensors))
    with pytest.raises(ValueError, match=r"src\.\w+ and out\['\w+'\] share memory"):
        repack(kernel_weights, kernel_weights.spec, out=in_place)


@pytest.mark.parametrize("options, error, message", [
    (dict(stages=2.5), ValueError, r"stages must be an int in \[2, 8\], got 2.5"),
    (dict(a_in_shared="no"), TypeError, "a_in_shared must be a bool, got 'no'"),
    (dict(split_k=True), ValueError, "split_k must be a positive power of two, got True"),
])
def test_tile_options_of_the_wrong_type(options, error, message):
    with pytest.raises(error, match=message):
        GemmTile(**options)


def test_batched_align_counts_are_ints():
    with pytest.raises(ValueError, match="tokens_per_expert must be an integer >= 1, got True"):
        batched_align(_ints(2), True, 16)


def test_activation_parameters_are_numbers():
    with pytest.raises(TypeError, match="alpha must be a number, got None"):
        Activation("swigluoai", alpha=None)
    with pytest.raises(TypeError, match="limit must be a number, got '7'"):
        Activation("swigluoai", limit="7")
