"""Bring your own checkpoint: a Hugging Face Qwen3-MoE checkpoint imported with Megatron-Bridge
into a model whose experts are TorchGroupedMLP, LoRA adapters trained on it, and the result
exported back to Hugging Face format. On the CPU (a CUDA host too), FP32, through the CPU launcher;
needs megatron-bridge and transformers (the Python 3.12 / megatron-core 0.19 and 0.20 legs).

    python tests/support/run_on_cpu.py examples/hf_roundtrip.py [--out-dir runs/hf_roundtrip] [--steps 20]

1. Makes a tiny Qwen3-MoE checkpoint locally (random weights from a small config, no download).
2. `AutoBridge.from_hf_pretrained(path).to_megatron_provider()`, with the provider naming the
   launcher entry point `torch_experts_gpt_spec` (TorchGroupedMLP experts; the provider's
   run_config.yaml keeps it); Bridge's pre-wrap hook loads the HF weights into the packed expert
   buffers.
3. Compares every expert weight with the HF tensor and the logits with the HF model's forward.
4. Exports with `bridge.export_hf_weights` (written out with the checkpoint's config, as
   `bridge.save_hf_pretrained` does) and compares every tensor with the original file.
5. Trains LoRA adapters (`apply_lora`) a few steps, folds them into the base weights, exports
   again and runs the exported checkpoint with transformers: its logits are the Megatron
   model's (with adapters).
6. Imports the checkpoint again and trains Megatron-Bridge's own LoRA (per-expert adapters on
   the experts) a few steps, exports the adapters as a Hugging Face PEFT adapter
   (`bridge.save_hf_adapter`) and runs the original checkpoint with that adapter through the
   `peft` library (skipped when `peft` is not installed): its logits are the Megatron model's.
"""

import argparse
import importlib.util
from pathlib import Path

import torch

from mcore_torch_experts import apply_lora, lora_parameters, register_with_megatron_bridge
from mcore_torch_experts.lora import LoRALinear, PerExpertLoRAAdapter
from mcore_torch_experts.specs import torch_experts_gpt_spec
from single_process import init_megatron, on_cpu, shutdown_megatron

TINY_QWEN3_MOE = dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                      moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                      max_position_embeddings=64, tie_word_embeddings=False)
LORA_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def make_tiny_checkpoint(path: Path, seed: int = 0) -> None:
    """A Qwen3-MoE checkpoint (config, FP32 safetensors) with random weights from a small config."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY_QWEN3_MOE)).save_pretrained(path)


def import_with_torch_experts(path: Path):
    """(bridge, model): Bridge's provider for the checkpoint, with TorchGroupedMLP experts, builds
    the GPTModel on the CPU in FP32 and loads the HF weights (Bridge's pre-wrap hook)."""
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(path)  # an FP32 checkpoint: an FP32 model
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.moe_grouped_gemm = True
    provider.transformer_layer_spec = torch_experts_gpt_spec
    # CPU, one process (on a CUDA host too): local modules, the allgather dispatcher and unfused
    # kernels (Bridge turns gradient-accumulation fusion on wherever TE is importable).
    provider.transformer_impl = "local"
    provider.gradient_accumulation_fusion = False
    provider.moe_token_dispatcher_type = "allgather"
    provider.moe_permute_fusion = False
    provider.masked_softmax_fusion = False
    provider.cross_entropy_loss_fusion = False
    provider.finalize()
    model, = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True,
                                                mixed_precision_wrapper=None)
    return bridge, model


def export_hf(bridge, model, path: Path) -> dict:
    """Bridge's export (`export_hf_weights`: every HF tensor, experts split per expert) written as
    a Hugging Face checkpoint with the imported checkpoint's config. Returns {HF name: tensor}.

    What `bridge.save_hf_pretrained` does, minus its unconditional import of nvidia-modelopt
    (Megatron-Bridge 0.6.2, `save_hf_weights`), which a CPU host need not have."""
    from safetensors.torch import save_file

    tensors = {name: tensor.contiguous() for name, tensor in
               bridge.export_hf_weights([model], cpu=True, show_progress=False)}
    bridge.hf_pretrained.save_artifacts(path)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return tensors


def causal_inputs(tokens: torch.Tensor):
    """Positions [B, S] and the causal mask [1, 1, S, S] (True = masked) for tokens [B, S]."""
    batch, seq = tokens.shape
    positions = torch.arange(seq).expand(batch, seq)
    return positions, torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)


@torch.no_grad()
def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """[B, S, V] logits of the Megatron model, eval mode."""
    return model.eval()(tokens, *causal_inputs(tokens))


@torch.no_grad()
def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    """[B, S, V] logits of the checkpoint at `path` run by transformers."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf(input_ids=tokens).logits


def train_adapters(model, steps: int, lr: float = 1e-2, seed: int = 0) -> list:
    """LoRA (rank 8, per-expert adapters on the experts) trained `steps` Adam steps on random
    next-token data over a frozen base; returns the losses."""
    torch.manual_seed(seed)
    apply_lora(model, LORA_TARGETS, rank=8, alpha=16, expert_adapter="per_expert")
    return train(model, lora_parameters(model).values(), steps, lr)


def apply_bridge_lora(model, seed: int = 0, **layout):
    """Megatron-Bridge's LoRA (rank 8, alpha 16) on attention and experts, expert adapters laid
    out by `layout` (e.g. `share_expert_adapters=False`); returns the LoRA object, which
    `bridge.save_hf_adapter` takes as the adapter's config."""
    from megatron.bridge.peft.lora import LoRA

    register_with_megatron_bridge()
    torch.manual_seed(seed)
    lora = LoRA(target_modules=LORA_TARGETS, dim=8, alpha=16, **layout)
    lora(model)
    return lora


def train(model, parameters, steps: int, lr: float = 1e-2) -> list:
    """`steps` Adam steps of `parameters` on random next-token data; returns the losses."""
    optimizer = torch.optim.Adam(parameters, lr=lr)
    data = torch.randint(0, TINY_QWEN3_MOE["vocab_size"], (4, 17))
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(data[:, :-1], *causal_inputs(data[:, :-1]), labels=data[:, 1:]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def hf_peft_logits(path: Path, adapter_path: Path, tokens: torch.Tensor) -> torch.Tensor:
    """[B, S, V] logits of the checkpoint at `path` with the Hugging Face PEFT adapter at
    `adapter_path` loaded by the `peft` library, run by transformers."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return PeftModel.from_pretrained(hf, adapter_path).eval()(input_ids=tokens).logits


@torch.no_grad()
def merge_adapters(model) -> int:
    """Fold every LoRA adapter into its base weight (W += B @ A * alpha / rank; per expert for
    expert linears) and put the base module back in the wrapper's place. Returns the count."""
    wrappers = [name for name, module in model.named_modules() if isinstance(module, LoRALinear)]
    for name in wrappers:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        lora = getattr(parent, child)
        a, b = lora.adapter.linear_in.weight, lora.adapter.linear_out.weight
        if isinstance(lora.adapter, PerExpertLoRAAdapter):
            for i, weight in enumerate(lora.to_wrap.expert_weights()):
                weight.add_((b[i] @ a[i]).to(weight.dtype), alpha=lora.adapter.scale)
        elif hasattr(lora.to_wrap, "expert_weights"):  # one adapter shared by all experts
            for weight in lora.to_wrap.expert_weights():
                weight.add_((b @ a).to(weight.dtype), alpha=lora.adapter.scale)
        else:
            lora.to_wrap.weight.add_((b @ a).to(lora.to_wrap.weight.dtype),
                                     alpha=lora.adapter.scale)
        setattr(parent, child, lora.to_wrap)
    return len(wrappers)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", default="runs/hf_roundtrip")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    out = Path(args.out_dir)
    if not on_cpu():
        raise SystemExit("hf_roundtrip.py runs on the CPU (a tiny FP32 model): "
                         "python tests/support/run_on_cpu.py examples/hf_roundtrip.py")
    init_megatron()
    from safetensors.torch import load_file

    make_tiny_checkpoint(out / "hf_tiny")
    original = load_file(out / "hf_tiny" / "model.safetensors")
    bridge, model = import_with_torch_experts(out / "hf_tiny")
    experts = model.decoder.layers[0].mlp.experts
    print(f"experts: {type(experts).__name__}, fc1 packed {list(experts.linear_fc1.packed_weight.shape)}")

    tokens = torch.randint(0, TINY_QWEN3_MOE["vocab_size"], (2, 16),
                           generator=torch.Generator().manual_seed(1))
    base_logits = megatron_logits(model, tokens)
    print(f"import: logits max |Megatron - HF| = {max_abs(base_logits, hf_logits(out / 'hf_tiny', tokens)):.3e}")

    exported = export_hf(bridge, model, out / "hf_export")
    exact = exported.keys() == original.keys() and all(
        torch.equal(exported[k], original[k]) for k in original)
    print(f"export: {len(exported)} tensors, {'all equal' if exact else 'DIFFERENT'} to the original")

    losses = train_adapters(model, args.steps)
    print(f"adapters: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps")
    lora_logits = megatron_logits(model, tokens)
    merged = merge_adapters(model)
    print(f"merged {merged} adapters: logits max |merged - with adapters| = "
          f"{max_abs(megatron_logits(model, tokens), lora_logits):.3e}")
    export_hf(bridge, model, out / "hf_merged")
    print(f"merged export: logits max |HF - Megatron with adapters| = "
          f"{max_abs(hf_logits(out / 'hf_merged', tokens), lora_logits):.3e}")

    bridge, model = import_with_torch_experts(out / "hf_tiny")
    lora = apply_bridge_lora(model, share_expert_adapters=False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    losses = train(model, trainable, args.steps)
    print(f"Bridge LoRA: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps")
    lora_logits = megatron_logits(model, tokens)
    bridge.save_hf_adapter([model], out / "hf_adapter", peft_config=lora, show_progress=False)
    if importlib.util.find_spec("peft") is None:
        print("HF PEFT adapter written; peft is not installed, so it is not run")
    else:
        peft_logits = hf_peft_logits(out / "hf_tiny", out / "hf_adapter", tokens)
        print(f"HF PEFT adapter: logits max |HF + adapter - Megatron with adapters| = "
              f"{max_abs(peft_logits, lora_logits):.3e}")
    if not exact:
        raise SystemExit("the exported tensors differ from the original checkpoint")


if __name__ == "__main__":
    try:
        main()
    finally:
        shutdown_megatron()
