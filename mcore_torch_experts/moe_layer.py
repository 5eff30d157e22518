"""Moved to `mcore_torch_experts.megatron.moe_layer`; this path stays importable for now, with a
deprecation warning that names the new one."""

import warnings

from .megatron.moe_layer import *  # noqa: F401,F403

warnings.warn("mcore_torch_experts.moe_layer moved to mcore_torch_experts.megatron.moe_layer: import it "
              "from there.", DeprecationWarning, stacklevel=2)
