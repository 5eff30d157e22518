"""Moved to `mcore_torch_experts.megatron.convert`; this path stays importable for now, with a
deprecation warning that names the new one."""

import warnings

from .megatron.convert import *  # noqa: F401,F403

warnings.warn("mcore_torch_experts.convert moved to mcore_torch_experts.megatron.convert: import it "
              "from there.", DeprecationWarning, stacklevel=2)
