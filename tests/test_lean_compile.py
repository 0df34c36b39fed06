"""`numba_kernels.lean_compile`: the package's kernels compile without numba-cuda's unused
PTX, to the same code. Compiled for sm_90a in a process of its own with the real CUDA
target (`tools.ptx_check`: no GPU needed, but libNVVM and nvJitLink), since the test
session itself may run under the simulator."""

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

COMPILE_BOTH_WAYS = """
import json, re
import tools.ptx_check as ptx_check  # the real target on a stand-in sm_90 device, before numba_kernels
from numba.cuda.cudadrv import driver, nvvm
try:
    nvvm.NVVM()
    assert driver._have_nvjitlink()
except Exception as error:
    print(json.dumps({"skip": f"no libNVVM or nvJitLink here: {error!r}"}))
    raise SystemExit
import numpy as np
from numba import cuda, float32
from numba_kernels import ptx

compiled_to = []  # per NVVM compile: LTO-IR (True) or PTX (False)
compile_ir = nvvm.compile_ir
def counting(*args, **options):
    compiled_to.append("gen-lto" in options)
    return compile_ir(*args, **options)
nvvm.compile_ir = counting

to_half = ptx.to_half("bfloat16")

def make():  # a new function object each time: only ptx.kernel's are the package's
    def scale_to_half(x, out):  # calls a PTX helper, linked from CUDA C++
        i = cuda.grid(1)
        if i < x.size:
            out[i] = to_half(x[i] * float32(2))
    return scale_to_half

args = (np.zeros(64, np.float32), np.zeros(64, np.int16))
result = {}
for name, kernel in (("package", ptx.kernel(make())), ("plain", cuda.jit(lto=True)(make()))):
    compiled_to.clear()
    code = ptx_check.compile_kernel(kernel, *args).ptx
    result[name] = {"compiled_to": list(compiled_to), "ptx": re.sub(r"_Z[0-9A-Za-z_$]+", "NAME", code)}
print(json.dumps(result))
"""


def test_a_cuda_target_that_is_not_numba_cuda_is_left_alone(monkeypatch):
    """Where no numba-cuda distribution is installed (its successor, say), nothing is
    wrapped and kernels compile the ordinary way, rather than failing to build."""
    from numba_kernels import lean_compile

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert lean_compile._install.__wrapped__() is False


def test_package_kernels_skip_the_ptx_numba_cuda_throws_away():
    """A `ptx.kernel` is compiled by NVVM once, to LTO-IR; the same function as a plain
    `cuda.jit(lto=True)` kernel (not the package's: left as numba-cuda compiles it) once
    to PTX in its constructor and then to LTO-IR; both link to the same PTX."""
    env = {key: value for key, value in os.environ.items() if key != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("NUMBA_MOE_LEAN_COMPILE", None)
    run = subprocess.run([sys.executable, "-c", COMPILE_BOTH_WAYS], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    assert result["package"]["compiled_to"] == [True]
    assert result["plain"]["compiled_to"] == [False, True]
    assert result["package"]["ptx"] == result["plain"]["ptx"]
    assert "cvt.rn.bf16.f32" in result["package"]["ptx"]  # the helper, inlined
