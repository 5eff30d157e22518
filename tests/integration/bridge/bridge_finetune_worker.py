"""Run by test_bridge_finetune.py under torchrun (one process, gloo, CPU): Megatron-Bridge's own
`finetune()` with the provider settings of docs/enable.md (`transformer_layer_spec =
torch_experts_gpt_spec`, `moe_grouped_gemm = True`) and Bridge's LoRA on linear_qkv, linear_proj,
linear_fc1 and linear_fc2, in the order of Bridge's own LoRA functional tests:

- "pretrain": Bridge's `pretrain()` with Bridge's local spec (SequentialMLP experts, every weight
  training) for one step, saved as a torch_dist checkpoint: the finetunes' pretrained checkpoint;
- "control": `finetune()` of it with the same stock spec;
- "ours": `finetune()` of it with the documented settings;
- "ours-first-half": the same, stopped half-way and saved (Bridge's adapter-only checkpoint);
- "ours-resumed": the same again, resumed from that save.

The process group is made here first (gloo), as Bridge's functional tests make theirs; the CPU
patch table (support.cpu_support: `megatron_patches`, `megatron_lm_patches`,
`megatron_bridge_patches`) is applied and tensors asked for on CUDA are made on the CPU. Writes
each phase's losses, learning rates and what the model trains as JSON to argv[2].

    torchrun --nproc-per-node 1 tests/integration/bridge/bridge_finetune_worker.py OUT_DIR RESULT_JSON
"""

import json
import sys
from pathlib import Path

import torch

from support.bridge_finetune import Phase, Schedule, finetune_config
from support.bridge_imports import (
    import_megatron_bridge,
    import_megatron_bridge_training,
)
from support.cpu_support import (
    CudaTensorsOnTheCpu,
    apply,
    megatron_bridge_patches,
    megatron_lm_patches,
    megatron_patches,
)

ITERS = 4
# A tiny GPT-MoE (2 layers, 4 experts of 32, top-2, SwiGLU, RoPE, GQA), with what a CPU host
# needs: local modules, no fused kernels, the allgather dispatcher. BF16 (`bf16_mixed`), as on
# the GPU.
MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=128, num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
             moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=1e-3,
             normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
             position_embedding_type="rope", share_embeddings_and_output_weights=False,
             hidden_dropout=0.0, attention_dropout=0.0, vocab_size=128,
             make_vocab_size_divisible_by=128, seq_length=16, init_method_std=0.02)
CPU_MODEL = dict(transformer_impl="local", persist_layer_norm=False,
                 gradient_accumulation_fusion=False, masked_softmax_fusion=False,
                 bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
                 cross_entropy_loss_fusion=False)
SEQUENCES, MICRO_BATCH = 4, 2
LORA_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
PHASES = {
    # name: (experts, train_iters, what it loads, where it saves)
    "pretrain": ("stock", 1, None, "pretrained"),
    "control": ("stock", ITERS, None, None),
    "ours": ("torch", ITERS, None, None),
    "ours-first-half": ("torch", ITERS // 2, None, "lora_split"),
    "ours-resumed": ("torch", ITERS, "lora_split", "lora_split"),
}


def config(phase: str, out: Path):
    """Bridge's ConfigContainer for one phase, built as Bridge's own LoRA tests build theirs."""
    import torch.nn.functional as F
    from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec
    from megatron.bridge.peft.lora import LoRA

    experts, train_iters, load, save = PHASES[phase]
    provider = GPTModelProvider(**MODEL, **CPU_MODEL, activation_func=F.silu)
    if experts == "torch":  # docs/enable.md, "Megatron-Bridge"
        from mcore_torch_experts.specs import torch_experts_gpt_spec

        provider.transformer_layer_spec = torch_experts_gpt_spec
        provider.moe_grouped_gemm = True
    else:  # Bridge's spec without Transformer Engine: Megatron's SequentialMLP experts
        provider.transformer_layer_spec = local_layer_spec
    finetuning = phase != "pretrain"
    schedule = Schedule(lr=1e-2 if finetuning else 1e-3, min_lr=1e-4, warmup_iters=1,
                        decay_iters=ITERS, global_batch_size=SEQUENCES,
                        micro_batch_size=MICRO_BATCH, distributed_optimizer=False)
    return finetune_config(provider, Phase(train_iters, load, save, finetuning), schedule, out,
                           peft=LoRA(target_modules=LORA_TARGETS, dim=8, alpha=16),
                           distributed_backend="gloo")


def run(phase: str, out: Path) -> dict:
    """One phase: Bridge's finetune() (pretrain() for the stock pretrain) with a callback that
    records each step's loss and learning rate and what the model trains."""
    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.finetune import finetune
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    class Record(Callback):
        def __init__(self):
            self.steps, self.model = [], {}

        def on_train_start(self, context):
            named = [(n, p) for chunk in context.model for n, p in chunk.named_parameters()]
            trained = [n for n, p in named if p.requires_grad]
            self.model = dict(
                experts=sorted({type(m).__name__ for chunk in context.model
                                for m in chunk.modules() if type(m).__name__.endswith("MLP")
                                and hasattr(m, "num_local_experts")}),
                parameters=len(named), trained=len(trained),
                trained_non_adapter=[n for n in trained if ".adapter." not in n],
                expert_weights_trained=sum(1 for n, p in named if ".experts." in n
                                           and ".adapter." not in n and p.requires_grad),
                adapters=sum(1 for n in trained if ".adapter." in n),
                start_step=context.state.train_state.step)

        def on_train_step_end(self, context):
            loss = context.loss_dict.get("lm loss") if context.loss_dict else None
            self.steps.append(dict(step=context.state.train_state.step,
                                   loss=None if loss is None else float(loss),
                                   lr=context.optimizer.param_groups[0]["lr"]))

    record = Record()
    cfg = config(phase, out)
    (pretrain if phase == "pretrain" else finetune)(cfg, forward_step, callbacks=[record])
    return dict(model=record.model, steps=record.steps)


def main() -> None:
    out, result_path = Path(sys.argv[1]), Path(sys.argv[2])
    import_megatron_bridge()
    import_megatron_bridge_training()
    apply(megatron_lm_patches() + megatron_bridge_patches())
    apply(megatron_patches(on_cpu=True))
    torch.distributed.init_process_group("gloo")
    results = {}
    with CudaTensorsOnTheCpu():
        for phase in PHASES:
            results[phase] = run(phase, out)
    result_path.write_text(json.dumps(results, indent=1))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
