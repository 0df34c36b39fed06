"""Each card's table in BENCHMARKS.md is the render of that card's latest saved benchmark
run (`benchmarks/results/<date>-*.json`, the card's files of its latest date in name
order), so its ratios cannot drift from the measurements by hand edits."""

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location("bench_table", ROOT / "benchmarks" / "bench_table.py")
bench_table = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench_table)

RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.json"))


def latest_runs() -> dict[str, list[dict]]:
    """Each card's runs of the latest date it has (file names begin with the date)."""
    by_device: dict[str, list[tuple[str, dict]]] = {}
    for path in RESULTS:
        run = json.loads(path.read_text())
        by_device.setdefault(run["device"], []).append((path.name[:10], run))
    latest = {}
    for device, runs in by_device.items():
        newest = max(date for date, _ in runs)
        latest[device] = [run for date, run in runs if date == newest]
    return latest


def row(**changes):
    base = dict(shape="qwen3", format="w4a16-g128", M=1, experts_touched=8, floor_ms=0.0046, gemm_ms=0.0180,
                fraction_of_floor=0.25, layer_ms=0.0219, torch_ms=0.6215, grouped_mm_ms=0.0625)
    return {**base, **changes}


def test_line_ratio_is_bold_above_the_line_and_blank_past_decode():
    assert bench_table.line_ratio(row()) == "**1.24**"  # 0.0180 / (0.0046 / 0.7 + 0.008)
    assert bench_table.line_ratio(row(gemm_ms=0.0100)) == "0.69"
    assert bench_table.line_ratio(row(M=64)) == ""


def test_a_row_has_every_column():
    cells = bench_table.table_row(row()).strip("|").split("|")
    assert len(cells) == bench_table.HEADER.splitlines()[0].count("|") - 1
    assert [c.strip() for c in cells[:3]] == ["Qwen3-30B-A3B", "w4a16-g128", "1"]
    assert cells[-2].strip() == f"{0.6215 / 0.0180:.2f}x"


@pytest.mark.parametrize("device", sorted(latest_runs()))
def test_benchmarks_md_holds_each_cards_latest_run(device):
    assert bench_table.render(latest_runs()[device]) in (ROOT / "BENCHMARKS.md").read_text()


def test_the_source_digest_names_the_tree_not_its_caches(tmp_path):
    """A run records `source_digest` of the tree it timed: equal trees give one digest,
    a changed source or tuned table another, and compiled caches or files beside the
    packages none."""
    for package in bench_table.PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(f"# {package}\n")
    (tmp_path / "moe" / "tuned.json").write_text("{}")
    first = bench_table.source_digest(tmp_path)
    (tmp_path / "moe" / "__pycache__").mkdir()
    (tmp_path / "moe" / "__pycache__" / "runner.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "BENCHMARKS.md").write_text("notes")
    assert bench_table.source_digest(tmp_path) == first
    (tmp_path / "moe" / "tuned.json").write_text('{"a": 1}')
    changed = bench_table.source_digest(tmp_path)
    assert changed != first
    (tmp_path / "moe" / "tuned.json").rename(tmp_path / "layouts" / "tuned.json")  # same bytes, another place
    assert bench_table.source_digest(tmp_path) not in (first, changed)


def test_sources_prints_the_digest_of_a_tree(tmp_path, capsys):
    (tmp_path / "layouts").mkdir()
    (tmp_path / "layouts" / "spec.py").write_text("x = 1\n")
    bench_table.main(["--sources", str(tmp_path)])
    assert capsys.readouterr().out.strip() == bench_table.source_digest(tmp_path)
