"""docs/enable.md's Bridge route taken literally on the model as Bridge returns it, a list of
model chunks (`provide_distributed_model`, `peft(model)`): the bridge-save-merged snippet saves
it, the bridge-load-merged snippet reloads it on the CPU in FP32 with the trained logits, and a
reload without `use_cpu_init=True` is refused naming that fix; without PEFT, Megatron's optimizer
as Bridge builds it holds every parameter but the expert weights ("What trains"); the allowlist
the docs quote is the one Bridge's `instantiate` applies. Runs in a subprocess
(bridge_merged_reload_worker.py): Bridge's import needs a Transformer Engine stand-in on hosts
without TE."""

import importlib.util
import re
from pathlib import Path

import pytest

from support.bridge import run_worker
from support.doc_snippets import ENABLE_MD

pytestmark = [pytest.mark.bridge, pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("megatron.bridge") is None,
    reason="needs megatron-bridge and transformers (the Python 3.12 / megatron-core 0.19 leg)")]

WORKER = Path(__file__).parent / "bridge_merged_reload_worker.py"
MERGED = [f"decoder.layers.{i}.{name}" for i in (0, 1) for name in (
    "self_attention.linear_proj", "self_attention.linear_qkv", "mlp.experts.linear_fc1",
    "mlp.experts.linear_fc2")]
EXPERT_WEIGHTS = [f"decoder.layers.{i}.mlp.experts.linear_fc{j}.weight{e}"
                  for i in (0, 1) for j in (1, 2) for e in range(4)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return run_worker(WORKER, tmp_path_factory.mktemp("bridge_merged_reload"), hide_gpus=True)


def test_bridge_save_merged_snippet_saves_the_list_bridge_returns(run):
    assert run["provided"] == run["after_peft"] == "list" and run["chunks"] == 1
    assert run["experts"] == ["TorchGroupedMLP"]
    assert run["losses"][-1] < run["losses"][0]
    assert run["merged"] == MERGED
    assert run["merged_logits_max_abs"] < 1e-5
    # The snippet's earlier form, save_megatron_model([model], ...), on that list:
    assert run["list_in_a_list_error"] == \
        "RuntimeError: _get_attr_wrapped_model given a list of models"


def test_bridge_load_merged_snippet_reloads_the_trained_model_on_the_cpu(run):
    assert run["reloaded"] == "list" and run["reloaded_experts"] == ["TorchGroupedMLP"]
    assert run["reloaded_logits_max_abs"] < 1e-5


def test_fp32_reload_without_use_cpu_init_is_refused_naming_it(run):
    error = run["reload_without_cpu_init_error"]
    assert error.startswith("TorchExpertsConfigError: moe_expert_gemm_backend='torch' does not "
                            "support params_dtype=torch.float32: ")
    assert "load_megatron_model(path, use_cpu_init=True)" in error


def test_without_peft_bridge_s_optimizer_holds_everything_but_the_expert_weights(run):
    optimizer = run["optimizer_without_peft"]
    assert optimizer["left"] == EXPERT_WEIGHTS
    assert optimizer["held"] == sorted(set(run["all_parameters"]) - set(EXPERT_WEIGHTS))
    assert optimizer["held"] == run["requires_grad_without_peft"]
    assert any(".mlp.router." in name for name in optimizer["held"])


def test_the_allowlist_the_docs_quote_is_bridge_s(run):
    text = " ".join(ENABLE_MD.read_text().split())
    sentence = re.search(r"refuses targets outside its allowlist: (.*?) `InstantiationException",
                         text).group(1)
    assert sorted(re.findall(r"`([\w.]+\.)`", sentence)) == run["allowlist"]
