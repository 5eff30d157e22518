"""Every difference between the supported Megatron-Core releases (0.16.x to 0.19.x)."""

import contextlib
import dataclasses
import functools
import inspect
from typing import Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_pg_rank, get_pg_size


def default_pg_collection(pg_collection: Optional[ProcessGroupCollection]) -> ProcessGroupCollection:
    """The given process groups, or Megatron's global (mpu) ones."""
    if pg_collection is not None:
        return pg_collection
    return ProcessGroupCollection.use_mpu_process_groups()


def group_size(group) -> int:
    return get_pg_size(group)


def group_rank(group) -> int:
    return get_pg_rank(group)


def make_sharded_tensors(state_dict, tp_axis_map, sharded_offsets, tp_group, dp_cp_group):
    """`make_sharded_tensors_for_checkpoint`, passing the groups only where it takes them."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    params = inspect.signature(make_sharded_tensors_for_checkpoint).parameters
    kwargs = {}
    if "tp_group" in params:
        kwargs["tp_group"] = tp_group
    if "dp_cp_group" in params:
        kwargs["dp_cp_group"] = dp_cp_group
    return make_sharded_tensors_for_checkpoint(state_dict, "", tp_axis_map, sharded_offsets,
                                               **kwargs)


def ensure_dp_cp_group(metadata: Optional[dict]) -> dict:
    """Megatron >= 0.16 expects `dp_cp_group` in the sharded-state-dict metadata."""
    from megatron.core.transformer import utils

    ensure = getattr(utils, "ensure_metadata_has_dp_cp_group", None)
    if ensure is not None:
        return ensure(metadata)
    return dict(metadata or {})


def expert_rng_fork():
    """Context in which expert weights are initialised on the GPU (Megatron's expert RNG)."""
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        get_expert_parallel_rng_tracker_name,
    )

    tracker = get_cuda_rng_tracker()
    if torch.cuda.is_available() and tracker.is_initialized():
        return tracker.fork(get_expert_parallel_rng_tracker_name())
    return contextlib.nullcontext()


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
    """Arguments for Megatron's GPT layer-spec builders that this release accepts."""
    params = inspect.signature(builder).parameters
    wanted = dict(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                  qk_layernorm=config.qk_layernorm,
                  multi_latent_attention=config.multi_latent_attention, **kwargs)
    if "moe_use_legacy_grouped_gemm" in params:  # removed in 0.17
        wanted.setdefault("moe_use_legacy_grouped_gemm", False)
    return {k: v for k, v in wanted.items() if k in params}


# --- Launchers' spec callbacks -------------------------------------------------------------------
# Megatron-LM 0.19 (megatron.training.models.gpt.GPTModelBuilder, what `--spec MODULE NAME` feeds)
# calls a callable `transformer_layer_spec` with its GPTModelConfig, which holds the model's
# TransformerConfig as the field `transformer` and proxies attribute reads to it (0.18 added
# HybridModelConfig the same way). Megatron-Bridge providers are TransformerConfig subclasses.


def launcher_transformer_config(config):
    """The TransformerConfig behind what a launcher hands a spec callback: `config` itself, or
    the `transformer` field of a Megatron-LM model config (GPTModelConfig, HybridModelConfig)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if isinstance(config, TransformerConfig):
        return config
    inner = getattr(config, "transformer", None)
    if isinstance(inner, TransformerConfig):
        return inner
    raise TypeError(
        f"a spec callback takes a TransformerConfig (or a Megatron-LM model config holding one "
        f"as `transformer`), got {type(config).__name__}; pass the model's TransformerConfig.")


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
        from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec as hybrid_stack_spec
    return hybrid_stack_spec


def hybrid_model_class():
    """HybridModel (0.18+), or MambaModel before it."""
    try:
        from megatron.core.models.hybrid.hybrid_model import HybridModel
    except ImportError:  # before 0.18
        from megatron.core.models.mamba.mamba_model import MambaModel as HybridModel
    return HybridModel


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
# Both the allgather and the alltoall dispatcher sum a token's top-k rows inside `moe_utils.unpermute`
# (called without probs: the experts already applied them). FP32CombineMoELayer hands each
# dispatcher instance a replacement for the method that calls it. The reversed permutation
# mapping is the rows' token ids (0.16: masked_select; 0.17+: a stable argsort), or TE's row
# map under moe_permute_fusion; the allgather dispatcher keeps its routing map as `local_map`, the
# alltoall one as `routing_map`.
# Alltoall with overlapped shared experts: 0.16/0.17 run the shared experts' fc2 and their output
# communication in `combine_postprocess`; 0.18+ run them in `token_combine`, before it.


def megatron_core_release() -> tuple:
    """The installed megatron-core's (major, minor)."""
    from megatron.core import __version__
    from packaging.version import Version

    return Version(__version__).release[:2]


def shared_experts_fc2_in_combine_postprocess() -> bool:
    return megatron_core_release() < (0, 18)


def permuted_token_ids(routing_map: torch.Tensor, num_rows: int) -> torch.Tensor:
    """routing_map [T, E] bool -> the token of each of the `num_rows` permuted rows [num_rows]:
    expert by expert, tokens ascending within each, the order of Megatron's permute and of
    Transformer Engine's fused one (its row map counts each expert's tokens in token order).
    No host sync (a stable sort, as Megatron's own permute does from 0.17)."""
    experts_by_token = routing_map.bool().T.contiguous().reshape(-1)
    rows = experts_by_token.argsort(descending=True, stable=True)[:num_rows]
    return rows % routing_map.shape[0]


def _token_ids(dispatcher, routing_map: torch.Tensor, permuted: torch.Tensor) -> torch.Tensor:
    """The token of each row of `permuted` [N, H]. Megatron's permute keeps them as the reversed
    mapping; with moe_permute_fusion that holds TE's row map instead, and they are rebuilt."""
    if dispatcher.config.moe_permute_fusion:
        return permuted_token_ids(routing_map, permuted.shape[0])
    return dispatcher.reversed_local_input_permutation_mapping


def route_unpermute_through(dispatcher, combine) -> None:
    """Make `dispatcher` sum top-k rows with `combine(permuted [N, H], token_ids [N], restore_shape)`."""
    from megatron.core.transformer.moe import token_dispatcher as td

    if isinstance(dispatcher, td.MoEAllGatherTokenDispatcher):
        def combine_preprocess(hidden_states):
            token_ids = _token_ids(dispatcher, dispatcher.local_map, hidden_states)
            return combine(hidden_states, token_ids, dispatcher.hidden_shape_before_permute)

        dispatcher.combine_preprocess = combine_preprocess
    elif isinstance(dispatcher, td.MoEAlltoAllTokenDispatcher):
        fc2_here = shared_experts_fc2_in_combine_postprocess()

        def combine_postprocess(permuted_local_input_tokens):
            shared = dispatcher.shared_experts
            if shared is not None and fc2_here:
                shared.linear_fc2_forward(permuted_local_input_tokens)
                shared.post_forward_comm()
            token_ids = _token_ids(dispatcher, dispatcher.routing_map, permuted_local_input_tokens)
            output = combine(permuted_local_input_tokens, token_ids,
                             dispatcher.hidden_shape_before_permute).view(dispatcher.hidden_shape)
            if shared is not None:
                output = output + shared.get_output()
            return output

        dispatcher.combine_postprocess = combine_postprocess
    else:
        raise TypeError(
            f"moe_combine_in_fp32 supports the allgather and alltoall token dispatchers, got "
            f"{type(dispatcher).__name__}; set moe_token_dispatcher_type to 'allgather' or "
            "'alltoall', or moe_combine_in_fp32=False."
        )


# --- Converting built experts modules ------------------------------------------------------------
# SequentialMLP and TEGroupedMLP keep their groups as ep_group / tp_group (expert TP); SequentialMLP
# also keeps dp_group (expert DP), TEGroupedMLP does not (0.16). The legacy GroupedMLP (0.16 only)
# is not converted: moe_use_legacy_grouped_gemm is refused.


def convertible_experts_classes() -> tuple:
    """Megatron's experts modules whose weights TorchGroupedMLP can take over."""
    from megatron.core.transformer.moe import experts

    return tuple(getattr(experts, name) for name in ("SequentialMLP", "TEGroupedMLP")
                 if hasattr(experts, name))


def experts_process_groups(experts) -> ProcessGroupCollection:
    """The expert groups (ep, expt_tp, expt_dp) a built Megatron experts module runs with."""
    groups = ProcessGroupCollection(ep=experts.ep_group, expt_tp=experts.tp_group)
    groups.expt_dp = getattr(experts, "dp_group", None) or default_pg_collection(None).expt_dp
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


# --- Dense-to-MoE upcycling ----------------------------------------------------------------------
# 0.16 to 0.19 (upcycling_utils.py identical): `_get_config` chooses the target key layout with
# `isinstance(experts, SequentialMLP)` / `isinstance(experts, TEGroupedMLP)`, looking both names up
# in the module's globals at call time, and raises TypeError for any other experts class.


@contextlib.contextmanager
def upcycling_accepts_as_te_grouped_mlp(experts_class):
    """Within the context, Megatron's upcycling takes `experts_class` modules for TEGroupedMLP's
    layout (`experts.linear_fc{1,2}.weight{i}`); the module global is restored on exit."""
    from megatron.core.transformer.moe import upcycling_utils

    accepted = upcycling_utils.TEGroupedMLP
    if isinstance(accepted, tuple) and experts_class in accepted:  # nested: already accepted
        yield
        return
    upcycling_utils.TEGroupedMLP = (accepted, experts_class)
    try:
        yield
    finally:
        upcycling_utils.TEGroupedMLP = accepted
