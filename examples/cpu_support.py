"""Run Megatron-Core's MoE layer on a CPU-only host (examples only; the GPU path needs none of it).

megatron-core 0.16's router moves its weights to `torch.cuda.current_device()` and its
`moe_utils` refers to `te_general_gemm` even without Transformer Engine. On a machine without
CUDA, these two adjustments let the examples build and run a real MoE layer; with CUDA present
nothing is changed.
"""

import os

import torch


def init_single_process_megatron(port: int = 29512) -> None:
    """One gloo process with Megatron's parallel state (every parallel size 1)."""
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend, rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
    else:
        _adapt_megatron_to_cpu()


def _adapt_megatron_to_cpu() -> None:
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
