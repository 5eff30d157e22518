"""Activation x probs in one Triton kernel for TorchGroupedMLP, forward and backward.

The eager form, `(act(fc1_out) * probs[:, None]).to(bf16)`, runs several memory-bound kernels
(relu and pow, or silu, offset add and mul; a multiply by FP32 probs that writes an FP32 [T, F]
tensor; a cast back) and autograd keeps up to 4F values per row. `FusedActivationProbs` reads
fc1_out once and writes the bf16 result once; backward reads the gradient and fc1_out and writes
d fc1_out once, with d probs (where the router trains) from FP32 row sums in the same pass; it
saves only fc1_out and probs. The math is FP32, rounded once (the eager form rounds act(x) to bf16
before the FP32 multiply: the two differ by at most one bf16 ulp).

Covers squared ReLU and SiLU, gated or not, with glu_linear_offset (what it covers is decided
in choice.py: `activation_kernel_not_covered`); CUDA tensors only (CPU tensors need
TRITON_INTERPRET=1 set before triton is first imported).
"""

import torch
import triton
import triton.language as tl

from .choice import KERNEL_ACTIVATIONS

BLOCK_ROWS, BLOCK_COLS = 8, 256


@triton.jit
def _act_and_slope(x, ACT: tl.constexpr):
    """act(x) and act'(x), FP32; ACT is the activation's KERNEL_ACTIVATIONS code (0 squared
    ReLU, 1 SiLU)."""
    if ACT == 0:
        r = tl.maximum(x, 0.0)
        a = r * r
        slope = 2.0 * r
    else:
        s = 1.0 / (1.0 + tl.exp(-x))
        a = x * s
        slope = s * (1.0 + x * (1.0 - s))
    return a, slope


@triton.jit
def _tile(rows, width, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's row and column indices, and which of them are in range."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = r < rows
    return r, c, row_ok, row_ok[:, None] & (c[None, :] < width)


@triton.jit
def _forward_kernel(h_ptr, p_ptr, out_ptr, rows, width, h_stride, out_stride, offset,
                    ACT: tl.constexpr, GLU: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr):
    r, c, row_ok, mask = _tile(rows, width, BLOCK_R, BLOCK_C)
    h_row = h_ptr + r.to(tl.int64)[:, None] * h_stride
    a, _ = _act_and_slope(tl.load(h_row + c[None, :], mask=mask, other=0.0).to(tl.float32), ACT)
    if GLU:
        a = a * (tl.load(h_row + width + c[None, :], mask=mask, other=0.0).to(tl.float32) + offset)
    p = tl.load(p_ptr + r, mask=row_ok, other=0.0).to(tl.float32)
    out = out_ptr + r.to(tl.int64)[:, None] * out_stride + c[None, :]
    tl.store(out, (a * p[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(g_ptr, h_ptr, p_ptr, dh_ptr, dp_ptr, rows, width, g_stride, h_stride,
                     dp_stride, offset, ACT: tl.constexpr, GLU: tl.constexpr,
                     PROBS_GRAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r, c, row_ok, mask = _tile(rows, width, BLOCK_R, BLOCK_C)
    p = tl.load(p_ptr + r, mask=row_ok, other=0.0).to(tl.float32)
    g_row = g_ptr + r.to(tl.int64)[:, None] * g_stride
    g_unscaled = tl.load(g_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
    g = g_unscaled * p[:, None]
    h_row = h_ptr + r.to(tl.int64)[:, None] * h_stride
    dh_row = dh_ptr + r.to(tl.int64)[:, None] * h_stride
    a, slope = _act_and_slope(tl.load(h_row + c[None, :], mask=mask, other=0.0).to(tl.float32), ACT)
    if GLU:
        up = tl.load(h_row + width + c[None, :], mask=mask, other=0.0).to(tl.float32) + offset
        tl.store(dh_row + c[None, :], (g * up * slope).to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_row + width + c[None, :], (g * a).to(dh_ptr.dtype.element_ty), mask=mask)
        unscaled = a * up
    else:
        tl.store(dh_row + c[None, :], (g * slope).to(dh_ptr.dtype.element_ty), mask=mask)
        unscaled = a
    if PROBS_GRAD:  # this column tile's share of d probs = sum(grad * act(h)), FP32
        share = tl.sum(tl.where(mask, g_unscaled * unscaled, 0.0), axis=1)
        tl.store(dp_ptr + r.to(tl.int64) * dp_stride + tl.program_id(1), share, mask=row_ok)


def _grid(rows, width):
    return (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(width, BLOCK_COLS))


def _forward(h, probs, act, glu, offset):
    width = h.shape[1] // 2 if glu else h.shape[1]
    out = h.new_empty(h.shape[0], width)
    if h.shape[0]:
        _forward_kernel[_grid(h.shape[0], width)](
            h, probs, out, h.shape[0], width, h.stride(0), out.stride(0), offset,
            ACT=act, GLU=glu, BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_COLS)
    return out


class FusedActivationProbs(torch.autograd.Function):
    """(act(h) [* (up + offset)]) * probs -> h.dtype [T, F], from h = fc1_out [T, F or 2F]."""

    @staticmethod
    def forward(ctx, h, probs, act, glu, offset):
        h, probs = h.contiguous(), probs.contiguous()
        ctx.save_for_backward(h, probs)
        ctx.act, ctx.glu, ctx.offset = act, glu, offset
        return _forward(h, probs, act, glu, offset)

    @staticmethod
    def backward(ctx, grad):
        h, probs = ctx.saved_tensors
        grad = grad.contiguous()
        dh = torch.empty_like(h)
        grid = _grid(h.shape[0], grad.shape[1])
        # A trainable router: d probs from per-column-tile FP32 row sums [T, tiles], summed in a
        # fixed order (deterministic; no [T, F] temporary).
        shares = (probs.new_empty(h.shape[0], grid[1], dtype=torch.float32)
                  if ctx.needs_input_grad[1] else None)
        if h.shape[0]:
            _backward_kernel[grid](
                grad, h, probs, dh, shares if shares is not None else probs, h.shape[0],
                grad.shape[1], grad.stride(0), h.stride(0),
                shares.stride(0) if shares is not None else 0, ctx.offset, ACT=ctx.act,
                GLU=ctx.glu, PROBS_GRAD=shares is not None, BLOCK_R=BLOCK_ROWS,
                BLOCK_C=BLOCK_COLS)
        dprobs = shares.sum(-1).to(probs.dtype) if shares is not None else None
        return dh, dprobs, None, None, None


def fused_activation_probs(config, fc1_out: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """fc1_out [T, F or 2F] (bf16), probs [T] -> act(fc1_out) * probs [T, F] in fc1_out's dtype."""
    return FusedActivationProbs.apply(fc1_out, probs, KERNEL_ACTIVATIONS[config.activation_func],
                                      bool(config.gated_linear_unit),
                                      float(config.glu_linear_offset))
