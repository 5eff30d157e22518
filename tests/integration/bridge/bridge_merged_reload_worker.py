"""Run by test_bridge_save_merged.py in its own process (Bridge's import needs a Transformer
Engine stand-in, see support.bridge_imports.import_megatron_bridge, that must
not reach other tests).

docs/enable.md's Bridge route taken literally, on the model as Bridge hands it over: a list of
chunks. A tiny HF Qwen3-MoE checkpoint imported with AutoBridge into TorchGroupedMLP experts
(`provide_distributed_model`: a list), then
- the prefixes Bridge's `instantiate` admits (docs/enable.md quotes them);
- without PEFT: which parameters Megatron's optimizer (`get_megatron_optimizer`, what Bridge's
  training setup builds) holds;
- the bridge-peft snippet on the list (`peft(model)`: a list), a few Adam steps;
- the bridge-save-merged snippet on that list; what the snippet's earlier form,
  `save_megatron_model([model], ...)`, does with it;
- Bridge's load_megatron_model of the merged checkpoint on the CPU, FP32: without
  `use_cpu_init=True`, then the bridge-load-merged snippet.
Writes what it measured (or the error each step raised) as JSON to argv[2].

    python tests/integration/bridge/bridge_merged_reload_worker.py OUT_DIR RESULT_JSON
"""

import json
import sys
from pathlib import Path

import torch

import hf_roundtrip as example
from mcore_torch_experts.specs import torch_experts_gpt_spec
from support.bridge_imports import (
    import_megatron_bridge,
    import_megatron_bridge_checkpointing,
)
from support.cpu_support import (
    CudaTensorsOnTheCpu,
    init_single_process_megatron,
)
from support.doc_snippets import run_snippet

STEPS = 3


def error_text(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def provide_chunks(path: Path) -> list:
    """The model chunks Bridge's provider for the checkpoint at `path` builds, the bridge-gpt
    snippet's two settings plus the CPU form (examples/hf_roundtrip.py's)."""
    from megatron.bridge import AutoBridge

    provider = AutoBridge.from_hf_pretrained(path).to_megatron_provider(load_weights=True)
    provider.moe_grouped_gemm = True
    provider.transformer_layer_spec = torch_experts_gpt_spec
    provider.transformer_impl = "local"
    provider.gradient_accumulation_fusion = False
    provider.moe_token_dispatcher_type = "allgather"
    provider.moe_permute_fusion = False
    provider.masked_softmax_fusion = False
    provider.cross_entropy_loss_fusion = False
    provider.finalize()
    return provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True,
                                              mixed_precision_wrapper=None)


def optimizer_parameters(chunks: list) -> dict:
    """{"held": names, "left": names}: the parameters Megatron's optimizer, built as Bridge's
    training setup builds it (each chunk wrapped in Megatron's DistributedDataParallel, then
    `get_megatron_optimizer` over the wrapped chunks), holds and leaves."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    wrapped = [DistributedDataParallel(chunk.config, DistributedDataParallelConfig(), chunk)
               for chunk in chunks]
    with CudaTensorsOnTheCpu():  # the optimizer's scalars, which it makes on CUDA by name
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=False), wrapped)
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    names = [(name, p) for chunk in chunks for name, p in chunk.named_parameters()]
    return {"held": sorted(n for n, p in names if id(p) in held),
            "left": sorted(n for n, p in names if id(p) not in held)}


def main(out: Path, result_path: Path) -> None:
    import_megatron_bridge()
    import_megatron_bridge_checkpointing()
    from megatron.bridge.training.model_load_save import load_megatron_model, save_megatron_model

    init_single_process_megatron(on_cpu=True)
    # Bridge's save_checkpoint records the CUDA generator even with save_rng=False: on a
    # CPU-only host the CPU generator stands for it (docs/enable.md says so).
    if not torch.cuda.is_available():
        torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    # The prefixes Bridge's `instantiate` admits as Bridge installs them (its module adds its own
    # to Megatron-LM's `target_allowlist`), before the bridge-reload snippet adds the package's.
    import megatron.bridge.utils.instantiate_utils  # noqa: F401
    from megatron.training.config.instantiate_utils import target_allowlist

    allowlist = sorted(target_allowlist.allowed_prefixes)
    run_snippet("bridge-reload")  # register_allowed_target_prefix("mcore_torch_experts")
    example.make_tiny_checkpoint(out / "hf_tiny", seed=3)
    tokens = torch.randint(0, example.TINY_QWEN3_MOE["vocab_size"], (2, 16),
                           generator=torch.Generator().manual_seed(5))
    model = provide_chunks(out / "hf_tiny")
    result = {"allowlist": allowlist, "provided": type(model).__name__, "chunks": len(model),
              "experts": sorted({type(m).__name__ for chunk in model for n, m in
                                 chunk.named_modules() if n.endswith("mlp.experts")})}
    try:
        result["optimizer_without_peft"] = optimizer_parameters(model)
    except Exception as error:  # recorded: the test shows it
        result["optimizer_without_peft_error"] = error_text(error)
    result["requires_grad_without_peft"] = sorted(
        n for chunk in model for n, p in chunk.named_parameters() if p.requires_grad)
    result["all_parameters"] = sorted(n for chunk in model for n, _ in chunk.named_parameters())

    torch.manual_seed(0)
    model = run_snippet("bridge-peft", model=model)["model"]  # peft(model) on the list
    result["after_peft"] = type(model).__name__
    trainable = [p for chunk in model for p in chunk.parameters() if p.requires_grad]
    result["losses"] = example.train(model[0], trainable, STEPS)
    live = example.megatron_logits(model[0], tokens)

    # The snippet's earlier form on the list: save_megatron_model([model], ...).
    try:
        save_megatron_model([model], out / "list_in_a_list")
    except Exception as error:  # recorded: the test pins it
        result["list_in_a_list_error"] = error_text(error)

    checkpoint_dir = out / "merged"
    result["merged"] = run_snippet("bridge-save-merged", model=model,
                                   checkpoint_dir=checkpoint_dir)["merged"]
    result["merged_logits_max_abs"] = example.max_abs(example.megatron_logits(model[0], tokens),
                                                      live)

    # Reload on the CPU in FP32 without use_cpu_init (Bridge's default, False): the provider
    # builds its model for the GPU.
    try:
        load_megatron_model(str(checkpoint_dir / "iter_0000000"))
    except Exception as error:  # recorded: the test pins it
        result["reload_without_cpu_init_error"] = error_text(error)
    reloaded = run_snippet("bridge-load-merged", checkpoint_dir=checkpoint_dir)["model"]
    result["reloaded"] = type(reloaded).__name__
    result["reloaded_experts"] = sorted({type(m).__name__ for chunk in reloaded for n, m in
                                         chunk.named_modules() if n.endswith("mlp.experts")})
    result["reloaded_logits_max_abs"] = example.max_abs(
        example.megatron_logits(reloaded[0], tokens), live)
    result_path.write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
