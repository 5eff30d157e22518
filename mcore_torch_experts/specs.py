"""Reference layer specs: Megatron's own GPT specs with TorchGroupedMLP as the MoE experts when
`config.moe_expert_gemm_backend == "torch"`, and Megatron's choice otherwise.

The spec decides which module runs; TorchGroupedMLP never looks at global state.
"""

import dataclasses

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from . import _compat
from .config import validate_torch_experts_config
from .experts import TorchGroupedMLP


def torch_experts_spec() -> ModuleSpec:
    """The experts spec for MoESubmodules.experts, on every supported Megatron-Core release."""
    return ModuleSpec(module=TorchGroupedMLP)


def wants_torch_experts(config: TransformerConfig) -> bool:
    return getattr(config, "moe_expert_gemm_backend", "transformer_engine") == "torch"


def with_torch_experts(layer_spec: ModuleSpec) -> ModuleSpec:
    """A copy of a TransformerLayer spec whose MoE experts are TorchGroupedMLP (dense: unchanged)."""
    mlp = layer_spec.submodules.mlp
    if not _compat.is_moe_mlp_spec(mlp):
        return layer_spec
    moe = dataclasses.replace(_compat.moe_submodules(mlp), experts=torch_experts_spec())
    submodules = dataclasses.replace(layer_spec.submodules,
                                     mlp=_compat.with_moe_submodules(mlp, moe))
    return dataclasses.replace(layer_spec, submodules=submodules)


def _select(config: TransformerConfig, layer_spec: ModuleSpec) -> ModuleSpec:
    if not wants_torch_experts(config):
        return layer_spec
    validate_torch_experts_config(config)
    return with_torch_experts(layer_spec)


def get_gpt_layer_with_transformer_engine_spec(config: TransformerConfig, **kwargs) -> ModuleSpec:
    """Megatron's TE GPT layer spec for `config`; MoE experts follow moe_expert_gemm_backend."""
    builder = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec
    return _select(config, builder(**_compat.gpt_layer_spec_kwargs(builder, config, **kwargs)))


def get_gpt_layer_local_spec(config: TransformerConfig, **kwargs) -> ModuleSpec:
    """Megatron's local (no TE) GPT layer spec for `config`; MoE experts follow the backend flag."""
    builder = gpt_layer_specs.get_gpt_layer_local_spec
    return _select(config, builder(**_compat.gpt_layer_spec_kwargs(builder, config, **kwargs)))


def get_gpt_decoder_block_spec(config: TransformerConfig, use_transformer_engine: bool, **kwargs):
    """Megatron's decoder block spec (dense and MoE layers per moe_layer_freq), MoE experts
    following moe_expert_gemm_backend."""
    block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine, **kwargs)
    if not wants_torch_experts(config):
        return block
    validate_torch_experts_config(config)
    layers = [with_torch_experts(spec) for spec in block.layer_specs]
    return dataclasses.replace(block, layer_specs=layers)
