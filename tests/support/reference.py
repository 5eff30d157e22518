"""Independent references: an FP64 per-expert loop, and Megatron's SequentialMLP with the same weights."""

import torch
import torch.nn.functional as F
from megatron.core.activations import squared_relu
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.transformer_config import TransformerConfig

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "squared_relu": squared_relu}


def make_config(activation="silu", glu=True, num_experts=4, hidden=32, ffn=48,
                dtype=torch.bfloat16, **overrides) -> TransformerConfig:
    """A tiny MoE TransformerConfig built on the CPU."""
    fields = dict(
        num_layers=2, hidden_size=hidden, num_attention_heads=4, num_moe_experts=num_experts,
        moe_ffn_hidden_size=ffn, ffn_hidden_size=ffn, moe_grouped_gemm=True,
        gated_linear_unit=glu, activation_func=ACTIVATIONS[activation], add_bias_linear=False,
        bf16=dtype == torch.bfloat16, params_dtype=dtype, use_cpu_initialization=True,
        moe_router_topk=2,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def sequential_mlp(config, pg_collection, num_local_experts=None) -> SequentialMLP:
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return SequentialMLP(num_local_experts or config.num_moe_experts, config, submodules,
                         pg_collection=pg_collection)


@torch.no_grad()
def copy_weights_to_sequential(torch_mlp, seq_mlp) -> None:
    for i, expert in enumerate(seq_mlp.local_experts):
        expert.linear_fc1.weight.copy_(getattr(torch_mlp.linear_fc1, f"weight{i}"))
        expert.linear_fc2.weight.copy_(getattr(torch_mlp.linear_fc2, f"weight{i}"))


def _clamp(value, bound_ok, bound):
    """value where bound_ok, else the constant bound (no gradient there)."""
    return torch.where(bound_ok, value, torch.full_like(value, bound))


def fp64_experts(config, fc1, fc2, x, splits, probs, clamp_on_bf16=False) -> torch.Tensor:
    """Per-expert FP64 loop: fc1 [E, out, in], fc2 [E, H, F], x [T, H], probs [T] -> [T, H] float64.

    clamp_on_bf16: the GLU clamp decides which side of the bound each value is on from the fc1
    output rounded to bf16 (as a bf16 module does); the math stays FP64."""
    outputs = []
    start = 0
    for e, count in enumerate(list(splits)):
        rows = x[start:start + count].double()
        p = probs[start:start + count].double().unsqueeze(-1)
        if config.moe_apply_probs_on_input:
            rows, p = rows * p, torch.ones_like(p)
        h = rows @ fc1[e].double().T
        if config.gated_linear_unit:
            gate, up = h.chunk(2, dim=-1)
            if (clamp := config.activation_func_clamp_value) is not None and clamp_on_bf16:
                g16, u16 = gate.detach().bfloat16().double(), up.detach().bfloat16().double()
                gate = _clamp(gate, g16 <= clamp, clamp)
                up = _clamp(_clamp(up, u16 <= clamp, clamp), u16 >= -clamp, -clamp)
            elif clamp is not None:
                gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
            h = config.activation_func(gate) * (up + config.glu_linear_offset)
        else:
            h = config.activation_func(h)
        outputs.append((h * p) @ fc2[e].double().T)
        start += count
    return torch.cat(outputs) if outputs else x.new_zeros(0, fc2.shape[1], dtype=torch.float64)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return float((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30))
