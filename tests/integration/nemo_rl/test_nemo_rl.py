"""NeMo-RL's own Megatron policy worker (main at 7ea279ab, megatron-core 0.20.0, megatron-bridge
0.7.0) with the worker extension of mcore_torch_experts.integrations.nemo_rl, on the CPU: the
extension's `__init__` (`enable_torch_experts`, then `MegatronPolicyWorkerImpl.__init__`'s
setup), then the worker's `get_logprobs` and one `train` step, with the docs' PEFT block and
without PEFT (nemo_rl_worker_run.py, in its own process). References: transformers' forward of
the same checkpoint, and the parameters before the step. With PEFT, the worker's own
`save_checkpoint` after the step, then a fresh worker in a new process resuming from it as
NeMo-RL resumes a run (its `weights_path` and `optimizer_path`), against the trained worker and
the HF checkpoint.
Skipped, with the reason, where NeMo-RL's stack is not installed (every leg but 0.20.0;
scripts/legs.sh installs it there).
"""

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

from support.bridge import run_worker

pytestmark = pytest.mark.bridge

WORKER = Path(__file__).parent / "nemo_rl_worker_run.py"


def nemo_rl_folder() -> Path:
    """The folder holding NeMo-RL and the packages its worker imports (scripts/legs.sh:
    NEMO_RL_DIR in the 0.20.0 leg's folder, or MCORE_TORCH_EXPERTS_NEMO_RL_PATH); skips the test,
    with the reason, where the stack is not there."""
    if sys.version_info < (3, 12):
        pytest.skip("NeMo-RL's Megatron worker needs Python 3.12+ (Megatron-Bridge 0.7)")
    for module in ("megatron.core", "megatron.bridge"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (NeMo-RL's stack, megatron-core 0.20.0 and "
                        "megatron-bridge 0.7.0, is the 0.20.0 leg's)")
    from importlib.metadata import version

    if not version("megatron-core").startswith("0.20."):
        pytest.skip(f"NeMo-RL main pins megatron-core 0.20.0, not {version('megatron-core')}")
    import megatron.core

    default = Path(megatron.core.__file__).parents[2] / "nemo-rl"
    folder = Path(os.environ.get("MCORE_TORCH_EXPERTS_NEMO_RL_PATH", default))
    if not (folder / "nemo_rl" / "__init__.py").is_file() or not (folder / ".complete").is_file():
        pytest.skip(f"NeMo-RL is not installed in {folder} (scripts/legs.sh's setup of the "
                    "0.20.0 leg puts it there, from nemo-rl-7ea279ab.tar.gz)")
    return folder


@pytest.fixture(scope="module", params=[True, False], ids=["peft", "full"])
def nemo_rl_run(request, tmp_path_factory):
    folder = nemo_rl_folder()
    examples = Path(__file__).parents[3] / "examples"  # hf_roundtrip's tiny checkpoint
    out = tmp_path_factory.mktemp("nemo_rl")
    result = run_worker(WORKER, out, hide_gpus=True, args=["1" if request.param else "0"],
                        pythonpath=[folder, examples])
    return {**result, "out": out, "pythonpath": [folder, examples]}


@pytest.fixture(scope="module")
def nemo_rl_reload(nemo_rl_run):
    """The PEFT run's checkpoint, saved by the trained worker's save_checkpoint, loaded by a fresh
    worker in a new process (the case without PEFT is skipped to keep the test short: its save
    and load are the same calls on the whole model)."""
    if not nemo_rl_run["peft"]:
        pytest.skip("the save and reload are checked with PEFT")
    return run_worker(WORKER, nemo_rl_run["out"], hide_gpus=True, args=["1", "reload"],
                      pythonpath=nemo_rl_run["pythonpath"])


def expert_weight(name: str) -> bool:
    """TorchGroupedMLP's expert weights (`linear_fc1.weight0`, ...; `to_wrap.` under a LoRA
    wrapper), not their adapters."""
    return re.search(r"\.mlp\.experts\.linear_fc[12]\.(to_wrap\.)?weight\d+$", name) is not None


def test_nemo_rl_worker_builds_torch_experts_through_its_hf_import(nemo_rl_run):
    assert nemo_rl_run["stood_in"] == []  # Bridge's checkpointing imports the real packages
    classes = nemo_rl_run["worker_classes"]  # the extension's class, as Ray runs it
    assert classes[1:3] == ["TorchExpertsMegatronPolicyWorker", "MegatronPolicyWorkerImpl"]
    assert nemo_rl_run["provider_spec"] == "torch_experts_gpt_spec"  # rebuilt from run_config
    assert nemo_rl_run["experts"] == ["TorchGroupedMLP", "TorchGroupedMLP"]
    # The recipe's dispatcher (moe_token_dispatcher_type: alltoall).
    assert nemo_rl_run["dispatchers"] == ["MoEAlltoAllTokenDispatcher"] * 2
    counts = [re.search(r"(\d+) expert weights .*, (\d+) of them frozen", line)
              for line in nemo_rl_run["log"]]
    counts = [match.groups() for match in counts if match]
    assert counts and all(total == frozen for total, frozen in counts)


def test_nemo_rl_get_logprobs_gives_the_hf_models_logprobs(nemo_rl_run):
    assert nemo_rl_run["logprobs_max_abs"] < 1e-4


def test_nemo_rl_reference_model_gives_the_hf_models_logprobs_after_the_step(nemo_rl_run):
    assert nemo_rl_run["reference_logprobs_max_abs"] < 1e-4


def test_nemo_rl_train_step_trains_what_the_docs_say(nemo_rl_run):
    names, changed = set(nemo_rl_run["all_names"]), set(nemo_rl_run["changed"])
    trainable = set(nemo_rl_run["trainable"])
    assert 0 < nemo_rl_run["loss"] < 1e3
    experts = {name for name in names if expert_weight(name)}
    assert len(experts) == 16  # 2 layers x 4 experts x 2 projections
    assert not changed & experts  # bitwise equal after the step
    assert changed == trainable  # the step changed every parameter it trains, and only those
    if nemo_rl_run["peft"]:
        assert all(".adapter." in name for name in changed)
        assert {name for name in changed if ".mlp.experts." in name}  # the experts' adapters
    else:
        routers = {name for name in names if name.endswith(".mlp.router.weight")}
        assert routers  # NeMo-RL's recipe freezes them (freeze_moe_router: true)
        assert changed == names - experts - routers


def test_nemo_rl_resumed_worker_reloads_the_trained_policy(nemo_rl_reload):
    """A fresh worker built from the trained worker's checkpoint (NeMo-RL's save_checkpoint, then
    CheckpointManager.get_resume_paths' weights_path and optimizer_path for the constructor):
    TorchGroupedMLP experts, the trained logprobs, adapters and Adam moments, the HF checkpoint's
    expert weights."""
    result = nemo_rl_reload
    assert result["resume_paths"] == {"weights_path": "policy/weights",
                                      "optimizer_path": "policy/optimizer"}
    assert result["experts"] == ["TorchGroupedMLP", "TorchGroupedMLP"]
    assert result["provider_spec"] == "torch_experts_gpt_spec"
    assert result["reloaded_vs_trained_logprobs_max_abs"] < 1e-6
    assert result["reloaded_vs_hf_logprobs_max_abs"] > 1e-3  # the trained adapters, not zero ones
    assert result["all_names"] == result["trained_names"]
    assert any(".adapter." in name for name in result["all_names"])
    assert result["differing"] == []  # every parameter, adapters included, bitwise the trained
    assert result["expert_weights_compared"] == 16
    assert result["expert_weights_vs_hf_max_abs"] == 0.0  # the HF checkpoint's, bitwise
    assert result["moment_names"] == result["trained_moment_names"] != []  # the optimizer's too
    assert result["moments_max_abs"] == 0.0
    # Bridge's PEFT save keeps the adapters (and their Adam moments) only; the frozen base, the
    # experts' weights among them, comes back from NeMo-RL's converted HF checkpoint.
    saved = [key for key in result["saved_keys"] if not key.startswith(("rng_state", "common_"))]
    assert saved and all(".adapter." in key for key in saved)
    assert {key for key in saved if key.startswith("optimizer.state.")}
