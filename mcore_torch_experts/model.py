"""Moved to `mcore_torch_experts.megatron.model`; this path stays importable for now, with a
deprecation warning that names the new one."""

import warnings

from .megatron.model import *  # noqa: F401,F403

warnings.warn("mcore_torch_experts.model moved to mcore_torch_experts.megatron.model: import it "
              "from there.", DeprecationWarning, stacklevel=2)
