"""Swap the experts of an already built model (SequentialMLP, TEGroupedMLP) for TorchGroupedMLP.

For models that someone else's provider builds: call it after the model is built and before
adapters (a model whose expert linears already carry adapters is refused, unchanged), DDP
wrapping and the optimizer.
"""

import contextlib
import copy
from dataclasses import dataclass, field
from typing import List, Sequence, Tuple, Union

import torch
from megatron.core.utils import get_pg_size

from .. import _compat
from ..config import validate_torch_experts_config
from ..experts import TorchGroupedMLP, local_weight_shapes
from .recompute import install_frozen_input_guard


@dataclass
class ConversionSummary:
    """What convert_experts_to_torch replaced."""

    modules_converted: int = 0
    bytes_packed: int = 0
    """Bytes of expert weights now held in TorchGroupedMLP's packed buffers."""
    names: List[str] = field(default_factory=list)
    """Qualified names of the replaced experts modules (`decoder.layers.1.mlp.experts`, ...)."""
    blocks_guarded: int = 0
    """Transformer blocks given the frozen-input guard (install_frozen_input_guard)."""


def convert_experts_to_torch(
        model: Union[torch.nn.Module, Sequence[torch.nn.Module]]) -> ConversionSummary:
    """Replace every SequentialMLP / TEGroupedMLP experts module of `model` (a module, or a list
    of model chunks) with a TorchGroupedMLP holding the same weights, frozen.

    Keys: the state-dict keys change from SequentialMLP's
    `experts.local_experts.{i}.linear_fc{1,2}.weight` to TEGroupedMLP's
    `experts.linear_fc{1,2}.weight{i}` (TEGroupedMLP's stay as they are); the sharded
    (distributed-checkpoint) keys, global shapes and offsets are identical before and after, so
    distributed checkpoints load either way.

    Every module is validated first (validate_torch_experts_config with its own expert-parallel
    and expert-tensor-parallel group sizes; its expert weights all on one CPU or CUDA device, each
    of the shape its config gives), so a refusal leaves the model untouched;
    `moe_grouped_gemm` need not be set, the conversion is what makes the experts grouped. Each new
    module is built on the old weights' device in their dtype without initialisation, filled
    expert by expert, and the old module dropped before the next one is built: at most one
    layer's experts exist twice. Hooks on the old modules do not carry over. Finally the
    frozen-input guard is installed, so adapters train under full recompute.
    """
    root = torch.nn.ModuleList(model) if isinstance(model, (list, tuple)) else model
    names = _validated_targets(root)
    summary = ConversionSummary()
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = root.get_submodule(parent_name)
        new = _torch_grouped_mlp_like(getattr(parent, child), name)
        setattr(parent, child, new)  # the old module's last reference here goes
        summary.modules_converted += 1
        summary.bytes_packed += sum(linear.packed_weight.nbytes
                                    for linear in (new.linear_fc1, new.linear_fc2))
        summary.names.append(name)
    summary.blocks_guarded = install_frozen_input_guard(root)
    return summary


def _validated_targets(root: torch.nn.Module) -> List[str]:
    """Names of the convertible experts modules, each one's settings checked."""
    classes = _compat.convertible_experts_classes()
    names = []
    for name, module in root.named_modules():
        if isinstance(module, classes):
            if not name:
                raise TypeError(
                    f"convert_experts_to_torch: the {type(module).__name__} passed in is itself "
                    "the experts module, and a module cannot replace itself in its parent. Pass "
                    "the module that holds it (its MoE layer, or the model). It is unchanged.")
            _refuse_wrapped_linears(module, name)
            _refuse_unusable_devices(module, name)  # first: the config check reads the device
            validate_torch_experts_config(_build_config(module),
                                          get_pg_size(module.ep_group),
                                          get_pg_size(module.tp_group))
            _refuse_unusable_shapes(module, name)
            names.append(name)
    return names


def _refuse_unusable_devices(experts, name: str) -> None:
    """Expert weights not all on one CPU or CUDA device (meta weights hold no values)."""
    weights = _expert_weights(experts)
    devices = sorted({str(weight.device) for pair in weights for weight in pair})
    if len(devices) != 1 or weights[0][0].device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"convert_experts_to_torch: {name}'s expert weights are on {devices}; they are taken "
            "over on one CPU or CUDA device. Move the model there (a meta-device model: "
            "materialise and load its weights first, e.g. to_empty, then the checkpoint), then "
            "convert. The model is unchanged.")


def _refuse_unusable_shapes(experts, name: str) -> None:
    """Expert weights of another shape than the new module's [out, in] slots."""
    shapes = local_weight_shapes(experts.config, get_pg_size(experts.tp_group))
    for i, pair in enumerate(_expert_weights(experts)):
        for fc, weight, shape in zip((1, 2), pair, shapes):
            if list(weight.shape) != shape:
                raise ValueError(
                    f"convert_experts_to_torch: {name}: expert {i}'s linear_fc{fc} weight has "
                    f"shape {list(weight.shape)}, expected {shape} from its config; load weights "
                    "of the config's shapes, then convert. The model is unchanged.")


def _refuse_wrapped_linears(experts, name: str) -> None:
    """Adapters wrap an expert linear (`to_wrap`): its weights cannot be taken over."""
    wrapped = [f"{name}.{sub}" for sub, module in experts.named_modules()
               if hasattr(module, "to_wrap")]
    if wrapped:
        more = f" (and {len(wrapped) - 1} more)" if len(wrapped) > 1 else ""
        raise ValueError(
            f"convert_experts_to_torch: {wrapped[0]}{more} already carries a LoRA adapter; the "
            "expert weights cannot be taken over through it. Convert before adding adapters: "
            "build the model, call convert_experts_to_torch, then apply_lora. The model is "
            "unchanged."
        )


def _expert_weights(experts) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """(fc1 [F*(2 if GLU)/etp, H], fc2 [H, F/etp]) for each local expert of a Megatron module."""
    if hasattr(experts, "local_experts"):  # SequentialMLP
        return [(e.linear_fc1.weight, e.linear_fc2.weight) for e in experts.local_experts]
    return [(getattr(experts.linear_fc1, f"weight{i}"), getattr(experts.linear_fc2, f"weight{i}"))
            for i in range(experts.num_local_experts)]


def _build_config(experts):
    """A shallow copy of the module's config describing the TorchGroupedMLP to build in its place:
    grouped, on the weights' device, in their dtype, not initialised."""
    weight = _expert_weights(experts)[0][0]
    config = copy.copy(experts.config)
    config.moe_grouped_gemm = True
    config.use_cpu_initialization = weight.device.type == "cpu"
    config.perform_initialization = False
    config.params_dtype = weight.dtype
    return config


@torch.no_grad()
def _torch_grouped_mlp_like(experts, name: str) -> TorchGroupedMLP:
    weights = _expert_weights(experts)
    device = weights[0][0].device
    # TorchGroupedMLP builds on the current CUDA device: make it the weights'.
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        new = TorchGroupedMLP(experts.num_local_experts, _build_config(experts),
                              pg_collection=_compat.experts_process_groups(experts), name=name)
    for i, (fc1, fc2) in enumerate(weights):
        new.linear_fc1.packed_weight[i].copy_(fc1)
        new.linear_fc2.packed_weight[i].copy_(fc2)
    for module in new.modules():
        module.config = experts.config  # the config the replaced module ran with
    new.requires_grad_(False)
    return new.train(experts.training)
