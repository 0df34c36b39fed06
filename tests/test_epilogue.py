"""A GEMM that finishes its own reduction (`then=`) writes exactly what the separate
kernel computes from the same partials, bit for bit, and leaves its counters at zero."""

import attrs
import numpy as np
import pytest
import torch
from fusing import SeparateReductions, fuse_every_tile

from layouts import Quantized, formats
from layouts.samples import random_quantized
from moe import MoEConfig, MoEHooks, MoELayer, QuantScheme
from moe.oracle import Backend, heuristic_backend
from numba_kernels import interop
from numba_kernels.activation import Activation, activate
from numba_kernels.align import moe_align_block_size
from numba_kernels.combine import combine
from numba_kernels.epilogue import FusedActivation, FusedCombine
from numba_kernels.gemm import GemmTile, grouped_gemm
from numba_kernels.launch import recording
from numba_kernels.weights import KernelWeights

SWAP = GemmTile(block_m=8, warps_k=2, slabs_per_warp=1, swap_ab=True, fused_reduction=True)
SPLIT = GemmTile(block_m=16, warps_k=1, slabs_per_warp=1, split_k=2, fused_reduction=True)
SWAP_SPLIT = GemmTile(block_m=8, warps_k=1, slabs_per_warp=1, split_k=2, swap_ab=True, fused_reduction=True)


def setup(shape, *, tokens, top_k, tile, seed=0, per_slot=False, half=torch.bfloat16):
    """Weights (E, N, K) as int4 group 32, `half` activations, alignment for `tile`, routing."""
    rng = np.random.default_rng(seed)
    spec = formats.native(4, 32, half=interop.HALF_NAMES[half])
    weights = KernelWeights.from_physical(spec, spec.pack(random_quantized(spec, shape, rng)), shape)
    device = interop.kernel_device()
    topk_ids = torch.tensor(np.stack([rng.permutation(shape[0])[:top_k] for _ in range(tokens)]), dtype=torch.int32,
                            device=device)
    topk_weights = torch.tensor(rng.uniform(0.1, 1.0, (tokens, top_k)), dtype=torch.float32, device=device)
    rows = tokens * top_k if per_slot else tokens
    act = torch.tensor(0.1 * rng.standard_normal((rows, shape[2])), dtype=torch.float32).to(half).to(device)
    alignment = moe_align_block_size(topk_ids, tile.block_m, shape[0], check_ids=False)
    return weights, act, alignment, topk_ids, topk_weights


def arrivals(count=64):
    return torch.zeros(count, dtype=torch.int32, device=interop.kernel_device())


@pytest.mark.parametrize("tile,activation,n", [(SWAP_SPLIT, Activation("silu"), 128),  # halves: gate, up tiles
                                               (SPLIT, Activation("swigluoai"), 128),  # interleaved
                                               (SWAP, Activation("relu", gated=False), 96)])
def test_fused_activation_equals_the_activation_kernel(tile, activation, n):
    tokens, top_k = 3, 2
    weights, act, alignment, topk_ids, _ = setup((4, n, 32), tokens=tokens, top_k=top_k, tile=tile)
    slots = tokens * top_k
    partials = grouped_gemm(act, weights, *alignment, num_slots=slots, tile=tile, partial_output=True)
    expected = activate(partials, activation, out_dtype=torch.bfloat16)
    counters = arrivals()
    out = torch.full_like(expected, float("nan"))
    fused_partials = grouped_gemm(act, weights, *alignment, num_slots=slots, tile=tile,
                                  then=FusedActivation(activation, out, counters))
    assert torch.equal(fused_partials, partials)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    assert not counters.any()  # zeros again for the next call


@pytest.mark.parametrize("tile", [SPLIT, SWAP_SPLIT, attrs.evolve(SWAP_SPLIT, chunks_first=True)])
def test_fused_combine_equals_the_combine_kernel(tile):
    tokens, top_k, n = 3, 2, 96
    weights, act, alignment, topk_ids, topk_weights = setup((4, n, 32), tokens=tokens, top_k=top_k, tile=tile,
                                                           per_slot=True)
    slots = tokens * top_k
    partials = grouped_gemm(act, weights, *alignment, num_slots=slots, tile=tile, partial_output=True)
    expected = combine(partials, topk_weights, out_dtype=torch.bfloat16)
    counters = arrivals()
    out = torch.full_like(expected, float("nan"))
    grouped_gemm(act, weights, *alignment, num_slots=slots, tile=tile, then=FusedCombine(topk_weights, out, counters))
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    assert not counters.any()


def test_fused_combine_counts_a_token_routed_twice_to_one_expert():
    """Given topk_ids may repeat an expert: both slots sit in one block and arrive twice."""
    tile, n = SWAP, 64
    weights, act, _, _, topk_weights = setup((4, n, 32), tokens=2, top_k=2, tile=tile, per_slot=True)
    topk_ids = torch.tensor([[1, 1], [3, 1]], dtype=torch.int32, device=act.device)
    alignment = moe_align_block_size(topk_ids, tile.block_m, 4, check_ids=False)
    partials = grouped_gemm(act, weights, *alignment, num_slots=4, tile=tile, partial_output=True)
    expected = combine(partials, topk_weights, out_dtype=torch.bfloat16)
    out, counters = torch.empty_like(expected), arrivals()
    grouped_gemm(act, weights, *alignment, num_slots=4, tile=tile, then=FusedCombine(topk_weights, out, counters))
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    assert not counters.any()


def test_bad_fused_arguments_raise_errors_naming_the_argument():
    tile = SWAP
    weights, act, alignment, _, topk_weights = setup((4, 96, 32), tokens=3, top_k=2, tile=tile)
    call = dict(num_slots=6, tile=tile)
    out = torch.empty(6, 48, dtype=torch.bfloat16, device=act.device)
    with pytest.raises(ValueError, match="whole CTA columns"):  # I = 48 gate features: not a 64-column tile
        grouped_gemm(act, weights, *alignment, **call, then=FusedActivation(Activation("silu"), out, arrivals()))
    interleaved = FusedActivation(Activation("swigluoai"), out, arrivals(1))
    with pytest.raises(ValueError, match="then.arrivals holds 1 counters"):
        grouped_gemm(act, weights, *alignment, **call, then=interleaved)
    with pytest.raises(ValueError, match="then.out must have shape"):
        grouped_gemm(act, weights, *alignment, **call,
                     then=FusedActivation(Activation("swigluoai"), out[:5], arrivals()))
    with pytest.raises(ValueError, match="then.topk_weights"):
        grouped_gemm(act, weights, *alignment, **call,
                     then=FusedCombine(topk_weights[:2], torch.empty(2, 96, dtype=torch.bfloat16, device=act.device), arrivals()))
    with pytest.raises(ValueError, match="pass the weights to FusedCombine"):
        grouped_gemm(act, weights, *alignment, **call, topk_weights=topk_weights,
                     then=FusedCombine(topk_weights, torch.empty(3, 96, dtype=torch.bfloat16, device=act.device), arrivals()))
    with pytest.raises(TypeError, match="then must be"):
        grouped_gemm(act, weights, *alignment, **call, then="combine")
    with pytest.raises(ValueError, match="partial_output=True"):
        grouped_gemm(act, weights, *alignment, **call, partial_output=False,
                     then=FusedActivation(Activation("swigluoai"), out, arrivals()))


PAIRED = GemmTile(block_m=32, warps_n=4, warps_k=1, slabs_per_warp=2, stages=4, a_in_shared=True, fused_reduction=True)
SWAP_PAIRED = GemmTile(block_m=8, warps_n=2, warps_k=2, slabs_per_warp=1, swap_ab=True, fused_reduction=True)


@pytest.mark.parametrize("tile,n,half", [
    (PAIRED, 512, torch.bfloat16),  # two CTA columns of two gate and two up chunks each
    (attrs.evolve(PAIRED, warps_n=2, trim_padding=True, chunks_first=True), 256, torch.float16),
    (SWAP_PAIRED, 256, torch.bfloat16),  # decode, swapped: accumulators of 16 features x 8 slots
    (attrs.evolve(SWAP_PAIRED, warps_n=4, warps_k=1), 512, torch.float16),
    (GemmTile(block_m=16, warps_n=2, warps_k=1, slabs_per_warp=1, fused_reduction=True), 256, torch.bfloat16)])
def test_paired_warps_finish_the_activation_in_their_epilogue(tile, n, half):
    """The gate and up warps of each pair swap half their tiles through shared memory (a
    prefill tile's stage buffers, a decode tile's own words): the result is the activation
    kernel's on gemm1's half outputs, bit for bit, padding rows untouched and a block of
    another rank's expert (-1) zeros."""
    tokens, top_k, silu = 5, 2, Activation("silu")
    weights, act, (sorted_ids, expert_ids, padded), _, _ = setup((4, n, 32), tokens=tokens, top_k=top_k, tile=tile,
                                                                 half=half)
    slots = tokens * top_k
    expert_ids = expert_ids.clone()
    expert_ids[1] = -1
    alignment = (sorted_ids, expert_ids, padded)
    expected = activate(grouped_gemm(act, weights, *alignment, num_slots=slots, tile=tile), silu, out_dtype=half)
    out = torch.full_like(expected, float("nan"))
    written = grouped_gemm(act, weights, *alignment, num_slots=slots, tile=tile,
                           then=FusedActivation(silu, out, arrivals(0)))
    assert written is out
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    assert (expected == 0).all(dim=1).any()  # the -1 block's rows


def test_warps_along_k_add_in_warp_order_whichever_warp_stores_the_sum():
    """Four warps along K, a slab each: fused, a paired tile gathers every tile in warp 0;
    unfused, each 16-feature tile's owner warp sums it (warp 2 the third). Both must add
    a0 + a1 + a2 + a3 in that order. Here every weight is 1 and the warps' sums are
    a = (2**-24, 2**-24, 1, 2**-8). In order they add to 1 + 2**-8 + 2**-23, just above the
    midpoint of two bfloat16 values, so the half is 1 + 2**-7. Started from warp 2's own,
    each 2**-24 added to 1 rounds away, the sum is the midpoint 1 + 2**-8 itself, and the
    half ties to even: 1."""
    tile, silu, slots, shape = attrs.evolve(SWAP_PAIRED, warps_k=4), Activation("silu"), 6, (4, 256, 64)
    spec = formats.native(4, 32)
    codes = np.full(shape, 9, np.uint8)  # symmetric int4: value 1
    weights = KernelWeights.from_physical(spec, spec.pack(Quantized(codes, np.ones((4, 256, 2), np.float32))), shape)
    device = interop.kernel_device()
    act = torch.zeros(3, 64, dtype=torch.bfloat16)
    act[:, [0, 16, 32, 48]] = torch.tensor([2.0 ** -24, 2.0 ** -24, 1.0, 2.0 ** -8], dtype=torch.bfloat16)
    act = act.to(device)
    topk_ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32, device=device)
    alignment = moe_align_block_size(topk_ids, tile.block_m, 4, check_ids=False)
    halves = grouped_gemm(act, weights, *alignment, num_slots=slots, tile=tile)
    assert (halves.float() == 1 + 2 ** -7).all()
    expected = activate(halves, silu, out_dtype=torch.bfloat16)
    out = torch.full_like(expected, float("nan"))
    grouped_gemm(act, weights, *alignment, num_slots=slots, tile=tile, then=FusedActivation(silu, out, arrivals(0)))
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


def test_tiles_of_paired_warps_finish_only_an_activation_they_can_pair():
    weights, act, alignment, _, topk_weights = setup((4, 256, 32), tokens=3, top_k=2, tile=PAIRED)
    call = dict(num_slots=6, tile=PAIRED)
    out = torch.empty(6, 128, dtype=torch.bfloat16, device=act.device)
    combined = torch.empty(3, 256, dtype=torch.bfloat16, device=act.device)
    for then in (FusedCombine(topk_weights, combined, arrivals()),  # the combine stays a kernel
                 FusedActivation(Activation("swigluoai"), out, arrivals())):  # interleaved: no pairs of warps
        with pytest.raises(ValueError, match="finishes only a gated"):
            grouped_gemm(act, weights, *alignment, **call, then=then)
    silu = FusedActivation(Activation("silu"), out, arrivals())
    for tile in (attrs.evolve(PAIRED, warps_n=1), attrs.evolve(PAIRED, stages=2),  # 64 exchange words a row > 2 x 20
                 attrs.evolve(PAIRED, split_k=2)):
        with pytest.raises(ValueError, match="finishes only a gated"):
            grouped_gemm(act, weights, *alignment, num_slots=6, tile=tile, then=silu)
    with pytest.raises(ValueError, match="from half outputs"):
        grouped_gemm(act, weights, *alignment, **call, partial_output=True, then=silu)
    swapped = moe_align_block_size(torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32, device=act.device), 8, 4,
                                   check_ids=False)
    for then in (FusedCombine(topk_weights, combined, arrivals()),
                 FusedActivation(Activation("swigluoai"), out, arrivals())):
        with pytest.raises(ValueError, match="finishes only a gated"):  # decode pairs: no counters either
            grouped_gemm(act, weights, *swapped, num_slots=6, tile=SWAP_PAIRED, then=then)
    with pytest.raises(ValueError, match="steady_loop is for decode tiles"):
        GemmTile(block_m=32, warps_k=1, a_in_shared=True, steady_loop=True)


def _fused_then_separate(config, tokens: int, seed: int):
    """A small layer's forward with the reductions fused (ordinary launches, no post_gemm
    hook), then with them as kernels of their own: ((kernel names, output) of each)."""
    layer = MoELayer(config, max_tokens=tokens)
    layer.weights.fill_random(seed=seed)
    generator = torch.Generator().manual_seed(seed)
    hidden = (0.1 * torch.randn(tokens, config.hidden_size, generator=generator)).to(torch.bfloat16)
    logits = torch.randn(tokens, config.num_experts, generator=generator)
    hidden, logits = hidden.to(interop.kernel_device()), logits.to(interop.kernel_device())
    runs = []
    for hooks in (MoEHooks(), SeparateReductions()):
        layer.hooks = hooks
        with recording() as calls:
            out = layer(hidden, logits).clone()
        runs.append(([call.kernel.py_func.__name__ for call in calls], out))
    return runs


def test_layer_with_fused_tiles_runs_three_kernels_and_matches_the_separate_ones(monkeypatch):
    fuse_every_tile(monkeypatch, heuristic_backend)
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=64,
                       quant=QuantScheme("native", bits=4, group_size=32))
    (kernels, fused_out), (_, separate) = _fused_then_separate(config, tokens=2, seed=0)
    assert kernels == ["route_and_align", "grouped_gemm", "grouped_gemm"]
    assert torch.equal(fused_out.view(torch.int16), separate.view(torch.int16))


def test_layer_with_a_prefill_gemm1_finishing_the_activation_runs_no_activation_kernel(monkeypatch):
    """gemm1 on a prefill tile finishes the activation in its epilogue; gemm2's combine
    stays a kernel (a prefill tile has no counters): the same bits as the separate kernels."""
    tile = GemmTile(block_m=32, warps_n=2, warps_k=1, slabs_per_warp=2, stages=2, a_in_shared=True)
    fuse_every_tile(monkeypatch, lambda config, tokens, spec: Backend(32, tile, tile))
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=32, intermediate_size=64,
                       quant=QuantScheme("native", bits=4, group_size=32))
    (kernels, fused_out), (calls, separate) = _fused_then_separate(config, tokens=1, seed=1)
    assert kernels[-3:] == ["grouped_gemm", "grouped_gemm", "combine_kernel"]
    assert len(calls) == 5
    assert torch.equal(fused_out.view(torch.int16), separate.view(torch.int16))
    assert separate.abs().sum() > 0
