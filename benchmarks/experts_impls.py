"""What bench_experts.py runs: the experts implementations at one shape (TorchGroupedMLP's paths,
the raw grouped_mm pair, its GEMMs alone, the dense ceiling, SequentialMLP, TEGroupedMLP, the
legacy GroupedMLP), each as forward() -> (out, ctx) and backward(ctx) -> the input's gradient,
and `measure`, which makes one row of an implementation with the harness's Meter.
"""

from dataclasses import dataclass
from typing import Callable

import torch

from harness import error_note, version
from shapes import Shape

OURS_CPU = "TorchGroupedMLP (CPU splits)"
OURS_GPU = "TorchGroupedMLP (GPU splits)"
OURS_GRAPH = "TorchGroupedMLP CUDA graph (GPU splits)"
EAGER_ACT = "TorchGroupedMLP, eager activation"
FUSED = "TorchGroupedMLP, fused_gemm (CPU splits)"
GROUPED = "TorchGroupedMLP, grouped_mm (CPU splits)"
LORA_FUSED = "TorchGroupedMLP + LoRA, fused_gemm (CPU splits)"
LORA_GROUPED = "TorchGroupedMLP + LoRA, grouped_mm (CPU splits)"
RAW = "raw grouped_mm pair"
GEMMS = "grouped_mm GEMMs alone"
DENSE = "dense GEMMs (ceiling)"
SEQUENTIAL = "SequentialMLP"
TE = "TEGroupedMLP"
LEGACY = "GroupedMLP (legacy)"


@dataclass
class Impl:
    """One way to run the experts: forward() -> (out, ctx); backward(ctx) -> grad of the input."""

    name: str
    forward: Callable
    backward: Callable
    module: bool = False  # an experts module: count host syncs
    ours: bool = False  # TorchGroupedMLP's path: also probe whether a step blocks the host
    computes_experts: bool = True  # False: GEMMs on stand-in data, nothing to compare


class NotInstalled(Exception):
    """An optional module that cannot run here; the message is the table's note."""


# --- setup ---------------------------------------------------------------------------------------

def init_megatron(device: torch.device, seed: int):
    """One-process Megatron parallel state (all sizes 1) over an in-memory store; its groups."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                             world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    if device.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        # A bare "cuda" device (no index) means the current one; set_device wants an index.
        torch.cuda.set_device(device if device.index is not None else torch.cuda.current_device())
        model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return ProcessGroupCollection.use_mpu_process_groups()


def make_config(shape: Shape, experts: int, device: torch.device):
    import torch.nn.functional as F
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.transformer_config import TransformerConfig

    activation = {"squared_relu": squared_relu, "silu": F.silu}[shape.activation]
    return TransformerConfig(
        num_layers=1, hidden_size=shape.hidden, num_attention_heads=8, num_moe_experts=experts,
        moe_ffn_hidden_size=shape.ffn, ffn_hidden_size=shape.ffn, moe_router_topk=2,
        moe_grouped_gemm=True, gated_linear_unit=shape.glu, activation_func=activation,
        add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
        use_cpu_initialization=device.type == "cpu")


def frozen(module):
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def weight_pairs(ours):
    """[(fc1 weight [out, in], fc2 weight [in, F])] per local expert of a TorchGroupedMLP."""
    fc1, fc2 = ours.linear_fc1.expert_weights(), ours.linear_fc2.expert_weights()
    return list(zip(fc1, fc2))


def build_sequential(config, pg):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return frozen(SequentialMLP(config.num_moe_experts, config, submodules, pg_collection=pg))


@torch.no_grad()
def copy_into_ours(seq, ours):
    """Pack a SequentialMLP's weights into TorchGroupedMLP (the copy path of a conversion)."""
    for expert, (w1, w2) in zip(seq.local_experts, weight_pairs(ours)):
        w1.copy_(expert.linear_fc1.weight)
        w2.copy_(expert.linear_fc2.weight)


def build_te(config, pg, ours):
    if ours.linear_fc1.packed_weight.device.type != "cuda":
        raise NotInstalled("not available: Transformer Engine needs CUDA (this run is on the CPU)")
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelGroupedLinear,
            TERowParallelGroupedLinear,
        )
    except ImportError as exc:
        raise NotInstalled(f"not installed: {exc}") from exc
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    submodules = MLPSubmodules(linear_fc1=TEColumnParallelGroupedLinear,
                               linear_fc2=TERowParallelGroupedLinear)
    te = TEGroupedMLP(config.num_moe_experts, config, submodules, pg_collection=pg)
    with torch.no_grad():
        for i, (w1, w2) in enumerate(weight_pairs(ours)):
            getattr(te.linear_fc1, f"weight{i}").copy_(w1)
            getattr(te.linear_fc2, f"weight{i}").copy_(w2)
    return frozen(te)


def build_legacy(config, pg, ours):
    from mcore_torch_experts import _compat

    legacy_module = _compat.legacy_grouped_mlp()
    if legacy_module is None:
        raise NotInstalled(f"not available: megatron-core {version('megatron-core')} has no "
                           "legacy GroupedMLP (removed in 0.17)")
    GroupedMLP, grouped_gemm_is_available = legacy_module
    if not grouped_gemm_is_available():
        raise NotInstalled("not installed: grouped_gemm")
    legacy = GroupedMLP(config.num_moe_experts, config, pg_collection=pg)
    experts = config.num_moe_experts
    w1 = legacy.weight1.data.view(experts, config.hidden_size, -1)  # [E, in, out], transposed
    w2 = legacy.weight2.data.view(experts, -1, config.hidden_size)  # [E, F, in]
    with torch.no_grad():
        for i, (fc1, fc2) in enumerate(weight_pairs(ours)):
            w1[i].copy_(fc1.T)
            w2[i].copy_(fc2.T)
    return frozen(legacy)


# --- implementations -----------------------------------------------------------------------------

def module_impl(name, module, x, splits, probs, gy, call=None, ours=False):
    """An experts module called as MoELayer calls it; x requires grad, the weights do not."""
    call = call or (lambda: module(x, splits, probs)[0])

    def forward():
        out = call()
        return out, out

    return Impl(name, forward, lambda out: torch.autograd.grad(out, x, gy)[0], module=True,
                ours=ours)


def raw_pair_impl(config, shape, w1, w2, x, offs, probs, gy):
    """fc1 grouped_mm, activation, x probs (FP32, cast back), fc2 grouped_mm, and the two dgrad
    grouped_mms, as plain torch ops: no module, no autograd; the activation's derivative through
    the backward kernels autograd would use."""
    from mcore_torch_experts import find_grouped_mm

    gmm, act = find_grouped_mm().fn, config.activation_func
    x, p = x.detach(), probs.unsqueeze(-1)
    w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)

    def activation(h):
        if not shape.glu:
            return act(h)
        gate, up = h.chunk(2, -1)
        return act(gate) * up

    def activation_grad(h, grad):
        gate, up = h.chunk(2, -1) if shape.glu else (h, None)
        grad_gate = grad * up if shape.glu else grad
        if shape.activation == "silu":
            d_gate = torch.ops.aten.silu_backward(grad_gate, gate)
        else:  # squared ReLU: 2 relu(x) g
            d_gate = torch.relu(gate).mul_(2).mul_(grad_gate)
        return torch.cat([d_gate, grad * act(gate)], -1) if shape.glu else d_gate

    def forward():
        h = gmm(x, w1t, offs=offs)
        return gmm((activation(h) * p).to(h.dtype), w2t, offs=offs), h

    def backward(h):
        grad_act = (gmm(gy, w2, offs=offs) * p).to(h.dtype)
        return gmm(activation_grad(h, grad_act), w1, offs=offs)

    return Impl(RAW, forward, backward)


def gemm_impl(name, fc1, fc2, x, gy, fc1_out_like, act_like):
    """The four GEMMs of a step and nothing else: fc1(x), fc2(act), dgrad of fc2, dgrad of fc1.
    fc1/fc2(a, transposed) run one projection; act_like and fc1_out_like stand in for the
    activation and its gradient (same shapes, random values)."""
    x = x.detach()

    def forward():
        fc1(x, True)
        return fc2(act_like, True), None

    def backward(_):
        fc2(gy, False)
        return fc1(fc1_out_like, False)

    return Impl(name, forward, backward, computes_experts=False)


def graph_step(ours, x, splits, probs, gy):
    """A CUDA graph of TorchGroupedMLP forward + input gradient with GPU splits. Returns (graph,
    static (x, splits, probs, grad_out), static out, static grad)."""
    static = (x.detach().clone().requires_grad_(True), splits.clone(), probs.clone(), gy.clone())

    def step():
        out = ours(*static[:3])[0]
        return out, torch.autograd.grad(out, static[0], static[3])[0]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, grad = step()
    return graph, static, out, grad


def forced_forward(mlp, x, splits, probs, kernel, activation=None):
    """TorchGroupedMLP with its expert kernels forced to `kernel` ("fused_gemm" raises where it
    cannot run) and, when given, its activation (grouped_mm path: "fused" or "eager") forced
    too."""
    from mcore_torch_experts.kernels.choice import KernelChoice

    saved = mlp.kernels
    mlp.kernels = KernelChoice(kernel, kernel, activation or saved.activation)
    try:
        return mlp(x, splits, probs)[0]
    finally:
        mlp.kernels = saved


def lora_wrappers(mlp, kind: str, rank: int, alpha: float, seed: int):
    """Our LoRALinear around linear_fc1 and linear_fc2 of `mlp` (not installed), with B drawn
    small instead of zero so the adapter term is live; kind "shared" or "per_expert"."""
    from mcore_torch_experts.lora import LoRAAdapter, LoRALinear, PerExpertLoRAAdapter

    torch.manual_seed(seed)
    wrappers = []
    for base in (mlp.linear_fc1, mlp.linear_fc2):
        device, dtype = base.packed_weight.device, base.packed_weight.dtype
        if kind == "shared":
            adapter = LoRAAdapter(base.in_features, base.out_features, rank, alpha, 0.0, dtype,
                                  device)
        else:
            adapter = PerExpertLoRAAdapter(base.num_experts, base.in_features, base.out_features,
                                           rank, alpha, 0.0, dtype, device)
        with torch.no_grad():
            adapter.linear_out.weight.normal_(std=0.02)
        wrappers.append(LoRALinear(base, adapter))
    return wrappers


def lora_impl(name, mlp, wrappers, x, splits, probs, gy, kernel):
    """TorchGroupedMLP with the LoRA wrappers installed on its linears for the call and its
    kernels forced to `kernel`; backward is the update pass: the input gradient and every
    adapter factor's gradient (the first returned)."""
    params = [p for wrapper in wrappers for p in wrapper.adapter.parameters()]

    def forward():
        saved = mlp.linear_fc1, mlp.linear_fc2
        mlp.linear_fc1, mlp.linear_fc2 = wrappers
        try:
            out = forced_forward(mlp, x, splits, probs, kernel)
        finally:
            mlp.linear_fc1, mlp.linear_fc2 = saved
        return out, out

    def backward(out):
        return torch.autograd.grad(out, [x, *params], gy)

    return Impl(name, forward, backward, module=True, ours=True, computes_experts=False)


def lora_agreement(fused, grouped):
    """Largest relative difference of output, input gradient and adapter gradients between the
    two LoRA paths (each Impl run once)."""
    out_f, ctx_f = fused.forward()
    out_g, ctx_g = grouped.forward()
    pairs = [(out_f, out_g), *zip(fused.backward(ctx_f), grouped.backward(ctx_g))]
    return max(rel_err(a, b) for a, b in pairs)


# --- measurement ---------------------------------------------------------------------------------

def rel_err(actual, expected):
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def measure(meter, impl, reference, full=True):
    """One row: times, and with full=True memory, syncs, blocking and error against reference."""
    row = {"name": impl.name}

    def step():
        return impl.backward(impl.forward()[1])

    row["fwd_ms"], _ = meter.time(impl.forward)
    row["step_ms"], row["host_ms"] = meter.time(step)
    if not full:
        return row
    if meter.cuda:
        row["peak_mib"], row["held_mib"] = meter.step_memory(impl.forward, impl.backward)
        if impl.module:
            held = []
            row["syncs_fwd"] = meter.count_syncs(lambda: held.append(impl.forward()))
            row["syncs_bwd"] = meter.count_syncs(lambda: impl.backward(held.pop()[1]))
        if impl.ours:  # a few dozen launches: well inside the launch queue while the GPU sleeps
            row["blocks_host"] = meter.blocks_host(step)
    if impl.computes_experts:
        out, ctx = impl.forward()
        row["err"] = max(rel_err(out, reference[0]), rel_err(impl.backward(ctx), reference[1]))
    return row


def guarded_build(build, *args):
    """An optional module, or the note that says why there is none."""
    try:
        return build(*args)
    except NotInstalled as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001
        return error_note(exc)


def step_flops(shape: Shape) -> float:
    """Forward + input gradient: two GEMMs each way."""
    fc1_out = shape.ffn * (2 if shape.glu else 1)
    return 2 * 2 * shape.rows * shape.hidden * (fc1_out + shape.ffn)
