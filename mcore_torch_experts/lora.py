r"""LoRA adapters on Megatron-Core linears, with Megatron-Bridge's wrapper contract.

`LoRALinear(to_wrap, adapter)` calls the base as `to_wrap(x, *args) -> (out, bias)`, calls
`adapter(x, *args)` with the same arguments and returns `(out + adapter_out, bias)`, where
`adapter_out = (dropout(x) @ A.T @ B.T) * alpha / rank`.

- Factors: A (`adapter.linear_in.weight`) starts Xavier-normal, B (`adapter.linear_out.weight`)
  starts at zero, so a freshly wrapped model computes exactly what its base does.
- Expert linears (grouped: TorchGroupedLinear, TE grouped linears; Bridge's name rule
  `.*mlp\..*experts.*\.linear_fc[12]$`, not shared experts) get one adapter per grouped module
  (`expert_adapter="shared"`: A [r, in], B [out, r]) or one per expert (`"per_expert"`:
  A [E, r, in], B [E, out, r], both products one grouped GEMM over the expert's rows).
- Dense linears (Megatron Column/RowParallelLinear; TE linears by their `parallel_mode`) get
  A [r, in_local], B [out_local, r]. Tensor parallelism: a column-parallel base keeps A
  replicated and B sharded like its weight, and the rank-r activation's gradient is all-reduced
  (`copy_to_tensor_model_parallel_region`); a row-parallel base keeps A sharded like its weight
  and B replicated, and the rank-r activation is all-reduced in forward
  (`reduce_from_tensor_model_parallel_region`). Replicated factors then get the same gradient
  on every rank. Sequence parallelism and expert tensor parallelism are refused.
- dtype: adapter weights are kept in the base weight's dtype (Megatron-Bridge's choice) unless
  `dtype` says otherwise (e.g. FP32 master weights); the math runs in the input dtype.
- Expert parallelism: a per-expert adapter is sharded by EP like the expert weights (reduced
  over the expert data-parallel group); a shared expert adapter is one adapter replicated on
  every EP rank, reduced over the full data-parallel group like a dense weight (`allreduce`
  True; with sequence parallelism also summed over TP, `sequence_parallel` True), so every rank
  holds the same weights, trained on every token routed to any of the layer's experts.
- Checkpoints: the base keeps its state-dict keys (adapters add `<base>.adapter.*`); a wrapped
  module's `sharded_state_dict` is its base's (a pretrained base checkpoint loads into a wrapped
  model), unless `metadata` carries `LORA_ADAPTERS_METADATA_KEY: True`: then the adapters too,
  a shared expert adapter as one replicated tensor, a per-expert one sharded by global expert.
  `lora_sharded_state_dict(model)` gives the adapters only; `lora_state_dict` a plain dict.
"""

import math
import re
from typing import Dict, List, Optional, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)
from megatron.core.utils import get_pg_rank, get_pg_size

from ._compat import batch_invariant_kernels_on
from .kernels import grouped_gemm
from .kernels.choice import ADAPTER_READERS, FusedAdapter, hooked
from .kernels.factor_linear import factor_linear
from .kernels.grouped_gemm import Splits, find_grouped_mm, group_offsets

EXPERT_ADAPTERS = ("shared", "per_expert")
# sharded_state_dict(metadata={LORA_ADAPTERS_METADATA_KEY: True}): wrapped linears add adapters
LORA_ADAPTERS_METADATA_KEY = "mcore_torch_experts_lora_adapters"
PER_EXPERT_RANK_MULTIPLE = 8  # grouped GEMM needs 16-byte strides: bf16 rows of r elements


class _Weight(torch.nn.Module):
    """Holds one Parameter as `.weight`, so keys read `adapter.linear_in.weight` as in Bridge."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)


def _lora_factors(leading: tuple, in_features: int, out_features: int, rank: int, dtype, device):
    """A [*leading, r, in] ~ Xavier normal, B [*leading, out, r] = 0."""
    a = torch.empty(*leading, rank, in_features, dtype=dtype, device=device)
    torch.nn.init.normal_(a, std=math.sqrt(2.0 / (in_features + rank)))
    b = torch.zeros(*leading, out_features, rank, dtype=dtype, device=device)
    return _Weight(a), _Weight(b)


def _dropout(p: float) -> torch.nn.Module:
    return torch.nn.Dropout(p) if p > 0 else torch.nn.Identity()


class LoRAAdapter(torch.nn.Module):
    """One low-rank pair for every row: x [..., in] -> [..., out].

    Extra arguments (an expert linear's tokens_per_expert) are accepted and ignored.
    While Megatron's batch-invariant kernels are on, the factors' weight gradients are summed in
    fixed chunks of rows (kernels/factor_linear.py), not on the mode's one-program-per-tile mm.
    `tp_mode` "column"/"row" maps the rank-r activation across `tp_group` (see the module doc).
    """

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float,
                 dropout: float, dtype, device, tp_mode: Optional[str] = None, tp_group=None):
        super().__init__()
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.linear_in, self.linear_out = _lora_factors((), in_features, out_features, rank,
                                                        dtype, device)
        self.dropout = _dropout(dropout)
        self.tp_mode, self.tp_group = tp_mode, tp_group

    def forward(self, x: torch.Tensor, *args) -> torch.Tensor:
        chunked = batch_invariant_kernels_on()  # the weight gradients in fixed chunks of rows
        h = factor_linear(self.dropout(x), self.linear_in.weight.to(x.dtype), chunked)
        if self.tp_mode == "column":
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        elif self.tp_mode == "row":
            h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return factor_linear(h, self.linear_out.weight.to(x.dtype), chunked) * self.scale


class PerExpertLoRAAdapter(torch.nn.Module):
    """A low-rank pair per local expert: x [T, in] (rows contiguous by expert), tokens_per_expert
    [E] -> [T, out]; the rows of expert e use A[e] [r, in] and B[e] [out, r]."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, rank: int,
                 alpha: float, dropout: float, dtype, device):
        super().__init__()
        self.num_experts = num_experts
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.linear_in, self.linear_out = _lora_factors((num_experts,), in_features,
                                                        out_features, rank, dtype, device)
        self.dropout = _dropout(dropout)
        find_grouped_mm()   # refused here where torch has no grouped GEMM

    def forward(self, x: torch.Tensor, tokens_per_expert: Splits) -> torch.Tensor:
        offs = group_offsets(tokens_per_expert, self.num_experts, x.shape[0], x.device)
        a = self.linear_in.weight.to(x.dtype).transpose(1, 2)  # [E, in, r]
        b = self.linear_out.weight.to(x.dtype).transpose(1, 2)  # [E, r, out]
        h = grouped_gemm.grouped_mm(self.dropout(x).contiguous(), a, offs=offs)  # 16-byte strides
        return grouped_gemm.grouped_mm(h, b, offs=offs) * self.scale


class LoRALinear(torch.nn.Module):
    """`to_wrap(x, *args, **kwargs) -> (out, bias)` plus `adapter(x, *args)`.

    A base with a `return_layernorm_output` switch (TE's LayerNorm column linear) is asked for
    its layer-norm output, and the adapter gets that instead of x, as in Megatron-Bridge. The
    base may answer in any form Megatron's linears use: `(out, bias)`, `((out, ln_out), bias)`
    (TE with the switch on), `(out, bias, ln_out)`.
    """

    def __init__(self, to_wrap: torch.nn.Module, adapter: torch.nn.Module):
        super().__init__()
        if hasattr(to_wrap, "return_layernorm_output"):
            to_wrap.return_layernorm_output = True
        self.to_wrap = to_wrap
        self.adapter = adapter
        self.register_state_dict_post_hook(_unwrap_base_keys)
        self._register_load_state_dict_pre_hook(self._wrap_base_keys)

    def forward(self, x: torch.Tensor, *args, **kwargs):
        base_out = self.to_wrap(x, *args, **kwargs)
        if not isinstance(base_out, tuple):
            raise TypeError(f"LoRALinear: the base must return (out, bias), got "
                            f"{type(base_out).__name__}")
        out, bias, adapter_in = base_out[0], base_out[1], x
        if len(base_out) == 3:
            adapter_in = base_out[2]
        elif isinstance(out, tuple):
            out, adapter_in = out
        return out + self.adapter(adapter_in, *args).reshape(out.shape), bias

    def _wrap_base_keys(self, state_dict, prefix, *args):
        """Base keys arrive as the unwrapped module's (`<prefix>weight`): route them to to_wrap."""
        for key in [k for k in state_dict if k.startswith(prefix)]:
            rest = key[len(prefix):]
            if not rest.startswith(("adapter.", "to_wrap.")):
                state_dict[f"{prefix}to_wrap.{rest}"] = state_dict.pop(key)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The base's sharded state dict; with `metadata[LORA_ADAPTERS_METADATA_KEY]` true also
        the adapter's (`adapter_sharded_state_dict`)."""
        result = self.to_wrap.sharded_state_dict(prefix=prefix, sharded_offsets=sharded_offsets,
                                                 metadata=metadata)
        if metadata is not None and metadata.get(LORA_ADAPTERS_METADATA_KEY, False):
            result.update(self.adapter_sharded_state_dict(prefix, sharded_offsets, metadata))
        return result

    def adapter_sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """`<prefix>adapter.linear_{in,out}.weight` as ShardedTensors. A per-expert adapter
        [E_local, ...] is the EP rank's slice of one [E_global, ...] tensor, replicated over the
        expert data-parallel group; a shared expert adapter is one tensor replicated on every
        rank (one main replica: saved once, loaded on every EP rank); a dense adapter is sharded
        over TP like its base weight and replicated over data parallelism."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        adapter, base = self.adapter, self.to_wrap
        weights = {"linear_in.weight": adapter.linear_in.weight,
                   "linear_out.weight": adapter.linear_out.weight}
        pg = getattr(base, "_pg_collection", None)
        if isinstance(adapter, PerExpertLoRAAdapter):
            ep = pg.ep if pg is not None else parallel_state.get_expert_model_parallel_group()
            expt_dp = (pg.expt_dp if pg is not None
                       else parallel_state.get_expert_data_parallel_group())
            ep_axis = len(sharded_offsets)
            return {f"{prefix}adapter.{key}": ShardedTensor.from_rank_offsets(
                        f"{prefix}adapter.{key}", weight, *sharded_offsets,
                        (ep_axis, get_pg_rank(ep), get_pg_size(ep)),
                        replica_id=(0, 0, get_pg_rank(expt_dp)))
                    for key, weight in weights.items()}
        if getattr(adapter, "expert_shared", False):
            axes, tp_group = {}, pg.tp if pg is not None else None  # replicated everywhere
        else:
            tp_group = getattr(base, "tp_group", None) if get_pg_size(
                getattr(base, "tp_group", None)) > 1 else None
            axes = {"column": {"linear_out.weight": 0}, "row": {"linear_in.weight": 1}}.get(
                adapter.tp_mode, {})
        return make_sharded_tensors_for_checkpoint(
            weights, f"{prefix}adapter.", axes, sharded_offsets, tp_group=tp_group,
            dp_cp_group=metadata["dp_cp_group"])


def fused_lora(linear: torch.nn.Module, linear_type: type, x: torch.Tensor):
    """The fused expert kernels' view of our LoRALinear around a `linear_type` (exactly those
    classes: a subclass's forward may do anything), else None; kernels/choice.ADAPTER_READERS."""
    if type(linear) is not LoRALinear or type(linear.to_wrap) is not linear_type:
        return None
    adapter = linear.adapter
    factors = lambda: (adapter.linear_in.weight, adapter.linear_out.weight, adapter.scale)  # noqa: E731
    return FusedAdapter(linear.to_wrap, factors, _fused_obstacle(linear, adapter))


def _fused_obstacle(linear: "LoRALinear", adapter: torch.nn.Module) -> Optional[str]:
    """Why the fused kernels cannot compute `adapter` of our LoRALinear `linear`, or None."""
    if type(adapter) not in (LoRAAdapter, PerExpertLoRAAdapter):
        return (f"adapter is a {type(adapter).__name__}, not one of mcore_torch_experts.lora's "
                "LoRAAdapter/PerExpertLoRAAdapter")
    if getattr(adapter, "tp_mode", None) is not None:
        return "adapter maps its rank-r activation across tensor-parallel ranks"
    if not isinstance(adapter.dropout, torch.nn.Identity):
        return (f"adapter has dropout {getattr(adapter.dropout, 'p', '?')} (the fused fc2 input "
                "gradient cannot mask the adapter's share); apply_lora(dropout=0.0) adapters are "
                "fused")
    return hooked({"LoRALinear": linear, "adapter": adapter,
                   "adapter's linear_in": adapter.linear_in,
                   "adapter's linear_out": adapter.linear_out})


ADAPTER_READERS.append(fused_lora)


def _unwrap_base_keys(module, state_dict, prefix, local_metadata):
    """State-dict post-hook: `<prefix>to_wrap.weight` -> `<prefix>weight`, as if unwrapped."""
    inner = f"{prefix}to_wrap."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def is_expert_linear(name: str) -> bool:
    """Megatron-Bridge's rule: a routed-expert linear, not a shared expert's."""
    return (re.match(r".*mlp\..*experts.*\.linear_fc[12]$", name) is not None
            and ".shared_experts." not in name)


def _matches(name: str, targets: Sequence[str]) -> bool:
    """Bridge's matching: a target with `*` is a pattern for the full name, else the last part."""
    last = name.rsplit(".", 1)[-1]
    return any(re.fullmatch(re.escape(t).replace(r"\*", ".*"), name) if "*" in t else last == t
               for t in targets)


def _parallel_mode(base: torch.nn.Module) -> Optional[str]:
    if isinstance(base, ColumnParallelLinear):
        return "column"
    if isinstance(base, RowParallelLinear):
        return "row"
    return getattr(base, "parallel_mode", None)  # TE linears: "column", "row", None/"duplicated"


def _expert_adapter(name, base, rank, alpha, dropout, expert_adapter, dtype):
    etp = getattr(base.config, "expert_tensor_parallel_size", 1) or 1
    if etp > 1:
        raise NotImplementedError(
            f"{name}: expert adapters need expert_tensor_parallel_size=1 (got {etp})")
    out_features, in_features = base.weight0.shape
    dtype, device = dtype or base.weight0.dtype, base.weight0.device
    if expert_adapter == "shared":
        adapter = LoRAAdapter(in_features, out_features, rank, alpha, dropout, dtype, device)
        # One adapter for all of the layer's experts, on every EP rank: each EP rank computes
        # the share of its local experts' tokens, so the gradient is summed over the full
        # data-parallel group that spans EP (a dense weight's `allreduce`), and over TP where
        # sequence parallelism gives each TP rank other tokens (as Megatron's layer norms).
        adapter.expert_shared = True
        for p in adapter.parameters():
            p.allreduce = True
            if getattr(base.config, "sequence_parallel", False) and (
                    getattr(base.config, "tensor_model_parallel_size", 1) or 1) > 1:
                p.sequence_parallel = True
        return adapter
    num_experts = getattr(base, "num_experts", None) or base.num_gemms  # ours / TE GroupedLinear
    return PerExpertLoRAAdapter(num_experts, in_features, out_features, rank, alpha, dropout,
                                dtype, device)


def _dense_adapter(name, base, rank, alpha, dropout, dtype):
    out_features, in_features = base.weight.shape
    mode = _parallel_mode(base)
    tp_group = getattr(base, "tp_group", None)
    tp_size = get_pg_size(tp_group)
    if tp_size > 1:
        if mode not in ("column", "row"):
            raise NotImplementedError(f"{name}: unknown tensor-parallel layout {mode!r}")
        if getattr(base.config, "sequence_parallel", False):
            raise NotImplementedError(f"{name}: LoRA with sequence_parallel=True is not supported")
        if getattr(base, "gather_output", False):
            raise NotImplementedError(f"{name}: LoRA on a column-parallel base with "
                                      "gather_output=True is not supported")
    adapter = LoRAAdapter(in_features, out_features, rank, alpha, dropout,
                          dtype or base.weight.dtype, base.weight.device,
                          tp_mode=mode if tp_size > 1 else None, tp_group=tp_group)
    if mode == "column":
        set_tensor_model_parallel_attributes(adapter.linear_out.weight, True, 0, 1)
    elif mode == "row":
        set_tensor_model_parallel_attributes(adapter.linear_in.weight, True, 1, 1)
    return adapter


def _make_adapter(name, base, rank, alpha, dropout, expert_adapter, dtype):
    if is_expert_linear(name) and isinstance(getattr(base, "weight0", None), torch.Tensor):
        adapter = _expert_adapter(name, base, rank, alpha, dropout, expert_adapter, dtype)
        base_weight = base.weight0
    elif isinstance(getattr(base, "weight", None), torch.Tensor) and base.weight.dim() == 2:
        adapter = _dense_adapter(name, base, rank, alpha, dropout, dtype)
        base_weight = base.weight
    else:
        raise TypeError(f"apply_lora: {name} ({type(base).__name__}) matches the targets but is "
                        "not a linear layer LoRA can wrap")
    # Per-expert adapters are reduced like their base (expert-parallel bases over the expert
    # data-parallel group); a shared expert adapter set its own (_expert_adapter).
    if not getattr(adapter, "expert_shared", False):
        for p in adapter.parameters():
            p.allreduce = getattr(base_weight, "allreduce", True)
    return adapter


def apply_lora(model: torch.nn.Module, targets: Sequence[str], rank: int, alpha: float,
               dropout: float = 0.0, expert_adapter: str = "shared",
               dtype: Optional[torch.dtype] = None) -> List[str]:
    """Freeze every parameter of `model` except the adapters of earlier calls (left as they
    are), wrap each target linear in LoRALinear, return the wrapped module names.

    targets: names like ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"] (matching the
    last part of a module name) or patterns with `*` (matching the full name). Modules inside
    an earlier call's LoRALinear (its base and adapter) are never matched; a target that is
    already a LoRALinear is refused.
    expert_adapter: "shared" or "per_expert" (rank a multiple of 8). dtype: adapter weights'
    dtype, default the base weight's.
    """
    if expert_adapter not in EXPERT_ADAPTERS:
        raise ValueError(f"expert_adapter={expert_adapter!r}: choose one of {EXPERT_ADAPTERS}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"rank={rank!r}: the LoRA rank must be a positive integer")
    if expert_adapter == "per_expert" and rank % PER_EXPERT_RANK_MULTIPLE:
        raise ValueError(f"rank={rank}: expert_adapter='per_expert' needs a multiple of "
                         f"{PER_EXPERT_RANK_MULTIPLE} (grouped GEMM needs 16-byte strides)")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout={dropout!r}: must lie in [0, 1)")
    if isinstance(targets, str) or not targets:
        raise ValueError(f"targets={targets!r}: give a non-empty list of module names or patterns")
    inside_wrappers = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, LoRALinear))
    found = [(n, m) for n, m in model.named_modules()
             if n and _matches(n, targets) and not n.startswith(inside_wrappers)]
    if not found:
        raise ValueError(f"targets={list(targets)} matched no module of {type(model).__name__}")
    wrapped_already = [n for n, m in found if isinstance(m, LoRALinear)]
    if wrapped_already:
        raise ValueError(f"apply_lora: {wrapped_already} already carry LoRA adapters")
    adapters = [_make_adapter(n, m, rank, alpha, dropout, expert_adapter, dtype) for n, m in found]
    earlier_adapters = {id(p) for p in lora_parameters(model).values()}
    for p in model.parameters():
        if id(p) not in earlier_adapters:
            p.requires_grad_(False)
    for (name, base), adapter in zip(found, adapters):
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, LoRALinear(base, adapter))
    return [name for name, _ in found]


def lora_parameters(model: torch.nn.Module) -> Dict[str, torch.nn.Parameter]:
    """Every adapter parameter of `model` by its state-dict key (what the optimizer trains)."""
    return {f"{name}.adapter.{key}": p
            for name, module in model.named_modules() if isinstance(module, LoRALinear)
            for key, p in module.adapter.named_parameters()}


def lora_state_dict(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The adapter weights only, under the keys `model.state_dict()` gives them."""
    return {key: p.detach() for key, p in lora_parameters(model).items()}


def lora_sharded_state_dict(model: torch.nn.Module, prefix: str = "",
                            metadata: Optional[dict] = None) -> dict:
    """The adapters' ShardedTensors only, for Megatron's distributed checkpoints, under the keys
    `model.sharded_state_dict(prefix)` gives them (LoRALinear.adapter_sharded_state_dict). `model`
    must have `sharded_state_dict` (a MegatronModule). Save with `dist_checkpointing.save`; load
    with `dist_checkpointing.load(lora_sharded_state_dict(fresh), dir)` then
    `load_lora_state_dict(fresh, loaded)` (prefix ""). A shared expert adapter is saved once and
    loaded on every EP rank; a per-expert one as one global [E, ...] tensor."""
    adapter_ids = {id(p) for p in lora_parameters(model).values()}
    metadata = {**(metadata or {}), LORA_ADAPTERS_METADATA_KEY: True}
    full = model.sharded_state_dict(prefix=prefix, metadata=metadata)
    return {key: value for key, value in full.items()
            if isinstance(value, ShardedTensor) and id(value.data) in adapter_ids}


def load_lora_state_dict(model: torch.nn.Module, state: Dict[str, torch.Tensor]) -> None:
    """Copy adapter weights into `model`'s adapters; every adapter key must be present and no
    other key may be."""
    params = lora_parameters(model)
    missing = sorted(params.keys() - state.keys())
    unexpected = sorted(state.keys() - params.keys())
    if missing or unexpected:
        raise KeyError(f"adapter state does not match the model's adapters: missing {missing}, "
                       f"unexpected {unexpected}")
    for key, p in params.items():
        if state[key].shape != p.shape:
            raise ValueError(f"{key}: shape {list(state[key].shape)} in the state, "
                             f"{list(p.shape)} in the model")
    with torch.no_grad():
        for key, p in params.items():
            p.copy_(state[key])
