"""The hybrid (Mamba / attention / MLP / MoE) stack spec whose MoE experts follow
`moe_expert_gemm_backend`, for HybridModel providers (Nemotron-H style models: Nemotron-3 Nano and
Super).

Copy this file next to your model provider (or import it from here). The name is the package's own
function; see specs/README.md and docs/enable.md.
"""

from mcore_torch_experts.specs import (
    fp32_combine_hybrid_stack_spec,
    get_hybrid_stack_spec,
    torch_experts_fp32_combine_hybrid_stack_spec,
    torch_experts_hybrid_stack_spec,
)

__all__ = ["fp32_combine_hybrid_stack_spec", "get_hybrid_stack_spec",
           "torch_experts_fp32_combine_hybrid_stack_spec", "torch_experts_hybrid_stack_spec"]
