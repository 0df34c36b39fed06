"""The benchmark scripts stay importable: they run only on the device machine, so a name
they import that moved (read_patterns once imported a helper that had left bench_moe)
would otherwise surface there, costing device time."""

import importlib
import pathlib
import sys

import pytest

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
