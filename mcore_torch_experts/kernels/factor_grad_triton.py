"""A low-rank factor's weight gradient, split over the rows in a fixed way (Triton).

`factor_grad(left [T, p], right [T, q]) -> left.T @ right [p, q] float32`: the weight gradient of
a LoRA factor shared by all T rows (p or q is the rank r; T is every token, or every routed row,
so it can be 65,536 and more). Megatron's batch-invariant matmul runs such a product on one
program per 128 x 128 output tile, each looping over all T rows: 16 to 32 programs for a rank-16
factor, whatever the GPU has. Here the rows are cut into chunks of CHUNK_ROWS, a constant: one
program per (output tile, chunk) sums its chunk's rows in row order in FP32, then one program per
block of outputs adds the chunks' sums in chunk order. The order of every sum depends on the rows'
positions alone, never on T, so a row's contribution is summed the same way whatever follows it
(batch-invariant in the sense of Megatron's fixed K loop), and the result is the same run to run.
The FP32 partial sums live in a buffer of at most PARTIAL_BYTES: past that the chunks go in waves,
each added onto the result in chunk order, the same sums as in one wave.

CUDA tensors run the kernels, and CPU tensors too with TRITON_INTERPRET=1 set before triton is
imported; other CPU tensors take the same chunks' sums as torch ops (`chunked_sums`).
"""

import torch
import triton
import triton.language as tl

from . import TRITON_INTERPRETER

CHUNK_ROWS = 2048   # rows per partial sum: fixed, so the sums never depend on T
BLOCK_ROWS = 64     # rows per K step inside a chunk
BLOCK_SUM = 1024    # outputs per program of the chunk sum
PARTIAL_BYTES = 64 * 2**20  # the partial sums' buffer at most (a wave of chunks)


@triton.jit
def _chunk_partial_kernel(left_ptr, right_ptr, part_ptr, first_chunk, rows, p, q,
                          stride_lt, stride_lp, stride_rt, stride_rq,
                          CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
                          BLOCK_Q: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    tile = tl.program_id(0)
    slot = tl.program_id(1)
    chunk = first_chunk + slot
    tiles_q = tl.cdiv(q, BLOCK_Q)
    ps = (tile // tiles_q) * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = (tile % tiles_q) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    p_ok, q_ok = ps < p, qs < q
    acc = tl.zeros([BLOCK_P, BLOCK_Q], dtype=tl.float32)
    first = chunk.to(tl.int64) * CHUNK
    for step in range(0, CHUNK, BLOCK_T):
        ts = first + step + tl.arange(0, BLOCK_T)
        t_ok = ts < rows
        lt = tl.load(left_ptr + ts[:, None] * stride_lt + ps[None, :] * stride_lp,
                     mask=t_ok[:, None] & p_ok[None, :], other=0.0)
        rt = tl.load(right_ptr + ts[:, None] * stride_rt + qs[None, :] * stride_rq,
                     mask=t_ok[:, None] & q_ok[None, :], other=0.0)
        if DOT_FP32:
            lt, rt = lt.to(tl.float32), rt.to(tl.float32)
        if IEEE:
            acc = tl.dot(tl.trans(lt), rt, acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(lt), rt, acc)
    out = part_ptr + slot.to(tl.int64) * p * q + ps[:, None] * q + qs[None, :]
    tl.store(out, acc, mask=p_ok[:, None] & q_ok[None, :])


@triton.jit
def _chunk_sum_kernel(part_ptr, out_ptr, chunks, size, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < size
    acc = tl.load(out_ptr + i, mask=ok, other=0.0)
    for c in range(0, chunks):
        acc += tl.load(part_ptr + c * size + i, mask=ok, other=0.0)
    tl.store(out_ptr + i, acc, mask=ok)


def _block(width: int) -> int:
    """A tile side for an output dimension: 16 to 64 (tl.dot needs at least 16)."""
    return min(64, max(16, triton.next_power_of_2(width)))


def factor_grad(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """left [T, p], right [T, q] (same dtype: bf16, fp16 or fp32) -> left.T @ right [p, q] float32,
    summed in chunks of CHUNK_ROWS rows (module doc)."""
    if left.dim() != 2 or right.dim() != 2 or left.shape[0] != right.shape[0]:
        raise ValueError(f"factor_grad: left {list(left.shape)} and right {list(right.shape)} "
                         "must be [T, p] and [T, q] with the same T")
    if left.dtype != right.dtype or left.dtype not in (torch.bfloat16, torch.float16,
                                                       torch.float32):
        raise TypeError(f"factor_grad: left {left.dtype}, right {right.dtype}; give both in "
                        "torch.bfloat16, torch.float16 or torch.float32")
    if left.device.type != "cuda" and not TRITON_INTERPRETER:
        return chunked_sums(left, right)
    rows, p = left.shape
    q = right.shape[1]
    out = torch.zeros(p, q, dtype=torch.float32, device=left.device)
    chunks = triton.cdiv(rows, CHUNK_ROWS)
    if chunks == 0 or p == 0 or q == 0:
        return out
    block_p, block_q = _block(p), _block(q)
    wave = max(1, min(chunks, PARTIAL_BYTES // (4 * p * q)))
    part = torch.empty(wave, p, q, dtype=torch.float32, device=left.device)
    tiles = triton.cdiv(p, block_p) * triton.cdiv(q, block_q)
    for first in range(0, chunks, wave):
        count = min(wave, chunks - first)
        _chunk_partial_kernel[(tiles, count)](
            left, right, part, first, rows, p, q, left.stride(0), left.stride(1),
            right.stride(0), right.stride(1), CHUNK=CHUNK_ROWS, BLOCK_T=BLOCK_ROWS,
            BLOCK_P=block_p, BLOCK_Q=block_q, DOT_FP32=TRITON_INTERPRETER,
            IEEE=left.dtype == torch.float32, num_warps=4)
        _chunk_sum_kernel[(triton.cdiv(p * q, BLOCK_SUM),)](part, out, count, p * q,
                                                           BLOCK=BLOCK_SUM)
    return out


def chunked_sums(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """factor_grad's chunks as torch ops (the CPU without triton's interpreter): each chunk's
    left.T @ right in FP32, added in chunk order -> [p, q] float32."""
    out = left.new_zeros(left.shape[1], right.shape[1], dtype=torch.float32)
    for first in range(0, left.shape[0], CHUNK_ROWS):
        out += left[first:first + CHUNK_ROWS].t().float() @ right[first:first + CHUNK_ROWS].float()
    return out
