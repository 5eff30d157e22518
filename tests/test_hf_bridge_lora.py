"""Megatron-Bridge's LoRA on TorchGroupedMLP experts of a Hugging Face checkpoint imported with
AutoBridge, exported the ways Bridge offers: as a Hugging Face PEFT adapter
(`AutoBridge.save_hf_adapter`, run with the `peft` library over the original checkpoint) and
merged into the weights (`export_hf_weights`, and `merge_bridge_lora` then export); transformers
must reproduce the Megatron logits with the adapters live (FP32). Runs in a subprocess
(hf_bridge_lora_worker.py): Bridge's import needs a Transformer Engine stand-in on hosts without
TE."""

import importlib.util
from pathlib import Path

import pytest

from bridge_support import run_worker

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("megatron.bridge") is None,
    reason="needs megatron-bridge and transformers (the Python 3.12 / megatron-core 0.19 leg)")
needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="needs the peft library to load the HF PEFT adapter")

WORKER = Path(__file__).with_name("hf_bridge_lora_worker.py")
LAYOUTS = ["shared", "per_expert", "shared_outer", "per_expert_normalized"]
EXPERT_LINEARS = [f"decoder.layers.{i}.mlp.experts.linear_fc{j}" for i in (0, 1) for j in (1, 2)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return run_worker(WORKER, tmp_path_factory.mktemp("hf_bridge_lora"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bridge_lora_trains_on_the_imported_experts(exported, layout):
    result = exported[layout]
    assert result["adapter_wrappers"] == 2 * 4  # 2 layers x (qkv, proj, experts fc1, fc2)
    assert result["trainable_are_adapters"] and result["expert_adapters"] == 2 * 2 * 2
    assert result["losses"][-1] < result["losses"][0]
    assert result["adapter_shift_max_abs"] > 0.1  # the adapters changed the model


@needs_peft
@pytest.mark.parametrize("layout", ["shared", "per_expert"])
def test_hf_peft_adapter_reproduces_the_megatron_logits(exported, layout):
    result = exported[layout]
    assert {"gate_proj", "up_proj", "down_proj"} <= set(result["adapter_target_modules"])
    assert result["peft_logits_max_abs"] < 1e-5


def test_shared_outer_hf_peft_adapter_is_bridge_s_own_limit(exported):
    """Bridge 0.6.2 exports a shared-outer adapter's shared side as one [1, ...] tensor under the
    expert-agnostic name (SGLang's layout) and the other side per expert; `save_hf_adapter`'s
    conversion to the PEFT layout then finds one side only. The tensors are those of any grouped
    base (TE grouped linears alike)."""
    assert exported["shared_outer"]["save_hf_adapter_error"] == (
        "ValueError: Incomplete adapter export for target parameter: "
        "model.layers.0.mlp.experts.down_proj")


@needs_peft
def test_normalized_rank_hf_peft_adapter_is_the_hf_side_s_limit(exported):
    """With `normalize_moe_lora` the expert adapters have rank dim // topk, which Bridge writes as
    `rank_pattern` per expert module; PEFT (0.21, `utils/transformers_weight_conversion.py`),
    fusing the per-expert adapters into transformers 5's packed `gate_up_proj` / `down_proj`
    parameters, sizes them from `r` and refuses the tensors."""
    error = exported["per_expert_normalized"]["peft_error"]
    assert error.startswith("RuntimeError: Error(s) in loading state_dict for PeftModelForCausalLM")
    assert ("size mismatch for base_model.model.model.layers.0.mlp.experts.lora_A.default.weight: "
            "copying a param with shape torch.Size([16, 32]) from checkpoint, the shape in "
            "current model is torch.Size([32, 32])") in error


@pytest.mark.parametrize("layout", LAYOUTS)
def test_merged_exports_reproduce_the_megatron_logits(exported, layout):
    result = exported[layout]
    assert result["bridge_merged_hf_logits_max_abs"] < 1e-5  # Bridge merges while exporting
    assert result["merged"] == EXPERT_LINEARS
    assert result["merged_megatron_logits_max_abs"] < 1e-5
    assert result["merged_hf_logits_max_abs"] < 1e-5
