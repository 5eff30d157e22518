"""NeMo-RL's own Megatron policy worker (main at 7ea279ab, megatron-core 0.20.0, megatron-bridge
0.7.0) with the worker extension of examples/nemo_rl_worker.py, on the CPU: its setup in the order
`MegatronPolicyWorkerImpl.__init__` makes it, then its `get_logprobs` and one `train` step, with
and without PEFT (nemo_rl_worker_run.py, in its own process). Skipped where NeMo-RL, megatron-core
0.20 or Megatron-Bridge 0.7 is not installed.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from bridge_support import run_worker

WORKER = Path(__file__).with_name("nemo_rl_worker_run.py")


def nemo_rl_stack() -> None:
    """Skip, with the reason, where NeMo-RL's stack is not installed."""
    if sys.version_info < (3, 12):
        pytest.skip("NeMo-RL's Megatron worker needs Python 3.12+ (Megatron-Bridge 0.7)")
    for module, what in (("nemo_rl", "NeMo-RL"), ("megatron.bridge", "megatron-bridge 0.7.0"),
                         ("ray", "Ray (NeMo-RL's policy modules import it)")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{what} is not installed (the megatron-core 0.20.0 leg)")
    from importlib.metadata import version

    if not version("megatron-core").startswith("0.20."):
        pytest.skip(f"NeMo-RL main pins megatron-core 0.20.0, not {version('megatron-core')}")
    if not os.environ.get("NEMO_RL_CONFIGS"):
        pytest.skip("NEMO_RL_CONFIGS (NeMo-RL's examples/configs folder) is not set")


@pytest.fixture(scope="module", params=[True, False], ids=["peft", "full"])
def nemo_rl_run(request, tmp_path_factory):
    nemo_rl_stack()
    return run_worker(WORKER, tmp_path_factory.mktemp("nemo_rl"), hide_gpus=True,
                      args=["1" if request.param else "0"])


def expert_weight(name: str) -> bool:
    return ".mlp.experts.linear_fc" in name and ".weight" in name and "adapter" not in name


def test_nemo_rl_worker_builds_torch_experts_and_gives_the_hf_models_logprobs(nemo_rl_run):
    assert nemo_rl_run["experts"] == ["TorchGroupedMLP", "TorchGroupedMLP"]
    assert nemo_rl_run["logprobs_max_abs"] < 1e-4


def test_nemo_rl_train_step_trains_what_the_docs_say(nemo_rl_run):
    names, changed = nemo_rl_run["all_names"], set(nemo_rl_run["changed"])
    assert nemo_rl_run["loss"] == nemo_rl_run["loss"] and abs(nemo_rl_run["loss"]) < 1e3
    experts = [n for n in names if expert_weight(n)]
    assert experts and not changed & set(experts)  # bitwise equal after the step
    if nemo_rl_run["peft"]:
        assert changed and all("adapter" in n for n in changed)
        assert any(".mlp.experts." in n for n in changed)  # the experts' shared adapters
    else:
        router = {n for n in names if n.endswith("mlp.router.weight")}  # freeze_moe_router
        expected = set(names) - set(experts) - router
        assert changed == expected
        assert any("all expert weights frozen" in line for line in nemo_rl_run["log"])
