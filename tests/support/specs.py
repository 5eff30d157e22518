"""What the spec, launcher, docs and installed-wheel tests share: the launcher entry points and
the layers each builds, tolerances of the model comparisons, and ways to look into a spec."""

import dataclasses
import functools

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig

from mcore_torch_experts import _compat
from mcore_torch_experts.megatron.moe_layer import FP32CombineMoELayer
from support.tiny_gpt import tiny_config

# Same weights, same math: only the expert GEMM kernels differ (equal on the CPU). Tight enough
# to notice one expert of one layer scaled by 1.5 (logits move by 6e-3, gradients by 0.25).
LOGITS_TOL, GRAD_TOL = 1e-3, 1e-2


def experts_class(layer_spec):
    """The experts class a TransformerLayer spec's MoE mlp builds (ModuleSpec or partial form)."""
    return _compat.spec_class(_compat.moe_submodules(layer_spec.submodules.mlp).experts)


def spec_structure(spec):
    """A spec as comparable plain data: 0.18+ partials compare by identity, so compare what they
    build and with which arguments instead."""
    if isinstance(spec, functools.partial):
        return ("partial", spec.func, tuple(map(spec_structure, spec.args)),
                {k: spec_structure(v) for k, v in spec.keywords.items()})
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return (type(spec), {f.name: spec_structure(getattr(spec, f.name))
                             for f in dataclasses.fields(spec)})
    if isinstance(spec, (list, tuple)):
        return [spec_structure(s) for s in spec]
    if isinstance(spec, dict):
        return {k: spec_structure(v) for k, v in spec.items()}
    return spec


def mlp_kinds(model):
    """Per layer: the MLP class of dense layers, the experts class of MoE layers."""
    return [type(getattr(layer.mlp, "experts", layer.mlp)) for layer in model.decoder.layers]


def plain_config(**attributes):
    """A plain TransformerConfig (as MLA configs and Bridge providers are) with the flag, when
    given, set as an attribute."""
    fields = {f.name: getattr(tiny_config(), f.name) for f in dataclasses.fields(TransformerConfig)
              if f.init}
    config = TransformerConfig(**{**fields, "moe_grouped_gemm": True})
    for name, value in attributes.items():
        setattr(config, name, value)
    return config


# {entry point of mcore_torch_experts.specs: (whose experts its MoE layers build, their class)}
LAUNCHER_ENTRY_POINTS = {
    "torch_experts_gpt_spec": ("torch", MoELayer),
    "torch_experts_fp32_combine_gpt_spec": ("torch", FP32CombineMoELayer),
    "fp32_combine_gpt_spec": ("megatron", FP32CombineMoELayer),
    "torch_experts_hybrid_stack_spec": ("torch", MoELayer),
    "torch_experts_fp32_combine_hybrid_stack_spec": ("torch", FP32CombineMoELayer),
    "fp32_combine_hybrid_stack_spec": ("megatron", FP32CombineMoELayer),
}
