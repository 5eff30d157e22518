"""torchrun worker: megatron-core 0.20's batch_invariant_mode across expert parallel (or
expert-tensor parallel) ranks, TorchGroupedMLP experts.

Every rank holds a probe batch of its own tokens, alone and then among other tokens (7x as many,
and 32x as many routed mostly onto two experts), and runs the MoE layer of the package's spec in
the mode (router, alltoall dispatcher with its fixed-order unpermute, our experts with no adapter,
a shared and a per-expert LoRA, Megatron's combine): each rank's probe outputs and input gradients
must come out bit for bit the same in every batch, whatever the other ranks hold, and a changed
probe value must show. On the CPU (gloo) only the mode's flag is set (Megatron's batch-invariant
kernels need CUDA), as in tests/unit/test_batch_invariance.py; the dispatcher's CUDA streams and
split sizes get the host stand-ins of support.cpu_support (host_streams), as does the uneven
all-gather of expert-tensor parallelism (`--etp 2`: each rank holds half of every expert, the
dispatcher gathers both ranks' rows in uneven sizes, which gloo's all-gather refuses and NCCL
takes; our expert adapters need ETP=1, so the experts run without them there). Each rank writes
`OUT/rank{R}.json`; rank 0 prints one line per adapter; the exit status is non-zero on a
failure.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests/distributed/batch_invariance_ep.py --ep 2 --out /tmp/bi
    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests/distributed/batch_invariance_ep.py --ep 1 --etp 2 --out /tmp/bi_etp
"""

import sys

import torch
import torch.distributed as dist

from _common import (
    Sizes,
    base_parser,
    init_parallel,
    init_processes,
    moe_config,
    moe_layer,
    write_result,
)

SIZES = Sizes(hidden=64, ffn=32, experts=8, topk=2)
PROBE_TOKENS, RANK = 8, 8
# context: (other tokens per probe token, the others routed mostly onto two experts)
CONTEXTS = {"alone": (0, False), "among 7x others": (7, False), "skewed, 32x": (32, True)}


def mode_settings():
    """What megatron-core 0.20 asks of an MoE config in the mode (but DeepGEMM, which our
    experts never call)."""
    from megatron.core.transformer.enums import AttnBackend

    return dict(batch_invariant_mode=True, attention_backend=AttnBackend.flash,
                flash_attention_version=3, attention_dropout=0.0)


def layer_in_the_mode(args, pg, adapter):
    from mcore_torch_experts.lora import apply_lora

    config = moe_config("torch", SIZES, "cpu", ep=args.ep, etp=args.etp, dispatcher="alltoall",
                        **mode_settings())
    layer = moe_layer(config, pg, torch.device("cpu"))
    if adapter is None:
        for p in layer.experts.parameters():
            p.requires_grad_(False)
        return layer
    torch.manual_seed(1)
    apply_lora(torch.nn.ModuleDict({"mlp": layer}), ["linear_fc1", "linear_fc2"], rank=RANK,
               alpha=2 * RANK, expert_adapter=adapter)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "linear_out" in name:
                p.normal_(std=0.05)  # B starts at zero: the adapters would add nothing
    return layer


def batch(others_per_probe, skewed):
    """This rank's hidden [S, 1, H] with its probe tokens in the middle, their slice and the
    output gradient; the probe tokens' values the same in every batch, the others' not."""
    rank, h = dist.get_rank(), SIZES.hidden
    probe = torch.Generator().manual_seed(100 + rank)
    probe_x, probe_grad = torch.randn(PROBE_TOKENS, h, generator=probe), torch.randn(
        PROBE_TOKENS, h, generator=probe)
    # Rank 1 holds 3 more others: the ranks' batches differ in length too (at ETP=2 the
    # dispatcher's gather of both ranks' rows is uneven only then: every rank's rows are its own).
    others = others_per_probe * PROBE_TOKENS + (3 * rank if others_per_probe else 0)
    gen = torch.Generator().manual_seed(1000 * rank + others + skewed)
    x, grad = torch.randn(others + PROBE_TOKENS, h, generator=gen), torch.randn(
        others + PROBE_TOKENS, h, generator=gen)
    if skewed:  # the others close to one direction: the router piles them onto few experts
        x[:others // 2] = x[:others // 2] * 0.01 + probe_x[0]
    at = slice(others // 2, others // 2 + PROBE_TOKENS)
    x[at], grad[at] = probe_x, probe_grad
    return x.unsqueeze(1).bfloat16(), at, grad.unsqueeze(1).bfloat16()


def differences(layer):
    """{context: (max |probe output - alone's|, max |probe input gradient - alone's|)}, and the
    same for a control: the probe alone with one of its values changed (the comparison must see
    it)."""
    results = {}
    for context, (others, skewed) in {**CONTEXTS, "control": (0, False)}.items():
        x, at, grad = batch(others, skewed)
        if context == "control":
            x[at][0, 0, 0] += 0.5
        x.requires_grad_(True)
        out, _ = layer(x)
        out.backward(grad)
        results[context] = (out[at].detach().clone(), x.grad[at].clone())
    alone_out, alone_dx = results["alone"]
    assert alone_out.abs().sum() > 0 and alone_dx.abs().sum() > 0
    return {context: [(out - alone_out).abs().max().item(), (dx - alone_dx).abs().max().item()]
            for context, (out, dx) in results.items()}


def main():
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--etp", type=int, default=1)
    args = parser.parse_args()
    if args.device != "cpu":
        parser.error("--device cpu only (gloo; Megatron's batch-invariant kernels are not turned "
                     "on here): tests/unit/test_batch_invariance.py runs the mode on a GPU")
    from megatron.core.transformer.custom_layers import batch_invariant_kernels

    init_processes("cpu", host_streams=True)
    pg = init_parallel("cpu", ep=args.ep, etp=args.etp)
    batch_invariant_kernels._batch_invariant_MODE = True  # the flag only: its kernels need CUDA
    layout = f"ep{args.ep}" + (f" etp{args.etp}" if args.etp > 1 else "")
    result = dict(rank=dist.get_rank(), layout=layout, differences={})
    # Our expert adapters need expert_tensor_parallel_size=1 (apply_lora refuses them under
    # ETP): the experts alone there.
    for adapter in (None, "shared", "per_expert") if args.etp == 1 else (None,):
        result["differences"][str(adapter)] = differences(layer_in_the_mode(args, pg, adapter))
    write_result(args.out, result)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    failed = [(r["rank"], adapter, context, diff) for r in gathered
              for adapter, by_context in r["differences"].items()
              for context, diff in by_context.items()
              if (diff != [0.0, 0.0]) != (context == "control")]
    if dist.get_rank() == 0:
        for adapter in result["differences"]:
            worst = max(max(max(d) for c, d in r["differences"][adapter].items()
                            if c != "control") for r in gathered)
            print(f"{result['layout']} {adapter}: probe output and input gradient, worst "
                  f"difference to alone over ranks and batches {worst:.3g}")
        print(f"FAILED: {failed}" if failed else f"{result['layout']}: all checks passed",
              flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
