"""GPT MoE layer specs whose MoE experts follow `moe_expert_gemm_backend`, for model providers.

Copy this file next to your model provider (or import it from here). Every name is the package's
own function, so the specs stay the tested ones; the file only gathers them where a provider
author looks. See specs/README.md for which one each framework calls, and docs/enable.md.
"""

from mcore_torch_experts.specs import (
    fp32_combine_gpt_spec,
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    gpt_transformer_layer_spec,
    torch_experts_fp32_combine_gpt_spec,
    torch_experts_gpt_spec,
    with_torch_experts,
)

__all__ = [
    "fp32_combine_gpt_spec",
    "get_gpt_decoder_block_spec",
    "get_gpt_layer_local_spec",
    "get_gpt_layer_with_transformer_engine_spec",
    "gpt_transformer_layer_spec",
    "torch_experts_fp32_combine_gpt_spec",
    "torch_experts_gpt_spec",
    "with_torch_experts",
]
