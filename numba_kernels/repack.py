"""Repack: re-store a checkpoint's quantized weight in another spec's layout, on the device.

Bit-exact with `layouts.convert(physical, src_spec, dst_spec)` (= dst.pack(src.unpack(...)))
and generated from the two specs, with no format-specific code: GPTQ or AWQ -> Marlin,
compressed-tensors -> GPTQ, NVFP4 compressed-tensors -> ModelOpt swizzled, and any other
pair that shares the code type, group size, zero points and act-order (`check_convertible`).

Algorithm (one kernel launch, plus a few small torch ops for act-order and global scales):

* codes: for every logical element (e, n, k), read the code through the source's index
  map (`elements.code_reader`) and OR it into its destination word at the place the
  destination's map gives (`Layout.locate`). The destination words are zeroed first and
  every code's bits are disjoint, so the atomic ORs give the same words in any order:
  deterministic, and padding (partial words, Pad, the 128x4 swizzle) stays zero.
  Destination words are addressed as a flat array of 32-bit words: bit position =
  (flat element index) * word_bits + the code's bits in its word (from its shift, and
  its `BitPack.places` if any), so uint8 words (NVFP4) use the same 32-bit atomics
  (little endian), on a 32-bit view of the tensor or, where the tensor's bytes cannot be
  viewed as 32-bit words, on a zeroed scratch copied back afterwards.
* scales, zero points: for every (e, n, group), copy the stored scale bits when the two
  scale formats are equal, else decode to float32 and re-encode (`elements.scale_encoder`:
  half floats round to nearest even, the float8 formats as `e4m3_encode` / `ue5m3_encode`);
  the logical zero point (stored - source offset) mod 2^bits is stored again with the
  destination offset. A destination scale format without sign or zero (float8_ue5m3) gets
  |scale|, and each code thread folds its block scale's sign into the e2m1 code (zero
  scale: code 0), as `QuantSpec.pack` does; NaN scales are refused before the launch.
* act-order (torch, on the device): g_idx is copied; a destination storing K sorted by
  group (Marlin act-order) gets the stable argsort of each expert's g_idx, as
  `QuantSpec.pack` does. The kernel maps each logical k to its stored position in each
  layout through the inverse permutations (tables of (experts, K) int32).
* global scales: divisor (compressed-tensors) or reciprocal (ModelOpt) as each spec stores it.

Experts: `experts` (a range of expert ids, default all) selects the experts to convert.
The source and the destination stacks each hold either every expert (indexed by id) or
just the selected ones (indexed by position in `experts`); a stack of exactly
len(experts) experts is read positionally. Without `out` the result holds just the
selected experts. So `repack(one_expert, spec, out=buffers, experts=range(e, e + 1))`
converts checkpoint expert e into the preallocated buffers.

Work split: a grid-stride loop over E * N * K code elements then E * N * groups scale
elements, one element per thread per step, logical k fastest (neighbouring threads read
neighbouring source codes).

Memory traffic: the source once (words re-read from cache by the codes sharing them), the
destination zeroed once, and one 32-bit atomic per code, resolved in L2. The atomics bound
it: on an H200, 6.7 ms for 128 Qwen3-30B-A3B experts (1536 x 2048, GPTQ -> Marlin; about
60 G codes/s), 1.5 ms for a 14336 x 4096 Mixtral expert.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import cuda, int32, uint32

from layouts import QuantSpec

from . import interop, ptx
from .launch import launch_kernel
from .elements import code_reader, group_reader, scale_decoder, scale_encoder, scale_reader, zero_reader
from .weights import SLOTS, KernelWeights

THREADS = 256
MAX_BLOCKS = 4 if ptx.SIMULATED else 65536
"""Grid cap: the grid-stride loop covers the rest (few simulated blocks: each one is slow)."""

_SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                 "float8_e4m3": torch.uint8, "float8_ue5m3": torch.uint8}
_WORD_DTYPES = {None: torch.int32, "int32": torch.int32, "uint8": torch.uint8}


def word_dtype(layout) -> torch.dtype:
    """Storage dtype of a code tensor: its BitPack word (int32 or uint8), else one code per
    int32 (or per uint8 with dtype='uint8')."""
    if layout.bitpack is not None:
        return torch.int32 if layout.bitpack.word_bits == 32 else torch.uint8
    if layout.dtype not in _WORD_DTYPES:
        raise ValueError(f"repack stores codes in int32 or uint8 arrays, not {layout.dtype!r} ({layout!r})")
    return _WORD_DTYPES[layout.dtype]


def check_convertible(src_spec: QuantSpec, dst_spec: QuantSpec, shape: tuple[int, int]) -> None:
    """Raise ValueError unless `dst_spec` can hold, bit for bit, what `src_spec` stores for
    a weight of logical (N, K) `shape`."""
    n, k = shape
    problems = []
    if src_spec.code != dst_spec.code:
        problems.append(f"codes differ ({src_spec.code!r} -> {dst_spec.code!r})")
    if (src_spec.zeros is None) != (dst_spec.zeros is None):
        problems.append("zero points are stored by only one of them")
    same_groups = src_spec.group_size == dst_spec.group_size or src_spec.groups(k) == dst_spec.groups(k) == 1
    if not same_groups:
        problems.append(f"group sizes differ ({src_spec.group_size} -> {dst_spec.group_size})")
    if (src_spec.g_idx_name is None) != (dst_spec.g_idx_name is None):
        problems.append("act-order (g_idx) is used by only one of them")
    if (src_spec.global_scale_name is None) != (dst_spec.global_scale_name is None):
        problems.append("a global scale is stored by only one of them")
    if problems:
        raise ValueError(f"dst_spec {dst_spec.name!r} cannot hold {src_spec.name!r} weights: " + "; ".join(problems))
    try:
        dst_spec.check_shape(shape)
    except ValueError as error:
        raise ValueError(f"dst_spec cannot hold a weight of shape (N, K) = {shape}: {error}") from None
    if dst_spec.scales.layout.bitpack is not None:
        raise ValueError(f"dst_spec {dst_spec.name!r}: bit-packed scales are not supported")
    word_dtype(dst_spec.weight.layout)
    if dst_spec.zeros is not None:
        word_dtype(dst_spec.zeros.layout)


def _word_writer(layout, shape: tuple[int, int], word_bits: int):
    """Device function (words, e, i, j, code): OR `code` into its place in a flat 32-bit
    view of the (E, rows, cols) array `layout` stores (see the module docstring)."""
    locate = layout.locate(shape, wrap=ptx.device)
    insert = ptx.device(layout.bitpack.insert_fn() if layout.bitpack else _one_code_per_word)
    rows, cols = layout.physical_shape(shape)

    @ptx.device
    def write(words, e, i, j, code):
        row, col, shift = locate(i, j)
        bit = ((e * rows + row) * cols + col) * word_bits  # the word's first bit
        placed = uint32(insert(uint32(code), uint32(shift)))
        cuda.atomic.or_(words, bit >> 5, int32(placed << uint32(bit & 31)))

    return write


def _one_code_per_word(code, shift):
    return code


@ptx.device
def _no_write(words, e, i, j, code):
    return


def _position_in(sorted_k: bool):
    """Device function (positions, slot, k): the stored position of logical k (a table for
    layouts that store K sorted by group, k itself otherwise)."""
    if sorted_k:
        @ptx.device
        def table_position(positions, slot, k_):
            return int32(positions[slot, k_])

        return table_position

    @ptx.device
    def same_position(positions, slot, k_):
        return int32(k_)

    return same_position


@functools.cache
def make_repack_kernel(src_spec: QuantSpec, dst_spec: QuantSpec, n: int, k: int,
                       weight_word_bits: int, zero_word_bits: int, dst_rows: int | None = None, row_offset: int = 0):
    """Kernel (src_arrays, weight_words, scales, zero_words, src_positions, dst_positions,
    experts, total) converting (E, n, k) weights from `src_spec` to `dst_spec`; source row
    n lands in destination row n + row_offset of a (dst_rows, k) destination (default n).

    src_arrays: `KernelWeights.arrays()`; weight_words / zero_words: flat int32 views of the
    destination code tensors (whose words are `*_word_bits` wide); scales: the destination
    scales (E, rows, cols); *_positions: (slots, k) stored position of each logical k;
    experts: (slots, src_first, src_step, dst_first, dst_step), expert ids of each slot."""
    dst_rows = n if dst_rows is None else dst_rows
    check_convertible(src_spec, dst_spec, (dst_rows, k))
    groups = src_spec.groups(k)
    read_code, read_zero = code_reader(src_spec, n, k), zero_reader(src_spec, n, k)
    write_code = _word_writer(dst_spec.weight.layout, (dst_rows, k), weight_word_bits)
    locate_src_scale = src_spec.scales.layout.locate((n, groups), wrap=ptx.device)
    locate_dst_scale = dst_spec.scales.layout.locate((dst_rows, groups), wrap=ptx.device)
    same_scale_format = src_spec.scale_format == dst_spec.scale_format
    decode, encode = scale_decoder(src_spec.scale_format), scale_encoder(dst_spec.scale_format)
    src_position, dst_position = _position_in(src_spec.sort_k_by_group), _position_in(dst_spec.sort_k_by_group)
    fold_signs = _folds_scale_signs(src_spec, dst_spec)
    read_scale, group_of = scale_reader(src_spec, n, k), group_reader(src_spec)
    has_zeros = dst_spec.zeros is not None
    write_zero = _word_writer(dst_spec.zeros.layout, (dst_rows, groups), zero_word_bits) if has_zeros else _no_write
    zero_offset, zero_mask = dst_spec.zero_offset, (1 << dst_spec.code.bits) - 1
    codes_per_expert, groups_per_expert = n * k, n * groups

    @ptx.kernel
    def repack_kernel(src_arrays, weight_words, scales, zero_words, src_positions, dst_positions, experts, total):
        src_weight, src_scales, src_zeros, src_g_idx = src_arrays[0], src_arrays[1], src_arrays[2], src_arrays[3]
        slots, src_first, src_step, dst_first, dst_step = experts
        codes = slots * codes_per_expert
        for index in range(cuda.grid(1), total, cuda.gridsize(1)):
            if index < codes:
                slot, rest = index // codes_per_expert, index % codes_per_expert
                n_, k_ = rest // k, rest % k
                e_src, kp = src_first + slot * src_step, src_position(src_positions, slot, k_)
                code = read_code(src_weight, e_src, n_, kp)
                if fold_signs:
                    scale = read_scale(src_scales, e_src, n_, group_of(src_g_idx, e_src, kp))
                    code = _folded_code(code, scale)
                write_code(weight_words, dst_first + slot * dst_step, n_ + row_offset,
                           dst_position(dst_positions, slot, k_), code)
            else:
                slot, rest = (index - codes) // groups_per_expert, (index - codes) % groups_per_expert
                n_, group = rest // groups, rest % groups
                e_src, e_dst = src_first + slot * src_step, dst_first + slot * dst_step
                row, col, _ = locate_src_scale(n_, group)
                dst_row, dst_col, _ = locate_dst_scale(n_ + row_offset, group)
                if same_scale_format:
                    scales[e_dst, dst_row, dst_col] = src_scales[e_src, row, col]
                else:
                    scales[e_dst, dst_row, dst_col] = encode(decode(src_scales[e_src, row, col]))
                if has_zeros:
                    zero = int32(read_zero(src_zeros, e_src, n_, group))
                    write_zero(zero_words, e_dst, n_ + row_offset, group, (zero + zero_offset) & zero_mask)

    return repack_kernel


def _folds_scale_signs(src_spec: QuantSpec, dst_spec: QuantSpec) -> bool:
    """Whether repacking moves scale signs and zeros into the codes (a destination scale
    format without them, from one with them)."""
    return src_spec.scale_format.signed and not dst_spec.scale_format.signed


@ptx.device
def _folded_code(code, scale):
    """The e2m1 code carrying its block scale's sign (and 0 under a zero scale)."""
    if scale == 0:
        return uint32(0)
    return code ^ uint32(8) if scale < 0 else code


def destination_tensors(dst_spec: QuantSpec, shape: tuple[int, int, int]) -> dict[str, tuple[tuple, torch.dtype]]:
    """{engine name: (shape, dtype)} of the tensors `repack` writes for a logical (E, N, K)
    weight: codes, scales and zeros (E, rows, cols) as `dst_spec.pack` shapes them, g_idx
    and sort indices (E, K) int32, the global scale (E,) float32, weight_shape (3,) int64."""
    experts, n, k = shape
    groups = dst_spec.groups(k)
    tensors = {
        dst_spec.weight.name: ((experts,) + dst_spec.weight.layout.physical_shape((n, k)),
                               word_dtype(dst_spec.weight.layout)),
        dst_spec.scales.name: ((experts,) + dst_spec.scales.layout.physical_shape((n, groups)),
                               _SCALE_DTYPES[dst_spec.scale_format.name]),
    }
    if dst_spec.zeros is not None:
        tensors[dst_spec.zeros.name] = ((experts,) + dst_spec.zeros.layout.physical_shape((n, groups)),
                                        word_dtype(dst_spec.zeros.layout))
    if dst_spec.g_idx_name is not None:
        tensors[dst_spec.g_idx_name] = ((experts, k), torch.int32)
    if dst_spec.sort_k_by_group:
        tensors[dst_spec.sort_indices_name] = ((experts, k), torch.int32)
    if dst_spec.global_scale_name is not None:
        tensors[dst_spec.global_scale_name] = ((experts,), torch.float32)
    if dst_spec.shape_name is not None:
        tensors[dst_spec.shape_name] = ((3,), torch.int64)
    return tensors


def repack(src: KernelWeights, dst_spec: QuantSpec, *, out: dict | None = None,
           experts: range | None = None, row_offset: int = 0, dst_rows: int | None = None,
           zero_first: bool = True) -> dict[str, torch.Tensor]:
    """`dst_spec`'s physical tensors (engine names, shapes of `destination_tensors`) for the
    weight `src` holds: bit-exact with `layouts.convert`, computed on the kernels' device.

    out:     preallocated destination tensors ({name: tensor}, each (E_out, ...) as
             `destination_tensors` gives); filled in place and returned, nothing else is
             allocated for them (act-order and global scales use (experts, K) temporaries).
    experts: a range of expert ids to convert (default: all). `src` and `out` each hold
             either every expert (indexed by id) or exactly these (indexed by position);
             without `out` the result holds exactly these.
    row_offset, dst_rows: place the source's N rows at rows row_offset.. of a destination
             holding dst_rows logical rows (default: the source's), e.g. an MoE layer's gate
             and up projections in one [w1; w3] buffer.
    zero_first: clear the destination experts first (what makes bit-packed words exact);
             pass False to add rows to a destination an earlier call cleared and filled.
    """
    if not isinstance(src, KernelWeights):
        raise TypeError(f"src must be a KernelWeights, got {type(src).__name__}")
    if not isinstance(dst_spec, QuantSpec):
        raise TypeError(f"dst_spec must be a QuantSpec, got {type(dst_spec).__name__}")
    held, n, k = src.shape
    dst_rows = n + row_offset if dst_rows is None else dst_rows
    if row_offset < 0 or row_offset + n > dst_rows:
        raise ValueError(f"rows {row_offset}..{row_offset + n} do not fit a destination of {dst_rows} rows")
    check_convertible(src.spec, dst_spec, (dst_rows, k))
    if out is not None and not isinstance(out, dict):
        raise TypeError(f"out must map dst_spec's tensor names to tensors, got {type(out).__name__}")
    if experts is None:
        experts = range(held if out is None else _expert_count(dst_spec, out))
    if not isinstance(experts, range) or experts.step < 1 or (len(experts) and experts[0] < 0):
        raise ValueError(f"experts must be an increasing range of expert ids >= 0, got {experts!r}")
    if out is None:
        out = {name: interop.empty(shape, dtype)
               for name, (shape, dtype) in destination_tensors(dst_spec, (len(experts), dst_rows, k)).items()}
    else:
        out = _checked_out(dst_spec, out, (dst_rows, k))
        sources = {f"src.{slot}": tensor for slot, tensor in zip(SLOTS, src.tensors) if tensor.numel() > 1}
        interop.check_disjoint({**sources, **{f"out[{name!r}]": tensor for name, tensor in out.items()}})
    if len(experts) == 0:
        return out
    src_first, src_step = _stack_index(experts, held, "src")
    dst_first, dst_step = _stack_index(experts, _expert_count(dst_spec, out), "out")
    dst_experts = slice(dst_first, dst_first + len(experts) * dst_step, dst_step)
    src_experts = torch.arange(src_first, src_first + len(experts) * src_step, src_step, device=interop.kernel_device())

    if _folds_scale_signs(src.spec, dst_spec):
        _check_no_nan_scales(src, dst_spec, src_experts)
    src_positions, dst_positions = _act_order(src, dst_spec, out, src_experts, dst_experts, first_rows=row_offset == 0)
    _global_scale(src, dst_spec, out, src_experts, dst_experts)
    if dst_spec.shape_name is not None:
        out[dst_spec.shape_name].copy_(torch.tensor([_expert_count(dst_spec, out), dst_rows, k], dtype=torch.int64))

    weight, scales = out[dst_spec.weight.name], out[dst_spec.scales.name]
    zeros = out[dst_spec.zeros.name] if dst_spec.zeros is not None else None
    for tensor in (weight, scales, zeros):
        if tensor is not None and zero_first:
            tensor[dst_experts].zero_()
    if zeros is None:
        zeros = torch.zeros(1, dtype=torch.int32, device=weight.device)  # a stand-in the kernel never touches
    weight_words, weight_scratch = _flat_words(weight)
    zero_words, zero_scratch = _flat_words(zeros)
    if not zero_first and (weight_scratch is not None or zero_scratch is not None):
        raise ValueError("zero_first=False needs destination words that tile 32-bit words")

    kernel = make_repack_kernel(src.spec, dst_spec, n, k, weight.element_size() * 8, zeros.element_size() * 8,
                                dst_rows, row_offset)
    total = len(experts) * n * (k + src.spec.groups(k))
    blocks = min(-(-total // THREADS), MAX_BLOCKS)
    launch_kernel(
        kernel, blocks, THREADS,
        src.arrays(), interop.to_kernel(weight_words), interop.to_kernel(scales), interop.to_kernel(zero_words),
        interop.to_kernel(src_positions), interop.to_kernel(dst_positions),
        (len(experts), src_first, src_step, dst_first, dst_step), total)
    for tensor, scratch in ((weight, weight_scratch), (zeros, zero_scratch)):
        if scratch is not None:
            tensor[dst_experts] = scratch.view(torch.uint8)[:tensor.numel()].view(tensor.shape)[dst_experts]
    return out


def _expert_count(dst_spec: QuantSpec, out: dict) -> int:
    weight = out.get(dst_spec.weight.name)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        raise ValueError(f"out[{dst_spec.weight.name!r}] must be an (experts, rows, cols) tensor")
    return weight.shape[0]


def _checked_out(dst_spec: QuantSpec, out: dict, shape: tuple[int, int]) -> dict:
    """`out` with every destination tensor checked (present, dtype, shape, device)."""
    if not isinstance(out, dict):
        raise TypeError(f"out must be a dict of tensors keyed by engine names, got {type(out).__name__}")
    expected = destination_tensors(dst_spec, (_expert_count(dst_spec, out),) + shape)
    missing = sorted(set(expected) - set(out))
    if missing:
        raise ValueError(f"out is missing {missing} (dst_spec {dst_spec.name!r} stores {sorted(expected)})")
    return {name: interop.check_tensor(f"out[{name!r}]", out[name], dtype=dtype, shape=tensor_shape)
            for name, (tensor_shape, dtype) in expected.items()}


def _stack_index(experts: range, held: int, name: str) -> tuple[int, int]:
    """(first, step): index of the selected experts in a stack of `held` experts."""
    if held == len(experts):
        return 0, 1
    if experts[-1] < held:
        return experts.start, experts.step
    raise ValueError(f"{name} holds {held} experts: neither the {len(experts)} selected ones nor all of {experts!r}")


def _flat_words(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(flat int32 words over `tensor`'s bytes, the scratch they live in or None): uint8
    tensors whose bytes do not tile 32-bit words get a zeroed scratch to copy back."""
    flat = tensor.view(-1)
    if tensor.dtype == torch.int32:
        return flat, None
    if flat.numel() % 4 == 0 and flat.data_ptr() % 4 == 0:
        return flat.view(torch.int32), None
    scratch = torch.zeros(-(-flat.numel() // 4), dtype=torch.int32, device=tensor.device)
    return scratch, scratch


def _check_no_nan_scales(src: KernelWeights, dst_spec: QuantSpec, src_experts) -> None:
    """A destination without signed scales takes signs and zeros into the codes; NaN has
    nowhere to go."""
    scales = src.tensors[1][src_experts % src.tensors[1].shape[0]]
    if src.spec.scale_format.name == "float8_e4m3":
        nan = (scales & 0x7F) == 0x7F
    else:
        nan = torch.isnan(scales.float())
    if bool(nan.any()):
        raise ValueError(f"src scales hold NaN, which dst_spec {dst_spec.name!r} cannot store "
                         f"({dst_spec.scale_format!r} has no NaN)")


def _act_order(src: KernelWeights, dst_spec: QuantSpec, out: dict, src_experts, dst_experts, first_rows: bool):
    """Write g_idx (and the sort indices of a K-sorted destination); return the (slots, K)
    stored positions of each logical k in the source and the destination layouts. Rows
    placed after others (`first_rows` False: up after gate in one [w1; w3] weight) keep the
    g_idx those wrote, which must be theirs: one K order serves every row of an expert
    (projections of one input share it, as GPTQ's act-order follows the input's Hessian)."""
    device = interop.kernel_device()
    stand_in = torch.zeros((1, 1), dtype=torch.int32, device=device)
    if dst_spec.g_idx_name is None:
        return stand_in, stand_in
    g_idx, k_order = src.tensors[3], src.tensors[4]
    group_of_k = g_idx[src_experts % g_idx.shape[0]]  # in the source's stored K order
    logical_k = torch.arange(group_of_k.shape[1], dtype=torch.int32, device=device).expand(group_of_k.shape)
    src_positions = dst_positions = stand_in
    if src.spec.sort_k_by_group:  # stored position kp holds logical k = k_order[kp]
        order = k_order[src_experts % k_order.shape[0]].long()
        group_of_k = torch.empty_like(group_of_k).scatter_(1, order, group_of_k)
        src_positions = torch.empty_like(logical_k).scatter_(1, order, logical_k)
    stored = {}
    if dst_spec.sort_k_by_group:
        order = torch.argsort(group_of_k, dim=1, stable=True)
        stored[dst_spec.sort_indices_name] = order
        dst_positions = torch.empty_like(logical_k).scatter_(1, order, logical_k)
        group_of_k = torch.gather(group_of_k, 1, order)
    stored[dst_spec.g_idx_name] = group_of_k
    for name, value in stored.items():
        if first_rows:
            out[name][dst_experts] = value
        elif not torch.equal(out[name][dst_experts], value.to(out[name].dtype)):
            raise ValueError("act-order rows placed after others must have their g_idx (one K order per expert): "
                             "the gate and up projections of an act-order checkpoint differ in g_idx")
    return src_positions, dst_positions


def _global_scale(src: KernelWeights, dst_spec: QuantSpec, out: dict, src_experts, dst_experts) -> None:
    """Re-store the per-expert global scale: a divisor, or its reciprocal (ModelOpt)."""
    if dst_spec.global_scale_name is None:
        return
    stored = src.tensors[5][src_experts % src.tensors[5].shape[0]]
    divisor = torch.reciprocal(stored) if src.spec.global_scale_reciprocal else stored
    stored = torch.reciprocal(divisor) if dst_spec.global_scale_reciprocal else divisor
    out[dst_spec.global_scale_name][dst_experts] = stored


def reference_repack(src_spec: QuantSpec, physical: dict, dst_spec: QuantSpec, shape=None) -> dict[str, np.ndarray]:
    """`layouts.convert` with the logical shape (padded layouts cannot infer it): the numpy
    tensors, as `dst_spec.pack` shapes them, that `repack` must reproduce bit for bit."""
    return dst_spec.pack(src_spec.unpack(physical, shape))
