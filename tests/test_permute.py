"""Act-order inputs permuted per slot (`numba_kernels.permute`): the kernel equals its
numpy reference on a hand-made alignment (padding, an expert of another rank, entries past
the padded total), for rows read as half pairs and element by element; the K-sorted tiles
of uniform act-order groups read as plain tiles compute the act-order GEMM; bad
arguments are refused by name."""

import numpy as np
import pytest
import torch

from layouts import formats
from layouts.samples import random_quantized
from numba_kernels import interop
from numba_kernels.align import moe_align_block_size
from numba_kernels.gemm import GemmTile, grouped_gemm, reference_grouped_gemm
from numba_kernels.permute import groups_are_runs, permute_slots, plain_spec, reference_permute_slots
from numba_kernels.weights import KernelWeights

DEVICE = interop.kernel_device()
BLOCK_M = 4
# Four blocks of four entries: expert 2 with two padding entries (slot id 8 = num_slots),
# a block of an expert on another rank (-1), expert 0, and a block past the padded total.
SORTED_IDS = [0, 3, 8, 8, 1, 2, 8, 8, 4, 5, 6, 7, 1, 1, 1, 1]
EXPERT_IDS = [2, -1, 0, 1]
PADDED = 12


def _alignment():
    return tuple(torch.tensor(v, dtype=torch.int32, device=DEVICE) for v in (SORTED_IDS, EXPERT_IDS, [PADDED]))


@pytest.mark.parametrize("k", [64, 40, 36, 13], ids=lambda k: f"K={k}")  # pairs (K % 8 == 0), then element-wise
@pytest.mark.parametrize("rows", [4, 8], ids=["per_token", "per_slot"])
def test_permute_slots_matches_its_reference(k, rows):
    rng = np.random.default_rng(k + rows)
    act = torch.from_numpy(rng.standard_normal((rows, k))).to(torch.bfloat16)
    order = torch.from_numpy(np.stack([rng.permutation(k) for _ in range(3)]).astype(np.int32))
    out = torch.full((8, k), 7.0, dtype=torch.bfloat16)
    got = permute_slots(act.to(DEVICE), order.to(DEVICE), *_alignment(), num_slots=8, block_m=BLOCK_M,
                        out=out.to(DEVICE))
    expected = reference_permute_slots(act.view(torch.int16), order, *_alignment(), num_slots=8, block_m=BLOCK_M,
                                       out=out.view(torch.int16))
    np.testing.assert_array_equal(got.cpu().view(torch.int16).numpy(), expected)
    assert (got[[1, 2]].cpu() == 7.0).all()  # the other rank's slots are left alone


def test_groups_are_runs_of_group_size():
    runs = torch.arange(40, dtype=torch.int32) // 16
    assert groups_are_runs(runs, 16) and groups_are_runs(torch.stack([runs, runs]), 16)
    assert not groups_are_runs(torch.roll(runs, 1), 16)
    assert not groups_are_runs(torch.sort(torch.tensor([0] * 20 + [1] * 12 + [2] * 8, dtype=torch.int32)).values, 16)


@pytest.mark.parametrize("tile", [GemmTile(block_m=16, warps_k=1, slabs_per_warp=2),
                                  GemmTile(block_m=32, warps_n=2, warps_k=1, slabs_per_warp=2, a_in_shared=True)],
                         ids=["decode", "prefill"])
def test_k_sorted_tiles_read_as_plain_tiles_compute_the_act_order_gemm(tile):
    spec, (experts, n, k) = formats.native(4, 32, act_order=True), (2, 64, 96)
    rng = np.random.default_rng(3)
    q = random_quantized(spec, (experts, n, k), rng)
    physical = spec.pack(q)
    stored = KernelWeights.from_physical(spec, physical, (experts, n, k))
    plain = KernelWeights(plain_spec(spec), stored.shape, stored.tensors)
    act = torch.from_numpy(rng.standard_normal((3, k))).to(torch.bfloat16).to(DEVICE)
    topk_ids = torch.tensor([[0, 1], [1, 0], [0, 1]], dtype=torch.int32, device=DEVICE)
    alignment = moe_align_block_size(topk_ids, tile.block_m, experts)
    permuted = permute_slots(act, plain.k_order, *alignment, num_slots=6, block_m=tile.block_m)
    got = grouped_gemm(permuted, plain, *alignment, num_slots=6, tile=tile).float().cpu().numpy()
    expected = reference_grouped_gemm(act.float().cpu().numpy(), spec.dequantize(physical, (experts, n, k)),
                                      *(a.cpu().numpy() for a in alignment[:2]), int(alignment[2][0]),
                                      block_m=tile.block_m, num_slots=6)
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 1e-2
    assert plain_spec(formats.native(4, 32)) is None  # nothing to permute


@pytest.mark.parametrize("change, error, match", [
    (dict(order=torch.zeros((3, 63), dtype=torch.int32)), ValueError, r"order must be \(E, 64\) or \(1, 64\)"),
    (dict(order=torch.zeros((3, 64), dtype=torch.int64)), TypeError, "order"),
    (dict(num_slots=6), ValueError, r"num_slots \(6\) must be a positive multiple of act's rows \(4\)"),
    (dict(block_m=8), ValueError, "expert_ids .* blocks of block_m = 8"),
    (dict(out=torch.zeros((8, 64), dtype=torch.float16)), TypeError, "out"),
])
def test_bad_arguments_are_refused_by_name(change, error, match):
    arguments = dict(act=torch.zeros((4, 64), dtype=torch.bfloat16), order=torch.zeros((3, 64), dtype=torch.int32),
                     num_slots=8, block_m=BLOCK_M, out=None)
    arguments.update(change)
    arguments = {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value
                 for name, value in arguments.items()}
    with pytest.raises(error, match=match):
        permute_slots(arguments.pop("act"), arguments.pop("order"), *_alignment(), **arguments)
