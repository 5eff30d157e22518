"""Moved to `mcore_torch_experts.megatron.recompute`; this path stays importable for now, with a
deprecation warning that names the new one."""

import warnings

from .megatron.recompute import *  # noqa: F401,F403

warnings.warn("mcore_torch_experts.recompute moved to mcore_torch_experts.megatron.recompute: import it "
              "from there.", DeprecationWarning, stacklevel=2)
