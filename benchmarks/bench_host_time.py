"""Host time of TorchGroupedMLP's per-call work at 128 local experts: `packed()` of one expert
linear (what every forward asks for each linear), and one forward, and forward + input gradient,
of the experts module on a batch small enough that the host's work dominates (hidden 256, 128
SwiGLU experts of 128, 256 rows). Prints and writes a table: microseconds per call, median
(min–max) over rounds, each round the mean of `--calls` calls.

    python3 benchmarks/bench_host_time.py --out-dir OUT [--experts 128] [--rounds 7] [--calls 200]

On a GPU the timed calls are enqueued back to back with one synchronisation at each end, so the
figure is the host's time per call while the GPU keeps up; on the CPU the forward's figures
include its small compute (they say nothing about GPU speed), `packed()` is host work alone.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import harness
from experts_impls import init_megatron


def build(experts: int, device: torch.device):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mcore_torch_experts import TorchGroupedMLP

    pg = init_megatron(device, seed=0)
    config = TransformerConfig(
        num_layers=1, hidden_size=256, num_attention_heads=8, num_moe_experts=experts,
        moe_ffn_hidden_size=128, ffn_hidden_size=128, moe_router_topk=2, moe_grouped_gemm=True,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, bf16=True,
        params_dtype=torch.bfloat16, use_cpu_initialization=device.type == "cpu")
    return TorchGroupedMLP(experts, config, pg_collection=pg).to(device)


def per_call_us(fn, device, calls: int, rounds: int) -> list:
    """[us per call] of each round: `calls` calls between two synchronisations."""
    for _ in range(max(3, calls // 10)):
        fn()
    harness.sync(device)
    values = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        harness.sync(device)
        values.append((time.perf_counter() - start) / calls * 1e6)
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    if args.experts < 1 or args.rows < 0 or args.rounds < 1 or args.calls < 1:
        parser.error("--experts, --rounds and --calls must be at least 1, --rows at least 0")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    experts = build(args.experts, device)
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.rows, 256, device=device, generator=generator).bfloat16()
    x.requires_grad_(True)
    splits = torch.full((args.experts,), args.rows // args.experts, dtype=torch.long)
    splits[: args.rows % args.experts] += 1
    probs = torch.rand(args.rows, device=device, generator=generator)
    grad = torch.ones(args.rows, 256, device=device, dtype=torch.bfloat16)

    def forward():
        with torch.no_grad():
            experts(x, splits, probs)

    def forward_backward():
        out, _ = experts(x, splits, probs)
        torch.autograd.grad(out, x, grad)

    cases = [("`linear_fc1.packed()`", lambda: experts.linear_fc1.packed(refuse_trainable=True)),
             ("forward (no grad)", forward), ("forward + input gradient", forward_backward)]
    rows, data = [], {}
    for name, fn in cases:
        values = per_call_us(fn, device, args.calls, args.rounds)
        data[name] = values
        rows.append([name, f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})"])
    header = harness.header(device, packages=("triton", "megatron-core"))
    header.append(f"{args.experts} local experts (SwiGLU, hidden 256, width 128), {args.rows} rows; "
                  f"{args.rounds} rounds of {args.calls} calls")
    body = harness.markdown_table(["call", "us per call, median (min–max) of the rounds"], rows)
    print(harness.write_report(args.out_dir, "host_time", "TorchGroupedMLP's host time per call",
                               header, body, data))


if __name__ == "__main__":
    sys.exit(main())
