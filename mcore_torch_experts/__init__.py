"""Frozen grouped-GEMM experts for adapter training on Megatron-Core MoE models."""

__version__ = "0.1.0"  # the distribution's version too (setup.cfg reads it)

from .combine import CHUNK_ROWS_ENV, DEFAULT_CHUNK_ROWS, chunk_rows_from_env, fp32_combine
from .config import (
    TorchExpertsConfigError,
    TorchExpertsTransformerConfig,
    validate_fp32_combine_config,
    validate_torch_experts_config,
)
from .experts import TorchGroupedLinear, TorchGroupedMLP
from .integrations.bridge import check_bridge_peft, merge_bridge_lora, register_with_megatron_bridge
from .kernels.grouped_gemm import find_grouped_mm, frozen_grouped_linear, group_offsets
from .lora import (
    LoRALinear,
    apply_lora,
    load_lora_state_dict,
    lora_parameters,
    lora_sharded_state_dict,
    lora_state_dict,
)
from .megatron.convert import ConversionSummary, convert_experts_to_torch
from .megatron.model import build_gpt_model, build_moe_layer
from .megatron.moe_layer import FP32CombineMoELayer, convert_moe_layers_to_fp32_combine
from .megatron.recompute import install_frozen_input_guard

__all__ = [
    "CHUNK_ROWS_ENV",
    "ConversionSummary",
    "DEFAULT_CHUNK_ROWS",
    "FP32CombineMoELayer",
    "LoRALinear",
    "TorchExpertsConfigError",
    "TorchExpertsTransformerConfig",
    "TorchGroupedLinear",
    "TorchGroupedMLP",
    "apply_lora",
    "build_gpt_model",
    "build_moe_layer",
    "check_bridge_peft",
    "chunk_rows_from_env",
    "convert_experts_to_torch",
    "convert_moe_layers_to_fp32_combine",
    "find_grouped_mm",
    "fp32_combine",
    "frozen_grouped_linear",
    "group_offsets",
    "install_frozen_input_guard",
    "load_lora_state_dict",
    "lora_parameters",
    "lora_sharded_state_dict",
    "lora_state_dict",
    "merge_bridge_lora",
    "register_with_megatron_bridge",
    "validate_fp32_combine_config",
    "validate_torch_experts_config",
]
