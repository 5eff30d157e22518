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

tests/test_nemo_rl.py runs this class's `__init__` (NeMo-RL main's whole worker setup),
`get_logprobs` and a `train` step on the CPU, in the test's process rather than in a Ray actor;
see docs/enable.md, "NeMo-RL".
"""

import ray
from nemo_rl.models.policy.utils import get_runtime_env_for_policy_worker
from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorkerImpl

from ..errors import TorchExpertsConfigError
from ..specs import torch_experts_gpt_spec, torch_experts_hybrid_stack_spec
from .bridge import register_with_megatron_bridge


def enable_torch_experts(worker, config=None) -> None:
    """Let this process's Megatron-Bridge rebuild providers naming the package's specs, register
    TorchGroupedLinear with Bridge's PEFT, and give `worker` the specs NeMo-RL's HF import puts
    on the provider (GPT: torch_experts_gpt_spec; hybrid: torch_experts_hybrid_stack_spec).

    `config` (the worker's policy config): a `pretrained_checkpoint` of format `megatron_bridge`
    or `megatron_lm` is refused (TorchExpertsConfigError): NeMo-RL skips its HF import for them,
    and with it the spec, so the experts would silently be Megatron's."""
    from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix

    checkpoint = (config or {}).get("pretrained_checkpoint") or {}
    if checkpoint.get("format") in ("megatron_bridge", "megatron_lm"):
        raise TorchExpertsConfigError(
            f"policy.pretrained_checkpoint.format={checkpoint['format']!r} "
            f"(path {checkpoint.get('path')!r}): NeMo-RL builds such a checkpoint's model without "
            "its HF import, where TorchExpertsMegatronPolicyWorker puts the spec, so its experts "
            "would be Megatron's. Remove policy.pretrained_checkpoint and set policy.model_name "
            "to the HF checkpoint (export a Megatron checkpoint to HF first), with "
            "policy.megatron_cfg.force_reconvert_from_hf: true once.")
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
