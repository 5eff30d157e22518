"""Reference layer specs: Megatron's own GPT specs with TorchGroupedMLP as the MoE experts when
`config.moe_expert_gemm_backend == "torch"`, and Megatron's choice otherwise; MoE layers become
FP32CombineMoELayer when `config.moe_combine_in_fp32` is set.

The spec decides which module runs; TorchGroupedMLP never looks at global state. Specs are never
changed in place: Megatron shares one MoE layer spec between all MoE layers of a block.
"""

import dataclasses
import importlib.util
from typing import Mapping, Optional

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from . import _compat
from .config import (
    check_backend,
    refuse_unsupported_flags,
    validate_fp32_combine_config,
    validate_torch_experts_config,
)
from .experts import TorchGroupedMLP
from .moe_layer import FP32CombineMoELayer


def torch_experts_spec() -> ModuleSpec:
    """The experts spec for MoESubmodules.experts, on every supported Megatron-Core release."""
    return ModuleSpec(module=TorchGroupedMLP)


def wants_torch_experts(config: TransformerConfig) -> bool:
    """Whether `config.moe_expert_gemm_backend` (a field or a plain attribute; absent means
    "transformer_engine") says "torch"; any value other than BACKENDS is a TorchExpertsConfigError."""
    backend = getattr(config, "moe_expert_gemm_backend", "transformer_engine")
    check_backend(backend)
    return backend == "torch"


def with_torch_experts(layer_spec: ModuleSpec) -> ModuleSpec:
    """A copy of a TransformerLayer spec whose MoE experts are TorchGroupedMLP (dense: unchanged)."""
    mlp = layer_spec.submodules.mlp
    if not _compat.is_moe_mlp_spec(mlp):
        return layer_spec
    moe = dataclasses.replace(_compat.moe_submodules(mlp), experts=torch_experts_spec())
    submodules = dataclasses.replace(layer_spec.submodules,
                                     mlp=_compat.with_moe_submodules(mlp, moe))
    return dataclasses.replace(layer_spec, submodules=submodules)


def with_fp32_combine(layer_spec: ModuleSpec) -> ModuleSpec:
    """A copy of a TransformerLayer spec whose MoE layer sums top-k outputs in FP32."""
    mlp = layer_spec.submodules.mlp
    if not _compat.is_moe_mlp_spec(mlp):
        return layer_spec
    submodules = dataclasses.replace(
        layer_spec.submodules, mlp=_compat.with_moe_layer_class(mlp, FP32CombineMoELayer))
    return dataclasses.replace(layer_spec, submodules=submodules)


def _follow_config(config: TransformerConfig, layer_spec: ModuleSpec,
                   torch_experts: bool) -> ModuleSpec:
    if torch_experts:
        layer_spec = with_torch_experts(layer_spec)
    if getattr(config, "moe_combine_in_fp32", False):
        validate_fp32_combine_config(config)
        layer_spec = with_fp32_combine(layer_spec)
    return layer_spec


def _check_torch_experts(config: TransformerConfig, spec_kwargs: Mapping[str, object]) -> bool:
    """Whether `config` asks for TorchGroupedMLP, after refusing what it cannot honour (in the
    config or in the spec builder's arguments, e.g. use_te_op_fuser=True)."""
    if not wants_torch_experts(config):
        return False
    validate_torch_experts_config(config)
    refuse_unsupported_flags(spec_kwargs)
    return True


def get_gpt_layer_with_transformer_engine_spec(config: TransformerConfig, **kwargs) -> ModuleSpec:
    """Megatron's TE GPT layer spec for `config`; MoE experts follow moe_expert_gemm_backend."""
    torch_experts = _check_torch_experts(config, kwargs)
    builder = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec
    spec = builder(**_compat.gpt_layer_spec_kwargs(builder, config, **kwargs))
    return _follow_config(config, spec, torch_experts)


def get_gpt_layer_local_spec(config: TransformerConfig, **kwargs) -> ModuleSpec:
    """Megatron's local (no TE) GPT layer spec for `config`; MoE experts follow the backend flag."""
    torch_experts = _check_torch_experts(config, kwargs)
    builder = gpt_layer_specs.get_gpt_layer_local_spec
    spec = builder(**_compat.gpt_layer_spec_kwargs(builder, config, **kwargs))
    return _follow_config(config, spec, torch_experts)


def get_gpt_decoder_block_spec(config: TransformerConfig, use_transformer_engine: bool, **kwargs):
    """Megatron's decoder block spec (dense and MoE layers per moe_layer_freq, this pipeline
    stage's layers), MoE experts following moe_expert_gemm_backend.

    `kwargs` go to Megatron's builder: normalization, qk_l2_norm, vp_stage, pp_rank.
    """
    torch_experts = _check_torch_experts(config, kwargs)
    block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine, **kwargs)
    layers = [_follow_config(config, s, torch_experts) for s in block.layer_specs]
    return dataclasses.replace(block, layer_specs=layers)


def gpt_transformer_layer_spec(config: TransformerConfig, vp_stage: Optional[int] = None,
                               use_transformer_engine: Optional[bool] = None):
    """What a GPT model provider passes to GPTModel as `transformer_layer_spec`: the decoder block
    spec for MoE configs, one layer spec for dense ones; MoE experts follow
    moe_expert_gemm_backend.

    Megatron-Bridge calls it as `GPTModelProvider.transformer_layer_spec(config, vp_stage=...)`.
    `use_transformer_engine` defaults to whether Transformer Engine is importable.
    """
    if use_transformer_engine is None:
        use_transformer_engine = importlib.util.find_spec("transformer_engine") is not None
    if config.num_moe_experts:
        return get_gpt_decoder_block_spec(config, use_transformer_engine,
                                          normalization=config.normalization,
                                          qk_l2_norm=config.qk_l2_norm, vp_stage=vp_stage)
    if use_transformer_engine:
        return get_gpt_layer_with_transformer_engine_spec(config, qk_l2_norm=config.qk_l2_norm)
    return get_gpt_layer_local_spec(config, normalization=config.normalization,
                                    qk_l2_norm=config.qk_l2_norm)


def get_hybrid_stack_spec(config: TransformerConfig, stack_spec=None):
    """What a hybrid (Nemotron-H style) model provider passes to HybridModel as
    `hybrid_stack_spec`: Megatron's hybrid stack spec (or `stack_spec`, one with the same
    `submodules.moe_layer` field) whose MoE layer follows moe_expert_gemm_backend and
    moe_combine_in_fp32. Mamba, attention and MLP layers are unchanged.
    """
    torch_experts = _check_torch_experts(config, {})
    if stack_spec is None:
        stack_spec = _compat.megatron_hybrid_stack_spec()
    moe_layer = _follow_config(config, stack_spec.submodules.moe_layer, torch_experts)
    return dataclasses.replace(stack_spec,
                               submodules=dataclasses.replace(stack_spec.submodules,
                                                              moe_layer=moe_layer))
