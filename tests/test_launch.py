"""A recorded launch replays exactly as the ordinary Numba launch ran, with arrays
re-pointed in place, and costs far less host time on the GPU."""

import time

import numpy as np
import pytest
import torch
from numba import cuda, float32

from numba_kernels import interop, launch, ptx
from numba_kernels.launch import GraphReplay, Launcher, LeanLaunchUnavailable, Replay, launch_kernel, recording


@ptx.kernel
def _scaled_gather(values, pairs, index, scale, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        first, second = pairs
        out[i] = values[index[i]] * scale + first[i] + second[0, i]


@ptx.kernel
def _reverse_through_shared(values, out):
    buffer = cuda.shared.array(0, float32)  # dynamic: as many bytes as the launch grants
    n = values.shape[0]
    for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        buffer[i] = values[i]
    cuda.syncthreads()
    for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        out[i] = buffer[n - 1 - i]


def _inputs(n, seed):
    generator = torch.Generator().manual_seed(seed)
    device = interop.kernel_device()
    values = torch.randn(n, generator=generator).to(device)
    pairs = (torch.randn(n, generator=generator).to(device), torch.randn(2, n, generator=generator).to(device))
    index = torch.randperm(n, generator=generator).to(torch.int32).to(device)
    return values, pairs, index


def _expected(values, pairs, index, scale):
    return values[index.long()] * scale + pairs[0] + pairs[1][0]


def _record(values, pairs, index, scale, out):
    to = interop.to_kernel
    with recording() as calls:
        launch_kernel(_scaled_gather, -(-out.shape[0] // 32), 32, to(values), (to(pairs[0]), to(pairs[1])), to(index),
                      np.float32(scale), to(out))
    assert len(calls) == 1
    return calls[0]


def test_a_recorded_launch_replays_with_rebound_arrays():
    n = 40
    values, pairs, index = _inputs(n, 0)
    out = torch.full((n,), float("nan"), device=values.device)
    launcher = Launcher(_record(values, pairs, index, 2.0, out))
    torch.testing.assert_close(out, _expected(values, pairs, index, 2.0))  # the recorded launch ran

    values2, pairs2, index2 = _inputs(n, 1)
    out2 = torch.full((n,), float("nan"), device=values.device)
    for argument, tensor in ((0, values2), (2, index2), (4, out2)):
        launcher.rebind(argument, tensor)
    launcher.launch(interop.launch_stream_handle())
    torch.testing.assert_close(out2, _expected(values2, pairs, index2, 2.0))


def test_replaying_runs_a_function_once_and_replays_its_launches_in_order():
    """`launch.replaying` (what `moe.tune` and the benchmark time): the recorded launches
    run again in their order, on the arrays they were recorded with."""
    n = 16
    values, pairs, index = _inputs(n, 0)
    first, second = torch.zeros(n, device=values.device), torch.zeros(n, device=values.device)
    to = interop.to_kernel

    def two_launches():
        launch_kernel(_scaled_gather, 1, 32, to(values), (to(pairs[0]), to(pairs[1])), to(index), np.float32(1.0),
                      to(first))
        launch_kernel(_scaled_gather, 1, 32, to(first), (to(pairs[0]), to(pairs[1])), to(index), np.float32(2.0),
                      to(second))

    replay = launch.replaying(two_launches)
    assert len(replay.launchers) == 2
    expected = _expected(_expected(values, pairs, index, 1.0), pairs, index, 2.0)
    torch.testing.assert_close(second, expected)  # recording ran the function once
    first.zero_()
    second.zero_()
    replay()
    torch.testing.assert_close(second, expected)  # the second launch read the first's output


def test_recording_is_scoped_and_nests():
    values, pairs, index = _inputs(8, 0)
    out = torch.empty(8, device=values.device)
    with recording() as outer:
        _record(values, pairs, index, 1.0, out)
        launch_kernel(_scaled_gather, 1, 32, *_record(values, pairs, index, 1.0, out).args)
    assert len(outer) == 1
    launch_kernel(_scaled_gather, 1, 32, *outer[0].args)  # outside any recording: just launched


@pytest.mark.gpu
def test_a_replay_costs_far_less_host_time_than_an_ordinary_launch():
    n = 1024
    values, pairs, index = _inputs(n, 0)
    out = torch.empty(n, device=values.device)
    call = _record(values, pairs, index, 2.0, out)
    launcher = Launcher(call)
    stream = interop.launch_stream_handle()
    for _ in range(10):
        launcher.launch(stream)
        launch_kernel(call.kernel, call.grid, call.block, *call.args)
    torch.cuda.synchronize()

    def host_time(launch):
        start = time.perf_counter()
        for _ in range(500):
            launch()
        elapsed = (time.perf_counter() - start) / 500
        torch.cuda.synchronize()
        return elapsed

    lean = host_time(lambda: launcher.launch(stream))
    ordinary = host_time(lambda: launch_kernel(call.kernel, call.grid, call.block, *call.args))
    print(f"host time per launch (5 arrays): replay {lean * 1e6:.1f} us, numba {ordinary * 1e6:.1f} us")
    assert lean < ordinary / 2


@ptx.kernel
def _slow_producer(out, value):
    """Lets the next kernel launch at once, then takes about 200 us before it writes."""
    ptx.release_next()
    for _ in range(200):
        cuda.nanosleep(1000)
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = value[0]


@ptx.kernel
def _early_consumer(source, out):
    ptx.wait_for_previous()
    ptx.release_next()
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = source[i] + 1.0


def _producer_and_consumer(n: int = 4096):
    """(data, result, value_in, the two recorded calls): `_slow_producer` writes value_in[0]
    to data, then `_early_consumer`, launched early, writes data + 1 to result."""
    data, result, value_in = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda"), torch.ones(1, device="cuda")
    to = interop.to_kernel
    with recording() as calls:
        launch_kernel(_slow_producer, n // 128, 128, to(data), to(value_in))
        launch_kernel(_early_consumer, n // 128, 128, to(data), to(result), waits=True)
    torch.cuda.synchronize()
    return data, result, value_in, calls


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["stream", "streams", "graph"])
def test_an_early_launched_kernel_waits_for_the_kernel_before_it(where):
    """A kernel launched with `waits=True` may start while its predecessor runs (on
    Hopper: `Launcher.early`), and still reads what that predecessor wrote: eagerly on one
    stream, on a stream that changes between launches (the early launch keeps its stream
    in its configuration), and from a CUDA graph. Without the wait the consumer reads the
    producer's old values."""
    data, result, value_in, calls = _producer_and_consumer()
    producer, consumer = (Launcher(call) for call in calls)
    assert consumer.early == (ptx.hopper() and launch.EARLY_LAUNCH) and not producer.early
    side = torch.cuda.Stream()
    for value in (2.0, 3.0, 4.0):
        value_in.fill_(value)
        data.zero_()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph() if where == "graph" else None
        stream = side if where == "streams" and value == 3.0 else torch.cuda.current_stream()
        with torch.cuda.graph(graph) if graph else torch.cuda.stream(stream):
            handle = interop.launch_stream_handle()  # the capturing stream inside the graph
            assert handle == torch.cuda.current_stream().cuda_stream
            producer.launch(handle)
            consumer.launch(handle)
        if graph:
            graph.replay()
        torch.cuda.synchronize()
        assert torch.all(result == value + 1.0), f"read {result.unique().tolist()}"


@pytest.mark.gpu
def test_a_graph_replay_reads_rebound_arrays_and_keeps_its_early_launch_waiting():
    """`GraphReplay`: the producer's node takes each call's rebound value, the early-launched
    consumer still waits for it (a programmatic edge of the graph), and inside a caller's
    own capture the kernels become nodes of that graph instead."""
    data, result, _, calls = _producer_and_consumer()
    replay = Replay(tuple(Launcher(call) for call in calls))
    graph = GraphReplay(replay, rebound=[0])
    for value in (2.0, 3.0):
        value_now = torch.full((1,), value, device="cuda")
        replay.launchers[0].rebind(1, value_now)
        data.zero_()
        graph()
        torch.cuda.synchronize()
        assert torch.all(result == value + 1.0), f"read {result.unique().tolist()}"
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        graph()
    for value in (4.0, 5.0):
        value_now.fill_(value)
        data.zero_()
        outer.replay()
        torch.cuda.synchronize()
        assert torch.all(result == value + 1.0), f"read {result.unique().tolist()}"


@pytest.mark.skipif(not ptx.SIMULATED, reason="under the simulator only")
def test_a_graph_replay_needs_the_gpu():
    with pytest.raises(LeanLaunchUnavailable, match="need the GPU"):
        GraphReplay(Replay(()))


def test_a_kernel_gets_more_than_48_kb_of_dynamic_shared_memory_launched_or_replayed():
    """Above the 48 KB CUDA grants unasked, the kernel is opted in before its first launch."""
    n = 16 * 1024  # 64 KB of float32
    values = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(interop.kernel_device())
    out = torch.full_like(values, float("nan"))
    to = interop.to_kernel
    with recording() as calls:
        launch_kernel(_reverse_through_shared, 1, 128, to(values), to(out), shared_bytes=4 * n)
    torch.testing.assert_close(out, values.flip(0))
    out.fill_(float("nan"))
    Launcher(calls[0]).launch(interop.launch_stream_handle())
    torch.testing.assert_close(out, values.flip(0))


@pytest.mark.gpu
def test_resident_ctas_is_the_first_wave_that_shared_memory_allows():
    """40 KB of dynamic shared memory a CTA (plus what CUDA reserves for each) bounds how
    many CTAs a multiprocessor holds; the first wave is that on every multiprocessor."""
    n, shared_bytes = 1024, 40 * 1024
    values = torch.zeros(n, device="cuda")
    args = (interop.to_kernel(values), interop.to_kernel(torch.empty_like(values)))
    device = cuda.get_current_device()
    per_sm = device.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR // (shared_bytes + device.RESERVED_SHARED_MEMORY_PER_BLOCK)
    assert launch.resident_ctas(_reverse_through_shared, 128, shared_bytes, args) == per_sm * device.MULTIPROCESSOR_COUNT
