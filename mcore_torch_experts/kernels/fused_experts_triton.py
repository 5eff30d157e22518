"""Grouped GEMMs with the expert activation in their epilogues, for frozen experts (Triton).

Two kernels cover the passes over the [T, F] intermediate that TorchGroupedMLP otherwise runs
separately:

- fc1 forward: h = x @ W1[e].T per expert, then act(h) [* (up + offset)] * probs in the epilogue,
  written once in bf16; h itself (bf16, what backward needs) is written only under grad.
- fc2 input gradient: g = grad_out @ W2[e] per expert, then the activation's backward and the
  probs in the epilogue, giving d h directly (and the probs' gradient, per column tile, when the
  probs require grad).

fc2 forward and fc1's input gradient are plain grouped GEMMs and stay on torch's grouped_mm.

A LoRA adapter on either linear: the fc1 kernel runs a second, short K loop of length r over
`scale * x @ A.T` [T, r] (computed outside) and B into the same accumulators, so the epilogue
sees the whole pre-activation; the fc2 input-gradient kernel adds `scale * (g @ B) @ A` the same
way before the activation's backward. The autograd Functions around these launchers, the
adapters' own small GEMMs and gradients: fused_experts.py.

Scheduling needs no host sync and is CUDA-graph capturable: the grid is an upper bound on the
row tiles, cdiv(T, BLOCK_M) + E (each expert wastes at most one partial tile), times the column
tiles; every program finds its expert from the cumulative row ends `offs` on the device (a prefix
sum over per-expert tile counts) and returns at once when it has no tile. Zero-token experts own
no tile. CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before triton is imported.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import TRITON_INTERPRETER
from .activation_triton import _act_and_slope

# DOT_FP32=TRITON_INTERPRETER: under triton's interpreter a bf16 tl.dot reads its operands' bits
# wrongly, so the kernels feed it FP32 copies there (bf16 products are exact in FP32: the result
# is the same up to the order of the sums).


class Tiles(NamedTuple):
    """Block sizes and launch settings of one kernel."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


# The fastest of a sweep on the H200 at the Super EP4, Qwen3-30B-A3B and Nano shapes
# (benchmarks/fused_tiles_sweep.py, BENCHMARKS.md).
FC1_TILES = Tiles(128, 256, 64, 8, 3)
FC1_GLU_TILES = Tiles(128, 128, 64, 8, 3)  # two accumulators (gate and up): 256 columns in all
DGRAD_TILES = Tiles(128, 256, 64, 8, 3)
DGRAD_GLU_TILES = Tiles(128, 128, 64, 8, 4)  # the epilogue reads gate and up


@triton.jit
def _find_tile(offs_ptr, num_experts, pid, num_n_tiles, BLOCK_M: tl.constexpr,
               E_P2: tl.constexpr):
    """This program's (expert, first row, end row, column tile); expert >= num_experts when the
    program has no tile."""
    m_tile = pid // num_n_tiles
    n_tile = pid % num_n_tiles
    e = tl.arange(0, E_P2)
    in_range = e < num_experts
    ends = tl.load(offs_ptr + e, mask=in_range, other=0)
    starts = tl.load(offs_ptr + e - 1, mask=in_range & (e > 0), other=0)
    counts = tl.where(in_range, ends - starts, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, 0)
    expert = tl.sum((tile_end <= m_tile).to(tl.int32), 0)
    mine = e == expert
    first_tile = tl.sum(tl.where(mine, tile_end - tiles, 0), 0)
    row_start = tl.sum(tl.where(mine, starts, 0), 0) + (m_tile - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(mine, ends, 0), 0)
    return expert, row_start, row_end, n_tile


@triton.jit
def _row_tile(ptrs, row_ok, ks, k_left, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """One K step of a GEMM's left operand [BLOCK_M, BLOCK_K]: rows past the tile's expert and
    (unless EVEN_K) the `ks` at or past `k_left` read zero; FP32 copies under DOT_FP32."""
    if EVEN_K:
        tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        tile = tl.load(ptrs, mask=row_ok[:, None] & (ks < k_left)[None, :], other=0.0)
    if DOT_FP32:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _col_tile(ptrs, col_ok, ks, k_left, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """One K step of a GEMM's right operand [BLOCK_K, BLOCK_N]: columns past N and (unless
    EVEN_K) the `ks` at or past `k_left` read zero; FP32 copies under DOT_FP32."""
    if EVEN_K:
        tile = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
    else:
        tile = tl.load(ptrs, mask=col_ok[None, :] & (ks < k_left)[:, None], other=0.0)
    if DOT_FP32:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _fc1_gemm_act_kernel(x_ptr, ids_ptr, w_ptr, offs_ptr, p_ptr, h_ptr, out_ptr, xa_ptr,
                         lb_ptr, num_experts, N, K, R, num_n_tiles, offset, clamp,
                         ACT: tl.constexpr, GLU: tl.constexpr, CLAMP: tl.constexpr,
                         SAVE_H: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr,
                         GATHER: tl.constexpr, LORA: tl.constexpr,
                         LORA_PER_EXPERT: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         E_P2: tl.constexpr):
    """x [T, K], w [E, N or 2N, K] -> out [T, N] = act(h) [* (up + offset)] * p; h [T, N or 2N]
    (bf16 pre-activation) when SAVE_H. With GATHER, row i reads x[ids[i]] (x [tokens, K], ids
    [T]: the routed rows without a permuted copy). With LORA, h = x @ w[e].T + xa @ lb[e].T: xa
    [T, R] (the adapter's scale * x @ A.T), lb [E, N or 2N, R] (LORA_PER_EXPERT) or [N or 2N, R],
    a second, short K loop into the same accumulators."""
    expert, row_start, row_end, n_tile = _find_tile(
        offs_ptr, num_experts, tl.program_id(0), num_n_tiles, BLOCK_M, E_P2)
    if expert >= num_experts:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    rows64 = rows.to(tl.int64)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    if GATHER:
        x_rows = tl.load(ids_ptr + rows64, mask=row_ok, other=0).to(tl.int64)
    else:
        x_rows = rows64
    a_ptrs = x_ptr + x_rows[:, None] * K + ks[None, :]
    w_e = w_ptr + expert.to(tl.int64) * (N * (2 if GLU else 1)) * K
    b_ptrs = w_e + cols[None, :].to(tl.int64) * K + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GLU:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = _row_tile(a_ptrs, row_ok, ks, K - k, EVEN_K, DOT_FP32)
        acc = tl.dot(a, _col_tile(b_ptrs, col_ok, ks, K - k, EVEN_K, DOT_FP32), acc)
        if GLU:
            acc_up = tl.dot(a, _col_tile(b_ptrs + N * K, col_ok, ks, K - k, EVEN_K, DOT_FP32),
                            acc_up)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    width = N * 2 if GLU else N
    if LORA:
        rs = tl.arange(0, BLOCK_R)
        la_ptrs = xa_ptr + rows64[:, None] * R + rs[None, :]
        lb_e = lb_ptr
        if LORA_PER_EXPERT:
            lb_e = lb_ptr + expert.to(tl.int64) * width * R
        lb_ptrs = lb_e + cols[None, :].to(tl.int64) * R + rs[:, None]
        for r in tl.range(0, R, BLOCK_R, num_stages=1):  # short: not pipelined
            a = _row_tile(la_ptrs, row_ok, rs, R - r, False, DOT_FP32)
            acc = tl.dot(a, _col_tile(lb_ptrs, col_ok, rs, R - r, False, DOT_FP32), acc)
            if GLU:
                acc_up = tl.dot(a, _col_tile(lb_ptrs + N * R, col_ok, rs, R - r, False, DOT_FP32),
                                acc_up)
            la_ptrs += BLOCK_R
            lb_ptrs += BLOCK_R
    mask = row_ok[:, None] & col_ok[None, :]
    h_tile = h_ptr + rows64[:, None] * width + cols[None, :]
    gate = acc.to(out_ptr.dtype.element_ty)
    if SAVE_H:
        tl.store(h_tile, gate, mask=mask)
    gate = gate.to(tl.float32)
    if GLU:
        up = acc_up.to(out_ptr.dtype.element_ty)
        if SAVE_H:
            tl.store(h_tile + N, up, mask=mask)
        up = up.to(tl.float32)
        if CLAMP:
            gate = tl.minimum(gate, clamp)
            up = tl.minimum(tl.maximum(up, -clamp), clamp)
    a, _ = _act_and_slope(gate, ACT)
    if GLU:
        a = a * (up + offset)
    p = tl.load(p_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows64[:, None] * N + cols[None, :],
             (a * p[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fc2_dgrad_gemm_act_kernel(g_ptr, w_ptr, offs_ptr, p_ptr, h_ptr, dh_ptr, dp_ptr, gb_ptr,
                               la_ptr, num_experts, N, K, R, T, num_n_tiles, offset, clamp,
                               ACT: tl.constexpr, GLU: tl.constexpr, CLAMP: tl.constexpr,
                               DPROBS: tl.constexpr, EVEN_K: tl.constexpr,
                               DOT_FP32: tl.constexpr, LORA: tl.constexpr,
                               LORA_PER_EXPERT: tl.constexpr, BLOCK_R: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               E_P2: tl.constexpr):
    """g [T, K] (fc2's output gradient), w [E, K, N] (fc2), h [T, N or 2N] -> dh (d h, bf16)
    and, when DPROBS, dp [num_n_tiles, T] FP32 partial sums of the probs' gradient. With LORA,
    the gradient of fc2's input is g @ w[e] + gb @ la[e]: gb [T, R] (scale * g @ B), la
    [E, R, N] (LORA_PER_EXPERT) or [R, N], a second, short K loop into the same accumulator."""
    expert, row_start, row_end, n_tile = _find_tile(
        offs_ptr, num_experts, tl.program_id(0), num_n_tiles, BLOCK_M, E_P2)
    if expert >= num_experts:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    rows64 = rows.to(tl.int64)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = g_ptr + rows64[:, None] * K + ks[None, :]
    b_ptrs = w_ptr + expert.to(tl.int64) * K * N + ks[:, None].to(tl.int64) * N + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        acc = tl.dot(_row_tile(a_ptrs, row_ok, ks, K - k, EVEN_K, DOT_FP32),
                     _col_tile(b_ptrs, col_ok, ks, K - k, EVEN_K, DOT_FP32), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * N
    if LORA:
        rs = tl.arange(0, BLOCK_R)
        ga_ptrs = gb_ptr + rows64[:, None] * R + rs[None, :]
        la_e = la_ptr
        if LORA_PER_EXPERT:
            la_e = la_ptr + expert.to(tl.int64) * R * N
        lb_ptrs = la_e + rs[:, None].to(tl.int64) * N + cols[None, :]
        for r in tl.range(0, R, BLOCK_R, num_stages=1):  # short: not pipelined
            acc = tl.dot(_row_tile(ga_ptrs, row_ok, rs, R - r, False, DOT_FP32),
                         _col_tile(lb_ptrs, col_ok, rs, R - r, False, DOT_FP32), acc)
            ga_ptrs += BLOCK_R
            lb_ptrs += BLOCK_R * N
    mask = row_ok[:, None] & col_ok[None, :]
    width = N * 2 if GLU else N
    h_tile = h_ptr + rows64[:, None] * width + cols[None, :]
    dh_tile = dh_ptr + rows64[:, None] * width + cols[None, :]
    p = tl.load(p_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    grad = acc * p[:, None]
    gate = tl.load(h_tile, mask=mask, other=0.0).to(tl.float32)
    if GLU:
        up = tl.load(h_tile + N, mask=mask, other=0.0).to(tl.float32)
        if CLAMP:
            gate_ok = gate <= clamp
            up_ok = (up >= -clamp) & (up <= clamp)
            gate = tl.minimum(gate, clamp)
            up = tl.minimum(tl.maximum(up, -clamp), clamp)
        up = up + offset
        a, slope = _act_and_slope(gate, ACT)
        d_gate = grad * up * slope
        d_up = grad * a
        if CLAMP:
            d_gate = tl.where(gate_ok, d_gate, 0.0)
            d_up = tl.where(up_ok, d_up, 0.0)
        tl.store(dh_tile, d_gate.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_tile + N, d_up.to(dh_ptr.dtype.element_ty), mask=mask)
        a = a * up
    else:
        a, slope = _act_and_slope(gate, ACT)
        tl.store(dh_tile, (grad * slope).to(dh_ptr.dtype.element_ty), mask=mask)
    if DPROBS:
        partial = tl.sum(tl.where(mask, acc * a, 0.0), 1)
        tl.store(dp_ptr + n_tile * T + rows, partial, mask=row_ok)


def _e_p2(num_experts: int) -> int:
    return max(16, triton.next_power_of_2(num_experts))


def _block_r(rank: int) -> int:
    """The adapter loop's K block: tl.dot needs at least 16; past 32 the loop steps (its operand
    tiles, one stage, stay small beside the main loop's pipelined ones)."""
    return min(32, max(16, triton.next_power_of_2(rank)))


def _grid(rows: int, num_experts: int, tiles: Tiles, width: int):
    """(programs, column tiles): an upper bound on row tiles times the column tiles."""
    n_tiles = triton.cdiv(width, tiles.block_n)
    return (triton.cdiv(rows, tiles.block_m) + num_experts) * n_tiles, n_tiles


def fc1_activation(x, w1, offs, probs, act, glu, offset, clamp, save_h, xa=None, lb=None,
                   token_ids=None):
    """x [T, H], w1 [E, F or 2F, H], offs int32 [E], probs [T] -> (out [T, F], h [T, F or 2F]
    or None). out = act(h) [* (up + offset)] * probs in x's dtype, h = x @ w1[e].T, plus
    xa @ lb.T (or lb[e]) with an adapter: xa [T, r] = scale * x @ A.T (lora_down), lb the
    adapter's B [F or 2F, r] or [E, F or 2F, r]. With token_ids [T] (int64), x holds the
    tokens [tokens, H] and row i reads x[token_ids[i]]."""
    num_experts, width, hidden = w1.shape
    ffn = width // 2 if glu else width
    gather = token_ids is not None
    rows = token_ids.shape[0] if gather else x.shape[0]
    out = x.new_empty(rows, ffn)
    h = x.new_empty(rows, width) if save_h else None
    if rows == 0:
        return out, h
    lora = lb is not None
    rank = xa.shape[1] if lora else 0
    tiles = FC1_GLU_TILES if glu else FC1_TILES
    programs, n_tiles = _grid(rows, num_experts, tiles, ffn)
    _fc1_gemm_act_kernel[(programs,)](
        x, token_ids.contiguous() if gather else offs, w1, offs, probs, h if save_h else out, out,
        xa.contiguous() if lora else x, lb.contiguous() if lora else w1, num_experts, ffn, hidden,
        rank, n_tiles, float(offset), float(clamp or 0.0), ACT=act, GLU=glu,
        CLAMP=clamp is not None, SAVE_H=save_h, EVEN_K=hidden % tiles.block_k == 0,
        DOT_FP32=TRITON_INTERPRETER, GATHER=gather, LORA=lora,
        LORA_PER_EXPERT=lora and lb.dim() == 3, BLOCK_R=_block_r(rank),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        E_P2=_e_p2(num_experts), num_warps=tiles.warps, num_stages=tiles.stages)
    return out, h


def fc2_dgrad_activation(grad_out, w2, offs, probs, h, act, glu, offset, clamp, want_dprobs,
                         gb=None, la=None):
    """grad_out [T, H], w2 [E, H, F], h [T, F or 2F] (saved fc1 output), probs [T] ->
    (d h [T, F or 2F] bf16, d probs [T] FP32 or None). With an adapter on fc2 the gradient of
    its input adds gb @ la (or la[e]): gb [T, r] = scale * grad_out @ B, la the adapter's A
    [r, F] or [E, r, F]."""
    num_experts, hidden, ffn = w2.shape
    rows = grad_out.shape[0]
    dh = torch.empty_like(h)
    tiles = DGRAD_GLU_TILES if glu else DGRAD_TILES
    programs, n_tiles = _grid(rows, num_experts, tiles, ffn)
    if rows == 0:
        return dh, (probs.new_zeros(0, dtype=torch.float32) if want_dprobs else None)
    partial = (torch.empty(n_tiles, rows, dtype=torch.float32, device=h.device)
               if want_dprobs else dh)
    lora = la is not None
    rank = gb.shape[1] if lora else 0
    _fc2_dgrad_gemm_act_kernel[(programs,)](
        grad_out, w2, offs, probs, h, dh, partial, gb.contiguous() if lora else grad_out,
        la.contiguous() if lora else w2, num_experts, ffn, hidden, rank, rows, n_tiles,
        float(offset), float(clamp or 0.0), ACT=act, GLU=glu, CLAMP=clamp is not None,
        DPROBS=want_dprobs, EVEN_K=hidden % tiles.block_k == 0, DOT_FP32=TRITON_INTERPRETER, LORA=lora,
        LORA_PER_EXPERT=lora and la.dim() == 3, BLOCK_R=_block_r(rank),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        E_P2=_e_p2(num_experts), num_warps=tiles.warps, num_stages=tiles.stages)
    # The tiles' partial sums added in tile order, each row alone: cumsum over the outer dim is a
    # sequential scan per row on the CPU and on CUDA, where sum(0) may pick its order by the row
    # count (on the CPU it does from 8 tiles): d probs must not depend on the other rows.
    return dh, (partial.cumsum(0)[-1] if want_dprobs else None)
