"""What the Transformer Engine tests share: the skip rule, and tiny GPT-MoE models built from
Megatron's TE spec (TE attention and linears) on CUDA in BF16, with TEGroupedMLP or TorchGroupedMLP
experts. The TE tests run in the TE leg (scripts/gpu_te.sh on a GPU host with TE installed;
docs/transformer_engine.md); elsewhere they skip."""

import importlib.util

import pytest
import torch
from megatron.core.models.gpt import GPTModel

from mcore_torch_experts import specs
from support.tiny_gpt import SEQ, VOCAB, tiny_config

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None

needs_te = [
    pytest.mark.te,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device: Transformer Engine runs on CUDA only"),
    pytest.mark.skipif(not HAVE_TE, reason="needs Transformer Engine (pip install .[te] on a GPU "
                       "host; the TE leg: scripts/gpu_te.sh, docs/transformer_engine.md)"),
]


def te_config(**overrides):
    """tiny_config (dense, MoE, MoE; hidden 64, 4 SwiGLU experts of 32, top-2, BF16) built on the
    GPU; experts: TEGroupedMLP unless `moe_expert_gemm_backend="torch"`."""
    fields = dict(moe_grouped_gemm=True, use_cpu_initialization=False)
    fields.update(overrides)
    return tiny_config(**fields)


def te_gpt(config, seed=0) -> GPTModel:
    """GPTModel whose every layer comes from Megatron's TE spec (the MoE experts follow the
    config's backend), on CUDA. The same seed gives the same weights (CPU and CUDA RNGs reseeded)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    spec = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=True)
    model = GPTModel(config, transformer_layer_spec=spec, vocab_size=VOCAB,
                     max_sequence_length=SEQ, position_embedding_type="rope")
    return model.cuda()
