"""Adapters that train under activation recompute: the frozen-input guard.

Megatron's checkpoints give their outputs a gradient only if one of their tensor inputs requires
grad; parameters used inside do not count. That holds for the re-entrant checkpoint of full
recompute (`recompute_granularity="full"`: whole layers) and of selective recompute of "mlp",
"moe" and "shared_experts", and for the output-discarding checkpoint (which runs its function
under no_grad) of "mla_up_proj", "layernorm", "moe_act" and, from 0.19, "gdn_norm_out"; the
output-discarding checkpoint cannot even recompute an output whose input did not require grad
(backward fails). With a frozen embedding (PP=1, adapter training) the block input does not
require grad, so adapters inside such a checkpoint are cut off from the loss until something
before them requires grad: with full `"uniform"` recompute, or selective "moe" with adapters on
the experts only, no adapter trains (the loss may not even require grad); with full `"block"`
recompute the first `recompute_num_layers` layers' adapters silently get no gradient. Only
selective "core_attn" (Megatron's default) checkpoints nothing trainable.

The guard hands such a block `hidden_states.detach().requires_grad_(True)`: a leaf whose
gradient is computed and discarded. Nothing upstream requires grad, so nothing is lost. The
residual stream then carries requires_grad to every checkpoint input of every layer.
"""

import types

import torch

from .. import _compat

_ORIGINAL_FORWARD = "_forward_without_frozen_input_guard"
SELECTIVE_MODULES_WITHOUT_PARAMETERS = frozenset({"core_attn"})
"""Selective recompute modules whose checkpoint holds no parameter and needs no input grad."""


def _needs_input_grad(config) -> bool:
    """Whether the recompute `config` asks for needs a block input that requires grad: full
    recompute, or selective recompute of any module but those without parameters."""
    granularity = config.recompute_granularity
    if granularity == "full":
        return True
    modules = set(getattr(config, "recompute_modules", None) or ())
    return granularity == "selective" and bool(modules - SELECTIVE_MODULES_WITHOUT_PARAMETERS)


def _needs_trainable_input(block: torch.nn.Module, hidden_states) -> bool:
    """Training under such recompute, a frozen input, and something trainable inside the block."""
    return (block.training and torch.is_grad_enabled()
            and isinstance(hidden_states, torch.Tensor) and not hidden_states.requires_grad
            and _needs_input_grad(block.config)
            and any(p.requires_grad for p in block.parameters()))


def _guarded_forward(self, hidden_states, *args, **kwargs):
    if _needs_trainable_input(self, hidden_states):
        hidden_states = hidden_states.detach().requires_grad_(True)
    return getattr(self, _ORIGINAL_FORWARD)(hidden_states, *args, **kwargs)


def install_frozen_input_guard(model: torch.nn.Module) -> int:
    """Guard every TransformerBlock and hybrid (Mamba) stack in `model`; return how many blocks
    carry the guard.

    Only the instances' `forward` is wrapped (no class or module patching). The checks run at
    every call, so adapters added, parameters frozen or recompute settings changed after
    installation are seen. Calling it again changes nothing.
    """
    blocks = [m for m in model.modules() if isinstance(m, _compat.recompute_block_classes())]
    for block in blocks:
        if _ORIGINAL_FORWARD not in vars(block):
            setattr(block, _ORIGINAL_FORWARD, block.forward)
            block.forward = types.MethodType(_guarded_forward, block)
    return len(blocks)
