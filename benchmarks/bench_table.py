"""The Markdown table of `BENCHMARKS.md` from the JSON files `bench_moe.py --json` writes.

One row per benchmark row, in the order of the files and their rows; the ratios are
computed here so that every table reads the same way:

* floor / GEMMs: the benchmark's fraction of the floor (issue 7's measure);
* GEMMs / line, at M <= 16: GEMM time over floor / 0.7 + 8 us, issue 6's target line
  (bold where above it);
* layer / GEMMs, and the torch loop's time over the GEMMs' (how many times faster).

    python benchmarks/bench_table.py qwen3_mixtral.json deepseek.json >> table.md

A run records the digest of the sources it timed (`source_digest`): the device machine's
copy of the checkout can carry older git metadata than its files (its runs named
themselves after an older commit), so a run is matched to a commit by the digest of that
commit's files:

    git archive COMMIT layouts numba_kernels moe | tar -x -C /tmp/tree
    python benchmarks/bench_table.py --sources /tmp/tree

Plain Python: it runs anywhere, no GPU needed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib

SHAPE_NAMES = {"qwen3": "Qwen3-30B-A3B", "mixtral": "Mixtral-8x7B", "deepseek": "DeepSeek-V3"}
DECODE_TOKENS = 16  # issue 6's line applies up to this many tokens
LINE_FRACTION, LINE_LAUNCH_MS = 0.7, 0.008  # the line: floor / 0.7 + 8 us
PACKAGES = ("layouts", "numba_kernels", "moe")  # what a run's timing depends on (tuned tables included)

HEADER = ("| shape | format | M | experts | floor ms | GEMMs ms | floor / GEMMs | GEMMs / line | layer ms | "
          "layer / GEMMs | torch loop ms | loop / GEMMs | grouped_mm ms |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def milliseconds(value: float | None) -> str:
    """Four significant figures or so, as the earlier tables print them."""
    if value is None:
        return ""
    return f"{value:.4f}" if value < 1 else f"{value:.3f}" if value < 10 else f"{value:.2f}"


def line_ratio(row: dict) -> str:
    """GEMMs over issue 6's line, bold where above it; empty above `DECODE_TOKENS`."""
    if row["M"] > DECODE_TOKENS:
        return ""
    ratio = row["gemm_ms"] / (row["floor_ms"] / LINE_FRACTION + LINE_LAUNCH_MS)
    return f"**{ratio:.2f}**" if ratio > 1 else f"{ratio:.2f}"


def table_row(row: dict) -> str:
    gemm = row["gemm_ms"]
    cells = [SHAPE_NAMES.get(row["shape"], row["shape"]), row["format"], str(row["M"]), str(row["experts_touched"]),
             milliseconds(row["floor_ms"]), milliseconds(gemm), f"{row['fraction_of_floor']:.2f}", line_ratio(row),
             milliseconds(row["layer_ms"]), f"{row['layer_ms'] / gemm:.2f}", milliseconds(row["torch_ms"]),
             f"{row['torch_ms'] / gemm:.2f}x", milliseconds(row.get("grouped_mm_ms"))]
    return "| " + " | ".join(cells) + " |"


def render(runs: list[dict]) -> str:
    """The table of every row of `runs` (each a parsed `bench_moe.py --json` file)."""
    return "\n".join([HEADER] + [table_row(row) for run in runs for row in run["rows"]])


def source_digest(root) -> str:
    """A hash of the packages' Python files and tuned tables under `root`, paths included
    (compiled caches are not sources): the same for the same tree whatever git says."""
    root = pathlib.Path(root)
    digest = hashlib.sha256()
    for path in sorted(path for package in PACKAGES for path in (root / package).rglob("*")
                       if path.suffix in (".py", ".json")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="JSON files written by bench_moe.py --json")
    parser.add_argument("--sources", metavar="DIR", help="print the digest of the sources under DIR instead")
    args = parser.parse_args(argv)
    if args.sources:
        print(source_digest(args.sources))
        return
    if not args.files:
        parser.error("give the JSON files to render (or --sources DIR)")
    runs = []
    for path in args.files:
        with open(path) as f:
            runs.append(json.load(f))
    for run in runs:
        sources = f" (sources {run['sources']})" if "sources" in run else ""
        print(f"<!-- {run['device']}, {run['date']}, commit {run['commit']}{sources}: "
              f"copy {run['copy_bandwidth_TBps']:.2f} TB/s, bf16 matmul {run['bf16_matmul_TFLOPs']:.0f} TFLOP/s -->")
    print(render(runs))


if __name__ == "__main__":
    main()
