"""Every fixture of the tests: a one-process gloo world with Megatron's parallel state, with the
patches of support.cpu_support.megatron_patches (the one table, each patch with its reason)
applied and undone after each test. The code under test is not patched."""

import os
import socket
from pathlib import Path

import pytest
import torch

from support.cpu_support import megatron_patches
from support.triton_interpreter import interpreter_is_on, run_interpreted

ROOT = Path(__file__).resolve().parents[1]
# Child processes (examples, workers, torchrun, benchmarks) import this checkout's package, not
# whichever copy an editable install points at, and the suite's own modules (tests/: the
# `support` package; tests/integration/megatron_lm/: the Megatron-LM worker's flags;
# benchmarks/: the harness; examples/: the examples the workers run), as this process does
# through pytest's `pythonpath` setting (setup.cfg).
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [
    str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "integration" / "megatron_lm"),
    str(ROOT / "benchmarks"), str(ROOT / "examples"), os.environ.get("PYTHONPATH")]))


def pytest_collection_modifyitems(config, items):
    """The leg rule (scripts/legs.sh: leg_skips): scripts/run_tests.sh sets
    MCORE_TORCH_EXPERTS_LEG_SKIPS to "marker=legs;..." for the markers whose tests this leg leaves
    to those legs; they skip here with that reason. Unset (pytest run by hand), all run."""
    for rule in filter(None, os.environ.get("MCORE_TORCH_EXPERTS_LEG_SKIPS", "").split(";")):
        marker, legs = rule.split("=", 1)
        skip = pytest.mark.skip(reason=f"{marker}: run on the legs {legs} only (scripts/legs.sh)")
        for item in items:
            if item.get_closest_marker(marker) is not None:
                item.add_marker(skip)


def pytest_runtest_logreport(report):
    """MCORE_TORCH_EXPERTS_FAILURES_AT_ONCE=1 (scripts/gpu_te.sh): each failure's traceback printed
    when it happens (under xdist too: the controller gets every worker's report), so a run cut
    by a time limit says why its failures failed, not only which."""
    if report.failed and os.environ.get("MCORE_TORCH_EXPERTS_FAILURES_AT_ONCE") == "1":
        print(f"\n[failed at once] {report.nodeid} ({report.when}):\n"
              f"{report.longreprtext[-4000:]}", flush=True)


def _apply(monkeypatch, patches):
    for patch in patches:
        monkeypatch.setattr(patch.owner, patch.name, patch.value, raising=False)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test marked `triton_interpreter` runs its Triton kernels on the CPU: in this process when
    it started under TRITON_INTERPRET=1, else alone in a child pytest that did (its pass, skip or
    failure is this test's)."""
    if pyfuncitem.get_closest_marker("triton_interpreter") is None or interpreter_is_on():
        return None
    child = run_interpreted(pyfuncitem.nodeid)
    if child.returncode == 0 and " passed" not in child.stdout and " skipped" in child.stdout:
        reasons = [line for line in child.stdout.splitlines() if line.startswith("SKIPPED")]
        pytest.skip(f"under the Triton interpreter: {reasons[-1] if reasons else 'skipped'}")
    assert child.returncode == 0 and " passed" in child.stdout, (child.stdout[-4000:]
                                                                  + child.stderr[-2000:])
    return True


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


ATTENTION_BACKEND_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


@pytest.fixture(autouse=True)
def _attention_backend_env():
    """Each test starts from the attention-backend environment the run was given: building a
    Megatron language model writes NVTE_*_ATTN into the process environment for its
    `attention_backend` and asserts them at the next build, which may ask for another backend."""
    given = {name: os.environ.get(name) for name in ATTENTION_BACKEND_ENV}
    yield
    for name, value in given.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def megatron_world(_gloo_world, monkeypatch):
    """A one-process Megatron parallel state (all sizes 1) for tests whose tensors live on the
    host's device (CUDA where present): the CPU patches only on a host without CUDA."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    _apply(monkeypatch, megatron_patches(on_cpu=not torch.cuda.is_available()))
    return ProcessGroupCollection.use_mpu_process_groups()


@pytest.fixture
def megatron_cpu(megatron_world, monkeypatch):
    """megatron_world for a model on the CPU, on any host (a CUDA host with TE too): the CPU
    patches applied."""
    _apply(monkeypatch, megatron_patches(on_cpu=True))
    return megatron_world


@pytest.fixture
def megatron_cpu_training(megatron_cpu, monkeypatch):
    """megatron_cpu, plus what selective "layernorm" recompute needs without Transformer Engine.
    On a CUDA host too these FP32 models stay on the CPU; tests/unit/test_te_lora.py trains adapters
    under recompute on the GPU with Transformer Engine."""
    _apply(monkeypatch, megatron_patches(on_cpu=True, recompute_without_te=True))
    return megatron_cpu


@pytest.fixture
def te_world(megatron_world):
    """megatron_world on CUDA for models built from Megatron's TE spec: the model-parallel CUDA
    RNG seeded (attention dropout and initialisation fork it)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    return megatron_world


@pytest.fixture
def cpu_cuda_streams(monkeypatch):
    """Host stand-ins for the CUDA streams of Megatron's alltoall token dispatcher on a CPU-only
    machine (one process, expert parallel size 1); nothing on a CUDA host."""
    on_cpu = not torch.cuda.is_available()
    _apply(monkeypatch, megatron_patches(on_cpu=on_cpu, host_streams=on_cpu))
