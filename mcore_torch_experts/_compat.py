"""Every difference between the supported Megatron-Core releases (0.16.x to 0.19.x)."""

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
    import contextlib

    return contextlib.nullcontext()


# --- Layer specs -------------------------------------------------------------------------------
# 0.16/0.17: the MoE mlp spec is ModuleSpec(module=MoELayer, submodules=MoESubmodules(...)).
# 0.18+:     it is functools.partial(MoELayer, submodules=MoESubmodules(...)).
# Every version builds an experts ModuleSpec (0.16 through build_module, 0.17+ by calling it).


def is_moe_mlp_spec(mlp_spec) -> bool:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return getattr(mlp_spec, "module", None) is MoELayer or getattr(mlp_spec, "func", None) is MoELayer


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
