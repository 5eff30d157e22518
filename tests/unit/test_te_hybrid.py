"""Megatron's own hybrid stack spec with its Transformer Engine classes (TE attention, TE norms,
TEGroupedMLP in the MoE layer), through specs.get_hybrid_stack_spec: a HybridModel of attention
and MoE layers ("*E*E"; Mamba layers need mamba_ssm) with TorchGroupedMLP experts builds on CUDA
in BF16, matches the TEGroupedMLP model with the same weights, and trains adapters under full
recompute with the frozen-input guard (megatron-core 0.18+: MambaStack before it has no full
recompute). CUDA with TE only (the TE legs)."""

import pytest
import torch

from mcore_torch_experts import TorchGroupedMLP, specs
from mcore_torch_experts.lora import apply_lora, lora_parameters
from mcore_torch_experts.megatron.recompute import install_frozen_input_guard
from support.reference import rel_err
from support.te import needs_te, te_config
from support.tiny_gpt import HYBRID_PATTERN as PATTERN
from support.tiny_gpt import LORA_TARGETS as TARGETS
from support.tiny_gpt import (
    assert_same_outputs,
    batch,
    experts_modules,
    hybrid_model,
    needs_hybrid_recompute,
)

pytestmark = needs_te
LOGITS_TOL, GRAD_TOL = 1e-2, 5e-2  # BF16: TE's per-expert GEMMs against torch's grouped GEMM
RECOMPUTE_TOL = 1e-2  # the same BF16 model with and without recompute (TE attention's backward)


def hybrid_config(**overrides):
    return te_config(num_layers=len(PATTERN), moe_layer_freq=1, **overrides)


def te_hybrid_model(config, seed=0):
    """A HybridModel from Megatron's hybrid stack spec as given (TEGroupedMLP experts) or as
    get_hybrid_stack_spec makes it for `config`, on CUDA."""
    return hybrid_model(config, specs.get_hybrid_stack_spec(config), seed=seed).cuda()


def test_te_hybrid_model_matches_the_te_grouped_mlp_model(te_world):
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    reference = te_hybrid_model(hybrid_config())
    ours = te_hybrid_model(hybrid_config(moe_expert_gemm_backend="torch"), seed=1)
    assert experts_modules(reference) == [TEGroupedMLP] * 2
    assert experts_modules(ours) == [TorchGroupedMLP] * 2

    missing, unexpected = ours.load_state_dict(reference.state_dict(), strict=False)
    assert unexpected == [] and all(key.endswith("_extra_state") for key in missing)
    assert_same_outputs(ours, reference, LOGITS_TOL, GRAD_TOL)


def adapter_grads(state, recompute_method, guard):
    """Adapter gradients (FP32 adapters over the frozen BF16 base `state`) of a TorchGroupedMLP
    HybridModel with LoRA on attention and expert linears, after one backward."""
    recompute = dict(recompute_granularity="full", recompute_method=recompute_method,
                     recompute_num_layers=2) if recompute_method else {}
    config = hybrid_config(moe_expert_gemm_backend="torch", **recompute)
    model = te_hybrid_model(config)
    model.load_state_dict(state)
    if guard:
        assert install_frozen_input_guard(model) == 1
    apply_lora(model, TARGETS, rank=4, alpha=8, dtype=torch.float32)
    torch.manual_seed(0)
    for p in lora_parameters(model).values():  # B starts at zero: every adapter gets a gradient
        torch.nn.init.normal_(p, std=0.02)
    inputs, positions, mask, labels = (t.cuda() for t in batch())
    model.train()
    loss = model(inputs, positions, mask, labels=labels)
    if loss.requires_grad:
        loss.float().mean().backward()
    return {name: p.grad for name, p in lora_parameters(model).items()}


@needs_hybrid_recompute
@pytest.mark.parametrize("recompute_method", ["uniform", "block"])
def test_te_hybrid_adapters_train_under_full_recompute(te_world, recompute_method):
    config = hybrid_config(moe_expert_gemm_backend="torch")
    state = te_hybrid_model(config).state_dict()
    expected = adapter_grads(state, None, guard=False)
    # qkv and proj of 2 attention layers, fc1 and fc2 of 2 MoE layers; A and B each
    assert len(expected) == 8 * 2 and all(g is not None for g in expected.values())
    got = adapter_grads(state, recompute_method, guard=True)
    for name, grad in expected.items():
        assert got[name] is not None, name
        assert rel_err(got[name], grad) < RECOMPUTE_TOL, name

    unguarded = adapter_grads(state, recompute_method, guard=False)
    assert any(g is None for g in unguarded.values())  # what the guard is for
