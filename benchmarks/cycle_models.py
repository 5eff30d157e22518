"""The RL cycle's models: the stacks the model slices (shapes.py) are built from, the experts
arms and the adapters.

Stacks. "te": what users run, the whole model from Megatron's Transformer Engine specs (TE
attention, TE linears and norms, TEGroupedMLP experts, TE's fused permute): GPTModel from the
TE decoder block spec, or HybridModel from Megatron's hybrid stack spec. "local": Megatron's
local spec without TE (unfused DotProductAttention, SequentialMLP experts), GPT slices only; it
is what runs on the CPU and where TE is absent.

Arms. Every arm of a slice starts from the same base weights (the same seed and spec): "te" and
"te-cutlass" keep the TE stack's TEGroupedMLP, run with NVTE_USE_CUTLASS_GROUPED_GEMM=0 and =1
(TE reads it at each grouped GEMM call, so it is set around each arm's passes only); "torch"
converts the experts with `convert_experts_to_torch`; "torch-fp32-combine" then makes the MoE
layers FP32CombineMoELayer (`convert_moe_layers_to_fp32_combine`: the FP32 Triton combine, and on
the allgather dispatcher the experts read the routed rows in place); "sequential" keeps the local
stack's SequentialMLP. TorchGroupedMLP's kernels: --expert-kernel (`moe_expert_kernel`).

Adapters. Megatron-Bridge's LoRA (the NeMo-RL path; BF16 adapters as Bridge makes them) on
linear_qkv, linear_proj, linear_fc1, linear_fc2 (shared experts' linears included), expert
adapters shared per grouped module or one per expert; or this package's `apply_lora`. Every
arm gets the same adapter values (B non-zero, as for a trained adapter).
"""

import contextlib
import importlib.util
import math
import os
import re
import sys
from typing import Optional

import torch

from shapes import ModelSlice

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
CUTLASS_ENV = "NVTE_USE_CUTLASS_GROUPED_GEMM"


ARMS = {"te": "TEGroupedMLP", "te-cutlass": "TEGroupedMLP, CUTLASS grouped GEMM",
        "torch": "TorchGroupedMLP", "torch-fp32-combine": "TorchGroupedMLP, FP32CombineMoELayer",
        "sequential": "SequentialMLP"}
ARM_ENV = {"te": {CUTLASS_ENV: "0"}, "te-cutlass": {CUTLASS_ENV: "1"}}  # whatever the shell set
TE_ARMS = ("te", "te-cutlass")
TORCH_ARMS = ("torch", "torch-fp32-combine")
EXPERT_ADAPTERS = ("shared", "per_expert")


class NotAvailable(Exception):
    """An arm that cannot run here; the message is the table's note."""


def te_importable() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def te_version() -> str:
    """Transformer Engine's own version string (its distribution name varies), or "absent"."""
    if not te_importable():
        return "absent"
    import transformer_engine

    return getattr(transformer_engine, "__version__", "unknown")


def bridge_importable() -> bool:
    return sys.version_info >= (3, 12) and importlib.util.find_spec("megatron.bridge") is not None


def pick_stack(requested: str, device: torch.device) -> str:
    """"te" where Transformer Engine can run (importable, CUDA), else "local"; an explicit
    "te" that cannot run is an error naming why."""
    why = ("Transformer Engine is not importable" if not te_importable() else
           "Transformer Engine needs CUDA and this run is on the CPU"
           if device.type != "cuda" else None)
    if requested == "te" and why:
        raise SystemExit(f"--stack te: {why}; use --stack local (or auto)")
    if requested == "auto":
        return "local" if why else "te"
    return requested


def arm_unavailable(arm: str, stack: str, device: torch.device) -> Optional[str]:
    """Why `arm` cannot run on this stack and machine (None: it can)."""
    if arm in TE_ARMS and stack != "te":
        if not te_importable():
            return "not available: Transformer Engine is not importable"
        if device.type != "cuda":
            return "not available: Transformer Engine needs CUDA (this run is on the CPU)"
        return "not available: --stack local builds no TE modules"
    if arm == "sequential" and stack == "te":
        return "not available on the TE stack (SequentialMLP runs with --stack local)"
    return None


@contextlib.contextmanager
def arm_environment(arm: str):
    """The arm's environment variables, set for the duration (and restored after)."""
    saved = {k: os.environ.get(k) for k in ARM_ENV.get(arm, {})}
    os.environ.update(ARM_ENV.get(arm, {}))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def make_config(model: ModelSlice, layers: int, stack: str, args, device):
    """The slice's TorchExpertsTransformerConfig: BF16, frozen base, full uniform recompute (one
    layer per checkpoint), router in FP32 without auxiliary loss."""
    from megatron.core.activations import squared_relu

    from mcore_torch_experts import TorchExpertsTransformerConfig

    te = stack == "te"
    return TorchExpertsTransformerConfig(
        num_layers=2 * layers if model.hybrid else layers, hidden_size=model.hidden,
        num_attention_heads=model.heads, num_query_groups=model.query_groups,
        kv_channels=model.head_dim, qk_layernorm=model.qk_layernorm,
        ffn_hidden_size=model.moe_ffn, num_moe_experts=model.built_experts(args.ep),
        moe_ffn_hidden_size=model.moe_ffn, moe_router_topk=model.topk, moe_router_dtype="fp32",
        moe_router_score_function=model.router,
        moe_router_enable_expert_bias=model.router == "sigmoid",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type=args.dispatcher, moe_grouped_gemm=te,
        moe_expert_kernel=args.expert_kernel,
        moe_permute_fusion=te and args.permute_fusion,
        moe_shared_expert_intermediate_size=model.shared_ffn,
        expert_model_parallel_size=args.ep, gated_linear_unit=model.activation == "swiglu",
        activation_func=(torch.nn.functional.silu if model.activation == "swiglu"
                         else squared_relu),
        normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        use_cpu_initialization=device.type == "cpu", recompute_granularity="full",
        recompute_method="uniform", recompute_num_layers=1,
        **({"moe_latent_size": model.latent} if model.latent else {}))  # latent slices


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


def build_base(model: ModelSlice, layers: int, config, stack: str, args, device):
    """The slice's model from the stack's specs (experts: TEGroupedMLP on "te", SequentialMLP on
    "local"), with the frozen-input guard on its decoder."""
    from mcore_torch_experts import _compat, build_gpt_model
    from mcore_torch_experts.megatron.recompute import install_frozen_input_guard

    seed_all(args.seed)
    position = ({"position_embedding_type": "rope", "rotary_base": model.rotary_base}
                if model.rotary_base else {"position_embedding_type": "none"})
    if not model.hybrid:
        return build_gpt_model(config, vocab_size=model.vocab, max_sequence_length=args.seq,
                               use_transformer_engine=stack == "te", **position).to(device)
    if stack != "te":
        raise NotAvailable("not available: the hybrid slice is built from Megatron's hybrid "
                           "stack spec, which needs Transformer Engine (use a GPT slice)")
    model_class = _compat.hybrid_model_class()
    if model_class.__name__ != "HybridModel":
        raise NotAvailable("not available: the hybrid slice needs megatron-core 0.18+ (before it "
                           "MambaStack runs no full recompute, so the cycle would not be the one "
                           "measured here; use a GPT slice)")
    built = model_class(config=config, vocab_size=model.vocab, max_sequence_length=args.seq,
                        **position,
                        **{_compat.hybrid_stack_spec_kwarg(model_class):
                           _compat.megatron_hybrid_stack_spec(),
                           _compat.hybrid_pattern_kwarg(model_class): "*E" * layers})
    install_frozen_input_guard(built)
    return built.to(device)


def build_arm(arm: str, model: ModelSlice, layers: int, config, stack: str, args, device,
              expert_adapters: str):
    """The model of one arm, adapters on, base frozen."""
    from mcore_torch_experts import convert_experts_to_torch, convert_moe_layers_to_fp32_combine

    built = build_base(model, layers, config, stack, args, device)
    if arm in TORCH_ARMS:
        convert_experts_to_torch(built)
    if arm == "torch-fp32-combine":
        convert_moe_layers_to_fp32_combine(built)
    add_adapters(built, args, expert_adapters)
    fill_adapters(built, args.seed)
    return built


def adapter_source(requested: str) -> str:
    """"bridge" or "ours" for --adapters auto|bridge|ours."""
    if requested == "auto":
        return "bridge" if bridge_importable() else "ours"
    if requested == "bridge" and not bridge_importable():
        raise SystemExit("--adapters bridge: megatron-bridge is not importable (it needs Python "
                         "3.12 and megatron-bridge 0.6); use --adapters ours or auto")
    return requested


def import_bridge_peft() -> None:
    """Import Megatron-Bridge's PEFT (the real import with TE; a stand-in without it, on the CPU)
    and register the package with it. Done once before any arm is built: Bridge keeps the
    exceptions of the optional imports it tries, and with their tracebacks every frame then on
    the stack, which would keep the first arm's model alive past its turn."""
    import mcore_torch_experts
    from support.bridge_imports import import_megatron_bridge

    import_megatron_bridge()
    mcore_torch_experts.register_with_megatron_bridge()


def add_adapters(model, args, expert_adapters: str) -> None:
    """LoRA on TARGETS, base frozen: Megatron-Bridge's (share_expert_adapters from
    `expert_adapters`, "shared" or "per_expert"; import_bridge_peft first) or ours (BF16
    adapters, as Bridge's)."""
    if args.adapters == "bridge":
        import_bridge_peft()  # already done: a no-op
        from megatron.bridge.peft.lora import LoRA

        LoRA(target_modules=TARGETS, dim=args.rank, alpha=args.alpha,
             share_expert_adapters=expert_adapters == "shared")(model, training=True)
        return
    from mcore_torch_experts import apply_lora

    model.requires_grad_(False)
    apply_lora(model, TARGETS, rank=args.rank, alpha=args.alpha, expert_adapter=expert_adapters,
               dtype=torch.bfloat16)


SEQUENTIAL_EXPERT = re.compile(r"(.*\.experts\.)local_experts\.(\d+)\.(linear_fc[12])$")


def adapter_factors(model) -> dict:
    """{(grouped module name, expert or -1): (A, B)} for every adapter (ours or Bridge's: both
    hold `adapter.linear_in.weight` and `adapter.linear_out.weight`). SequentialMLP's
    `experts.local_experts.E.linear_fcN` is keyed as the grouped module `experts.linear_fcN`,
    expert E; per-expert factors [E, ...] are split by expert."""
    from cycle_profile import is_adapter_wrapper

    factors = {}
    for name, module in model.named_modules():
        if not is_adapter_wrapper(module):
            continue
        a, b = module.adapter.linear_in.weight, module.adapter.linear_out.weight
        match = SEQUENTIAL_EXPERT.match(name)
        if match:
            factors[match[1] + match[3], int(match[2])] = (a, b)
        elif a.dim() == 3:
            factors.update({(name, e): (a[e], b[e]) for e in range(a.shape[0])})
        else:
            factors[name, -1] = (a, b)
    return factors


@torch.no_grad()
def fill_adapters(model, seed: int) -> None:
    """The same adapter values in every arm (B non-zero, as for a trained adapter)."""
    generator = torch.Generator().manual_seed(seed)
    for _, (a, b) in sorted(adapter_factors(model).items()):
        a.copy_(torch.randn(a.shape, generator=generator) / math.sqrt(a.shape[-1]))
        b.copy_(torch.randn(b.shape, generator=generator) * 1e-2)


def describe(model: ModelSlice, layers: int, stack: str, args) -> list:
    """Report lines: the slice, the stack, the adapters."""
    attention = (f"GQA {model.heads}/{model.query_groups} heads of {model.head_dim}"
                 + (", QK RMSNorm" if model.qk_layernorm else "")
                 + (", RoPE" if model.rotary_base else ""))
    built = model.built_experts(args.ep)
    experts = (f"{built} {'SwiGLU' if model.activation == 'swiglu' else 'squared-ReLU'}"
               f" experts of {model.moe_ffn}, top-{model.topk} ({model.router} router)"
               + (f", {built // args.ep} per rank at EP={args.ep}" if args.ep > 1 else "")
               + (f", latent {model.latent} (the experts see {model.latent})"
                  if model.latent else "")
               + (f", shared expert of {model.shared_ffn}" if model.shared_ffn else ""))
    kind = (f"HybridModel, pattern {'*E' * layers} ({layers} attention + {layers} MoE layers)"
            if model.hybrid else f"GPTModel, {layers} MoE layers")
    lines = [f"model: {model.label} slice, {kind}: hidden {model.hidden}, {attention}; "
             f"{experts}; vocab {model.vocab}; BF16 base, frozen"]
    if model.note:
        lines.append(f"slice: {model.note}")
    full_ep = model.experts // (model.local_experts or model.experts)
    if model.local_experts and args.ep <= full_ep:
        lines.append(
            f"experts: {model.local_experts} per rank, as on one rank of the model's "
            f"{model.experts} at EP={full_ep} without tensor parallelism, so each expert gets "
            f"the rows it gets there (balanced routing: tokens per rank x top-{model.topk} / "
            f"{model.local_experts})"
            + (f"; {built} experts in all at EP={args.ep}, top-{model.topk} over those"
               if built < model.experts else ""))
    lines.append(
        "stack: Megatron's Transformer Engine specs (TE attention, TE linears and norms, "
        f"TEGroupedMLP experts; fused permute {'on' if args.permute_fusion else 'off'})"
        if stack == "te" else
        "stack: Megatron's local spec (no Transformer Engine): unfused DotProductAttention, "
        "the [b*heads, s, s] scores materialised; permute fusion off")
    sources = [args.adapters] if isinstance(args.adapters, str) else list(args.adapters)
    kinds = {"bridge": f"`bridge`: Megatron-Bridge {_version('megatron-bridge')} "
                       f"LoRA(dim={args.rank}, alpha={args.alpha:g}, share_expert_adapters=True "
                       "for `shared`, False for `per_expert`)",
             "ours": f"`ours`: mcore_torch_experts.apply_lora(rank={args.rank}, "
                     f"alpha={args.alpha:g}, expert_adapter=`shared` or `per_expert`)"}
    lines.append(
        "LoRA: " + "; ".join(kinds[source] for source in sources)
        + f", BF16 adapters on {', '.join(TARGETS)} (shared experts' too); expert adapters "
        "`shared`: one pair per grouped module, `per_expert`: one per expert (SequentialMLP: "
        "one per expert linear either way)")
    return lines


def _version(dist: str) -> str:
    from harness import version

    return version(dist)
