"""Megatron-Bridge's LoRA on TorchGroupedMLP experts of a Hugging Face checkpoint imported with
AutoBridge, exported the ways Bridge offers: as a Hugging Face PEFT adapter
(`AutoBridge.save_hf_adapter`, run with the `peft` library over the original checkpoint) and
merged into the weights (`export_hf_weights`, and `merge_bridge_lora` then export); transformers
must reproduce the Megatron logits with the adapters live (FP32). Saved and reloaded with
Bridge's own checkpointing (docs/enable.md, "Saving and reloading trained Bridge adapters"):
merged (`merge_bridge_lora`, save_megatron_model, load_megatron_model) and adapters kept
(save_checkpoint with cfg.peft, the PEFT pre-wrap hook, load_checkpoint) give the trained
logits; without either, the untrained ones. Runs in a subprocess
(hf_bridge_lora_worker.py): Bridge's import needs a Transformer Engine stand-in on hosts without
TE."""

import importlib.util
from pathlib import Path

import pytest

from support.bridge import run_worker

pytestmark = [pytest.mark.bridge, pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("megatron.bridge") is None,
    reason="needs megatron-bridge and transformers (the Python 3.12 / megatron-core 0.19 leg)")]
needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="needs the peft library to load the HF PEFT adapter")

WORKER = Path(__file__).parent / "hf_bridge_lora_worker.py"
LAYOUTS = ["shared", "per_expert", "shared_outer", "per_expert_normalized"]
ALL_LINEARS = [f"decoder.layers.{i}.{name}" for i in (0, 1) for name in (
    "self_attention.linear_proj", "self_attention.linear_qkv", "mlp.experts.linear_fc1",
    "mlp.experts.linear_fc2")]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    results = run_worker(WORKER, tmp_path_factory.mktemp("hf_bridge_lora"))
    for layout, result in results.items():  # the figures, for the record (pytest -s)
        print(layout, {k: f"{v:.1e}" for k, v in result.items()
                       if k.endswith("max_abs") and isinstance(v, float)})
    return results


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
    assert result["merged"] == ALL_LINEARS  # attention adapters too
    assert result["merged_megatron_logits_max_abs"] < 1e-5
    assert result["merged_hf_logits_max_abs"] < 1e-5


@pytest.mark.parametrize("layout", ["shared", "per_expert", "per_expert_normalized"])
def test_unmerged_bridge_checkpoint_reloads_the_untrained_model(exported, layout):
    """Why the two routes exist: save_megatron_model with the adapters live, then
    load_megatron_model (a model without adapters), gives the untrained model back."""
    result = exported[layout]
    assert result["unmerged_reloaded_vs_untrained_max_abs"] < 1e-5
    assert result["unmerged_reloaded_vs_trained_max_abs"] > 0.1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_merged_bridge_checkpoint_reloads_the_trained_model(exported, layout):
    """The docs' LoRA (attention and experts) trained, `merge_bridge_lora`, Bridge's
    save_megatron_model, Bridge's load_megatron_model: the trained logits (FP32), not the
    untrained ones."""
    result = exported[layout]
    assert result["merged_reloaded_logits_max_abs"] < 1e-5
    assert result["merged_reloaded_vs_untrained_max_abs"] > 0.1


@pytest.mark.parametrize("layout", ["shared", "per_expert", "per_expert_normalized"])
def test_adapter_only_bridge_checkpoint_resumes_the_trained_model(exported, layout):
    """Bridge's finetune route: save_checkpoint with cfg.peft writes the adapter states only (the
    attention and expert adapters, no base weight); a fresh model from the provider rebuilt by
    load_model_config, Bridge's PEFT pre-wrap hook (pretrained checkpoint loaded, the same LoRA
    applied: the untrained logits), then load_checkpoint: the trained logits (FP32)."""
    result = exported[layout]
    assert "adapters_resumed_error" not in result, result.get("adapters_resumed_error")
    keys = result["adapter_checkpoint_keys"]
    assert keys and all(".adapter." in key for key in keys)
    assert {"self_attention.linear_qkv", "self_attention.linear_proj", "linear_fc1",
            "linear_fc2"} <= {key.split(".adapter.")[0].split("layers.")[1].replace(
                "mlp.experts.experts.", "") for key in keys}
    assert result["resumed_before_load_vs_untrained_max_abs"] < 1e-5
    assert result["adapters_resumed_logits_max_abs"] < 1e-5
    assert result["adapters_resumed_vs_untrained_max_abs"] > 0.1


def test_shared_outer_adapter_checkpoint_is_bridge_s_own_limit(exported):
    """Bridge 0.6.2's PackedPerExpertLinear.sharded_state_dict omits an argument of its own
    helper (test_bridge_lora.py pins it on any base): its adapter-only save cannot run."""
    error = ("TypeError: _make_grouped_expert_sharded_tensor() missing 1 required keyword-only "
             "argument: 'pg_collection'")
    assert exported["shared_outer"]["adapters_resumed_error"] == error
    assert exported["shared_outer"]["unmerged_save_error"] == error  # save_megatron_model too
