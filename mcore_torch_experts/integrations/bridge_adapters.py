"""Megatron-Bridge's LoRA adapters computed on TorchGroupedLinear experts (bridge.py installs
these when it registers the package with Bridge):

- `_grouped_expert_adapters` / `_grouped_on_torch_experts` wrap `AdapterWrapper.adapter_forward`
  and `GroupedExpertLinearAdapter.forward`: a per-expert adapter on a TorchGroupedLinear is
  called as before (its module hooks run) but computes `grouped_expert_adapter_forward` (one
  grouped GEMM per projection, no host read of the splits), unless `grouped_adapter_obstacle`
  names a setting it cannot honour: then Bridge's own forward runs and the reason is logged once.
- `fused_bridge_lora`: the fused expert kernels' reader of Bridge's LoRALinear
  (kernels.choice.ADAPTER_READERS), shared and per-expert adapters through their parameters.
"""

import functools
from typing import Optional

import torch
from megatron.core.utils import get_pg_size

from .. import experts
from ..experts import TorchGroupedLinear
from ..kernels import grouped_gemm
from ..kernels.choice import FusedAdapter, hooked
from ..kernels.grouped_gemm import Splits, group_offsets

_ORIGINAL = "__torch_experts_original__"
"""The attribute that holds what a wrapper of Bridge's code wraps (registration is idempotent)."""

_LOGGED_OBSTACLES = set()
_BASE = "_torch_grouped_base"  # the keyword that hands the adapter its TorchGroupedLinear


def _grouped_expert_adapters(original, utils):
    @functools.wraps(original)
    def adapter_forward(self, adapter, x, *args, **kwargs):
        base = self.to_wrap
        if (isinstance(base, TorchGroupedLinear)
                and isinstance(adapter, utils.GroupedExpertLinearAdapter)
                and type(adapter).forward is utils.GroupedExpertLinearAdapter.forward):
            obstacle = grouped_adapter_obstacle(adapter, base, x, _splits(args, kwargs))
            if obstacle is None:
                return adapter(x, *args, **kwargs, **{_BASE: base})
            if obstacle not in _LOGGED_OBSTACLES:
                _LOGGED_OBSTACLES.add(obstacle)
                experts.logger.warning(
                    "mcore_torch_experts: Megatron-Bridge's per-expert LoRA on %s runs Bridge's own "
                    "forward (a slice per expert and a host read of the splits), not one grouped "
                    "GEMM per projection: %s", base.name, obstacle)
        return original(self, adapter, x, *args, **kwargs)

    setattr(adapter_forward, _ORIGINAL, original)
    return adapter_forward


def _grouped_on_torch_experts(original):
    @functools.wraps(original)
    def forward(self, x, *args, **kwargs):
        base = kwargs.pop(_BASE, None)
        if base is None:
            return getattr(forward, _ORIGINAL)(self, x, *args, **kwargs)
        return grouped_expert_adapter_forward(self, base, x, _splits(args, kwargs))

    setattr(forward, _ORIGINAL, original)
    return forward


def _splits(args, kwargs) -> Optional[Splits]:
    """The token splits as Bridge's adapter finds them: `m_splits=`, `tokens_per_expert=`, or
    the first extra positional argument."""
    for key in ("m_splits", "tokens_per_expert"):
        if kwargs.get(key) is not None:
            return kwargs[key]
    return args[0] if args else None


def grouped_adapter_obstacle(adapter, base: TorchGroupedLinear, x: torch.Tensor,
                             splits: Optional[Splits]) -> Optional[str]:
    """Why Bridge's GroupedExpertLinearAdapter `adapter` on `base` must run Bridge's own forward
    on x [T, in] (a sentence naming the setting), or None: it runs grouped_expert_adapter_forward."""
    if splits is None:
        return "no token splits were passed (Bridge's forward raises)"
    if adapter._is_te_fp8_enabled():
        return "Transformer Engine FP8 autocast is on (Bridge's TE FP8 grouped linear)"
    etp = get_pg_size(base._pg_collection.expt_tp)
    if etp > 1:
        return (f"expert_tensor_parallel_size={etp} (Bridge gathers and pads the rank-r "
                "activation across expert-TP ranks); set expert_tensor_parallel_size=1")
    a, b = adapter.linear_in.weight, adapter.linear_out.weight
    if not a.dtype == b.dtype == x.dtype:
        return (f"adapter weights are {a.dtype}/{b.dtype} and the input {x.dtype}; keep the "
                "adapters in the experts' dtype (Bridge's default params_dtype)")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"input dtype {x.dtype}: grouped GEMM takes float32, bfloat16 or float16"
    sizes = {"in_features": a.shape[2], "dim": a.shape[1], "out_features": b.shape[1]}
    unaligned = {k: v for k, v in sizes.items() if v * x.element_size() % 16}
    if unaligned:
        return (f"{unaligned} in {x.dtype}: grouped GEMM needs 16-byte rows; choose a dim "
                f"(after normalize_moe_lora) that is a multiple of {16 // x.element_size()}")
    return None


def _offsets(splits: Splits, num_experts: int, x: torch.Tensor) -> torch.Tensor:
    """Cumulative row ends, int32 [E], on x's device. A tensor is not read on the host (the
    base linear has checked these splits in the same call); a list is checked by group_offsets."""
    if isinstance(splits, torch.Tensor):
        return splits.to(x.device, non_blocking=True).cumsum(0).to(torch.int32)
    return group_offsets(splits, num_experts, x.shape[0], x.device)


def grouped_expert_adapter_forward(adapter, base: TorchGroupedLinear, x: torch.Tensor,
                                   splits: Splits) -> torch.Tensor:
    """Bridge's GroupedExpertLinearAdapter math on x [T, in] (rows contiguous by expert) with
    splits [E] -> [T, out]: dropout (pre) -> A_e -> activation -> B_e -> dropout (post) ->
    * alpha / dim, each projection one grouped GEMM over the rows as they are; the factors
    A [E, r, in], B [E, out, r] are read through Bridge's weight containers (their hooks run)."""
    if adapter.dropout_position == "pre":
        x = adapter.dropout(x)
    a, b = adapter.linear_in(), adapter.linear_out()
    scale = adapter.alpha / adapter.dim
    if x.shape[0] == 0:  # as Bridge: zero gradients, not None, for both factors
        anchor = a.reshape(-1)[0] + b.reshape(-1)[0]
        return (x.new_empty((0, b.shape[1])) + anchor * 0.0) * scale
    offload = adapter.config.cpu_offloading and adapter.config.cpu_offloading_activations
    grouped_input = x.contiguous().view_as(x)  # a tensor of our own to mark for offloading
    if offload:
        grouped_input.activation_offloading = True
    offs = _offsets(splits, base.num_experts, x)
    hidden = adapter.activation(grouped_gemm.grouped_mm(grouped_input, a.transpose(1, 2), offs=offs))
    if offload:
        hidden.activation_offloading = True
    out = grouped_gemm.grouped_mm(hidden, b.transpose(1, 2), offs=offs)
    if adapter.dropout_position == "post":
        out = adapter.dropout(out)
    return out * scale


def fused_bridge_lora(linear: torch.nn.Module, linear_type: type,
                      x: torch.Tensor) -> Optional[FusedAdapter]:
    """The fused expert kernels' view of Bridge's LoRALinear around a `linear_type` (exactly
    that class), else None; kernels/choice.ADAPTER_READERS. A disabled adapter is no term (Bridge
    then runs the base alone, and calls no adapter module: only the wrapper's hooks would run);
    the shared (ParallelLinearAdapter) and per-expert
    (GroupedExpertLinearAdapter) layouts are read through their weights as Bridge's forward reads
    them, scale alpha / dim; anything the kernels would compute differently is an obstacle."""
    from megatron.bridge.peft import utils
    from megatron.bridge.peft.lora_layers import LoRALinear

    if type(linear) is not LoRALinear or type(linear.to_wrap) is not linear_type:
        return None
    base, adapter = linear.to_wrap, linear.adapter
    if not linear._adapter_enabled:
        return FusedAdapter(base, obstacle=hooked({"Bridge's LoRALinear": linear}))
    if type(adapter) is utils.ParallelLinearAdapter:
        read = lambda: (adapter.linear_in.weight, adapter.linear_out.weight,  # noqa: E731
                        adapter.alpha / adapter.dim)
    else:
        read = lambda: (adapter.linear_in(), adapter.linear_out(),  # noqa: E731
                        adapter.alpha / adapter.dim)
    return FusedAdapter(base, read, fused_bridge_obstacle(linear, adapter, base, x, utils))


def fused_bridge_obstacle(linear, adapter, base: TorchGroupedLinear, x: torch.Tensor,
                          utils) -> Optional[str]:
    """Why the fused kernels cannot compute Bridge's `adapter` (of its LoRALinear `linear` on
    `base`) on the experts' input x as Bridge's forward does, or None."""
    shared = type(adapter) is utils.ParallelLinearAdapter
    if not shared and type(adapter) is not utils.GroupedExpertLinearAdapter:
        return (f"adapter is Bridge's {type(adapter).__name__}; the kernels take one pair of "
                "factors, shared (share_expert_adapters=True) or per expert "
                "(share_expert_adapters=False), not mixed")
    if not isinstance(adapter.dropout, torch.nn.Identity):
        return (f"adapter has dropout {getattr(adapter.dropout, 'p', '?')} (the fused fc2 input "
                "gradient cannot mask the adapter's share); set the LoRA dropout to 0.0")
    if not isinstance(adapter.activation, torch.nn.Identity):
        return (f"adapter applies {type(adapter.activation).__name__} between its factors; "
                "LoRA's is the identity")
    etp = get_pg_size(base._pg_collection.expt_tp)
    if etp > 1 or (shared and get_pg_size(adapter.tp_group) > 1):
        return (f"adapter spans expert tensor-parallel ranks (expert_tensor_parallel_size="
                f"{etp}); set expert_tensor_parallel_size=1")
    if shared and not adapter.is_expert:
        return "adapter is not built as an expert adapter (its communication would differ)"
    if not shared and adapter._is_te_fp8_enabled():
        return "adapter runs Transformer Engine FP8 autocast"
    if adapter.config.cpu_offloading and adapter.config.cpu_offloading_activations:
        return "adapter's activations are marked for CPU offloading"
    weights = (adapter.linear_in.weight, adapter.linear_out.weight)
    if any(w.dtype != x.dtype for w in weights):
        return (f"adapter weights are {weights[0].dtype}/{weights[1].dtype} and the input "
                f"{x.dtype}; keep the adapters in the experts' dtype (Bridge's default "
                "params_dtype)")
    return hooked({"Bridge's LoRALinear": linear, "adapter": adapter,
                   "adapter's linear_in": adapter.linear_in,
                   "adapter's linear_out": adapter.linear_out})
