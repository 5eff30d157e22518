"""Moved to `mcore_torch_experts.megatron.upcycling`; this path stays importable for now, with a
deprecation warning that names the new one."""

import warnings

from .megatron.upcycling import *  # noqa: F401,F403

warnings.warn("mcore_torch_experts.upcycling moved to mcore_torch_experts.megatron.upcycling: import it "
              "from there.", DeprecationWarning, stacklevel=2)
