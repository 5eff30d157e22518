"""Every difference between the supported Megatron-Core releases (0.16.x to 0.19.x)."""

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
