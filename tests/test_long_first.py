"""The long GPU tests reach the heads of the runs xdist's work-stealing scheduler starts
its workers on (the scheduler itself, given stand-in workers, decides the runs)."""

import types

import pytest
from xdist.scheduler.worksteal import WorkStealingScheduling

from long_first import start_long_tests_first


class _Item:
    def __init__(self, name, seconds=None):
        self.name, self.seconds = name, seconds

    def get_closest_marker(self, name):
        return pytest.mark.long(self.seconds).mark if name == "long" and self.seconds else None


class _Worker:
    shutting_down = False

    def __init__(self, index):
        self.sent, self.gateway = [], types.SimpleNamespace(id=f"gw{index}")

    def send_runtest_some(self, indices):
        self.sent += indices

    def shutdown(self):
        pass


class _Config:
    def __init__(self, workers):
        self.workers = workers

    def getvalue(self, name):
        return [f"{self.workers}*popen"] if name == "tx" else None


def _runs(names, workers):
    """The indices of `names` each of `workers` stand-in workers is first sent."""
    scheduler = WorkStealingScheduling(_Config(workers))
    nodes = [_Worker(index) for index in range(workers)]
    for node in nodes:
        scheduler.add_node(node)
        scheduler.add_node_collection(node, names)
    scheduler.schedule()
    return [node.sent for node in nodes]


@pytest.mark.parametrize("workers,total,long", [(16, 155, 20), (16, 80, 20), (7, 155, 20), (4, 30, 3), (16, 20, 20)])
def test_long_tests_open_the_workers_runs_longest_first(workers, total, long):
    seconds = [60 + (7 * k) % 170 for k in range(long)]  # distinct, in no order
    spread = [total * k // long for k in range(long)]
    items = [_Item(f"t{i}") for i in range(total)]
    for k, i in enumerate(spread):
        items[i].seconds = seconds[k]
    original = list(items)
    start_long_tests_first(items, workers)
    assert sorted(items, key=original.index) == original  # the same tests, reordered
    runs = [[items[i] for i in run] for run in _runs([item.name for item in items], workers)]
    assert sum(map(len, runs)) == total
    heads = [run[0].seconds for run in runs if run][:long]
    assert heads == sorted(seconds, reverse=True)[: len(heads)]
    for run in runs:  # a run's long tests come before its others, longest first
        marked = [item.seconds for item in run if item.seconds]
        assert [item.seconds for item in run[: len(marked)]] == sorted(marked, reverse=True)


def test_one_worker_keeps_the_collection_order():
    items = [_Item("a"), _Item("b", 100), _Item("c")]
    start_long_tests_first(items, 1)
    assert [item.name for item in items] == ["a", "b", "c"]
