"""Qwen3-MoE reference spec (Qwen3-30B-A3B sizes): every layer MoE, 128 SwiGLU experts of width
768, top-8 softmax routing, no shared experts, qk_layernorm, RMSNorm, RoPE base 1e6, GQA (32
heads, 4 query groups). Routed experts are TorchGroupedMLP (`moe_expert_gemm_backend="torch"`).

    from specs.qwen3_moe import model_provider          # Megatron-LM style: get_model(model_provider)
    from specs.qwen3_moe import use_torch_experts       # Megatron-Bridge: on AutoBridge's provider

Other family members (Qwen3-235B-A22B, ...) differ in sizes only: pass them to
`transformer_config(**overrides)`.
"""

import torch
from megatron.core.models.gpt import GPTModel

from mcore_torch_experts import TorchExpertsTransformerConfig
from mcore_torch_experts.specs import torch_experts_gpt_spec

VOCAB_SIZE = 151936
MAX_SEQUENCE_LENGTH = 40960
ROTARY_BASE = 1_000_000


def transformer_config(**overrides) -> TorchExpertsTransformerConfig:
    """Qwen3-30B-A3B's TransformerConfig, BF16, TorchGroupedMLP experts; `overrides` replace
    fields (a test shrinks the sizes)."""
    fields = dict(
        num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
        num_query_groups=4, kv_channels=128, qk_layernorm=True, normalization="RMSNorm",
        layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=128, moe_ffn_hidden_size=768, moe_router_topk=8,
        moe_router_pre_softmax=False, moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-3, moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=True, bf16=True, params_dtype=torch.bfloat16,
        moe_expert_gemm_backend="torch",
    )
    fields.update(overrides)
    return TorchExpertsTransformerConfig(**fields)


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                   pg_collection=None, *, vocab_size=VOCAB_SIZE,
                   max_sequence_length=MAX_SEQUENCE_LENGTH) -> GPTModel:
    """A Qwen3-MoE GPTModel with TorchGroupedMLP experts; the arguments before `*` are those
    Megatron-LM's `get_model` passes (`config` None: `transformer_config()`)."""
    if config is None:
        config = transformer_config()
    return GPTModel(config=config, transformer_layer_spec=torch_experts_gpt_spec(config, vp_stage),
                    vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope",
                    rotary_base=ROTARY_BASE, vp_stage=vp_stage, pg_collection=pg_collection)


def use_torch_experts(provider):
    """Point a Megatron-Bridge GPTModelProvider (AutoBridge's for a Qwen3-MoE checkpoint) at
    TorchGroupedMLP experts, as docs/enable.md's `bridge-gpt` snippet does; call it before
    `provider.finalize()`. Returns the provider."""
    if not hasattr(provider, "transformer_layer_spec"):
        raise TypeError(f"use_torch_experts takes a Megatron-Bridge GPTModelProvider (it has "
                        f"`transformer_layer_spec`), got {type(provider).__name__}")
    provider.transformer_layer_spec = torch_experts_gpt_spec
    provider.moe_grouped_gemm = True
    return provider


# NeMo-RL `policy.megatron_cfg` (docs/enable.md, "NeMo-RL"): the worker extension
# TorchExpertsMegatronPolicyWorker names the spec; LoRA on the experts' fc1/fc2.
NEMO_RL_MEGATRON_CFG = """\
enabled: true
moe_grouped_gemm: true
force_reconvert_from_hf: true   # once, for the first run with the worker extension
peft:
  enabled: true
  target_modules: [linear_fc1, linear_fc2]
  exclude_modules: []
  dim: 8
  alpha: 32
  dropout: 0.0
  dropout_position: post
  lora_A_init_method: xavier
  lora_B_init_method: zero
  a2a_experimental: false
  lora_dtype: null
"""
