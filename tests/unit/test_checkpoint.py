"""Sharded state dicts match SequentialMLP's, and distributed checkpoints load both ways."""

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

from mcore_torch_experts import TorchGroupedMLP
from support.reference import make_config, sequential_mlp

PREFIX = "decoder.layers.0.mlp."


def layout(module):
    """{global key: sorted [(global shape, global offset)]} of every sharded tensor and object."""
    sharded = module.sharded_state_dict(prefix=PREFIX)
    apply_factories(sharded)
    result = {}
    values = []
    for value in sharded.values():  # a GLU factory builds a list: [gate half, up half]
        values.extend(value if isinstance(value, list) else [value])
    for value in values:
        if isinstance(value, ShardedTensor):
            entry = ("tensor", value.global_shape, value.global_offset, value.dtype)
        elif isinstance(value, ShardedObject):
            entry = ("object", value.global_shape, value.global_offset)
        else:
            raise AssertionError(f"unexpected sharded entry {type(value)}")
        result.setdefault(value.key, []).append(entry)
    return {k: sorted(v) for k, v in result.items()}


@pytest.mark.parametrize("glu", [True, False])
def test_sharded_layout_matches_sequential_mlp(megatron_cpu, glu):
    config = make_config(glu=glu, activation="silu" if glu else "squared_relu")
    ours = TorchGroupedMLP(4, config, pg_collection=megatron_cpu)
    theirs = sequential_mlp(config, megatron_cpu)
    expected = layout(theirs)
    assert layout(ours) == expected
    fc1 = expected[PREFIX + "experts.linear_fc1.weight"]
    assert len(fc1) == (8 if glu else 4)  # one per expert (GLU: gate and up halves separately)


def _load(module, directory):
    sharded = module.sharded_state_dict(prefix=PREFIX)
    loaded = dist_checkpointing.load(sharded, str(directory))
    state = {k[len(PREFIX):]: v for k, v in loaded.items()}
    module.load_state_dict(state, strict=True)


def _expert_weights(module):
    if isinstance(module, TorchGroupedMLP):
        return [(module.linear_fc1.packed_weight[i], module.linear_fc2.packed_weight[i])
                for i in range(module.num_local_experts)]
    return [(e.linear_fc1.weight, e.linear_fc2.weight) for e in module.local_experts]


@pytest.mark.parametrize("direction", ["sequential_to_torch", "torch_to_sequential"])
def test_dist_checkpoint_round_trip(megatron_cpu, tmp_path, direction):
    config = make_config()
    torch.manual_seed(1)
    seq = sequential_mlp(config, megatron_cpu)
    torch.manual_seed(2)
    ours = TorchGroupedMLP(4, config, pg_collection=megatron_cpu)
    source, target = (seq, ours) if direction == "sequential_to_torch" else (ours, seq)
    assert not torch.equal(_expert_weights(source)[1][0], _expert_weights(target)[1][0])
    pointers = [w.data_ptr() for w in ours.linear_fc1.expert_weights()]

    dist_checkpointing.save(source.sharded_state_dict(prefix=PREFIX), str(tmp_path))
    _load(target, tmp_path)

    for (src1, src2), (dst1, dst2) in zip(_expert_weights(source), _expert_weights(target)):
        assert torch.equal(src1, dst1) and torch.equal(src2, dst2)
    # Loading wrote into the packed buffer; the Parameters are still its views.
    assert [w.data_ptr() for w in ours.linear_fc1.expert_weights()] == pointers


def _files_bytes(directory) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


@pytest.mark.parametrize("glu", [True, False])
def test_dist_checkpoint_is_no_larger_than_sequential_mlps(megatron_cpu, tmp_path, glu):
    """Every expert weight is a view of the whole packed buffer; a torch_dist checkpoint still
    holds each expert once, not the buffer once per expert."""
    num_experts = 8
    config = make_config(num_experts=num_experts, glu=glu,
                         activation="silu" if glu else "squared_relu")
    torch.manual_seed(3)
    ours = TorchGroupedMLP(num_experts, config, pg_collection=megatron_cpu)
    seq = sequential_mlp(config, megatron_cpu)
    with torch.no_grad():
        for (dst1, dst2), (src1, src2) in zip(_expert_weights(seq), _expert_weights(ours)):
            dst1.copy_(src1)
            dst2.copy_(src2)
    sizes = {}
    for name, module in (("torch", ours), ("sequential", seq)):
        directory = tmp_path / name
        directory.mkdir()
        dist_checkpointing.save(module.sharded_state_dict(prefix=PREFIX), str(directory),
                                sharded_strategy=("torch_dist", 1))
        sizes[name] = _files_bytes(directory)
    weight_bytes = sum(linear.packed_weight.nbytes for linear in (ours.linear_fc1, ours.linear_fc2))
    # The buffer written once per expert would be num_experts times the weights: far larger.
    assert weight_bytes <= sizes["torch"] <= sizes["sequential"], (sizes, weight_bytes)
