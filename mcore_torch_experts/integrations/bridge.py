"""Megatron-Bridge PEFT (LoRA, CanonicalLoRA) on TorchGroupedMLP experts.

Bridge recognises the linears it can wrap by type in `peft.utils.get_adapter_attributes_from_linear`,
a function that `peft.lora`, `peft.canonical_lora`, `peft.dora` and the conversion code import by
name. `register_with_megatron_bridge()` teaches it TorchGroupedLinear (the attributes of a TE
grouped linear of the same parallel mode), in Bridge's own module and in every module that bound
it, and wraps two more entry points, both unchanged for every other module type:

- `ModuleMatcher.match`: in `exclude_modules` mode a TorchGroupedLinear is a linear to wrap, as
  the experts' ColumnParallelLinear/RowParallelLinear of a SequentialMLP are;
- `PEFT.__call__` of LoRA, CanonicalLoRA and DoRA: every module the PEFT would wrap is checked
  first (`check_bridge_peft`), so a module Bridge cannot wrap is an error before any parameter
  is frozen or any module replaced;
- `AdapterWrapper.adapter_forward` and `GroupedExpertLinearAdapter.forward`: a per-expert
  adapter on a TorchGroupedLinear runs one grouped GEMM per projection (bridge_adapters.py);
  called without a TorchGroupedLinear base, the adapter runs Bridge's forward.

It also adds bridge_adapters.fused_bridge_lora to the fused expert kernels' adapter readers, so
Bridge's shared and per-expert LoRA run inside those kernels. `merge_bridge_lora` folds every
Bridge LoRA adapter into its weights.

Importing this module (the package does) adds `register_if_bridge_loaded` to
`experts.ON_BUILD`, so experts built in a process that imported Bridge's PEFT register at once.

Adapter layouts on a TorchGroupedLinear are Bridge's own: `share_expert_adapters=True`
(ParallelLinearAdapter, one pair per grouped module), `False` (GroupedExpertLinearAdapter, one
pair per local expert, read from `num_gemms`), `experts_shared_outer_loras=True`
(SharedOuterGroupedExpertAdapter), each with `normalize_moe_lora`. DoRA needs one `.weight` per
linear and is refused on grouped experts (Bridge has no DoRA for TE grouped linears either).
"""

import functools
import sys
from typing import List, Optional

import torch
from megatron.core.utils import get_pg_size

from .. import experts
from ..experts import TorchGroupedLinear
from ..kernels.choice import ADAPTER_READERS
from .bridge_adapters import (
    _ORIGINAL,
    _grouped_expert_adapters,
    _grouped_on_torch_experts,
    fused_bridge_lora,
)

_ATTRIBUTES_FUNCTION = "get_adapter_attributes_from_linear"


def register_with_megatron_bridge() -> bool:
    """Teach Megatron-Bridge's PEFT about TorchGroupedLinear; return whether Bridge is importable.

    Idempotent. Without Megatron-Bridge (or when it cannot be imported) nothing is touched and
    the answer is False.
    """
    try:
        from megatron.bridge.peft import adapter_wrapper, base, module_matcher, utils
    except ImportError:
        return False
    original = getattr(utils.get_adapter_attributes_from_linear, _ORIGINAL,
                       utils.get_adapter_attributes_from_linear)
    if not hasattr(utils.get_adapter_attributes_from_linear, _ORIGINAL):
        utils.get_adapter_attributes_from_linear = _with_torch_grouped_attributes(original, utils)
    wrapped = utils.get_adapter_attributes_from_linear
    for name, module in list(sys.modules.items()):  # the modules that imported it by name
        if name.startswith("megatron.bridge") and getattr(module, _ATTRIBUTES_FUNCTION, None) is original:
            setattr(module, _ATTRIBUTES_FUNCTION, wrapped)
    if not hasattr(module_matcher.ModuleMatcher.match, _ORIGINAL):
        module_matcher.ModuleMatcher.match = _matching_torch_grouped(module_matcher.ModuleMatcher.match,
                                                                     utils)
    if not hasattr(base.PEFT.__call__, _ORIGINAL):
        base.PEFT.__call__ = _checked_first(base.PEFT.__call__)
    wrapper, per_expert = adapter_wrapper.AdapterWrapper, utils.GroupedExpertLinearAdapter
    if not hasattr(wrapper.adapter_forward, _ORIGINAL):
        wrapper.adapter_forward = _grouped_expert_adapters(wrapper.adapter_forward, utils)
    if not hasattr(per_expert.forward, _ORIGINAL):
        per_expert.forward = _grouped_on_torch_experts(per_expert.forward)
    if fused_bridge_lora not in ADAPTER_READERS:
        ADAPTER_READERS.append(fused_bridge_lora)
    return True


def register_if_bridge_loaded() -> None:
    """Register when the process has already imported Bridge's PEFT (never imports it)."""
    if "megatron.bridge.peft.utils" in sys.modules:
        register_with_megatron_bridge()


experts.ON_BUILD.append(register_if_bridge_loaded)  # Bridge's PEFT, when used, must know us


def adapter_attributes(module: TorchGroupedLinear, utils):
    """Bridge's AdapterAttributes of a TorchGroupedLinear: those of a TE grouped linear of the same
    parallel mode (features of the whole, not the expert-TP shard, on the parallel side)."""
    tp_size = get_pg_size(module._pg_collection.expt_tp)
    column = module.parallel_mode == "column"
    return utils.AdapterAttributes(
        input_is_parallel=not column,
        in_features=module.in_features * (1 if column else tp_size),
        out_features=module.out_features * (tp_size if column else 1),
        disable_tensor_parallel_comm=False,
        disable_sequence_parallel_comm=not module.config.sequence_parallel,
        base_linear_is_parallel=True,
    )


def _with_torch_grouped_attributes(original, utils):
    @functools.wraps(original)
    def get_adapter_attributes_from_linear(m, *args, **kwargs):
        if isinstance(m, TorchGroupedLinear):
            return adapter_attributes(m, utils)
        return original(m, *args, **kwargs)

    setattr(get_adapter_attributes_from_linear, _ORIGINAL, original)
    return get_adapter_attributes_from_linear


def _matching_torch_grouped(original, utils):
    @functools.wraps(original)
    def match(self, m, name=None, prefix=None):
        found = original(self, m, name, prefix)
        exclude_mode = not (self.canonical_mapping or self.target_modules)
        if found is None and exclude_mode and isinstance(m, TorchGroupedLinear):
            full_name = f"{prefix}.{name}" if prefix else name
            if name not in self.exclude_modules and not any(
                    utils.wildcard_match(pattern, full_name) for pattern in self.exclude_modules):
                self._record_match(name, full_name)
                return name, full_name
        return found

    setattr(match, _ORIGINAL, original)
    return match


def _checked_first(original):
    @functools.wraps(original)
    def __call__(self, model, training=True):
        check_bridge_peft(self, model)
        return original(self, model, training=training)

    setattr(__call__, _ORIGINAL, original)
    return __call__


def _wrappable_types(utils) -> tuple:
    """The module types Bridge's attribute function recognises (TorchGroupedLinear included)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.router import TopKRouter

    types = [TopKRouter, ColumnParallelLinear, RowParallelLinear, TorchGroupedLinear]
    if utils.HAVE_TE:
        types += [*utils.TECL, *utils.TERL, utils.TELinear]
    if utils.HAVE_MODELOPT_LINEAR:
        types.append(utils.ModelOptLinear)
    return tuple(t for t in types if isinstance(t, type))  # Bridge's placeholders for absent TE


def _refusal(peft, module, utils):
    """Why Bridge's `peft` cannot wrap `module` (None when it can)."""
    from megatron.bridge.peft.dora import DoRA

    if isinstance(peft, DoRA):
        if isinstance(module, TorchGroupedLinear) or not isinstance(getattr(module, "weight", None),
                                                                    torch.Tensor):
            return ("DoRA needs the base weight as one `.weight` tensor; grouped expert linears "
                    "hold weight0..weight{E-1} (Bridge has no DoRA on grouped experts)")
    elif isinstance(module, torch.nn.Linear):
        return None
    if not isinstance(module, _wrappable_types(utils)):
        return "not a linear type Megatron-Bridge's PEFT recognises"
    return None


def _rank_refusal(peft, module, full_name, utils):
    """Bridge's own objection to the LoRA rank `peft` would give `module` (a
    `normalize_moe_lora` rank not divisible by the router's top-k), or None."""
    try:
        utils.get_effective_lora_dim(module, dim=peft.dim,
                                     normalize_moe_lora=getattr(peft, "normalize_moe_lora", False),
                                     is_expert=utils.is_expert_linear(full_name))
    except ValueError as exc:
        return (f"{exc}; choose a dim divisible by moe_router_topk, or "
                "normalize_moe_lora=False")
    return None


def check_bridge_peft(peft, model) -> None:
    """Raise before `peft(model)` changes anything if a module it would wrap cannot be wrapped
    (NotImplementedError) or would get a rank Bridge refuses (ValueError).

    Checks Bridge's LoRA, CanonicalLoRA and DoRA (and subclasses keeping their `transform`): it
    walks `model` (a module or a list of model chunks) with the PEFT's own matching. Other PEFT
    classes wrap what their own `transform` decides and are not checked.
    """
    from megatron.bridge.peft import utils
    from megatron.bridge.peft.adapter_wrapper import AdapterWrapper
    from megatron.bridge.peft.canonical_lora import CanonicalLoRA
    from megatron.bridge.peft.dora import DoRA
    from megatron.bridge.peft.lora import LoRA
    from megatron.bridge.peft.lora_layers import LinearAdapter

    if type(peft).transform not in (LoRA.transform, CanonicalLoRA.transform, DoRA.transform):
        return
    refused, bad_ranks = [], []

    def visit(module, name, prefix):
        if isinstance(module, (AdapterWrapper, LinearAdapter)):
            return
        found = peft.match(module, name, prefix)
        if found is None:
            return
        if (reason := _refusal(peft, module, utils)) is not None:
            refused.append(f"{found[1]} ({type(module).__name__}): {reason}")
        elif (not isinstance(module, torch.nn.Linear) and not isinstance(peft, DoRA)
              and (reason := _rank_refusal(peft, module, found[1], utils)) is not None):
            bad_ranks.append(f"{found[1]} ({type(module).__name__}): {reason}")

    chunks = model if isinstance(model, list) else [model]
    peft._init_target_match_state()
    for chunk in chunks:  # named_modules, not Bridge's walk, which rebuilds containers
        for full_name, module in getattr(chunk, "module", chunk).named_modules():
            prefix, _, name = full_name.rpartition(".")
            visit(module, name, prefix or None)
    peft._reset_target_match_state()
    if refused:
        raise NotImplementedError(
            f"Megatron-Bridge {type(peft).__name__} cannot wrap {len(refused)} matched module(s); "
            "the model was not changed:\n  " + "\n  ".join(refused)
            + "\nLeave them out of target_modules (or add them to exclude_modules), e.g. "
            "target_modules=['linear_qkv', 'linear_proj'] for attention only.")
    if bad_ranks:
        raise ValueError(
            f"Megatron-Bridge {type(peft).__name__} would refuse the rank of {len(bad_ranks)} "
            "matched module(s); the model was not changed:\n  " + "\n  ".join(bad_ranks))


def _expert_factors(adapter, num_experts: int):
    """Per-expert LoRA factors of a Bridge adapter on a grouped linear: A [E, r, in], B [E, out, r]."""
    from megatron.bridge.peft import utils

    a, b = adapter.linear_in.weight, adapter.linear_out.weight
    if isinstance(adapter, (utils.GroupedExpertLinearAdapter, utils.SharedOuterGroupedExpertAdapter,
                            utils.ParallelLinearAdapter)):
        return (a if a.dim() == 3 else a.expand(num_experts, *a.shape),
                b if b.dim() == 3 else b.expand(num_experts, *b.shape))
    raise TypeError(f"merge_bridge_lora: unknown adapter type {type(adapter).__name__}")


def _merge_refusal(name: str, wrapper, lora_linear) -> Optional[str]:
    """Why `merge_bridge_lora` cannot fold the Bridge adapter wrapper at `name` (None when it can)."""
    if not name:
        return (f"the model passed in is itself a LoRA wrapper (of {type(wrapper.to_wrap).__name__}), "
                "which cannot be replaced by its base where the caller holds it: pass the module "
                "that holds it, or the whole model")
    if not isinstance(wrapper, lora_linear):
        return (f"{name} is a {type(wrapper).__name__} (Bridge's CanonicalLoRA, DoRA or router "
                "LoRA), which merge_bridge_lora does not fold: use Bridge's LoRA, or keep the "
                "adapters unmerged (save them and apply the same PEFT before loading)")
    if not wrapper._adapter_enabled:
        return (f"{name}'s adapter is disabled (Bridge's disable_adapter_layers), so the model "
                "computes without it and merging would change that. Enable the adapters to merge "
                "them (the PEFT's enable_adapter_layers(model), or the wrapper's "
                "enable_adapter_layers()), or put the wrapper's `to_wrap` in its place to drop "
                "the adapter unmerged")
    if not isinstance(wrapper.adapter.activation, torch.nn.Identity):
        return (f"{name}'s adapter has a {type(wrapper.adapter.activation).__name__} activation; "
                "only LoRA (identity activation) merges")
    base = wrapper.to_wrap
    if isinstance(base, TorchGroupedLinear):
        if get_pg_size(base._pg_collection.expt_tp) > 1:
            return (f"{name} has expert tensor parallelism > 1 (expert_tensor_parallel_size); "
                    "merge on a model loaded with expert_tensor_parallel_size=1")
    elif not (isinstance(getattr(base, "weight", None), torch.Tensor) and base.weight.dim() == 2):
        return (f"{name} wraps a {type(base).__name__} without one 2-D `.weight`; "
                "merge_bridge_lora folds adapters on TorchGroupedLinear experts and on linears "
                "with one weight matrix")
    return None


def _merged_weight(wrapper):
    """The wrapper's base weight with its LoRA folded in by Bridge's `LoRAMerge` (FP32 math):
    [E, out, in] packed for TorchGroupedLinear, else the linear's [out, in]."""
    from megatron.bridge.peft.lora_merge import LoRAMerge

    base, adapter = wrapper.to_wrap, wrapper.adapter
    if isinstance(base, TorchGroupedLinear):
        a, b = _expert_factors(adapter, base.num_experts)
        weights = base.packed()
        return torch.stack([
            LoRAMerge().merge(weights[e].float(), b[e].float(), a[e].float(), adapter.alpha,
                              adapter.dim, tp_group=base._pg_collection.expt_tp).to(weights.dtype)
            for e in range(base.num_experts)])
    return LoRAMerge().merge(base.weight.float(), adapter.linear_out.weight.float(),
                             adapter.linear_in.weight.float(), adapter.alpha, adapter.dim,
                             tp_group=getattr(adapter, "tp_group", None)).to(base.weight.dtype)


def merge_bridge_lora(model) -> List[str]:
    """Fold every Bridge LoRA adapter into its base weight with Bridge's `LoRAMerge`
    (W + alpha/r * B @ A, in FP32) and unwrap it; return the merged module names.

    `model` is a module or a list of model chunks. Expert adapters on TorchGroupedLinear go into
    the packed buffer in place, so every `weightN` stays a view of it; dense ones (LoRALinear on
    linear_qkv, linear_proj, dense and shared-expert linear_fc1/fc2, Transformer Engine or local
    linears, any tensor parallelism Bridge's merge gathers over) into the linear's `.weight`.
    Every wrapper is checked before anything changes; refused: CanonicalLoRA, DoRA and router
    LoRA wrappers, adapters Bridge has disabled (`disable_adapter_layers`), a non-identity
    activation, expert tensor parallelism above 1, a wrapper passed as `model` (or a chunk).
    """
    from megatron.bridge.peft.adapter_wrapper import AdapterWrapper
    from megatron.bridge.peft.lora_layers import LoRALinear

    chunks = model if isinstance(model, list) else [model]
    found = [(chunk, name, m) for chunk in chunks for name, m in chunk.named_modules()
             if isinstance(m, AdapterWrapper)]
    refused = [reason for _, name, wrapper in found
               if (reason := _merge_refusal(name, wrapper, LoRALinear)) is not None]
    if refused:
        raise ValueError(f"merge_bridge_lora: {len(refused)} adapter(s) cannot be merged; nothing "
                         "was merged:\n  " + "\n  ".join(refused))
    merged = [_merged_weight(wrapper) for _, _, wrapper in found]
    with torch.no_grad():
        for (chunk, name, wrapper), weights in zip(found, merged):
            base = wrapper.to_wrap
            (base.packed_weight if isinstance(base, TorchGroupedLinear) else base.weight).copy_(weights)
            # Bridge's LoRA makes a TE layernorm linear also return its layernorm output (for
            # the adapter, which the wrapper consumed); its holder expects (out, bias) again.
            for flag in ("return_layernorm_output", "return_layernorm_output_gathered"):
                if getattr(base, flag, False) is True:
                    setattr(base, flag, False)
            parent, _, child = name.rpartition(".")
            setattr(chunk.get_submodule(parent), child, base)
    return [name for _, name, _ in found]
