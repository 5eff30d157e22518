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


def declares_fused_expert_kernels(module: torch.nn.Module) -> bool:
    """Whether `module`'s own class (a subclass does not inherit it) says the fused expert
    kernels compute its math: lora.py's LoRALinear, LoRAAdapter and PerExpertLoRAAdapter set
    `FUSED_EXPERT_KERNELS = True`, so the experts' core needs no import of the adapters."""
    return type(module).__dict__.get("FUSED_EXPERT_KERNELS", False) is True


def fused_adapter(linear: torch.nn.Module, linear_type: type):
    """(base, adapter) of an expert linear as the fused path sees it: a plain `linear_type` is
    (linear, None); our LoRALinear around one, (its base, its adapter). Anything else is
    (None, None)."""
    if type(linear) is linear_type:
        return linear, None
    if declares_fused_expert_kernels(linear) and type(linear.to_wrap) is linear_type:
        return linear.to_wrap, linear.adapter
    return None, None


def _adapter_obstacle(name: str, linear: torch.nn.Module, adapter: torch.nn.Module):
    """Why the fused kernels cannot compute `adapter` (of our LoRALinear `linear`), or None."""
    if not declares_fused_expert_kernels(adapter):
        return (f"{name}'s adapter is a {type(adapter).__name__}, not one of "
                "mcore_torch_experts.lora's LoRAAdapter/PerExpertLoRAAdapter")
    if getattr(adapter, "tp_mode", None) is not None:
        return f"{name}'s adapter maps its rank-r activation across tensor-parallel ranks"
    if not isinstance(adapter.dropout, torch.nn.Identity):
        return (f"{name}'s adapter has dropout {getattr(adapter.dropout, 'p', '?')} (the fused "
                "fc2 input gradient cannot mask the adapter's share); apply_lora(dropout=0.0) "
                "adapters are fused")
    hooked = [part for part, module in (("the LoRALinear", linear), ("its adapter", adapter),
                                        ("linear_in", adapter.linear_in),
                                        ("linear_out", adapter.linear_out))
              if has_hooks(module)]
    if hooked:
        return f"{name}: {' and '.join(hooked)} carry hooks that it would skip"
    return None


def fused_gemm_obstacle(linears: Sequence[torch.nn.Module], linear_type: type,
                        hidden: torch.Tensor) -> Optional[str]:
    """Why this call cannot take the fused GEMM path, which calls the packed weights directly
    (skipping `linears`' own calls), or None when it can: each linear must be a plain
    `linear_type` without hooks, or our LoRALinear around one with a LoRA adapter the kernels
    compute (lora.py's, no dropout, no tensor-parallel mapping, no hooks anywhere), and the
    input on CUDA (or under triton's interpreter)."""
    for name, linear in zip(("linear_fc1", "linear_fc2"), linears):
        base, adapter = fused_adapter(linear, linear_type)
        reason = None
        if base is None:
            reason = (f"{name} is a {type(linear).__name__}, an adapter wrapper or module it "
                      "cannot compute")
        elif has_hooks(base):
            reason = f"{name} carries hooks that it would skip"
        elif adapter is not None:
            reason = _adapter_obstacle(name, linear, adapter)
        if reason is not None:
            return ("moe_expert_kernel='fused_gemm' runs the packed expert weights directly, but "
                    f"linear_fc1/linear_fc2 carry adapters or hooks that it would skip ({reason});"
                    " set moe_expert_kernel='grouped_mm' or 'auto' for such adapters or hooks on "
                    "the experts.")
    from .fused_experts_triton import INTERPRETER

    if not hidden.is_cuda and not INTERPRETER:
        return (f"moe_expert_kernel='fused_gemm' runs Triton kernels on CUDA tensors; the "
                f"input is on {hidden.device}. Move the module to CUDA or set "
                "moe_expert_kernel='grouped_mm' or 'auto'.")
    return None
