"""Expert weights of a layer in the kernel layout, and the conversion from checkpoints.

`ExpertWeights` preallocates the layer's weights in the kernel-native layout
(`formats.native`, Marlin's tensor-core tiles; for formats the native layout cannot hold,
the checkpoint's own layout, which the GEMM reads through its index maps) and converts
checkpoint tensors into them expert by expert on the device (`numba_kernels.repack`),
through one reusable scratch buffer per checkpoint tensor. So converting costs about one
expert's checkpoint tensors of extra memory, nothing of the checkpoint stays alive
afterwards, and loading new weights later (reinforcement-learning weight sync) converts
them into the same buffers, so kernels, launchers and captured graphs keep working.

GPTQ, AWQ, compressed-tensors, Marlin and NVFP4 (compressed-tensors or ModelOpt names)
all go through this one path; only the layout spec differs. w13 holds [w1 (gate); w3 (up)]
rows, logical (E, 2I, H) (or (E, I, H) for non-gated activations); w2 is (E, H, I).

Act-order weights are stored with K sorted by group, and the GEMMs read them as plain
tiles of the column-permuted weight, each slot's activations permuted to match first
(`numba_kernels.permute`): so loading checks that every expert's groups hold group_size
input features each, as GPTQ makes them.
"""

from __future__ import annotations

import functools
from typing import Iterable, Mapping

import numpy as np
import torch

from layouts import QuantSpec, formats
from numba_kernels import interop
from numba_kernels.permute import groups_are_runs, plain_spec
from numba_kernels.repack import destination_tensors, repack
from numba_kernels.weights import KernelWeights

from .config import MoEConfig, check_config


def _to_tensor(value) -> torch.Tensor:
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)
        if array.dtype == np.uint16:
            return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
        if array.dtype == np.uint32:
            array = array.view(np.int32)
        return torch.from_numpy(np.ascontiguousarray(array))
    return interop.as_tensor(value, "checkpoint tensor")


UNREAD_NAMES = frozenset().union(*(spec.tensor_names for spec in (
    formats.gptq(symmetric=False, act_order=True), formats.awq(), formats.compressed_tensors(symmetric=False),
    formats.marlin(zero_points=True), formats.marlin(act_order=True),
    *(formats.nvfp4(checkpoint=name) for name in formats.NVFP4_CHECKPOINTS)))) | {"input_scale", "input_global_scale"}
"""Checkpoint tensors a format may carry without needing them (symmetric GPTQ's constant
qzeros, a trivial g_idx, activation scales): skipped. Any other name (an expert bias, a
misspelt tensor) is refused rather than silently left out."""


@functools.cache
def kernel_spec(config: MoEConfig) -> QuantSpec:
    """The layout the kernels read `config`'s weights in: the kernel-native layout where the
    format has one, else the checkpoint's own (read through its index maps). Cached: the
    oracle asks on every call, and building a layout's permutations takes 0.1 to 0.3 ms."""
    return config.quant.native_spec(config.dtype) or config.quant.checkpoint_spec(config.dtype)


def gemm_spec(stored: QuantSpec) -> QuantSpec:
    """How the GEMMs read weights stored as `stored`: act-order's K-sorted tiles as their
    plain twin (`permute.plain_spec`, module docstring), any other layout as it is."""
    return plain_spec(stored) or stored


def permutes_inputs(config: MoEConfig) -> bool:
    """Whether `config`'s GEMMs read act-order weights as plain tiles, their inputs
    permuted per slot first (module docstring): the workspace holds the permuted rows."""
    return plain_spec(kernel_spec(config)) is not None


def _check_stored_shape(label: str, tensor: torch.Tensor, logical: tuple[int, int], experts: int) -> None:
    """compressed-tensors' weight_shape: the stacked (E, N, K), or (N, K) once per expert."""
    stored = tensor.reshape(-1).tolist()
    if stored != [experts, *logical] and stored != [*logical] * experts:
        raise ValueError(f"{label} is {stored}, the layer expects {[experts, *logical]} or {list(logical)} "
                         "per expert")


_ACT_ORDER = formats.marlin(act_order=True)
_K_ORDERS = (_ACT_ORDER.g_idx_name, _ACT_ORDER.sort_indices_name)
"""Act-order's per-feature tensors (GPTQ's groups, Marlin's sort): one (K,) may serve every
expert, and checkpoints without act-order may carry them in K order, or empty."""


def _check_unread(name: str, tensor: torch.Tensor, k: int, spec: QuantSpec) -> None:
    """A tensor the format carries but does not read must say nothing: a g_idx in K order
    (`k // group_size`), or one value throughout (symmetric GPTQ's qzeros). Otherwise the
    checkpoint is act-order or has zero points, and the QuantScheme says it has not."""
    if name in _K_ORDERS and tensor.numel():
        trivial = torch.arange(k, device=tensor.device) // ((spec.group_size or k) if name == _K_ORDERS[0] else 1)
        if tensor.shape != trivial.shape or not torch.equal(tensor.long(), trivial):
            raise ValueError(f"{name} is not in K order: the checkpoint is act-order, and {spec.name} reads no "
                             "g_idx (QuantScheme(act_order=True))")
    elif tensor.numel() and not bool((tensor == tensor.reshape(-1)[0]).all()):
        raise ValueError(f"{name} varies, and {spec.name} does not read it: zero points need "
                         "QuantScheme(symmetric=False)")


class ExpertWeights:
    """The layer's w13 and w2 in the layout the kernels read, preallocated for the local
    experts; `load_expert` / `load` fill them from checkpoint tensors.

    stored_spec:      the layout the buffers hold (what checkpoints are converted into).
    spec:             how the GEMMs read them (`w13`, `w2`): the stored layout, or for
                      act-order its plain twin (`permute.plain_spec`).
    permutes_inputs:  the GEMMs' inputs are permuted into each expert's K order first
                      (`w13.k_order`, `w2.k_order`)."""

    def __init__(self, config: MoEConfig):
        check_config(config)
        self.config = config
        self.checkpoint_spec = config.quant.checkpoint_spec(config.dtype)
        self.stored_spec = kernel_spec(config)
        self.spec = gemm_spec(self.stored_spec)
        self.permutes_inputs = self.spec is not self.stored_spec
        experts, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.w13_shape = (experts, config.gate_up_size, h)
        self.w2_shape = (experts, h, i)
        self._w13 = {name: interop.empty(shape, dtype)
                     for name, (shape, dtype) in destination_tensors(self.stored_spec, self.w13_shape).items()}
        self._w2 = {name: interop.empty(shape, dtype)
                    for name, (shape, dtype) in destination_tensors(self.stored_spec, self.w2_shape).items()}
        self.w13, self.w2 = (
            KernelWeights(self.spec, shape, KernelWeights.from_physical(self.stored_spec, tensors, shape,
                                                                        check_indices=False).tensors)
            for tensors, shape in ((self._w13, self.w13_shape), (self._w2, self.w2_shape)))
        self._scratch: dict[tuple[str, str], torch.Tensor] = {}
        self.loaded = np.zeros(experts, dtype=bool)
        self._all_loaded = False  # until a load fails (that expert is then unloaded)

    def _on_device(self, role: str, physical: Mapping) -> dict[str, torch.Tensor]:
        """Copy one expert's checkpoint tensors into reusable device scratch buffers."""
        staged = {}
        for name, value in physical.items():
            tensor = _to_tensor(value)
            key = (role, name)
            buffer = self._scratch.get(key)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device=interop.kernel_device())
                self._scratch[key] = buffer
            buffer.copy_(tensor)
            staged[name] = buffer
        return staged

    def _convert(self, role: str, physical: Mapping, logical: tuple[int, int], out: dict, expert: int, *,
                 dst_rows: int, row_offset: int = 0) -> None:
        try:
            physical = self._read_names(physical, logical)
            source = KernelWeights.from_physical(self.checkpoint_spec, self._on_device(role, physical), logical)
            if source.num_experts != 1:
                raise ValueError(f"must hold one expert's tensors, got {source.num_experts} experts")
            repack(source, self.stored_spec, out=out, experts=range(expert, expert + 1), row_offset=row_offset,
                   dst_rows=dst_rows, zero_first=row_offset == 0)
        except (ValueError, TypeError, KeyError) as error:  # say which projection of which expert
            message = error.args[0] if isinstance(error, KeyError) and error.args else error
            raise type(error)(f"expert {expert}, {role}: {message}") from error

    def _read_names(self, physical: Mapping, logical: tuple[int, int]) -> dict:
        """The tensors of `physical` that the checkpoint spec reads, after checking the rest
        are names checkpoints carry unread (`UNREAD_NAMES`) and a stored logical shape
        (compressed-tensors' weight_shape) agrees with the layer (`KernelWeights.from_physical`
        checks what the spec reads, act-order's indices among them)."""
        spec = self.checkpoint_spec
        read = spec.tensor_names
        unknown = sorted(set(physical) - read - UNREAD_NAMES)
        if unknown:
            raise ValueError(f"unexpected tensors {unknown} ({spec.name} reads {sorted(read)}; expert biases or "
                             "other extra tensors are not supported)")
        k = logical[1]
        for name, value in physical.items():
            if name == spec.shape_name:
                _check_stored_shape(name, _to_tensor(value), logical, experts=1)
            elif name not in read:
                _check_unread(name, _to_tensor(value), k, spec)
        return {name: value for name, value in physical.items() if name in read and name != spec.shape_name}

    def load_expert(self, expert: int, w1: Mapping, w2: Mapping, w3: Mapping | None = None) -> None:
        """Convert local expert `expert`'s checkpoint tensors (engine names, one expert's
        shapes: w1 and w3 (I, H), w2 (H, I)) into the kernel buffers."""
        config = self.config
        if isinstance(expert, bool) or not isinstance(expert, (int, np.integer)):
            raise TypeError(f"expert must be an int (a local expert index), got {expert!r}")
        if not 0 <= expert < config.num_local_experts:
            raise IndexError(f"expert must lie in [0, {config.num_local_experts}), got {expert}")
        self._check_mappings(w1, w2, w3)
        h, i = config.hidden_size, config.intermediate_size
        if config.activation.gated and w3 is None:
            raise ValueError(f"a gated activation ({config.activation.name}) needs w3 (the up projection)")
        if not config.activation.gated and w3 is not None:
            raise ValueError(f"a non-gated activation ({config.activation.name}) takes no w3")
        self._check_shared_global_scale(expert, w1, w3)
        self.loaded[expert] = self._all_loaded = False  # until every projection is in
        gate_up = self.w13_shape[1]
        self._convert("w1", w1, (i, h), self._w13, expert, dst_rows=gate_up)
        if w3 is not None:
            self._convert("w3", w3, (i, h), self._w13, expert, dst_rows=gate_up, row_offset=i)
        self._convert("w2", w2, (h, i), self._w2, expert, dst_rows=h)
        if self.permutes_inputs:
            self._check_group_runs(expert)
        self.loaded[expert] = True

    def _check_group_runs(self, expert: int) -> None:
        """Act-order groups must hold group_size input features each (the last the rest):
        only then are the K-sorted tiles plain ones (module docstring)."""
        spec = self.stored_spec
        for role, tensors in (("w1 and w3" if self.config.activation.gated else "w1", self._w13), ("w2", self._w2)):
            g_idx = tensors[spec.g_idx_name][expert]
            if not groups_are_runs(g_idx, spec.group_size):
                sizes = torch.bincount(g_idx.long()).tolist()
                raise ValueError(f"expert {expert}: the act-order groups of {role} must hold group_size = "
                                 f"{spec.group_size} input features each (the last one the rest), as GPTQ makes "
                                 f"them; their g_idx gives groups of {sizes[:8]}{'...' if len(sizes) > 8 else ''}")

    def _check_mappings(self, w1, w2, w3) -> None:
        """Each projection comes as the checkpoint's tensors by name: a bare tensor (a dense
        weight, or only the packed codes) has no scales to convert with."""
        spec = self.checkpoint_spec
        for role, physical in (("w1", w1), ("w2", w2), ("w3", w3)):
            if physical is None and role != "w3":
                raise TypeError(f"{role} is required (the checkpoint's {spec.name} tensors by name)")
            if physical is not None and not isinstance(physical, Mapping):
                raise TypeError(f"{role} must map the checkpoint's tensor names to tensors ({spec.name}: "
                                f"{spec.weight.name!r}, {spec.scales.name!r}, ...), got {type(physical).__name__}")

    def _check_shared_global_scale(self, expert: int, w1: Mapping, w3: Mapping | None) -> None:
        """The kernel layout keeps one NVFP4 global scale per expert for [w1; w3]: checkpoint
        exporters give fused gate/up projections one (ModelOpt unifies their amax)."""
        name = self.checkpoint_spec.global_scale_name
        if name is None or w3 is None or name not in w1 or name not in w3:  # a missing one: named by _convert
            return
        gate, up = (float(_to_tensor(w[name]).float().reshape(-1)[0]) for w in (w1, w3))
        if gate != up:
            raise ValueError(f"expert {expert}: w1 and w3 have different global scales ({name} {gate} and {up}); "
                             "the kernel layout keeps one per expert, as fused gate/up checkpoints store them")

    def load(self, experts: Iterable[tuple[int, Mapping, Mapping, Mapping | None]]) -> None:
        """`load_expert` for each (expert, w1, w2, w3) of `experts` (any iterable, e.g. a
        generator reading a checkpoint expert by expert)."""
        for item in experts:
            if not isinstance(item, (tuple, list)) or len(item) != 4:
                got = f"of {len(item)}" if isinstance(item, (tuple, list)) else repr(item)
                raise TypeError("experts must yield (expert, w1, w2, w3) tuples (w3 None for a non-gated "
                                f"activation), got {type(item).__name__} {got}")
            self.load_expert(*item)

    def load_stacked(self, w1: Mapping, w2: Mapping, w3: Mapping | None = None) -> None:
        """`load` from stacked checkpoint tensors (leading expert axis; act-order's g_idx and
        K sort indices may also be one (K,) for every expert), one expert at a time, then
        drop the scratch."""
        self._check_mappings(w1, w2, w3)
        spec = self.checkpoint_spec
        orders = set(_K_ORDERS) | {spec.g_idx_name, spec.sort_indices_name} - {None}

        experts, h, i = self.config.num_local_experts, self.config.hidden_size, self.config.intermediate_size
        for role, physical, logical in (("w1", w1, (i, h)), ("w2", w2, (h, i)), ("w3", w3, (i, h))):
            for name, value in (physical or {}).items():
                shape = tuple(np.shape(value))
                if name == spec.shape_name:
                    _check_stored_shape(f"{role}[{name!r}]", _to_tensor(value), logical, experts)
                elif not (name in orders and len(shape) == 1) and shape[:1] != (experts,):
                    where = " (this rank's, in local order: see expert_map)" if self.config.expert_map else ""
                    raise ValueError(f"{role}[{name!r}] must hold the {experts} local experts{where} along its "
                                     f"first axis, got shape {shape}")

        def expert_slice(physical: Mapping | None, expert: int):
            if physical is None:
                return None
            return {name: value if name in orders and np.ndim(value) == 1 else value[expert]
                    for name, value in physical.items() if name != spec.shape_name}

        self.load((e, expert_slice(w1, e), expert_slice(w2, e), expert_slice(w3, e))
                  for e in range(self.config.num_local_experts))
        self.release_scratch()

    def fill_random(self, seed: int = 0) -> None:
        """Random weights written straight into the kernel buffers, for benchmarks (no
        checkpoint, no conversion): random code bits, scales in a moderate range."""
        generator = torch.Generator(device=interop.kernel_device()).manual_seed(seed)
        spec = self.stored_spec
        for tensors, (_, _, k) in ((self._w13, self.w13_shape), (self._w2, self.w2_shape)):
            for name, tensor in tensors.items():
                if name == spec.scales.name and tensor.dtype == torch.uint8:  # fp8 bytes of 2**-4 .. 2**2
                    low, high = (int(b) for b in spec.scale_format.encode(np.array([2.0 ** -4, 4.0])))
                    tensor.copy_(torch.randint(low, high, tensor.shape, generator=generator, device=tensor.device))
                elif name == spec.scales.name:
                    tensor.uniform_(0.5 / k ** 0.5, 1.5 / k ** 0.5, generator=generator)
                elif name == spec.global_scale_name:
                    tensor.fill_(1.0)
                elif name == spec.g_idx_name:
                    tensor.copy_(torch.arange(k, device=tensor.device) // spec.group_size)
                elif name == spec.sort_indices_name and spec.sort_k_by_group:
                    tensor.copy_(torch.arange(k, device=tensor.device))
                else:
                    info = torch.iinfo(tensor.dtype)
                    tensor.copy_(torch.randint(info.min, info.max, tensor.shape, generator=generator,
                                               device=tensor.device, dtype=torch.int64).to(tensor.dtype))
        self.loaded[:] = True

    def release_scratch(self) -> None:
        """Free the conversion scratch buffers (they are reused while loading)."""
        self._scratch.clear()

    def check_loaded(self) -> None:
        if self._all_loaded:  # asked on every forward: the array is looked at until it is full
            return
        if not self.loaded.all():
            missing = np.flatnonzero(~self.loaded)
            raise RuntimeError(f"experts {missing[:8].tolist()}{'...' if missing.size > 8 else ''} have no weights: "
                               "call load_expert or load first")
        self._all_loaded = True


def process_weights_after_loading(config: MoEConfig, w1: Mapping, w2: Mapping, w3: Mapping | None = None) -> ExpertWeights:
    """Convert stacked checkpoint tensors (engine names, leading local-expert axis; w1 and w3
    the gate and up projections, logical (E, I, H); w2 (E, H, I)) into the kernel layout,
    one expert at a time through one scratch buffer per tensor, which is freed afterwards."""
    weights = ExpertWeights(config)
    weights.load_stacked(w1, w2, w3)
    return weights
