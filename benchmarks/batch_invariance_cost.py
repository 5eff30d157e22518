"""What megatron-core 0.20's batch-invariant mode costs an MoE layer with TorchGroupedMLP experts.

One MoE layer (router, alltoall dispatcher without permute fusion, TorchGroupedMLP experts with
this package's shared LoRA adapters on both expert linears), timed in three arms, interleaved
round by round: the mode off; the mode on (`batch_invariant_mode=True` in the config and
`set_batch_invariant_mode(True, backend="triton")` around the calls) with Megatron's combine; the
mode on with the FP32 Triton combine. Per arm: the forward without grad (a logprob pass) and
forward + backward (an update pass), device ms, median (min–max) over the rounds, each round the
median of --reps calls; and each against the mode off.

    python3 benchmarks/batch_invariance_cost.py --out-dir OUT [--shape qwen3-30b-a3b] [--tokens 8192]
        [--rounds 5] [--reps 5]

Needs a CUDA GPU, megatron-core 0.20 and Transformer Engine (Megatron's
`enable_batch_invariant_mode` imports it).
"""

import argparse
import functools
import importlib.util
import statistics
import sys
from pathlib import Path

import torch

import harness
from experts_impls import init_megatron

SHAPES = {  # experts, hidden, expert ffn, top-k
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "tiny": (8, 256, 128, 2),
}
ARMS = ("mode off", "mode on, Megatron's combine", "mode on, FP32 Triton combine")
RANK = 16


def build(arm: str, shape, device):
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from mcore_torch_experts import TorchExpertsTransformerConfig, _compat
    from mcore_torch_experts.lora import apply_lora
    from mcore_torch_experts.megatron.moe_layer import FP32CombineMoELayer
    from mcore_torch_experts.specs import get_gpt_layer_local_spec

    experts, hidden, ffn, topk = shape
    settings = dict(num_layers=1, hidden_size=hidden, num_attention_heads=16,
                    num_moe_experts=experts, moe_ffn_hidden_size=ffn, moe_router_topk=topk,
                    moe_grouped_gemm=True, add_bias_linear=False, bf16=True,
                    params_dtype=torch.bfloat16, gated_linear_unit=True,
                    activation_func=torch.nn.functional.silu, moe_aux_loss_coeff=0.0,
                    moe_expert_gemm_backend="torch", moe_token_dispatcher_type="alltoall",
                    attention_backend=AttnBackend.flash, flash_attention_version=3,
                    attention_dropout=0.0, batch_invariant_mode=arm != ARMS[0])
    fp32_combine = arm == ARMS[2]
    if fp32_combine:
        settings.update(moe_combine_in_fp32=True, moe_combine_backend="triton")
    config = TorchExpertsTransformerConfig(**settings)
    torch.manual_seed(0)
    spec = get_gpt_layer_local_spec(config).submodules.mlp
    layer = _compat.build_moe_layer(_compat.with_moe_layer_class(
        spec, FP32CombineMoELayer if fp32_combine else MoELayer), config).to(device)
    apply_lora(torch.nn.ModuleDict({"mlp": layer}), ["linear_fc1", "linear_fc2"], rank=RANK,
               alpha=2 * RANK, expert_adapter="shared")
    return layer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if args.tokens < 1 or args.rounds < 1 or args.reps < 1:
        parser.error("--tokens, --rounds and --reps must be at least 1")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: Megatron's batch-invariant kernels run on CUDA only")
    try:
        from megatron.core.transformer.custom_layers.batch_invariant_kernels import (
            set_batch_invariant_mode,
        )
    except ImportError as exc:
        parser.error(f"needs megatron-core 0.20 or newer (its batch-invariant kernels): {exc}")
    if importlib.util.find_spec("transformer_engine") is None:
        parser.error("needs Transformer Engine: megatron-core 0.20's enable_batch_invariant_mode "
                     "imports it")
    device = torch.device("cuda", torch.cuda.current_device())
    init_megatron(device, seed=0)
    shape = SHAPES[args.shape]
    layers = {arm: build(arm, shape, device) for arm in ARMS}
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.tokens, 1, shape[1], device=device, generator=generator).bfloat16()
    grad = torch.randn_like(x)

    def forward(layer):
        with torch.no_grad():
            layer(x)

    def forward_backward(layer):
        inputs = x.detach().requires_grad_(True)
        out, _ = layer(inputs)
        out.backward(grad)

    times = {(arm, phase): [] for arm in ARMS for phase in ("forward", "forward + backward")}
    for _ in range(args.rounds):
        for arm, layer in layers.items():
            with set_batch_invariant_mode(arm != ARMS[0], backend="triton"):
                for phase, fn in (("forward", forward), ("forward + backward", forward_backward)):
                    call = functools.partial(fn, layer)
                    device_ms, _ = harness.median_ms(call, device, warmup=2, reps=args.reps)
                    times[(arm, phase)].append(device_ms)
    rows = []
    for arm in ARMS:
        row = [arm]
        for phase in ("forward", "forward + backward"):
            values, base = times[(arm, phase)], times[(ARMS[0], phase)]
            ratios = [v / b for v, b in zip(values, base)]
            row += [f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})",
                    f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"]
        rows.append(row)
    header = harness.header(device, packages=("triton", "megatron-core", "transformer-engine"))
    experts, hidden, ffn, topk = shape
    header.append(f"{args.shape}: {experts} SwiGLU experts of {ffn}, hidden {hidden}, top-{topk}; "
                  f"{args.tokens} tokens; shared LoRA rank {RANK} on both expert linears; "
                  f"{args.rounds} interleaved rounds, each the median of {args.reps} calls")
    body = harness.markdown_table(
        ["arm", "forward ms", "x mode off", "forward + backward ms", "x mode off"], rows)
    print(harness.write_report(args.out_dir, "batch_invariance_cost",
                               "What the batch-invariant mode costs an MoE layer", header, body,
                               {"times": {f"{a} | {p}": v for (a, p), v in times.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
