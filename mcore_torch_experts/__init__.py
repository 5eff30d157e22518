"""Frozen grouped-GEMM experts for adapter training on Megatron-Core MoE models."""

from .combine import CHUNK_ROWS_ENV, DEFAULT_CHUNK_ROWS, chunk_rows_from_env, fp32_combine
from .config import (
    TorchExpertsConfigError,
    TorchExpertsTransformerConfig,
    validate_fp32_combine_config,
    validate_torch_experts_config,
)
from .convert import ConversionSummary, convert_experts_to_torch
from .experts import TorchGroupedLinear, TorchGroupedMLP
from .grouped_gemm import find_grouped_mm, frozen_grouped_linear, group_offsets
from .moe_layer import FP32CombineMoELayer

__all__ = [
    "CHUNK_ROWS_ENV",
    "ConversionSummary",
    "DEFAULT_CHUNK_ROWS",
    "FP32CombineMoELayer",
    "TorchExpertsConfigError",
    "TorchExpertsTransformerConfig",
    "TorchGroupedLinear",
    "TorchGroupedMLP",
    "chunk_rows_from_env",
    "convert_experts_to_torch",
    "find_grouped_mm",
    "fp32_combine",
    "frozen_grouped_linear",
    "group_offsets",
    "validate_fp32_combine_config",
    "validate_torch_experts_config",
]
