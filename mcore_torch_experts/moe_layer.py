"""FP32CombineMoELayer: Megatron's MoELayer, with each token's top-k expert outputs summed in FP32.

Megatron's dispatchers sum a token's k expert rows with `scatter_add_` in the tokens' dtype (bf16),
or promote the whole permuted tensor when probs reach the unpermute. This layer routes that sum
through `fp32_combine` (chunked scatter-add or the fused Triton gather-reduce): FP32 accumulation,
one rounding to the activation dtype, extra memory bounded by the accumulator plus one chunk.
"""

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer

from . import _compat
from .combine import fp32_combine


class FP32CombineMoELayer(MoELayer):
    """MoELayer whose top-k combine accumulates in FP32 (settings from the config:
    `moe_combine_chunk_rows`, `moe_combine_backend`)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, **kwargs):
        super().__init__(config, submodules, layer_number=layer_number,
                         pg_collection=pg_collection, **kwargs)
        _compat.route_unpermute_through(self.token_dispatcher, self.combine_top_k)

    def combine_top_k(self, permuted: torch.Tensor, token_ids: torch.Tensor,
                      restore_shape) -> torch.Tensor:
        """permuted [N, H] expert outputs, token_ids [N] -> [restore_shape[0], H] in permuted's dtype."""
        summed = fp32_combine(permuted, token_ids, restore_shape[0],
                              chunk_rows=getattr(self.config, "moe_combine_chunk_rows", None),
                              backend=getattr(self.config, "moe_combine_backend", None))
        return summed.to(permuted.dtype)
