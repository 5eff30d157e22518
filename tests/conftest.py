"""Shared fixtures: a one-process gloo world with Megatron's parallel state, on the CPU."""

import os

import pytest
import torch


def _patch_megatron_for_cpu(monkeypatch):
    """Two test-only patches so Megatron-Core's MoE layer runs on a CPU-only machine.

    - The router places tensors on `torch.cuda.current_device()`; without CUDA that call fails,
      so it answers "cpu" here.
    - megatron-core 0.16.1's `moe_utils` references `te_general_gemm` even when Transformer
      Engine is absent (NameError); without TE it should be None.
    The code under test is not patched.
    """
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        monkeypatch.setattr(moe_utils, "te_general_gemm", None, raising=False)


@pytest.fixture(scope="session")
def _gloo_world():
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()


@pytest.fixture
def megatron_cpu(_gloo_world, monkeypatch):
    """A one-process Megatron parallel state (all sizes 1) with the CPU patches applied."""
    _patch_megatron_for_cpu(monkeypatch)
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()



@pytest.fixture
def cpu_cuda_streams(monkeypatch):
    """CUDA-stream stand-ins (tests/host_streams.py) so Megatron's alltoall token dispatcher runs
    on a CPU-only machine. Test setup only; the code under test is not patched."""
    if torch.cuda.is_available():
        return
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from host_streams import cuda_stream_patches

    for owner, name, stand_in in cuda_stream_patches():
        monkeypatch.setattr(owner, name, stand_in)
    monkeypatch.setattr(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", None, raising=False)
