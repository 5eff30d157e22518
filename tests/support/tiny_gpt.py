"""The tests' model presets: a tiny BF16 GPT-MoE (config, batch, forward/backward, the expert-key
map between SequentialMLP and TorchGroupedMLP/TEGroupedMLP models, the sharded-state layout a
checkpoint would write), a HybridModel of its layers, and a 4-layer FP32 GPT-MoE for adapter
training on the CPU (config, LM batch)."""

import re

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
from megatron.core.models.gpt import GPTModel

from mcore_torch_experts import TorchExpertsTransformerConfig, _compat
from support.reference import rel_err

VOCAB, SEQ, BATCH = 128, 16, 2
MOE_LAYER_FREQ = [0, 1, 1]  # layer 0 dense, layers 1 and 2 MoE
MOE_LAYERS = [1, 2]
NUM_EXPERTS, HIDDEN, MOE_FFN = 4, 64, 32
HYBRID_PATTERN = "*E*E"  # attention, MoE, attention, MoE
LORA_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]

needs_hybrid_recompute = pytest.mark.skipif(
    _compat.hybrid_model_class().__name__ != "HybridModel",
    reason=f"HybridModel (HybridStack with full recompute) arrived in megatron-core 0.18 "
           f"(installed {'.'.join(map(str, _compat.megatron_core_release()))})")


def tiny_config(**overrides) -> TorchExpertsTransformerConfig:
    """3 layers (dense, MoE, MoE), hidden 64, 4 SwiGLU experts of width 32, top-2, bf16 weights."""
    fields = dict(
        num_layers=len(MOE_LAYER_FREQ), moe_layer_freq=MOE_LAYER_FREQ, hidden_size=HIDDEN,
        num_attention_heads=4, ffn_hidden_size=128, num_moe_experts=NUM_EXPERTS,
        moe_ffn_hidden_size=MOE_FFN, moe_router_topk=2, moe_router_dtype="fp32",
        moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm", add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        use_cpu_initialization=True,
    )
    fields.update(overrides)
    return TorchExpertsTransformerConfig(**fields)


def fp32_moe_config(**overrides) -> TorchExpertsTransformerConfig:
    """4 layers, every one MoE (4 SwiGLU experts of width 64, top-2), hidden 64, FP32 on the CPU,
    TorchGroupedMLP experts (`moe_expert_gemm_backend="torch"`); `overrides` replace fields."""
    fields = dict(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
        moe_ffn_hidden_size=64, ffn_hidden_size=64, moe_router_topk=2, moe_grouped_gemm=True,
        moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        use_cpu_initialization=True, moe_expert_gemm_backend="torch",
    )
    fields.update(overrides)
    return TorchExpertsTransformerConfig(**fields)


def lm_batch(decoder_input=None) -> dict:
    """GPTModel keyword arguments: [BATCH, SEQ] tokens, positions, causal mask, next-token labels."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return dict(input_ids=tokens, position_ids=torch.arange(SEQ).expand(BATCH, SEQ),
                attention_mask=torch.ones(1, 1, SEQ, SEQ).triu(1).bool(),
                labels=torch.roll(tokens, -1, dims=1), decoder_input=decoder_input)


def gpt(config, spec, seed=0) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope")


def hybrid_model(config, stack_spec, seed=0):
    """A HybridModel (MambaModel before 0.18) of HYBRID_PATTERN's layers from `stack_spec`."""
    model_class = _compat.hybrid_model_class()
    torch.manual_seed(seed)
    return model_class(config=config, vocab_size=VOCAB, max_sequence_length=SEQ,
                       position_embedding_type="rope",
                       **{_compat.hybrid_stack_spec_kwarg(model_class): stack_spec,
                          _compat.hybrid_pattern_kwarg(model_class): HYBRID_PATTERN})


def experts_modules(model) -> list:
    """The class of every experts module of `model`, in order."""
    return [type(m) for name, m in model.named_modules() if name.endswith("mlp.experts")]


def freeze_experts(model) -> None:
    """The frozen expert base of adapter training, for a reference model (SequentialMLP,
    TEGroupedMLP) whose experts Megatron builds trainable."""
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.requires_grad_(False)


def assert_experts_built_frozen(model) -> None:
    """Every expert weight of `model` (TorchGroupedMLP experts) is frozen as built."""
    experts = [p for n, p in model.named_parameters() if ".mlp.experts." in n]
    assert experts and not any(p.requires_grad for p in experts)


def batch():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    causal_mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    return tokens[:, :-1], positions, causal_mask, tokens[:, 1:]


def forward_backward(model):
    """Logits [B, S, V], per-token loss [B, S], and the gradient of every trainable parameter of
    the summed loss (the expert weights' input gradients flow into all of them)."""
    device = next(model.parameters()).device
    inputs, positions, mask, labels = (tensor.to(device) for tensor in batch())
    logits = model(inputs, positions, mask).detach()
    loss = model(inputs, positions, mask, labels=labels)
    model.zero_grad()
    loss.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logits, loss.detach(), grads


def assert_same_outputs(ours, reference, logits_tol: float, grad_tol: float) -> None:
    """Two models with the same weights and frozen experts give the same logits, loss and
    gradient of every trainable parameter (the embedding's included), within the tolerances."""
    assert_experts_built_frozen(ours)
    freeze_experts(reference)
    logits, loss, grads = forward_backward(ours)
    ref_logits, ref_loss, ref_grads = forward_backward(reference)
    assert rel_err(logits, ref_logits) < logits_tol
    assert rel_err(loss, ref_loss) < logits_tol
    assert grads.keys() == ref_grads.keys() and "embedding.word_embeddings.weight" in grads
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) < grad_tol, name


SEQUENTIAL_EXPERT_KEY = re.compile(r"(.*\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.(\w+)$")


def sequential_to_grouped(state_dict) -> dict:
    """A SequentialMLP model's state dict under TEGroupedMLP's (= TorchGroupedMLP's) keys:
    `experts.local_experts.{i}.linear_fc{j}.weight` -> `experts.linear_fc{j}.weight{i}`. The
    per-expert `_extra_state` entries have no counterpart and are dropped."""
    grouped = {}
    for key, value in state_dict.items():
        match = SEQUENTIAL_EXPERT_KEY.match(key)
        if match is None:
            grouped[key] = value
        elif match[4] == "weight":
            grouped[f"{match[1]}{match[3]}.weight{match[2]}"] = value
    return grouped


EXPERTS = [f"decoder.layers.{layer}.mlp.experts" for layer in MOE_LAYERS]
# fc1 [2F, H] (SwiGLU) and fc2 [H, F] per expert, bf16.
BYTES_PER_LAYER = NUM_EXPERTS * (2 * MOE_FFN * HIDDEN + HIDDEN * MOE_FFN) * 2


def sharded_layout(model):
    """{global key: sorted [(kind, global shape, global offset)]} of the sharded state dict."""
    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    layout = {}
    for value in sharded.values():
        for item in value if isinstance(value, list) else [value]:  # GLU: [gate half, up half]
            if isinstance(item, ShardedTensor):
                entry = ("tensor", item.global_shape, item.global_offset)
            else:
                assert isinstance(item, ShardedObject), type(item)
                entry = ("object", item.global_shape, item.global_offset)
            layout.setdefault(item.key, []).append(entry)
    return {key: sorted(entries) for key, entries in layout.items()}
