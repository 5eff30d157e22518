"""fp32_combine inside NeMo Automodel's GroupedExperts and GroupedExpertsLoRA (torch_mm experts).

`GroupedExperts._forward_grouped_mm` ends with `y.scatter_add_(0, ids, output2.float())`: an FP32
copy of every routed row (twice the bf16 expert output) lives next to the accumulator, and its
backward gathers a full-size FP32 gradient before casting it. Automodel's expert LoRA
(`GroupedExpertsLoRA`, what its PEFT puts in place of each GroupedExperts) ends the same way.
`install_fp32_combine(model)` gives each such module in `model` an instance-level
`_forward_grouped_mm` that runs the release's code up to output2 and sums output2 into its tokens
with `fp32_combine` instead, and gives the module holding it a forward pre-hook that installs the
same combine on whatever GroupedExperts replaced it (Automodel's PEFT applied afterwards);
`remove_combine` takes both off again. Pickling and deep copies carry them. Nothing else changes:
not the classes, not nemo_automodel's module globals, not the modules you did not pass.

Releases: nemo-automodel 0.7.0, and 0.4.0 (the PyPI release and NeMo-RL's pinned commit 24b47e85,
which declares 0.4.0), identical in the code reproduced here except that 0.4.0 has no MXFP8
experts (`select_grouped_mm`, `use_mxfp8`, `apply_router_weight_after_down`).
"""

import functools
from typing import Callable, List

import nemo_automodel
import torch
from nemo_automodel.components._peft.lora_experts import GroupedExpertsLoRA
from nemo_automodel.components.moe import experts as _experts
from nemo_automodel.components.moe.experts import (
    GroupedExperts,
    GroupedExpertsDeepEP,
    GroupedExpertsTE,
    _apply_bias,
    _permute_tokens_for_grouped_mm,
    _torch_mm_experts_fwd,
)
from torch.distributed.tensor import DTensor

from ..combine import check_options, fp32_combine

VERIFIED_VERSIONS = ("0.7.0", "0.4.0")
"""nemo-automodel releases whose GroupedExperts / GroupedExpertsLoRA._forward_grouped_mm this
module reproduces."""

_HAS_MXFP8 = hasattr(_experts, "select_grouped_mm")
"""0.7.0: GroupedExperts picks its grouped GEMM by use_mxfp8 and has apply_router_weight_after_down;
0.4.0 runs torch._grouped_mm and has neither (the one difference between the two here)."""

Combine = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""combine(expert_out [N, H], token_ids [N], num_tokens) -> y [num_tokens, H] float32."""


class AutomodelCombineError(ValueError):
    """A module or release install_combine does not take; the message names the field, its value
    and the fix. Raised before any module is changed."""


def install_fp32_combine(model: torch.nn.Module, *, chunk_rows=None, backend=None) -> List[str]:
    """Route the FP32 accumulation of every GroupedExperts / GroupedExpertsLoRA in `model` (or
    `model` itself) through `fp32_combine(..., chunk_rows=chunk_rows, backend=backend)` (None:
    its defaults, the fused triton kernel on CUDA). Returns the modules' qualified names ("" for
    `model`). Before or after Automodel's PEFT: a GroupedExpertsLoRA that replaces an installed
    module gets the same combine on its parent's next forward.

    Every module is checked first; a refusal (AutomodelCombineError) leaves all of them as they
    were. Calling it again replaces the options; `remove_combine` undoes it.
    """
    check_options(chunk_rows, backend)
    return install_combine(model, functools.partial(fp32_combine, chunk_rows=chunk_rows,
                                                    backend=backend))


def install_combine(model: torch.nn.Module, combine: Combine) -> List[str]:
    """install_fp32_combine with any `combine(expert_out [N, H], token_ids [N], num_tokens)
    -> y [num_tokens, H] float32` in place of the scatter-add (benchmarks compare others).
    Pickling the model pickles `combine` too (a lambda cannot be: pickling then fails)."""
    targets = _checked_targets(model)
    for name, module in targets:
        module._forward_grouped_mm = _CombinedForward(module, combine)
        if name:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            _remove_guards(parent, child)
            parent.register_forward_pre_hook(_ReplacementGuard(child, combine))
    return [name for name, _ in targets]


def remove_combine(model: torch.nn.Module) -> List[str]:
    """Give every GroupedExperts in `model` that has an installed combine the shipped
    `_forward_grouped_mm` back and drop the pre-hooks that follow replacements; returns the
    modules' names (none: [])."""
    names = []
    for name, module in model.named_modules():
        _remove_guards(module)
        if _installed(module):
            del module._forward_grouped_mm
            names.append(name)
    return names


class _CombinedForward:
    """The `_forward_grouped_mm` installed on a module: the shipped class's `_forward_grouped_mm`
    with its combine. An object, not a bound method: pickle would restore a bound method as the
    class's method of the same name (the shipped one); this pickles and deep-copies with the
    module."""

    def __init__(self, module: torch.nn.Module, combine: Combine):
        self.module, self.combine = module, combine

    def __call__(self, *args, **kwargs):
        reproduce = (_lora_forward_grouped_mm if isinstance(self.module, GroupedExpertsLoRA)
                     else _forward_grouped_mm)
        return reproduce(self.module, self.combine, *args, **kwargs)


class _ReplacementGuard:
    """Forward pre-hook of the module holding an installed GroupedExperts as `child`: when the
    child was replaced (Automodel's PEFT swaps GroupedExperts for a new GroupedExpertsLoRA), it
    checks the replacement and installs the same combine on it before the forward runs, or
    raises AutomodelCombineError naming it; never the shipped scatter-add unannounced."""

    def __init__(self, child: str, combine: Combine):
        self.child, self.combine = child, combine

    def __call__(self, parent: torch.nn.Module, args):
        module = getattr(parent, self.child, None)
        if _installed(module):
            return None
        where = f"{self.child} ({type(module).__name__})"
        if not isinstance(module, GroupedExperts):
            raise AutomodelCombineError(
                f"{where}: replaced the GroupedExperts that install_fp32_combine was given and "
                "is not one; call remove_combine(model) before replacing the experts.")
        _check_release()
        _check_module(module, f"{where}, which replaced the installed GroupedExperts")
        module._forward_grouped_mm = _CombinedForward(module, self.combine)
        return None


def _remove_guards(module: torch.nn.Module, child=None) -> None:
    """Drop `module`'s _ReplacementGuard pre-hooks (for `child` only, when given)."""
    for key, hook in list(module._forward_pre_hooks.items()):
        if isinstance(hook, _ReplacementGuard) and child in (None, hook.child):
            del module._forward_pre_hooks[key]


def _grouped_mm(self):
    """The grouped GEMM GroupedExperts._forward_grouped_mm runs with expert bias, (a, b, offs)."""
    if _HAS_MXFP8:
        return _experts.select_grouped_mm(self.use_mxfp8)
    return lambda a, b, offs: torch._grouped_mm(a, b, offs=offs)


def _forward_grouped_mm(self, combine, x, token_mask, weights, indices, gate_and_up_projs,
                        down_projs, gate_up_proj_bias, down_proj_bias, n_local_experts,
                        experts_start_idx):
    """GroupedExperts._forward_grouped_mm (x [T, H] -> y [T, H] float32),
    config.apply_router_weight_after_down=False, with `y.scatter_add_(0, ids, output2.float())`
    replaced by `combine`. No routed rows: the shipped method (its dummy graph)."""
    sorted_token_ids, sorted_weights, tokens_per_expert, offs = _permute_tokens_for_grouped_mm(
        indices, weights, token_mask, n_local_experts, experts_start_idx)
    if sorted_token_ids.numel() == 0:
        return GroupedExperts._forward_grouped_mm(
            self, x, token_mask, weights, indices, gate_and_up_projs, down_projs,
            gate_up_proj_bias, down_proj_bias, n_local_experts, experts_start_idx)
    permuted_x = x[sorted_token_ids]
    permuted_probs = sorted_weights.unsqueeze(-1)
    if self.expert_bias:
        grouped_mm = _grouped_mm(self)
        output1 = grouped_mm(permuted_x, gate_and_up_projs, offs)
        output1 = _apply_bias(output1, gate_up_proj_bias, tokens_per_expert)
        output1 = self.expert_activation_grouped(output1, permuted_probs)
        output2 = grouped_mm(output1, down_projs, offs)
        output2 = _apply_bias(output2, down_proj_bias, tokens_per_expert, permuted_probs)
    else:
        mxfp8 = dict(use_mxfp8=self.use_mxfp8) if _HAS_MXFP8 else {}
        output2 = _torch_mm_experts_fwd(permuted_x, gate_and_up_projs, down_projs,
                                        tokens_per_expert, permuted_probs,
                                        self.expert_activation_grouped, **mxfp8)
    return combine(output2, sorted_token_ids, x.shape[0])


def _lora_forward_grouped_mm(self, combine, x, token_mask, weights, indices, gate_and_up_projs,
                             down_projs, lora_gate_and_up_A, lora_gate_and_up_B, lora_down_A,
                             lora_down_B, n_local_experts, experts_start_idx):
    """GroupedExpertsLoRA._forward_grouped_mm (x [T, H] -> y [T, H] float32: base + scale * A B
    per projection) with `y.scatter_add_(0, ids, output2.float())` replaced by `combine`. No
    routed rows: the shipped method (its dummy graph)."""
    sorted_token_ids, sorted_weights, tokens_per_expert, offs = _permute_tokens_for_grouped_mm(
        indices, weights, token_mask, n_local_experts, experts_start_idx)
    if sorted_token_ids.numel() == 0:
        return GroupedExpertsLoRA._forward_grouped_mm(
            self, x, token_mask, weights, indices, gate_and_up_projs, down_projs,
            lora_gate_and_up_A, lora_gate_and_up_B, lora_down_A, lora_down_B, n_local_experts,
            experts_start_idx)
    permuted_x = x[sorted_token_ids]
    permuted_probs = sorted_weights.unsqueeze(-1)
    output1 = torch._grouped_mm(permuted_x, gate_and_up_projs, offs=offs)
    lora_out1 = torch._grouped_mm(torch._grouped_mm(permuted_x, lora_gate_and_up_A, offs=offs),
                                  lora_gate_and_up_B, offs=offs)
    output1 = output1 + lora_out1 * self.scale
    if self.expert_bias:
        output1 = _apply_bias(output1, _local(self.gate_up_proj_bias), tokens_per_expert)
    output1 = self.expert_activation_grouped(output1, permuted_probs)
    output2 = torch._grouped_mm(output1, down_projs, offs=offs)
    lora_out2 = torch._grouped_mm(torch._grouped_mm(output1, lora_down_A, offs=offs),
                                  lora_down_B, offs=offs)
    output2 = output2 + lora_out2 * self.scale
    if self.expert_bias:
        output2 = _apply_bias(output2, _local(self.down_proj_bias), tokens_per_expert,
                              permuted_probs)
    return combine(output2, sorted_token_ids, x.shape[0])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _installed(module) -> bool:
    method = vars(module).get("_forward_grouped_mm") if isinstance(module, torch.nn.Module) else None
    return isinstance(method, _CombinedForward) and method.module is module


def _check_release() -> None:
    version = nemo_automodel.__version__
    # Its package_info appends the short hash of any git checkout it is installed inside.
    if version.split("+")[0] not in VERIFIED_VERSIONS:
        raise AutomodelCombineError(
            f"nemo_automodel.__version__={version!r}: the combine reproduces "
            f"GroupedExperts._forward_grouped_mm of nemo-automodel {' / '.join(VERIFIED_VERSIONS)} "
            "and was verified against those only. Install nemo-automodel==0.7.0, or keep the "
            "shipped experts.")


def _checked_targets(model: torch.nn.Module):
    """(name, module) of every GroupedExperts in `model`, each one checked."""
    _check_release()
    targets = []
    for name, module in model.named_modules():
        where = f"{name} ({type(module).__name__})" if name else type(module).__name__
        if isinstance(module, (GroupedExpertsDeepEP, GroupedExpertsTE)):
            raise AutomodelCombineError(
                f"{where}: the DeepEP / HybridEP / UCCL-EP dispatchers combine the expert outputs "
                "themselves; there is no scatter-add to replace. Only backend.dispatcher='torch' "
                "with backend.experts='torch_mm' builds GroupedExperts.")
        if isinstance(module, GroupedExperts):
            _check_module(module, where)
            targets.append((name, module))
    if not targets:
        raise AutomodelCombineError(
            f"{type(model).__name__} holds no GroupedExperts: pass an Automodel model or MoE "
            "layer built with backend.dispatcher='torch', backend.experts='torch_mm'.")
    return targets


def _check_module(module: GroupedExperts, where: str) -> None:
    cls = type(module)
    shipped = GroupedExpertsLoRA if isinstance(module, GroupedExpertsLoRA) else GroupedExperts
    if (cls.forward is not shipped.forward
            or cls._forward_grouped_mm is not shipped._forward_grouped_mm):
        raise AutomodelCombineError(
            f"{where}: {cls.__name__} overrides {shipped.__name__}.forward or "
            "_forward_grouped_mm, which the combine does not recognise; keep the shipped experts.")
    for attr in ("forward", "_forward_grouped_mm"):
        if attr in vars(module) and not (attr == "_forward_grouped_mm" and _installed(module)):
            raise AutomodelCombineError(
                f"{where}: its {attr} was replaced on the instance by something else, which the "
                f"combine does not recognise; remove that (del module.{attr}) first.")
    if not module.use_torch_mm:
        raise AutomodelCombineError(
            f"{where}: use_torch_mm=False (backend.experts is not 'torch_mm'): it runs the "
            "per-expert loop, whose FP32 temporaries hold one expert's rows at a time. Build the "
            "model with backend.experts='torch_mm' to use the combine.")
    # GroupedExpertsLoRA._forward_grouped_mm accumulates into [T, H] whatever this field says.
    if (_HAS_MXFP8 and shipped is GroupedExperts
            and module.config.apply_router_weight_after_down):
        raise AutomodelCombineError(
            f"{where}: config.apply_router_weight_after_down=True scatters each row into its own "
            "[token, top-k] slot of an FP32 buffer and sums over top-k afterwards; there is no "
            "accumulation to replace. Keep the shipped experts for such a model.")
