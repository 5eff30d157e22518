"""Every choice this package offers, in one file: the values of its config fields
(`moe_expert_gemm_backend`, `moe_expert_kernel`, `moe_combine_backend`), the activation paths
the kernel choice resolves to and the names of the fused path's profiler ranges. The modules that
act on them re-export theirs."""

import enum


class ExpertGemmBackend(enum.StrEnum):
    """`moe_expert_gemm_backend`: whose experts a MoE layer builds."""

    TRANSFORMER_ENGINE = "transformer_engine"  # Megatron's own (TEGroupedMLP with TE)
    TORCH = "torch"  # TorchGroupedMLP


class ExpertKernel(enum.StrEnum):
    """`moe_expert_kernel`: what TorchGroupedMLP's experts run."""

    AUTO = "auto"
    FUSED_GEMM = "fused_gemm"
    GROUPED_MM = "grouped_mm"


class ActivationImpl(enum.StrEnum):
    """How the grouped_mm path applies activation x probs."""

    FUSED = "fused"  # one Triton kernel, on CUDA tensors
    EAGER = "eager"  # torch ops (the CPU; CUDA where triton is missing or the kernel does not cover)


class CombineBackend(enum.StrEnum):
    """`backend` of fp32_combine (`moe_combine_backend`); None picks one."""

    TORCH = "torch"
    TRITON = "triton"


class ProfileRange(enum.StrEnum):
    """The torch profiler ranges the fused GEMM path opens while a profiler runs (its expert
    linears and adapters are not called as modules there, so module hooks cannot name their
    work); a backward opens the same range around the same work."""

    EXPERT_GEMMS = "mcore_torch_experts::expert_gemms"  # the expert GEMM kernels, epilogues in
    EXPERT_ADAPTERS = "mcore_torch_experts::expert_adapters"  # the adapters' rank-r GEMMs
