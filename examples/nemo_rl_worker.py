"""The NeMo-RL policy-worker extension, for launchers that name this file: the class lives in the
package, `mcore_torch_experts.integrations.nemo_rl.TorchExpertsMegatronPolicyWorker`, which is
the name to register (it imports wherever the package is installed; no copy needed). See
docs/enable.md, "NeMo-RL". Needs NeMo-RL and Ray.
"""

from mcore_torch_experts.integrations.nemo_rl import (
    TorchExpertsMegatronPolicyWorker,
    enable_torch_experts,
)

__all__ = ["TorchExpertsMegatronPolicyWorker", "enable_torch_experts"]
