"""The launcher path of the reference specs: Megatron-LM's `--spec mcore_torch_experts.specs
NAME` and the `_target_` Megatron-Bridge's run_config.yaml records (docs/specs.md). The specs live
in `mcore_torch_experts.megatron.specs`; this path stays."""

from .megatron.specs import *  # noqa: F401,F403
from .megatron.specs import __all__  # noqa: F401
