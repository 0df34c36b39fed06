"""Start the long GPU tests first: where they stand in the collection decides when they run.

`--dist worksteal` (setup.cfg) hands the i-th of n workers the i-th of n nearly equal runs
of the collection and lets an idle worker take the tail of another's run. The tests marked
`long(seconds)` (minutes each on the GPU, mostly compiling the widest kernels) sat together
at the end of test_gpu_runner.py, where one worker ran three of them in a row: that file
alone took 415 s of a device call's 600 on 16 workers, and the whole `-m gpu` suite ran
past the call (ninety-fifth and ninety-sixth sessions, benchmarks/LOG.md). Dealt longest
first, one to each run's head, they start together; where there are more long tests than
workers, the next round goes back from the last run, whose head is the shortest.
"""


def start_long_tests_first(items, workers):
    """Reorder `items` in place so that each of `workers` runs begins with its long tests.

    Every worker computes the same order from the same collection, as xdist requires."""
    if workers < 2:
        return
    shares, left = [], len(items)
    for worker in range(workers):  # worksteal's split of the collection
        shares.append(left // (workers - worker))
        left -= shares[-1]
    long = sorted((item for item in items if item.get_closest_marker("long")),
                  key=lambda item: -item.get_closest_marker("long").args[0])
    runs = [[] for _ in shares]
    forward = True
    while long:  # one to each run with room left, round by round, back and forth
        for run, share in zip(runs, shares) if forward else reversed(list(zip(runs, shares))):
            if long and len(run) < share:
                run.append(long.pop(0))
        forward = not forward
    others = [item for item in items if not item.get_closest_marker("long")]
    ordered = []
    for run, share in zip(runs, shares):
        ordered += run + others[: share - len(run)]
        del others[: share - len(run)]
    items[:] = ordered
