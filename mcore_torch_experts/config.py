"""The `moe_expert_gemm_backend` flag and the checks that run when it says "torch"."""

import dataclasses
import re
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from . import _compat
from .combine import option_problem
from .enums import ExpertGemmBackend
from .errors import TorchExpertsConfigError
from .kernels.choice import check_expert_kernel
from .settings import ExpertSettings, check_backend

MAX_LOCAL_EXPERTS = 1023  # grouped GEMM's CUTLASS path takes fewer than 1024 groups
ALIGN_ELEMENTS = 8  # 16-byte strides for bf16 operands


def _refuse(field: str, value, fix: str, setting: str = "moe_expert_gemm_backend='torch'") -> None:
    raise TorchExpertsConfigError(f"{setting} does not support {field}={value!r}: {fix}")


_TE_OP_FUSER_FIX = "the TE operation fuser builds its own expert ops; set {field}=False."

# Refused whenever set (truthy), as a config field or a spec-builder argument: {field: fix}.
# A field the installed Megatron-Core lacks reads as unset.
REFUSED_WHEN_SET = {
    "fp8": "the frozen expert base runs in BF16; set fp8=None, or keep "
           "moe_expert_gemm_backend='transformer_engine' for FP8 experts.",
    "fp4": "the frozen expert base runs in BF16; set fp4=None, or keep "
           "moe_expert_gemm_backend='transformer_engine' for FP4 experts.",
    "fp16": "grouped GEMM's fast path is BF16; set fp16=False, bf16=True and "
            "params_dtype=torch.bfloat16.",
    "add_bias_linear": "expert weights must be bias-free; set add_bias_linear=False, or keep "
                       "moe_expert_gemm_backend='transformer_engine'.",
    "delay_wgrad_compute": "frozen experts have no weight gradient to delay; set "
                           "delay_wgrad_compute=False.",
    "moe_use_legacy_grouped_gemm": "TorchGroupedMLP replaces the legacy GroupedMLP; set "
                                   "moe_use_legacy_grouped_gemm=False.",  # 0.16 only
    "use_transformer_engine_op_fuser":  # config field, 0.18+
        _TE_OP_FUSER_FIX.format(field="use_transformer_engine_op_fuser"),
    "use_te_op_fuser": _TE_OP_FUSER_FIX.format(field="use_te_op_fuser"),  # spec-builder argument
    "moe_mlp_glu_interleave_size": "TorchGroupedMLP lays fc1 out as [gate; up] halves; set "
                                   "moe_mlp_glu_interleave_size=None.",  # 0.18+
    "moe_single_grouped_weight": "TorchGroupedMLP keeps one Parameter per expert "
                                 "(linear_fc*.weightN); set moe_single_grouped_weight=False.",  # 0.18+
    "moe_paged_stash": "TorchGroupedMLP saves what its backward needs itself and keeps no "
                       "paged stash; set moe_paged_stash=False.",  # 0.18+
    **{field: f"routing-map padding rounds expert segments up for FP8/FP4 experts; the torch "
              f"backend runs BF16 segments of any length. Set {field}=False."
       for field in ("moe_router_padding_for_quantization", "moe_router_padding_for_fp8")},
}
# Fusions on the MoE path and what the torch backend does with them: moe_permute_fusion (TE's
# permute / unpermute / chunk sort in the dispatchers; FP32CombineMoELayer rebuilds the token ids
# from the routing map) and moe_router_fusion (TE's top-k, scores, aux loss) hand the experts the
# same rows and work; use_fused_weighted_squared_relu and bias_activation_fusion (Megatron's fused
# activation x probs in TEGroupedMLP) compute what TorchGroupedMLP computes anyway, and so does
# use_te_activation_func for plain SwiGLU only (_refuse_te_activation_mismatch); the TE op fuser,
# routing-map padding (FP8/FP4 only) and the paged stash (HybridEP / NCCL-EP) are refused above,
# the flex dispatcher's fixed-size modes in _refuse_fixed_size_flex_dispatch.
# A fused expert-LoRA switch (none in Megatron-Core 0.16 to 0.20): a field naming LoRA and experts.
FUSED_EXPERT_LORA_FIELD = re.compile(r"lora.*(expert|moe)|(expert|moe).*lora")
OFFLOADED_EXPERT_MODULES = {"expert_fc1", "moe_act", "fused_group_mlp"}  # fused_group_mlp: 0.19+


def refuse_unsupported_flags(settings: Mapping[str, object]) -> None:
    """Refuse every REFUSED_WHEN_SET entry and fused expert-LoRA switch that is set in `settings`
    (a config's fields, or a spec builder's keyword arguments), the flex dispatcher's fixed-size
    modes and expert activation offloading. Runs before Megatron's own checks of the same fields,
    whose messages ask for the TE op fuser."""
    for field, fix in REFUSED_WHEN_SET.items():
        if settings.get(field):
            _refuse(field, settings[field], fix)
    for field, value in settings.items():
        if value and FUSED_EXPERT_LORA_FIELD.search(field):
            _refuse(field, value, f"the fused expert-LoRA path runs its own expert GEMMs; set "
                    f"{field} off. Adapters wrap TorchGroupedMLP's linear_fc1/linear_fc2 instead.")
    _refuse_fixed_size_flex_dispatch(settings)
    offloaded = OFFLOADED_EXPERT_MODULES & set(settings.get("offload_modules") or [])
    if settings.get("fine_grained_activation_offloading") and offloaded:
        _refuse("offload_modules", sorted(offloaded),
                "expert activation offloading is not implemented for the torch backend; remove "
                + " and ".join(repr(module) for module in sorted(offloaded))
                + " from offload_modules.")


def refuse_spec_arguments(spec_kwargs: Mapping[str, object]) -> None:
    """Refuse a spec builder's argument that asks for another experts module than the one the
    torch backend puts in (`moe_grouped_gemm=False`: SequentialMLP), as the config field is."""
    if "moe_grouped_gemm" in spec_kwargs and not spec_kwargs["moe_grouped_gemm"]:
        _refuse("moe_grouped_gemm", spec_kwargs["moe_grouped_gemm"],
                "TorchGroupedMLP is a grouped experts module; pass moe_grouped_gemm=True or leave "
                "the argument out.")


def _refuse_fixed_size_flex_dispatch(settings: Mapping[str, object]) -> None:
    """Megatron-Core 0.19/0.20's flex dispatcher modes that hand the experts a fixed-size buffer, with
    rows past sum(tokens_per_expert), or NCCL-EP's symmetric-memory output buffers: Megatron feeds
    them to TE's op fuser only (docs/scale_out.md)."""
    backend = settings.get("moe_flex_dispatcher_backend")
    if backend == "hybridep" and settings.get("moe_expert_rank_capacity_factor") is not None:
        _refuse("moe_expert_rank_capacity_factor", settings["moe_expert_rank_capacity_factor"],
                "HybridEP's static per-rank budget hands the experts a fixed-size buffer with rows "
                "past sum(tokens_per_expert), which only TE's op fuser reads; set "
                "moe_expert_rank_capacity_factor=None (HybridEP then sizes each step's buffers).")
    if backend != "ncclep":
        return
    dynamic = _compat.ncclep_dynamic_shape_setting()
    if settings.get("moe_ncclep_zero_copy"):
        _refuse("moe_ncclep_zero_copy", True,
                "NCCL-EP zero copy has the experts write into its symmetric-memory buffers "
                "(output_buffer, grad_input_buffer), which only TE's op fuser fills; set "
                f"moe_ncclep_zero_copy=False and {dynamic}.")
    static = _compat.ncclep_static_shape(settings)
    if static is not None:
        _refuse(*static,
                "NCCL-EP's static shape hands the experts the whole receive buffer, rows past "
                f"sum(tokens_per_expert) included, which only TE's op fuser reads; set {dynamic} "
                "(the experts then get the received rows only).")


def _refuse_te_activation_mismatch(config: TransformerConfig) -> None:
    """use_te_activation_func: Megatron's experts run Transformer Engine's activation op, which
    is the function TorchGroupedMLP computes (activation_func) for plain SwiGLU only: Megatron
    maps silu without gating to TE's ReLU, TE's GELU ops use the tanh form, and Megatron builds
    TE's SwiGLU without glu_linear_offset or activation_func_clamp_value."""
    if not getattr(config, "use_te_activation_func", False):
        return
    if config.gated_linear_unit and config.activation_func == torch.nn.functional.silu:
        ignored = [f"{field}={getattr(config, field)!r}" for field, unset
                   in (("glu_linear_offset", 0.0), ("activation_func_clamp_value", None))
                   if getattr(config, field, unset) != unset]
        if ignored:
            _refuse("use_te_activation_func", True,
                    f"with {' and '.join(ignored)}, Transformer Engine's SwiGLU op, which Megatron "
                    "builds without an offset or a clamp, is not the function TorchGroupedMLP "
                    "computes; set use_te_activation_func=False (Megatron's experts then apply "
                    "them too).")
        return
    activation = getattr(config.activation_func, "__name__", config.activation_func)
    _refuse("use_te_activation_func", True,
            f"with activation_func={activation} and gated_linear_unit={config.gated_linear_unit}, "
            "Transformer Engine's activation op is not the function TorchGroupedMLP computes "
            "(only SwiGLU is the same); set use_te_activation_func=False.")


TRANSFORMER_IMPLS = ("transformer_engine", "local")


def refuse_transformer_impl(config: TransformerConfig, setting: str) -> None:
    """Refuse a `transformer_impl` outside TRANSFORMER_IMPLS ("inference_optimized") for
    `setting`, the feature that asked (the torch backend, the FP32 combine, a launcher spec)."""
    if config.transformer_impl not in TRANSFORMER_IMPLS:
        _refuse("transformer_impl", config.transformer_impl,
                "Megatron's inference-optimized layers serve neither TorchGroupedMLP nor the FP32 "
                "combine (from megatron-core 0.17 their MoE layers call the experts with a routing "
                "map and swap in their own token dispatcher); set "
                "transformer_impl='transformer_engine' or 'local'.",
                setting)


# batch_invariant_mode=True (Megatron's batch-invariant kernels; the field exists from 0.16, MoE
# under it from 0.20): Megatron-Core 0.20's own requirements for an MoE model in the mode
# (transformer_config.py), each as (field, whether a value meets it, the fix). Its DeepGEMM
# requirement is not among them: DeepGEMM serves TE's grouped GEMM, which TorchGroupedMLP never
# calls (its grouped GEMMs and kernels measured batch-invariant: docs/guarantees.md).
BATCH_INVARIANT_MIN_RELEASE = (0, 20)
BATCH_INVARIANT_REQUIREMENTS = (
    ("params_dtype", lambda v: v == torch.bfloat16,
     "the mode runs BF16 parameters only; set bf16=True and params_dtype=torch.bfloat16."),
    ("attention_backend", lambda v: getattr(v, "name", v) == "flash",
     "the mode runs FlashAttention only; set attention_backend=AttnBackend.flash."),
    ("flash_attention_version", lambda v: v in (3, 4),
     "training and rollouts must run the same batch-invariant FlashAttention kernel; set "
     "flash_attention_version=3 or 4."),
    ("context_parallel_size", lambda v: v == 1,
     "context parallelism runs TE's FlashAttention 2 kernels; set context_parallel_size=1."),
    ("attention_dropout", lambda v: v == 0.0,
     "dropout is not batch-invariant; set attention_dropout=0.0."),
    ("moe_token_dispatcher_type", lambda v: v == "alltoall",
     "Megatron's batch-invariant MoE runs the alltoall dispatcher; set "
     "moe_token_dispatcher_type='alltoall'."),
    ("moe_permute_fusion", lambda v: not v,
     "the unfused unpermute adds each token's rows in a fixed order; set moe_permute_fusion=False."),
    ("moe_permute_fusion_into_hybridep", lambda v: not v,
     "the unfused unpermute adds each token's rows in a fixed order; set "
     "moe_permute_fusion_into_hybridep=False."),
    ("moe_router_dtype", lambda v: v != "fp64",
     "Megatron's batch-invariant matmul has no FP64 kernel (the router's FP64 gating matmul "
     "fails inside it with KeyError: torch.float64); set moe_router_dtype='fp32' (NeMo-RL's "
     "Megatron recipes set 'fp64')."),
    ("moe_pad_expert_input_to_capacity", lambda v: not v,
     "the mode runs dropless routing only; set moe_pad_expert_input_to_capacity=False."),
    ("moe_pad_experts_for_cuda_graph_inference", lambda v: not v,
     "the mode runs dropless routing only; set moe_pad_experts_for_cuda_graph_inference=False."),
)


def check_batch_invariant_mode(config: TransformerConfig,
                               settings: Optional[ExpertSettings] = None) -> None:
    """With batch_invariant_mode=True and TorchGroupedMLP experts: Megatron-Core 0.20 or newer
    (the first with a batch-invariant MoE unpermute and router) and its requirements for the
    mode (BATCH_INVARIANT_REQUIREMENTS); a field this Megatron-Core lacks reads as unset. The FP32
    combine's part is validate_fp32_combine_config's. `settings`: the config's, where read."""
    _check_batch_invariant(config, settings or ExpertSettings.read(config))


def _check_batch_invariant(config: TransformerConfig, settings: ExpertSettings) -> None:
    if not settings.batch_invariant:
        return
    release = _compat.megatron_core_release()
    if release < BATCH_INVARIANT_MIN_RELEASE:
        _refuse("batch_invariant_mode", True,
                f"batch-invariant MoE needs megatron-core >= 0.20 (its fixed-order unpermute and "
                f"router); this is {'.'.join(map(str, release))}. Upgrade megatron-core or set "
                "batch_invariant_mode=False.")
    for field, meets, fix in BATCH_INVARIANT_REQUIREMENTS:
        if hasattr(config, field) and not meets(getattr(config, field)):
            _refuse(field, getattr(config, field), fix, "batch_invariant_mode=True")


def _refuse_outright(config: TransformerConfig, settings: ExpertSettings) -> None:
    """The torch backend's refusals that go before Megatron's own checks of the same settings
    (fp8 without Transformer Engine, inference-optimized layers, say), whose messages do not
    name the fix."""
    refuse_transformer_impl(config, "moe_expert_gemm_backend='torch'")
    refuse_unsupported_flags(vars(config))
    _check_batch_invariant(config, settings)


def _check_torch_experts(config: TransformerConfig, ep_size: Optional[int] = None,
                         etp_size: Optional[int] = None) -> None:
    """The rest of validate_torch_experts_config: what the torch backend needs of the model."""
    if config.num_moe_experts is None:
        _refuse("num_moe_experts", None,
                "it builds MoE experts only; set num_moe_experts, or leave the backend at "
                "'transformer_engine' for dense models.")
    if not config.moe_grouped_gemm:
        _refuse("moe_grouped_gemm", False, "set moe_grouped_gemm=True.")
    _refuse_te_activation_mismatch(config)
    dtype = config.params_dtype
    if dtype == torch.float16 or (dtype != torch.bfloat16 and not config.use_cpu_initialization):
        _refuse("params_dtype", dtype,
                "grouped GEMM runs BF16 expert weights on CUDA; set bf16=True and "
                "params_dtype=torch.bfloat16 (float32 works only for CPU runs with "
                "use_cpu_initialization=True: Megatron-LM's --use-cpu-initialization, a "
                "Bridge provider's provide_distributed_model(use_cpu_initialization=True), "
                "Bridge's load_megatron_model(path, use_cpu_init=True)).")
    recompute_modules = getattr(config, "recompute_modules", None) or []
    if config.recompute_granularity == "selective" and "moe_act" in recompute_modules:
        _refuse("recompute_modules", list(recompute_modules),
                "selective 'moe_act' recompute is not implemented for the torch backend; use "
                "'moe' (whole MoE layer) or recompute_granularity='full'.")
    if config.moe_apply_probs_on_input and config.moe_router_topk != 1:
        _refuse("moe_apply_probs_on_input", True,
                f"it needs moe_router_topk=1 (got {config.moe_router_topk}); set "
                "moe_router_topk=1 or moe_apply_probs_on_input=False.")
    ep = ep_size if ep_size is not None else config.expert_model_parallel_size
    etp = etp_size if etp_size is not None else (config.expert_tensor_parallel_size or 1)
    _check_shapes(config, ep, etp)


def _check_shapes(config: TransformerConfig, ep_size: int, etp_size: int) -> None:
    experts = config.num_moe_experts
    if experts % ep_size:
        _refuse("num_moe_experts", experts,
                f"it must be divisible by expert_model_parallel_size={ep_size}. Choose an "
                "expert_model_parallel_size that divides it.")
    local = experts // ep_size
    if local > MAX_LOCAL_EXPERTS:
        _refuse("num_moe_experts", experts,
                f"{local} local experts per rank; grouped GEMM takes at most {MAX_LOCAL_EXPERTS}. "
                "Raise expert_model_parallel_size.")
    ffn = config.moe_ffn_hidden_size
    if ffn % etp_size:
        _refuse("moe_ffn_hidden_size", ffn,
                f"it must be divisible by expert_tensor_parallel_size={etp_size}. Choose an "
                "expert_tensor_parallel_size that divides it.")
    local_ffn = ffn // etp_size
    if local_ffn % ALIGN_ELEMENTS:
        _refuse("moe_ffn_hidden_size", ffn,
                f"the per-rank width {ffn}/{etp_size}={local_ffn} must be a multiple of "
                f"{ALIGN_ELEMENTS} (grouped GEMM needs 16-byte strides); "
                + _aligned_ffn_fix(ffn, etp_size))
    in_field = "hidden_size" if config.moe_latent_size is None else "moe_latent_size"
    in_size = getattr(config, in_field)
    if in_size % ALIGN_ELEMENTS:
        _refuse(in_field, in_size,
                f"it must be a multiple of {ALIGN_ELEMENTS} (grouped GEMM needs 16-byte strides); "
                "keep moe_expert_gemm_backend='transformer_engine' for this model.")


def _aligned_ffn_fix(ffn: int, etp_size: int) -> str:
    """The fix for a per-rank FFN width that is not a multiple of ALIGN_ELEMENTS: the largest
    smaller expert_tensor_parallel_size that gives an aligned width and divides the current one
    (so the same ranks still form expert-TP groups), when there is one."""
    usable = [etp for etp in range(etp_size - 1, 0, -1)
              if etp_size % etp == 0 and ffn % etp == 0 and (ffn // etp) % ALIGN_ELEMENTS == 0]
    if usable:
        return (f"set expert_tensor_parallel_size={usable[0]} (per-rank width "
                f"{ffn // usable[0]}).")
    return (f"{ffn} is not a multiple of {ALIGN_ELEMENTS}, so no expert_tensor_parallel_size "
            f"gives one. Choose a moe_ffn_hidden_size that is a multiple of "
            f"{ALIGN_ELEMENTS * etp_size}, or keep moe_expert_gemm_backend='transformer_engine' "
            "for this model.")


def validate_torch_experts_config(config: TransformerConfig, ep_size: Optional[int] = None,
                                  etp_size: Optional[int] = None,
                                  settings: Optional[ExpertSettings] = None) -> None:
    """Refuse every setting the torch expert backend cannot honour with a TorchExpertsConfigError
    naming the field, its value and the fix.

    Runs when a TorchExpertsTransformerConfig says "torch", when the reference specs pick
    TorchGroupedMLP, when TorchGroupedMLP is built and before a model is converted. `ep_size` /
    `etp_size` default to the config's parallel sizes; pass the process-group sizes when known.
    A config without the `moe_expert_gemm_backend` field counts as asking for "torch".
    `settings`: the config's (`ExpertSettings.read`, which checks the fields' values), where read.
    """
    _refuse_outright(config, settings or ExpertSettings.read(config))
    _check_torch_experts(config, ep_size, etp_size)


COMBINE_DISPATCHERS = ("allgather", "alltoall")


def validate_fp32_combine_config(config: TransformerConfig,
                                 setting: str = "moe_combine_in_fp32=True",
                                 settings: Optional[ExpertSettings] = None) -> None:
    """Refuse settings under which the FP32 top-k combine cannot run as asked; `setting` is
    what asked for it (a launcher entry point names itself); `settings`: the config's, where
    read."""
    refuse_transformer_impl(config, setting)
    _check_fp32_combine(config, setting, settings or ExpertSettings.read(config))


def _check_fp32_combine(config: TransformerConfig, setting: str,
                        settings: ExpertSettings) -> None:
    """validate_fp32_combine_config but its transformer_impl check."""

    def refuse(field, value, fix):
        _refuse(field, value, fix, setting)

    if config.num_moe_experts is None:
        refuse("num_moe_experts", None, "it combines MoE expert outputs; set moe_combine_in_fp32=False.")
    if config.moe_token_dispatcher_type not in COMBINE_DISPATCHERS:
        refuse("moe_token_dispatcher_type", config.moe_token_dispatcher_type,
               f"use one of {COMBINE_DISPATCHERS}.")
    backend = settings.combine_backend
    if settings.batch_invariant and backend != "triton":
        refuse("moe_combine_backend", backend, "under batch_invariant_mode=True the combine must "
               "be the Triton kernel, which adds each token's rows in one fixed order, by "
               "expert (the torch backend's scatter-add is not even run-to-run deterministic on CUDA); set "
               "moe_combine_backend='triton'.")
    if config.moe_pad_expert_input_to_capacity:
        refuse("moe_pad_expert_input_to_capacity", True, "padded (drop-and-pad) combines are not "
               "supported; set moe_pad_expert_input_to_capacity=False.")
    problem = option_problem(settings.combine_chunk_rows, settings.combine_backend)
    if problem is not None:
        option, value, requirement = problem
        refuse(f"moe_combine_{option}", value, f"it must be {requirement}.")



@dataclass(frozen=True)
class SpecChoice:
    """What a spec builder does for one config, decided once (`spec_choice`) with every refusal
    before any spec is built: TorchGroupedMLP experts or Megatron's, and the FP32 combine
    (`fp32_combine`: the setting that asked for it, None for Megatron's combine)."""

    torch_experts: bool
    fp32_combine: Optional[str]


def spec_choice(config: TransformerConfig, spec_kwargs: Optional[Mapping[str, object]] = None, *,
                experts_absent: str = "transformer_engine", entry_point: Optional[str] = None,
                entry_point_combines: bool = False) -> SpecChoice:
    """The one check of a spec route. `config.moe_expert_gemm_backend` (`experts_absent` where the
    config has no such field or attribute) picks the experts; with "torch" the config and the
    spec builder's arguments `spec_kwargs` are validated (e.g. use_te_op_fuser=True is refused).
    A launcher `entry_point` (named by import path) first refuses this package's settings held
    as plain attributes and transformer_impl="inference_optimized"; `entry_point_combines`: it
    asks for the FP32 combine itself. Otherwise `moe_combine_in_fp32` asks for it."""
    settings = ExpertSettings.read(config)
    backend = settings.gemm_backend or experts_absent
    check_backend(backend)
    if entry_point is not None:
        refuse_unrecorded_settings(config, entry_point)
        refuse_transformer_impl(config, entry_point)
    torch_experts = backend == ExpertGemmBackend.TORCH
    if entry_point_combines:
        combine = entry_point
    else:
        combine = "moe_combine_in_fp32=True" if settings.combine_in_fp32 else None
    if entry_point is None and (torch_experts or combine is not None):
        refuse_transformer_impl(config, "moe_expert_gemm_backend='torch'" if torch_experts
                                else combine)
    if torch_experts:
        _check_batch_invariant(config, settings)
        _check_torch_experts(config)
    if combine is not None:
        _check_fp32_combine(config, combine, settings)
    if torch_experts:  # the flags last, the spec builder's arguments' and the config's
        refuse_spec_arguments(spec_kwargs or {})
        refuse_unsupported_flags(spec_kwargs or {})
        refuse_unsupported_flags(vars(config))
    return SpecChoice(torch_experts, combine)


@dataclass
class TorchExpertsTransformerConfig(TransformerConfig):
    """TransformerConfig with the expert GEMM backend switch and the FP32 combine settings."""

    moe_expert_gemm_backend: str = "transformer_engine"
    """"transformer_engine" (Megatron's own experts) or "torch" (TorchGroupedMLP)."""

    moe_expert_kernel: str = "auto"
    """TorchGroupedMLP's kernels: "grouped_mm" (four grouped_mm GEMMs, the activation between),
    "fused_gemm" (Triton grouped GEMMs with the activation, probs and this package's LoRA adapters
    in their epilogues; an error where it cannot run) or "auto" (fused_gemm on GPUs where it
    measured faster, for non-gated activations; a call it cannot compute takes grouped_mm). The
    values: `mcore_torch_experts.enums.ExpertKernel`."""

    moe_combine_in_fp32: bool = False
    """Sum each token's top-k expert outputs in FP32 with bounded memory (FP32CombineMoELayer in
    the reference specs). Off: Megatron's combine, unchanged."""

    moe_combine_chunk_rows: Optional[int] = None
    """Rows per chunk of the torch FP32 combine (0 = single shot); None reads
    MCORE_TORCH_EXPERTS_COMBINE_CHUNK_ROWS, unset means 4096."""

    moe_combine_backend: Optional[str] = None
    """"torch" (chunked scatter-add), "triton" (fused, deterministic; CUDA) or None (triton on
    CUDA when importable, else torch)."""

    def __post_init__(self):
        # The settings refused outright go first: Megatron's own checks of them (fp8 without
        # Transformer Engine, inference-optimized layers, say) would fail with a message that
        # does not name the fix.
        settings = ExpertSettings.read(self)  # checks the backend and kernel values
        torch_experts = settings.gemm_backend == ExpertGemmBackend.TORCH
        if torch_experts:
            _refuse_outright(self, settings)
        if settings.combine_in_fp32:  # it reads no field that Megatron's checks derive
            if not torch_experts:
                refuse_transformer_impl(self, "moe_combine_in_fp32=True")
            _check_fp32_combine(self, "moe_combine_in_fp32=True", settings)
        # Megatron's checks of batch_invariant_mode for an MoE model are ours above but its
        # DeepGEMM requirement (TE's grouped GEMM, which TorchGroupedMLP never calls): its
        # __post_init__ runs with the mode off, which it reads for nothing else (0.20).
        invariant = torch_experts and settings.batch_invariant
        if invariant:
            self.batch_invariant_mode = False
        try:
            super().__post_init__()
        finally:
            if invariant:
                self.batch_invariant_mode = True
        if torch_experts:
            _check_torch_experts(self)
        check_expert_kernel(self, settings.expert_kernel)


PACKAGE_FIELDS = tuple(name for name in TorchExpertsTransformerConfig.__dataclass_fields__
                       if name not in TransformerConfig.__dataclass_fields__)
"""The fields TorchExpertsTransformerConfig adds to TransformerConfig."""

_COMBINE_ENTRY_POINTS = ("torch_experts_fp32_combine_gpt_spec (TorchGroupedMLP experts) or "
                         "fp32_combine_gpt_spec (Megatron's experts), or their "
                         "*_hybrid_stack_spec namesakes")
_UNRECORDED_FIXES = {
    "moe_expert_gemm_backend": "name the entry point that means the experts instead: "
                               "torch_experts_gpt_spec (TorchGroupedMLP), fp32_combine_gpt_spec "
                               "(Megatron's experts with the FP32 combine) or Megatron's own "
                               "spec, or their *_hybrid_stack_spec namesakes",
    "moe_combine_in_fp32": f"name {_COMBINE_ENTRY_POINTS} instead",
    "moe_combine_chunk_rows": "set MCORE_TORCH_EXPERTS_COMBINE_CHUNK_ROWS in the environment of "
                              "every process instead",
    "moe_combine_backend": "remove it (the automatic choice applies)",
    "moe_expert_kernel": "remove it (the automatic choice applies)",
}


def refuse_unrecorded_settings(config: TransformerConfig, entry_point: str) -> None:
    """Refuse a PACKAGE_FIELDS setting held as a plain attribute of `config` (a Bridge provider,
    a plain TransformerConfig) when a launcher entry point builds from it: Bridge's
    run_config.yaml records dataclass fields only, so a provider rebuilt from it would silently
    build without the setting."""
    fields = {field.name for field in dataclasses.fields(config)}
    for name in PACKAGE_FIELDS:
        if name in vars(config) and name not in fields:
            _refuse(name, getattr(config, name),
                    f"a plain attribute of {type(config).__name__} (not a dataclass field) is "
                    "not recorded in Megatron-Bridge's run_config.yaml, so a provider rebuilt "
                    "from it (NeMo-RL's policy and reference models are) would build without "
                    f"it; {_UNRECORDED_FIXES[name]}.", entry_point)
