"""The `moe_expert_gemm_backend` flag and the checks that run when it says "torch"."""

from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

BACKENDS = ("transformer_engine", "torch")
MAX_LOCAL_EXPERTS = 1023  # grouped GEMM's CUTLASS path takes fewer than 1024 groups
ALIGN_ELEMENTS = 8  # 16-byte strides for bf16 operands


class TorchExpertsConfigError(ValueError):
    """A setting that TorchGroupedMLP cannot honour; the message names the field and the fix."""


def _refuse(field: str, value, fix: str) -> None:
    raise TorchExpertsConfigError(
        f"moe_expert_gemm_backend='torch' does not support {field}={value!r}: {fix}"
    )


def _check_supported_settings(config: TransformerConfig) -> None:
    if config.num_moe_experts is None:
        _refuse("num_moe_experts", None,
                "it builds MoE experts only; set num_moe_experts, or leave the backend at "
                "'transformer_engine' for dense models.")
    if not config.moe_grouped_gemm:
        _refuse("moe_grouped_gemm", False, "set moe_grouped_gemm=True.")
    if getattr(config, "moe_use_legacy_grouped_gemm", False):
        _refuse("moe_use_legacy_grouped_gemm", True,
                "set moe_use_legacy_grouped_gemm=False; TorchGroupedMLP replaces the grouped MLP.")
    if config.fp8 is not None:
        _refuse("fp8", config.fp8, "the frozen expert base runs in BF16; set fp8=None or use "
                "moe_expert_gemm_backend='transformer_engine'.")
    if getattr(config, "fp4", None) is not None:
        _refuse("fp4", config.fp4, "the frozen expert base runs in BF16; set fp4=None or use "
                "moe_expert_gemm_backend='transformer_engine'.")
    if config.fp16 or config.params_dtype == torch.float16:
        _refuse("fp16" if config.fp16 else "params_dtype", True if config.fp16 else torch.float16,
                "grouped GEMM's fast path is BF16; set bf16=True and params_dtype=torch.bfloat16.")
    if config.add_bias_linear:
        _refuse("add_bias_linear", True, "expert weights must be bias-free; set "
                "add_bias_linear=False or use moe_expert_gemm_backend='transformer_engine'.")
    if getattr(config, "delay_wgrad_compute", False):
        _refuse("delay_wgrad_compute", True, "frozen experts have no weight gradient to delay; "
                "set delay_wgrad_compute=False.")
    if getattr(config, "use_te_op_fuser", False):
        _refuse("use_te_op_fuser", True, "the TE operation fuser builds its own expert ops; set "
                "use_te_op_fuser=False.")
    offloaded = {"expert_fc1", "moe_act"} & set(getattr(config, "offload_modules", None) or [])
    if getattr(config, "fine_grained_activation_offloading", False) and offloaded:
        _refuse("offload_modules", sorted(offloaded),
                "expert activation offloading is not implemented for the torch backend; remove "
                "'expert_fc1' and 'moe_act' from offload_modules.")
    recompute_modules = getattr(config, "recompute_modules", None) or []
    if config.recompute_granularity == "selective" and "moe_act" in recompute_modules:
        _refuse("recompute_modules", list(recompute_modules),
                "selective 'moe_act' recompute is not implemented for the torch backend; use "
                "'moe' (whole MoE layer) or recompute_granularity='full'.")
    if config.moe_apply_probs_on_input and config.moe_router_topk != 1:
        _refuse("moe_apply_probs_on_input", True,
                f"it needs moe_router_topk=1 (got {config.moe_router_topk}).")


def _check_shapes(config: TransformerConfig, ep_size: int, etp_size: int) -> None:
    experts = config.num_moe_experts
    if experts % ep_size:
        _refuse("num_moe_experts", experts,
                f"it must be divisible by expert_model_parallel_size={ep_size}.")
    local = experts // ep_size
    if local > MAX_LOCAL_EXPERTS:
        _refuse("num_moe_experts", experts,
                f"{local} local experts per rank; grouped GEMM takes at most {MAX_LOCAL_EXPERTS}. "
                "Raise expert_model_parallel_size.")
    ffn = config.moe_ffn_hidden_size
    if ffn % etp_size:
        _refuse("moe_ffn_hidden_size", ffn,
                f"it must be divisible by expert_tensor_parallel_size={etp_size}.")
    local_ffn = ffn // etp_size
    if local_ffn % ALIGN_ELEMENTS:
        _refuse("moe_ffn_hidden_size", ffn,
                f"the per-rank width {ffn}/{etp_size}={local_ffn} must be a multiple of "
                f"{ALIGN_ELEMENTS} (grouped GEMM needs 16-byte strides).")
    in_field = "hidden_size" if config.moe_latent_size is None else "moe_latent_size"
    in_size = getattr(config, in_field)
    if in_size % ALIGN_ELEMENTS:
        _refuse(in_field, in_size,
                f"it must be a multiple of {ALIGN_ELEMENTS} (grouped GEMM needs 16-byte strides).")


def validate_torch_experts_config(config: TransformerConfig, ep_size: Optional[int] = None,
                                  etp_size: Optional[int] = None) -> None:
    """Refuse every setting the torch expert backend cannot honour, naming field, value and fix.

    `ep_size`/`etp_size` default to the config's parallel sizes; pass the process-group sizes
    when they are known (at module build time).
    """
    backend = getattr(config, "moe_expert_gemm_backend", "torch")
    if backend not in BACKENDS:
        raise TorchExpertsConfigError(
            f"moe_expert_gemm_backend={backend!r} is not a backend; choose one of {BACKENDS}."
        )
    _check_supported_settings(config)
    ep = ep_size if ep_size is not None else config.expert_model_parallel_size
    etp = etp_size if etp_size is not None else (config.expert_tensor_parallel_size or 1)
    _check_shapes(config, ep, etp)


@dataclass
class TorchExpertsTransformerConfig(TransformerConfig):
    """TransformerConfig with the expert GEMM backend switch and the FP32 combine settings."""

    moe_expert_gemm_backend: str = "transformer_engine"
    """"transformer_engine" (Megatron's own experts) or "torch" (TorchGroupedMLP)."""

    def __post_init__(self):
        super().__post_init__()
        if self.moe_expert_gemm_backend not in BACKENDS:
            raise TorchExpertsConfigError(
                f"moe_expert_gemm_backend={self.moe_expert_gemm_backend!r} is not a backend; "
                f"choose one of {BACKENDS}."
            )
        if self.moe_expert_gemm_backend == "torch":
            validate_torch_experts_config(self)
