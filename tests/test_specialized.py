"""The warp-specialised GEMM (`numba_kernels.gemm_specialized`) and its stage blocks, under
the simulator: gather -> gemm1 (blocked rows) -> activation into stage blocks -> gemm2
(a row a slot) equal the spec's dequantised product for blocks of several widths; the
layer takes it where the oracle says (Hopper, from tens of slots an expert, or a tuned entry),
replays it, and keeps the tiles for hooked calls; the workspace fits it; bad arguments
and configurations fail by name."""

import attrs
import numpy as np
import pytest
import torch
from fusing import SeparateReductions
from ranks import rank_layers

import moe.oracle
import numba_kernels.fragments
from layouts import formats
from layouts.samples import random_quantized
from moe import MoEConfig, MoELayer, QuantScheme, Workspace
from moe.oracle import Backend, backend_from_dict, backend_to_dict, select_backend, select_batched_backend
from moe.reference import random_checkpoint, reference_moe
from moe.weights import kernel_spec
from numba_kernels import interop
from numba_kernels.activation import Activation, reference_activate
from numba_kernels.align import align_sizes, moe_align_block_size
from numba_kernels.gemm import GemmTile
from numba_kernels.gemm_specialized import (SpecializedTile, make_specialized_kernel, specialized_gemm,
                                            specialized_supported)
from numba_kernels.stage_blocks import activate_blocks, gather_blocks, piece_at, piece_of
from numba_kernels.weights import KernelWeights

DEVICE = interop.kernel_device()
# Blocks of 32 slots in two parts of up to 16 (widths 8 and 16); K = 128 goes round the ring of
# two stages once, K = 192 once and a half (the last round, after the main loop, partial).
TILE = SpecializedTile(block_m=32, max_width=16, width_step=8, stages=2)


def _weights(spec, shape, rng):
    physical = spec.pack(random_quantized(spec, shape, rng))
    dense = torch.from_numpy(spec.dequantize(physical, shape)).to(torch.bfloat16).double()
    weights = KernelWeights.from_physical(spec, physical, shape)
    return KernelWeights(spec, shape, tuple(None if t is None else t.to(DEVICE) for t in weights.tensors)), dense


@pytest.mark.parametrize("spec", [formats.native(4, 64, zero_points=True), formats.native(fp4=True)],
                         ids=["int4 zero points", "nvfp4"])
def test_gather_gemm_activation_gemm_give_the_specs_product(spec):
    """Three experts of 20, 4 and no slots (parts of 16 and 4 slots, of 4, none: widths
    16, 8, 8): gemm1's blocked rows are
    hidden @ w13 rounded to halves, gemm2's row of each slot act(gate) * up @ w2, and the
    padding's sentinel row is the only other row gemm2 writes."""
    rng = np.random.default_rng(0)
    experts, hidden_size, intermediate, top_k = 3, 128, 192, 2
    w13, dense13 = _weights(spec, (experts, 2 * intermediate, hidden_size), rng)
    w2, dense2 = _weights(spec, (experts, hidden_size, intermediate), rng)
    ids = torch.tensor([[0, 1]] * 4 + [[0, 0]] * 8, dtype=torch.int32)  # expert 0: 20 slots, expert 1: 4
    tokens, slots = ids.shape[0], ids.numel()
    hidden = torch.randn(tokens, hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    alignment = tuple(t.to(DEVICE) for t in moe_align_block_size(ids, TILE.block_m, experts))
    blocks = alignment[1].shape[0]
    picks = torch.full((blocks * TILE.sub_blocks,), 7, dtype=torch.int32, device=DEVICE)
    stages = max(hidden_size, intermediate) // 64  # the larger GEMM's K
    stage = torch.full((picks.numel() * stages * TILE.block_words(),), -1, dtype=torch.int32, device=DEVICE)
    gate_up = torch.full((blocks * TILE.block_m, 2 * intermediate), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = torch.full((slots + 1, hidden_size), float("nan"), dtype=torch.bfloat16, device=DEVICE)

    gather_blocks(hidden.to(DEVICE), alignment, slots, top_k, TILE, picks, stage)
    assert picks.cpu().tolist()[:4] == [1, 0, 0, -1] and all(p == -1 for p in picks.cpu().tolist()[4:])
    specialized_gemm(stage, w13, picks, alignment[1], alignment[0], gate_up, TILE, blocked=True)
    activation = Activation("silu")
    activate_blocks(gate_up, activation, TILE, picks, stage)
    specialized_gemm(stage, w2, picks, alignment[1], alignment[0], out, TILE, blocked=False)

    sorted_ids = alignment[0].cpu().tolist()
    for position, slot in enumerate(sorted_ids[:2 * TILE.block_m]):
        if slot >= slots:
            continue
        expert, token = int(ids.flatten()[slot]), slot // top_k
        expected1 = (hidden[token].double() @ dense13[expert].T).to(torch.bfloat16).double()
        got1 = gate_up[position].cpu().double()
        assert torch.allclose(got1, expected1, rtol=1e-2, atol=1e-2 * float(expected1.abs().max()))
        y = (torch.nn.functional.silu(expected1[:intermediate]) * expected1[intermediate:]).to(torch.bfloat16)
        expected2 = y.double() @ dense2[expert].T
        got2 = out[slot].cpu().double()
        assert torch.allclose(got2, expected2, rtol=2e-2, atol=2e-2 * float(expected2.abs().max())), slot
    assert not out[:slots].isnan().any()


def documented_piece(p, width):
    """(slot, K within the stage) of piece `p` of a stage at `width`, read off the layout
    `stage_blocks` documents: slabs of 16 of K, in each the slots' groups of 8, in each
    two halves of the slab's K, in each 8 slots (wgmma's K-major core matrices)."""
    slab, group = divmod(p // 16, width // 8)
    return 8 * group + p % 8, 16 * slab + 8 * (p // 8 % 2)


@pytest.mark.parametrize("activation", [Activation("swigluoai"), Activation("gelu", gated=False), Activation("relu")],
                         ids=["interleaved", "no gate", "gate and up halves"])
def test_activation_stage_blocks_hold_each_slots_activation(activation):
    """`activate_blocks` (16-byte loads of gemm1's rows, 16-byte stores) for each way gate
    and up lie in a row: piece p of a part's stage holds the activation of the eight
    features `documented_piece` names, of its slot's row, as halves; parts without slots
    stay untouched."""
    intermediate = 128
    width_in = 2 * intermediate if activation.gated else intermediate
    rows = torch.from_numpy(np.random.default_rng(4).standard_normal((2 * TILE.block_m, width_in)))
    gate_up = rows.to(torch.bfloat16)
    picks = torch.tensor([1, 0, -1, 0], dtype=torch.int32)  # parts of widths 16, 8, none, 8
    steps, words = intermediate // 64, TILE.block_words()
    stage = torch.full((picks.numel() * steps * words,), -1, dtype=torch.int32, device=DEVICE)
    activate_blocks(gate_up.to(DEVICE), activation, TILE, picks.to(DEVICE), stage)
    expected = reference_activate(gate_up.float().numpy(), activation)
    got = stage.cpu()
    for part, pick in enumerate(picks.tolist()):
        held = got[part * steps * words:(part + 1) * steps * words]
        if pick < 0:
            assert (held == -1).all(), part
            continue
        width = (pick + 1) * TILE.width_step
        first_row = part // TILE.sub_blocks * TILE.block_m + part % TILE.sub_blocks * TILE.max_width
        for step in range(steps):
            halves = held[step * words:(step + 1) * words].view(torch.bfloat16).double().numpy()
            for p in range(8 * width):
                slot, k = documented_piece(p, width)
                want = expected[first_row + slot, 64 * step + k:64 * step + k + 8]
                np.testing.assert_allclose(halves[8 * p:8 * p + 8], want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("width", [8, 16, 72, 256])
def test_piece_of_and_piece_at_follow_the_documented_layout(width):
    """The gather stores piece p of (slot, K) = `piece_of(p)`, the activation stores
    (slot, K) at `piece_at`: both as documented, every piece of a stage once."""
    u32 = np.uint32
    for p in range(8 * width):
        slot, k = documented_piece(p, width)
        assert tuple(int(v) for v in piece_of(u32(p), u32(width))) == (slot, k), p
        assert int(piece_at(u32(slot), u32(k), u32(width))) == p, p


def test_stage_block_kernels_refuse_arrays_past_32_bit_offsets(monkeypatch):
    """Both kernels address their arrays by 32-bit offsets: an array past them fails by name
    (the limit lowered here: a real one would take 16 GB)."""
    hidden = torch.zeros(4, 128, dtype=torch.bfloat16, device=DEVICE)
    alignment = tuple(t.to(DEVICE) for t in moe_align_block_size(torch.tensor([[0, 1]] * 4, dtype=torch.int32),
                                                                  TILE.block_m, 2))
    picks = torch.zeros(alignment[1].shape[0] * TILE.sub_blocks, dtype=torch.int32, device=DEVICE)
    stage = torch.zeros(picks.numel() * 2 * TILE.block_words(), dtype=torch.int32, device=DEVICE)
    gate_up = torch.zeros(alignment[1].shape[0] * TILE.block_m, 256, dtype=torch.bfloat16, device=DEVICE)
    monkeypatch.setattr(numba_kernels.fragments, "COPY_OFFSET_LIMIT", hidden.numel() // 2 - 1)
    with pytest.raises(ValueError, match="source and blocks must each hold fewer than 2\\*\\*32"):
        gather_blocks(hidden, alignment, 8, 2, TILE, picks, stage)
    with pytest.raises(ValueError, match="gate_up and blocks must each hold fewer than 2\\*\\*32"):
        activate_blocks(gate_up, Activation("silu"), TILE, picks, stage)


def _tiny_config(quant=QuantScheme("gptq", bits=4, group_size=64), **fields):
    return MoEConfig(**{**dict(num_experts=2, top_k=2, hidden_size=128, intermediate_size=64), **fields}, quant=quant)


def _as_on_hopper(monkeypatch):
    """The oracle as on an H100 / H200."""
    monkeypatch.setattr(moe.oracle, "specialized_device", lambda: True)


def test_layer_takes_the_warp_specialised_gemm_on_hopper_and_replays_it(monkeypatch):
    """32 tokens over two experts (32 slots an expert): on sm_90 the oracle takes the
    warp-specialised GEMM on blocks of 64, the layer equals its float64 definition, a replay
    with new inputs too, and a call with hooks takes the tiles (they see slot-ordered
    outputs). (Blocks of 128 in two parts: the expert-parallel test below.)"""
    _as_on_hopper(monkeypatch)
    config = _tiny_config()
    assert select_backend(config, 32, kernel_spec(config)).specialized == moe.oracle.NARROW_SPECIALIZED_TILE
    checkpoint = random_checkpoint(config, np.random.default_rng(0))
    layer = MoELayer(config, max_tokens=32)
    layer.load_weights(checkpoint.w1, checkpoint.w2, checkpoint.w3)
    rng = np.random.default_rng(1)
    for _ in range(2):  # recorded, then replayed on new inputs
        hidden = torch.from_numpy(rng.standard_normal((32, 128))).to(torch.bfloat16)
        logits = torch.from_numpy(rng.standard_normal((32, 2)).astype(np.float32))
        expected = reference_moe(config, hidden.float().numpy(), checkpoint.dense_w13, checkpoint.dense_w2,
                                 router_logits=logits.numpy())
        out = layer(hidden.to(DEVICE), logits.to(DEVICE)).float().cpu().numpy()
        assert np.linalg.norm(out - expected) / np.linalg.norm(expected) < 2e-2
    layer.hooks = SeparateReductions()
    hooked = layer(hidden.to(DEVICE), logits.to(DEVICE)).float().cpu().numpy()
    assert np.linalg.norm(hooked - out) / np.linalg.norm(out) < 2e-2


def test_parts_wider_than_a_warpgroup_has_threads(monkeypatch):
    """A tile of one part a block of 256 slots (wgmma's widest N): 150 tokens over two
    experts (150 slots an expert) run as one part each, at width 160, more slots than a
    warpgroup has threads, and the layer equals its float64 definition."""
    _as_on_hopper(monkeypatch)
    tile = SpecializedTile(block_m=256, max_width=256, width_step=32, stages=2)
    monkeypatch.setattr(moe.oracle, "WIDEST_SPECIALIZED_TILE", tile)
    config = _tiny_config()
    backend = select_backend(config, 150, kernel_spec(config))
    assert backend.specialized == tile and backend.block_m == 256
    checkpoint = random_checkpoint(config, np.random.default_rng(4))
    layer = MoELayer(config, max_tokens=150)
    layer.load_weights(checkpoint.w1, checkpoint.w2, checkpoint.w3)
    rng = np.random.default_rng(5)
    hidden = torch.from_numpy(rng.standard_normal((150, 128))).to(torch.bfloat16)
    topk_weights = torch.from_numpy(rng.uniform(0.1, 1.0, (150, 2)).astype(np.float32))
    topk_ids = torch.tensor([[0, 1]] * 150, dtype=torch.int32)  # routed here: the simulator's routing takes a minute
    out = layer.forward(hidden.to(DEVICE), topk=(topk_weights.to(DEVICE), topk_ids.to(DEVICE))).float().cpu().numpy()
    assert layer.workspace.buffers(150, backend).picks.cpu().tolist()[:2] == [4, 4]  # widths 32, 64, .., 160
    expected = reference_moe(config, hidden.float().numpy(), checkpoint.dense_w13, checkpoint.dense_w2,
                             topk=(topk_weights.numpy(), topk_ids.numpy()))
    assert np.linalg.norm(out - expected) / np.linalg.norm(expected) < 2e-2


def test_expert_parallel_ranks_sum_to_the_full_layer(monkeypatch):
    """Two ranks of two experts each, 72 tokens (36 slots an expert): each rank's layer
    runs warp-specialised, and their outputs sum to the full layer's float64 definition.
    No CTA writes gemm2's rows of the slots routed to the other rank (poisoned here): the
    layer zeroes them for the combine."""
    _as_on_hopper(monkeypatch)
    full_config = _tiny_config(num_experts=4)
    checkpoint = random_checkpoint(full_config, np.random.default_rng(2))
    rng = np.random.default_rng(3)
    hidden = torch.from_numpy(rng.standard_normal((72, 128))).to(torch.bfloat16)
    topk_weights = torch.from_numpy(rng.uniform(0.1, 1.0, (72, 2)).astype(np.float32))
    topk_ids = torch.from_numpy(np.argsort(rng.random((72, 4)), axis=1)[:, :2].astype(np.int32))  # routed here
    total = np.zeros((72, 128))
    for layer in rank_layers(full_config, checkpoint, 2, max_tokens=72):
        backend = select_backend(layer.config, 72, kernel_spec(layer.config))
        assert backend.specialized == SpecializedTile()
        layer.workspace.buffers(72, backend).gemm2_out.fill_(float("nan"))
        topk = (topk_weights.to(DEVICE), topk_ids.to(DEVICE))
        total += layer.forward(hidden.to(DEVICE), topk=topk).float().cpu().numpy()
    expected = reference_moe(full_config, hidden.float().numpy(), checkpoint.dense_w13, checkpoint.dense_w2,
                             topk=(topk_weights.numpy(), topk_ids.numpy()))
    assert np.linalg.norm(total - expected) / np.linalg.norm(expected) < 2e-2


def test_oracle_takes_it_only_where_device_slots_and_layout_allow(monkeypatch):
    config = _tiny_config()
    spec = kernel_spec(config)
    assert select_backend(config, 36, spec).specialized is None  # the simulator is no Hopper
    _as_on_hopper(monkeypatch)
    low = moe.oracle.SPECIALIZED_TOKENS_PER_EXPERT
    assert select_backend(config, low, spec).specialized == moe.oracle.NARROW_SPECIALIZED_TILE  # blocks of 64
    assert select_backend(config, low - 1, spec).specialized is None  # too few slots an expert
    large = _tiny_config(hidden_size=1024, intermediate_size=4096)  # 12.6 M weights an expert
    assert select_backend(large, 12, kernel_spec(large)).specialized == moe.oracle.NARROW_SPECIALIZED_TILE
    assert select_backend(large, 11, kernel_spec(large)).specialized is None  # under 12 an expert: decode tiles
    assert select_backend(config, 33, spec).specialized == moe.oracle.SPECIALIZED_TILE  # past 32: blocks of 128
    assert select_backend(config, 80, spec).specialized == moe.oracle.SPECIALIZED_TILE  # a part of a block each
    assert select_backend(config, 81, spec).specialized == moe.oracle.WIDE_SPECIALIZED_TILE  # more: parts of 128
    assert select_backend(config, 127, spec).specialized == moe.oracle.WIDE_SPECIALIZED_TILE
    # from 128 an expert, 256 wide: at 128, about half the experts would take a second part for a few slots
    assert select_backend(config, 128, spec).specialized == moe.oracle.WIDEST_SPECIALIZED_TILE
    assert select_backend(config, 4096, spec).specialized == moe.oracle.WIDEST_SPECIALIZED_TILE
    zeros = _tiny_config(QuantScheme("gptq", bits=4, group_size=64, symmetric=False))
    assert select_backend(zeros, 4096, kernel_spec(zeros)).specialized == moe.oracle.WIDEST_SPECIALIZED_TILE
    assert select_backend(config, 36, spec, specialized=False).specialized is None
    assert select_batched_backend(config, 36, spec).specialized is None  # the batched layout reads no routing
    act_order = _tiny_config(QuantScheme("gptq", bits=4, group_size=64, act_order=True))
    assert select_backend(act_order, 36, kernel_spec(act_order)).specialized is None  # inputs permuted per expert
    assert moe.oracle.specialized_backend(config, 36, formats.marlin(4, 64)) is None  # not the native layout
    ranked = _tiny_config(num_experts=4, expert_map=[0, -1, 1, -1])  # all tokens routed, half of them here
    assert moe.oracle.slots_per_expert(ranked, 72) == 36
    assert select_backend(ranked, 72, kernel_spec(ranked)).specialized is not None
    assert select_backend(ranked, 36, kernel_spec(ranked)).specialized is None  # 18 slots an expert, not 36
    odd = _tiny_config(hidden_size=192)  # w2's 192 features: not whole panels of 128
    assert select_backend(odd, 36, kernel_spec(odd)).specialized is None
    monkeypatch.setattr(moe.oracle, "USE_SPECIALIZED", False)
    assert select_backend(config, 36, spec).specialized is None


def test_workspace_sizes_its_buffers_for_the_calls_the_oracle_runs_so(monkeypatch):
    """The stage blocks and the parts' widths fit the most slots a call the oracle runs
    warp-specialised can have: up to 64 an expert on the narrow tile (taken up to 32), 80 on
    the tile of blocks of 128, under 128 on the wide one, every slot of max_tokens on the
    widest."""
    _as_on_hopper(monkeypatch)
    config = _tiny_config()
    assert moe.oracle.specialized_slots(config, 4096, moe.oracle.NARROW_SPECIALIZED_TILE) == 128  # 64 an expert
    assert moe.oracle.specialized_slots(config, 4096, moe.oracle.SPECIALIZED_TILE) == 160  # 80 an expert, of 8192
    assert moe.oracle.specialized_slots(config, 4096, moe.oracle.WIDE_SPECIALIZED_TILE) == 256  # 128 an expert
    assert moe.oracle.specialized_slots(config, 4096, moe.oracle.WIDEST_SPECIALIZED_TILE) == 8192
    workspace = Workspace(config, 4096, kernel_spec(config))
    for tokens, tile in ((32, moe.oracle.NARROW_SPECIALIZED_TILE), (80, moe.oracle.SPECIALIZED_TILE),
                         (100, moe.oracle.WIDE_SPECIALIZED_TILE), (4096, moe.oracle.WIDEST_SPECIALIZED_TILE)):
        slots = tokens * config.top_k
        parts = align_sizes(slots, config.num_experts, tile.block_m)[1] * tile.sub_blocks
        buffers = workspace.buffers(tokens, select_backend(config, tokens, kernel_spec(config)))
        assert buffers.picks.numel() == parts and buffers.gemm2_out.shape == (slots + 1, 128)
        assert buffers.stage_blocks.numel() >= parts * 2 * tile.block_words()  # gemm1 K = 128: two stages
    plain = workspace.buffers(80, select_backend(config, 80, kernel_spec(config), specialized=False))
    assert plain.picks is None and plain.gemm1_out.shape[-2:] == (160, 128)  # slot rows (split or not), 2 I


def test_backends_round_trip_through_the_tuned_tables_format():
    tile = moe.oracle.PREFILL_TILE
    plain = Backend(64, tile, tile)
    assert backend_to_dict(plain)["specialized"] is None and backend_from_dict(backend_to_dict(plain)) == plain
    specialized = moe.oracle.warp_specialised(SpecializedTile())
    assert specialized == Backend(128, attrs.evolve(tile, block_m=128), attrs.evolve(tile, block_m=128),
                                  SpecializedTile())
    assert backend_from_dict(backend_to_dict(specialized)) == specialized
    with pytest.raises(ValueError, match="alignment block size"):
        Backend(64, tile, tile, SpecializedTile())


def test_bad_configurations_fail_by_name():
    for fields in (dict(width_step=12), dict(block_m=512, max_width=512), dict(block_m=64), dict(max_width=72),
                   dict(stages=1)):
        with pytest.raises(ValueError, match="width_step must be a multiple of 8"):
            SpecializedTile(**fields)
    assert SpecializedTile().widths == (16, 32, 48, 64, 80) and SpecializedTile().sub_blocks == 2
    assert SpecializedTile().min_ctas_per_sm == 2 and SpecializedTile(max_width=128).min_ctas_per_sm == 1
    spec = formats.native(4, 128)
    assert specialized_supported(spec, 256, 4096, "bfloat16")
    for n, k in ((256, 4096 + 16), (192, 4096)):  # K in whole stages of 64, N in whole panels of 128
        assert not specialized_supported(spec, n, k, "bfloat16")
        with pytest.raises(ValueError, match="cannot run on the warp-specialised GEMM"):
            make_specialized_kernel(spec, n, k, "bfloat16", SpecializedTile(), True)
    assert not specialized_supported(formats.marlin(4, 128), 256, 4096, "bfloat16")


def test_the_tuner_times_it_and_the_oracle_takes_what_it_measured(tmp_path, monkeypatch):
    """On "Hopper" the tuner times the warp-specialised backend beside the tile pairs (its
    gather, GEMMs, activation and combine in one replay) and saves it where it is the
    fastest; the oracle then takes it from the table (at the tile the token count takes),
    but not for calls that need tiles (hooks)."""
    from moe.tune import save, tune

    monkeypatch.setattr(moe.oracle, "TUNED_DIR", tmp_path)
    moe.oracle.tuned_tables.cache_clear()
    monkeypatch.setattr(moe.oracle, "specialized_device", lambda: True)
    config = _tiny_config()
    tile = GemmTile(block_m=16, warps_k=2, slabs_per_warp=1)
    timed = []

    def measure(replay, subject):  # the warp-specialised run scripted fastest
        timed.append((subject, len(replay.launchers)))
        return 1.0 if isinstance(subject, Backend) and subject.specialized else 2.0

    try:
        best = tune(config, [32], measure=measure, candidates=lambda tokens, config, k: [tile], progress=False,
                    routings=1)
        assert best[32] == moe.oracle.warp_specialised(moe.oracle.NARROW_SPECIALIZED_TILE)
        assert (best[32], 6) in timed  # alignment, gather, gemm1, activation, gemm2, combine
        save(config, best)
        spec = kernel_spec(config)
        assert select_backend(config, 32, spec) == best[32]
        assert select_backend(config, 32, spec, specialized=False).specialized is None
        wide = select_backend(config, 100, spec)  # 100 slots an expert, in the entry's reach: the wide tile
        assert wide == moe.oracle.warp_specialised(moe.oracle.WIDE_SPECIALIZED_TILE)
        assert moe.oracle.specialized_candidate(config, 8, spec)  # timed from 8 slots an expert
        assert not moe.oracle.specialized_candidate(config, 7, spec)
    finally:
        moe.oracle.tuned_tables.cache_clear()


def test_tiles_measured_faster_leave_larger_counts_to_the_untuned_choice(tmp_path, monkeypatch):
    """An entry that found the tiles faster at its count ("specialized": null) holds from
    that count until the untuned choice takes the warp-specialised GEMM (which gains with
    the slots an expert); where the untuned choice took it at the entry's count already,
    the measurement holds over the entry's whole reach."""
    from moe.tune import save

    monkeypatch.setattr(moe.oracle, "TUNED_DIR", tmp_path)
    _as_on_hopper(monkeypatch)
    tiles = Backend(16, GemmTile(block_m=16), GemmTile(block_m=16))
    small, large = _tiny_config(), _tiny_config(hidden_size=1024, intermediate_size=4096)
    try:
        for config in (small, large):
            save(config, {16: tiles})  # 16 slots an expert: two experts, top 2
        spec = kernel_spec(small)
        assert select_backend(small, 16, spec) == tiles
        assert select_backend(small, 31, spec) == tiles  # the untuned choice takes it from 32 slots an expert
        assert select_backend(small, 32, spec).specialized == moe.oracle.NARROW_SPECIALIZED_TILE
        assert select_backend(small, 63, spec).specialized == moe.oracle.SPECIALIZED_TILE
        assert moe.oracle.specialized_backend(large, 16, kernel_spec(large)) is not None  # large experts: from 12
        assert all(select_backend(large, m, kernel_spec(large)) == tiles for m in (16, 32, 63))
    finally:
        moe.oracle.tuned_tables.cache_clear()


def test_bad_arguments_fail_by_name_before_any_kernel():
    spec = formats.native(4, 64)
    weights, _ = _weights(spec, (3, 128, 128), np.random.default_rng(0))
    ids = torch.tensor([[0, 1]] * 4, dtype=torch.int32)
    alignment = tuple(t.to(DEVICE) for t in moe_align_block_size(ids, TILE.block_m, 3))
    blocks = alignment[1].shape[0]
    hidden = torch.zeros(4, 128, dtype=torch.bfloat16, device=DEVICE)
    picks = torch.zeros(blocks * TILE.sub_blocks, dtype=torch.int32, device=DEVICE)
    stage = torch.zeros(picks.numel() * 2 * TILE.block_words(), dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="source must be a"):
        gather_blocks(hidden.float(), alignment, 8, 2, TILE, picks, stage)
    with pytest.raises(ValueError, match="tokens x divisor = num_slots"):
        gather_blocks(hidden, alignment, 9, 2, TILE, picks, stage)
    with pytest.raises(ValueError, match="picks must have shape"):
        gather_blocks(hidden, alignment, 8, 2, TILE, picks[1:], stage)
    with pytest.raises(ValueError, match="blocks must hold"):
        gather_blocks(hidden, alignment, 8, 2, TILE, picks, stage[:-4])
    with pytest.raises(ValueError, match="blocks must start at a 16-byte aligned address"):  # 16-byte stores
        gather_blocks(hidden, alignment, 8, 2, TILE, picks, stage[1:])
    with pytest.raises(TypeError, match="tile must be a SpecializedTile"):
        gather_blocks(hidden, alignment, 8, 2, moe.oracle.PREFILL_TILE, picks, stage)
    out = torch.zeros(9, 128, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=r"expert_ids must lie in \[-1, 3\)"):
        bad = alignment[1].clone()
        bad[0] = 3
        specialized_gemm(stage, weights, picks, bad, alignment[0], out, TILE, blocked=False)
    with pytest.raises(ValueError, match="out must have a row per slot of each block"):
        specialized_gemm(stage, weights, picks, alignment[1], alignment[0], out, TILE, blocked=True)
    with pytest.raises(ValueError, match="out must have shape"):
        specialized_gemm(stage, weights, picks, alignment[1], alignment[0], out[:, :64], TILE, blocked=False)
    with pytest.raises(ValueError, match="out must start at a 16-byte aligned address"):  # 16-byte stores
        shifted = torch.zeros(9 * 128 + 4, dtype=torch.bfloat16, device=DEVICE)[4:].view(9, 128)  # 8 bytes in
        specialized_gemm(stage, weights, picks, alignment[1], alignment[0], shifted, TILE, blocked=False)
    with pytest.raises(TypeError, match="weights must be KernelWeights"):
        specialized_gemm(stage, weights.tensors, picks, alignment[1], alignment[0], out, TILE, blocked=False)
    gate_up = torch.zeros(blocks * TILE.block_m, 256, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="gate_up must be"):
        activate_blocks(gate_up[1:], Activation("silu"), TILE, picks, stage)
    with pytest.raises(TypeError, match="activation must be an Activation"):
        activate_blocks(gate_up, "silu", TILE, picks, stage)
