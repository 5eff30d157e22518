"""Dense-to-MoE upcycling (Megatron-LM's `--moe-use-upcycling`) into TorchGroupedMLP experts.

Megatron's `upcycling_utils` maps a dense MLP onto the experts of a MoE model by the experts'
state-dict keys, and knows two layouts: SequentialMLP's (`experts.local_experts.{i}.linear_fc1.weight`)
and TEGroupedMLP's (`experts.linear_fc1.weight{i}`). TorchGroupedMLP has TEGroupedMLP's keys, but
Megatron picks the layout with `isinstance(experts, TEGroupedMLP)` and refuses any other class.
Here Megatron's own code runs with TorchGroupedMLP accepted as the TEGroupedMLP layout, so the
weights, scales and router splits are exactly Megatron's; the resulting state dict loads into the
packed expert buffers. (0.16 to 0.20: `upcycling_utils.py` is the same; `_get_config` looks
`SequentialMLP` and `TEGroupedMLP` up in the module's globals at call time.)
"""

import contextlib
from typing import Callable, Sequence

import torch
from megatron.core.transformer.moe import upcycling_utils

from ..experts import TorchGroupedMLP


@contextlib.contextmanager
def torch_experts_upcycling():
    """Within this context Megatron's `upcycling_utils` treats TorchGroupedMLP experts as the
    TEGroupedMLP layout (whose state-dict keys they have); on exit it is as before.

    For callers of Megatron's own functions, e.g. Megatron-LM's `pretrain(...)` with
    `--moe-use-upcycling`:

        with torch_experts_upcycling():
            pretrain(...)
    """
    accepted = upcycling_utils.TEGroupedMLP
    if isinstance(accepted, tuple) and TorchGroupedMLP in accepted:  # nested: already accepted
        yield
        return
    upcycling_utils.TEGroupedMLP = (accepted, TorchGroupedMLP)
    try:
        yield
    finally:
        upcycling_utils.TEGroupedMLP = accepted


def upcycle_state_dict(moe_model: Sequence[torch.nn.Module],
                       dense_model: Sequence[torch.nn.Module]) -> dict:
    """Megatron's `upcycling_utils.upcycle_state_dict` for MoE models whose experts may be
    TorchGroupedMLP: `{"model": state dict}` for one model chunk (lists of unwrapped chunks in)."""
    with torch_experts_upcycling():
        return upcycling_utils.upcycle_state_dict(moe_model, dense_model)


def load_and_upcycle_model(load_dense_ckpt_func: Callable, moe_model: Sequence[torch.nn.Module],
                           dense_model: Sequence[torch.nn.Module], strict: bool = True,
                           load_args: tuple = (), load_kwargs: dict = None):
    """Megatron's `upcycling_utils.load_and_upcycle_model` for MoE models whose experts may be
    TorchGroupedMLP: loads the dense checkpoint with `load_dense_ckpt_func(*load_args,
    **load_kwargs) -> (iteration, flops)`, upcycles it into `moe_model` and returns that pair."""
    with torch_experts_upcycling():
        return upcycling_utils.load_and_upcycle_model(
            load_dense_ckpt_func, moe_model, dense_model, strict=strict, load_args=load_args,
            load_kwargs=dict(load_kwargs or {}))

