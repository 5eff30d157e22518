"""Grouped GEMM for frozen expert weights: entry-point choice, split handling, autograd.

`grouped_mm(a [T, K], b [E, K, N], offs=int32 [E] cumulative row ends) -> [T, N]` runs every
expert's rows against its own weight in one launch. The fast path wants bf16 on sm90/sm100;
anything else is a loop inside torch. It is the package's one grouped-GEMM seam: the experts, the
adapters and the fused path all call this module's `grouped_mm`, so replacing that attribute
swaps every grouped GEMM at once.
"""

import functools
import numbers
from typing import Callable, NamedTuple, Sequence, Union

import torch

Splits = Union[torch.Tensor, Sequence[int]]


class GroupedMMEntryPoint(NamedTuple):
    """The grouped GEMM callable and the name it was found under."""

    name: str
    fn: Callable


def find_grouped_mm() -> GroupedMMEntryPoint:
    """Public `torch.nn.functional.grouped_mm` when present, else private `torch._grouped_mm`."""
    public = getattr(torch.nn.functional, "grouped_mm", None)
    if public is not None:
        return GroupedMMEntryPoint("torch.nn.functional.grouped_mm", public)
    private = getattr(torch, "_grouped_mm", None)
    if private is not None:
        return GroupedMMEntryPoint("torch._grouped_mm", private)
    raise RuntimeError(
        f"torch {torch.__version__} has neither torch.nn.functional.grouped_mm nor "
        "torch._grouped_mm; moe_expert_gemm_backend='torch' needs torch >= 2.9. Upgrade torch "
        "or set moe_expert_gemm_backend='transformer_engine'."
    )


@functools.cache
def _entry_point() -> GroupedMMEntryPoint:
    return find_grouped_mm()


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a [T, K] @ b[e] [K, N] for expert e's rows -> [T, N]; offs int32 [E] cumulative row ends.
    Through find_grouped_mm()'s entry point, found on the first call."""
    return _entry_point().fn(a, b, offs=offs)


def group_offsets(tokens_per_expert: Splits, num_groups: int, num_rows: int,
                  device: torch.device) -> torch.Tensor:
    """Validate per-expert row counts and return cumulative row ends, int32 [E], on `device`.

    A list holds ints or 0-d integer tensors. CPU splits (a list or CPU tensor) are checked on
    the host. Splits already on an accelerator are checked with an asynchronous device assert,
    so no host synchronisation happens here.
    """
    if isinstance(tokens_per_expert, torch.Tensor):
        splits = tokens_per_expert
    else:
        counts = list(tokens_per_expert)
        for count in counts:
            if not _is_integer_count(count):
                raise ValueError(f"tokens_per_expert must hold integer counts, got {count!r} "
                                 f"({type(count).__name__}) in {counts}")
        if counts and all(isinstance(count, torch.Tensor) for count in counts):
            splits = torch.stack(counts)  # `list(tokens_per_expert)`: stays on its device
        else:
            splits = torch.tensor([int(count) for count in counts], dtype=torch.int64)
    if splits.dim() != 1 or splits.numel() != num_groups:
        raise ValueError(
            f"tokens_per_expert must hold one count per local expert: expected shape "
            f"[{num_groups}], got {list(splits.shape)}"
        )
    if splits.dtype.is_floating_point or splits.dtype.is_complex or splits.dtype == torch.bool:
        raise ValueError(f"tokens_per_expert must be an integer tensor, got {splits.dtype}")
    splits = splits.to(torch.int64)
    if splits.device.type == "cpu":
        if num_groups and int(splits.min()) < 0:
            raise ValueError(f"tokens_per_expert has a negative count: {splits.tolist()}")
        total = int(splits.sum())
        if total != num_rows:
            raise ValueError(
                f"tokens_per_expert sums to {total} but the input has {num_rows} rows"
                + (" (rows past the split sum come from a fixed-size flex dispatch, which "
                   "TorchGroupedMLP refuses at build: docs/scale_out.md)" if total < num_rows else "")
            )
        return splits.cumsum(0).to(device=device, dtype=torch.int32, non_blocking=True)
    if splits.device != device:
        splits = splits.to(device, non_blocking=True)
    ok = (splits.min() >= 0) & (splits.sum() == num_rows)
    torch._assert_async(ok, "tokens_per_expert must be non-negative and sum to the row count")
    return splits.cumsum(0).to(torch.int32)


def _is_integer_count(count) -> bool:
    """An int (not a bool), or a 0-d tensor of an integer dtype."""
    if isinstance(count, torch.Tensor):
        return count.dim() == 0 and not (count.dtype.is_floating_point or count.dtype.is_complex
                                         or count.dtype == torch.bool)
    return isinstance(count, numbers.Integral) and not isinstance(count, bool)


class FrozenGroupedLinearFunction(torch.autograd.Function):
    """y [T, out] = x [T, in] @ weight[e].T per expert group; gradient for x only.

    Saves the packed weight (the buffer itself, no copy) and the offsets: the input is not needed
    because the weight is frozen.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight, offs)
        if x.shape[0] == 0:
            return x.new_empty(0, weight.shape[1])
        # Grouped GEMM takes 16-byte strides only; any layout (column-major, say) is made so.
        return grouped_mm(x.contiguous(), weight.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        weight, offs = ctx.saved_tensors
        if grad_out.shape[0] == 0:
            return grad_out.new_zeros(0, weight.shape[2]), None, None
        # A stride-0 gradient (from `.sum().backward()`) is rejected by grouped GEMM.
        grad_in = grouped_mm(grad_out.contiguous(), weight, offs=offs)
        return grad_in, None, None


def frozen_grouped_linear(x: torch.Tensor, weight: torch.Tensor,
                          offs: torch.Tensor) -> torch.Tensor:
    """x [T, in], weight [E, out, in] (frozen), offs int32 [E] -> [T, out]."""
    return FrozenGroupedLinearFunction.apply(x, weight, offs)
