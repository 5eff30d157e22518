"""Build one Megatron-Core MoE layer twice from the same weights, with TorchGroupedMLP and with
Megatron's SequentialMLP as its experts; run forward and backward; print agreement and timings.

    python examples/demo_moe_layer.py [--experts 16] [--tokens 2048] [--hidden 256] [--ffn 512]
    python tests/support/run_on_cpu.py examples/demo_moe_layer.py [...]   (a host without CUDA)
"""

import argparse
import time

import torch

from mcore_torch_experts import TorchExpertsTransformerConfig, TorchGroupedMLP, build_moe_layer
from single_process import init_megatron, shutdown_megatron


def make_config(args, backend):
    device_init = not torch.cuda.is_available()
    return TorchExpertsTransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=4,
        num_moe_experts=args.experts, moe_ffn_hidden_size=args.ffn, ffn_hidden_size=args.ffn,
        moe_router_topk=args.topk, moe_grouped_gemm=backend == "torch",
        moe_token_dispatcher_type="allgather", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, bf16=True,
        params_dtype=torch.bfloat16, use_cpu_initialization=device_init,
        moe_expert_gemm_backend=backend,
    )


def timed(fn, repeats):
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    init_megatron()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    ours = build_moe_layer(make_config(args, "torch")).to(device)
    reference = build_moe_layer(make_config(args, "transformer_engine")).to(device)
    assert isinstance(ours.experts, TorchGroupedMLP)
    print(f"experts: {type(ours.experts).__name__} ({ours.experts.grouped_mm_name}) vs "
          f"{type(reference.experts).__name__}; {args.experts} experts, top-{args.topk}, "
          f"hidden {args.hidden}, ffn {args.ffn} (SwiGLU), {args.tokens} tokens on {device}")

    # Same weights: the router is copied, each expert's fc1/fc2 goes into the matching local expert.
    reference.router.load_state_dict(ours.router.state_dict())
    with torch.no_grad():
        for i, expert in enumerate(reference.experts.local_experts):
            expert.linear_fc1.weight.copy_(getattr(ours.experts.linear_fc1, f"weight{i}"))
            expert.linear_fc2.weight.copy_(getattr(ours.experts.linear_fc2, f"weight{i}"))
    for layer in (ours, reference):
        for p in layer.experts.parameters():
            p.requires_grad_(False)  # the frozen expert base of adapter training

    x = torch.randn(args.tokens, 1, args.hidden, dtype=torch.bfloat16, device=device)
    grad = torch.randn_like(x)
    results = {}
    for name, layer in (("TorchGroupedMLP", ours), ("SequentialMLP", reference)):
        inp = x.clone().requires_grad_(True)
        out, _ = layer(inp)
        out.backward(grad)
        results[name] = (out.detach().float(), inp.grad.float())

        def step(layer=layer):
            inp = x.clone().requires_grad_(True)
            layer(inp)[0].backward(grad)

        results[name] += (timed(step, args.repeats),)

    (out_a, gx_a, ms_a), (out_b, gx_b, ms_b) = results["TorchGroupedMLP"], results["SequentialMLP"]
    rel = lambda a, b: float((a - b).norm() / b.norm())
    print(f"output relative L2 difference:         {rel(out_a, out_b):.3e}")
    print(f"input-gradient relative L2 difference: {rel(gx_a, gx_b):.3e}")
    print(f"forward+backward per step: TorchGroupedMLP {ms_a:.1f} ms, SequentialMLP {ms_b:.1f} ms "
          f"({ms_b / ms_a:.2f}x)")
    if device == "cpu":
        print("(CPU timings: grouped GEMM is a per-expert loop on the CPU; speed is a GPU story, "
              "see BENCHMARKS.md)")


if __name__ == "__main__":
    try:
        main()
    finally:
        shutdown_megatron()
