"""Hybrid (Nemotron-H style) stacks: the reference hybrid stack spec puts TorchGroupedMLP in the MoE
layer and changes nothing else; a HybridModel of attention and MoE layers built from local (non-TE)
modules computes what the same model with SequentialMLP computes, and its adapters train under
full recompute with a frozen embedding."""

import dataclasses
import sys

import pytest
import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec

from mcore_torch_experts import TorchGroupedMLP, _compat, specs
from mcore_torch_experts.lora import apply_lora, lora_parameters
from mcore_torch_experts.megatron.recompute import install_frozen_input_guard
from support.tiny_gpt import HYBRID_PATTERN as PATTERN
from support.tiny_gpt import LORA_TARGETS as TARGETS
from support.tiny_gpt import (
    NUM_EXPERTS,
    assert_same_outputs,
    batch,
    experts_modules,
    hybrid_model,
    needs_hybrid_recompute,
    sequential_to_grouped,
    tiny_config,
)

LOGITS_TOL, GRAD_TOL = 1e-3, 1e-2  # as tests/unit/megatron/test_specs.py: same weights, same math

@pytest.fixture
def local_final_norm(monkeypatch):
    """Test-only patch: HybridStack builds its final norm as TENorm whatever its spec says, and
    TENorm raises without Transformer Engine. Megatron's own WrappedTorchNorm (the local specs'
    norm, same RMSNorm math) stands in for it. The code under test is not patched."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    hybrid_stack_class = _compat.recompute_block_classes()[1]  # HybridStack (MambaStack < 0.18)
    monkeypatch.setattr(sys.modules[hybrid_stack_class.__module__], "TENorm", WrappedTorchNorm)


def experts_class(layer_spec):
    return _compat.spec_class(_compat.moe_submodules(layer_spec.submodules.mlp).experts)


def hybrid_config(**overrides):
    fields = dict(num_layers=len(PATTERN), moe_layer_freq=1)
    fields.update(overrides)
    return tiny_config(**fields)


def test_hybrid_stack_spec_swaps_only_the_moe_experts():
    megatron_spec = _compat.megatron_hybrid_stack_spec()
    original_moe_layer = megatron_spec.submodules.moe_layer
    original_experts = experts_class(original_moe_layer)
    ours = specs.get_hybrid_stack_spec(
        hybrid_config(moe_expert_gemm_backend="torch", moe_grouped_gemm=True))

    assert experts_class(ours.submodules.moe_layer) is TorchGroupedMLP
    assert _compat.spec_class(ours.submodules.moe_layer) is _compat.spec_class(original_moe_layer)
    for field in dataclasses.fields(ours.submodules):
        if field.name != "moe_layer":
            assert getattr(ours.submodules, field.name) is \
                getattr(megatron_spec.submodules, field.name), field.name
    assert ours.module is megatron_spec.module
    # Megatron's spec is shared by every provider in the process: never changed in place.
    assert megatron_spec.submodules.moe_layer is original_moe_layer
    assert experts_class(original_moe_layer) is original_experts is not TorchGroupedMLP

    unchanged = specs.get_hybrid_stack_spec(hybrid_config(moe_grouped_gemm=True))
    assert unchanged.submodules.moe_layer is original_moe_layer


def test_hybrid_stack_spec_refuses_what_the_torch_backend_cannot_honour():
    from mcore_torch_experts import TorchExpertsConfigError

    config = hybrid_config(moe_expert_gemm_backend="torch", moe_grouped_gemm=True)
    config.add_bias_linear = True  # set after construction, as a provider override would
    with pytest.raises(TorchExpertsConfigError, match="add_bias_linear=True"):
        specs.get_hybrid_stack_spec(config)


def local_hybrid_stack_spec():
    """Megatron's hybrid stack spec with local (non-TE) attention and MoE layers, SequentialMLP
    experts; Mamba layers stay as they are (the pattern below uses none)."""
    megatron_spec = _compat.megatron_hybrid_stack_spec()
    local = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=NUM_EXPERTS,
                                                     moe_grouped_gemm=False,
                                                     normalization="RMSNorm")
    attention = dataclasses.replace(local, submodules=dataclasses.replace(
        local.submodules, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityFuncOp))
    moe = ModuleSpec(
        module=_compat.spec_class(megatron_spec.submodules.moe_layer),
        submodules=dataclasses.replace(local.submodules, input_layernorm=IdentityOp,
                                       self_attention=IdentityOp, self_attn_bda=IdentityFuncOp,
                                       mlp_bda=get_bias_dropout_add))
    return dataclasses.replace(megatron_spec, submodules=dataclasses.replace(
        megatron_spec.submodules, attention_layer=attention, moe_layer=moe))


def test_hybrid_model_matches_the_sequential_mlp_model(megatron_cpu, local_final_norm):
    ours_config = hybrid_config(moe_expert_gemm_backend="torch", moe_grouped_gemm=True)
    ours = hybrid_model(ours_config, specs.get_hybrid_stack_spec(ours_config,
                                                                 local_hybrid_stack_spec()), seed=1)
    reference = hybrid_model(hybrid_config(), local_hybrid_stack_spec())
    assert experts_modules(ours) == [TorchGroupedMLP] * 2
    assert experts_modules(reference) == [SequentialMLP] * 2

    missing, unexpected = ours.load_state_dict(sequential_to_grouped(reference.state_dict()),
                                               strict=False)
    assert unexpected == [] and all(key.endswith("_extra_state") for key in missing)
    assert_same_outputs(ours, reference, LOGITS_TOL, GRAD_TOL)


def adapter_grads(recompute_method, guard):
    """Adapter gradients of a frozen FP32 HybridModel (attention + MoE) with LoRA on attention
    and expert linears, after one backward."""
    recompute = dict(recompute_granularity="full", recompute_method=recompute_method,
                     recompute_num_layers=2) if recompute_method else {}
    config = hybrid_config(moe_expert_gemm_backend="torch", moe_grouped_gemm=True, bf16=False,
                           params_dtype=torch.float32, **recompute)
    model = hybrid_model(config, specs.get_hybrid_stack_spec(config, local_hybrid_stack_spec()))
    if guard:
        assert install_frozen_input_guard(model) == 1
    apply_lora(model, TARGETS, rank=4, alpha=8)
    torch.manual_seed(0)
    for p in lora_parameters(model).values():  # B starts at zero: give every adapter a gradient path
        torch.nn.init.normal_(p, std=0.02)
    inputs, positions, mask, labels = batch()
    model.train()
    loss = model(inputs, positions, mask, labels=labels)
    if loss.requires_grad:
        loss.float().mean().backward()
    return {name: p.grad for name, p in lora_parameters(model).items()}


@needs_hybrid_recompute
@pytest.mark.parametrize("recompute_method", ["uniform", "block"])
def test_hybrid_adapters_train_under_full_recompute(megatron_cpu_training, local_final_norm,
                                                   recompute_method):
    expected = adapter_grads(None, guard=False)
    # qkv and proj of 2 attention layers, fc1 and fc2 of 2 MoE layers; A and B each
    assert len(expected) == 8 * 2 and all(g is not None for g in expected.values())
    got = adapter_grads(recompute_method, guard=True)
    for name, grad in expected.items():
        assert got[name] is not None, name
        assert torch.allclose(got[name], grad, rtol=1e-5, atol=1e-7), name

    unguarded = adapter_grads(recompute_method, guard=False)
    assert any(g is None for g in unguarded.values())  # what the guard is for
