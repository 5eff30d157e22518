"""Shared fixtures: a one-process gloo world with Megatron's parallel state, on the CPU."""

import os

import pytest
import torch


def _define_te_general_gemm_without_te(monkeypatch):
    """megatron-core 0.16.1's `moe_utils` references `te_general_gemm` even when Transformer
    Engine is absent (a NameError in the router, on GPUs too): without TE it is None."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        monkeypatch.setattr(moe_utils, "te_general_gemm", None, raising=False)


def _patch_megatron_for_cpu(monkeypatch):
    """Test-only patches so Megatron-Core runs a model on the CPU, on any host.

    - Megatron places the router's weights, rope's frequencies and its buffers on
      `torch.cuda.current_device()`; on a CPU-only host that call fails, and on a CUDA host a CPU
      model would be half moved to the GPU. It answers "cpu" here, on every host.
    - With Transformer Engine importable, the router's gating GEMM calls TE's `general_gemm` for
      tensors on any device; TE reads a CPU tensor's memory as device memory (an illegal memory
      access that poisons every later CUDA call of the process; "No CUDA GPUs are available" where
      the GPUs are hidden). For CPU models it is None: the router's own torch.mm path.
    The code under test is not patched.
    """
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
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
def megatron_world(_gloo_world, monkeypatch):
    """A one-process Megatron parallel state (all sizes 1) for tests whose tensors live on the
    host's device (CUDA where present): the CPU patches only on a host without CUDA."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    _define_te_general_gemm_without_te(monkeypatch)
    if not torch.cuda.is_available():
        _patch_megatron_for_cpu(monkeypatch)
    return ProcessGroupCollection.use_mpu_process_groups()


@pytest.fixture
def megatron_cpu(megatron_world, monkeypatch):
    """megatron_world for a model on the CPU, on any host (a CUDA host with TE too): the CPU
    patches applied."""
    _patch_megatron_for_cpu(monkeypatch)
    return megatron_world


@pytest.fixture
def te_world(megatron_world):
    """megatron_world on CUDA for models built from Megatron's TE spec: the model-parallel CUDA
    RNG seeded (attention dropout and initialisation fork it)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    return megatron_world


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
