"""TorchGroupedMLP's forward through the fused expert kernels (fused_experts_triton.py): the
autograd Functions around the two kernels, saving only what backward needs, and the LoRA term of
an adapter on either linear (LoRATerm: shared factors or one pair per expert, scale alpha/r).
With RoutedTokens (routed_tokens.py) as the input, fc1's kernel reads each row through the row
index and fc1's input gradient is summed per token (`routed.row_sum()`).

The small `scale * x @ A.T` [T, r] is computed outside the kernels (a grouped GEMM per expert,
or a plain matmul for shared factors) and fed to fc1's kernel; fc2 forward and fc1's input
gradient are plain grouped GEMMs, fc2's adapter added with grouped_mm (or plain matmuls); the
adapters' gradients are exact, from the [T, r] products, fc2's input (for fc2's A) and the
gradients of h and of fc2's output.

While a torch profiler runs, the work is named by the ranges of enums.ProfileRange, forward and
backward: the expert GEMM kernels (the adapter's rank-r products in their epilogues included)
and the adapters' own rank-r GEMMs. Without a profiler no range is opened.
"""

import contextlib
from typing import NamedTuple

import torch

from ..enums import ProfileRange
from . import grouped_gemm
from .choice import KERNEL_ACTIVATIONS
from .factor_linear import factor_linear, factor_product_grad
from .fused_experts_triton import fc1_activation, fc2_dgrad_activation


def profile_range(name: ProfileRange):
    """A torch profiler range named `name` while a profiler runs, else a no-op context."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


class LoRATerm(NamedTuple):
    """An expert linear's LoRA adapter as the fused path takes it: y += scale * (x @ a.T) @ b.T.

    a [r, in] and b [out, r] (one adapter for every expert), or a [E, r, in] and b [E, out, r]
    (one per expert), in the input's dtype (autograd sees the cast from the adapter's weights);
    scale = alpha / r."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def per_expert(self) -> bool:
        return self.a.dim() == 3


def check_lora(term: LoRATerm, name: str, num_experts: int, in_features: int,
               out_features: int, dtype: torch.dtype) -> None:
    """Refuse factors that do not fit the expert weights they adapt, naming the linear."""
    lead = (num_experts,) if term.per_expert else ()
    a_shape, b_shape = tuple(term.a.shape), tuple(term.b.shape)
    rank = a_shape[-2] if term.a.dim() >= 2 else 0
    if (term.a.dim() not in (2, 3) or a_shape != (*lead, rank, in_features)
            or b_shape != (*lead, out_features, rank)):
        raise ValueError(f"{name}: adapter factors A {list(a_shape)} and B {list(b_shape)} do not "
                         f"fit {num_experts} experts of [{out_features}, {in_features}]; expected "
                         f"A [{', '.join(map(str, (*lead, 'r', in_features)))}] and B "
                         f"[{', '.join(map(str, (*lead, out_features, 'r')))}]")
    if term.a.dtype != dtype or term.b.dtype != dtype:
        raise TypeError(f"{name}: adapter factors in {term.a.dtype}/{term.b.dtype}, input in "
                        f"{dtype}; cast them to the input's dtype")


# Small GEMMs of the adapter term, outside the kernels: shared factors are plain matmuls over all
# rows, per-expert ones grouped GEMMs over the same offsets (16-byte strides: r a multiple of 8).

def _rows_times(x, w, offs, transpose):
    """x [T, k] times w [k', n'] (or w[e] for expert e's rows, w [E, k', n']), w transposed
    first when `transpose` -> [T, n]."""
    if w.dim() == 2:
        return x @ (w.t() if transpose else w)
    width = w.shape[1] if transpose else w.shape[2]
    if x.shape[0] == 0:
        return x.new_zeros(0, width)
    return grouped_gemm.grouped_mm(x.contiguous(), w.transpose(1, 2) if transpose else w, offs=offs)


def _factor_grad(left, right, offs, num_experts: int, per_expert: bool, chunked: bool):
    """left [T, p], right [T, q] -> left.T @ right [p, q] (in factor_grad's chunks where
    `chunked`), or per expert [E, p, q] over the experts' rows (zero for an expert without
    rows)."""
    if not per_expert:
        return factor_product_grad(left, right, chunked)
    if left.shape[0] == 0:
        return left.new_zeros(num_experts, left.shape[1], right.shape[1])
    return grouped_gemm.grouped_mm(left.t(), right.contiguous(), offs=offs)


class KernelArgs(NamedTuple):
    """The fused Functions' non-tensor arguments, as one tuple: the activation
    (kernels.choice.KERNEL_ACTIVATIONS), whether it is gated, the gated linear unit's offset and
    clamp, fc2's adapter scale (alpha / r; 1.0 without an adapter), the RoutedTokens whose
    tokens fc1 reads (None: its input is the rows), and whether shared factors take their weight
    gradients in factor_grad's fixed chunks (Megatron's batch-invariant kernels are on:
    kernels/factor_linear.py). Every grouped GEMM goes through kernels.grouped_gemm.grouped_mm."""

    act: str
    glu: bool
    offset: float
    clamp: float | None
    scale: float = 1.0
    routed: object = None
    chunked_grad: bool = False

    @property
    def activation(self) -> tuple:
        """(act, glu, offset, clamp): what the kernels take."""
        return self.act, self.glu, self.offset, self.clamp


def lora_down(x, term: LoRATerm, offs, routed=None, chunked=False):
    """scale * x @ A.T [T, r] (per expert: A[e] for expert e's rows), through autograd (the
    adapter's A and x get their gradients from it; a shared A's in factor_grad's chunks where
    `chunked`). With `routed` (x its tokens): the rows'
    [N, r], shared factors applied to the tokens before the gather (A's gradient reads the
    tokens: a copy of them when they are a reused buffer), per-expert ones after (the gathered
    rows are a copy already)."""
    if routed is not None:
        if term.per_expert:
            return lora_down(routed.rows(), term, offs)
        if term.a.requires_grad and torch.is_grad_enabled():
            x = routed.tokens_to_save()
        return routed.rows(factor_linear(x, term.a, chunked) * term.scale)
    if term.per_expert:
        if x.shape[0] == 0:
            return (x @ term.a[0].t()) * term.scale  # [0, r], still connected to A
        return grouped_gemm.grouped_mm(x.contiguous(), term.a.transpose(1, 2),
                                       offs=offs) * term.scale
    return factor_linear(x, term.a, chunked) * term.scale


class Fc1Activation(torch.autograd.Function):
    """x [T, H] -> (act(h) [* (up + offset)] * probs [T, F], h [T, F or 2F]) with h = fc1(x)
    (with `args.routed`: x the tokens, row i reads x[token_ids[i]], d x summed per token),
    frozen w1 [E, F or 2F, H], plus xa @ lb.T with an adapter (xa = lora_down(x), lb its B).
    The first output carries no gradient back (Fc2AfterActivation hands the gradient of h
    instead); backward is fc1's input gradient, d x = d h @ w1[e], and with an adapter
    d xa = d h @ lb (x and A get the rest through lora_down's autograd) and d lb = d h.T @ xa
    (per expert over its rows). Saves w1, the offsets and, with an adapter, lb (for d xa) and
    xa [T, r] (for d lb), each only when that gradient is wanted; with `args.routed`, its token
    ids (not its tokens)."""

    @staticmethod
    def forward(ctx, x, probs, w1, offs, xa, lb, args: KernelArgs):
        ctx.set_materialize_grads(False)
        wants_dxa, wants_dlb = ctx.needs_input_grad[4:6]
        routed = args.routed
        ctx.save_for_backward(w1, offs, xa if lb is not None and wants_dlb else None,
                              lb if lb is not None and wants_dxa else None,
                              None if routed is None else routed.token_ids)
        ctx.per_expert = lb is not None and lb.dim() == 3
        ctx.chunked = args.chunked_grad
        ctx.sum_rows = None if routed is None else routed.row_sum()
        inter, h = fc1_activation(x.contiguous(), w1, offs, probs.contiguous(), *args.activation,
                                  save_h=True, xa=xa, lb=lb,
                                  token_ids=None if routed is None else routed.token_ids)
        ctx.mark_non_differentiable(inter)
        return inter, h

    @staticmethod
    def backward(ctx, _grad_inter, grad_h):
        w1, offs, xa, lb, token_ids = ctx.saved_tensors
        if grad_h is None:
            return (None,) * 7
        grad_h = grad_h.contiguous()
        dx = None
        if ctx.needs_input_grad[0]:
            with profile_range(ProfileRange.EXPERT_GEMMS):
                if grad_h.shape[0] == 0:
                    dx = grad_h.new_zeros(0, w1.shape[2])
                else:
                    dx = grouped_gemm.grouped_mm(grad_h, w1, offs=offs)
            if token_ids is not None:
                dx = ctx.sum_rows(dx, token_ids)
        dxa = dlb = None
        with profile_range(ProfileRange.EXPERT_ADAPTERS):
            if lb is not None:  # saved only when xa needs its gradient
                dxa = _rows_times(grad_h, lb, offs, transpose=False)
            if xa is not None:  # saved only when lb needs its gradient
                dlb = _factor_grad(grad_h, xa, offs, w1.shape[0], ctx.per_expert, ctx.chunked)
        return dx, None, None, None, dxa, dlb, None


def fc2_forward(inter, w2, offs, term=None):
    """inter [T, F] -> (inter @ w2[e].T [T, H], xr): with an adapter, plus xr @ B.T where
    xr = scale * inter @ A.T [T, r] (per expert: A[e], B[e]); xr None without one."""
    with profile_range(ProfileRange.EXPERT_GEMMS):
        if inter.shape[0] == 0:
            out = inter.new_empty(0, w2.shape[1])
        else:
            out = grouped_gemm.grouped_mm(inter, w2.transpose(1, 2), offs=offs)
    if term is None:
        return out, None
    with profile_range(ProfileRange.EXPERT_ADAPTERS):
        xr = _rows_times(inter, term.a, offs, transpose=True) * term.scale
        return out + _rows_times(xr, term.b, offs, transpose=True), xr


class Fc2AfterActivation(torch.autograd.Function):
    """(inter [T, F], h [T, F or 2F], probs [T]) -> inter @ w2[e].T [T, H], frozen w2 [E, H, F],
    plus scale * (inter @ la.T) @ lb.T with an adapter (A la, B lb; scale = args.scale).

    inter is Fc1Activation's act(h) * probs; backward skips it and returns the gradients of h and
    probs straight from the fused fc2 input-gradient kernel, the adapter's share of fc2's input
    gradient (gb @ la, gb = scale * grad @ lb) in its accumulator. The adapter's gradients:
    d la = gb.T @ inter, d lb = grad.T @ xr (xr = scale * inter @ la.T), per expert over its rows.
    Saves h, probs, w2 and the offsets, and with an adapter its factors, inter (for d la only)
    and xr [T, r] (for d lb only); h is freed when this backward ends, before fc1's input
    gradient runs."""

    @staticmethod
    def forward(ctx, inter, h, probs, w2, offs, la, lb, args: KernelArgs):
        term = None if la is None else LoRATerm(la, lb, args.scale)
        out, xr = fc2_forward(inter, w2, offs, term)
        wants_dla, wants_dlb = ctx.needs_input_grad[5:7]
        ctx.save_for_backward(h, probs, w2, offs, la, lb,
                              inter if term is not None and wants_dla else None,
                              xr if term is not None and wants_dlb else None)
        ctx.args = args
        return out

    @staticmethod
    def backward(ctx, grad_out):
        h, probs, w2, offs, la, lb, inter, xr = ctx.saved_tensors
        args = ctx.args
        grad_out = grad_out.contiguous()
        gb = None
        if la is not None:
            with profile_range(ProfileRange.EXPERT_ADAPTERS):
                gb = _rows_times(grad_out, lb, offs, transpose=False) * args.scale
        with profile_range(ProfileRange.EXPERT_GEMMS):
            dh, dprobs = fc2_dgrad_activation(grad_out, w2, offs, probs.contiguous(), h,
                                              *args.activation,
                                              want_dprobs=ctx.needs_input_grad[2], gb=gb, la=la)
        if dprobs is not None:
            dprobs = dprobs.to(probs.dtype)
        dla = dlb = None
        per_expert = la is not None and la.dim() == 3
        with profile_range(ProfileRange.EXPERT_ADAPTERS):
            if inter is not None:
                dla = _factor_grad(gb, inter, offs, w2.shape[0], per_expert, args.chunked_grad)
            if xr is not None:
                dlb = _factor_grad(grad_out, xr, offs, w2.shape[0], per_expert, args.chunked_grad)
        return None, dh, dprobs, None, None, dla, dlb, None


def fused_experts(config, x, probs, w1, w2, offs, fc1_lora=None, fc2_lora=None, routed=None,
                  chunked_grad=False):
    """TorchGroupedMLP's forward through the fused kernels: x [T, H], probs [T] -> [T, H].

    fc1_lora / fc2_lora: the LoRATerm of an adapter on linear_fc1 / linear_fc2, or None.
    routed: a RoutedTokens whose tokens are x; then probs and the output have its N rows.
    chunked_grad: shared factors' weight gradients in factor_grad's fixed chunks."""
    clamp = config.activation_func_clamp_value if config.gated_linear_unit else None
    args = KernelArgs(KERNEL_ACTIVATIONS[config.activation_func],
                      bool(config.gated_linear_unit), float(config.glu_linear_offset),
                      None if clamp is None else float(clamp),
                      1.0 if fc2_lora is None else fc2_lora.scale, routed, chunked_grad)
    adapter_tensors = [t for term in (fc1_lora, fc2_lora) if term is not None
                       for t in (term.a, term.b)]
    trains = any(t.requires_grad for t in (x, probs, *adapter_tensors))
    if not (torch.is_grad_enabled() and trains):
        with torch.no_grad():
            with profile_range(ProfileRange.EXPERT_ADAPTERS):
                xa = None if fc1_lora is None else lora_down(x, fc1_lora, offs, routed)
            with profile_range(ProfileRange.EXPERT_GEMMS):
                inter, _ = fc1_activation(x.contiguous(), w1, offs, probs.contiguous(),
                                          *args.activation, save_h=False, xa=xa,
                                          lb=None if fc1_lora is None else fc1_lora.b,
                                          token_ids=None if routed is None else routed.token_ids)
            return fc2_forward(inter, w2, offs, fc2_lora)[0]
    with profile_range(ProfileRange.EXPERT_ADAPTERS):
        xa = None if fc1_lora is None else lora_down(x, fc1_lora, offs, routed, chunked_grad)
    with profile_range(ProfileRange.EXPERT_GEMMS):
        inter, h = Fc1Activation.apply(x, probs, w1, offs, xa,
                                       None if fc1_lora is None else fc1_lora.b, args)
        la, lb = (None, None) if fc2_lora is None else fc2_lora[:2]
        return Fc2AfterActivation.apply(inter, h, probs, w2, offs, la, lb, args)
