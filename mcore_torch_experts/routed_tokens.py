"""RoutedTokens: the experts' input as the tokens and a row index, without a permuted copy.

Megatron's dispatchers copy every routed row into expert-major order (`permute`) before the
experts run, and in backward sum the rows' input gradients back into their tokens. Where every
routed token is local after the dispatch (the allgather dispatcher), FP32CombineMoELayer hands
TorchGroupedMLP the tokens and the token of each expert-major row instead: the fused fc1 kernel
reads each row through that index, and the rows' input gradients are summed per token in FP32
(`fp32_combine`; deterministic with its triton backend), rounded once. Paths that need the rows
contiguous (grouped_mm, moe_apply_probs_on_input, a per-expert adapter's down projection on fc1)
gather them with `rows()`, whose backward is that same sum.

The tokens may be a buffer that Megatron rewrites after this layer's forward: on the allgather
dispatcher with TP x EP > 1 they are its global all-gather buffer
(`get_global_memory_buffer().get_tensor(..., "mpu")`), which the next layer's gather (and a
sequence-parallel linear's) overwrites. Nothing may save them for backward then (`reused`):
what needs them there saves `tokens_to_save()`, a copy; everything else saves the row index.
"""

import functools
from typing import NamedTuple

import torch

from .combine import CombineOptions, fp32_combine


class RoutedTokens(NamedTuple):
    """tokens [T, H] and token_ids [N] (int64, the token of each row, rows grouped by local
    expert in order, as Megatron's permute orders them); `combine` sums row gradients; `reused`:
    the tokens are a buffer rewritten after this forward, which backward must not read."""

    tokens: torch.Tensor
    token_ids: torch.Tensor
    combine: CombineOptions
    reused: bool = False

    def tokens_to_save(self) -> torch.Tensor:
        """The tokens as a tensor autograd may save for backward: a copy [T, H] when they are a
        reused buffer (T rows, where Megatron's permute copies N = T x topk), else the tokens."""
        return self.tokens.clone() if self.reused else self.tokens

    @property
    def num_rows(self) -> int:
        return self.token_ids.shape[0]

    def rows(self, values: torch.Tensor = None) -> torch.Tensor:
        """values [T, k] (default: the tokens) -> their routed rows [N, k], values[token_ids];
        backward sums each row's gradient into its token in FP32."""
        values = self.tokens if values is None else values
        return GatherRows.apply(values, self.token_ids, self.combine)

    def row_sum(self):
        """(row_values [N, k], token_ids [N]) -> [T, k] in row_values' dtype, each token's rows
        summed in FP32; holds the token count and the combine options, no tensor."""
        return functools.partial(sum_rows_by_token, num_tokens=self.tokens.shape[0],
                                 combine=self.combine)


def sum_rows_by_token(row_values: torch.Tensor, token_ids: torch.Tensor, num_tokens: int,
                      combine: CombineOptions) -> torch.Tensor:
    """row_values [N, k], token_ids [N] -> [num_tokens, k] in row_values' dtype (FP32 sum)."""
    return fp32_combine(row_values, token_ids, num_tokens, chunk_rows=combine.chunk_rows,
                        backend=combine.backend).to(row_values.dtype)


class GatherRows(torch.autograd.Function):
    """values [T, k] -> values[token_ids] [N, k]; backward: the FP32 per-token sum of the rows'
    gradients. Saves token_ids only."""

    @staticmethod
    def forward(ctx, values, token_ids, combine):
        ctx.save_for_backward(token_ids)
        ctx.num_tokens, ctx.combine = values.shape[0], combine
        return values.index_select(0, token_ids)

    @staticmethod
    def backward(ctx, grad_rows):
        (token_ids,) = ctx.saved_tensors
        return sum_rows_by_token(grad_rows.contiguous(), token_ids, ctx.num_tokens,
                                 ctx.combine), None, None
