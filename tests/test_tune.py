"""The tuner keeps the fastest measured tile per GEMM and block size, writes the device's
table, and the oracle then picks the tuned backend."""

import io
import re

import attrs
import pytest
import torch

import moe.oracle
import moe.tune
from layouts import formats
from moe import MoEConfig, QuantScheme, select_backend
from moe.oracle import Backend, activation_finishable
from moe.tune import (ProgressBar, candidate_tiles, other_format_tiles, paired_decode, refine_candidates, save,
                      split_variants, tune)
from moe.weights import kernel_spec
from numba_kernels.align import launch_shape, make_align_kernel
from numba_kernels.gemm import GemmTile
from numba_kernels.interop import SIMULATED

CONFIG = MoEConfig(num_experts=2, top_k=2, hidden_size=32, intermediate_size=64,
                   quant=QuantScheme("native", bits=4, group_size=32))
SLOW = GemmTile(block_m=16, warps_k=1, slabs_per_warp=1)
FAST = GemmTile(block_m=16, warps_k=2, slabs_per_warp=1, fused_reduction=True)


@pytest.fixture
def empty_tuned_dir(tmp_path, monkeypatch):
    """The oracle and the tuner on an empty directory of tuned tables (the heuristic's
    choices until a test saves one, whatever this device tuned)."""
    monkeypatch.setattr(moe.oracle, "TUNED_DIR", tmp_path)
    moe.oracle.tuned_tables.cache_clear()
    yield tmp_path
    moe.oracle.tuned_tables.cache_clear()


def test_tuner_keeps_the_fastest_tiles_and_the_oracle_reads_them(empty_tuned_dir, monkeypatch):
    launched, ready = [], []
    gemm = moe.tune.grouped_gemm

    def noting_readiness(*args, alignment_ready=False, **kwargs):
        ready.append(alignment_ready)
        return gemm(*args, alignment_ready=alignment_ready, **kwargs)

    monkeypatch.setattr(moe.tune, "grouped_gemm", noting_readiness)

    slots = 2 * CONFIG.top_k
    aligner = make_align_kernel(CONFIG.num_experts, 16, launch_shape(slots, CONFIG.num_experts)[1], "none")

    def measure(replay, subject):  # a scripted time (the launches ran when `replaying` recorded them)
        assert replay.launchers[0].kernel is aligner  # every replay starts as the layer's GEMMs do
        launched.append((subject, len(replay.launchers) - 1))
        if isinstance(subject, Backend):  # a pair of finalists: the other way round in this script
            return 1.0 if (subject.gemm1, subject.gemm2) == (SLOW, FAST) else 3.0
        return 1.0 if subject == FAST else 2.0

    finished = {}
    best = tune(CONFIG, [2], measure=measure, candidates=lambda tokens, config, k: [SLOW, FAST], progress=False,
                routings=2, finished=finished.__setitem__)
    assert finished == best  # each count handed over as soon as it is chosen
    # each tile timed on both routings, each GEMM with the reduction that reads its output:
    # a kernel of its own, or finished by the GEMM (fused_reduction, one launch)
    assert launched[:8] == [(SLOW, 2), (SLOW, 2), (FAST, 1), (FAST, 1)] * 2
    # then the finalists (here both tiles of each GEMM) in pairs, both GEMMs in one replay
    pairs = [(Backend(16, one, two), launches) for one, two, launches in
             ((FAST, FAST, 2), (FAST, SLOW, 3), (SLOW, FAST, 3), (SLOW, SLOW, 4))]
    assert sorted(launched[8:], key=repr) == sorted([pair for pair in pairs for _ in range(2)], key=repr)
    # alone a GEMM waits for the alignment; in a pair gemm2 comes after gemm1, the alignment ready
    assert ready == [False] * 8 + [False, True] * 8
    assert best[2] == Backend(16, SLOW, FAST)  # the fastest pair, not the fastest tiles alone

    path = save(CONFIG, best)
    assert path == str(empty_tuned_dir / moe.oracle.device_architecture() / f"{moe.oracle.device_name()}.json")
    assert select_backend(CONFIG, 2, kernel_spec(CONFIG)) == best[2]
    assert select_backend(CONFIG, 7, kernel_spec(CONFIG)) == best[2]  # largest measured M not above...
    assert select_backend(CONFIG, 8, kernel_spec(CONFIG)) != best[2]  # ...within TUNED_REACH = 4 times it
    assert select_backend(CONFIG, 1, kernel_spec(CONFIG)) != best[2]  # below every entry: the heuristic


def test_a_device_without_a_table_takes_its_architecture_siblings(empty_tuned_dir, monkeypatch):
    """An untuned GPU (an H100) takes the entries another GPU of its architecture measured
    (an H200's), shape by shape; its own entries win, token count by token count, once it
    has them; NUMBA_MOE_TUNED=0 (`USE_TUNED`) leaves the heuristic."""
    spec = kernel_spec(CONFIG)
    heuristic = select_backend(CONFIG, 2, spec)
    sibling, other = Backend(16, SLOW, FAST), Backend(16, FAST, SLOW)
    assert heuristic not in (sibling, other)
    save(CONFIG, {2: other}, device="Z_GPU")
    save(CONFIG, {2: sibling, 8: sibling}, device="A_GPU")  # two siblings: the first by name serves
    save(attrs.evolve(CONFIG, hidden_size=64), {2: other}, device="0_GPU")  # a sibling without this shape
    as_dict = moe.oracle.backend_to_dict
    assert moe.oracle.tuned_entries(CONFIG, spec) == ("A_GPU", {"2": as_dict(sibling), "8": as_dict(sibling)})
    assert select_backend(CONFIG, 2, spec) == sibling
    assert select_backend(CONFIG, 2, spec) is select_backend(CONFIG, 2, spec)  # parsed once, until the files change
    save(CONFIG, {2: other})  # this device's own entry for M = 2; the sibling's still serves M = 8
    assert moe.oracle.tuned_entries(CONFIG, spec) == (f"{moe.oracle.device_name()} + A_GPU",
                                                      {"2": as_dict(other), "8": as_dict(sibling)})
    assert select_backend(CONFIG, 2, spec) == other
    assert select_backend(CONFIG, 8, spec) == sibling
    save(CONFIG, {8: other})  # every count its own: the sibling no longer contributes
    assert moe.oracle.tuned_entries(CONFIG, spec)[0] == moe.oracle.device_name()
    monkeypatch.setattr(moe.oracle, "USE_TUNED", False)
    assert moe.oracle.tuned_entries(CONFIG, spec) == (None, {})
    assert select_backend(CONFIG, 2, spec) == heuristic
    monkeypatch.setattr(moe.oracle, "USE_TUNED", True)
    monkeypatch.setattr(moe.oracle, "device_architecture", lambda: "sm_100")  # another architecture: none
    assert select_backend(CONFIG, 2, spec) == heuristic


def test_zero_points_have_entries_of_their_own_and_fall_back_to_the_plain_layouts(empty_tuned_dir):
    """Int4 with zero points is tuned under a key of its own; a count it has no entry for
    takes the symmetric layout's entry (the tiles read the same codes), and its entries
    never reach the symmetric layout."""
    zero_points = attrs.evolve(CONFIG, quant=QuantScheme("native", bits=4, group_size=32, symmetric=False))
    plain_spec, zp_spec = kernel_spec(CONFIG), kernel_spec(zero_points)
    plain_key = moe.oracle.shape_key(CONFIG, plain_spec)
    assert moe.oracle.shape_keys(zero_points, zp_spec) == [f"{plain_key},zero_points=true", plain_key]
    plain, own = Backend(16, SLOW, FAST), Backend(16, FAST, SLOW)
    save(CONFIG, {2: plain, 8: plain})
    assert select_backend(zero_points, 2, zp_spec) == plain
    save(zero_points, {2: own})
    as_dict = moe.oracle.backend_to_dict
    assert moe.oracle.tuned_entries(zero_points, zp_spec) == (moe.oracle.device_name(),
                                                              {"2": as_dict(own), "8": as_dict(plain)})
    assert select_backend(zero_points, 2, zp_spec) == own
    assert select_backend(zero_points, 8, zp_spec) == plain
    assert select_backend(CONFIG, 2, plain_spec) == plain
    assert own.gemm2 in other_format_tiles(2, CONFIG, CONFIG.intermediate_size)  # the refine's candidates
    save(CONFIG, {8: own}, device="A_GPU")  # a sibling's plain entry: after this device's own
    assert moe.oracle.tuned_entries(zero_points, zp_spec)[1]["8"] == as_dict(plain)


def test_a_tuned_prefill_entry_skips_a_layout_it_cannot_stage(empty_tuned_dir):
    """Act-order's K-sorted tiles share the plain layout's name, hence its tuned entries;
    read through their index maps they cannot be staged, so the oracle gives them the
    heuristic's decode tiles instead of a prefill entry."""
    prefill = GemmTile(block_m=32, warps_n=2, warps_k=1, slabs_per_warp=2, a_in_shared=True)
    save(CONFIG, {64: Backend(32, prefill, prefill)})
    act_order = formats.native(4, 32, act_order=True)
    assert act_order.name == kernel_spec(CONFIG).name
    assert select_backend(CONFIG, 64, kernel_spec(CONFIG)).gemm1 == prefill
    assert not select_backend(CONFIG, 64, act_order).gemm1.a_in_shared


def test_the_shipped_tables_are_filed_by_architecture():
    """`moe/tuned/sm_<major><minor>/<device>.json`, each entry a valid backend."""
    folders = list(moe.oracle.TUNED_DIR.iterdir())
    assert folders and all(path.is_dir() and path.name.startswith("sm_") for path in folders)
    for folder in folders:
        for device, table in moe.oracle.tuned_tables(folder.name).items():
            assert table and " " not in device
            for entries in table.values():
                for value in entries.values():
                    backend = moe.oracle.backend_from_dict(value)
                    assert backend.gemm1.block_m == backend.gemm2.block_m == backend.block_m


@pytest.mark.parametrize("tokens", [1, 16, 256, 4096])
def test_candidates_are_valid_tiles_of_the_right_family(tokens):
    qwen3 = MoEConfig(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768)
    tiles = candidate_tiles(tokens, qwen3, 2048)
    assert tiles and all(isinstance(t, GemmTile) for t in tiles)
    per_expert = tokens * 8 / 128
    assert any(t.a_in_shared for t in tiles) == (per_expert > 4)
    assert any(not t.a_in_shared for t in tiles) == (per_expert <= 64)
    prefill = {t for t in tiles if t.a_in_shared}  # each prefill shape in both CTA orders...
    assert {attrs.evolve(t, chunks_first=not t.chunks_first) for t in prefill} == prefill
    trimmed = {t for t in prefill if t.trim_padding}  # ...with and without trimming where it applies
    plain = {t for t in prefill if not t.fused_reduction}
    assert {attrs.evolve(t, trim_padding=False) for t in trimmed} == {t for t in prefill if t.trimmable} - trimmed
    assert bool(trimmed) == bool(prefill)
    # gemm1's with the activation in the epilogue where the tile can pair gate and up warps
    fused = {t for t in prefill if t.fused_reduction}
    assert {attrs.evolve(t, fused_reduction=False) for t in fused} == {
        t for t in plain if activation_finishable(qwen3, t)}
    assert bool(fused) == bool(prefill)
    assert not any(t.fused_reduction for t in candidate_tiles(tokens, qwen3, 768) if t.a_in_shared)  # gemm2
    paired = {t for t in tiles if t.pairs_warps and not t.a_in_shared}  # gemm1's decode tiles as gate/up pairs
    assert bool(paired) == (per_expert <= 64)
    assert all(t.warps_n == 2 and t.split_k == 1 and t.fused_reduction for t in paired)
    assert not any(t.pairs_warps for t in candidate_tiles(tokens, qwen3, 768) if not t.a_in_shared)


def test_the_heuristics_tiles_are_candidates_of_every_tuning(empty_tuned_dir):
    """A tuned entry must beat the untuned choice to replace it: on the H200 Mixtral's
    M = 256 gemm2 with the heuristic's K split was no family's tile, and the tuned pair
    took 7 % longer than the heuristic's."""
    mixtral = MoEConfig(num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336)
    spec = kernel_spec(mixtral)
    for tokens in (1, 256, 4096):
        heuristic = moe.oracle.heuristic_backend(mixtral, tokens, spec)
        for tile, k in ((heuristic.gemm1, mixtral.hidden_size), (heuristic.gemm2, mixtral.intermediate_size)):
            assert tile in candidate_tiles(tokens, mixtral, k)
            assert tile in refine_candidates(tokens, mixtral, k)
    assert moe.oracle.heuristic_backend(mixtral, 256, spec).gemm2.split_k == 2
    tuned = Backend(16, SLOW, FAST)  # a saved entry unlike the heuristic: refine times both
    save(mixtral, {256: tuned})
    tiles = refine_candidates(256, mixtral, mixtral.intermediate_size)
    assert tiles[0] == FAST and tiles[-1] == moe.oracle.heuristic_backend(mixtral, 256, spec).gemm2


def test_progress_bar_counts_to_the_total():
    stream = io.StringIO()
    bar = ProgressBar(3, "M=1", stream=stream, width=6)
    for _ in range(3):
        bar.step("gemm1")
    assert stream.getvalue().endswith("3/3 gemm1" + " " * 35 + "\n")
    assert "[######]" in stream.getvalue()


def test_refine_times_the_current_choice_and_its_flipped_options(empty_tuned_dir):
    mixtral = MoEConfig(num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336, quant=QuantScheme("nvfp4"))
    current = select_backend(mixtral, 1, kernel_spec(mixtral)).gemm1
    tiles = refine_candidates(1, mixtral, mixtral.hidden_size)
    paired = [t for t in tiles if t.pairs_warps]  # gemm1 as gate/up pairs of warps, no K split
    assert paired == paired_decode(mixtral, mixtral.hidden_size, current) and len(paired) == 2
    assert all(t.warps_n == 2 and t.split_k == 1 and t.fused_reduction for t in paired)
    tiles = [t for t in tiles if not t.pairs_warps]
    splits = [t for t in tiles if t.split_k != current.split_k]  # the K split halved, doubled, quadrupled
    assert splits == split_variants(current, mixtral.hidden_size) == [
        attrs.evolve(current, split_k=split) for split in (current.split_k // 2, current.split_k * 2,
                                                           current.split_k * 4) if split >= 1]
    tiles = [t for t in tiles if t not in splits]
    depths = [t for t in tiles if t.slabs_per_warp != current.slabs_per_warp]  # half and twice the batch
    assert {t.slabs_per_warp for t in depths} == {current.slabs_per_warp // 2, current.slabs_per_warp * 2} - {0}
    assert all(attrs.evolve(t, slabs_per_warp=current.slabs_per_warp) == current for t in depths)
    tiles = [t for t in tiles if t not in depths]
    assert tiles[0] == current and len(set(tiles)) == len(tiles) == (7 if current.swap_ab else 6)
    assert tiles[-1] == attrs.evolve(current, release_early=not current.release_early)
    assert {t.steady_loop for t in tiles} == {False, True}
    assert {t.chunks_first for t in tiles} == {False, True}
    assert {t.warps_k for t in tiles} == {current.warps_k // 2, current.warps_k, current.warps_k * 2}
    prefill = refine_candidates(4096, mixtral, mixtral.intermediate_size)
    first = prefill[0]
    assert all(t.a_in_shared for t in prefill) and first.trimmable and len(set(prefill)) == len(prefill)
    assert prefill[1:3] == [attrs.evolve(first, chunks_first=not first.chunks_first),
                            attrs.evolve(first, trim_padding=not first.trim_padding)]
    # then the K split (each split keeping two stages) ...
    assert prefill[3:5] == split_variants(first, mixtral.intermediate_size) == [
        attrs.evolve(first, split_k=split) for split in (2, 4)]
    # ... and the pipeline a stage deeper or shallower (never below two), stages of twice or half the slabs
    depth, stages = first.slabs_per_warp, first.stages
    assert prefill[-1] == attrs.evolve(first, release_early=not first.release_early)  # the next kernel's start
    assert {(t.slabs_per_warp, t.stages) for t in prefill[5:-1]} == (
        {(depth, stages + 1), (depth // 2, stages), (depth * 2, stages)} | ({(depth, stages - 1)} if stages > 2 else set()))
    gemm1 = refine_candidates(4096, mixtral, mixtral.hidden_size)  # also with the activation flipped
    assert gemm1[2] == attrs.evolve(gemm1[0], fused_reduction=not gemm1[0].fused_reduction)


def test_entries_of_the_shapes_other_formats_are_candidates(empty_tuned_dir):
    """An entry of the same shape in another format, at the same count, brings its block
    size into the refine (which varies one entry's options, never its block size) and is
    a candidate of a full tuning too."""
    nvfp4 = MoEConfig(num_experts=2, top_k=2, hidden_size=32, intermediate_size=64, quant=QuantScheme("nvfp4"))
    prefill = GemmTile(block_m=32, warps_n=4, warps_k=1, slabs_per_warp=8, stages=2, a_in_shared=True)
    int4_entry = Backend(32, attrs.evolve(prefill, trim_padding=True), attrs.evolve(prefill, split_k=4))
    save(CONFIG, {256: int4_entry})
    assert other_format_tiles(256, nvfp4, nvfp4.hidden_size) == [int4_entry.gemm1]
    assert other_format_tiles(256, nvfp4, nvfp4.intermediate_size) == [int4_entry.gemm2]
    assert int4_entry.gemm2 in refine_candidates(256, nvfp4, nvfp4.intermediate_size)
    assert int4_entry.gemm1 in candidate_tiles(256, nvfp4, nvfp4.hidden_size)  # a full tuning's too
    assert other_format_tiles(64, nvfp4, nvfp4.hidden_size) == []  # another count: none
    assert other_format_tiles(256, CONFIG, CONFIG.hidden_size) == []  # its own format's entry is the current choice
    mixtral = MoEConfig(num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336, quant=QuantScheme("nvfp4"))
    assert other_format_tiles(256, mixtral, mixtral.hidden_size) == []  # another shape: none


def test_a_finalists_release_twin_is_paired_even_when_slower_alone(empty_tuned_dir):
    late, early = FAST, attrs.evolve(FAST, release_early=True)
    assert moe.tune.with_release_twins([SLOW, late, early], 1) == [SLOW]  # no twin of SLOW was timed
    assert moe.tune.with_release_twins([late, SLOW, early], 1) == [late, early]
    assert moe.tune.with_release_twins([late, early, SLOW], 2) == [late, early]  # each tile once

    def measure(replay, subject):  # alone `early` is the slowest; after it gemm2 starts sooner
        if isinstance(subject, Backend):
            return 1.0 if subject.gemm1 == early else 2.0
        return {SLOW: 2.0, late: 1.0, early: 3.0}[subject]

    best = tune(CONFIG, [2], measure=measure, candidates=lambda tokens, config, k: [SLOW, late, early],
                progress=False, routings=1)
    assert best[2].gemm1 == early


@pytest.mark.parametrize("counts,routings,named", [([0], 1, "token_counts"), ([], 1, "token_counts"),
                                                    ([2, -4], 1, "token_counts"), ([1.5], 1, "token_counts"),
                                                    ([2], 0, "routings"), ([2], True, "routings")])
def test_bad_token_counts_or_routings_are_refused_by_name(counts, routings, named):
    with pytest.raises(ValueError, match=named):
        tune(CONFIG, counts, measure=lambda replay, subject: 1.0, routings=routings, progress=False)


@pytest.mark.skipif(torch.cuda.is_available() and not SIMULATED, reason="this machine can time kernels")
def test_tuning_without_a_gpu_says_so():
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        tune(CONFIG, [2], progress=False)


@pytest.mark.skipif(torch.cuda.is_available() and not SIMULATED, reason="this machine can time kernels")
def test_the_command_line_without_a_gpu_says_so(capsys):
    with pytest.raises(SystemExit) as exit_info:
        moe.tune.main(["--experts", "4", "--top-k", "2", "--hidden", "64", "--intermediate", "64"])
    assert exit_info.value.code == 2  # a usage error, not a traceback
    assert "error: moe.tune times kernels on a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--top-k", "5"], r"top_k \(5\) must not exceed num_experts \(4\)"),
    (["--top-k", "2", "--tokens", "0"], "--tokens and --routings must be positive"),
    (["--top-k", "2", "--group-size", "0"], "group_size must be a positive int"),
    (["--top-k", "2", "--format", "nvfp4", "--zero-points"], "--zero-points applies to --format native"),
])
def test_the_command_line_reports_a_bad_shape_as_a_usage_error(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        moe.tune.main(["--experts", "4", "--hidden", "64", "--intermediate", "64", *args])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)
