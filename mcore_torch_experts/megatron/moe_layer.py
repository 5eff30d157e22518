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

With TorchGroupedMLP experts on the allgather dispatcher, the dispatcher makes no permuted copy
either: it hands the experts RoutedTokens (routed_tokens.py), the gathered tokens and the token
of each expert-major row, in Megatron's permute order; fc1 reads the rows in place and the
combine reads fc2's rows in place. The alltoall dispatcher permutes before its all-to-all (each
rank's rows must be contiguous to be sent), so its experts get the permuted buffer.
"""

from typing import List, Sequence, Union

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer

from .. import _compat
from ..combine import CombineOptions, fp32_combine
from ..config import validate_fp32_combine_config
from ..experts import TorchGroupedMLP
from ..routed_tokens import RoutedTokens
from ..settings import ExpertSettings


class FP32CombineMoELayer(MoELayer):
    """MoELayer whose top-k combine accumulates in FP32 (settings from the config:
    `moe_combine_chunk_rows`, `moe_combine_backend`). A config the combine cannot run is refused
    (validate_fp32_combine_config) before anything is built. On the allgather dispatcher its
    TorchGroupedMLP experts read the routed rows in place (hand_tokens_in_place).

    Before megatron-core 0.18, TransformerLayer passes `pg_collection` (and, on 0.17,
    `is_mtp_layer`) only to the exact MoELayer class: this layer is built without them and runs
    on Megatron's global (mpu) groups (docs/guarantees.md, "FP32 top-k combine")."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, **kwargs):
        settings = ExpertSettings.read(config)
        # before Megatron builds (and checks) its dispatcher
        validate_fp32_combine_config(config, settings=settings)
        super().__init__(config, submodules, layer_number=layer_number,
                         pg_collection=pg_collection, **kwargs)
        self._route_combine(settings)

    def _route_combine(self, settings: ExpertSettings) -> None:
        """Take the combine settings (the config's, read once) and route the dispatcher's
        combine (and, on allgather with TorchGroupedMLP experts, its rows) through this layer."""
        self.combine_options = CombineOptions.from_settings(settings)
        route_unpermute_through(self.token_dispatcher, self.combine_top_k)
        hand_tokens_in_place(self)

    def combine_top_k(self, permuted: torch.Tensor, token_ids: torch.Tensor,
                      restore_shape) -> torch.Tensor:
        """permuted [N, H] expert outputs, token_ids [N] -> [restore_shape[0], H] in permuted's dtype."""
        summed = fp32_combine(permuted, token_ids, restore_shape[0],
                              chunk_rows=self.combine_options.chunk_rows,
                              backend=self.combine_options.backend)
        return summed.to(permuted.dtype)


def convert_moe_layers_to_fp32_combine(
        model: Union[torch.nn.Module, Sequence[torch.nn.Module]]) -> List[str]:
    """Make every MoELayer of an already built `model` (a module, or a list of model chunks as
    Megatron-LM's get_model and Megatron-Bridge's providers return; exactly MoELayer, not a
    subclass) an FP32CombineMoELayer, in place: the same module objects, parameters and
    state-dict keys, its combine settings read from each layer's config. Every layer's config is
    checked first (validate_fp32_combine_config), so a refusal leaves the model unchanged.
    Returns the converted layers' qualified names (prefixed by the chunk's index for a list, as
    convert_experts_to_torch names them). For models someone else's provider builds; call it
    after convert_experts_to_torch to have the experts read their rows in place."""
    root = torch.nn.ModuleList(model) if isinstance(model, (list, tuple)) else model
    layers = [(name, module) for name, module in root.named_modules()
              if type(module) is MoELayer]
    settings = [ExpertSettings.read(layer.config) for _, layer in layers]
    for (_, layer), read in zip(layers, settings):
        validate_fp32_combine_config(layer.config, "convert_moe_layers_to_fp32_combine", read)
    for (_, layer), read in zip(layers, settings):
        layer.__class__ = FP32CombineMoELayer
        layer._route_combine(read)
    return [name for name, _ in layers]


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


def local_routing(routing_map: torch.Tensor, probs: torch.Tensor, local_experts: range):
    """routing_map [T, E] bool, probs [T, E] -> (tokens_per_expert [E_local] on the host, the
    token of each row [N], each row's prob [N], local map [T, E_local]): rows grouped by local
    expert, tokens ascending within each, as Megatron's permute orders them."""
    local_map = routing_map[:, local_experts.start:local_experts.stop].contiguous()
    by_expert = local_map.T.contiguous()
    tokens = torch.arange(local_map.shape[0], device=local_map.device)
    token_ids = tokens.expand_as(by_expert).masked_select(by_expert)
    row_probs = probs[:, local_experts.start:local_experts.stop].T.contiguous().masked_select(
        by_expert)
    return by_expert.sum(dim=1).long().cpu(), token_ids, row_probs, local_map


def in_global_memory_buffer(tensor: torch.Tensor) -> bool:
    """Whether `tensor` lives in Megatron's global memory buffer, which the next user (the next
    layer's all-gather, a sequence-parallel linear) overwrites: the allgather dispatcher gathers
    the tokens into it when TP x EP > 1 (`use_global_buffer=True`)."""
    from megatron.core import parallel_state

    buffers = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    if buffers is None or tensor.numel() == 0:
        return False
    storage = tensor.untyped_storage().data_ptr()
    return any(buffer.untyped_storage().data_ptr() == storage
               for buffer in buffers.buffer.values())


def hand_tokens_in_place(layer: MoELayer) -> None:
    """Make the layer's allgather dispatcher hand TorchGroupedMLP experts RoutedTokens instead of
    a permuted copy, keeping what its permute keeps for the combine (local_map, local_probs, the
    rows' token ids); other experts modules (checked at each call) get Megatron's permute. The
    alltoall dispatcher is left as it is."""
    from megatron.core.transformer.moe import token_dispatcher as td

    dispatcher = layer.token_dispatcher
    if not isinstance(dispatcher, td.MoEAllGatherTokenDispatcher):
        return
    permute_copy = dispatcher.dispatch_postprocess
    combine_permuted = dispatcher.combine_preprocess

    def dispatch_postprocess(hidden_states, probs):
        dispatcher.rows_in_place = isinstance(layer.experts, TorchGroupedMLP)
        if not dispatcher.rows_in_place:
            return permute_copy(hidden_states, probs)
        first, last = dispatcher.local_expert_indices[0], dispatcher.local_expert_indices[-1]
        tokens_per_expert, token_ids, row_probs, local_map = local_routing(
            dispatcher.routing_map, probs, range(first, last + 1))
        dispatcher.hidden_shape_before_permute = hidden_states.shape
        dispatcher.local_map, dispatcher.local_probs = local_map, row_probs
        dispatcher.reversed_local_input_permutation_mapping = token_ids
        dispatcher.routing_map = None
        routed = RoutedTokens(hidden_states, token_ids, layer.combine_options,
                              reused=in_global_memory_buffer(hidden_states))
        return routed, tokens_per_expert, row_probs

    def combine_preprocess(expert_output):
        if not dispatcher.rows_in_place:
            return combine_permuted(expert_output)
        return layer.combine_top_k(expert_output,
                                   dispatcher.reversed_local_input_permutation_mapping,
                                   dispatcher.hidden_shape_before_permute)

    dispatcher.rows_in_place = False
    dispatcher.dispatch_postprocess = dispatch_postprocess
    dispatcher.combine_preprocess = combine_preprocess


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
