"""The eager fast path: a forward's kernel launches recorded once, replayed per call.

Launching a forward's five or six kernels through Numba costs far more host time than
the GPU spends on them at decode (see `numba_kernels.launch`). So the first forward of a
given kind (token count, input dtypes, weights) runs the kernel wrappers
as usual inside `launch.recording()`, and the recorded launches become a `Program`:
`Launcher`s with their parameters packed, plus a note of every array argument that reads
one of the call's inputs. Later forwards of that kind re-point those arguments at the new
inputs and launch; the workspace's buffers, the weights and the tile choice are the
recorded ones, so nothing is validated, chosen or converted again. On the GPU the
launches are also captured into one CUDA graph (`launch.GraphReplay`): a replay is then a
parameter update for each kernel that reads an input and one graph launch, the host time
of about one launch instead of one per kernel.

An argument "reads an input" when its data pointer is the input's. To keep that
unambiguous the recording runs on private copies of inputs that share memory with each
other or with the workspace (an output fed back as the next input); the copies exist
only during that first call. On the GPU the first program of a process is replayed once
on its recorded inputs and must reproduce the recorded output bit for bit, or replay is
switched off (a guard against a numba-cuda version whose launches `Launcher` misreads).
"""

from __future__ import annotations

import warnings
from typing import Callable, Sequence

import attrs
import torch

from numba_kernels.launch import (GraphReplay, Launcher, LeanLaunchUnavailable, Replay, data_pointer, is_array,
                                  recording)
from numba_kernels.ptx import SIMULATED


@attrs.frozen(eq=False)
class Program:
    """Recorded launches and where each input goes: (launcher, argument, input) triples.
    `graph`: the same launches as one CUDA graph (`launch.GraphReplay`), where the GPU
    takes them so; else each call launches them one by one."""

    launches: Replay
    bindings: tuple[tuple[int, int, int], ...]
    output: torch.Tensor
    graph: GraphReplay | None = None

    def replay(self, inputs: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Launch again with `inputs` (laid out like the recorded ones) in their places."""
        launchers = self.launches.launchers
        for launcher, argument, position in self.bindings:
            launchers[launcher].rebind(argument, inputs[position])
        (self.graph or self.launches)()
        return self.output


def record(forward: Callable[[Sequence[torch.Tensor | None]], torch.Tensor], inputs: Sequence[torch.Tensor | None],
           owned: Callable[[torch.Tensor], bool]) -> tuple[torch.Tensor, Program | None]:
    """Run `forward(inputs)` once, recording its launches: (its output, the Program, or
    None where this numba-cuda cannot replay them). `owned(tensor)` says whether a tensor
    lies in memory the forward itself writes (the workspace)."""
    if _CHECK.failed:
        return forward(inputs), None
    staged, seen = [], set()
    for tensor in inputs:
        if tensor is not None and (tensor.data_ptr() in seen or owned(tensor)):
            tensor = tensor.clone()
        if tensor is not None:
            seen.add(tensor.data_ptr())
        staged.append(tensor)
    with recording() as calls:
        output = forward(staged)
    try:
        program = _program(calls, staged, output)
    except LeanLaunchUnavailable:
        return output, None
    if _CHECK.pending and not SIMULATED and not torch.cuda.is_current_stream_capturing():
        program = _checked(program, staged, output)
    return output, program


class _Check:
    pending = True  # until the first program of this process has been checked
    failed = False


_CHECK = _Check()


def _checked(program: Program, inputs, output: torch.Tensor) -> Program | None:
    """The first program of a process, replayed once on the recorded inputs, must give the
    recorded output bit for bit (every kernel is deterministic): a guard against a
    numba-cuda whose parameter packing `Launcher` misreads. If it does not, replay stays
    off for the process, with a warning, and the output is restored."""
    recorded = output.clone()
    program.replay(inputs)
    _CHECK.pending = False
    if torch.equal(output.view(torch.int16), recorded.view(torch.int16)):  # bits: NaN inputs give equal NaNs
        return program
    output.copy_(recorded)
    _CHECK.failed = True
    warnings.warn("a replayed forward differed from the ordinary launches: the eager fast path is off "
                  "(please report your numba-cuda version)", RuntimeWarning, stacklevel=3)
    return None


def _program(calls, inputs, output) -> Program:
    positions = {tensor.data_ptr(): position for position, tensor in enumerate(inputs) if tensor is not None}
    bindings = []
    for index, call in enumerate(calls):
        for argument, value in enumerate(call.args):
            if is_array(value):
                position = positions.get(data_pointer(value))
                if position is not None:
                    bindings.append((index, argument, position))
    unused = set(positions.values()) - {position for _, _, position in bindings}
    if unused:
        raise AssertionError(f"inputs {sorted(unused)} reach no kernel argument at their first element; "
                             "a wrapper passes an offset view, which replay cannot re-point")
    launches = Replay(tuple(Launcher(call) for call in calls))
    try:
        graph = GraphReplay(launches, rebound=[launcher for launcher, _, _ in bindings])
    except LeanLaunchUnavailable:
        graph = None  # the simulator, or a driver that will not capture these launches
    return Program(launches, tuple(bindings), output, graph)


class ProgramCache:
    """Programs by weights and call kind, least recently used dropped beyond `capacity`.
    An entry keeps its weights alive, so their id in its key cannot be reused meanwhile."""

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._entries: dict = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, kind) -> Program | None:
        entry = self._entries.pop(kind, None)
        if entry is None:
            return None
        self._entries[kind] = entry  # most recently used last
        return entry[1]

    def put(self, kind, program: Program | None, weights) -> None:
        """Remember `program` (nothing when None: that call kind is not replayable)."""
        if program is None:
            return
        self._entries[kind] = (weights, program)
        while len(self._entries) > self.capacity:
            del self._entries[next(iter(self._entries))]

    def clear(self) -> None:
        self._entries.clear()

    def run(self, kind, weights, forward, inputs: Sequence[torch.Tensor | None],
            owned: Callable[[torch.Tensor], bool]) -> torch.Tensor:
        """`forward(inputs)`: replayed if a call of this kind with these weights was
        recorded, else run and recorded (see `record`)."""
        key = (id(weights), kind)
        program = self.get(key)
        if program is not None:
            return program.replay(inputs)
        output, program = record(forward, inputs, owned)
        self.put(key, program, weights)
        return output
