"""Run by test_hf_bridge_lora.py in its own process (Bridge's import needs a Transformer Engine
stand-in, see examples/cpu_support.import_megatron_bridge, that must not reach other tests).

For each expert-adapter layout of Megatron-Bridge's LoRA: imports a tiny HF Qwen3-MoE checkpoint
with Megatron-Bridge into TorchGroupedMLP experts, applies Bridge's LoRA to attention and experts,
trains it a few steps, and exports the adapters three ways, each compared with the Megatron
logits with adapters live:
- as a Hugging Face PEFT adapter (`bridge.save_hf_adapter`), run with the `peft` library over the
  original checkpoint (when `peft` is installed);
- merged into the base weights by Bridge's own export (`export_hf_weights`);
- folded into the packed expert weights by `merge_bridge_lora`, then exported.
Writes what it measured (or the error each step raised) as JSON to argv[2].

    python tests/hf_bridge_lora_worker.py OUT_DIR RESULT_JSON
"""

import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from cpu_support import import_megatron_bridge, init_single_process_megatron  # noqa: E402
import hf_roundtrip as example  # noqa: E402

LAYOUTS = {  # Bridge LoRA arguments of each expert-adapter layout
    "shared": {},
    "per_expert": dict(share_expert_adapters=False),
    "shared_outer": dict(experts_shared_outer_loras=True),
    "per_expert_normalized": dict(share_expert_adapters=False, normalize_moe_lora=True),
}
STEPS = 5


def error_text(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def measure(out: Path, layout: str, tokens: torch.Tensor) -> dict:
    from megatron.bridge import AutoBridge

    from mcore_torch_experts.bridge import merge_bridge_lora

    bridge, model = example.import_with_torch_experts(out / "hf_tiny")
    base = example.megatron_logits(model, tokens)
    lora = example.apply_bridge_lora(model, **LAYOUTS[layout])
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    result = {"adapter_wrappers": sum(type(m).__name__ == "LoRALinear" for m in model.modules()),
              "trainable_are_adapters": all(".adapter." in n for n in trainable),
              "expert_adapters": sum(".experts.linear_fc" in n for n in trainable),
              "losses": example.train(model, trainable.values(), STEPS)}
    live = example.megatron_logits(model, tokens)
    result["adapter_shift_max_abs"] = example.max_abs(live, base)

    try:
        bridge.save_hf_adapter([model], out / layout / "hf_adapter", peft_config=lora,
                               show_progress=False)
    except Exception as error:  # recorded: the test pins Bridge's failure
        result["save_hf_adapter_error"] = error_text(error)
    else:
        config = json.loads((out / layout / "hf_adapter" / "adapter_config.json").read_text())
        result["adapter_target_modules"] = config["target_modules"]
        if importlib.util.find_spec("peft") is not None:
            try:
                peft_logits = example.hf_peft_logits(out / "hf_tiny", out / layout / "hf_adapter",
                                                     tokens)
                result["peft_logits_max_abs"] = example.max_abs(peft_logits, live)
            except Exception as error:  # recorded: the test pins the HF side's failure
                result["peft_error"] = error_text(error)

    example.export_hf(bridge, model, out / layout / "hf_bridge_merged")
    result["bridge_merged_hf_logits_max_abs"] = example.max_abs(
        example.hf_logits(out / layout / "hf_bridge_merged", tokens), live)

    result["merged"] = merge_bridge_lora(model)
    result["merged_megatron_logits_max_abs"] = example.max_abs(
        example.megatron_logits(model, tokens), live)
    exporter = AutoBridge.from_hf_pretrained(out / "hf_tiny")
    example.export_hf(exporter, model, out / layout / "hf_merged")
    result["merged_hf_logits_max_abs"] = example.max_abs(
        example.hf_logits(out / layout / "hf_merged", tokens), live)
    return result


def main(out: Path, result_path: Path) -> None:
    import_megatron_bridge()
    init_single_process_megatron(on_cpu=True)
    example.make_tiny_checkpoint(out / "hf_tiny", seed=3)
    tokens = torch.randint(0, example.TINY_QWEN3_MOE["vocab_size"], (2, 16),
                           generator=torch.Generator().manual_seed(5))
    results = {layout: measure(out, layout, tokens) for layout in LAYOUTS}
    result_path.write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
