"""Memory-bounded FP32 combine of MoE experts' top-k outputs.

`fp32_combine(expert_out [N, H], token_ids [N], num_tokens, probs=[N] | None) -> y [num_tokens, H]`
in float32, y[t] = sum over rows r with token_ids[r] == t of expert_out[r].float() * probs[r].

The usual form, `y.scatter_add_(0, ids, out.float() * p)`, materialises an FP32 copy of all N rows
(twice the bf16 expert output); its autograd backward gathers a full-size FP32 gradient before
casting it, and with trainable probs the forward also keeps the FP32 copy for backward.
Backends:

- "torch", `chunk_rows=0`: exactly that single-shot scatter-add, through ordinary autograd.
- "torch", `chunk_rows>0`: the same arithmetic `chunk_rows` rows at a time, in forward and backward,
  through `_ChunkedFP32Combine`. Extra memory is the accumulator plus a few chunk-sized buffers
  (plus, in backward, the gradient of expert_out itself). On the CPU the result is bit-identical
  to single-shot; on CUDA scatter-add uses FP32 atomics, so both forms agree to FP32 rounding only.
- "triton": a fused gather-reduce kernel (`combine_triton`): only the accumulator and an O(N)
  integer index, deterministic. `chunk_rows` does not apply to it.

`backend=None` picks "triton" for CUDA tensors when triton imports, else "torch".
`chunk_rows=None` reads MCORE_TORCH_EXPERTS_COMBINE_CHUNK_ROWS; unset means 4096.
"""

import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .enums import CombineBackend
from .settings import ExpertSettings

CHUNK_ROWS_ENV = "MCORE_TORCH_EXPERTS_COMBINE_CHUNK_ROWS"
# 4096 rows bound the FP32 temporary to 4096 * H * 4 bytes: 112 MiB at H = 7168 against 3.5 GiB
# single-shot at 16384 tokens x top-8, for about 5% more time on an H200 (6.65 vs 6.31 ms forward,
# 10.0 vs 9.5 ms forward+backward). Bounded memory is the point of the torch backend, so chunking is
# the default; 0 opts back into single-shot. At small H (1024) 4096-row chunks cost ~25% forward
# time, and 16384 rows is the better trade.
DEFAULT_CHUNK_ROWS = 4096


@dataclass(frozen=True)
class CombineOptions:
    """fp32_combine's options as a config holds them (`moe_combine_chunk_rows`,
    `moe_combine_backend`, read once), checked."""

    chunk_rows: Optional[int] = None
    backend: Optional[CombineBackend] = None

    def __post_init__(self):
        check_options(self.chunk_rows, self.backend)

    @classmethod
    def from_settings(cls, settings: ExpertSettings) -> "CombineOptions":
        return cls(settings.combine_chunk_rows, settings.combine_backend)


def chunk_rows_from_env() -> int:
    """MCORE_TORCH_EXPERTS_COMBINE_CHUNK_ROWS as an int >= 0 (0 = single-shot); unset -> 4096."""
    value = os.environ.get(CHUNK_ROWS_ENV)
    if value is None:
        return DEFAULT_CHUNK_ROWS
    try:
        chunk_rows = int(value)
    except ValueError:
        chunk_rows = -1
    if chunk_rows < 0:
        raise ValueError(
            f"{CHUNK_ROWS_ENV}={value!r} is not a valid row count: use a non-negative integer "
            f"(0 = single-shot, unset = {DEFAULT_CHUNK_ROWS})"
        )
    return chunk_rows


def fp32_combine(expert_out: torch.Tensor, token_ids: torch.Tensor, num_tokens: int, *,
                 probs: Optional[torch.Tensor] = None, chunk_rows: Optional[int] = None,
                 backend: Optional[str] = None) -> torch.Tensor:
    """Sum expert output rows into their tokens in FP32.

    expert_out: [N, H] floating, any row order (e.g. sorted by expert).
    token_ids: [N] integer, the token each row belongs to, in [0, num_tokens).
    probs: optional [N] floating routing weights, multiplied in FP32 before the sum.
    chunk_rows: rows per chunk for the torch backend (0 = single-shot); None reads the env var.
    backend: "torch", "triton" or None (auto). Returns y [num_tokens, H] float32, differentiable
    in expert_out and probs. Tokens without rows get zeros.
    """
    _check_inputs(expert_out, token_ids, num_tokens, probs)
    check_options(chunk_rows, backend)
    if chunk_rows is None:
        chunk_rows = chunk_rows_from_env()
    if _resolve_backend(backend, expert_out) == "triton":
        from .kernels.combine_triton import triton_fp32_combine

        return triton_fp32_combine(expert_out, token_ids, num_tokens, probs)
    token_ids = token_ids.long()
    if chunk_rows == 0:
        return _single_shot_combine(expert_out, token_ids, num_tokens, probs)
    return _ChunkedFP32Combine.apply(expert_out, token_ids, probs, num_tokens, chunk_rows)


def _single_shot_combine(expert_out, token_ids, num_tokens, probs):
    """The reference form: one full-size FP32 temporary, ordinary autograd."""
    rows = expert_out.float()
    if probs is not None:
        rows = rows * probs.float().unsqueeze(1)
    y = expert_out.new_zeros(num_tokens, expert_out.shape[1], dtype=torch.float32)
    return y.scatter_add_(0, token_ids.unsqueeze(1).expand_as(rows), rows)


class _ChunkedFP32Combine(torch.autograd.Function):
    """Chunked scatter-add forward; backward gathers grad_y chunk by chunk into one buffer of
    expert_out's dtype. Saves token_ids, probs, and expert_out only when probs need a gradient."""

    @staticmethod
    def forward(ctx, expert_out, token_ids, probs, num_tokens, chunk_rows):
        y = expert_out.new_zeros(num_tokens, expert_out.shape[1], dtype=torch.float32)
        for chunk in _row_chunks(expert_out.shape[0], chunk_rows):
            _add_rows(y, expert_out[chunk], token_ids[chunk], _rows_of(probs, chunk))
        need_grad_probs = probs is not None and ctx.needs_input_grad[2]
        ctx.save_for_backward(token_ids, probs, expert_out if need_grad_probs else None)
        ctx.expert_out_shape = expert_out.shape
        ctx.expert_out_dtype = expert_out.dtype
        ctx.chunk_rows = chunk_rows
        return y

    @staticmethod
    def backward(ctx, grad_y):
        token_ids, probs, expert_out = ctx.saved_tensors
        grad_out = grad_probs = None
        if ctx.needs_input_grad[0]:
            grad_out = grad_y.new_empty(ctx.expert_out_shape, dtype=ctx.expert_out_dtype)
        if expert_out is not None:
            grad_probs = torch.empty_like(probs)
        for chunk in _row_chunks(ctx.expert_out_shape[0], ctx.chunk_rows):
            _gather_row_grads(grad_y, token_ids[chunk], _rows_of(probs, chunk),
                              _rows_of(expert_out, chunk), _rows_of(grad_out, chunk),
                              _rows_of(grad_probs, chunk))
        return grad_out, None, grad_probs, None, None


def _row_chunks(num_rows: int, chunk_rows: int):
    return (slice(start, start + chunk_rows) for start in range(0, num_rows, chunk_rows))


def _rows_of(tensor: Optional[torch.Tensor], chunk: slice) -> Optional[torch.Tensor]:
    return tensor[chunk] if tensor is not None else None


def _add_rows(y, rows, token_ids, probs):
    """y[token_ids[i]] += rows[i].float() * probs[i]; the FP32 product lives only in this call.

    `rows` is a view of the caller's expert_out: it is never written (for FP32 rows `.float()`
    is the same tensor), the product is a new one.
    """
    if probs is not None:
        rows = rows * probs.float().unsqueeze(1)  # bf16 x fp32 promotes: one FP32 temporary
    rows = rows.float()
    y.scatter_add_(0, token_ids.unsqueeze(1).expand_as(rows), rows)


def _gather_row_grads(grad_y, token_ids, probs, expert_out, grad_out, grad_probs):
    """Fill grad_out [n, H] (grad_y[token_ids] * probs, cast) and grad_probs [n]
    (rowwise dot of grad_y[token_ids] and expert_out in FP32); either may be None."""
    grad_rows = grad_y[token_ids]
    if grad_probs is not None:
        grad_probs.copy_((grad_rows * expert_out.float()).sum(dim=1))
    if grad_out is not None:
        if probs is not None:
            grad_rows.mul_(probs.float().unsqueeze(1))
        grad_out.copy_(grad_rows)


def option_problem(chunk_rows: Optional[int],
                   backend: Optional[str]) -> Optional[Tuple[str, object, str]]:
    """(the option, its value, what it must be) for the first option fp32_combine does not take,
    or None: the one check of fp32_combine's arguments and of the moe_combine_* fields."""
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int)
                                   or chunk_rows < 0):
        return "chunk_rows", chunk_rows, "an int >= 0 (0 = single shot) or None"
    if backend is not None and backend not in tuple(CombineBackend):
        return ("backend", backend,
                f"one of {tuple(b.value for b in CombineBackend)} or None (automatic)")
    return None


def check_options(chunk_rows: Optional[int], backend: Optional[str]) -> None:
    """Refuse a chunk_rows or backend that fp32_combine does not take (ValueError)."""
    if (problem := option_problem(chunk_rows, backend)) is not None:
        option, value, requirement = problem
        raise ValueError(f"{option} must be {requirement}, got {value!r}")


def _resolve_backend(backend: Optional[str], expert_out: torch.Tensor) -> str:
    if backend is None:
        return "triton" if expert_out.is_cuda and _triton_importable() else "torch"
    if backend == "triton":
        _check_triton_can_run(expert_out)
    return backend


def _triton_importable() -> bool:
    try:
        from .kernels import combine_triton  # noqa: F401
    except ImportError:
        return False
    return True


def _check_triton_can_run(expert_out: torch.Tensor) -> None:
    try:
        from .kernels import TRITON_INTERPRETER, combine_triton  # noqa: F401
    except ImportError as error:
        raise RuntimeError(f"backend='triton' needs the triton package: {error}") from error
    if expert_out.is_cuda:
        return
    if expert_out.device.type == "cpu" and TRITON_INTERPRETER:
        return
    raise RuntimeError(
        f"backend='triton' needs CUDA tensors (got {expert_out.device}); on the CPU it runs "
        "only under the Triton interpreter, with TRITON_INTERPRET=1 set before triton is first "
        "imported. Use backend='torch' instead."
    )


def _check_inputs(expert_out, token_ids, num_tokens, probs):
    if expert_out.dim() != 2:
        raise ValueError(f"expert_out must be 2-D [N, H], got shape {list(expert_out.shape)}")
    if not expert_out.is_floating_point():
        raise ValueError(f"expert_out must be floating point, got {expert_out.dtype}")
    num_rows = expert_out.shape[0]
    if token_ids.dim() != 1 or token_ids.shape[0] != num_rows:
        raise ValueError(
            f"token_ids must have shape [{num_rows}] (one id per expert_out row), "
            f"got {list(token_ids.shape)}"
        )
    if token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool:
        raise ValueError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
    if token_ids.device != expert_out.device:
        raise ValueError(f"token_ids is on {token_ids.device}, expert_out on {expert_out.device}")
    if probs is not None:
        if probs.shape != (num_rows,):
            raise ValueError(f"probs must have shape [{num_rows}], got {list(probs.shape)}")
        if not probs.is_floating_point():
            raise ValueError(f"probs must be floating point, got {probs.dtype}")
        if probs.device != expert_out.device:
            raise ValueError(f"probs is on {probs.device}, expert_out on {expert_out.device}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    if num_rows == 0:
        return
    if token_ids.device.type == "cpu":
        low, high = int(token_ids.min()), int(token_ids.max())
        if low < 0 or high >= num_tokens:
            raise ValueError(
                f"token_ids must lie in [0, {num_tokens}), got values from {low} to {high}"
            )
    else:
        in_range = ((token_ids >= 0) & (token_ids < num_tokens)).all()
        torch._assert_async(in_range, f"fp32_combine: token_ids must lie in [0, {num_tokens})")
