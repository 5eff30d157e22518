"""Every difference between the supported Megatron-Core releases (0.16.x to 0.20.x), and nothing
else: each section names the releases its shims serve."""

import dataclasses
import functools
import inspect

from megatron.core.process_groups_config import ProcessGroupCollection

# --- Layer specs -------------------------------------------------------------------------------
# 0.16/0.17: the MoE mlp spec is ModuleSpec(module=MoELayer, submodules=MoESubmodules(...)).
# 0.18+:     it is functools.partial(MoELayer, submodules=MoESubmodules(...)).
# Every version builds an experts ModuleSpec (0.16 through build_module, 0.17+ by calling it).


def spec_class(spec):
    """The class a spec builds: a ModuleSpec's `module`, a partial's `func`, or the class itself."""
    if isinstance(spec, functools.partial):
        return spec.func
    return getattr(spec, "module", spec)


def is_moe_mlp_spec(mlp_spec) -> bool:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layer = spec_class(mlp_spec)
    return isinstance(layer, type) and issubclass(layer, MoELayer)


def build_moe_layer(mlp_spec, config, **kwargs):
    """The MoE layer an MoE mlp spec describes, built with `config` and `kwargs`
    (a ModuleSpec through Megatron's build_module, a 0.18+ partial by calling it)."""
    if isinstance(mlp_spec, functools.partial):
        return mlp_spec(config=config, **kwargs)
    from megatron.core.transformer.spec_utils import build_module

    return build_module(mlp_spec, config=config, **kwargs)


def with_moe_layer_class(mlp_spec, layer_class):
    """A copy of the MoE mlp spec that builds `layer_class` (a MoELayer subclass).

    In 0.16/0.17 TransformerLayer hands its pg_collection only to the exact MoELayer class; a
    subclass is built without it and takes Megatron's default (global) process groups.
    """
    if isinstance(mlp_spec, functools.partial):
        return functools.partial(layer_class, *mlp_spec.args, **mlp_spec.keywords)
    return dataclasses.replace(mlp_spec, module=layer_class)


def moe_submodules(mlp_spec):
    if isinstance(mlp_spec, functools.partial):
        return mlp_spec.keywords["submodules"]
    return mlp_spec.submodules


def with_moe_submodules(mlp_spec, submodules):
    """A copy of the MoE mlp spec holding `submodules` (the original may be shared: never mutate)."""
    if isinstance(mlp_spec, functools.partial):
        return functools.partial(mlp_spec.func, *mlp_spec.args,
                                 **{**mlp_spec.keywords, "submodules": submodules})
    return dataclasses.replace(mlp_spec, submodules=submodules)


def gpt_layer_spec_kwargs(builder, config, **kwargs) -> dict:
    """Arguments for one of Megatron's GPT layer-spec builders: the config's MoE and attention
    settings that this release's builder takes, overridden by `kwargs`, which all go through (an
    argument the builder does not take is a TypeError naming the release's parameters)."""
    params = inspect.signature(builder).parameters
    unknown = [name for name in kwargs if name not in params]
    if unknown:
        from megatron.core import __version__

        raise TypeError(
            f"{builder.__module__}.{builder.__qualname__} of megatron-core {__version__} takes no "
            f"argument {', '.join(map(repr, unknown))}; it takes {', '.join(params)}. Correct "
            "the name, or leave the argument out on this release.")
    defaults = dict(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                    qk_layernorm=config.qk_layernorm,
                    multi_latent_attention=config.multi_latent_attention,
                    moe_use_legacy_grouped_gemm=False)  # removed in 0.17
    return {**{k: v for k, v in defaults.items() if k in params}, **kwargs}


# --- Hybrid (Mamba / attention / MLP / MoE) stacks ----------------------------------------------
# 0.16/0.17: MambaModel + MambaStack, spec `models.mamba.mamba_layer_specs.mamba_stack_spec`.
# 0.18+:     HybridModel + HybridStack, spec `models.hybrid.hybrid_layer_specs.hybrid_stack_spec`
#            (MambaModel / MambaStack remain as aliases). Both specs hold the MoE layer's spec as
#            `submodules.moe_layer`.


def megatron_hybrid_stack_spec():
    """Megatron's reference hybrid stack spec of the installed release (its TE modules)."""
    try:
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    except ImportError:  # before 0.18
        from megatron.core.models.mamba.mamba_layer_specs import (
            mamba_stack_spec as hybrid_stack_spec,
        )
    return hybrid_stack_spec


def hybrid_model_class():
    """HybridModel (0.18+), or MambaModel before it."""
    try:
        from megatron.core.models.hybrid.hybrid_model import HybridModel
    except ImportError:  # before 0.18
        from megatron.core.models.mamba.mamba_model import MambaModel as HybridModel
    return HybridModel


def hybrid_stack_spec_kwarg(model_class) -> str:
    """The constructor argument that takes the stack spec: `hybrid_stack_spec` from 0.18,
    `mamba_stack_spec` (MambaModel) before it."""
    params = inspect.signature(model_class).parameters
    return "hybrid_stack_spec" if "hybrid_stack_spec" in params else "mamba_stack_spec"


def hybrid_pattern_kwarg(model_class) -> str:
    """The constructor argument that takes the layer pattern ("*E*E": attention, MoE, ...):
    `hybrid_layer_pattern` from 0.18 (`hybrid_override_pattern` is deprecated there)."""
    params = inspect.signature(model_class).parameters
    return "hybrid_layer_pattern" if "hybrid_layer_pattern" in params else "hybrid_override_pattern"


# --- Activation recompute -----------------------------------------------------------------------
# 0.16/0.17: TransformerBlock._checkpointed_forward runs full recompute; MambaStack
#            (megatron.core.ssm.mamba_block) has none, but its attention, MLP and MoE layers are
#            TransformerLayers that run the selective recompute of their config.
# 0.18+:     module-level megatron.core.recompute.checkpointed_forward, imported by name into
#            transformer_block.py and models/hybrid/hybrid_block.py (HybridStack; MambaStack is
#            an alias), so both run full recompute. Every block keeps `forward(hidden_states, ...)`.


def recompute_block_classes() -> tuple:
    """The block classes whose layers Megatron recomputes (full or selective recompute)."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    try:
        from megatron.core.models.hybrid.hybrid_block import HybridStack
    except ImportError:  # before 0.18
        from megatron.core.ssm.mamba_block import MambaStack as HybridStack
    return (TransformerBlock, HybridStack)


# --- Token dispatchers ---------------------------------------------------------------------------
# Alltoall with overlapped shared experts: 0.16/0.17 run the shared experts' fc2 and their output
# communication in `combine_postprocess`; 0.18+ run them in `token_combine`, before it.


def megatron_core_release() -> tuple:
    """The installed megatron-core's (major, minor)."""
    from megatron.core import __version__
    from packaging.version import Version

    return Version(__version__).release[:2]


def shared_experts_fc2_in_combine_postprocess() -> bool:
    """0.16/0.17: the alltoall dispatcher's `combine_postprocess` runs the overlapped shared
    experts' fc2 and output communication; 0.18+: `token_combine` does, before it."""
    return megatron_core_release() < (0, 18)


# --- NCCL-EP's static shape ----------------------------------------------------------------------
# 0.19: the flag moe_ncclep_static_shape hands the experts the whole fixed receive buffer (rows past
# sum(tokens_per_expert) included); without it the dispatcher narrows to the received rows.
# 0.20: the flag is gone; a set moe_expert_rank_capacity_factor selects the static shape, and None
# the eager mode (TE sizes each step's receive buffer to the received rows).


def ncclep_static_shape(settings) -> tuple:
    """(field, value) of the setting that puts NCCL-EP in its static shape, if `settings` (config
    fields by name) select it, else None."""
    if "moe_ncclep_static_shape" in _transformer_config_fields():
        return ("moe_ncclep_static_shape", True) if settings.get("moe_ncclep_static_shape") else None
    factor = settings.get("moe_expert_rank_capacity_factor")
    return None if factor is None else ("moe_expert_rank_capacity_factor", factor)


def ncclep_dynamic_shape_setting() -> str:
    """The setting that keeps NCCL-EP off its static shape, as a user writes it."""
    if "moe_ncclep_static_shape" in _transformer_config_fields():
        return "moe_ncclep_static_shape=False"
    return "moe_expert_rank_capacity_factor=None"


def _transformer_config_fields():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig.__dataclass_fields__


# --- Converting built experts modules ------------------------------------------------------------
# SequentialMLP and TEGroupedMLP keep their groups as ep_group / tp_group (expert TP); SequentialMLP
# also keeps dp_group (expert DP), TEGroupedMLP does not, but hands its pg_collection to its TE
# grouped linears, which keep it as `_pg_collection` (0.16 to 0.20). The legacy GroupedMLP (0.16
# only) is not converted: moe_use_legacy_grouped_gemm is refused.


def convertible_experts_classes() -> tuple:
    """Megatron's experts modules whose weights TorchGroupedMLP can take over."""
    from megatron.core.transformer.moe import experts

    return tuple(getattr(experts, name) for name in ("SequentialMLP", "TEGroupedMLP")
                 if hasattr(experts, name))


def experts_process_groups(experts) -> ProcessGroupCollection:
    """The expert groups (ep, expt_tp, expt_dp) a built Megatron experts module runs with; expt_dp
    from Megatron's globals only where neither the module nor its TE linears hold one."""
    groups = ProcessGroupCollection(ep=experts.ep_group, expt_tp=experts.tp_group)
    te_linear_groups = getattr(getattr(experts, "linear_fc1", None), "_pg_collection", None)
    groups.expt_dp = (getattr(experts, "dp_group", None)
                      or getattr(te_linear_groups, "expt_dp", None)
                      or ProcessGroupCollection.use_mpu_process_groups().expt_dp)
    return groups


# --- The legacy GroupedMLP ------------------------------------------------------------------------
# 0.16: megatron.core.transformer.moe.experts.GroupedMLP, with grouped_gemm_util (it needs the
# grouped_gemm package). 0.17+: both removed.


def legacy_grouped_mlp():
    """(GroupedMLP, grouped_gemm_is_available) where this release has the legacy module, else
    None (0.17+)."""
    from megatron.core.transformer.moe import experts

    if not hasattr(experts, "GroupedMLP"):
        return None
    from megatron.core.transformer.moe import grouped_gemm_util

    return experts.GroupedMLP, grouped_gemm_util.grouped_gemm_is_available


# --- Batch-invariant kernels ---------------------------------------------------------------------
# 0.19+: megatron.core.transformer.custom_layers.batch_invariant_kernels, a global switch that
# replaces aten::mm/addmm and TE's GEMMs (0.20 adds MoE to the mode); before 0.19 it is absent.

@functools.cache
def _batch_invariant_switch():
    try:
        from megatron.core.transformer.custom_layers.batch_invariant_kernels import (
            is_batch_invariant_mode_enabled,
        )
    except ImportError:
        return None
    return is_batch_invariant_mode_enabled


def batch_invariant_kernels_on() -> bool:
    """Whether Megatron's global batch-invariant kernels are on (False before 0.19)."""
    switch = _batch_invariant_switch()
    return switch is not None and switch()
