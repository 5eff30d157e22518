"""Reference layer specs: Megatron's own GPT specs with TorchGroupedMLP as the MoE experts when
`config.moe_expert_gemm_backend == "torch"`, and Megatron's choice otherwise; MoE layers become
FP32CombineMoELayer when `config.moe_combine_in_fp32` is set.

Launcher entry points are named by import path from Megatron-LM's `--spec` or a Megatron-Bridge
provider, whose configs have none of this package's fields; the path is what Bridge's
run_config.yaml records, so each one means one choice: `torch_experts_*` TorchGroupedMLP
experts, `fp32_combine_*` Megatron's experts with the FP32 combine, `torch_experts_fp32_combine_*`
both (`*`: `gpt_spec`, `hybrid_stack_spec`). On a TorchExpertsTransformerConfig their fields
still apply; one of those settings held as a plain attribute is refused (the YAML drops it).

The spec decides which module runs; no global switch is read. Modules run on the process groups
their parent hands them, and on Megatron's global (mpu) groups when it hands none: before
megatron-core 0.18 TransformerLayer hands none to FP32CombineMoELayer, which then runs, experts
included, on the mpu groups (docs/guarantees.md, "FP32 top-k combine"). Specs are never changed in
place: Megatron shares one MoE layer spec between all MoE layers of a block.
"""

import dataclasses
import importlib.util
from typing import Optional

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from .. import _compat
from ..config import SpecChoice, spec_choice
from ..experts import TorchGroupedMLP
from .moe_layer import FP32CombineMoELayer

# The spec functions docs/specs.md documents, by the import path launchers record
# (`mcore_torch_experts.specs.NAME`).
__all__ = [
    "fp32_combine_gpt_spec",
    "fp32_combine_hybrid_stack_spec",
    "get_gpt_decoder_block_spec",
    "get_gpt_layer_local_spec",
    "get_gpt_layer_with_transformer_engine_spec",
    "get_hybrid_stack_spec",
    "gpt_transformer_layer_spec",
    "torch_experts_fp32_combine_gpt_spec",
    "torch_experts_fp32_combine_hybrid_stack_spec",
    "torch_experts_gpt_spec",
    "torch_experts_hybrid_stack_spec",
    "with_torch_experts",
]


def torch_experts_spec() -> ModuleSpec:
    """The experts spec for MoESubmodules.experts, on every supported Megatron-Core release."""
    return ModuleSpec(module=TorchGroupedMLP)


def with_torch_experts(layer_spec: ModuleSpec) -> ModuleSpec:
    """A copy of a TransformerLayer spec whose MoE experts are TorchGroupedMLP (dense: unchanged)."""
    mlp = layer_spec.submodules.mlp
    if not _compat.is_moe_mlp_spec(mlp):
        return layer_spec
    moe = dataclasses.replace(_compat.moe_submodules(mlp), experts=torch_experts_spec())
    submodules = dataclasses.replace(layer_spec.submodules,
                                     mlp=_compat.with_moe_submodules(mlp, moe))
    return dataclasses.replace(layer_spec, submodules=submodules)


def with_fp32_combine(layer_spec: ModuleSpec) -> ModuleSpec:
    """A copy of a TransformerLayer spec whose MoE layer sums top-k outputs in FP32."""
    mlp = layer_spec.submodules.mlp
    if not _compat.is_moe_mlp_spec(mlp):
        return layer_spec
    submodules = dataclasses.replace(
        layer_spec.submodules, mlp=_compat.with_moe_layer_class(mlp, FP32CombineMoELayer))
    return dataclasses.replace(layer_spec, submodules=submodules)


def _follow_choice(layer_spec: ModuleSpec, choice: SpecChoice) -> ModuleSpec:
    """A layer spec with the experts and the combine `choice` says (decided and checked once)."""
    if choice.torch_experts:
        layer_spec = with_torch_experts(layer_spec)
    if choice.fp32_combine is not None:
        layer_spec = with_fp32_combine(layer_spec)
    return layer_spec


def get_gpt_layer_with_transformer_engine_spec(config: TransformerConfig, **kwargs) -> ModuleSpec:
    """Megatron's TE GPT layer spec for `config`, `kwargs` going to its builder (over the config's
    settings); MoE experts follow moe_expert_gemm_backend."""
    choice = spec_choice(config, kwargs)
    builder = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec
    spec = builder(**_compat.gpt_layer_spec_kwargs(builder, config, **kwargs))
    return _follow_choice(spec, choice)


def get_gpt_layer_local_spec(config: TransformerConfig, **kwargs) -> ModuleSpec:
    """Megatron's local (no TE) GPT layer spec for `config`, `kwargs` going to its builder (over the
    config's settings); MoE experts follow the backend flag."""
    choice = spec_choice(config, kwargs)
    builder = gpt_layer_specs.get_gpt_layer_local_spec
    spec = builder(**_compat.gpt_layer_spec_kwargs(builder, config, **kwargs))
    return _follow_choice(spec, choice)


def _decoder_block_spec(config: TransformerConfig, use_transformer_engine: bool,
                        choice: SpecChoice, **kwargs):
    block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine, **kwargs)
    layers = [_follow_choice(s, choice) for s in block.layer_specs]
    return dataclasses.replace(block, layer_specs=layers)


def get_gpt_decoder_block_spec(config: TransformerConfig, use_transformer_engine: bool, **kwargs):
    """Megatron's decoder block spec (dense and MoE layers per moe_layer_freq, this pipeline
    stage's layers), MoE experts following moe_expert_gemm_backend.

    `kwargs` go to Megatron's builder: normalization, qk_l2_norm, vp_stage, pp_rank.
    """
    return _decoder_block_spec(config, use_transformer_engine, spec_choice(config, kwargs),
                               **kwargs)


def gpt_transformer_layer_spec(config: TransformerConfig, vp_stage: Optional[int] = None,
                               use_transformer_engine: Optional[bool] = None):
    """What a GPT model provider passes to GPTModel as `transformer_layer_spec`: the decoder block
    spec for MoE configs, one layer spec for dense ones; MoE experts follow
    moe_expert_gemm_backend.

    Megatron-Bridge calls it as `GPTModelProvider.transformer_layer_spec(config, vp_stage=...)`.
    `use_transformer_engine` defaults to whether Transformer Engine is importable.
    """
    if use_transformer_engine is None:
        use_transformer_engine = importlib.util.find_spec("transformer_engine") is not None
    if config.num_moe_experts:
        return get_gpt_decoder_block_spec(config, use_transformer_engine,
                                          normalization=config.normalization,
                                          qk_l2_norm=config.qk_l2_norm, vp_stage=vp_stage)
    if use_transformer_engine:
        return get_gpt_layer_with_transformer_engine_spec(config, qk_l2_norm=config.qk_l2_norm)
    return get_gpt_layer_local_spec(config, normalization=config.normalization,
                                    qk_l2_norm=config.qk_l2_norm)


def launcher_transformer_config(config):
    """The TransformerConfig behind what a launcher hands a spec callback: `config` itself (a
    Megatron-Bridge provider), or the `transformer` field of a Megatron-LM model config
    (Megatron-LM 0.19's GPTModelBuilder, what `--spec MODULE NAME` feeds, calls a callable
    `transformer_layer_spec` with its GPTModelConfig; HybridModelConfig holds it the same way)."""
    if isinstance(config, TransformerConfig):
        return config
    inner = getattr(config, "transformer", None)
    if isinstance(inner, TransformerConfig):
        return inner
    raise TypeError(
        f"a spec callback takes a TransformerConfig (or a Megatron-LM model config holding one "
        f"as `transformer`), got {type(config).__name__}; pass the model's TransformerConfig.")


def _launcher_gpt_spec(config, vp_stage: Optional[int], entry_point: str, experts_absent: str,
                       fp32_combine: bool):
    """A launcher's GPT decoder block spec: TorchGroupedMLP experts unless a
    `moe_expert_gemm_backend` field says otherwise (absent: `experts_absent`), the FP32 combine
    when `fp32_combine` or a `moe_combine_in_fp32` field says so. Transformer Engine or local
    modules as `transformer_impl` says; "inference_optimized" is refused."""
    config = launcher_transformer_config(config)
    choice = spec_choice(config, experts_absent=experts_absent, entry_point=entry_point,
                         entry_point_combines=fp32_combine)
    return _decoder_block_spec(config, config.transformer_impl == "transformer_engine", choice,
                               normalization=config.normalization, qk_l2_norm=config.qk_l2_norm,
                               vp_stage=vp_stage)


def torch_experts_gpt_spec(config, vp_stage: Optional[int] = None):
    """A GPT `transformer_layer_spec` for launchers, named by import path: Megatron's decoder
    block spec (dense and MoE layers per moe_layer_freq, this stage's layers) with TorchGroupedMLP
    experts (unless a `moe_expert_gemm_backend` field says "transformer_engine"). Transformer
    Engine or local modules as `transformer_impl` says.

    `config`: a TransformerConfig or Bridge provider (`provider.transformer_layer_spec(provider,
    vp_stage=...)`), or Megatron-LM 0.19's GPTModelConfig (`--spec mcore_torch_experts.specs
    torch_experts_gpt_spec`), whose `transformer` field is the config every check runs on.
    """
    return _launcher_gpt_spec(config, vp_stage, "torch_experts_gpt_spec", "torch", False)


def torch_experts_fp32_combine_gpt_spec(config, vp_stage: Optional[int] = None):
    """torch_experts_gpt_spec with every MoE layer an FP32CombineMoELayer."""
    return _launcher_gpt_spec(config, vp_stage, "torch_experts_fp32_combine_gpt_spec", "torch",
                              True)


def fp32_combine_gpt_spec(config, vp_stage: Optional[int] = None):
    """Megatron's GPT decoder block spec, as torch_experts_gpt_spec builds it, with Megatron's
    experts (unless a `moe_expert_gemm_backend` field says "torch") and every MoE layer an
    FP32CombineMoELayer."""
    return _launcher_gpt_spec(config, vp_stage, "fp32_combine_gpt_spec", "transformer_engine",
                              True)


def _launcher_hybrid_stack_spec(config, entry_point: str, experts_absent: str,
                                fp32_combine: bool):
    config = launcher_transformer_config(config)
    choice = spec_choice(config, experts_absent=experts_absent, entry_point=entry_point,
                         entry_point_combines=fp32_combine)
    return _hybrid_stack_spec(_compat.megatron_hybrid_stack_spec(), choice)


def torch_experts_hybrid_stack_spec(config):
    """A hybrid `hybrid_stack_spec` for launchers (a Bridge HybridModelProvider calls it as
    `hybrid_stack_spec(provider)`): Megatron's hybrid stack spec (Transformer Engine modules, as
    Bridge's default) with TorchGroupedMLP experts in its MoE layer (unless a
    `moe_expert_gemm_backend` field says "transformer_engine")."""
    return _launcher_hybrid_stack_spec(config, "torch_experts_hybrid_stack_spec", "torch", False)


def torch_experts_fp32_combine_hybrid_stack_spec(config):
    """torch_experts_hybrid_stack_spec with its MoE layer an FP32CombineMoELayer."""
    return _launcher_hybrid_stack_spec(config, "torch_experts_fp32_combine_hybrid_stack_spec",
                                       "torch", True)


def fp32_combine_hybrid_stack_spec(config):
    """Megatron's hybrid stack spec with Megatron's experts (unless a `moe_expert_gemm_backend`
    field says "torch") and its MoE layer an FP32CombineMoELayer."""
    return _launcher_hybrid_stack_spec(config, "fp32_combine_hybrid_stack_spec",
                                       "transformer_engine", True)


def _hybrid_stack_spec(stack_spec, choice: SpecChoice):
    moe_layer = _follow_choice(stack_spec.submodules.moe_layer, choice)
    return dataclasses.replace(stack_spec,
                               submodules=dataclasses.replace(stack_spec.submodules,
                                                              moe_layer=moe_layer))


def get_hybrid_stack_spec(config: TransformerConfig, stack_spec=None):
    """What a hybrid (Nemotron-H style) model provider passes to HybridModel as
    `hybrid_stack_spec`: Megatron's hybrid stack spec (or `stack_spec`, one with the same
    `submodules.moe_layer` field) whose MoE layer follows moe_expert_gemm_backend and
    moe_combine_in_fp32. Mamba, attention and MLP layers are unchanged.
    """
    choice = spec_choice(config)
    if stack_spec is None:
        stack_spec = _compat.megatron_hybrid_stack_spec()
    return _hybrid_stack_spec(stack_spec, choice)


# What launchers and checkpoints record is the launcher path, mcore_torch_experts.specs (which
# re-exports this module's __all__): Bridge's run_config.yaml writes a spec's `_target_` from its
# __module__, so the entry points name that path, as before the specs moved here.
for _name in __all__:
    globals()[_name].__module__ = "mcore_torch_experts.specs"
del _name
