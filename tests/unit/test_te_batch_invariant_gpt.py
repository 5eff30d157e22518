"""A whole GPT in batch_invariant_mode (megatron-core 0.20) with our experts: Megatron's TE spec
(TE attention pinned to FlashAttention 3 or 4, TE linears and norms through the mode's kernels),
TorchGroupedMLP experts, our LoRA. What on-policy RL needs of it: one sequence's per-token
logprobs bit for bit the same alone and inside batches of other sequences (7 others; 31 others
whose tokens pile onto few experts), in both expert kernels and both combines.

It runs in the TE leg on a GPU with FlashAttention 3 (`flash_attn_3`) or 4 (`flash-attn-4`)
installed, which Megatron 0.20 requires in the mode; elsewhere it skips saying so."""

import pytest
import torch

from mcore_torch_experts import TorchExpertsTransformerConfig, _compat
from support.batch_invariance import attention_env, flash_attention_version, invariant_settings
from support.te import needs_te

MOE_MODE = _compat.megatron_core_release() >= (0, 20)
FLASH = flash_attention_version() if MOE_MODE else None
pytestmark = [
    *needs_te,
    pytest.mark.skipif(not MOE_MODE, reason="batch-invariant MoE is megatron-core 0.20's"),
    pytest.mark.skipif(FLASH is None, reason="Megatron 0.20's batch_invariant_mode runs "
                       "FlashAttention 3 or 4 only (flash_attn_3, or flash-attn-4 >= 4.0.0b20 "
                       "with the CuTe DSL); Megatron finds neither importable"),
]

VOCAB, SEQ, HIDDEN, HEADS, EXPERTS, FFN, TOP_K, RANK = 512, 128, 256, 4, 16, 128, 4, 16
# (sequences in the batch, the probe's row, whether the others pile onto a few experts)
CONTEXTS = {"alone": (1, 0, False), "among 7 others": (8, 3, False),
            "among 31 others, skewed": (32, 17, True)}


def invariant_gpt(kernel, combine, adapter):
    """Two MoE layers of 16 SwiGLU experts (top-4) from Megatron's TE spec in the mode, our
    experts (`kernel`), `combine` "megatron" or "fp32_triton", our LoRA (`adapter` "shared" or
    "per_expert") on attention and the experts with random B, on CUDA."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from mcore_torch_experts import build_gpt_model, convert_moe_layers_to_fp32_combine
    from mcore_torch_experts.lora import apply_lora
    from support.batch_invariance import randomize_adapter_outputs

    settings = dict(invariant_settings(), flash_attention_version=FLASH)
    if combine == "fp32_triton":
        settings.update(moe_combine_in_fp32=True, moe_combine_backend="triton")
    config = TorchExpertsTransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=2 * HIDDEN,
        num_moe_experts=EXPERTS, moe_ffn_hidden_size=FFN, moe_router_topk=TOP_K,
        moe_router_dtype="fp32", moe_aux_loss_coeff=0.0, moe_grouped_gemm=True,
        moe_expert_gemm_backend="torch", moe_expert_kernel=kernel, moe_permute_fusion=False,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0, bf16=True,
        params_dtype=torch.bfloat16, **settings)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model = build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                            use_transformer_engine=True, position_embedding_type="rope").cuda()
    if combine == "fp32_triton":
        convert_moe_layers_to_fp32_combine(model)
    apply_lora(model, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], rank=RANK,
               alpha=2 * RANK, expert_adapter=adapter)
    randomize_adapter_outputs(model)
    return model.eval()


def probe_logprobs(model, sequences, at, skewed):
    """The probe sequence's per-token logprobs [SEQ] (FP32) from a batch of `sequences` with the
    probe at row `at`; the probe's tokens are the same in every batch."""
    probe = torch.randint(0, VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(7))
    others = torch.randint(0, VOCAB, (sequences, SEQ + 1),
                           generator=torch.Generator().manual_seed(sequences))
    if skewed:   # every other sequence one repeated token: their rows pile onto a few experts
        others[:] = others[0, 0]
    others[at] = probe
    tokens, labels = others[:, :-1].cuda(), others[:, 1:].cuda()
    positions = torch.arange(SEQ, device="cuda").expand(sequences, SEQ)
    with torch.no_grad():
        return -model(tokens, positions, None, labels=labels)[at].float()


@pytest.fixture
def flash_attention_env():
    """The NVTE_* variables Megatron sets when it builds the model in the mode, and TE's cached
    backend choice, undone after the test, so that the test files after it in this process build
    and choose as they would have."""
    from transformer_engine.pytorch.attention.dot_product_attention import (
        dot_product_attention as te_dpa,
    )

    with attention_env():
        yield te_dpa._attention_backends


@pytest.mark.parametrize("adapter", ["shared", "per_expert"])
@pytest.mark.parametrize("combine", ["megatron", "fp32_triton"])
@pytest.mark.parametrize("kernel", ["grouped_mm", "fused_gemm"])
def test_one_sequences_logprobs_are_bitwise_the_same_in_any_batch(te_world, flash_attention_env,
                                                                  kernel, combine, adapter):
    from megatron.core.transformer.custom_layers.batch_invariant_kernels import (
        set_batch_invariant_mode,
    )

    model = invariant_gpt(kernel, combine, adapter)
    with set_batch_invariant_mode(True, backend="triton"):
        logprobs = {context: probe_logprobs(model, *setting)
                    for context, setting in CONTEXTS.items()}
        again = probe_logprobs(model, *CONTEXTS["alone"])
        backends = dict(flash_attention_env)
    kernels_ran = {m.last_expert_kernel.value for m in model.modules()
                   if type(m).__name__ == "TorchGroupedMLP"}
    alone = logprobs["alone"]
    differences = {c: (lp - alone).abs().max().item() for c, lp in logprobs.items()}
    print(f"\n[batch-invariant GPT] FA{FLASH} ({backends['flash_attention_backend']}) "
          f"{kernel} {combine} {adapter}: experts ran {sorted(kernels_ran)}; "
          f"max |logprob - alone's|: {differences}")
    assert backends["use_flash_attention"], backends   # the mode's attention, its FA pinned
    assert kernels_ran == {kernel}
    assert torch.isfinite(alone).all() and (alone < 0).all()
    assert torch.equal(again, alone)   # the same batch twice
    for context, lp in logprobs.items():
        assert torch.equal(lp, alone), (context, differences)
