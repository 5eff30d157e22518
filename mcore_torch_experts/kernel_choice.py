"""Which kernels TorchGroupedMLP runs: `moe_expert_kernel` resolved once at construction, and
the per-call conditions of the fused GEMM path.

"grouped_mm": four torch grouped GEMMs with the activation between them (one fused Triton
activation kernel on CUDA when it covers the config, `activation_impl`); "fused_gemm": Triton
grouped GEMMs with the activation in their epilogues (fused_experts_triton.py); "auto":
fused_gemm where it measured faster. The setting itself is checked by
`config.check_expert_kernel`.
"""

from typing import Optional, Sequence

import torch

from .config import check_expert_kernel, fused_gemm_unsupported

FUSED_GEMM_AUTO_CAPABILITIES = ((9, 0),)
"""GPUs where "auto" picks the fused GEMM kernels, for non-gated activations only: there they
measured faster than grouped_mm + the fused activation kernel on the H200; gated ones (SwiGLU)
measured slower at every tiling tried (BENCHMARKS.md)."""


def choose_expert_kernel(config) -> str:
    """Resolve `moe_expert_kernel` ("auto" when the config has no such field) to "fused_gemm"
    or "grouped_mm"; a setting that is not a choice, or a forced "fused_gemm" that cannot
    compute this config, is a TorchExpertsConfigError."""
    check_expert_kernel(config)
    setting = getattr(config, "moe_expert_kernel", "auto")
    if setting != "auto":
        return setting
    on_measured_gpu = (torch.cuda.is_available()
                       and torch.cuda.get_device_capability() in FUSED_GEMM_AUTO_CAPABILITIES)
    measured_faster = on_measured_gpu and not config.gated_linear_unit
    return ("fused_gemm" if measured_faster and fused_gemm_unsupported(config) is None
            else "grouped_mm")


def fused_activation_available(config) -> bool:
    """Whether the grouped_mm path runs activation x probs as one Triton kernel (on CUDA)."""
    try:
        from .activation_triton import covers
    except ImportError:  # no triton
        return False
    return covers(config)


def has_hooks(module: torch.nn.Module) -> bool:
    """Whether calling `module` runs hooks: its own forward or backward hooks, or global module
    hooks (`torch.nn.modules.module.register_module_*_hook`)."""
    hooks = torch.nn.modules.module
    return any((module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                module._backward_pre_hooks, hooks._global_forward_hooks,
                hooks._global_forward_pre_hooks, hooks._global_backward_hooks,
                hooks._global_backward_pre_hooks))


def fused_gemm_obstacle(linears: Sequence[torch.nn.Module], linear_type: type,
                        hidden: torch.Tensor) -> Optional[str]:
    """Why this call cannot take the fused GEMM path, which calls the packed weights directly
    (skipping `linears`' own calls), or None when it can: the linears must be plain
    `linear_type` without hooks, and the input on CUDA (or under triton's interpreter)."""
    if any(type(m) is not linear_type or has_hooks(m) for m in linears):
        return ("moe_expert_kernel='fused_gemm' runs the packed expert weights directly, but "
                "linear_fc1/linear_fc2 carry adapters or hooks that it would skip; set "
                "moe_expert_kernel='grouped_mm' or 'auto' for adapters or hooks on the experts.")
    from .fused_experts_triton import INTERPRETER

    if not hidden.is_cuda and not INTERPRETER:
        return (f"moe_expert_kernel='fused_gemm' runs Triton kernels on CUDA tensors; the "
                f"input is on {hidden.device}. Move the module to CUDA or set "
                "moe_expert_kernel='grouped_mm' or 'auto'.")
    return None
