"""The router kernel agrees with the float64 reference (same ids, same columns, weights to
float32 precision), reproduces vLLM's routing golden vectors, breaks ties by the lower
index, and rejects bad configs and tensors with clear errors."""

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given, strategies as st

from numba_kernels import interop
from numba_kernels.ptx import SIMULATED
from numba_kernels.routing import RoutingConfig, reference_route, route

DATA = Path(__file__).parent / "data"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _run(logits: torch.Tensor, config, bias: torch.Tensor | None = None):
    """Kernel outputs as numpy, from poisoned preallocated outputs."""
    shape = (logits.shape[0], config.top_k)
    out = (interop.empty(shape, torch.float32).fill_(np.nan), interop.empty(shape, torch.int32).fill_(-7))
    device = interop.kernel_device()
    weights, ids = route(logits.to(device), config, correction_bias=None if bias is None else bias.to(device), out=out)
    assert weights is out[0] and ids is out[1]
    return weights.cpu().numpy(), ids.cpu().numpy()


def _check(logits: torch.Tensor, config, bias: torch.Tensor | None = None):
    weights, ids = _run(logits, config, bias)
    expected_weights, expected_ids = reference_route(
        logits.float().numpy(), config, None if bias is None else bias.float().numpy())
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_allclose(weights, expected_weights, rtol=2e-5, atol=1e-6)


def _separated(values: np.ndarray) -> bool:
    """Distinct values differ by more than float32 rounding can blur (ties are exact)."""
    distinct = np.unique(values[np.isfinite(values)])
    return bool(np.all(np.diff(distinct) > 1e-5 * np.maximum(1.0, np.abs(distinct[1:]))))


def _no_near_ties(logits: np.ndarray, config, bias: np.ndarray) -> bool:
    """With a bias the keys are float32 sums on the device and float64 in the reference:
    only data whose keys and group scores are exactly tied or well apart is comparable."""
    if config.scoring == "softmax":
        exp = np.exp(logits - logits.max(axis=1, keepdims=True))
        scores = exp / exp.sum(axis=1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
    keys = scores + bias
    for row in keys:
        if not _separated(row):
            return False
        if config.grouped:
            top = -np.sort(-row.reshape(config.num_expert_group, -1), axis=1)
            if not _separated(top[:, :2].sum(axis=1) if top.shape[1] > 1 else top[:, 0]):
                return False
    return True


@st.composite
def routing_cases(draw):
    if draw(st.booleans()):
        groups, per_group = draw(st.sampled_from([2, 3, 4])), draw(st.sampled_from([1, 2, 3, 8]))
        experts, topk_group = groups * per_group, draw(st.integers(1, groups))
        top_k = draw(st.integers(1, topk_group * per_group))
    else:
        groups = topk_group = None
        experts = draw(st.integers(1, 40))
        top_k = draw(st.integers(1, experts))
    config = RoutingConfig(top_k=top_k, scoring=draw(st.sampled_from(["softmax", "sigmoid"])),
                           renormalize=draw(st.booleans()), num_expert_group=groups, topk_group=topk_group,
                           routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])))
    bias_kind = draw(st.sampled_from([None, "constant", "random"]))
    ties = bias_kind != "random" and draw(st.booleans())
    dtype = DTYPES[draw(st.sampled_from(list(DTYPES)))]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tokens = draw(st.integers(1, 3))
    # Integer logits in [0, 6] tie often and exactly, and no two different pairs of their
    # sigmoids sum to (nearly) the same value, so tied group scores are exact ties too.
    values = rng.integers(0, 7, (tokens, experts)) if ties else rng.standard_normal((tokens, experts)) * 2
    logits = torch.from_numpy(values.astype(np.float32)).to(dtype)
    bias = None
    if bias_kind == "constant":
        bias = torch.full((experts,), 0.25)
    elif bias_kind == "random":
        bias = torch.from_numpy((rng.standard_normal(experts) * 0.1).astype(np.float32))
    return logits, config, bias


@given(routing_cases())
def test_route_matches_reference(case):
    logits, config, bias = case
    if bias is not None:
        assume(_no_near_ties(logits.double().numpy(), config, bias.double().numpy()))
    _check(logits, config, bias)


@pytest.mark.parametrize("grouped", [False, True])
def test_ties_go_to_the_lower_index_in_selection_order(grouped):
    config = RoutingConfig(top_k=3, scoring="sigmoid", renormalize=True,
                           num_expert_group=4 if grouped else None, topk_group=2 if grouped else None)
    logits = torch.tensor([[1.0] * 8, [0.0, 2.0, 2.0, 0.0, 2.0, 2.0, 3.0, 0.0]])
    weights, ids = _run(logits, config, torch.zeros(8) if grouped else None)
    # Grouped, row 1: groups (0,1) (2,3) (4,5) (6,7) score s(2)+s(0), s(2)+s(0), 2 s(2),
    # s(3)+s(0) (s = sigmoid) -> groups 2 and 3 are kept; all ties go to the lower index.
    expected = [[0, 1, 2], [6, 4, 5]] if grouped else [[0, 1, 2], [6, 1, 2]]
    np.testing.assert_array_equal(ids, expected)
    np.testing.assert_allclose(weights[0], 1 / 3, rtol=1e-6)


def _golden(name: str, rows):
    data = np.load(DATA / f"{name}.npz")
    return {key: data[key][rows] if key.startswith(("in_gating", "out_")) else data[key] for key in data.files}


# The simulator runs one block per token at ~5,000 threads a second: a few rows there.
GOLDEN_ROWS = [0, 11, 31] if SIMULATED else slice(None)


@pytest.mark.parametrize("name, config", [
    ("c5_softmax_topk_M32_E64_k4_renorm", RoutingConfig(top_k=4, renormalize=True)),
    ("c5_softmax_topk_M32_E64_k4_norenorm", RoutingConfig(top_k=4, renormalize=False)),
    ("c5_grouped_topk_dsv3_M32_E256", RoutingConfig(top_k=8, scoring="sigmoid", renormalize=True,
                                                    num_expert_group=8, topk_group=4, routed_scaling_factor=2.5)),
])
def test_golden_vectors(name, config):
    data = _golden(name, GOLDEN_ROWS)
    bias = data.get("in_e_score_correction_bias")
    weights, ids = _run(torch.from_numpy(data["in_gating_output"]), config,
                        None if bias is None else torch.from_numpy(bias))
    order = np.argsort(ids, axis=1)
    np.testing.assert_array_equal(np.take_along_axis(ids, order, 1), data["out_topk_ids_sorted_by_id"])
    np.testing.assert_allclose(np.take_along_axis(weights, order, 1), data["out_topk_weights_sorted_by_id"],
                               rtol=1e-5, atol=1e-7)
    if bias is None:  # columns in selection order: descending weights
        assert np.all(np.diff(weights, axis=1) <= 0)


def test_empty_batch_launches_nothing():
    weights, ids = route(interop.empty((0, 8), torch.float32), RoutingConfig(top_k=2))
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_k=0), "top_k must be a positive integer"),
    (dict(top_k=2, scoring="relu"), "scoring must be one of"),
    (dict(top_k=2, renormalize=1), "renormalize must be a bool"),
    (dict(top_k=2, num_expert_group=4), "both be set or both be None"),
    (dict(top_k=2, num_expert_group=4, topk_group=5), "topk_group must be <= num_expert_group"),
    (dict(top_k=2, routed_scaling_factor=0.0), "routed_scaling_factor must be a positive finite number"),
])
def test_config_errors(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        RoutingConfig(**kwargs)


@pytest.mark.parametrize("config, experts, message", [
    (RoutingConfig(top_k=9), 8, r"top_k \(9\) must be <= the number of experts \(8\)"),
    (RoutingConfig(top_k=2, num_expert_group=3, topk_group=1), 8, r"num_expert_group \(3\) must divide"),
    (RoutingConfig(top_k=5, num_expert_group=4, topk_group=2), 8, r"topk_group \* experts per group \(4\)"),
])
def test_config_does_not_fit_the_experts(config, experts, message):
    logits = interop.empty((2, experts), torch.float32)
    with pytest.raises(ValueError, match=message):
        route(logits, config)
    with pytest.raises(ValueError, match=message):
        reference_route(np.zeros((2, experts)), config)


def test_tensor_errors():
    config, device = RoutingConfig(top_k=2), interop.kernel_device()
    logits = torch.zeros((3, 8), device=device)
    with pytest.raises(TypeError, match="router_logits must be a"):
        route(logits.to(torch.int32), config)
    with pytest.raises(ValueError, match="router_logits must have 2 dimensions"):
        route(logits[0], config)
    with pytest.raises(ValueError, match=r"correction_bias must have shape \(8,\)"):
        route(logits, config, correction_bias=torch.zeros(7, device=device))
    with pytest.raises(TypeError, match="config must be a RoutingConfig"):
        route(logits, {"top_k": 2})
    with pytest.raises(TypeError, match="out must be a"):
        route(logits, config, out=torch.zeros((3, 2), device=device))
    ids = torch.zeros((3, 2), dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"out\[0\] \(topk_weights\) must have shape \(3, 2\)"):
        route(logits, config, out=(torch.zeros((3, 3), device=device), ids))
    with pytest.raises(TypeError, match=r"out\[1\] \(topk_ids\) must be a torch.int32"):
        route(logits, config, out=(torch.zeros((3, 2), device=device), ids.float()))


@pytest.mark.gpu
@pytest.mark.parametrize("experts, config, dtype, with_bias", [
    (256, RoutingConfig(top_k=8, scoring="sigmoid", renormalize=True, num_expert_group=8, topk_group=4,
                        routed_scaling_factor=2.5), torch.float32, True),
    (128, RoutingConfig(top_k=8, renormalize=True), torch.bfloat16, False),
    (128, RoutingConfig(top_k=8, renormalize=False), torch.float32, False),
])
def test_realistic_shapes_on_gpu(experts, config, dtype, with_bias):
    generator = torch.Generator().manual_seed(experts)
    logits = (torch.randn((4096, experts), generator=generator) * 2).to(dtype)
    bias = torch.randn(experts, generator=generator) * 0.1 if with_bias else None
    _check(logits, config, bias)
