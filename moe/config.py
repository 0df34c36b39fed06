"""What an MoE layer is: its shapes, routing, activation, experts on this rank, and how
its weights are quantized. A frozen value: kernels, tile choices and workspaces are keyed
on it."""

from __future__ import annotations

import operator

import attrs

from layouts import E2M1, QuantSpec, formats
from layouts.checks import check_group_size, one_of
from numba_kernels.activation import Activation
from numba_kernels.routing import RoutingConfig

_CHECKPOINT_FORMATS = ("gptq", "awq", "compressed_tensors", "nvfp4", "marlin", "native")
_HALVES = ("bfloat16", "float16")


def _positive(instance, attribute, value):
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be a positive int, got {value!r}")


def _to_expert_map(value) -> tuple[int, ...] | None:
    """A sequence of integers as a tuple; floats or a string are refused, not truncated."""
    if value is None:
        return None
    if isinstance(value, str):
        raise TypeError(f"expert_map must be a sequence of ints, got the string {value!r}")
    try:
        return tuple(operator.index(v) for v in value)
    except TypeError:
        raise TypeError(f"expert_map must be a sequence of ints (global expert -> local index or -1), "
                        f"got {value!r}") from None


def _to_activation(value) -> Activation:
    return value if isinstance(value, Activation) else Activation(value)


@attrs.frozen
class QuantScheme:
    """How a checkpoint stores expert weights: a named format with its parameters, or any
    `QuantSpec` (then `checkpoint_spec` returns it as is).

    format:       gptq | awq | compressed_tensors | nvfp4 | marlin | native, or a QuantSpec.
    bits:         4 or 8 (integer formats).
    group_size:   32, 64, 128, ... or None for channel-wise scales.
    symmetric:    False for zero points (AWQ always has them).
    act_order:    GPTQ act-order (g_idx).
    nvfp4_checkpoint: compressed_tensors or modelopt naming of NVFP4 tensors.
    """

    format: str | QuantSpec = attrs.field(default="gptq")
    bits: int = 4
    group_size: int | None = attrs.field(default=128, validator=check_group_size)
    symmetric: bool = True
    act_order: bool = False
    nvfp4_checkpoint: str = attrs.field(default="compressed_tensors",
                                        validator=one_of(tuple(formats.NVFP4_CHECKPOINTS)))

    @format.validator
    def _check_format(self, attribute, value):
        if not isinstance(value, QuantSpec) and value not in _CHECKPOINT_FORMATS:
            raise ValueError(f"format must be a QuantSpec or one of {_CHECKPOINT_FORMATS}, got {value!r}")

    def checkpoint_spec(self, half: str = "bfloat16") -> QuantSpec:
        """The layout the checkpoint's tensors are in."""
        if isinstance(self.format, QuantSpec):
            return self.format
        if self.format == "gptq":
            return formats.gptq(self.bits, self.group_size, symmetric=self.symmetric, act_order=self.act_order)
        if self.format == "awq":
            return formats.awq(self.bits, self.group_size)
        if self.format == "compressed_tensors":
            return formats.compressed_tensors(self.bits, self.group_size, symmetric=self.symmetric)
        if self.format == "nvfp4":
            return formats.nvfp4(checkpoint=self.nvfp4_checkpoint)
        if self.format == "marlin":
            return formats.marlin(self.bits, self.group_size, zero_points=not self.symmetric,
                                  act_order=self.act_order, scale_dtype=half)
        return self.native_spec(half)

    def native_spec(self, half: str = "bfloat16") -> QuantSpec | None:
        """The kernel-native layout weight processing converts to, or None when the codes
        do not fit it (2- and 3-bit codes: the GEMM then reads the checkpoint as stored)."""
        if self.format == "native":
            return formats.native(self.bits, self.group_size, zero_points=not self.symmetric,
                                  act_order=self.act_order, half=half)
        spec = self.checkpoint_spec(half)
        if isinstance(spec.code, E2M1):
            return formats.native(fp4=True) if spec.group_size == 16 else None
        if spec.code.bits not in (4, 8) or (spec.zeros is not None and spec.g_idx_name is not None):
            return None
        return formats.native(spec.code.bits, spec.group_size, zero_points=spec.zeros is not None,
                              act_order=spec.g_idx_name is not None, half=half)


@attrs.frozen
class MoEConfig:
    """One MoE layer.

    num_experts:        experts of the whole layer (global).
    top_k:              experts per token.
    hidden_size:        H, the layer's input and output width.
    intermediate_size:  I, each expert's hidden width (gate and up are I wide each).
    activation:         an `Activation` or its name ("silu", "gelu", "gelu_tanh", "swigluoai", ...).
    scoring, renormalize, num_expert_group, topk_group, routed_scaling_factor: routing
                        (softmax top-k, or sigmoid with bias and grouped top-k as in DeepSeek-V3).
    expert_map:         global expert -> local index, -1 for experts on other ranks (expert
                        parallelism); None: every expert is local.
    quant:              how the checkpoint's expert weights are stored.
    dtype:              activation dtype name, bfloat16 or float16.
    """

    num_experts: int = attrs.field(validator=_positive)
    top_k: int = attrs.field(validator=_positive)
    hidden_size: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)
    activation: Activation = attrs.field(default="silu", converter=_to_activation)
    scoring: str = "softmax"
    renormalize: bool = False
    num_expert_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    expert_map: tuple[int, ...] | None = attrs.field(default=None, converter=_to_expert_map)
    quant: QuantScheme = attrs.field(factory=QuantScheme)
    dtype: str = attrs.field(default="bfloat16", validator=one_of(_HALVES))

    def __attrs_post_init__(self):
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must not exceed num_experts ({self.num_experts})")
        if self.expert_map is not None:
            if len(self.expert_map) != self.num_experts:
                raise ValueError(f"expert_map must map all {self.num_experts} experts, got {len(self.expert_map)} entries")
            local = sorted(v for v in self.expert_map if v >= 0)
            if local != list(range(len(local))) or any(v < -1 for v in self.expert_map):
                raise ValueError("expert_map must send local experts to 0..L-1 (each once) and the others to -1")
            if not local:
                raise ValueError("expert_map must keep at least one expert on this rank, got all -1")
        self.routing.check_experts(self.num_experts)

    @quant.validator
    def _check_quant(self, attribute, value):
        if not isinstance(value, QuantScheme):
            raise TypeError(f"quant must be a QuantScheme, e.g. QuantScheme('gptq', bits=4, group_size=128), "
                            f"got {value!r}")

    @property
    def routing(self) -> RoutingConfig:
        return RoutingConfig(top_k=self.top_k, scoring=self.scoring, renormalize=self.renormalize,
                             num_expert_group=self.num_expert_group, topk_group=self.topk_group,
                             routed_scaling_factor=self.routed_scaling_factor)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts if self.expert_map is None else sum(v >= 0 for v in self.expert_map)

    @property
    def gate_up_size(self) -> int:
        """gemm1's output width: 2 I for gated activations, I otherwise."""
        return 2 * self.intermediate_size if self.activation.gated else self.intermediate_size


def check_config(config) -> None:
    """Raise unless `config` is a MoEConfig (arguments swapped or left out fail far away)."""
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
