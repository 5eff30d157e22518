"""Run by test_nemo_rl.py in its own process, NeMo-RL (its folder, see scripts/legs.sh) first on
PYTHONPATH: the worker extension's class, `TorchExpertsMegatronPolicyWorker` of
examples/nemo_rl_worker.py, built as its Ray actor would build it, but in this process: its
`__init__` (`enable_torch_experts`, then NeMo-RL's `MegatronPolicyWorkerImpl.__init__`:
setup_distributed, validate_model_paths, handle_model_import -> import_model_from_hf_name,
validate_and_set_config, setup_model_and_optimizer, setup_reference_model_state,
finalize_megatron_setup), then the worker's `get_logprobs` and one `train` step (NeMo-RL's
NLLLossFn), on a tiny local Qwen3-MoE HF checkpoint, with NeMo-RL's Megatron GRPO recipe and the
docs' YAML block, on the CPU (the patches of mcore_torch_experts.testing.cpu_support:
`megatron_patches`, `megatron_lm_patches`, `nemo_rl_patches`, inside `CudaTensorsOnTheCpu`).

    python tests/nemo_rl_worker_run.py OUT_DIR RESULT_JSON PEFT(0|1)

Writes what it measured as JSON to RESULT_JSON.
"""

import copy
import json
import logging
import os
import sys
from pathlib import Path

import torch

import hf_roundtrip as example
from doc_snippets import snippet
from mcore_torch_experts.testing import cpu_support

NEMO_RL_CONFIG = "grpo_math_1B_megatron.yaml"  # NeMo-RL's Megatron GRPO recipe
SEQ = 16
BATCH = 2


def cpu_policy_config(hf_path: Path, peft: bool) -> dict:
    """NeMo-RL's Megatron GRPO recipe's `policy`, for the tiny checkpoint on one CPU process: the
    docs' YAML block (with `peft.enabled` as asked) merged over it, the settings a CPU host needs
    (FP32, local modules, no fused kernels, no overlap, no asynchronous checkpoint saves) and a
    batch of two sequences of 16 tokens."""
    import nemo_rl
    import yaml
    from nemo_rl.utils.config import load_config, register_omegaconf_resolvers
    from omegaconf import OmegaConf

    register_omegaconf_resolvers()
    # NeMo-RL's examples/configs, unpacked beside its package by scripts/legs.sh.
    configs = Path(os.environ.get("NEMO_RL_CONFIGS",
                                  Path(nemo_rl.__file__).parents[1] / "nemo_rl_configs"))
    policy = OmegaConf.to_container(load_config(str(configs / NEMO_RL_CONFIG)), resolve=True)[
        "policy"]
    ours = yaml.safe_load(snippet("nemo-rl-config"))["policy"]
    ours["megatron_cfg"]["peft"]["enabled"] = peft
    megatron = policy["megatron_cfg"]
    for key, value in ours["megatron_cfg"].items():
        megatron[key] = value
    policy.update(model_name=str(hf_path), precision="float32", train_global_batch_size=BATCH,
                  train_micro_batch_size=1, logprob_batch_size=1, max_total_sequence_length=SEQ,
                  make_sequence_length_divisible_by=1, generation=None)
    policy["tokenizer"]["name"] = str(hf_path)
    policy["sequence_packing"]["enabled"] = False
    policy["dynamic_batching"]["enabled"] = False
    megatron.update(transformer_impl="local", pipeline_dtype="float32", moe_permute_fusion=False,
                    apply_rope_fusion=False, bias_activation_fusion=False,
                    gradient_accumulation_fusion=False, train_iters=10)
    megatron["checkpoint"]["async_save"] = False  # they need nvidia-resiliency-ext (CUDA)
    megatron["optimizer"].update(bf16=False, use_distributed_optimizer=False,
                                 use_precision_aware_optimizer=False, lr=1e-2, min_lr=1e-2)
    megatron["scheduler"].update(lr_warmup_iters=0, lr_warmup_init=1e-2)
    megatron["distributed_data_parallel_config"].update(overlap_grad_reduce=False,
                                                        overlap_param_gather=False)
    return policy


def make_tokenizer(path: Path) -> None:
    """A word-level tokenizer of the tiny checkpoint's vocabulary, saved beside it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(example.TINY_QWEN3_MOE["vocab_size"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="t1", pad_token="t2",
                            unk_token="t0").save_pretrained(path)


def load_extension():
    path = Path(__file__).parents[1] / "examples" / "nemo_rl_worker.py"
    import importlib.util

    spec = importlib.util.spec_from_file_location("nemo_rl_worker", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def batch(tokens: torch.Tensor):
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    return BatchedDataDict({
        "input_ids": tokens, "input_lengths": torch.full((tokens.shape[0],), tokens.shape[1]),
        "token_mask": torch.ones_like(tokens, dtype=torch.float32),
        "sample_mask": torch.ones(tokens.shape[0])})


def hf_logprobs(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    """[B, S] log-probabilities of each next token under the HF model (0 at position 0, as
    NeMo-RL's get_logprobs)."""
    logits = example.hf_logits(path, tokens).double()
    taken = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros_like(taken[:, :1]), taken], 1)


def main(out: Path, result_path: Path, peft: bool) -> None:
    import importlib.util

    # Packages import_megatron_bridge_checkpointing would stand in for where they are missing.
    missing = [name for name in ("datasets", "modelopt", "megatron.energon", "tensorboard")
               if importlib.util.find_spec(name) is None]
    cpu_support.import_megatron_bridge()
    cpu_support.import_megatron_bridge_checkpointing()
    from nemo_rl.algorithms.loss.loss_functions import NLLLossFn
    from nemo_rl.distributed.named_sharding import NamedSharding
    from transformers import AutoTokenizer

    hf_path = out / "hf_tiny"
    example.make_tiny_checkpoint(hf_path, seed=4)
    make_tokenizer(hf_path)
    # What NeMo-RL's worker group gives each worker's Ray actor (one worker here), and the
    # converted checkpoint's cache.
    os.environ.update(NRL_MEGATRON_CHECKPOINT_DIR=str(out / "megatron_ckpts"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(cpu_support._free_port()))
    config = cpu_policy_config(hf_path, peft)
    extension = load_extension()
    # The class the Ray actor would run: TorchExpertsMegatronPolicyWorker's own __init__
    # (enable_torch_experts, then MegatronPolicyWorkerImpl.__init__).
    worker_class = extension.TorchExpertsMegatronPolicyWorker.__ray_metadata__.modified_class
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("mcore_torch_experts").addHandler(handler)

    cpu_support.apply(cpu_support.megatron_patches(on_cpu=True, host_streams=True))
    cpu_support.apply(cpu_support.megatron_lm_patches())
    cpu_support.apply(cpu_support.nemo_rl_patches())
    with cpu_support.CudaTensorsOnTheCpu():
        worker = worker_class.__new__(worker_class)
        worker_class.__init__(
            worker, copy.deepcopy(config), AutoTokenizer.from_pretrained(hf_path),
            worker_sharding_annotations=NamedSharding(layout=[0], names=["data_parallel"]))
        model = worker.model
        while hasattr(model, "module"):
            model = model.module
        layers = model.decoder.layers
        spec = worker.megatron_cfg.model.transformer_layer_spec
        result = {"experts": [type(layer.mlp.experts).__name__ for layer in layers],
                  "dispatchers": [type(layer.mlp.token_dispatcher).__name__ for layer in layers],
                  "peft": peft, "stood_in": missing, "worker_classes": [c.__name__ for c in type(worker).__mro__],
                  "provider_spec": getattr(spec, "__name__", repr(spec))}
        tokens = torch.randint(0, example.TINY_QWEN3_MOE["vocab_size"], (BATCH, SEQ),
                               generator=torch.Generator().manual_seed(7))
        data = batch(tokens)
        logprobs = worker.get_logprobs(data=data)["logprobs"]
        result["logprobs_max_abs"] = (logprobs.double() - hf_logprobs(hf_path, tokens)).abs()[
            :, 1:].max().item()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        result["trainable"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
        metrics = worker.train(data, NLLLossFn())
        after = dict(model.named_parameters())
        result["loss"] = float(torch.as_tensor(metrics["global_loss"]).float().mean())
        # The reference model (NeMo-RL's state dict of the model as loaded, swapped in) after the
        # step: the checkpoint's logprobs still.
        reference = worker.get_reference_policy_logprobs(data=data)["reference_logprobs"]
        result["reference_logprobs_max_abs"] = (
            reference.double() - hf_logprobs(hf_path, tokens)).abs()[:, 1:].max().item()
        result["changed"] = sorted(n for n in before if not torch.equal(before[n],
                                                                         after[n].detach()))
        result["all_names"] = sorted(before)
        result["log"] = records
    result_path.write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1")
