"""Test helper for expert parallelism: a layer's experts dealt out over ranks, each rank a
layer of its own (its expert map, its share of a checkpoint), whose outputs sum to the
whole layer's."""

import attrs

from moe import MoELayer


def rank_layers(config, checkpoint, ranks: int, max_tokens: int):
    """The layers of `ranks` ranks of `config` (expert e on rank e % ranks), each loaded
    with its experts of `checkpoint` (`moe.reference.random_checkpoint`)."""
    experts = config.num_experts
    for rank in range(ranks):
        owned = [e for e in range(experts) if e % ranks == rank]
        ranked = attrs.evolve(config, expert_map=[owned.index(e) if e in owned else -1 for e in range(experts)])
        layer = MoELayer(ranked, max_tokens=max_tokens)
        layer.load_weights(*({name: value[owned] for name, value in w.items()} for w in
                             (checkpoint.w1, checkpoint.w2, checkpoint.w3)))
        yield layer
