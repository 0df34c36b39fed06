"""The runner on the real GPU: eager replays with new inputs, no allocation per forward
after warm-up, CUDA-graph capture and replay with new inputs, bounded memory while
converting checkpoints, correct results on two streams at once, DLPack inputs from CuPy
and JAX, prefill tiles (act-order weights too), the batched layout, the tuner's timing, and every tuned entry of
this device's table on its own shape."""

import gc

import numpy as np
import pytest
import torch
from fusing import SeparateReductions, evolve_every_tile, fuse_every_tile
from ranks import rank_layers

import moe.oracle
from moe import BatchedWorkspace, MoEConfig, MoELayer, QuantScheme, batched_moe, fused_moe, select_backend
from moe.oracle import device_architecture, shape_key, tuned_entries, tuned_tables
from moe.reference import random_checkpoint, reference_moe
from moe.tune import tune
from moe.weights import kernel_spec
from numba_kernels.activation import reference_activate
from numba_kernels.gemm import GemmTile
from numba_kernels.ptx import SIMULATED

pytestmark = pytest.mark.gpu

SMALL = dict(num_experts=16, top_k=4, hidden_size=512, intermediate_size=256)


def _inputs(config, tokens, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(tokens, config.hidden_size, generator=generator, device="cuda").to(torch.bfloat16)
    logits = torch.randn(tokens, config.num_experts, generator=generator, device="cuda")
    return hidden, logits


@pytest.fixture(scope="module")
def layer():
    config = MoEConfig(**SMALL, quant=QuantScheme("gptq", group_size=128))
    checkpoint = random_checkpoint(config, np.random.default_rng(0))
    layer = MoELayer(config, max_tokens=64)
    layer.load_weights(checkpoint.w1, checkpoint.w2, checkpoint.w3)
    layer.checkpoint = checkpoint
    return layer


def _reference(layer, hidden, logits):
    return reference_moe(layer.config, hidden.float().cpu().numpy(), layer.checkpoint.dense_w13,
                         layer.checkpoint.dense_w2, router_logits=logits.cpu().numpy())


def _error(got, expected):
    return np.linalg.norm(got.float().cpu().numpy() - expected) / np.linalg.norm(expected)


def test_forward_allocates_no_device_memory_after_warm_up(layer):
    hidden, logits = _inputs(layer.config, 16, 0)
    layer(hidden, logits)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(3):
        layer(hidden, logits)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before


@pytest.mark.parametrize("tokens", [1, 48])
def test_eager_replays_read_each_calls_inputs(layer, tokens):
    for seed in (10, 11, 12):  # the first call records, the others replay
        hidden, logits = _inputs(layer.config, tokens, seed)
        assert _error(layer(hidden, logits), _reference(layer, hidden, logits)) < 2e-2


@pytest.mark.parametrize("tokens", [1, 48])
def test_cuda_graph_replays_with_new_inputs(layer, tokens):
    hidden, logits = _inputs(layer.config, tokens, 1)
    static_hidden, static_logits = hidden.clone(), logits.clone()
    layer(static_hidden, static_logits)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_hidden, static_logits)
    for seed in (2, 3):
        new_hidden, new_logits = _inputs(layer.config, tokens, seed)
        static_hidden.copy_(new_hidden)
        static_logits.copy_(new_logits)
        graph.replay()
        torch.cuda.synchronize()
        assert _error(static_out, _reference(layer, new_hidden, new_logits)) < 2e-2


def test_two_streams_compute_independently(layer):
    config = layer.config
    other = MoELayer(config, max_tokens=64)
    other.weights = layer.weights
    inputs = [_inputs(config, 32, seed) for seed in (4, 5)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outputs = []
    for (hidden, logits), stream, module in zip(inputs, streams, (layer, other)):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            outputs.append(module(hidden, logits))
    torch.cuda.synchronize()
    for (hidden, logits), out in zip(inputs, outputs):
        assert _error(out, _reference(layer, hidden, logits)) < 2e-2


def test_inputs_off_the_gpu_are_refused_by_name(layer):
    hidden, logits = _inputs(layer.config, 2, 6)
    with pytest.raises(ValueError, match=r"hidden_states must be on cuda:\d"):
        layer(hidden.cpu(), logits)
    with pytest.raises(ValueError, match=r"router_logits must be on cuda:\d"):
        layer(hidden, logits.cpu())


def test_checkpoint_conversion_needs_about_one_expert_of_extra_memory():
    config = MoEConfig(num_experts=8, top_k=2, hidden_size=2048, intermediate_size=768,
                       quant=QuantScheme("gptq", group_size=128))
    checkpoint = random_checkpoint(config, np.random.default_rng(1))
    layer = MoELayer(config, max_tokens=16)
    gc.collect()  # an earlier test's garbage freed during the conversion made memory_allocated drop below resident
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    layer.load_weights(checkpoint.w1, checkpoint.w2, checkpoint.w3)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - resident
    one_expert = sum(np.asarray(w[name][0]).nbytes for w in (checkpoint.w1, checkpoint.w2, checkpoint.w3) for name in w)
    print(f"conversion peak: {extra / 1e6:.2f} MB over the kernel buffers; one checkpoint expert {one_expert / 1e6:.2f} MB")
    assert extra <= 2 * one_expert + (1 << 20)
    assert torch.cuda.memory_allocated() == resident  # no pre-conversion tensor stays alive


def test_dlpack_inputs_from_cupy_and_jax(layer):
    hidden, logits = _inputs(layer.config, 8, 6)
    expected = _reference(layer, hidden, logits)
    cupy = pytest.importorskip("cupy")
    out = layer(cupy.from_dlpack(hidden), cupy.from_dlpack(logits))
    assert _error(out, expected) < 2e-2
    jax = pytest.importorskip("jax")
    jax_hidden = jax.dlpack.from_dlpack(hidden)
    jax_logits = jax.dlpack.from_dlpack(logits)
    out = layer(jax_hidden, jax_logits)
    assert _error(out, expected) < 2e-2


def test_prefill_batch_takes_the_shared_memory_tiles(layer, monkeypatch):
    """The tiles, that is: on Hopper the oracle takes the warp-specialised GEMM first there."""
    monkeypatch.setattr(moe.oracle, "USE_SPECIALIZED", False)
    big = MoELayer(layer.config, max_tokens=512)  # 128 slots per expert
    big.weights = layer.weights
    hidden, logits = _inputs(layer.config, 512, 7)
    assert select_backend(layer.config, 512, layer.weights.spec).gemm1.a_in_shared
    assert _error(big(hidden, logits), _reference(layer, hidden, logits)) < 2e-2


def test_act_order_layer_takes_the_prefill_tiles():
    """Act-order weights read as plain tiles of the permuted weight: prefill tiles at
    512 tokens, decode tiles at 3, each equal to the reference."""
    config = MoEConfig(**SMALL, quant=QuantScheme("gptq", group_size=128, act_order=True))
    checkpoint = random_checkpoint(config, np.random.default_rng(2))
    act_order = MoELayer(config, max_tokens=512)
    act_order.load_weights(checkpoint.w1, checkpoint.w2, checkpoint.w3)
    act_order.checkpoint = checkpoint
    assert act_order.weights.permutes_inputs
    assert select_backend(config, 512, act_order.weights.spec).gemm1.a_in_shared
    for tokens in (3, 512):
        hidden, logits = _inputs(config, tokens, 9)
        assert _error(act_order(hidden, logits), _reference(act_order, hidden, logits)) < 2e-2


def test_batched_layout_matches_each_experts_reference(layer):
    """The first call records its launches, the next two replay them (one CUDA graph) on
    new rows and counts; a replay once read stale activations (activation_kernel)."""
    config, checkpoint = layer.config, layer.checkpoint
    generator = torch.Generator(device="cuda").manual_seed(8)
    tokens_per_expert = 96
    workspace = BatchedWorkspace(config, tokens_per_expert, layer.weights.spec)
    for _ in range(3):
        hidden = torch.randn(config.num_experts, tokens_per_expert, config.hidden_size, generator=generator,
                             device="cuda").to(torch.bfloat16)
        counts = torch.randint(0, tokens_per_expert + 1, (config.num_experts,), generator=generator, device="cuda",
                               dtype=torch.int32)
        out = batched_moe(hidden, counts, layer.weights, config, workspace=workspace).float().cpu().numpy()
        x = hidden.double().cpu().numpy()
        for expert, count in enumerate(counts.tolist()):
            if count:
                intermediate = reference_activate(x[expert, :count] @ checkpoint.dense_w13[expert].T, config.activation)
                expected = intermediate @ checkpoint.dense_w2[expert].T
                assert np.linalg.norm(out[expert, :count] - expected) / np.linalg.norm(expected) < 2e-2
    assert len(workspace.programs) == 1


def test_replays_beside_other_work_give_the_plain_launches_bits():
    """Launched early, gemm2 loads its first weights before it waits for the activation
    kernel, and its activations after. Loaded through the read-only path, ptxas issued
    the first activation loads before the wait, and a replay now and then read them
    before they were written when other work shared the GPU (Qwen3 M = 1 on the H200:
    3 to 5 in 800 to 2500 replays; `benchmarks/replay_stress.py`). A thousand replays on
    four inputs, bf16 matmuls on another stream meanwhile, must each give the bits of
    plain launches (a fresh workspace's first call)."""
    config = MoEConfig(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768,
                       quant=QuantScheme("native", bits=4, group_size=128))
    layer = MoELayer(config, max_tokens=1)
    layer.weights.fill_random(seed=2)
    inputs = [_inputs(config, 1, seed) for seed in range(4)]
    plain = [fused_moe(*pair, layer.weights, config).clone() for pair in inputs]
    side, load = torch.cuda.Stream(), torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    differed = []
    for round_ in range(1000):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(round_ % 4):
                torch.mm(load, load)
        got = layer(*inputs[round_ % 4])
        if not torch.equal(got.view(torch.int16), plain[round_ % 4].view(torch.int16)):
            differed.append(round_)
    torch.cuda.synchronize()
    assert not differed, f"replays {differed[:10]} of 1000 differed from plain launches"


def test_tuner_times_candidates_with_cuda_graphs():
    config = MoEConfig(**SMALL, quant=QuantScheme("native", bits=4, group_size=128))
    tiles = [GemmTile(block_m=16, warps_k=4, slabs_per_warp=2), GemmTile(block_m=16, warps_k=2, slabs_per_warp=4)]
    best = tune(config, [4], candidates=lambda tokens, config, k: tiles, progress=False)
    assert best[4].gemm1 in tiles and best[4].gemm2 in tiles


@pytest.mark.parametrize("tokens", [1, 4, 512])
def test_releasing_the_next_kernel_early_changes_no_bit(tokens, monkeypatch):
    """`GemmTile.release_early` moves only where a GEMM lets the next kernel's CTAs start
    (they then wait beside its main loop): replayed with early launch, decode and prefill
    tiles (not the warp-specialised GEMM the oracle takes first on Hopper at 512), the
    layer's output must not change by a bit."""
    monkeypatch.setattr(moe.oracle, "USE_SPECIALIZED", False)
    config = MoEConfig(**SMALL, quant=QuantScheme("gptq", group_size=128))
    outputs = {}
    for early in (False, True):
        with monkeypatch.context() as patch:
            select = evolve_every_tile(patch, moe.oracle.select_backend, release_early=early)
            assert select(config, tokens, kernel_spec(config)).gemm1.release_early == early
            layer = MoELayer(config, max_tokens=tokens)
            layer.weights.fill_random(seed=4)
            for seed in (6, 7, 7):  # the first call records; the others replay the graph
                hidden, logits = _inputs(config, tokens, seed)
                outputs[early] = layer(hidden, logits).clone()
    assert torch.isfinite(outputs[False].float()).all()
    assert torch.equal(outputs[False].view(torch.int16), outputs[True].view(torch.int16))


def _tuned_entries() -> list:
    """(shape key, token count) of every tuned entry this device's architecture ships."""
    tables = {} if SIMULATED else tuned_tables(device_architecture())
    keys = sorted({key for table in tables.values() for key in table})
    return [(key, m) for key in keys for m in sorted({int(m) for table in tables.values() for m in table.get(key, {})})]


def _config_of(key: str) -> MoEConfig:
    fields = dict(part.split("=") for part in key.split(","))
    quant = (QuantScheme("nvfp4") if fields["spec"] == "native_nvfp4"
             else QuantScheme("native", bits=4, group_size=int(fields["group"]),
                              symmetric=fields.get("zero_points") != "true"))
    config = MoEConfig(num_experts=int(fields["E"]), top_k=int(fields["top_k"]), hidden_size=int(fields["H"]),
                       intermediate_size=int(fields["I"]), quant=quant)
    assert shape_key(config, kernel_spec(config)) == key
    return config


@pytest.mark.parametrize("key,tokens", _tuned_entries())
def test_tuned_entries_compute_what_the_heuristic_computes(key, tokens, monkeypatch):
    """A tuned entry picks tiles that the shape-generic tests may not have drawn (a K split,
    a warp count) on the real shape: its layer must agree with the heuristic's tiles. The
    warp-specialised GEMM runs only where the entry itself names it: where the oracle takes
    it without an entry's say (prefill counts on Hopper), it has tests of its own."""
    config = _config_of(key)
    if tuned_entries(config, kernel_spec(config))[1].get(str(tokens), {}).get("specialized") is None:
        monkeypatch.setattr(moe.oracle, "USE_SPECIALIZED", False)
    tuned = MoELayer(config, max_tokens=tokens)
    tuned.weights.fill_random(seed=3)
    hidden, logits = _inputs(config, tokens, 5)
    chosen = select_backend(config, tokens, tuned.weights.spec)
    got = tuned(hidden, logits).float()
    monkeypatch.setattr(moe.oracle, "USE_TUNED", False)
    monkeypatch.setattr(moe.oracle, "USE_SPECIALIZED", False)
    if select_backend(config, tokens, tuned.weights.spec) == chosen:
        pytest.skip("the tuned entry is the heuristic's choice")
    # The same weights through a workspace of its own: a second layer would allocate a
    # second set of weights (DeepSeek's 5.6 GB), and sixteen test workers share one GPU.
    expected = fused_moe(hidden, logits, tuned.weights, config).float()
    assert torch.isfinite(expected).all()
    assert (torch.linalg.norm(got - expected) / torch.linalg.norm(expected)).item() < 1e-2


REALISTIC = {"qwen3": dict(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768),
             "mixtral": dict(num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336)}


def _fused_equals_separate(layer, hidden, logits, label: str) -> torch.Tensor:
    """The layer's output as it runs (fused reductions) equals, bit for bit, the output
    with the reductions as kernels of their own; returns the latter."""
    fused = layer(hidden, logits).clone()
    layer.hooks = SeparateReductions()
    separate = layer(hidden, logits).clone()
    layer.hooks = None
    assert torch.isfinite(separate).all()
    assert torch.equal(fused.view(torch.int16), separate.view(torch.int16)), label
    return separate


@pytest.mark.long(70)
@pytest.mark.parametrize("shape", sorted(REALISTIC))
@pytest.mark.parametrize("quant", [QuantScheme("native", bits=4, group_size=128), QuantScheme("nvfp4")])
def test_fused_reductions_equal_the_separate_kernels_bit_for_bit(shape, quant, monkeypatch):
    """Decode GEMMs that finish the activation and the combine in their last CTAs
    (thousands of CTAs racing for the counters here): the same bits as the separate
    kernels, in eager calls and in 20 replays of a CUDA graph, the counters back at zero."""
    select_fused = fuse_every_tile(monkeypatch, moe.oracle.select_backend)
    config = MoEConfig(**REALISTIC[shape], quant=quant)
    layer = MoELayer(config, max_tokens=16)
    layer.weights.fill_random(seed=4)
    for tokens in (1, 4, 16):
        hidden, logits = _inputs(config, tokens, tokens)
        separate = _fused_equals_separate(layer, hidden, logits, f"M={tokens}")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(hidden, logits)
        for _ in range(20):
            static_out.zero_()
            graph.replay()
            assert torch.equal(static_out.view(torch.int16), separate.view(torch.int16)), f"M={tokens}, replayed"
        torch.cuda.synchronize()
        backend = select_fused(config, tokens, layer.weights.spec)
        assert backend.gemm1.fused_reduction and not backend.gemm1.a_in_shared
        assert not layer.workspace.buffers(tokens, backend).arrivals.any()


@pytest.mark.long(85)
@pytest.mark.parametrize("shape", sorted(REALISTIC))
@pytest.mark.parametrize("quant", [QuantScheme("native", bits=4, group_size=128), QuantScheme("nvfp4")])
def test_prefill_gemm1_finishing_the_activation_equals_the_separate_kernels(shape, quant, monkeypatch):
    """Prefill gemm1 tiles that finish the activation in their epilogue (the gate and up
    warps of a pair swap half their tiles through shared memory), at the saved entries'
    token counts: the same bits as the activation kernel on gemm1's half outputs. The
    tiles, that is, not the warp-specialised GEMM the oracle takes first on Hopper."""
    monkeypatch.setattr(moe.oracle, "USE_SPECIALIZED", False)
    select_fused = fuse_every_tile(monkeypatch, moe.oracle.select_backend)
    config = MoEConfig(**REALISTIC[shape], quant=quant)
    layer = MoELayer(config, max_tokens=4096)
    layer.weights.fill_random(seed=5)
    paired = 0
    for tokens in (256, 1024, 4096):
        backend = select_fused(config, tokens, layer.weights.spec)
        if not (backend.gemm1.a_in_shared and moe.oracle.fused_activation_kind(config, backend.gemm1)):
            continue
        paired += 1
        hidden, logits = _inputs(config, tokens, tokens)
        _fused_equals_separate(layer, hidden, logits, f"M={tokens}")
    assert paired


@pytest.mark.parametrize("quant", [QuantScheme("gptq", group_size=128),
                                   QuantScheme("gptq", group_size=128, symmetric=False),
                                   QuantScheme("nvfp4", nvfp4_checkpoint="modelopt")], ids=["int4", "zeros", "nvfp4"])
@pytest.mark.parametrize("tokens", [pytest.param(128, marks=pytest.mark.long(75)),
                                    pytest.param(256, marks=pytest.mark.long(100)),
                                    pytest.param(1024, marks=pytest.mark.long(190))])
def test_warp_specialised_layer_matches_the_reference(quant, tokens, monkeypatch):
    """At 32 slots an expert on Hopper the oracle takes the warp-specialised GEMM on blocks of
    64, at 64 on blocks of 128 (each block's part at the width its count needs), at 256 its
    widest tile (parts of up to 256 slots, a launch bound of one CTA an SM; zero points too,
    though they spill): the layer equals its float64 definition, a replay (new inputs) gives
    what the tiles give, and the same bits every time (with the wait for the last wgmma
    after the main loop, ptxas read the accumulators before it, and a run missed the last
    stage at random)."""
    config = MoEConfig(num_experts=8, top_k=2, hidden_size=1024, intermediate_size=512, quant=quant)
    backend = select_backend(config, tokens, kernel_spec(config))
    if backend.specialized is None:
        pytest.skip("the warp-specialised GEMM runs on sm_90 only")
    assert backend.specialized == moe.oracle.specialized_tile(config, tokens)
    checkpoint = random_checkpoint(config, np.random.default_rng(1))
    layer, plain = MoELayer(config, max_tokens=tokens), MoELayer(config, max_tokens=tokens)
    layer.load_weights(checkpoint.w1, checkpoint.w2, checkpoint.w3)
    layer.checkpoint = checkpoint
    for seed in (0, 1):
        hidden, logits = _inputs(config, tokens, seed)
        out = layer(hidden, logits).clone()
        assert _error(out, _reference(layer, hidden, logits)) < 2e-2
    assert torch.equal(layer(hidden, logits), out)
    plain.weights = layer.weights
    monkeypatch.setattr(moe.oracle, "USE_SPECIALIZED", False)
    expected = plain(hidden, logits)
    assert torch.allclose(out.float(), expected.float(), rtol=2e-2, atol=2e-2 * float(expected.abs().max()))


@pytest.mark.long(65)
def test_warp_specialised_expert_parallel_ranks_sum_to_the_layer(monkeypatch):
    """Two ranks of four experts each, 128 tokens (32 slots an expert): each rank's layer
    runs warp-specialised, recorded and replayed, and the ranks' outputs sum to the full
    layer's float64 definition (the other rank's slots add nothing)."""
    full = MoEConfig(num_experts=8, top_k=2, hidden_size=1024, intermediate_size=512, quant=QuantScheme("gptq"))
    checkpoint = random_checkpoint(full, np.random.default_rng(2))
    hidden, logits = _inputs(full, 128, 3)
    total = 0
    for layer in rank_layers(full, checkpoint, 2, max_tokens=128):
        if select_backend(layer.config, 128, kernel_spec(layer.config)).specialized is None:
            pytest.skip("the warp-specialised GEMM runs on sm_90 only")
        layer(hidden, logits)  # recorded; the replay below is what counts
        total = total + layer(hidden, logits).float()
    expected = reference_moe(full, hidden.float().cpu().numpy(), checkpoint.dense_w13, checkpoint.dense_w2,
                             router_logits=logits.cpu().numpy())
    assert _error(total, expected) < 2e-2


@pytest.mark.long(70)
@pytest.mark.parametrize("quant", [QuantScheme("native", bits=4, group_size=128), QuantScheme("nvfp4")])
def test_large_experts_run_warp_specialised_from_twelve_slots_an_expert(quant, monkeypatch):
    """Mixtral's experts (176 M weights) take the warp-specialised GEMM untuned from
    LARGE_EXPERT_TOKENS_PER_EXPERT slots an expert (48 tokens: 12), inside the decode regime,
    on blocks of 64 that are mostly padding: the layer at the real shape gives what the
    decode tiles give, and the same bits every call."""
    config = MoEConfig(**REALISTIC["mixtral"], quant=quant)
    tokens = 48
    assert moe.oracle.slots_per_expert(config, tokens) == moe.oracle.LARGE_EXPERT_TOKENS_PER_EXPERT
    monkeypatch.setattr(moe.oracle, "USE_TUNED", False)
    layer = MoELayer(config, max_tokens=tokens)
    backend = select_backend(config, tokens, layer.weights.spec)
    if backend.specialized is None:
        pytest.skip("the warp-specialised GEMM runs on sm_90 only")
    assert backend.specialized == moe.oracle.NARROW_SPECIALIZED_TILE
    layer.weights.fill_random(seed=6)
    hidden, logits = _inputs(config, tokens, 8)
    got = layer(hidden, logits).clone()
    assert torch.equal(layer(hidden, logits), got)
    monkeypatch.setattr(moe.oracle, "USE_SPECIALIZED", False)
    assert select_backend(config, tokens, layer.weights.spec).specialized is None
    expected = fused_moe(hidden, logits, layer.weights, config).float()
    assert torch.isfinite(expected).all()
    assert (torch.linalg.norm(got.float() - expected) / torch.linalg.norm(expected)).item() < 1e-2
