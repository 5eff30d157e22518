"""torchrun worker: LoRA adapters on TorchGroupedMLP in two FP32CombineMoELayers in a row, on the
allgather dispatcher with TP x EP > 1, through the fused expert kernels (Triton's interpreter on
the CPU).

There the dispatcher gathers each layer's tokens into Megatron's global all-gather buffer, and the
experts read them in place (RoutedTokens); the second layer's gather rewrites that buffer before
the first layer's backward runs. Output, input gradient and every adapter factor's gradient of
both layers are checked, on every rank, against an FP64 one-process reference of the two layers
with all global experts (each expert's weight W_e + alpha/r * B_e @ A_e; a shared adapter's
gradient on a rank is the sum over its local experts). Each rank writes `OUT/rank{R}.json`.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests/distributed/adapters_after_reused_buffer.py --ep 2 --adapter shared --out /tmp/x
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton's import: the fused kernels on the CPU

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import (  # noqa: E402
    GlobalWeights,
    Sizes,
    base_parser,
    global_inputs,
    init_parallel,
    init_processes,
    install,
    moe_config,
    moe_layer,
    reference_layer_with_adapters,
    rel_err,
    write_result,
)

SIZES = Sizes(glu=False, experts=4, hidden=32, ffn=32, tokens=12)  # squared ReLU: fused kernels
RANK, ALPHA = 8, 16.0
SCALE = ALPHA / RANK
# Relative L2 error against FP64: one bf16 layer under the interpreter is within 2e-2 (it
# truncates to bf16); two in a row compound (up to 1.9e-2 measured on layer 0's factors). A
# gradient computed from another layer's tokens is off by O(1).
TOLERANCE = 3e-2
LINEARS = ("linear_fc1", "linear_fc2")


def global_factors(layer: int, adapter: str):
    """{linear: (A [E, r, in], B [E, out, r])} of one layer, float32, the same on every rank; a
    shared adapter's factors repeated for each expert."""
    g = torch.Generator().manual_seed(100 + layer)
    shapes = {"linear_fc1": (SIZES.hidden, SIZES.ffn), "linear_fc2": (SIZES.ffn, SIZES.hidden)}
    lead = SIZES.experts if adapter == "per_expert" else 1
    factors = {}
    for name, (fan_in, fan_out) in shapes.items():
        a = torch.randn(lead, RANK, fan_in, generator=g) * 0.3
        b = torch.randn(lead, fan_out, RANK, generator=g) * 0.3
        factors[name] = (a.bfloat16().float().expand(SIZES.experts, -1, -1),
                         b.bfloat16().float().expand(SIZES.experts, -1, -1))
    return factors


def reference_layer(x64, weights: GlobalWeights, factors):
    """FP64 MoE layer over all tokens [N, H] with adapter factors {linear: (A, B)} (leaves)."""
    return reference_layer_with_adapters(x64, weights, factors, SIZES, SCALE)


def main():
    parser = base_parser(__doc__)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--adapter", choices=("shared", "per_expert"), default="shared")
    args = parser.parse_args()
    device = init_processes("cpu")
    pg = init_parallel("cpu", tp=args.tp, ep=args.ep)
    from megatron.core.activations import squared_relu

    from mcore_torch_experts import apply_lora
    from mcore_torch_experts.megatron.moe_layer import FP32CombineMoELayer

    world, rank = dist.get_world_size(), dist.get_rank()
    weights = [GlobalWeights.make(SIZES, seed=1234 + i) for i in range(2)]
    factors = [global_factors(i, args.adapter) for i in range(2)]
    root = torch.nn.Module()
    root.layers = torch.nn.ModuleList()
    for i in range(2):
        config = moe_config("torch", SIZES, "cpu", tp=args.tp, ep=args.ep,
                            moe_combine_in_fp32=True, moe_expert_kernel="fused_gemm",
                            activation_func=squared_relu)  # the kernels' (Megatron's) function
        layer = moe_layer(config, pg, device)
        assert isinstance(layer, FP32CombineMoELayer)
        install(layer, weights[i], pg, SIZES.glu)
        root.layers.append(torch.nn.Module())
        root.layers[i].mlp = layer
    apply_lora(root, list(LINEARS), rank=RANK, alpha=ALPHA, expert_adapter=args.adapter)
    local = SIZES.experts // pg.ep.size()
    experts = range(pg.ep.rank() * local, (pg.ep.rank() + 1) * local)
    adapters = {}
    with torch.no_grad():
        for i, container in enumerate(root.layers):
            for name in LINEARS:
                adapter = getattr(container.mlp.experts, name).adapter
                a, b = factors[i][name]
                take = (lambda t: t[experts]) if args.adapter == "per_expert" else (lambda t: t[0])
                adapter.linear_in.weight.copy_(take(a))
                adapter.linear_out.weight.copy_(take(b))
                adapters[(i, name)] = adapter
    handed = []
    for container in root.layers:
        container.mlp.experts.register_forward_pre_hook(
            lambda module, inputs: handed.append(type(inputs[0]).__name__))

    xs, grads = global_inputs(world, SIZES, seed=7)
    x = xs[rank].clone().requires_grad_(True)
    hidden, outs = x, []
    for container in root.layers:
        hidden, _ = container.mlp(hidden)
        outs.append(hidden)
    hidden.backward(grads[rank])

    # The reference: all ranks' tokens through both layers in FP64; layer 1 routes on the value
    # layer 0 gave (bf16), so both route alike, and differentiates through the reference.
    gathered = [torch.empty_like(outs[0]) for _ in range(world)]
    dist.all_gather(gathered, outs[0].detach().contiguous())
    real_out0 = torch.stack(gathered).reshape(-1, SIZES.hidden).double()
    x64 = xs.reshape(-1, SIZES.hidden).double().requires_grad_(True)
    leaves = [{name: tuple(t.double().clone().requires_grad_(True) for t in pair)
               for name, pair in layer_factors.items()} for layer_factors in factors]
    ref0 = reference_layer(x64, weights[0], leaves[0])
    ref1 = reference_layer(ref0 + (real_out0 - ref0).detach(), weights[1], leaves[1])
    ref1.backward(grads.reshape(-1, SIZES.hidden).double())
    mine = slice(rank * SIZES.tokens, (rank + 1) * SIZES.tokens)
    errors = {"out": rel_err(hidden, ref1[mine].reshape(hidden.shape)),
              "grad_x": rel_err(x.grad, x64.grad[mine].reshape(x.shape))}
    for (i, name), adapter in adapters.items():
        for factor, module, leaf in zip("AB", (adapter.linear_in, adapter.linear_out),
                                        leaves[i][name]):
            want = leaf.grad[experts] if args.adapter == "per_expert" else leaf.grad[
                list(experts)].sum(0)
            errors[f"layer{i}.{name}.{factor}"] = rel_err(module.weight.grad, want)
    result = {"rank": rank, "adapter": args.adapter, "experts_input": handed, "errors": errors,
              "tolerance": TOLERANCE}
    write_result(args.out, result)
    if rank == 0:
        print(result)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
