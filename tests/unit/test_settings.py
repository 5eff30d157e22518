"""`ExpertSettings.read`: the package's config fields read once, one rule for an absent field."""

import dataclasses

import pytest
from megatron.core.transformer.transformer_config import TransformerConfig

from mcore_torch_experts.config import TorchExpertsTransformerConfig
from mcore_torch_experts.enums import ExpertGemmBackend, ExpertKernel
from mcore_torch_experts.errors import TorchExpertsConfigError
from mcore_torch_experts.settings import DEFAULTS, ExpertSettings


def test_the_defaults_are_the_config_fields_defaults():
    """An absent field reads as the value TorchExpertsTransformerConfig declares (Megatron's for
    batch_invariant_mode, where this megatron-core has it)."""
    fields = {f.name: f.default for f in dataclasses.fields(TorchExpertsTransformerConfig)}
    for name, default in DEFAULTS.items():
        if name in fields:
            assert fields[name] == default, name
        else:
            assert name == "batch_invariant_mode"
            assert "batch_invariant_mode" not in TransformerConfig.__dataclass_fields__
    ours = {f.name for f in dataclasses.fields(TorchExpertsTransformerConfig)} - set(
        TransformerConfig.__dataclass_fields__)
    assert ours - {"moe_expert_gemm_backend"} == set(DEFAULTS) - {"batch_invariant_mode"}


def test_a_config_without_the_fields_reads_their_defaults():
    plain = type("PlainConfig", (), {})()
    assert ExpertSettings.read(plain) == ExpertSettings(
        gemm_backend=None, expert_kernel=ExpertKernel.AUTO, combine_in_fp32=False,
        combine_chunk_rows=None, combine_backend=None, batch_invariant=False)


def test_the_fields_are_read_as_given():
    config = type("Config", (), dict(
        moe_expert_gemm_backend="torch", moe_expert_kernel="grouped_mm", moe_combine_in_fp32=1,
        moe_combine_chunk_rows=128, moe_combine_backend="triton", batch_invariant_mode=True))()
    settings = ExpertSettings.read(config)
    assert settings == ExpertSettings(ExpertGemmBackend.TORCH, ExpertKernel.GROUPED_MM, True, 128,
                                      "triton", True)
    assert type(settings.gemm_backend) is ExpertGemmBackend
    assert type(settings.expert_kernel) is ExpertKernel


@pytest.mark.parametrize("field, value", [("moe_expert_gemm_backend", "cutlass"),
                                          ("moe_expert_gemm_backend", None),
                                          ("moe_expert_kernel", "fast")])
def test_a_value_that_is_not_a_choice_is_refused_naming_field_and_choices(field, value):
    config = type("Config", (), {field: value})()
    with pytest.raises(TorchExpertsConfigError, match=rf"{field}={value!r}.*one of"):
        ExpertSettings.read(config)
