"""batch_invariant_mode probes (megatron-core 0.20): an MoE layer in the mode, a batch of probe
tokens alone and among other tokens, and how far the probe tokens' output and input gradient
move from the alone run's; the FlashAttention a whole model in the mode runs, and TE's attention
variables kept apart per model. Shapes: x [S, 1, H] (S tokens, H hidden), probe slice [P]."""

import contextlib
import importlib.util
import os

import pytest
import torch

from mcore_torch_experts import TorchExpertsTransformerConfig, _compat

# A config that builds our experts on any leg (the mode's fields are added by invariant_settings).
VALID = dict(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
             moe_ffn_hidden_size=32, moe_router_topk=2, moe_grouped_gemm=True,
             add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
             moe_expert_gemm_backend="torch")

# The probe layer: a batch of probe tokens alone, among 7x as many others and among thousands
# (the others' routing skewed onto two experts in one of them).
PROBE_TOKENS, HIDDEN, EXPERTS, FFN, TOP_K, RANK = 16, 512, 16, 256, 4, 16
CONTEXTS = {"alone": (0, False), "among 7x others": (7, False),
            "among thousands": (256, False), "skewed, thousands": (256, True)}
CPU_CONTEXTS = {"alone": (0, False), "among 7x others": (7, False),
                "among a thousand": (64, False), "skewed, a thousand": (64, True)}


def gpu_in_the_mode(test):
    """The marks of a test that runs Megatron's batch-invariant kernels: a CUDA device, and
    Transformer Engine importable (the TE leg)."""
    for mark in (pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                                    reason="megatron-core 0.20's enable_batch_invariant_mode imports "
                                    "Transformer Engine (ModuleNotFoundError without it): the TE leg "
                                    "runs this"),
                 pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
                 pytest.mark.te, pytest.mark.gpu):
        test = mark(test)
    return test


ATTENTION_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN", "NVTE_FLASH_ATTN_V2",
                 "NVTE_FLASH_ATTN_V3", "NVTE_FLASH_ATTN_V4")


def flash_attention_version():
    """4 or 3 where Megatron finds that FlashAttention importable (its attention module's own
    HAVE_FA4 / HAVE_FA3: FA4 4.0.0b20 or newer with the CuTe DSL, FA3's interface), else None."""
    from megatron.core.transformer import attention

    if getattr(attention, "HAVE_FA4", False):
        return 4
    return 3 if getattr(attention, "HAVE_FA3", False) else None


def whole_model_mode_missing():
    """Why a whole model cannot run in megatron-core 0.20's batch_invariant_mode here (its
    batch-invariant kernels; FlashAttention 3 or 4), or None."""
    try:
        import megatron.core.transformer.custom_layers.batch_invariant_kernels  # noqa: F401
    except ImportError as exc:
        return f"needs megatron-core 0.20 or newer (its batch-invariant kernels): {exc}"
    if flash_attention_version() is None:
        return ("needs FlashAttention 3 or 4 (flash_attn_3 or flash-attn-4), which the mode runs: "
                "neither is importable")
    return None


@contextlib.contextmanager
def attention_env(values=None):
    """TE's NVTE_* attention variables set to `values` (None: none set) for the duration, and TE's
    cached backend choice dropped on the way in and out. Megatron sets those variables when it
    builds a model (pinned to FlashAttention in the mode): the dict yielded holds them as they
    are at the end; afterwards they are as they were before."""
    from transformer_engine.pytorch.attention.dot_product_attention import (
        dot_product_attention as te_dpa,
    )

    saved = {name: os.environ.pop(name) for name in ATTENTION_ENV if name in os.environ}
    os.environ.update(values or {})
    te_dpa._attention_backends["attention_params"] = None
    final = {}
    try:
        yield final
    finally:
        final.update({name: os.environ[name] for name in ATTENTION_ENV if name in os.environ})
        for name in ATTENTION_ENV:
            os.environ.pop(name, None)
        os.environ.update(saved)
        te_dpa._attention_backends["attention_params"] = None


def invariant_settings():
    """What megatron-core 0.20 asks of an MoE config in the mode (but DeepGEMM)."""
    from megatron.core.transformer.enums import AttnBackend

    return dict(batch_invariant_mode=True, attention_backend=AttnBackend.flash,
                flash_attention_version=3, attention_dropout=0.0,
                moe_token_dispatcher_type="alltoall")


def moe_layer_in_the_mode(combine, kernel, device):
    """A MoE layer (router, alltoall dispatcher, our experts; `combine` "megatron" or
    "fp32_triton") in the mode, SwiGLU experts, no adapter, every parameter trainable."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from mcore_torch_experts.megatron.moe_layer import FP32CombineMoELayer
    from mcore_torch_experts.specs import get_gpt_layer_local_spec

    settings = dict(VALID, hidden_size=HIDDEN, num_moe_experts=EXPERTS,
                    moe_ffn_hidden_size=FFN, moe_router_topk=TOP_K, moe_aux_loss_coeff=0.0,
                    gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                    moe_expert_kernel=kernel, use_cpu_initialization=device == "cpu",
                    **invariant_settings())
    if combine == "fp32_triton":
        settings.update(moe_combine_in_fp32=True, moe_combine_backend="triton")
    config = TorchExpertsTransformerConfig(**settings)
    torch.manual_seed(0)
    spec = get_gpt_layer_local_spec(config).submodules.mlp
    layer_class = FP32CombineMoELayer if combine == "fp32_triton" else MoELayer
    return _compat.build_moe_layer(_compat.with_moe_layer_class(spec, layer_class), config).to(
        device)


def randomize_adapter_outputs(module):
    """LoRA's B starts at zero and would add nothing: small random values instead."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "linear_out" in name:
                p.normal_(std=0.01)


def probe_batch(others_per_probe, skewed, device):
    """hidden [S, 1, H] with the probe tokens in the middle, their slice, the output gradient;
    the probe tokens' values the same in every batch."""
    probe = torch.Generator().manual_seed(7)
    probe_x = torch.randn(PROBE_TOKENS, HIDDEN, generator=probe)
    probe_grad = torch.randn(PROBE_TOKENS, HIDDEN, generator=probe)
    others = others_per_probe * PROBE_TOKENS
    gen = torch.Generator().manual_seed(others + skewed)
    x = torch.randn(others + PROBE_TOKENS, HIDDEN, generator=gen)
    if skewed:   # the others' hidden states close to one direction: the router piles them up
        x[:others // 2] = x[:others // 2] * 0.01 + probe_x[0]
    grad = torch.randn_like(x)
    at = slice(others // 2, others // 2 + PROBE_TOKENS)
    x[at], grad[at] = probe_x, probe_grad
    to = dict(device=device, dtype=torch.bfloat16)
    return x.unsqueeze(1).to(**to), at, grad.unsqueeze(1).to(**to)


def probe_differences(layer, device, contexts=CONTEXTS):
    """{context: (max |output - alone's|, max |input gradient - alone's|)} of the probe tokens,
    and the alone run's largest input-gradient entry."""
    results = {}
    for context, (others, skewed) in contexts.items():
        x, at, grad = probe_batch(others, skewed, device)
        x.requires_grad_(True)
        out, _ = layer(x)
        out.backward(grad)
        results[context] = (out[at].clone(), x.grad[at].clone())
    alone_out, alone_dx = results["alone"]
    assert alone_out.abs().sum() > 0 and alone_dx.abs().sum() > 0
    return {context: ((out - alone_out).abs().max().item(), (dx - alone_dx).abs().max().item())
            for context, (out, dx) in results.items()}, alone_dx.abs().max().item()
