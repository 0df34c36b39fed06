"""The benchmark scripts stay importable: they run only on the device machine, so a name
they import that moved (read_patterns once imported a helper that had left bench_moe)
would otherwise surface there, costing device time."""

import importlib
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
                                       ("specialized_bound", [])])
def test_a_timing_script_without_a_gpu_says_it_needs_one(name, argv, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    try:
        with pytest.raises(SystemExit):
            importlib.import_module(name).main(argv)
    finally:
        sys.modules.pop(name, None)
    assert "on a CUDA GPU and none is available" in capsys.readouterr().err


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


def test_specialized_bound_variants_name_chunks_stages_and_what_they_leave_out(monkeypatch):
    import argparse

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    try:
        bound = importlib.import_module("specialized_bound")
        assert bound.variant("4:3") == (4, 3, "") and bound.variant("2:5:act") == (2, 5, "act")
        for text in ("4", "4:3:epilogue", "4:3:act:x", "a:3"):
            with pytest.raises(argparse.ArgumentTypeError, match="chunks:stages"):
                bound.variant(text)
        spec = bound.SPECS["w4a16-g128"]
        with pytest.raises(ValueError, match="leave_out"):
            bound.make_bound_kernel(spec, 512, 4096, (64,), 2, 3, "epilogue")
        with pytest.raises(ValueError, match="bulk-copied stages"):
            bound.make_bound_kernel(spec, 512, 4096 + 16, (64,), 2, 3)  # K not in whole stages
        with pytest.raises(ValueError, match="widths multiples of 8"):
            bound.make_bound_kernel(spec, 512, 4096, (60,), 2, 3)
        assert bound.widths_for([0, 5, 8, 64, 61, 9]) == (8, 16, 64)
        assert bound.image_copies_arg("tensors") == "tensors" and bound.image_copies_arg("5") == 5
        assert bound.image_copies_arg("split") == "split"
        with pytest.raises(argparse.ArgumentTypeError, match="count of copies"):
            bound.image_copies_arg("-1")
        with pytest.raises(ValueError, match="positive integer, 'tensors' or 'split'"):
            bound.image_bounds(spec, 512, 4096, 2, -1)
        stage = bound.image_bounds(spec, 512, 4096, 2, 1)[-1]  # two chunks' 4 slabs of codes, then their scales
        assert bound.image_bounds(spec, 512, 4096, 2, "tensors") == (0, 4 * 2 * 128, stage)
        assert bound.image_bounds(spec, 512, 4096, 2, "split") == (0, 4 * 2 * 128, stage)
        assert bound.image_bounds(spec, 512, 4096, 2, 3) == (0, 4 * (stage // 12), 4 * (2 * stage // 12), stage)
    finally:
        sys.modules.pop("specialized_bound", None)


@pytest.mark.parametrize("spec_name, image_copies, steps_first", [
    ("w4a16-g128", 0, False), ("nvfp4", 0, False), ("zero points", 0, False), ("zero points", 1, False),
    ("nvfp4", 3, False), ("zero points", "tensors", False), ("w4a16-g128", 1, True), ("zero points", "split", True)])
def test_specialized_bound_computes_the_grouped_product_it_times(spec_name, image_copies, steps_first, monkeypatch):
    """The warp-specialised bound (bulk copies of each stage on mbarriers, producer warps
    decoding the native layout with the GEMM's reader into wgmma's A tiles, a consumer
    warpgroup's wgmma at the width its expert's slots need, named barriers) gives act @
    the spec's dequantised weights for each expert's slots: under the simulator at a
    shape of six CTAs (three experts of 5, 16 and no slots, two feature tiles) whose 4
    stages go round a 2-stage ring twice (on the GPU the script checks itself at a larger
    one before it times). `image_copies` not 0: each stage's weights from their stage
    image (the weights staged by `copy_bulk` and written back stage by stage, a CTA's
    stages or `steps_first` a step's tiles one after another), in that many copies a
    stage or a copy a tensor (from two tensors: "split")."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    try:
        from layouts import formats

        bound = importlib.import_module("specialized_bound")
        spec = bound.SPECS.get(spec_name) or formats.native(4, 64, zero_points=True)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        assert bound.bound_error(spec, [5, 16, 0], 256, 256, 2, 2, device, image_copies=image_copies,
                                 steps_first=steps_first) < 1e-5
    finally:
        sys.modules.pop("specialized_bound", None)
