"""The benchmark scripts stay importable: they run only on the device machine, so a name
they import that moved (read_patterns once imported a helper that had left bench_moe)
would otherwise surface there, costing device time."""

import argparse
import importlib
import json
import pathlib
import sys

import pytest
import torch

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
MODULES = sorted(BENCHMARKS.glob("*.py"))


def test_the_scripts_are_found():
    assert {"bench_moe", "read_patterns", "reads"} <= {path.stem for path in MODULES}


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.stem)
def test_imports(path, monkeypatch):
    """Every module imports; a script (one with a `__main__` guard) has its `main`."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import each other as top-level modules
    try:
        module = importlib.import_module(path.stem)
        if '__name__ == "__main__"' in path.read_text():
            assert callable(getattr(module, "main", None)), f"benchmarks/{path.name} runs as a script but has no main()"
    finally:
        sys.modules.pop(path.stem, None)


def _run_per_gpu(tmp_path, steps, cards=2):
    """benchmarks/per_gpu.sh from a copy of the device scripts (no carried wheel to
    install), with an nvidia-smi that lists `cards` cards."""
    import shutil
    import subprocess

    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    for name in ("per_gpu.sh", "device_env.sh"):
        shutil.copy(BENCHMARKS / name, root / "benchmarks" / name)
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    smi = fake_bin / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo {i}\n" for i in range(cards)))
    smi.chmod(0o755)
    env = {"PATH": f"{fake_bin}:/usr/bin:/bin", "OUT": str(tmp_path / "out")}
    return subprocess.run(["bash", "benchmarks/per_gpu.sh", *steps], cwd=root, env=env, capture_output=True,
                          text=True, timeout=60)


def test_per_gpu_runs_each_step_on_its_own_card(tmp_path):
    import tarfile

    done = _run_per_gpu(tmp_path, ['echo "card $CUDA_VISIBLE_DEVICES" > $OUT/seen.txt', "echo second; exit 3"])
    assert done.returncode == 1, done.stderr  # the second step failed
    out = tmp_path / "out"
    assert (out / "job0.log").read_text().strip() == "exit 0"
    assert (out / "job1.log").read_text().split() == ["second", "exit", "3"]
    with tarfile.open(out / "steps.tar.gz") as packed:
        assert packed.extractfile("gpu0/seen.txt").read() == b"card 0\n"
        assert "gpu1" in packed.getnames()
    assert sorted(path.name for path in out.iterdir()) == ["job0.log", "job1.log", "steps.tar.gz"]


def test_per_gpu_refuses_more_steps_than_cards(tmp_path):
    done = _run_per_gpu(tmp_path, ["true", "true", "true"], cards=2)
    assert done.returncode == 2 and "3 steps for 2 cards" in done.stderr


def test_bench_rows_are_listed_in_the_tables_order_and_printed(monkeypatch, capsys):
    """bench_moe times a shape's rows by token count (decode rows before any prefill row)
    but writes and prints them as the table reads: shape, format, M."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench_moe = importlib.import_module("bench_moe")
    try:
        base = dict(experts_touched=8, gemm_ms=0.02, layer_ms=0.025, floor_ms=0.007, fraction_of_floor=0.35,
                    torch_ms=0.4, grouped_mm_ms=None)
        timed = [dict(base, shape=shape, format=fmt, M=m) for shape in ("qwen3", "mixtral") for m in (1, 256)
                 for fmt in ("w4a16-g128", "nvfp4")]
        timed.sort(key=bench_moe.table_order(["qwen3", "mixtral"], ["w4a16-g128", "nvfp4"]))
        assert [(r["shape"], r["format"], r["M"]) for r in timed[:4]] == [
            ("qwen3", "w4a16-g128", 1), ("qwen3", "w4a16-g128", 256), ("qwen3", "nvfp4", 1), ("qwen3", "nvfp4", 256)]
        bench_moe.print_row(dict(timed[0], eager_layer_ms=0.02, eager_host_us=14.0, kernels=4, eager_over_layer=0.8,
                                 eager_ordinary_ms=1.8))
        printed = capsys.readouterr().out
        assert "M=    1" in printed and "host 14.0 us for 4 kernels" in printed and "grouped_mm nan ms" in printed
    finally:
        sys.modules.pop("bench_moe", None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("name,argv", [("bench_moe", ["--shapes", "qwen3", "--tokens", "1"]),
                                       ("compare_trees", ["--trees", "a=.", "--jobs", "qwen3:nvfp4:1"]),
                                       ("specialized_ab", []), ("stage_blocks_rates", []), ("part_widths", [])])
def test_a_timing_script_without_a_gpu_says_it_needs_one(name, argv, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    try:
        with pytest.raises(SystemExit):
            importlib.import_module(name).main(argv)
    finally:
        sys.modules.pop(name, None)
    assert "on a CUDA GPU and none is available" in capsys.readouterr().err


@pytest.mark.parametrize("fields, says", [(["a_buffers=3"], "unexpected keyword argument 'a_buffers'"),
                                          (["stages=1"], "stages in [2, 7]"), (["stages"], "KEY=INT")])
def test_specialized_ab_names_a_bad_variant(fields, says, monkeypatch, capsys):
    """`--variant` takes SpecializedTile fields as KEY=INT, checked against the tiles the jobs
    take; anything else fails by name, before any GPU is looked for."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    try:
        ab = importlib.import_module("specialized_ab")
        oracle = ab.moe.oracle
        assert ab.parse_variant(["stages=3", "max_width=64"], ab.OWN_TILES) == {"stages": 3, "max_width": 64}
        assert ab.parse_variant(["block_m=128", "max_width=80"], [oracle.NARROW_SPECIALIZED_TILE])  # 16 divides 80
        with pytest.raises(argparse.ArgumentTypeError, match="width_step must be a multiple of 8 dividing"):
            ab.parse_variant(["block_m=128", "max_width=80"], [oracle.WIDEST_SPECIALIZED_TILE])  # 32 does not
        with pytest.raises(SystemExit):
            ab.main(["--variant", *fields])
    finally:
        sys.modules.pop("specialized_ab", None)
    err = capsys.readouterr().err
    assert "--variant takes SpecializedTile fields as KEY=INT" in err and says in err


def test_specialized_ab_runs_the_warp_specialised_gemm_where_an_entry_says_tiles(tmp_path, monkeypatch):
    """specialized_ab.py's warp-specialised way passes over a tuned entry that found the
    tiles faster at the count timed (else both ways would run the tiles); its tiles way
    takes that entry."""
    import moe.oracle
    from moe import MoEConfig, QuantScheme
    from moe.oracle import Backend, select_backend
    from moe.tune import save
    from moe.weights import kernel_spec
    from numba_kernels.gemm import GemmTile

    monkeypatch.setattr(moe.oracle, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(moe.oracle, "specialized_device", lambda: True)  # as on an H100 / H200
    for name in ("USE_TUNED", "USE_SPECIALIZED", *moe.oracle.SPECIALIZED_TILE_NAMES):  # what `choose` sets
        monkeypatch.setattr(moe.oracle, name, getattr(moe.oracle, name))
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    config = MoEConfig(num_experts=2, top_k=2, hidden_size=128, intermediate_size=64,
                       quant=QuantScheme("gptq", bits=4, group_size=64))
    tiles, spec = Backend(16, GemmTile(block_m=16), GemmTile(block_m=16)), kernel_spec(config)
    try:
        save(config, {32: tiles})  # 32 slots an expert, where the untuned oracle takes it
        assert select_backend(config, 32, spec) == tiles
        ab = importlib.import_module("specialized_ab")
        ab.choose(ab.OWN)
        assert select_backend(config, 32, spec) == moe.oracle.warp_specialised(moe.oracle.NARROW_SPECIALIZED_TILE)
        ab.choose(None)
        assert select_backend(config, 32, spec) == tiles
    finally:
        sys.modules.pop("specialized_ab", None)
        moe.oracle.tuned_tables.cache_clear()


@pytest.mark.parametrize("job", ["mixtral:int3:256", "llama:nvfp4:256"])
def test_specialized_ab_names_a_job_it_cannot_build(job, monkeypatch, capsys):
    """A job's shape and format are checked before any GPU is looked for: a name
    bench_moe.py does not know fails by name (and the list names its zero-point format)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    try:
        ab = importlib.import_module("specialized_ab")
        with pytest.raises(SystemExit):
            ab.main(["--jobs", job])
    finally:
        sys.modules.pop("specialized_ab", None)
    err = capsys.readouterr().err
    assert f"--jobs: {job!r} names no shape" in err and "w4a16-g128-zp" in err


def test_part_widths_routes_every_expert_the_same_count_and_names_a_bad_variant(monkeypatch, capsys):
    """part_widths.py's routing gives each expert exactly the slots asked for (a token's
    experts distinct), or says why it cannot; `--variants` fail by name before any GPU is
    looked for."""
    from moe import MoEConfig, QuantScheme

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    try:
        widths = importlib.import_module("part_widths")
        config = MoEConfig(num_experts=16, top_k=4, hidden_size=128, intermediate_size=64,
                           quant=QuantScheme("native", bits=4, group_size=64))
        weights, ids = widths.uniform_routing(config, 6, device="cpu")
        assert ids.shape == (24, 4) and torch.bincount(ids.flatten().long()).tolist() == [6] * 16
        assert all(len(set(row)) == 4 for row in ids.tolist()) and torch.all(weights == 0.25)
        six = MoEConfig(num_experts=6, top_k=4, hidden_size=128, intermediate_size=64, quant=config.quant)
        assert torch.bincount(widths.uniform_routing(six, 2, device="cpu")[1].flatten().long()).tolist() == [2] * 6
        with pytest.raises(ValueError, match="must be a multiple of top_k"):
            widths.uniform_routing(six, 3, device="cpu")
        with pytest.raises(SystemExit):
            widths.main(["--variants", "stages=6", "stages=1,max_width=128"])
    finally:
        sys.modules.pop("part_widths", None)
    assert "stages in [2, 7]" in capsys.readouterr().err


def test_replay_stress_says_where_outputs_differ_and_changes_the_oracles_tiles(monkeypatch):
    """replay_stress.py's report (rows, count, largest error, the first row's columns as
    runs) and its `--evolve` (the runner and the workspace take changed tiles)."""
    import moe.runner
    import moe.workspace
    from moe import MoEConfig, QuantScheme
    from moe.weights import kernel_spec

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    for module in (moe.runner, moe.workspace):  # restored afterwards: evolve_tiles replaces them
        monkeypatch.setattr(module, "select_backend", module.select_backend)
    try:
        stress = importlib.import_module("replay_stress")
        expected = torch.zeros(2, 8, dtype=torch.bfloat16)
        got = expected.clone()
        got[1, 2:5], got[1, 7] = 1.0, -3.0
        assert stress.where_they_differ(got, expected) == "4 elements in rows [1], max |diff| 3; row 1's columns 2-4 7-7"
        stress.evolve_tiles(["gemm1.release_early=true", "gemm2.split_k=4"])
        config = MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=64,
                           quant=QuantScheme("gptq", group_size=32))
        backend = moe.runner.select_backend(config, 1, kernel_spec(config))
        assert backend.gemm1.release_early and backend.gemm2.split_k == 4
        assert moe.workspace.select_backend is moe.runner.select_backend
    finally:
        sys.modules.pop("replay_stress", None)


@pytest.mark.parametrize("job", ["llama:4096", "qwen3:", "qwen3:0"])
def test_stage_blocks_rates_names_a_job_it_cannot_build(job, monkeypatch, capsys):
    """A job (shape:tokens) that names no benchmark shape or no positive count fails by name
    before any GPU is looked for."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    try:
        rates = importlib.import_module("stage_blocks_rates")
        assert rates.parse_job("mixtral:256") == ("mixtral", 256)
        with pytest.raises(SystemExit):
            rates.main(["--jobs", job])
    finally:
        sys.modules.pop("stage_blocks_rates", None)
    assert "a job is shape:tokens with a shape of" in capsys.readouterr().err


def test_take_entries_takes_a_jobs_entry_and_says_what_it_changes(tmp_path, monkeypatch, capsys):
    """take_entries.py copies the named jobs' entries of a refined table, and only those;
    a key the older entry lacks reads as its default (not a change), except "specialized",
    whose missing key and null differ; a job the refined table lacks fails by name."""
    from moe.oracle import backend_to_dict, heuristic_backend

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    try:
        take = importlib.import_module("take_entries")
        key, _ = take.job_key("qwen3:nvfp4:16")
        config, _ = take.job_config("qwen3:nvfp4:16")
        old = backend_to_dict(heuristic_backend(config, 16))
        del old["specialized"], old["gemm1"]["release_early"]  # a table from before those keys
        new = json.loads(json.dumps(old))
        new["gemm2"]["split_k"] = old["gemm2"]["split_k"] * 2
        new["gemm1"]["release_early"], new["specialized"] = False, None
        table, refined = tmp_path / "table.json", tmp_path / "refined.json"
        table.write_text(json.dumps({key: {"16": old, "64": old}}))
        refined.write_text(json.dumps({key: {"16": new, "64": new, "256": new}}))
        take.main([str(refined), str(table), "qwen3:nvfp4:16", "--dry-run"])
        assert json.loads(table.read_text())[key]["16"] == old
        take.main([str(refined), str(table), "qwen3:nvfp4:16"])
        printed = capsys.readouterr().out.splitlines()
        split = old["gemm2"]["split_k"]
        assert printed == [f"qwen3:nvfp4:16: gemm2.split_k: {split} -> {2 * split}; specialized: (no key) -> None"] * 2
        written = json.loads(table.read_text())
        assert written[key] == {"16": new, "64": old}  # the job's count only
        assert table.read_text() == json.dumps(written, indent=1, sort_keys=True) + "\n"  # as moe.tune writes
        with pytest.raises(SystemExit):
            take.main([str(refined), str(table), "qwen3:nvfp4:4"])
    finally:
        for name in ("take_entries", "compare_trees", "bench_moe"):
            sys.modules.pop(name, None)
    err = capsys.readouterr().err
    assert "job 'qwen3:nvfp4:4': the refined table has no entry" in err and "at M = 4" in err
