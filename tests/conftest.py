"""Shared fixtures: a one-process gloo world with Megatron's parallel state, on the CPU."""

import socket
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))  # cpu_support


def _define_te_general_gemm_without_te(monkeypatch):
    """megatron-core 0.16.1's `moe_utils` references `te_general_gemm` even when Transformer
    Engine is absent (a NameError in the router, on GPUs too): without TE it is None."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        monkeypatch.setattr(moe_utils, "te_general_gemm", None, raising=False)


def _patch_megatron_for_cpu(monkeypatch):
    """Test-only: the patches that keep Megatron-Core on the CPU, on any host (a CUDA host with
    TE too), each with its reason: examples/cpu_support.megatron_on_cpu_patches, the one table the
    examples and these tests share. Undone after each test; the code under test is not patched."""
    from cpu_support import megatron_on_cpu_patches

    for owner, name, value in megatron_on_cpu_patches():
        monkeypatch.setattr(owner, name, value, raising=False)


@pytest.fixture(scope="session")
def _gloo_world():
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        # A free port in the init method, not in MASTER_ADDR/PORT: child processes the tests
        # start (examples, benchmarks, torchrun) pick their own.
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                             rank=0, world_size=1)
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
