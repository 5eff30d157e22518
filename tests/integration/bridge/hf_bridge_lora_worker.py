"""Run by test_hf_bridge_lora.py in its own process (Bridge's import needs a Transformer Engine
stand-in, see support.bridge_imports.import_megatron_bridge, that must not reach other tests).

For each expert-adapter layout of Megatron-Bridge's LoRA: imports a tiny HF Qwen3-MoE checkpoint
with Megatron-Bridge into TorchGroupedMLP experts (saved with save_megatron_model as the
finetune's pretrained checkpoint), applies Bridge's LoRA to the docs' four targets (the
per-expert layout with docs/enable.md's bridge-peft snippet), trains it a few steps, then:
- adapters kept: Bridge's save_checkpoint with cfg.peft (snippet bridge-peft-checkpoints), a
  fresh model through Bridge's PEFT pre-wrap hook, load_checkpoint;
- save_megatron_model with the adapters live, load_megatron_model (what the routes are for);
- merged: snippet bridge-save-merged (merge_bridge_lora, save_megatron_model), then
  load_megatron_model;
and exports the adapters three ways, each compared with the Megatron logits with adapters
live:
- as a Hugging Face PEFT adapter (`bridge.save_hf_adapter`), run with the `peft` library over the
  original checkpoint (when `peft` is installed);
- merged into the base weights by Bridge's own export (`export_hf_weights`);
- folded into the weights by `merge_bridge_lora`, then exported.
Writes what it measured (or the error each step raised) as JSON to argv[2].

    python tests/integration/bridge/hf_bridge_lora_worker.py OUT_DIR RESULT_JSON
"""

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import torch

import hf_roundtrip as example
from support.bridge_imports import (
    import_megatron_bridge,
    import_megatron_bridge_checkpointing,
)
from support.cpu_support import init_single_process_megatron
from support.doc_snippets import run_snippet

LAYOUTS = {  # Bridge LoRA arguments of each expert-adapter layout
    "shared": {},
    "per_expert": dict(share_expert_adapters=False),
    "shared_outer": dict(experts_shared_outer_loras=True),
    "per_expert_normalized": dict(share_expert_adapters=False, normalize_moe_lora=True),
}
STEPS = 5


def error_text(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def bridge_state(model_config):
    """Bridge's GlobalState with the ConfigContainer `save_megatron_model` builds (no optimizer,
    RNG or dataset); the bridge-peft-checkpoints snippet then sets what a finetune recipe sets."""
    from megatron.bridge.training.config import CheckpointConfig, ConfigContainer, LoggerConfig
    from megatron.bridge.training.state import GlobalState
    from megatron.core.optimizer import OptimizerConfig

    state = GlobalState()
    state.cfg = ConfigContainer(
        model=model_config, train=None, optimizer=OptimizerConfig(use_distributed_optimizer=False),
        ddp=None, scheduler=None, dataset=None, logger=LoggerConfig(), tokenizer=None, dist=None,
        checkpoint=CheckpointConfig(async_save=False, save_optim=False, save_rng=False,
                                    ckpt_format="torch_dist",
                                    dist_ckpt_optim_fully_reshardable=True))
    return state


def same_lora(lora):
    """A new LoRA with `lora`'s arguments (what a resumed finetune builds from its config)."""
    return type(lora)(**{f.name: getattr(lora, f.name) for f in dataclasses.fields(lora) if f.init})


def adapter_checkpoint_keys(path: Path) -> list:
    """The model tensors Bridge wrote to the checkpoint at `path` (its dist-checkpoint metadata)."""
    from megatron.core import dist_checkpointing

    metadata = dist_checkpointing.load_tensors_metadata(str(path / "iter_0000000"))
    return sorted(metadata)


def reload_megatron(path: Path):
    """Bridge's load_megatron_model (load_model_config, the provider rebuilt, the weights loaded)
    of the checkpoint Bridge wrote at `path`."""
    from megatron.bridge.training.model_load_save import load_megatron_model

    loaded = load_megatron_model(str(path / "iter_0000000"), use_cpu_init=True,
                                 skip_temp_dist_context=True)
    return loaded[0] if isinstance(loaded, list) else loaded


def measure(out: Path, layout: str, tokens: torch.Tensor) -> dict:
    from megatron.bridge import AutoBridge
    from megatron.bridge.training import checkpointing, setup
    from megatron.bridge.training.model_load_save import load_model_config, save_megatron_model

    bridge, model = example.import_with_torch_experts(out / "hf_tiny")
    base = example.megatron_logits(model, tokens)
    save_megatron_model([model], out / layout / "base")  # the finetune's pretrained checkpoint
    if layout == "per_expert":  # the docs' snippet (docs/enable.md, bridge-peft)
        torch.manual_seed(0)
        lora = run_snippet("bridge-peft", model=model)["peft"]
    else:  # the same targets, the layout's expert adapters
        lora = example.apply_bridge_lora(model, **LAYOUTS[layout])
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    result = {"adapter_wrappers": sum(type(m).__name__ == "LoRALinear" for m in model.modules()),
              "trainable_are_adapters": all(".adapter." in n for n in trainable),
              "expert_adapters": sum(".experts.linear_fc" in n for n in trainable),
              "losses": example.train(model, trainable.values(), STEPS)}
    live = example.megatron_logits(model, tokens)
    result["adapter_shift_max_abs"] = example.max_abs(live, base)

    # Adapters kept, Bridge's finetune route (docs/enable.md, bridge-peft-checkpoints): with
    # cfg.peft set, save_checkpoint writes the adapter states only; resuming, the provider
    # rebuilt from the pretrained checkpoint builds a fresh model whose PEFT pre-wrap hook
    # (Bridge's `_create_peft_pre_wrap_hook`) loads that checkpoint and applies a LoRA of the
    # same arguments; setup turns `finetune` off again and load_checkpoint loads the adapters
    # (Bridge's PEFT resume: the state dict filtered to adapters, a non-strict load).
    run_dir, base_checkpoint = str(out / layout / "run"), str(out / layout / "base")
    try:
        state = bridge_state(model.config)
        run_snippet("bridge-peft-checkpoints", cfg=state.cfg, peft=lora, run_dir=run_dir,
                    base_checkpoint=base_checkpoint)
        checkpointing.save_checkpoint(state=state, model=[model], optimizer=None,
                                      opt_param_scheduler=None,
                                      num_floating_point_operations_so_far=0,
                                      callback_manager=None)
        result["adapter_checkpoint_keys"] = adapter_checkpoint_keys(Path(run_dir))
        provider, _ = load_model_config(f"{base_checkpoint}/iter_0000000")
        state = bridge_state(provider)
        run_snippet("bridge-peft-checkpoints", cfg=state.cfg, peft=same_lora(lora),
                    run_dir=run_dir, base_checkpoint=base_checkpoint)
        provider.finalize()
        fresh, = provider.provide_distributed_model(
            wrap_with_ddp=False, use_cpu_initialization=True, mixed_precision_wrapper=None,
            pre_wrap_hook=setup._create_peft_pre_wrap_hook(state.cfg, state))
        result["resumed_before_load_vs_untrained_max_abs"] = example.max_abs(
            example.megatron_logits(fresh, tokens), base)
        state.cfg.checkpoint.finetune = False  # as Bridge's setup does before it loads
        checkpointing.load_checkpoint(state, [fresh], None, None)
        resumed = example.megatron_logits(fresh, tokens)
        result["adapters_resumed_logits_max_abs"] = example.max_abs(resumed, live)
        result["adapters_resumed_vs_untrained_max_abs"] = example.max_abs(resumed, base)
    except Exception as error:  # recorded: the test pins Bridge's failure
        result["adapters_resumed_error"] = error_text(error)

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

    # What a user gets without either route: save_megatron_model on the model with live
    # adapters, load_megatron_model.
    try:
        save_megatron_model([model], out / layout / "unmerged")
    except Exception as error:  # recorded: the test pins Bridge's failure
        result["unmerged_save_error"] = error_text(error)
    else:
        unmerged = example.megatron_logits(reload_megatron(out / layout / "unmerged"), tokens)
        result["unmerged_reloaded_vs_untrained_max_abs"] = example.max_abs(unmerged, base)
        result["unmerged_reloaded_vs_trained_max_abs"] = example.max_abs(unmerged, live)

    # Merged (docs/enable.md, bridge-save-merged): the model's adapters folded by
    # merge_bridge_lora, Bridge's save_megatron_model, then Bridge's load_megatron_model.
    checkpoint_dir = out / layout / "merged"
    result["merged"] = run_snippet("bridge-save-merged", model=model,
                                   checkpoint_dir=checkpoint_dir)["merged"]
    result["merged_megatron_logits_max_abs"] = example.max_abs(
        example.megatron_logits(model, tokens), live)
    reloaded = example.megatron_logits(reload_megatron(checkpoint_dir), tokens)
    result["merged_reloaded_logits_max_abs"] = example.max_abs(reloaded, live)
    result["merged_reloaded_vs_untrained_max_abs"] = example.max_abs(reloaded, base)
    exporter = AutoBridge.from_hf_pretrained(out / "hf_tiny")
    example.export_hf(exporter, model, out / layout / "hf_merged")
    result["merged_hf_logits_max_abs"] = example.max_abs(
        example.hf_logits(out / layout / "hf_merged", tokens), live)
    return result


def main(out: Path, result_path: Path) -> None:
    import_megatron_bridge()
    import_megatron_bridge_checkpointing()
    from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix

    init_single_process_megatron(on_cpu=True)
    # Bridge's save_checkpoint records the CUDA generator even with save_rng=False: on a
    # CPU-only host the CPU generator stands for it (the one piece of Bridge's checkpointing
    # that asks for CUDA here).
    if not torch.cuda.is_available():
        torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    register_allowed_target_prefix("mcore_torch_experts")  # docs/enable.md, bridge-reload
    # Bridge's training setup initialises Megatron's microbatch calculator (initialize.py), which
    # load_checkpoint updates on resume; one process, one microbatch.
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    init_num_microbatches_calculator(0, None, 1, 1, 1)
    example.make_tiny_checkpoint(out / "hf_tiny", seed=3)
    tokens = torch.randint(0, example.TINY_QWEN3_MOE["vocab_size"], (2, 16),
                           generator=torch.Generator().manual_seed(5))
    results = {layout: measure(out, layout, tokens) for layout in LAYOUTS}
    result_path.write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
