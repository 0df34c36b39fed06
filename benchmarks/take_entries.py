"""Take refined entries into a tuned table, saying what each one changes.

`refine_side_by_side.sh` brings back the refined table whole: the entries the refine
chose, and every other entry as the tree had it. Which to take is decided on the
side-by-side figures, a job at a time, so the merge is by job (compare_trees.py's
shape:format:M), not by file:

    python benchmarks/take_entries.py /tmp/s1/gpu0/NVIDIA_H200_q64.json \\
        moe/tuned/sm_90/NVIDIA_H200.json qwen3:w4a16-g128:64 qwen3:nvfp4:64

For each job it prints what the taken entry changes, field by field (both entries read as
tiles, so a key the older entry lacks reads as its default, not as a change), and then
writes the table in the form `moe.tune` writes it. "specialized" is compared as written:
a missing key and null differ (`oracle.heuristic_first`). `--dry-run` only prints.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import attrs

from bench_moe import job_config
from moe.oracle import backend_from_dict, shape_key
from moe.tune import write_entries
from moe.weights import kernel_spec

MISSING = "(no key)"


def job_key(job: str) -> tuple[str, str]:
    """'qwen3:nvfp4:16' -> (the table's shape key, '16')."""
    config, tokens = job_config(job)
    return shape_key(config, kernel_spec(config)), str(tokens)


def changes(old: dict | None, new: dict) -> list[str]:
    """What replacing `old` by `new` changes, one 'field: old -> new' a line."""
    if old is None:
        return ["a new entry"]
    before, after = backend_from_dict(old), backend_from_dict(new)
    lines = [f"block_m: {before.block_m} -> {after.block_m}"] if before.block_m != after.block_m else []
    for gemm in ("gemm1", "gemm2"):
        tile_before, tile_after = getattr(before, gemm), getattr(after, gemm)
        lines += [f"{gemm}.{field.name}: {getattr(tile_before, field.name)} -> {getattr(tile_after, field.name)}"
                  for field in attrs.fields(type(tile_after))
                  if getattr(tile_before, field.name) != getattr(tile_after, field.name)]
    specialized = old.get("specialized", MISSING), new.get("specialized", MISSING)
    if specialized[0] != specialized[1]:
        lines.append(f"specialized: {specialized[0]} -> {specialized[1]}")
    return lines


def take(refined: dict, table_path: Path, jobs: list[str], dry_run: bool = False) -> dict[str, list[str]]:
    """Copy each job's entry of `refined` into the table at `table_path`; returns each
    job's changes."""
    table = json.loads(table_path.read_text()) if table_path.exists() else {}
    report = {}
    for job in jobs:
        key, tokens = job_key(job)
        new = refined.get(key, {}).get(tokens)
        if new is None:
            raise ValueError(f"job {job!r}: the refined table has no entry {key} at M = {tokens}")
        report[job] = changes(table.get(key, {}).get(tokens), new)
        if not dry_run:
            write_entries(table_path, key, {int(tokens): new})
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("refined", type=Path, help="the refined table refine_side_by_side.sh brought back")
    parser.add_argument("table", type=Path, help="the tuned table to take the entries into")
    parser.add_argument("jobs", nargs="+", help="shape:format:M, as compare_trees.py's jobs")
    parser.add_argument("--dry-run", action="store_true", help="print the changes, write nothing")
    args = parser.parse_args(argv)
    try:
        report = take(json.loads(args.refined.read_text()), args.table, args.jobs, args.dry_run)
    except (OSError, ValueError) as error:
        parser.error(str(error))
    for job, lines in report.items():
        print(f"{job}: " + ("; ".join(lines) if lines else "no change"))


if __name__ == "__main__":
    main()
