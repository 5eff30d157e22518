"""Run by test_nemo_rl.py in its own process, NeMo-RL (its folder, see scripts/legs.sh) first on
PYTHONPATH: the worker extension's class, `TorchExpertsMegatronPolicyWorker` of
mcore_torch_experts.integrations.nemo_rl, built as its Ray actor would build it, but in this
process: its `__init__` (`enable_torch_experts`, then NeMo-RL's `MegatronPolicyWorkerImpl.__init__`:
setup_distributed, validate_model_paths, handle_model_import -> import_model_from_hf_name,
validate_and_set_config, setup_model_and_optimizer, setup_reference_model_state,
finalize_megatron_setup), then the worker's `get_logprobs` and one `train` step (NeMo-RL's
NLLLossFn), on a tiny local Qwen3-MoE HF checkpoint, with NeMo-RL's Megatron GRPO recipe and the
docs' YAML block, on the CPU (the patches of support.cpu_support:
`megatron_patches`, `megatron_lm_patches`, `nemo_rl_patches`, inside `CudaTensorsOnTheCpu`),
then the worker's `save_checkpoint` as NeMo-RL's GRPO loop calls it. The phase `reload`, a later
process on the same OUT_DIR, builds a fresh worker from that checkpoint as a resumed NeMo-RL run
does (`CheckpointManager.get_resume_paths`, the constructor's `weights_path` and
`optimizer_path`) and compares it with what the training process kept.

    python tests/integration/nemo_rl/nemo_rl_worker_run.py OUT_DIR RESULT_JSON PEFT(0|1) [train|reload]

(with NeMo-RL's folder, the repository, tests/ and examples/ on PYTHONPATH). Writes what it
measured as JSON to RESULT_JSON.
"""

import copy
import json
import logging
import os
import re
import sys
from pathlib import Path

import torch

import hf_roundtrip as example
from support import bridge_imports, cpu_support
from support.doc_snippets import snippet

NEMO_RL_CONFIG = "grpo_math_1B_megatron.yaml"  # NeMo-RL's Megatron GRPO recipe
SEQ = 16
BATCH = 2


def policy_config(hf_path: Path, peft: bool) -> dict:
    """NeMo-RL's Megatron GRPO recipe's `policy` with the docs' YAML block (`peft.enabled` as
    asked) merged over it, for the checkpoint at `hf_path`: what a user's run gets on a GPU."""
    import nemo_rl
    import yaml
    from nemo_rl.utils.config import load_config, register_omegaconf_resolvers
    from omegaconf import OmegaConf

    register_omegaconf_resolvers()
    # NeMo-RL's examples/configs, beside its package as in its checkout (scripts/legs.sh).
    configs = Path(os.environ.get("NEMO_RL_CONFIGS",
                                  Path(nemo_rl.__file__).parents[1] / "examples" / "configs"))
    policy = OmegaConf.to_container(load_config(str(configs / NEMO_RL_CONFIG)), resolve=True)[
        "policy"]
    ours = yaml.safe_load(snippet("nemo-rl-config"))["policy"]
    ours["megatron_cfg"]["peft"]["enabled"] = peft
    megatron = policy["megatron_cfg"]
    for key, value in ours["megatron_cfg"].items():
        megatron[key] = value
    policy["model_name"] = policy["tokenizer"]["name"] = str(hf_path)
    return policy


def cpu_policy_config(hf_path: Path, peft: bool) -> dict:
    """`policy_config` for the tiny checkpoint on one CPU process: the settings a CPU host needs
    (FP32, local modules, no fused kernels, no overlap, no asynchronous checkpoint saves) and a
    batch of two sequences of 16 tokens."""
    policy = policy_config(hf_path, peft)
    megatron = policy["megatron_cfg"]
    policy.update(precision="float32", train_global_batch_size=BATCH,
                  train_micro_batch_size=1, logprob_batch_size=1, max_total_sequence_length=SEQ,
                  make_sequence_length_divisible_by=1, generation=None)
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


def make_tokenizer(path: Path, vocab_size: int = example.TINY_QWEN3_MOE["vocab_size"]) -> None:
    """A word-level tokenizer of the checkpoint's vocabulary, saved beside it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="t1", pad_token="t2",
                            unk_token="t0").save_pretrained(path)


def load_extension():
    """The worker extension's module, the package's NeMo-RL integration."""
    from mcore_torch_experts.integrations import nemo_rl

    return nemo_rl


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


def hf_expert_weights(path: Path) -> dict:
    """{(layer, expert): (fc1, fc2)}: the HF checkpoint's expert weights in Megatron's layout
    (linear_fc1 = [gate_proj; up_proj], linear_fc2 = down_proj), read from its safetensors."""
    from safetensors.torch import load_file

    tensors = {}
    for file in path.glob("*.safetensors"):
        tensors.update(load_file(file))
    experts = {}
    for layer in range(example.TINY_QWEN3_MOE["num_hidden_layers"]):
        for expert in range(example.TINY_QWEN3_MOE["num_experts"]):
            prefix = f"model.layers.{layer}.mlp.experts.{expert}."
            experts[layer, expert] = (
                torch.cat([tensors[prefix + "gate_proj.weight"],
                           tensors[prefix + "up_proj.weight"]]),
                tensors[prefix + "down_proj.weight"])
    return experts


def optimizer_moments(worker, model) -> dict:
    """{parameter name: Adam's first moment}, of the worker's optimizer (Megatron's FP32Optimizer
    around torch's Adam on a CPU host)."""
    names = {id(param): name for name, param in model.named_parameters()}
    state = worker.optimizer.optimizer.state
    return {names[id(param)]: moments["exp_avg"].detach().clone()
            for param, moments in state.items() if id(param) in names and "exp_avg" in moments}


def build_worker(worker_class, config: dict, hf_path: Path, **resume):
    """The worker, built as its Ray actor would build it (`resume`: the `weights_path` and
    `optimizer_path` NeMo-RL's Policy passes a resumed run's workers), and its unwrapped model."""
    from nemo_rl.distributed.named_sharding import NamedSharding
    from transformers import AutoTokenizer

    worker = worker_class.__new__(worker_class)
    worker_class.__init__(
        worker, copy.deepcopy(config), AutoTokenizer.from_pretrained(hf_path), **resume,
        worker_sharding_annotations=NamedSharding(layout=[0], names=["data_parallel"]))
    model = worker.model
    while hasattr(model, "module"):
        model = model.module
    return worker, model


def describe(worker, model) -> dict:
    layers = model.decoder.layers
    spec = worker.megatron_cfg.model.transformer_layer_spec
    return {"experts": [type(layer.mlp.experts).__name__ for layer in layers],
            "dispatchers": [type(layer.mlp.token_dispatcher).__name__ for layer in layers],
            "worker_classes": [c.__name__ for c in type(worker).__mro__],
            "provider_spec": getattr(spec, "__name__", repr(spec))}


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def main(out: Path, result_path: Path, peft: bool, phase: str) -> None:
    """`phase` "train": the checkpoint made, the worker built, get_logprobs, one train step, the
    reference logprobs, then the worker's save_checkpoint as NeMo-RL's GRPO calls it (the trained
    parameters, logprobs and Adam moments kept in OUT_DIR/trained.pt). "reload" (a later process,
    as a resumed run): a fresh worker built from that checkpoint the way NeMo-RL resumes, and
    compared with what the training process kept and with the HF checkpoint."""
    import importlib.util

    # Packages import_megatron_bridge_checkpointing would stand in for where they are missing.
    missing = [name for name in ("datasets", "modelopt", "megatron.energon", "tensorboard")
               if importlib.util.find_spec(name) is None]
    bridge_imports.import_megatron_bridge()
    bridge_imports.import_megatron_bridge_checkpointing()
    from nemo_rl.algorithms.loss.loss_functions import NLLLossFn
    from nemo_rl.utils.checkpoint import CheckpointManager

    hf_path = out / "hf_tiny"
    if phase == "train":
        example.make_tiny_checkpoint(hf_path, seed=4)
        make_tokenizer(hf_path)
    # What NeMo-RL's worker group gives each worker's Ray actor (one worker here), and the
    # converted checkpoint's cache (the reload finds the training process's conversion there).
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
    # NeMo-RL's GRPO layout: <checkpoint_dir>/step_<n>/policy/{weights,optimizer,tokenizer}.
    step_dir = out / "checkpoints" / "step_1"
    tokens = torch.randint(0, example.TINY_QWEN3_MOE["vocab_size"], (BATCH, SEQ),
                           generator=torch.Generator().manual_seed(7))
    data = batch(tokens)

    cpu_support.apply(cpu_support.megatron_patches(on_cpu=True, host_streams=True))
    cpu_support.apply(cpu_support.megatron_lm_patches())
    cpu_support.apply(cpu_support.nemo_rl_patches())
    with cpu_support.CudaTensorsOnTheCpu():
        if phase == "reload":
            # What NeMo-RL's GRPO setup resumes from (CheckpointManager.get_resume_paths), passed
            # to the Policy, which gives its workers' constructors these absolute paths.
            weights_path, optimizer_path = CheckpointManager.get_resume_paths(step_dir)
            resume = {"weights_path": os.path.abspath(weights_path),
                      "optimizer_path": optimizer_path and os.path.abspath(optimizer_path)}
            worker, model = build_worker(worker_class, config, hf_path, **resume)
            result = {**describe(worker, model), "peft": peft,
                      "resume_paths": {key: value and os.path.relpath(value, step_dir)
                                       for key, value in resume.items()}}
            trained = torch.load(out / "trained.pt")
            # What the checkpoint holds (torch_dist: torch.distributed.checkpoint's metadata).
            from torch.distributed.checkpoint import FileSystemReader

            result["saved_keys"] = sorted(FileSystemReader(
                str(step_dir / "policy" / "weights" / "iter_0000000")).read_metadata()
                .state_dict_metadata)
            logprobs = worker.get_logprobs(data=data)["logprobs"]
            result["reloaded_vs_trained_logprobs_max_abs"] = max_abs(
                logprobs[:, 1:], trained["logprobs"][:, 1:])
            result["reloaded_vs_hf_logprobs_max_abs"] = max_abs(
                logprobs[:, 1:], hf_logprobs(hf_path, tokens)[:, 1:])
            params = {n: p.detach() for n, p in model.named_parameters()}
            result["all_names"] = sorted(params)
            result["trained_names"] = sorted(trained["parameters"])
            result["differing"] = sorted(
                n for n in params if n in trained["parameters"]
                and not torch.equal(params[n], trained["parameters"][n]))
            result["parameters_max_abs"] = max(
                max_abs(params[n], trained["parameters"][n]) for n in params
                if n in trained["parameters"])
            # The experts' weights against the HF checkpoint's (TorchGroupedMLP's weight<e>,
            # under `to_wrap.` where LoRA wraps them).
            reference = hf_expert_weights(hf_path)
            compared, expert_max_abs = 0, 0.0
            for name, param in params.items():
                match = re.search(r"layers\.(\d+)\.mlp\.experts\.linear_fc([12])\."
                                  r"(?:to_wrap\.)?weight(\d+)$", name)
                if match:
                    layer, fc, expert = map(int, match.groups())
                    expert_max_abs = max(expert_max_abs, max_abs(
                        param, reference[layer, expert][fc - 1]))
                    compared += 1
            result["expert_weights_compared"] = compared
            result["expert_weights_vs_hf_max_abs"] = expert_max_abs
            moments = optimizer_moments(worker, model)
            result["moment_names"] = sorted(moments)
            result["trained_moment_names"] = sorted(trained["moments"])
            result["moments_max_abs"] = max(
                [max_abs(moments[n], trained["moments"][n]) for n in moments
                 if n in trained["moments"]], default=None)
            result["log"] = records
            result_path.write_text(json.dumps(result))
            return
        worker, model = build_worker(worker_class, config, hf_path)
        result = {**describe(worker, model), "peft": peft, "stood_in": missing}
        logprobs = worker.get_logprobs(data=data)["logprobs"]
        result["logprobs_max_abs"] = (logprobs.double() - hf_logprobs(hf_path, tokens)).abs()[
            :, 1:].max().item()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        result["trainable"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
        metrics = worker.train(data, NLLLossFn())
        after = dict(model.named_parameters())
        result["loss"] = float(torch.as_tensor(metrics["global_loss"]).float().mean())
        trained_logprobs = worker.get_logprobs(data=data)["logprobs"]
        # The reference model (NeMo-RL's state dict of the model as loaded, swapped in) after the
        # step: the checkpoint's logprobs still.
        reference = worker.get_reference_policy_logprobs(data=data)["reference_logprobs"]
        result["reference_logprobs_max_abs"] = (
            reference.double() - hf_logprobs(hf_path, tokens)).abs()[:, 1:].max().item()
        result["changed"] = sorted(n for n in before if not torch.equal(before[n],
                                                                         after[n].detach()))
        result["all_names"] = sorted(before)
        # The worker's own save, with the arguments NeMo-RL's GRPO loop passes through its
        # Policy (save_optimizer: true, the recipe's default).
        policy_dir = step_dir / "policy"
        worker.save_checkpoint(weights_path=str(policy_dir / "weights"),
                               optimizer_path=str(policy_dir / "optimizer"),
                               tokenizer_path=str(policy_dir / "tokenizer"))
        torch.save({"logprobs": trained_logprobs,
                    "parameters": {n: p.detach().clone() for n, p in model.named_parameters()},
                    "moments": optimizer_moments(worker, model)}, out / "trained.pt")
        result["log"] = records
    result_path.write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1",
         sys.argv[4] if len(sys.argv) > 4 else "train")
