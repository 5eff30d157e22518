"""This package's settings on a TransformerConfig as one typed object, read once per entry point
(`ExpertSettings.read`): TorchGroupedMLP and FP32CombineMoELayer when built, a spec route's one
check (`config.spec_choice`), TorchExpertsTransformerConfig's own checks.

One rule for a field a config lacks (a plain TransformerConfig, a Megatron-Bridge provider, a
megatron-core release before the field): it reads as its default (`DEFAULTS`: the values
TorchExpertsTransformerConfig declares, and Megatron's for `batch_invariant_mode`). Only
`moe_expert_gemm_backend` reads None when absent: what its absence means is the entry point's to
say (a spec route builds Megatron's experts; TorchGroupedMLP built directly is the torch backend).
"""

from dataclasses import dataclass
from typing import Optional

from .enums import ExpertGemmBackend, ExpertKernel
from .errors import TorchExpertsConfigError

DEFAULTS = {
    "moe_expert_kernel": ExpertKernel.AUTO.value,
    "moe_combine_in_fp32": False,
    "moe_combine_chunk_rows": None,
    "moe_combine_backend": None,
    "batch_invariant_mode": False,  # megatron-core 0.20+
}


_ABSENT = object()


def read_field(config, name: str):
    """`config.name`, or its default (`DEFAULTS`) where the config has no such field."""
    return getattr(config, name, DEFAULTS[name])


def check_backend(backend) -> None:
    """Refuse a moe_expert_gemm_backend value outside ExpertGemmBackend, naming the allowed
    ones."""
    if backend not in tuple(ExpertGemmBackend):
        raise TorchExpertsConfigError(
            f"moe_expert_gemm_backend={backend!r} is not a backend: set it to one of "
            f"{tuple(b.value for b in ExpertGemmBackend)}."
        )


def check_kernel_value(setting) -> ExpertKernel:
    """`moe_expert_kernel` as an ExpertKernel; a value that is not a choice is refused."""
    if setting not in tuple(ExpertKernel):
        raise TorchExpertsConfigError(f"moe_expert_kernel={setting!r} is not a kernel choice: "
                                      f"set it to one of {tuple(k.value for k in ExpertKernel)}.")
    return ExpertKernel(setting)


@dataclass(frozen=True)
class ExpertSettings:
    """This package's fields of one config, read and value-checked once. The combine's two
    options stay as given: `combine.option_problem` checks them where the combine runs."""

    gemm_backend: Optional[ExpertGemmBackend]
    """`moe_expert_gemm_backend`; None where the config has no such field."""
    expert_kernel: ExpertKernel
    combine_in_fp32: bool
    combine_chunk_rows: Optional[int]
    combine_backend: Optional[str]
    batch_invariant: bool
    """Megatron's `batch_invariant_mode`."""

    @classmethod
    def read(cls, config) -> "ExpertSettings":
        backend = getattr(config, "moe_expert_gemm_backend", _ABSENT)
        if backend is not _ABSENT:  # a value held, None included, must be a choice
            check_backend(backend)
            backend = ExpertGemmBackend(backend)
        else:
            backend = None
        return cls(gemm_backend=backend,
                   expert_kernel=check_kernel_value(read_field(config, "moe_expert_kernel")),
                   combine_in_fp32=bool(read_field(config, "moe_combine_in_fp32")),
                   combine_chunk_rows=read_field(config, "moe_combine_chunk_rows"),
                   combine_backend=read_field(config, "moe_combine_backend"),
                   batch_invariant=bool(read_field(config, "batch_invariant_mode")))
