"""The lean launcher runs a kernel exactly as an ordinary Numba launch does, re-points
its buffers in place, and is much cheaper per launch on the GPU."""

import time

import numpy as np
import pytest
import torch
from numba import cuda

from numba_kernels import interop, ptx
from numba_kernels.launch import Launcher


@ptx.kernel
def _scaled_gather(values, pairs, index, scale, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        first, second = pairs
        out[i] = values[index[i]] * scale + first[i] + second[0, i]


def _inputs(n, seed):
    generator = torch.Generator().manual_seed(seed)
    device = interop.kernel_device()
    values = torch.randn(n, generator=generator).to(device)
    pairs = (torch.randn(n, generator=generator).to(device), torch.randn(2, n, generator=generator).to(device))
    index = torch.randperm(n, generator=generator).to(torch.int32).to(device)
    return values, pairs, index


def _expected(values, pairs, index, scale):
    return values[index.long()] * scale + pairs[0] + pairs[1][0]


def test_launcher_matches_the_kernel_and_repoints_buffers():
    n = 40
    values, pairs, index = _inputs(n, 0)
    out = torch.full((n,), float("nan"), device=values.device)
    to = interop.to_kernel
    launcher = Launcher(_scaled_gather, (2,), 32,
                        (to(values), (to(pairs[0]), to(pairs[1])), to(index), np.float32(2.0), to(out)))
    launcher.launch(interop.launch_stream_handle())
    torch.testing.assert_close(out, _expected(values, pairs, index, 2.0))

    values2, pairs2, index2 = _inputs(n, 1)
    out2 = torch.full((n,), float("nan"), device=values.device)
    launcher.set_array(0, to(values2))
    launcher.set_array(2, to(index2))
    launcher.set_array(4, to(out2))
    launcher.set_scalar(3, -1.0)
    launcher.launch(interop.launch_stream_handle())
    torch.testing.assert_close(out2, _expected(values2, pairs, index2, -1.0))


def test_set_array_rejects_a_different_rank():
    values, pairs, index = _inputs(8, 0)
    to = interop.to_kernel
    launcher = Launcher(_scaled_gather, (1,), 32, (to(values), (to(pairs[0]), to(pairs[1])), to(index),
                                                    np.float32(1.0), to(values)))
    if not ptx.SIMULATED:
        with pytest.raises(ValueError, match="rank"):
            launcher.set_array(0, to(pairs[1]))


@pytest.mark.gpu
def test_launcher_host_time_is_far_below_an_ordinary_launch():
    n = 1024
    values, pairs, index = _inputs(n, 0)
    out = torch.empty(n, device=values.device)
    to = interop.to_kernel
    args = (to(values), (to(pairs[0]), to(pairs[1])), to(index), np.float32(2.0), to(out))
    launcher = Launcher(_scaled_gather, (4,), 256, args)
    stream = interop.launch_stream_handle()
    numba_stream = interop.launch_stream()
    for _ in range(10):
        launcher.launch(stream)
        _scaled_gather[4, 256, numba_stream](*args)
    torch.cuda.synchronize()

    def host_time(launch):
        start = time.perf_counter()
        for _ in range(500):
            launch()
        elapsed = (time.perf_counter() - start) / 500
        torch.cuda.synchronize()
        return elapsed

    lean = host_time(lambda: launcher.launch(stream))
    ordinary = host_time(lambda: _scaled_gather[4, 256, numba_stream](*args))
    print(f"host time per launch: launcher {lean * 1e6:.1f} us, numba {ordinary * 1e6:.1f} us")
    assert lean < ordinary / 2
