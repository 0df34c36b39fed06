"""The eager fast path: a layer's first call of a kind records its launches, later calls
replay them with new inputs (each compared with the float reference, so a replay that
kept reading the recorded inputs fails), also when the recording call's input is the
workspace's own output; kinds are kept apart, and growing the workspace forgets the
recordings (they point into the old buffers)."""

import numpy as np
import pytest
import torch

from moe import MoEConfig, MoEHooks, QuantScheme, replay
from moe.reference import reference_moe
from numba_kernels import ptx
from numba_kernels.launch import Replay
from test_moe import DEVICE, TINY, _inputs, _layer, _relative_error


def _expected(config, checkpoint, hidden, **routing):
    routing = {name: value.float().cpu().numpy() if isinstance(value, torch.Tensor) else value
               for name, value in routing.items()}
    return reference_moe(config, hidden.float().cpu().numpy(), checkpoint.dense_w13, checkpoint.dense_w2, **routing)


def test_replays_read_the_new_logits_bias_and_hidden_states():
    config = MoEConfig(**TINY, scoring="sigmoid", num_expert_group=2, topk_group=1, renormalize=True,
                       quant=QuantScheme("gptq", group_size=32))
    layer, checkpoint = _layer(config)
    for seed in range(2):
        hidden, logits = (t.to(DEVICE) for t in _inputs(config, 3, seed=seed))
        bias = (torch.linspace(-0.5, 0.5, config.num_experts) * (1 if seed else -1)).to(DEVICE)
        out = layer(hidden, logits, correction_bias=bias)
        expected = _expected(config, checkpoint, hidden, router_logits=logits, correction_bias=bias)
        assert _relative_error(out, expected) < 2e-2
        assert len(layer.workspace.programs) == 1
    (_, program), = layer.workspace.programs._entries.values()
    assert (program.graph is None) == ptx.SIMULATED  # on the GPU a replay is one graph launch


def test_replays_read_a_new_given_top_k():
    config = MoEConfig(**TINY, quant=QuantScheme("awq", group_size=32))
    layer, checkpoint = _layer(config)
    rng = np.random.default_rng(3)
    for seed in range(2):
        hidden, _ = (t.to(DEVICE) for t in _inputs(config, 2, seed=seed))
        topk_ids = torch.from_numpy(np.stack([rng.choice(config.num_experts, config.top_k, replace=False)
                                              for _ in range(2)]).astype(np.int32)).to(DEVICE)
        topk_weights = torch.from_numpy(rng.random((2, config.top_k), dtype=np.float32)).to(DEVICE)
        out = layer(hidden, topk=(topk_weights, topk_ids))
        assert _relative_error(out, _expected(config, checkpoint, hidden, topk=(topk_weights, topk_ids))) < 2e-2
    assert len(layer.workspace.programs) == 1


def test_a_recording_whose_input_is_the_workspace_output():
    config = MoEConfig(**TINY, quant=QuantScheme("gptq", group_size=32))
    layer, checkpoint = _layer(config)
    hidden, logits = (t.to(DEVICE) for t in _inputs(config, 3, seed=4))
    fed_back = layer(hidden, logits)[:2]  # a view of the workspace's output: 2 tokens, a new kind
    values = fed_back.clone()
    out = layer(fed_back, logits[:2])
    assert _relative_error(out, _expected(config, checkpoint, values, router_logits=logits[:2])) < 2e-2
    hidden, logits = (t.to(DEVICE) for t in _inputs(config, 2, seed=5))
    out = layer(hidden, logits)  # the replay must read these, not the workspace output
    assert _relative_error(out, _expected(config, checkpoint, hidden, router_logits=logits)) < 2e-2


def test_kinds_are_recorded_apart_and_growing_forgets_them():
    config = MoEConfig(**TINY, quant=QuantScheme("gptq", group_size=32))
    layer, _ = _layer(config)
    hidden, logits = (t.to(DEVICE) for t in _inputs(config, 1, seed=6))
    layer(hidden, logits)
    layer(hidden, logits.to(torch.bfloat16))
    assert len(layer.workspace.programs) == 2
    layer.hooks = MoEHooks()  # hooks run Python between the kernels: never recorded
    layer(hidden, logits)
    assert len(layer.workspace.programs) == 2
    layer.workspace.grow(8)
    assert len(layer.workspace.programs) == 0


@pytest.mark.gpu
def test_replay_is_captured_by_a_cuda_graph():
    config = MoEConfig(**TINY, quant=QuantScheme("gptq", group_size=32))
    layer, checkpoint = _layer(config)
    static_hidden, static_logits = (t.to(DEVICE) for t in _inputs(config, 3, seed=7))
    layer(static_hidden, static_logits)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(static_hidden, static_logits)
    hidden, logits = (t.to(DEVICE) for t in _inputs(config, 3, seed=8))
    static_hidden.copy_(hidden)
    static_logits.copy_(logits)
    graph.replay()
    assert _relative_error(out, _expected(config, checkpoint, hidden, router_logits=logits)) < 2e-2


class _Overwrite:
    """A stand-in launcher whose replay writes something else than the recorded output."""

    def __init__(self, out):
        self.out = out

    def rebind(self, argument, tensor):
        pass

    def launch(self, stream):
        self.out.fill_(1.0)


def test_a_replay_that_disagrees_with_the_recording_turns_replay_off(monkeypatch):
    monkeypatch.setattr(replay, "_CHECK", replay._Check())
    output = torch.zeros(2, 3)
    program = replay.Program(Replay((_Overwrite(output),)), (), output)
    with pytest.warns(RuntimeWarning, match="eager fast path is off"):
        assert replay._checked(program, (), output) is None
    assert torch.equal(output, torch.zeros(2, 3)) and replay._CHECK.failed and not replay._CHECK.pending
    calls = []
    assert replay.record(lambda inputs: calls.append(inputs) or output, (output,), lambda t: False) == (output, None)
    assert calls == [(output,)]
    agreeing = replay.Program(Replay(()), (), output)
    monkeypatch.setattr(replay, "_CHECK", replay._Check())
    assert replay._checked(agreeing, (), output) is agreeing
