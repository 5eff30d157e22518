"""NeMo-RL's Megatron policy worker with TorchGroupedMLP experts: a policy-worker extension that
builds the Megatron policy (and its reference model) with the package's specs, in the style of
NeMo-RL's own `MegatronQuantPolicyWorker`. Select it from your launcher by its name,
`mcore_torch_experts.integrations.nemo_rl.TorchExpertsMegatronPolicyWorker`, with this package
installed where the Megatron workers run; see docs/enable.md, "NeMo-RL". Imports NeMo-RL and Ray:
nothing else in the package imports this module (`examples/nemo_rl_worker.py` re-exports it).

NeMo-RL's `MegatronPolicyWorkerImpl.__init__` reads `self._transformer_layer_spec` and
`self._mamba_stack_spec` and hands them to its HF -> Megatron import (`handle_model_import` ->
`import_model_from_hf_name`), which sets them on the provider before saving the converted
checkpoint. The spec is then recorded in that checkpoint's run_config.yaml, from which NeMo-RL
rebuilds the provider (`load_model_config` -> `instantiate`) for the policy and the reference
model; `instantiate` admits the package's functions once its prefix is registered, which this
worker does in its own process before anything is loaded.

tests/integration/nemo_rl/test_nemo_rl.py runs this class's `__init__` (NeMo-RL main's whole worker setup),
`get_logprobs` and a `train` step on the CPU, in the test's process rather than in a Ray actor;
see docs/enable.md, "NeMo-RL".
"""

from pathlib import Path
from typing import Optional

import ray
from nemo_rl.models.policy.utils import get_runtime_env_for_policy_worker
from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorkerImpl

from .. import _compat
from ..config import BATCH_INVARIANT_MIN_RELEASE
from ..errors import TorchExpertsConfigError
from ..megatron.specs import torch_experts_gpt_spec, torch_experts_hybrid_stack_spec
from .bridge import register_with_megatron_bridge

SPEC_FIELDS = ("transformer_layer_spec", "hybrid_stack_spec", "mamba_stack_spec")


def recorded_specs(path) -> Optional[list]:
    """The `_target_`s of the layer and stack specs that the run_config.yaml of the
    Megatron-Bridge checkpoint at `path` records, found as NeMo-RL finds it (`path` itself, else
    the iteration `latest_checkpointed_iteration.txt` names, else the newest `iter_*` folder), or
    None where there is no run_config.yaml."""
    import yaml

    root = Path(path)
    candidates = [root / "run_config.yaml"]
    tracker = root / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        candidates.append(root / f"iter_{int(tracker.read_text().strip()):07d}" / "run_config.yaml")
    candidates += [folder / "run_config.yaml" for folder in sorted(root.glob("iter_*"),
                                                                  reverse=True)]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        return None
    model = (yaml.safe_load(found.read_text()) or {}).get("model") or {}
    return [entry.get("_target_") for entry in (model.get(f) for f in SPEC_FIELDS)
            if isinstance(entry, dict) and entry.get("_target_")]


def batch_invariant_requested(config) -> bool:
    """Whether the worker's policy config asks for Megatron's batch_invariant_mode: NeMo-RL sets a
    model field it has no setting of its own for through policy.megatron_cfg.model_overrides."""
    overrides = ((config or {}).get("megatron_cfg") or {}).get("model_overrides") or {}
    return bool(overrides.get("batch_invariant_mode"))


def enable_torch_experts(worker, config=None) -> None:
    """Let this process's Megatron-Bridge rebuild providers naming the package's specs, register
    TorchGroupedLinear with Bridge's PEFT, and give `worker` the specs NeMo-RL's HF import puts
    on the provider (GPT: torch_experts_gpt_spec; hybrid: torch_experts_hybrid_stack_spec).
    Where the config asks for batch_invariant_mode, turn Megatron's batch-invariant kernels on in
    this process first, as Megatron-LM's `--batch-invariant-mode` does in its initialize and
    NeMo-RL does not: our experts refuse a forward in the mode without them.

    `config` (the worker's policy config): NeMo-RL skips its HF import, where the spec goes, for a
    `pretrained_checkpoint`. One of format `megatron_bridge` is taken where its run_config.yaml
    records one of the package's specs (NeMo-RL rebuilds its provider from that file, with
    TorchGroupedMLP experts) and refused (TorchExpertsConfigError) otherwise; one of format
    `megatron_lm` (no run_config.yaml: Megatron's experts) is refused."""
    from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix

    checkpoint = (config or {}).get("pretrained_checkpoint") or {}
    fmt, path = checkpoint.get("format"), checkpoint.get("path")
    fix = ("Remove policy.pretrained_checkpoint and set policy.model_name to the HF checkpoint "
           "(export a Megatron checkpoint to HF first), with "
           "policy.megatron_cfg.force_reconvert_from_hf: true once")
    if fmt == "megatron_lm":
        raise TorchExpertsConfigError(
            f"policy.pretrained_checkpoint.format='megatron_lm' (path {path!r}): NeMo-RL builds "
            "such a checkpoint's model without its HF import, where "
            "TorchExpertsMegatronPolicyWorker puts the spec, so its experts would be Megatron's. "
            f"{fix}.")
    if fmt == "megatron_bridge":
        specs = recorded_specs(path) if path else None
        if not specs or not any(t.startswith("mcore_torch_experts.specs.") for t in specs):
            found = ("it has no run_config.yaml (looked in the path, the iteration "
                     "latest_checkpointed_iteration.txt names and the iter_* folders)"
                     if specs is None else f"its run_config.yaml records the spec(s) {specs}")
            raise TorchExpertsConfigError(
                f"policy.pretrained_checkpoint.format='megatron_bridge' (path {path!r}): {found}, "
                "and NeMo-RL rebuilds the model from that file without its HF import, where "
                "TorchExpertsMegatronPolicyWorker puts the spec, so its experts would be "
                "Megatron's. Save the checkpoint from a provider whose transformer_layer_spec is "
                f"mcore_torch_experts.specs.torch_experts_gpt_spec, or: {fix}.")
    if batch_invariant_requested(config):
        release = _compat.megatron_core_release()
        if release < BATCH_INVARIANT_MIN_RELEASE:
            raise TorchExpertsConfigError(
                "policy.megatron_cfg.model_overrides.batch_invariant_mode=True: batch-invariant "
                "MoE needs megatron-core >= 0.20 (its fixed-order unpermute and router); this is "
                f"{'.'.join(map(str, release))}. Upgrade megatron-core or remove the override.")
        megatron_cfg = config.get("megatron_cfg") or {}
        router_dtype = megatron_cfg["model_overrides"].get(
            "moe_router_dtype", megatron_cfg.get("moe_router_dtype"))
        if router_dtype == "fp64":
            raise TorchExpertsConfigError(
                "policy.megatron_cfg.moe_router_dtype='fp64' with "
                "policy.megatron_cfg.model_overrides.batch_invariant_mode=True: Megatron's "
                "batch-invariant matmul has no FP64 kernel (the router's gating matmul fails "
                "inside it with KeyError: torch.float64). Set policy.megatron_cfg.moe_router_dtype: "
                "fp32 (NeMo-RL's Megatron recipes set fp64).")
        from megatron.core.transformer.custom_layers.batch_invariant_kernels import (
            enable_batch_invariant_mode,
        )

        enable_batch_invariant_mode(backend="triton")
    register_allowed_target_prefix("mcore_torch_experts")
    register_with_megatron_bridge()
    worker._transformer_layer_spec = torch_experts_gpt_spec
    worker._mamba_stack_spec = torch_experts_hybrid_stack_spec


@ray.remote(runtime_env=get_runtime_env_for_policy_worker("megatron_policy_worker"))
class TorchExpertsMegatronPolicyWorker(MegatronPolicyWorkerImpl):
    """NeMo-RL's Megatron policy worker, its MoE experts TorchGroupedMLP."""

    def __init__(self, config, *args, **kwargs):
        enable_torch_experts(self, config)
        super().__init__(config, *args, **kwargs)
