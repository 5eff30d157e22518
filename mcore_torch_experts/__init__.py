"""Frozen grouped-GEMM experts for adapter training on Megatron-Core MoE models."""

from .config import (
    TorchExpertsConfigError,
    TorchExpertsTransformerConfig,
    validate_torch_experts_config,
)
from .experts import TorchGroupedLinear, TorchGroupedMLP
from .grouped_gemm import find_grouped_mm, frozen_grouped_linear, group_offsets

__all__ = [
    "TorchExpertsConfigError",
    "TorchExpertsTransformerConfig",
    "TorchGroupedLinear",
    "TorchGroupedMLP",
    "find_grouped_mm",
    "frozen_grouped_linear",
    "group_offsets",
    "validate_torch_experts_config",
]
