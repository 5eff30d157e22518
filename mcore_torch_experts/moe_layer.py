"""FP32CombineMoELayer: Megatron's MoELayer, with each token's top-k expert outputs summed in FP32.

Megatron's dispatchers sum a token's k expert rows with `scatter_add_` in the tokens' dtype (bf16),
or promote the whole permuted tensor when probs reach the unpermute. This layer routes that sum
through `fp32_combine` (chunked scatter-add or the fused Triton gather-reduce): FP32 accumulation,
one rounding to the activation dtype, extra memory bounded by the accumulator plus one chunk.

Both the allgather and the alltoall dispatcher sum a token's top-k rows inside
`moe_utils.unpermute` (called without probs: the experts already applied them); each dispatcher
instance gets a replacement for the method that calls it. The reversed permutation mapping is the
rows' token ids, or TE's row map under moe_permute_fusion; the allgather dispatcher keeps its
routing map as `local_map`, the alltoall one as `routing_map`.
"""

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer

from . import _compat
from .combine import CombineOptions, fp32_combine
from .config import validate_fp32_combine_config


class FP32CombineMoELayer(MoELayer):
    """MoELayer whose top-k combine accumulates in FP32 (settings from the config:
    `moe_combine_chunk_rows`, `moe_combine_backend`). A config the combine cannot run is refused
    (validate_fp32_combine_config) before anything is built.

    Before megatron-core 0.18, TransformerLayer passes `pg_collection` (and, on 0.17,
    `is_mtp_layer`) only to the exact MoELayer class: this layer is built without them and runs
    on Megatron's global (mpu) groups (docs/guarantees.md, "FP32 top-k combine")."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, **kwargs):
        validate_fp32_combine_config(config)  # before Megatron builds (and checks) its dispatcher
        super().__init__(config, submodules, layer_number=layer_number,
                         pg_collection=pg_collection, **kwargs)
        self.combine_options = CombineOptions.from_config(config)
        route_unpermute_through(self.token_dispatcher, self.combine_top_k)

    def combine_top_k(self, permuted: torch.Tensor, token_ids: torch.Tensor,
                      restore_shape) -> torch.Tensor:
        """permuted [N, H] expert outputs, token_ids [N] -> [restore_shape[0], H] in permuted's dtype."""
        summed = fp32_combine(permuted, token_ids, restore_shape[0],
                              chunk_rows=self.combine_options.chunk_rows,
                              backend=self.combine_options.backend)
        return summed.to(permuted.dtype)


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
        fc2_here = _compat.shared_experts_fc2_in_combine_postprocess()

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
