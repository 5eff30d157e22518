"""CPU tests on a CUDA host with Transformer Engine importable (the TE leg): a model built on the
CPU stays there. Megatron's router moves its weight to `torch.cuda.current_device()` at its first
forward and rope its frequencies, and with TE importable the router's gating GEMM is TE's, which
reads the CPU input's memory as device memory: an illegal memory access that fails every later
CUDA call of the process. `megatron_cpu` (tests/conftest.py) keeps such models on the CPU.

The tests below are the ones that hit it first, each run in a child process so that a
regression fails here instead of poisoning this process."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).parent
FIRST_HIT = [
    "megatron/test_specs.py::test_partial_moe_spec_gets_torch_experts_without_touching_the_original",
    "megatron/test_convert.py::test_conversion_keeps_outputs_weights_and_sharded_keys",
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="a CUDA host only: on a CPU-only host no model can move to a GPU")
@pytest.mark.parametrize("test", FIRST_HIT, ids=lambda t: t.split("::")[1])
def test_a_cpu_model_stays_on_the_cpu_on_a_cuda_host(test):
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                           cwd=TESTS, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    assert "illegal memory access" not in child.stdout
