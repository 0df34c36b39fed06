"""The grouped dequant-GEMM equals `act @ dequantize(W[e]).T` per aligned token block, for
weights in any spec (the fast Marlin-tile path and the index-map path), every tile shape,
and the cases the engines got wrong."""

import itertools

import attrs
import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st
from numba import cuda, uint32

from layouts import BitPack, Layout, Quantized, Tensor, Transpose, formats
from layouts.samples import random_quantized
from layouts.strategies import spec_for
from numba_kernels import gemm as gemm_module, interop, ptx, twins
from numba_kernels.align import moe_align_block_size
from numba_kernels.fragments import (COPY_OFFSET_LIMIT, HALF_CONSTANTS, bit_spread, bulk_staging_supported,
                                     copy_offsets_fit, e2m1_moves, fast_path_supported, fragment_reader, lane_scales,
                                     move_instructions, staged_weights, zero_point_byte)
from numba_kernels.gemm import GemmTile, grouped_gemm, prefill_supported, reference_grouped_gemm
from numba_kernels.weights import KernelWeights

DECODE = GemmTile(block_m=16, warps_k=2, slabs_per_warp=2)
PREFILL = GemmTile(block_m=32, warps_m=1, warps_n=2, warps_k=1, slabs_per_warp=2, a_in_shared=True)
PREFILL_SPLIT_K = GemmTile(block_m=16, warps_k=2, slabs_per_warp=1, a_in_shared=True, split_k=2, stages=2)
SPLIT = GemmTile(block_m=16, warps_k=1, slabs_per_warp=1, split_k=2)
SWAP = GemmTile(block_m=8, warps_k=2, slabs_per_warp=2, swap_ab=True)


def reference_alignment(topk_ids: np.ndarray, block_m: int, num_experts: int, expert_map=None):
    """moe_align_block_size semantics in numpy (slots ascending within each expert)."""
    flat = topk_ids.reshape(-1)
    sorted_ids, expert_ids = [], []
    for expert in range(num_experts):
        slots = np.flatnonzero(flat == expert)
        if slots.size:
            padded = -(-slots.size // block_m) * block_m
            sorted_ids += list(slots) + [flat.size] * (padded - slots.size)
            local = expert if expert_map is None else expert_map[expert]
            expert_ids += [local] * (padded // block_m)
    return (np.array(sorted_ids, np.int32), np.array(expert_ids, np.int32),
            np.array([len(sorted_ids)], np.int32))


def run_case(spec, shape, *, tokens, top_k, tile, half=torch.bfloat16, routed_weights=True, seed=0,
             topk_ids=None, expert_map=None, per_slot=False, check_weights=lambda dense: None,
             reorder=lambda sorted_ids: None):
    """(kernel output, float64 reference) for random weights, activations and routing;
    `check_weights` sees the dequantized weights first, `reorder` may permute the aligned
    slot ids in place (a caller's own alignment)."""
    rng = np.random.default_rng(seed)
    experts = shape[0]
    q = random_quantized(spec, shape, rng)
    physical = spec.pack(q)
    weights = KernelWeights.from_physical(spec, physical, shape)
    dense = spec.dequantize(physical, shape)
    check_weights(dense)
    if topk_ids is None:
        topk_ids = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]).astype(np.int32)
    topk_weights = rng.uniform(0.1, 1.0, topk_ids.shape).astype(np.float32)
    sorted_ids, expert_ids, padded = reference_alignment(topk_ids, tile.block_m, experts, expert_map)
    reorder(sorted_ids)
    num_slots = topk_ids.size
    act = torch.randn(num_slots if per_slot else tokens, shape[-1], generator=torch.Generator().manual_seed(seed)).to(half)
    device = interop.kernel_device()
    out = grouped_gemm(act.to(device), weights, *(torch.from_numpy(a).to(device) for a in (sorted_ids, expert_ids, padded)),
                       num_slots=num_slots, tile=tile,
                       topk_weights=torch.from_numpy(topk_weights).to(device) if routed_weights else None)
    got = out.float().cpu().numpy()
    if got.ndim == 3:
        got = got.sum(axis=0)
    expected = reference_grouped_gemm(act.float().numpy(), dense, sorted_ids, expert_ids, padded[0], tile.block_m,
                                      num_slots, topk_weights if routed_weights else None)
    return got, expected


def assert_close(got, expected, tolerance=1e-2):
    assert not np.isnan(got).any(), "an output element was not written"
    error = np.linalg.norm(got - expected) / max(np.linalg.norm(expected), 1e-30)
    assert error < tolerance, f"relative error {error:.3g}"


GEMM_SPECS = [formats.native(4, 32), formats.native(4, 64, zero_points=True), formats.native(8, None),
              formats.native(fp4=True), formats.gptq(4, 32, symmetric=False), formats.awq(4, 32),
              formats.compressed_tensors(8, 32), formats.marlin(4, 32, act_order=True)]


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_grouped_gemm_matches_reference_for_any_spec_and_tile(data):
    experts = data.draw(st.integers(1, 3), label="experts")
    named = data.draw(st.booleans(), label="named format")
    # Random layouts go through the index maps, element by element: slow under the simulator.
    n = data.draw(st.sampled_from([16, 64, 80] if named else [16]), label="n")
    k = data.draw(st.sampled_from([32, 48, 64] if named else [32]), label="k")
    spec = data.draw(st.sampled_from(GEMM_SPECS) if named else spec_for((experts, n, k)), label="spec")
    try:
        spec.check_shape((experts, n, k))
    except ValueError:
        return
    tile = data.draw(st.sampled_from([DECODE, PREFILL, SPLIT, PREFILL_SPLIT_K, SWAP]), label="tile")
    top_k = data.draw(st.integers(1, experts), label="top_k")
    tokens = data.draw(st.integers(1, 3), label="tokens")
    half = data.draw(st.sampled_from([torch.bfloat16, torch.float16]), label="half")
    if tile.a_in_shared and not prefill_supported(spec, n, k, interop.HALF_NAMES[half], tile):
        with pytest.raises(ValueError, match="cannot be staged"):
            run_case(spec, (experts, n, k), tokens=1, top_k=1, tile=tile, half=half)
        return
    got, expected = run_case(spec, (experts, n, k), tokens=tokens, top_k=top_k, tile=tile, half=half,
                             routed_weights=data.draw(st.booleans()), seed=data.draw(st.integers(0, 2**16)),
                             per_slot=data.draw(st.booleans(), label="per_slot"), check_weights=representable(half))
    representable(half)(expected)
    assert_close(got, expected)


def representable(half):
    """Random specs can dequantize past float16's range (int8 codes times e4m3 scales): no
    float16 GEMM holds such weights or outputs, so those examples are not drawn."""
    return lambda values: assume(half != torch.float16 or np.abs(np.nan_to_num(values)).max() < 65504)


@pytest.mark.parametrize("group_size, zero_points, half", [
    (32, False, torch.bfloat16), (64, True, torch.bfloat16), (128, False, torch.float16), (None, True, torch.float16),
    (32, True, torch.float16), (128, True, torch.bfloat16), (None, False, torch.bfloat16), (64, False, torch.float16),
])
def test_native_int4_at_every_group_size_with_and_without_zero_points(group_size, zero_points, half):
    spec = formats.native(4, group_size, zero_points=zero_points)
    assert fast_path_supported(spec, interop.HALF_NAMES[half])
    assert_close(*run_case(spec, (2, 64, 256), tokens=2, top_k=2, tile=DECODE, half=half))


@pytest.mark.parametrize("spec, half, found", [
    (formats.native(4, 128), "bfloat16", True), (formats.native(4, 32, zero_points=True), "bfloat16", True),
    (formats.native(8, 64, half="float16"), "float16", True), (formats.native(fp4=True), "float16", True),
    (formats.native(4, 128), "float16", False), (formats.native(4, None), "bfloat16", False),
    (formats.native(8, 64), "bfloat16", False), (formats.marlin(4, 32, act_order=True), "float16", False),
])
def test_decode_prefetches_scales_exactly_where_a_lane_s_eight_sit_together(spec, half, found):
    assert (lane_scales(spec, 192, 256, half) is not None) == found


def with_places(spec, places, tensor="weight"):
    """`spec` with the BitPack of its `tensor` ("weight" or "zeros") storing bits at `places`."""
    stored = getattr(spec, tensor)
    steps = stored.layout.steps
    layout = Layout(steps[:-1] + (attrs.evolve(steps[-1], places=places),))
    return attrs.evolve(spec, name=f"{spec.name}_{tensor}_placed", **{tensor: attrs.evolve(stored, layout=layout)})


def test_zero_points_with_scattered_bits_are_read_through_their_index_maps():
    """`lane_scales` shifts 4-bit zero points out of their word; zero points whose bits a
    BitPack scatters go through `elements.zero_reader` instead, with the same products."""
    spec = with_places(formats.native(4, 32, zero_points=True), tuple(reversed(range(32))), "zeros")
    assert fast_path_supported(spec, "bfloat16") and lane_scales(spec, 64, 64, "bfloat16") is None
    assert_close(*run_case(spec, (2, 64, 64), tokens=2, top_k=2, tile=DECODE))


@pytest.mark.parametrize("half, as_bits", [("bfloat16", lambda x: int(np.float32(x).view(np.uint32)) >> 16),
                                           ("float16", lambda x: int(np.float16(x).view(np.uint16)))])
def test_a_zero_point_at_any_bit_becomes_minus_magic_plus_it_in_one_byte_permute(half, as_bits):
    """The prefetched zero point's offset pair: `zero_point_byte`'s shift and selector, for a
    nibble at every bit of its word, against -(magic + z) in both halves."""
    constants = HALF_CONSTANTS[half]
    for shift, zero in itertools.product(range(29), range(16)):
        word = (0xFFFFFFFF ^ 0xF << shift | zero << shift) & 0xFFFFFFFF  # the other bits set: masked out
        right, selector = zero_point_byte(shift)
        pair = int(twins.byte_perm(word >> right & 0x0F0F0F0F, constants.minus_magic_top * 0x01010101, selector))
        minus = as_bits(-(constants.int4_magic_value + zero))
        assert pair == minus | minus << 16, (shift, zero)


@pytest.mark.parametrize("spec, half", [(formats.native(4, 32, zero_points=True, half="float16"), torch.float16),
                                        (formats.native(8, 64, half="float16"), torch.float16),
                                        (formats.native(fp4=True), torch.float16)])
def test_prefetched_scales_and_zero_points_in_either_half_type(spec, half):
    assert_close(*run_case(spec, (2, 80, 96), tokens=3, top_k=2, tile=DECODE, half=half))


@pytest.mark.parametrize("spec, half, tile", [
    (formats.native(4, 128), torch.bfloat16, PREFILL),
    (formats.native(4, 32, zero_points=True, half="float16"), torch.float16, PREFILL_SPLIT_K),
    (formats.native(fp4=True), torch.float16, GemmTile(block_m=16, warps_k=1, slabs_per_warp=4, stages=4,
                                                       a_in_shared=True)),
    (formats.native(8, 64, half="float16"), torch.float16, PREFILL),
])
def test_prefill_pipeline_at_every_group_size_code_width_and_stage_depth(spec, half, tile):
    """Groups longer than a stage (128), shorter (NVFP4's 16), zero points, 8-bit codes;
    2 to 4 buffers; a K split; warps splitting a stage; a partial last stage (K = 96)."""
    assert prefill_supported(spec, 80, 96, interop.HALF_NAMES[half], tile)
    assert_close(*run_case(spec, (2, 80, 96), tokens=3, top_k=2, tile=tile, half=half))


TRIMMED = GemmTile(block_m=64, warps_k=1, slabs_per_warp=2, stages=2, a_in_shared=True, trim_padding=True)


def run_twenty_slots_per_expert(tile, **options):
    """run_case with 20 slots per expert: a 64-row block's first 16-row tile full, the
    second 4 slots, the rest padding."""
    topk_ids = np.tile(np.array([[0, 1]], np.int32), (20, 1))
    return run_case(formats.native(4, 32), (2, 64, 64), tokens=20, top_k=2, tile=tile, topk_ids=topk_ids, **options)


@pytest.mark.parametrize("tile", [PREFILL, TRIMMED])
def test_prefill_warps_of_several_row_tiles_with_padding_at_the_tail(tile):
    """Padding after an expert's slots (trimmed: the 64-row block runs the loop over two m
    tiles)."""
    assert_close(*run_twenty_slots_per_expert(tile))


def test_trimmed_blocks_count_m_tiles_up_to_the_last_slot_wherever_the_padding_lies():
    """A caller's alignment may hold padding before a slot: the first block's slot of row
    19 moved to row 50, so its last m tile is in use though rows 19 to 49 are padding."""
    def move_a_slot_past_padding(sorted_ids):
        sorted_ids[19], sorted_ids[50] = sorted_ids[50], sorted_ids[19]

    assert_close(*run_twenty_slots_per_expert(TRIMMED, reorder=move_a_slot_past_padding))


@pytest.mark.parametrize("tile", [PREFILL, SPLIT, SWAP])
def test_cta_order_early_weights_and_trimming_change_no_output_bit(tile, monkeypatch):
    """chunks_first only reorders the grid, alignment_ready only moves the first weight
    loads of a decode tile's first wave of CTAs before the wait (none, the first three, or
    all of them here: `resident_ctas` stands in for the GPU's count), trim_padding only
    drops m tiles of padding (here a block of 32 rows holds at most 4 slots): every CTA
    computes what it did before."""
    shape, spec = (3, 160, 64), formats.native(4, 32)
    weights = KernelWeights.from_physical(spec, spec.pack(random_quantized(spec, shape, np.random.default_rng(1))),
                                          shape)
    device = interop.kernel_device()
    act = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(device)
    topk_ids = torch.tensor([[0, 2], [1, 2], [2, 0], [0, 1]], dtype=torch.int32, device=device)
    alignment = moe_align_block_size(topk_ids, tile.block_m, shape[0], check_ids=False)
    variants = [(attrs.evolve(tile, chunks_first=True), False, 0)]
    if not tile.a_in_shared:  # a prefill tile's first copies hold activations: it always waits first
        variants += [(tile, True, early) for early in (0, 3, 1 << 20)]
    if tile.trimmable:
        variants.append((attrs.evolve(tile, trim_padding=True), False, 0))
    first = grouped_gemm(act, weights, *alignment, num_slots=8, tile=tile)
    chunks = -(-160 // tile.block_n)
    assert (tile.grid(5, 160), attrs.evolve(tile, chunks_first=True).grid(5, 160)) == (
        (5, chunks, tile.split_k), (chunks, 5, tile.split_k))
    for variant, ready, early in variants:
        monkeypatch.setattr(gemm_module, "resident_ctas", lambda *args, early=early: early)
        assert torch.equal(grouped_gemm(act, weights, *alignment, num_slots=8, tile=variant, alignment_ready=ready),
                           first), (variant, ready, early)


def test_k_not_a_multiple_of_the_group_size():
    # intermediate 704 with group 128: the last group holds 64 input features
    assert_close(*run_case(formats.native(4, 128), (1, 64, 704), tokens=1, top_k=1, tile=DECODE))


def test_n_not_a_multiple_of_the_tile_after_a_tensor_parallel_split():
    assert_close(*run_case(formats.native(4, 32), (2, 160, 64), tokens=2, top_k=1, tile=DECODE))
    assert_close(*run_case(formats.native(4, 32), (2, 160, 64), tokens=2, top_k=1, tile=PREFILL))
    # whole 64-feature chunks, but the last CTA's second warp past N: it must store nothing
    assert_close(*run_case(formats.native(4, 32), (2, 192, 64), tokens=2, top_k=1, tile=PREFILL))


@pytest.mark.parametrize("spec, tile, tokens, top_k", [
    (formats.native(4, 32, zero_points=True), SWAP, 3, 2),
    (formats.native(fp4=True), GemmTile(block_m=8, warps_k=1, slabs_per_warp=1, split_k=2, swap_ab=True), 2, 2),
    (formats.native(4, 128, half="float16"), SWAP, 12, 1),  # 12 slots on 2 experts: several 8-slot blocks each
    (formats.gptq(4, 32), SWAP, 2, 2),  # through the index maps
])
def test_swapped_operands_give_the_same_products(spec, tile, tokens, top_k):
    """Weights as the A operand, slots as B (decode): every slot of an 8-slot block, N not
    a multiple of 64, K split over warps and CTAs."""
    half = torch.float16 if spec.scale_format.name == "float16" else torch.bfloat16
    assert_close(*run_case(spec, (2, 80, 256), tokens=tokens, top_k=top_k, tile=tile, half=half))


@pytest.mark.parametrize("spec, tile", [
    (formats.native(4, 64), SWAP),  # K = 192: warp 1's run of 6 slabs straddles groups 1 and 2
    # runs of 6 slabs in batches of 4: checked slab by slab (the others are whole batches)
    (formats.native(4, 64), GemmTile(block_m=8, warps_k=2, slabs_per_warp=4, swap_ab=True)),
    (formats.native(4, 64, zero_points=True, half="float16"), SWAP),
    (formats.native(4, 128), GemmTile(block_m=8, warps_k=4, slabs_per_warp=1, swap_ab=True)),  # a short last group
    (formats.native(4, 32), GemmTile(block_m=8, warps_k=1, slabs_per_warp=1, split_k=2, swap_ab=True)),
])
def test_deferred_scales_per_group_give_the_same_products(spec, tile):
    """Swapped decode over 4-bit codes sums (M + q) a per scale group and applies zero
    point and scale in float32 (`fragments.DeferredScales`): group sizes, zero points,
    either half type, warp runs that straddle groups, a short last group, K splits, runs
    of whole batches and runs that end inside one."""
    half = torch.float16 if spec.scale_format.name == "float16" else torch.bfloat16
    assert fragment_reader(spec, 80, 192, interop.HALF_NAMES[half]).deferred is not None
    assert_close(*run_case(spec, (2, 80, 192), tokens=3, top_k=2, tile=tile, half=half))


@pytest.mark.parametrize("spec, tile", [
    (formats.native(fp4=True), GemmTile(block_m=8, warps_k=1, slabs_per_warp=2, swap_ab=True, steady_loop=True)),
    (formats.native(4, 64), GemmTile(block_m=8, warps_k=1, slabs_per_warp=2, swap_ab=True, steady_loop=True)),
    (formats.native(4, 32, zero_points=True), GemmTile(block_m=16, warps_k=2, slabs_per_warp=1, steady_loop=True)),
])
def test_steady_loop_without_range_checks_gives_the_same_products(spec, tile):
    """K = 192 is 12 slabs: a warp's run enters the unchecked loop for whole batches and
    finishes in the checked one (2 slabs per batch: slabs 0-7 unchecked, 8-11 checked);
    deferred scale groups (64) fold in both."""
    half = torch.float16 if spec.scale_format.name == "float16" else torch.bfloat16
    assert_close(*run_case(spec, (2, 80, 192), tokens=3, top_k=2, tile=tile, half=half))


@pytest.mark.parametrize("tile", [GemmTile(block_m=8, warps_k=1, slabs_per_warp=2, swap_ab=True),
                                  GemmTile(block_m=16, warps_k=1, slabs_per_warp=2, stages=2, a_in_shared=True)],
                         ids=["decode", "prefill"])
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("placed", [True, False], ids=["placed", "in_sequence"])
def test_nvfp4_fragments_are_exact_for_every_code_and_the_extreme_block_scales(half, tile, placed):
    """Every e2m1 code times e4m3 block scales from the smallest subnormal (2**-9) to the
    largest (448), negative and zero ones too (folded into the codes), decoded as code *
    scale * 2**-7 and rescaled in the epilogue: one-hot activations read each weight back,
    exactly (each fits the half type). The tile reader's bit moves come from the layout's
    places: the native ones, and the same tiles with each code's bits in sequence."""
    spec, n, k = formats.native(fp4=True), 64, 32
    if not placed:
        spec = with_places(spec, None)
    assert fast_path_supported(spec, interop.HALF_NAMES[half])
    codes = (np.arange(n * k).reshape(1, n, k) * 7) % 16
    e4m3 = np.array([2.0 ** -9, -7 * 2.0 ** -9, 2.0 ** -6, 0.0, 0.5, -1.0, 1.875, 240.0, -448.0, 448.0])
    scales = e4m3[np.arange(n * k // 16).reshape(1, n, k // 16) % 10]
    quantized = Quantized(codes, scales, global_scale=np.array([0.5], np.float32))
    physical = spec.pack(quantized)
    weights = KernelWeights.from_physical(spec, physical, (1, n, k))
    dense = spec.dequantize(physical, (1, n, k))[0]
    sorted_ids, expert_ids, padded = reference_alignment(np.zeros((k, 1), np.int32), tile.block_m, 1)
    device = interop.kernel_device()
    out = grouped_gemm(torch.eye(k, dtype=half).to(device), weights,
                       *(torch.from_numpy(a).to(device) for a in (sorted_ids, expert_ids, padded)), num_slots=k,
                       tile=tile)
    np.testing.assert_array_equal(out.float().cpu().numpy(), dense.T)


@pytest.mark.parametrize("places, half", [(formats.NVFP4_PLACES, "bfloat16"), (formats.NVFP4_PLACES, "float16"),
                                          (None, "bfloat16")], ids=["placed-bf16", "placed-f16", "in_order-bf16"])
def test_bit_spread_moves_every_bit_as_the_pieces_do(places, half):
    """`bit_spread`'s multiply gives the bits the shift-and-mask pieces give, for any word:
    its copies never overlap, so no carry reaches a kept bit."""
    words = np.random.default_rng(0).integers(0, 2 ** 32, 4096, dtype=np.uint64)
    words[:2] = 0, 2 ** 32 - 1
    spreads = 0
    for moves in e2m1_moves(places, half):
        pieces = sum(((words << left) & 0xFFFFFFFF) >> right & mask for left, right, mask in moves)
        spread = bit_spread(moves)
        if spread is not None:
            right, gather, multiplier, mask = spread
            np.testing.assert_array_equal((words >> right & gather) * multiplier & mask, pieces)
            spreads += 1
    assert spreads >= 1


def test_native_nvfp4_places_three_codes_of_four_one_shift_and_mask_from_a_bfloat16():
    """`formats.NVFP4_PLACES` is what the tile reader is generated from: in bfloat16, slots
    0..2 of each half move in one piece and slot 3 in three, which one multiply moves at
    once (`bit_spread`): 9 instructions a word against 13 in order; float16 14 against 15.
    A placement that splits a code across halves, or moves the two halves differently, is
    read through the index maps instead."""
    def pieces(places, half):
        return [len(moves) for moves in e2m1_moves(places, half)]

    def instructions(places, half):
        return sum(move_instructions(moves) for moves in e2m1_moves(places, half))

    assert pieces(formats.NVFP4_PLACES, "bfloat16") == [1, 1, 1, 3]
    assert pieces(None, "bfloat16") == pieces(None, "float16") == [2, 2, 2, 2]
    spreads = [bit_spread(moves) is not None for moves in e2m1_moves(formats.NVFP4_PLACES, "bfloat16")]
    assert spreads == [False, False, False, True]
    assert instructions(formats.NVFP4_PLACES, "bfloat16") == 9 and instructions(None, "bfloat16") == 13
    assert instructions(formats.NVFP4_PLACES, "float16") == 14 and instructions(None, "float16") == 15
    straddling = (16,) + tuple(range(1, 16)) + (0,) + tuple(range(17, 32))
    assert e2m1_moves(straddling, "bfloat16") is None
    assert e2m1_moves(tuple(range(16)) + tuple(range(16, 32))[::-1], "bfloat16") is None
    assert not fast_path_supported(with_places(formats.native(fp4=True), straddling), "bfloat16")
    bytes_placed = attrs.evolve(formats.nvfp4(), weight=Tensor("weight", Layout(
        (Transpose(), Transpose(), Transpose(), BitPack(4, word_bits=8, places=tuple(range(8)))))))
    assert not fast_path_supported(bytes_placed, "bfloat16")  # four steps, but not Marlin's tiles (found by Hypothesis)


def test_no_placement_of_three_one_piece_codes_decodes_in_fewer_instructions():
    """Why `formats.NVFP4_PLACES` stays (the sixty-fifth session timed NVFP4's bit moves at
    1.15 us of Qwen3's 17.7 at M = 1): a code moves in one piece when its bits sit as
    p..p+2, p+9 of a half (a bfloat16's 6..8, 15 shifted), and three such codes fit a half
    only at p = 0, 3 and 6. Every order of the fourth code's bits in what they leave (10,
    11, 13, 14) takes at least 4 instructions, so 9 a word is the least of those placements."""
    shapes = [(p, p + 1, p + 2, p + 9) for p in range(7)]
    trios = [trio for trio in itertools.combinations(shapes, 3) if len(set(sum(trio, ()))) == 12]
    assert trios == [((0, 1, 2, 9), (3, 4, 5, 12), (6, 7, 8, 15))]

    def word(last):  # the three codes, then the fourth's bits in the order given; both halves alike
        half = sum(trios[0], ()) + last
        return half + tuple(16 + bit for bit in half)

    fewest = min(sum(move_instructions(moves) for moves in e2m1_moves(word(last), "bfloat16"))
                 for last in itertools.permutations((10, 11, 13, 14)))
    assert fewest == 9
    # Nor across words: every register one (funnel) shift and one mask would need translates
    # of a register's bits (6..8, 15 of each half) to tile the 128 bits of a lane's slab.
    pattern = (6, 7, 8, 15, 22, 23, 24, 31)

    def tiles(covered):
        if covered == (1 << 128) - 1:
            return True
        cell = next(bit for bit in range(128) if not covered >> bit & 1)  # the first bit left: some translate covers it
        for offset in {(cell - bit) % 128 for bit in pattern}:
            translate = sum(1 << (offset + bit) % 128 for bit in pattern)
            if not covered & translate and tiles(covered | translate):
                return True
        return False

    assert not tiles(0)


@pytest.mark.parametrize("spec, deferred", [
    (formats.native(4, 128), True), (formats.native(4, 32, zero_points=True), True),
    (formats.native(fp4=True), False), (formats.native(8, 64, half="float16"), False), (formats.gptq(4, 32), False),
])
def test_scales_are_deferred_for_4_bit_integer_codes_with_lane_scales_only(spec, deferred):
    half = spec.scale_format.name if spec.scale_format.name in ("float16", "bfloat16") else "bfloat16"
    assert (fragment_reader(spec, 128, 256, half).deferred is not None) == deferred


def test_int8_codes_in_bfloat16_take_the_float32_path():
    assert_close(*run_case(formats.native(8, 64), (2, 64, 128), tokens=2, top_k=2, tile=DECODE))


def test_act_order_through_index_maps_and_sorted_marlin():
    for spec in (formats.gptq(4, 32, act_order=True), formats.marlin(4, 32, act_order=True)):
        assert_close(*run_case(spec, (2, 64, 128), tokens=2, top_k=2, tile=DECODE))


def test_a_single_token_routed_to_a_single_expert():
    assert_close(*run_case(formats.native(4, 32), (4, 64, 64), tokens=1, top_k=1, tile=DECODE))


def test_all_tokens_routed_to_one_expert_and_experts_without_tokens():
    topk_ids = np.full((5, 1), 2, np.int32)
    assert_close(*run_case(formats.native(4, 32), (4, 64, 64), tokens=5, top_k=1, tile=DECODE, topk_ids=topk_ids))


def test_top_k_equal_to_the_number_of_experts_with_split_k_partials():
    assert_close(*run_case(formats.native(fp4=True), (3, 64, 64), tokens=2, top_k=3, tile=SPLIT))


def test_blocks_of_experts_on_another_rank_produce_zeros():
    expert_map = np.array([0, -1, 1], np.int32)
    got, expected = run_case(formats.native(4, 32), (3, 64, 64), tokens=3, top_k=2, tile=DECODE,
                             expert_map=expert_map)
    # the reference writes zeros for the -1 blocks; every slot of expert 1 is among them
    assert_close(got, expected)


def _small_problem(half=torch.bfloat16):
    spec = formats.native(4, 32)
    shape = (2, 64, 64)
    q = random_quantized(spec, shape, np.random.default_rng(0))
    weights = KernelWeights.from_physical(spec, spec.pack(q), shape)
    device = interop.kernel_device()
    sorted_ids, expert_ids, padded = reference_alignment(np.array([[0], [1]], np.int32), 16, 2)
    alignment = tuple(torch.from_numpy(a).to(device) for a in (sorted_ids, expert_ids, padded))
    return torch.zeros(2, 64, dtype=half, device=device), weights, alignment


NATIVE_SPECS = [formats.native(4, 128), formats.native(4, 64, zero_points=True), formats.native(fp4=True)]


@pytest.mark.parametrize("spec", NATIVE_SPECS, ids=lambda spec: spec.name)
@pytest.mark.parametrize("chunks, n", [(2, 256), (4, 512), (1, 128)])
def test_bulk_staging_takes_whole_stages_and_whole_runs_of_chunks(spec, chunks, n):
    k, slabs = 256, 4
    assert bulk_staging_supported(spec, n, k, "bfloat16", chunks, slabs)
    assert not bulk_staging_supported(spec, n, k + 16, "bfloat16", chunks, slabs)  # a partial stage
    assert chunks == 1 or not bulk_staging_supported(spec, n - 64, k, "bfloat16", chunks, slabs)  # a chunk past N
    assert (staged_weights(spec, n, k, "bfloat16", chunks, slabs, 64).copy_panel is not None) == (chunks == 2)


@pytest.mark.parametrize("spec", NATIVE_SPECS, ids=lambda spec: spec.name)
@pytest.mark.parametrize("first_chunk", [0, 2], ids=["the first panel", "the second panel"])
def test_bulk_staging_fills_a_stage_exactly_as_the_threads_copies_do(spec, first_chunk):
    """`StagedWeights.copy_panel` (one thread's bulk copies on an mbarrier) writes every
    word of a stage that the threads' 16-byte copies write, for each stage of an expert:
    codes, scales and zero points of a CTA's two chunks, one column panel of the native
    layout (`formats.NATIVE_PANEL`)."""
    experts, k, slabs, threads, chunks, n = 2, 256, 4, 64, 2, 256
    second_chunk = first_chunk + 1
    staged = staged_weights(spec, n, k, "bfloat16", chunks, slabs, threads)
    words, steps, copies = staged.stage_words, k // (slabs * 16), staged.copies_per_thread
    plan, copy, wait_all, copy_panel = staged.plan, staged.copy, ptx.wait_copies[0], staged.copy_panel

    @ptx.kernel
    def run(weights, e, first, second, seen):
        shared = cuda.shared.array(0, uint32)
        thread = uint32(cuda.threadIdx.x)
        sources = cuda.local.array(copies, uint32)
        plan(e, first, second, thread, sources)
        if thread == 0:
            ptx.mbarrier_init(shared, 2 * words, 1)
        for step in range(steps):
            for i in range(thread, 2 * words, threads):
                shared[i] = uint32(0xDEADBEEF)
            ptx.async_proxy_fence()  # the fill before the bulk copies' writes (another proxy)
            cuda.syncthreads()
            copy(weights, sources, step * slabs, shared, uint32(0), thread)
            ptx.commit_copies()
            if thread == 0:
                ptx.mbarrier_expect_bytes(shared, 2 * words, 4 * words)
                copy_panel(weights, e, first, step * slabs, shared, uint32(words), 2 * words)
            wait_all()
            ptx.mbarrier_wait(shared, 2 * words, step % 2)
            cuda.syncthreads()
            for i in range(thread, 2 * words, threads):
                seen[step, i] = shared[i]
            cuda.syncthreads()

    q = random_quantized(spec, (experts, n, k), np.random.default_rng(2))
    weights = KernelWeights.from_physical(spec, spec.pack(q), (experts, n, k))
    for e in range(experts):
        seen = np.zeros((steps, 2 * words), np.uint32)
        run[1, threads, 0, 4 * (2 * words + 2)](weights.arrays(), e, first_chunk, second_chunk, seen)
        np.testing.assert_array_equal(seen[:, words:], seen[:, :words])
        assert not (seen == 0xDEADBEEF).any()


def test_prefill_copies_take_only_arrays_their_32_bit_offsets_reach():
    small, huge = torch.empty(4), torch.empty(1).expand(COPY_OFFSET_LIMIT + 1)  # no memory behind it
    assert copy_offsets_fit(small, torch.empty(1).expand(COPY_OFFSET_LIMIT))
    assert not copy_offsets_fit(small, huge)


@pytest.mark.parametrize("change, error, message", [
    (lambda a: dict(a, act=a["act"].float()), TypeError, "act must be a torch.bfloat16 or torch.float16"),
    (lambda a: dict(a, act=a["act"][:, :32].contiguous()), ValueError, "K = 64"),
    (lambda a: dict(a, act=a["act"][:, ::2]), ValueError, "contiguous"),
    (lambda a: dict(a, num_slots=3), ValueError, "num_slots"),
    (lambda a: dict(a, tile=GemmTile(block_m=32)), ValueError, "block_size = block_m"),
    (lambda a: dict(a, topk_weights=torch.ones(3)), ValueError, "topk_weights"),
    (lambda a: dict(a, out=torch.empty(2, 63, dtype=torch.bfloat16, device=interop.kernel_device())), ValueError,
     "out must have shape"),
    (lambda a: dict(a, tile=GemmTile(block_m=16, a_in_shared=True, stages=8, slabs_per_warp=16)), ValueError,
     "shared memory"),
])
def test_bad_arguments_are_rejected_before_launch(change, error, message):
    act, weights, alignment = _small_problem()
    arguments = change(dict(act=act, num_slots=2, tile=DECODE, topk_weights=None, out=None))
    with pytest.raises(error, match=message):
        grouped_gemm(arguments["act"], weights, *alignment, num_slots=arguments["num_slots"], tile=arguments["tile"],
                     topk_weights=arguments["topk_weights"], out=arguments["out"])


def test_token_blocks_past_the_grid_s_y_limit_are_refused_in_chunks_first_order():
    act, weights, _ = _small_problem()
    tile = GemmTile(block_m=16, chunks_first=True)
    blocks = 65536
    device = act.device
    sorted_ids = torch.full((blocks * 16,), 2, dtype=torch.int32, device=device)
    expert_ids = torch.full((blocks,), -1, dtype=torch.int32, device=device)
    padded = torch.tensor([16], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="may not exceed 65535"):
        grouped_gemm(act, weights, sorted_ids, expert_ids, padded, num_slots=2, tile=tile)


def test_prefill_tiles_refuse_layouts_they_cannot_stage_and_misaligned_activations():
    spec, shape = formats.gptq(4, 32), (2, 64, 64)
    gptq = KernelWeights.from_physical(spec, spec.pack(random_quantized(spec, shape, np.random.default_rng(0))), shape)
    act, native, alignment = _small_problem()
    prefill = GemmTile(block_m=16, a_in_shared=True)
    assert not prefill_supported(spec, 64, 64, "bfloat16", prefill)
    with pytest.raises(ValueError, match="cannot be staged through shared memory"):
        grouped_gemm(act, gptq, *alignment, num_slots=2, tile=prefill)
    misaligned = torch.zeros(2 * 64 + 1, dtype=torch.bfloat16, device=act.device)[1:].view(2, 64)
    with pytest.raises(ValueError, match="16-byte aligned"):
        grouped_gemm(misaligned, native, *alignment, num_slots=2, tile=prefill)


def test_tile_parameters_are_validated():
    with pytest.raises(ValueError, match="power of two"):
        GemmTile(warps_k=3)
    with pytest.raises(ValueError, match="multiple of 16"):
        GemmTile(block_m=16, warps_m=2)
    with pytest.raises(ValueError, match="1024"):
        GemmTile(warps_m=4, warps_n=4, warps_k=4, block_m=64)
    with pytest.raises(ValueError, match="stages"):
        GemmTile(stages=1)
    with pytest.raises(ValueError, match="swap_ab takes blocks of 8"):
        GemmTile(block_m=16, swap_ab=True)
    with pytest.raises(ValueError, match="swap_ab takes blocks of 8"):
        GemmTile(block_m=8, a_in_shared=True, swap_ab=True)
    with pytest.raises(ValueError, match="for decode tiles"):
        GemmTile(block_m=16, a_in_shared=True, steady_loop=True)
    for untrimmable in (dict(block_m=32), dict(block_m=16, a_in_shared=True),
                        dict(block_m=64, warps_m=2, a_in_shared=True)):
        with pytest.raises(ValueError, match="trim_padding is for prefill tiles"):
            GemmTile(**untrimmable, trim_padding=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name, shape, top_k, tokens", [
    ("qwen3_gemm1", (16, 1536, 2048), 8, 16), ("qwen3_gemm2", (16, 2048, 768), 8, 64),
])
@pytest.mark.parametrize("tile", [  # the oracle's decode and prefill tiles, a K-split prefill, the options
    GemmTile(block_m=16, warps_k=4, slabs_per_warp=2, split_k=2),
    GemmTile(block_m=8, warps_k=4, slabs_per_warp=2, split_k=2, swap_ab=True),
    GemmTile(block_m=8, warps_k=4, slabs_per_warp=4, swap_ab=True, steady_loop=True),
    GemmTile(block_m=64, warps_m=1, warps_n=4, warps_k=1, slabs_per_warp=4, stages=2, a_in_shared=True),
    GemmTile(block_m=64, warps_m=1, warps_n=4, warps_k=1, slabs_per_warp=2, stages=4, a_in_shared=True,
             chunks_first=True, trim_padding=True),
    GemmTile(block_m=128, warps_m=2, warps_n=4, warps_k=1, slabs_per_warp=2, stages=3, a_in_shared=True),
    GemmTile(block_m=64, warps_m=2, warps_n=4, warps_k=1, slabs_per_warp=2, stages=3, split_k=2, a_in_shared=True)])
@pytest.mark.parametrize("spec", [formats.native(4, 128), formats.native(fp4=True)], ids=["int4", "nvfp4"])
def test_realistic_shapes_on_the_gpu(name, shape, top_k, tokens, tile, spec):
    assert_close(*run_case(spec, shape, tokens=tokens, top_k=top_k, tile=tile))
