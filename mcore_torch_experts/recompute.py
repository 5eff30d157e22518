"""Adapters that train under full activation recompute: the frozen-input guard.

Megatron's full recompute (`recompute_granularity="full"`) runs the layers inside a re-entrant
checkpoint, whose outputs get a gradient only if one of its tensor inputs requires grad;
parameters used inside do not count. With a frozen embedding (PP=1, adapter training) the block
input does not require grad, so checkpointed layers are cut off from the loss: with
`recompute_method="uniform"` no adapter trains (the loss may not even require grad), with
`"block"` the first `recompute_num_layers` layers' adapters silently get no gradient.

The guard hands such a block `hidden_states.detach().requires_grad_(True)`: a leaf whose
gradient is computed and discarded. Nothing upstream requires grad, so nothing is lost.
"""

import types

import torch

from . import _compat

_ORIGINAL_FORWARD = "_forward_without_frozen_input_guard"


def _needs_trainable_input(block: torch.nn.Module, hidden_states) -> bool:
    """Full recompute in training, a frozen input, and something trainable inside the block."""
    return (block.training and block.config.recompute_granularity == "full"
            and torch.is_grad_enabled()
            and isinstance(hidden_states, torch.Tensor) and not hidden_states.requires_grad
            and any(p.requires_grad for p in block.parameters()))


def _guarded_forward(self, hidden_states, *args, **kwargs):
    if _needs_trainable_input(self, hidden_states):
        hidden_states = hidden_states.detach().requires_grad_(True)
    return getattr(self, _ORIGINAL_FORWARD)(hidden_states, *args, **kwargs)


def install_frozen_input_guard(model: torch.nn.Module) -> int:
    """Guard every TransformerBlock (and HybridStack where Megatron gives it full recompute) in
    `model`; return how many blocks carry the guard.

    Only the instances' `forward` is wrapped (no class or module patching). The checks run at
    every call, so adapters added or parameters frozen after installation are seen. Calling it
    again changes nothing.
    """
    blocks = [m for m in model.modules() if isinstance(m, _compat.full_recompute_block_classes())]
    for block in blocks:
        if _ORIGINAL_FORWARD not in vars(block):
            setattr(block, _ORIGINAL_FORWARD, block.forward)
            block.forward = types.MethodType(_guarded_forward, block)
    return len(blocks)
