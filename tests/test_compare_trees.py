"""`benchmarks/compare_trees.py` refuses malformed jobs and trees before it starts any
process (the timing itself needs a GPU and two source trees: run it on the device)."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location("compare_trees", ROOT / "benchmarks" / "compare_trees.py")
compare_trees = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(compare_trees)


def test_jobs_and_trees_parse():
    assert compare_trees.parse_job("qwen3:nvfp4:4") == ("qwen3", "nvfp4", 4)
    assert compare_trees.parse_tree("before=/tmp/a=b") == ("before", "/tmp/a=b")


@pytest.mark.parametrize("job", ["qwen3:nvfp4", "qwen3:nvfp4:0", "qwen3:nvfp4:x", "a:b:1:2"])
def test_malformed_jobs_are_refused(job):
    with pytest.raises(ValueError, match="shape:format:M"):
        compare_trees.parse_job(job)


@pytest.mark.parametrize("tree", ["/tmp/a", "=/tmp/a", "before="])
def test_malformed_trees_are_refused(tree):
    with pytest.raises(ValueError, match="name=path"):
        compare_trees.parse_tree(tree)


def test_main_checks_jobs_before_running_anything():
    with pytest.raises(ValueError, match="shape:format:M"):
        compare_trees.main(["--trees", "a=.", "--jobs", "qwen3:nvfp4"])
