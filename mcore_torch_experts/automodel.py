"""fp32_combine inside NeMo Automodel's GroupedExperts (nemo-automodel 0.7.0, `torch_mm` experts).

`GroupedExperts._forward_grouped_mm` ends with `y.scatter_add_(0, ids, output2.float())`: an FP32
copy of every routed row (twice the bf16 expert output) lives next to the accumulator, and its
backward gathers a full-size FP32 gradient before casting it. `install_fp32_combine(model)` gives
each GroupedExperts module in `model` an instance-level `_forward_grouped_mm` that runs 0.7.0's
code up to output2 and sums output2 into its tokens with `fp32_combine` instead; `remove_combine`
takes it off again. Pickling and deep copies carry it. Nothing else changes: not the class, not
nemo_automodel's module globals, not the modules you did not pass.
"""

import functools
from typing import Callable, List

import nemo_automodel
import torch
from nemo_automodel.components.moe.experts import (
    GroupedExperts,
    GroupedExpertsDeepEP,
    GroupedExpertsTE,
    _apply_bias,
    _permute_tokens_for_grouped_mm,
    _torch_mm_experts_fwd,
    select_grouped_mm,
)

from .combine import check_options, fp32_combine

VERIFIED_VERSIONS = ("0.7.0",)
"""nemo-automodel releases whose GroupedExperts._forward_grouped_mm this module reproduces."""

Combine = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""combine(expert_out [N, H], token_ids [N], num_tokens) -> y [num_tokens, H] float32."""


class AutomodelCombineError(ValueError):
    """A module or release install_combine does not take; the message names the field, its value
    and the fix. Raised before any module is changed."""


def install_fp32_combine(model: torch.nn.Module, *, chunk_rows=None, backend=None) -> List[str]:
    """Route the FP32 accumulation of every GroupedExperts in `model` (or `model` itself)
    through `fp32_combine(..., chunk_rows=chunk_rows, backend=backend)` (None: its defaults,
    the fused triton kernel on CUDA). Returns the modules' qualified names ("" for `model`).

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
    for _, module in targets:
        module._forward_grouped_mm = _CombinedForward(module, combine)
    return [name for name, _ in targets]


def remove_combine(model: torch.nn.Module) -> List[str]:
    """Give every GroupedExperts in `model` that has an installed combine the shipped
    `_forward_grouped_mm` back; returns their names (none: [])."""
    names = []
    for name, module in model.named_modules():
        if _installed(module):
            del module._forward_grouped_mm
            names.append(name)
    return names


class _CombinedForward:
    """The `_forward_grouped_mm` installed on a module: `_forward_grouped_mm` with its combine.
    An object, not a bound method: pickle would restore a bound method as the class's method of
    the same name (the shipped one); this pickles and deep-copies with the module."""

    def __init__(self, module: torch.nn.Module, combine: Combine):
        self.module, self.combine = module, combine

    def __call__(self, *args, **kwargs):
        return _forward_grouped_mm(self.module, self.combine, *args, **kwargs)


def _forward_grouped_mm(self, combine, x, token_mask, weights, indices, gate_and_up_projs,
                        down_projs, gate_up_proj_bias, down_proj_bias, n_local_experts,
                        experts_start_idx):
    """nemo-automodel 0.7.0's GroupedExperts._forward_grouped_mm (x [T, H] -> y [T, H] float32),
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
        grouped_mm = select_grouped_mm(self.use_mxfp8)
        output1 = grouped_mm(permuted_x, gate_and_up_projs, offs)
        output1 = _apply_bias(output1, gate_up_proj_bias, tokens_per_expert)
        output1 = self.expert_activation_grouped(output1, permuted_probs)
        output2 = grouped_mm(output1, down_projs, offs)
        output2 = _apply_bias(output2, down_proj_bias, tokens_per_expert, permuted_probs)
    else:
        output2 = _torch_mm_experts_fwd(permuted_x, gate_and_up_projs, down_projs,
                                        tokens_per_expert, permuted_probs,
                                        self.expert_activation_grouped, use_mxfp8=self.use_mxfp8)
    return combine(output2, sorted_token_ids, x.shape[0])


def _installed(module: torch.nn.Module) -> bool:
    method = vars(module).get("_forward_grouped_mm")
    return isinstance(method, _CombinedForward) and method.module is module


def _checked_targets(model: torch.nn.Module):
    """(name, module) of every GroupedExperts in `model`, each one checked."""
    version = nemo_automodel.__version__
    # Its package_info appends the short hash of any git checkout it is installed inside.
    if version.split("+")[0] not in VERIFIED_VERSIONS:
        raise AutomodelCombineError(
            f"nemo_automodel.__version__={version!r}: the combine reproduces "
            f"GroupedExperts._forward_grouped_mm of nemo-automodel {' / '.join(VERIFIED_VERSIONS)} "
            "and was verified against that only. Install nemo-automodel==0.7.0, or keep the "
            "shipped experts.")
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
    if (cls.forward is not GroupedExperts.forward
            or cls._forward_grouped_mm is not GroupedExperts._forward_grouped_mm):
        raise AutomodelCombineError(
            f"{where}: {cls.__name__} overrides GroupedExperts.forward or _forward_grouped_mm, "
            "which the combine does not recognise; keep the shipped experts.")
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
    if module.config.apply_router_weight_after_down:
        raise AutomodelCombineError(
            f"{where}: config.apply_router_weight_after_down=True scatters each row into its own "
            "[token, top-k] slot of an FP32 buffer and sums over top-k afterwards; there is no "
            "accumulation to replace. Keep the shipped experts for such a model.")
