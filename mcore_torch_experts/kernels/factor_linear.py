"""A shared LoRA factor's products, with its weight gradient split over the rows in the mode.

While Megatron's batch-invariant kernels are on (megatron-core 0.20's `set_batch_invariant_mode`),
its `aten::mm` is one Triton program per 128 x 128 output tile looping over every row: a shared
factor's weight gradient (rank r by width, summed over all T rows) then runs on r/128 x width/128
programs. `factor_linear` and `factor_product_grad` take that gradient from
`factor_grad_triton.factor_grad` instead (fixed chunks of rows, batch-invariant as Megatron's
kernel is) where the caller says `chunked` (it asks `_compat.batch_invariant_kernels_on()`); every
other product stays on `aten::mm`, so on the mode's kernels. Otherwise both are the plain torch
ops.
"""

import torch
import torch.nn.functional as F


class FactorLinear(torch.autograd.Function):
    """x [..., in] @ w.T -> [..., out] for a factor w [out, in]: forward and input gradient on
    aten::mm, w's gradient from factor_grad (FP32 sums, rounded once to w's dtype)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x if w.requires_grad else None, w)
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, grad_y):
        from .factor_grad_triton import factor_grad

        x, w = ctx.saved_tensors
        dx = grad_y @ w if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = factor_grad(grad_y.reshape(-1, w.shape[0]), x.reshape(-1, w.shape[1])).to(w.dtype)
        return dx, dw


def factor_linear(x: torch.Tensor, w: torch.Tensor, chunked: bool) -> torch.Tensor:
    """F.linear(x, w) for a shared LoRA factor w [out, in]; its weight gradient from factor_grad
    where `chunked`."""
    if chunked and w.requires_grad and torch.is_grad_enabled():
        return FactorLinear.apply(x, w)
    return F.linear(x, w)


def factor_product_grad(left: torch.Tensor, right: torch.Tensor, chunked: bool) -> torch.Tensor:
    """left [T, p], right [T, q] -> left.T @ right [p, q] in left's dtype: a shared factor's
    weight gradient inside a backward, from factor_grad where `chunked`."""
    if chunked:
        from .factor_grad_triton import factor_grad

        return factor_grad(left, right.to(left.dtype)).to(left.dtype)
    return left.t() @ right
