"""Nemotron-3 hybrid reference spec (Nemotron-3 Nano 30B-A3B sizes): Mamba-2, attention and MoE
layers through Megatron's hybrid stack spec, each MoE layer 128 routed squared-ReLU experts (not
gated) of width 1856 (top-6, sigmoid router with expert bias) and one shared expert. Routed
experts are TorchGroupedMLP (`moe_expert_gemm_backend="torch"`); Mamba and attention layers are
Megatron's.

Megatron's hybrid stack spec is built from Transformer Engine modules: the model needs TE (and a
GPU); without it only the spec can be built. The sizes and the layer pattern are those of
Megatron-Bridge 0.7.0's Nemotron 3 Nano recipe (`recipes/nemotronh/h100/nemotron_3_nano.py`).
"""

import inspect

import torch
from megatron.core.activations import squared_relu

from mcore_torch_experts import TorchExpertsTransformerConfig, _compat
from mcore_torch_experts.specs import torch_experts_hybrid_stack_spec

VOCAB_SIZE = 131072
MAX_SEQUENCE_LENGTH = 8192
# One character per layer: M Mamba, * attention, E MoE, - dense MLP (52 layers).
HYBRID_LAYER_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"


def transformer_config(**overrides) -> TorchExpertsTransformerConfig:
    """Nemotron-3 Nano's TransformerConfig, BF16, TorchGroupedMLP experts, one layer per character
    of HYBRID_LAYER_PATTERN; `overrides` replace fields (a test shrinks the sizes; a shorter
    pattern needs its `num_layers`)."""
    fields = dict(
        num_layers=len(HYBRID_LAYER_PATTERN), is_hybrid_model=True, hidden_size=2688,
        ffn_hidden_size=1856, num_attention_heads=32, num_query_groups=2, kv_channels=128,
        mamba_num_heads=64, mamba_head_dim=64, mamba_state_dim=128, mamba_num_groups=8,
        normalization="RMSNorm", layernorm_epsilon=1e-5, gated_linear_unit=False,
        activation_func=squared_relu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=128, moe_ffn_hidden_size=1856, moe_shared_expert_intermediate_size=3712,
        moe_router_topk=6, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4,
        moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True,
        bf16=True, params_dtype=torch.bfloat16, moe_expert_gemm_backend="torch",
    )
    fields.update(overrides)
    return TorchExpertsTransformerConfig(**fields)


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                   pg_collection=None, *, vocab_size=VOCAB_SIZE,
                   max_sequence_length=MAX_SEQUENCE_LENGTH,
                   hybrid_layer_pattern=HYBRID_LAYER_PATTERN):
    """A Nemotron-3 hybrid model (HybridModel; MambaModel before megatron-core 0.18) whose MoE
    layers have TorchGroupedMLP experts; the arguments before `*` are those Megatron-LM's
    `get_model` passes (`config` None: `transformer_config()`). Needs Transformer Engine."""
    if config is None:
        config = transformer_config()
    if len(hybrid_layer_pattern) != config.num_layers:
        raise ValueError(f"hybrid_layer_pattern has {len(hybrid_layer_pattern)} layers, "
                         f"config.num_layers={config.num_layers}; give one character per layer")
    model_class = _compat.hybrid_model_class()
    kwargs = {_compat.hybrid_stack_spec_kwarg(model_class): torch_experts_hybrid_stack_spec(config),
              _compat.hybrid_pattern_kwarg(model_class): hybrid_layer_pattern}
    if vp_stage is not None:
        if "vp_stage" not in inspect.signature(model_class).parameters:
            raise ValueError(f"{model_class.__name__} of the installed megatron-core takes no "
                             f"vp_stage (virtual pipelining of hybrid models: megatron-core 0.18+)")
        kwargs["vp_stage"] = vp_stage
    return model_class(config=config, vocab_size=vocab_size,
                       max_sequence_length=max_sequence_length, pre_process=pre_process,
                       post_process=post_process, share_embeddings_and_output_weights=False,
                       position_embedding_type="none", pg_collection=pg_collection, **kwargs)


def use_torch_experts(provider):
    """Point a Megatron-Bridge HybridModelProvider (Nemotron-3, Nemotron-H) at TorchGroupedMLP
    experts, as docs/enable.md's `bridge-hybrid` snippet does (and `moe_grouped_gemm = True`,
    which TorchGroupedMLP needs); call it before `provider.finalize()`. Returns the provider."""
    if not hasattr(provider, "hybrid_stack_spec"):
        raise TypeError(f"use_torch_experts takes a Megatron-Bridge HybridModelProvider (it has "
                        f"`hybrid_stack_spec`; Bridge 0.6+), got {type(provider).__name__}")
    provider.hybrid_stack_spec = torch_experts_hybrid_stack_spec
    provider.moe_grouped_gemm = True
    return provider


# NeMo-RL `policy.megatron_cfg` (docs/enable.md, "NeMo-RL"): the worker extension
# TorchExpertsMegatronPolicyWorker names the hybrid spec; LoRA on the experts' fc1/fc2.
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
