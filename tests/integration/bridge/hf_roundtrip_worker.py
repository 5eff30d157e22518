"""Run by test_hf_roundtrip.py in its own process (Bridge's import needs a Transformer Engine
stand-in, see support.bridge_imports.import_megatron_bridge, that must not reach other tests):
imports a tiny HF Qwen3-MoE checkpoint with Megatron-Bridge into TorchGroupedMLP experts, exports
it, trains and merges adapters, and writes what it measured as JSON to argv[2].

    python tests/integration/bridge/hf_roundtrip_worker.py OUT_DIR RESULT_JSON
"""

import json
import sys
from pathlib import Path

import torch

import hf_roundtrip as example
from support.bridge_imports import import_megatron_bridge
from support.cpu_support import init_single_process_megatron


def expert_weights_match(model, original, config) -> bool:
    """Every packed expert weight equals the HF tensors it came from (read from the file):
    fc1[i] = [gate_i; up_i], fc2[i] = down_i, and each weightN is a view of the buffer."""
    for layer_idx, layer in enumerate(model.decoder.layers):
        experts = layer.mlp.experts
        if type(experts).__name__ != "TorchGroupedMLP":
            return False
        for i in range(config["num_experts"]):
            hf = f"model.layers.{layer_idx}.mlp.experts.{i}."
            fc1 = torch.cat([original[hf + "gate_proj.weight"], original[hf + "up_proj.weight"]])
            for linear, expected in ((experts.linear_fc1, fc1),
                                     (experts.linear_fc2, original[hf + "down_proj.weight"])):
                weight = getattr(linear, f"weight{i}")
                if not (torch.equal(linear.packed_weight[i], expected) and
                        weight.data_ptr() == linear.packed_weight[i].data_ptr()):
                    return False
    return True


def main(out: Path, result_path: Path) -> None:
    import_megatron_bridge()
    init_single_process_megatron(on_cpu=True)
    from safetensors.torch import load_file

    example.make_tiny_checkpoint(out / "hf_tiny", seed=3)
    original = load_file(out / "hf_tiny" / "model.safetensors")
    bridge, model = example.import_with_torch_experts(out / "hf_tiny")
    tokens = torch.randint(0, example.TINY_QWEN3_MOE["vocab_size"], (2, 16),
                           generator=torch.Generator().manual_seed(5))
    result = {"experts_match": expert_weights_match(model, original, example.TINY_QWEN3_MOE)}
    base = example.megatron_logits(model, tokens)
    result["import_logits_max_abs"] = example.max_abs(base, example.hf_logits(out / "hf_tiny", tokens))
    result["logits_scale"] = base.abs().max().item()

    exported = example.export_hf(bridge, model, out / "hf_export")
    result["export_keys_equal"] = sorted(exported) == sorted(original)
    result["export_unequal"] = [k for k in original if not torch.equal(exported.get(k), original[k])]
    reloaded = load_file(out / "hf_export" / "model.safetensors")
    result["export_file_equal"] = all(torch.equal(reloaded[k], original[k]) for k in original)

    result["losses"] = example.train_adapters(model, steps=10)
    with_adapters = example.megatron_logits(model, tokens)
    result["adapter_shift_max_abs"] = example.max_abs(with_adapters, base)
    result["merged"] = example.merge_adapters(model)
    example.export_hf(bridge, model, out / "hf_merged")
    result["merged_hf_logits_max_abs"] = example.max_abs(
        example.hf_logits(out / "hf_merged", tokens), with_adapters)
    result_path.write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
