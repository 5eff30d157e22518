"""DeepSeek-V3 style reference spec: multi-latent attention, the first 3 layers dense, then MoE
layers of 256 routed SwiGLU experts of width 2048 (top-8) and one shared expert, a sigmoid router
with expert bias and group-limited routing (8 groups, top-4 groups). Routed experts are
TorchGroupedMLP (`moe_expert_gemm_backend="torch"`); the shared expert stays Megatron's MLP.

Every field set here exists in every megatron-core release the package supports (0.16.1 to
0.20.0); the MLA fields are MLATransformerConfig's, hence DeepSeekV3TransformerConfig. MTP
layers (`mtp_num_layers`) are left out: add them through `transformer_config(mtp_num_layers=1)`.
"""

from dataclasses import dataclass

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import MLATransformerConfig

from mcore_torch_experts import TorchExpertsTransformerConfig
from mcore_torch_experts.specs import torch_experts_gpt_spec

VOCAB_SIZE = 129280
MAX_SEQUENCE_LENGTH = 4096
FIRST_DENSE_LAYERS = 3


@dataclass
class DeepSeekV3TransformerConfig(TorchExpertsTransformerConfig, MLATransformerConfig):
    """MLATransformerConfig (multi-latent attention) with the package's fields."""


def transformer_config(first_dense_layers: int = FIRST_DENSE_LAYERS,
                       **overrides) -> DeepSeekV3TransformerConfig:
    """DeepSeek-V3's TransformerConfig, BF16, TorchGroupedMLP experts: `first_dense_layers` dense
    layers, the rest MoE (`moe_layer_freq`, unless overridden); `overrides` replace fields (a
    test shrinks the sizes)."""
    num_layers = overrides.pop("num_layers", 61)
    if not 0 <= first_dense_layers < num_layers:
        raise ValueError(f"first_dense_layers={first_dense_layers} leaves no MoE layer in "
                         f"num_layers={num_layers}; pass 0 <= first_dense_layers < num_layers")
    fields = dict(
        num_layers=num_layers,
        moe_layer_freq=[0] * first_dense_layers + [1] * (num_layers - first_dense_layers),
        hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128,
        # multi-latent attention (MLATransformerConfig), YaRN RoPE
        multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
        qk_pos_emb_head_dim=64, v_head_dim=128, qk_layernorm=True, rope_type="yarn",
        rotary_base=10000, rotary_scaling_factor=40, original_max_position_embeddings=4096,
        beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
        normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0,
        # MoE: routed experts, one shared expert, sigmoid router with expert bias, group-limited
        num_moe_experts=256, moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
        moe_router_topk=8, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3,
        moe_router_topk_scaling_factor=2.5, moe_router_num_groups=8, moe_router_group_topk=4,
        moe_router_pre_softmax=True, moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=1e-4, moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=True, bf16=True, params_dtype=torch.bfloat16,
        moe_expert_gemm_backend="torch",
    )
    fields.update(overrides)
    return DeepSeekV3TransformerConfig(**fields)


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                   pg_collection=None, *, vocab_size=VOCAB_SIZE,
                   max_sequence_length=MAX_SEQUENCE_LENGTH) -> GPTModel:
    """A DeepSeek-V3 style GPTModel with TorchGroupedMLP routed experts; the arguments before `*`
    are those Megatron-LM's `get_model` passes (`config` None: `transformer_config()`)."""
    if config is None:
        config = transformer_config()
    return GPTModel(config=config, transformer_layer_spec=torch_experts_gpt_spec(config, vp_stage),
                    vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=False,
                    # as Megatron-LM's DeepSeek runs; GPTModel leaves RoPE (YaRN) to MLA itself
                    position_embedding_type="rope",
                    vp_stage=vp_stage, pg_collection=pg_collection)


def use_torch_experts(provider):
    """Point a Megatron-Bridge GPTModelProvider (AutoBridge's for a DeepSeek-V3 checkpoint, an
    MLA provider) at TorchGroupedMLP routed experts, as docs/enable.md's `bridge-gpt` snippet
    does; call it before `provider.finalize()`. Returns the provider."""
    if not hasattr(provider, "transformer_layer_spec"):
        raise TypeError(f"use_torch_experts takes a Megatron-Bridge GPTModelProvider (it has "
                        f"`transformer_layer_spec`), got {type(provider).__name__}")
    provider.transformer_layer_spec = torch_experts_gpt_spec
    provider.moe_grouped_gemm = True
    return provider


# NeMo-RL `policy.megatron_cfg` (docs/enable.md, "NeMo-RL"): the worker extension
# TorchExpertsMegatronPolicyWorker names the spec; LoRA on every linear_fc1/linear_fc2 (routed
# experts, the shared expert and the dense layers' MLPs: the same names).
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
