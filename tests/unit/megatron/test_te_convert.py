"""convert_experts_to_torch on models built from Megatron's Transformer Engine spec: TEGroupedMLP
experts, and SequentialMLP experts whose linears are TE's (moe_grouped_gemm=False). Same weights,
same sharded layout, close outputs and gradients; torch_dist checkpoints load from the TE model
into the converted one and back, exactly. CUDA with TE only (the TE leg)."""

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.transformer.moe.experts import SequentialMLP

from mcore_torch_experts import TorchGroupedMLP
from mcore_torch_experts.megatron.convert import convert_experts_to_torch
from support.reference import rel_err
from support.te import needs_te, te_config, te_gpt
from support.tiny_gpt import (
    BYTES_PER_LAYER,
    EXPERTS,
    NUM_EXPERTS,
    forward_backward,
    freeze_experts,
    sequential_to_grouped,
    sharded_layout,
)

pytestmark = needs_te
LOGITS_TOL, GRAD_TOL = 1e-2, 5e-2  # BF16: TE's per-expert GEMMs against torch's grouped GEMM


def tensors(state_dict) -> dict:
    """The tensors of a state dict (TE's `_extra_state` entries left out)."""
    return {k: v.detach().clone() for k, v in state_dict.items()
            if torch.is_tensor(v) and "_extra_state" not in k}


def assert_converts(model, expected_expert_state):
    """Convert `model` (expert weights frozen) and check it against itself before: expert weights
    (`expected_expert_state`, under TEGroupedMLP's keys), sharded layout, logits, gradients."""
    freeze_experts(model)
    logits, loss, grads = forward_backward(model)
    layout = sharded_layout(model)

    summary = convert_experts_to_torch(model)

    assert summary.names == EXPERTS and summary.bytes_packed == 2 * BYTES_PER_LAYER
    assert all(isinstance(model.get_submodule(name), TorchGroupedMLP) for name in EXPERTS)
    new_state = model.state_dict()
    for key, value in expected_expert_state.items():
        assert torch.equal(new_state[key], value), key
    assert sharded_layout(model) == layout
    new_logits, new_loss, new_grads = forward_backward(model)
    assert rel_err(new_logits, logits) < LOGITS_TOL and rel_err(new_loss, loss) < LOGITS_TOL
    assert new_grads.keys() == grads.keys() and "embedding.word_embeddings.weight" in grads
    for name, grad in grads.items():
        assert rel_err(new_grads[name], grad) < GRAD_TOL, name


def test_te_grouped_mlp_model_converts_with_unchanged_keys(te_world):
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    model = te_gpt(te_config())
    assert all(isinstance(model.get_submodule(name), TEGroupedMLP) for name in EXPERTS)
    experts = {k: v for k, v in tensors(model.state_dict()).items() if ".experts." in k}
    assert len(experts) == 2 * 2 * NUM_EXPERTS  # fc1 and fc2 weightN in each MoE layer
    assert_converts(model, experts)


def test_te_spec_sequential_mlp_model_converts(te_world):
    """Megatron's TE spec with moe_grouped_gemm=False: SequentialMLP whose experts' linears are
    TEColumnParallelLinear / TERowParallelLinear."""
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelLinear,
        TERowParallelLinear,
    )

    model = te_gpt(te_config(moe_grouped_gemm=False))
    for name in EXPERTS:
        experts = model.get_submodule(name)
        assert isinstance(experts, SequentialMLP)
        assert all(isinstance(e.linear_fc1, TEColumnParallelLinear)
                   and isinstance(e.linear_fc2, TERowParallelLinear) for e in experts.local_experts)
    grouped = tensors(sequential_to_grouped(model.state_dict()))
    experts = {k: v for k, v in grouped.items() if ".experts." in k}
    assert len(experts) == 2 * 2 * NUM_EXPERTS
    assert_converts(model, experts)


def save(model, directory):
    directory.mkdir()
    dist_checkpointing.save(model.sharded_state_dict(), str(directory),
                            sharded_strategy=("torch_dist", 1))


def load(model, directory):
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(directory)),
                          strict=True)


def assert_same_tensors(got, expected):
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize("moe_grouped_gemm", [True, False],
                         ids=["te_grouped_mlp", "te_spec_sequential_mlp"])
def test_torch_dist_checkpoint_loads_te_to_torch_and_back(te_world, tmp_path, moe_grouped_gemm):
    """A TE-spec model's checkpoint loads into its converted twin, whose checkpoint loads into a
    fresh TE-spec model: every tensor as saved (SequentialMLP's under TEGroupedMLP's keys)."""
    def weights(model):
        return tensors(sequential_to_grouped(model.state_dict()))

    te_model = te_gpt(te_config(moe_grouped_gemm=moe_grouped_gemm), seed=1)
    expected = weights(te_model)
    converted = te_gpt(te_config(moe_grouped_gemm=moe_grouped_gemm), seed=2)
    convert_experts_to_torch(converted)
    fresh_te_model = te_gpt(te_config(moe_grouped_gemm=moe_grouped_gemm), seed=3)
    expert_key = f"{EXPERTS[0]}.linear_fc1.weight0"
    for other in (converted, fresh_te_model):  # different weights before loading
        assert not torch.equal(weights(other)[expert_key], expected[expert_key])

    save(te_model, tmp_path / "te")
    load(converted, tmp_path / "te")
    assert isinstance(converted.get_submodule(EXPERTS[0]), TorchGroupedMLP)
    assert_same_tensors(weights(converted), expected)

    save(converted, tmp_path / "torch")
    load(fresh_te_model, tmp_path / "torch")
    te_experts = type(te_model.get_submodule(EXPERTS[0]))
    assert type(fresh_te_model.get_submodule(EXPERTS[0])) is te_experts
    assert_same_tensors(weights(fresh_te_model), expected)
    # The loaded models compute what the saved one computes (TE against torch experts: BF16).
    logits = forward_backward(te_model)[0]
    assert rel_err(forward_backward(fresh_te_model)[0], logits) < 1e-3
    assert rel_err(forward_backward(converted)[0], logits) < LOGITS_TOL
