"""Megatron-Bridge's per-expert LoRA (`share_expert_adapters=False`) on TorchGroupedMLP: one
forward+backward of the experts module with the adapters on the grouped path (one grouped GEMM
per projection, mcore_torch_experts.integrations.bridge) against Bridge's own forward of the same adapters
(a slice per expert, a `.tolist()` of the splits), and without adapters.

Per shape (shapes.SHAPES, uniform and Zipf routing, the splits on the GPU): device ms (CUDA
events, median), host syncs of one step (torch.cuda sync debug mode) and the relative L2 of
the grouped path's output and adapter gradients against Bridge's. Prints a markdown table.

    python benchmarks/bench_bridge_per_expert.py --shapes qwen3-30b,super-ep4 --dim 16
    python benchmarks/bench_bridge_per_expert.py --tiny    # CPU smoke run (wall clock, no syncs)
"""

import argparse

import torch

from experts_impls import init_megatron, make_config, rel_err
from harness import markdown_table, median_ms
from shapes import SHAPES, TINY_SHAPES, make_splits


def build(shape, pg, dim, device):
    """TorchGroupedMLP at `shape` with Bridge's per-expert LoRA (random B), on `device`."""
    from megatron.bridge.peft.lora import LoRA

    from mcore_torch_experts import TorchGroupedMLP

    config = make_config(shape, shape.experts, device)
    root = torch.nn.Module()
    root.mlp = torch.nn.Module()
    root.mlp.experts = TorchGroupedMLP(shape.experts, config, pg_collection=pg)
    LoRA(target_modules=["linear_fc1", "linear_fc2"], dim=dim, alpha=2 * dim,
         share_expert_adapters=False)(root)
    with torch.no_grad():
        for name, p in root.named_parameters():
            if name.endswith("linear_out.weight"):
                p.normal_(std=0.02)
    return root.to(device).mlp.experts


def step_fn(experts, x, splits, probs, grad):
    def step():
        experts.zero_grad(set_to_none=True)
        out, _ = experts(x, splits, probs)
        out.backward(grad)
        return out
    return step


def count_syncs(fn, device) -> str:
    import warnings

    if device.type != "cuda":
        return "—"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return str(sum("synchroniz" in str(w.message) for w in caught))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3-30b,super-ep4")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes on the CPU (automatic without CUDA)")
    args = parser.parse_args()
    args.tiny = args.tiny or not torch.cuda.is_available()
    shapes = TINY_SHAPES if args.tiny else SHAPES
    if args.tiny:
        args.shapes, args.warmup, args.reps = ",".join(TINY_SHAPES), 1, 2
    from support.bridge_imports import import_megatron_bridge

    import_megatron_bridge()
    from megatron.bridge.peft.adapter_wrapper import AdapterWrapper

    import mcore_torch_experts
    from mcore_torch_experts.integrations.bridge import _ORIGINAL

    mcore_torch_experts.register_with_megatron_bridge()
    grouped_forward = AdapterWrapper.adapter_forward
    bridge_forward = getattr(grouped_forward, _ORIGINAL)
    device = torch.device("cpu") if args.tiny else torch.device("cuda", torch.cuda.current_device())
    pg = init_megatron(device, seed=0)
    rows = []
    for key in args.shapes.split(","):
        shape = shapes[key]
        experts = build(shape, pg, args.dim, device)
        for routing in ("uniform", "zipf"):
            splits = make_splits(shape.rows, shape.experts, routing, 1.2, 0).to(device)
            gen = torch.Generator(device=device).manual_seed(1)
            x = torch.randn(shape.rows, shape.hidden, generator=gen, device=device).bfloat16()
            x.requires_grad_(True)
            probs = torch.rand(shape.rows, generator=gen, device=device)
            grad = torch.randn(shape.rows, shape.hidden, generator=gen, device=device).bfloat16()
            step = step_fn(experts, x, splits, probs, grad)
            results = {}
            for path, forward in (("grouped", grouped_forward), ("bridge", bridge_forward)):
                AdapterWrapper.adapter_forward = forward
                ms = median_ms(step, device, args.warmup, args.reps)[0]
                syncs = count_syncs(step, device)
                out = step().detach()
                grads = [p.grad.clone() for p in experts.parameters() if p.requires_grad]
                results[path] = (ms, syncs, out, grads)
            AdapterWrapper.adapter_forward = grouped_forward
            for linear in (experts.linear_fc1, experts.linear_fc2):
                linear._adapter_enabled = False
            base_ms = median_ms(step, device, args.warmup, args.reps)[0]
            for linear in (experts.linear_fc1, experts.linear_fc2):
                linear._adapter_enabled = True
            (g_ms, g_syncs, g_out, g_grads), (b_ms, b_syncs, b_out, b_grads) = (
                results["grouped"], results["bridge"])
            err = max([rel_err(g_out, b_out)] + [rel_err(a, b) for a, b in zip(g_grads, b_grads)])
            rows.append([shape.label, routing, f"{base_ms:.2f}", f"{g_ms:.2f}", f"{b_ms:.2f}",
                         f"{g_ms - base_ms:.2f}", f"{b_ms - base_ms:.2f}",
                         f"{(b_ms - base_ms) / max(g_ms - base_ms, 1e-9):.1f}x",
                         f"{g_syncs} / {b_syncs}", f"{err:.1e}"])
        del experts
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"Bridge per-expert LoRA dim={args.dim}, experts forward+backward (device ms, median "
          f"of {args.reps}); adapters = step - no-adapter step")
    print("\n".join(markdown_table(
        ["shape", "routing", "no adapters", "grouped", "Bridge's", "adapters grouped",
         "adapters Bridge's", "speed-up", "host syncs (grouped / Bridge's)",
         "max rel L2 vs Bridge's"], rows)))


if __name__ == "__main__":
    main()
