"""torchrun worker: one parallel layout, a full Megatron MoE layer with TorchGroupedMLP experts.

For each dispatcher and activation it checks, on every rank, that the layer's output and input
gradient match the same layer with SequentialMLP experts and an FP64 one-process reference holding
all global experts; that the experts received exactly the tokens routed to them from every rank the
dispatcher gathers from; and that the frozen weights are untouched. TorchGroupedMLP in the
FP32CombineMoELayer too, against the FP64 reference (on allgather its experts read the gathered
tokens through the row index). Where Transformer Engine runs
(importable, --device cuda) the same again with the layers of the TE spec: TorchGroupedMLP against
Megatron's TEGroupedMLP with the same global weights (elsewhere reported as skipped, with the
reason). Then it checks that invalid shapes for this layout fail with the same message on every
rank. Each rank writes `OUT/rank{R}.json`; rank 0 prints a parity table; the exit status is
non-zero on any failure.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests/distributed/moe_parity.py --ep 2 --out /tmp/ep2 [--device cuda]
"""

import sys

import torch
import torch.distributed as dist

from _common import (
    GlobalWeights,
    Sizes,
    base_parser,
    expert_weight_params,
    experts_layer,
    global_inputs,
    group_ranks,
    init_parallel,
    init_processes,
    install,
    moe_config,
    moe_layer,
    parity_table,
    reference_moe,
    rel_err,
    routing,
    te_unavailable,
    write_result,
)

CASES = {"swiglu": Sizes(glu=True), "squared_relu": Sizes(glu=False)}
# Relative L2 errors. The layer runs in bf16 (inputs, weights, expert outputs); the FP64 reference
# sees the same bf16 weights and inputs. SequentialMLP does the same math with per-expert GEMMs:
# on the CPU with the same eager ops (near bit-equal); on CUDA TorchGroupedMLP's fused activation
# rounds once where Megatron's ops round per op (about 6e-3 measured on H200).
# TEGroupedMLP (TE's grouped linears, CUDA only) against TorchGroupedMLP in the TE spec's layers:
# both BF16 with the same router and dispatcher, rounding to BF16 in different places (3.4e-3 to
# 4.1e-3 between the two experts modules at model shapes, docs/transformer_engine.md): the bound
# of CUDA's SequentialMLP comparison and of tests/unit/test_te_parity.py.
TOLERANCE = {"reference": 2e-2, "sequential": {"cpu": 1e-3, "cuda": 2e-2}, "te": {"cuda": 2e-2}}
# (TorchGroupedMLP, the experts it is compared with) of each parity block
PAIRS = {"parity": ("torch", "sequential"), "te_parity": ("torch-te", "te")}
CPU_ONLY_REASON = ("Megatron's alltoall dispatcher needs CUDA streams "
                   "(MoEAlltoAllTokenDispatcher creates torch.cuda.Stream()); "
                   "scripts/gpu_distributed.sh runs it on GPUs")


def run_layer(layer, x, grad_out, seen, key):
    """Forward and backward of the MoE layer; records the experts' tokens_per_expert under key."""
    hook = layer.experts.register_forward_pre_hook(
        lambda module, inputs: seen.__setitem__(key, [int(n) for n in inputs[1].tolist()]))
    x = x.detach().clone().requires_grad_(True)
    out, bias = layer(x)
    out.backward(grad_out)
    hook.remove()
    assert bias is None
    return out.detach(), x.grad


def expected_tokens_per_expert(pg, xs, weights, sizes):
    """Tokens routed to this rank's experts from every rank its dispatcher gathers from."""
    local = sizes.experts // pg.ep.size()
    first = pg.ep.rank() * local
    counts = torch.zeros(sizes.experts, dtype=torch.long)
    for q in group_ranks(pg.tp_ep):
        idx, _ = routing(xs[q].reshape(-1, sizes.hidden), weights, sizes.topk)
        counts += torch.bincount(idx.flatten(), minlength=sizes.experts)
    return counts[first:first + local].tolist()


def parity(args, pg, device, dispatcher, case, sizes, block="parity"):
    """One row of `block` (PAIRS): TorchGroupedMLP's layer against the same layer with the other
    experts and against the FP64 reference; the tokens each experts module saw."""
    weights = GlobalWeights.make(sizes)
    rank, world = dist.get_rank(), dist.get_world_size()
    xs, grads = global_inputs(world, sizes, seed=7)
    x, grad_out = xs[rank].to(device), grads[rank].to(device)
    ours, other = PAIRS[block]
    results, seen, untouched = {}, {}, True
    for experts in (ours, other):
        layer = experts_layer(experts, sizes, pg, device, tp=args.tp, ep=args.ep, etp=args.etp,
                              sp=args.sp, dispatcher=dispatcher)
        install(layer, weights, pg, sizes.glu)
        results[experts] = run_layer(layer, x, grad_out, seen, experts)
        for (fc1, fc2), (fc1_shard, fc2_shard) in zip(expert_weight_params(layer.experts),
                                                      weights.local_shards(pg, sizes.glu)):
            untouched &= (torch.equal(fc1.cpu(), fc1_shard) and torch.equal(fc2.cpu(), fc2_shard)
                          and fc1.grad is None and fc2.grad is None)
    (out, grad), (other_out, other_grad) = results[ours], results[other]
    ref_out, ref_grad = reference_moe(x.cpu(), grad_out.cpu(), weights, sizes)
    row = fp32_combine_row(args, pg, device, dispatcher, sizes, weights, x, grad_out, ref_out,
                           ref_grad) if block == "parity" else {}
    return {**row,
        "dispatcher": dispatcher, "case": case,
        f"out_vs_{other}": rel_err(out, other_out), f"grad_vs_{other}": rel_err(grad, other_grad),
        "out_vs_reference": rel_err(out, ref_out), "grad_vs_reference": rel_err(grad, ref_grad),
        f"{other}_out_vs_reference": rel_err(other_out, ref_out),
        f"{other}_grad_vs_reference": rel_err(other_grad, ref_grad),
        "tokens_per_expert": seen[ours], f"{other}_tokens_per_expert": seen[other],
        "expected_tokens_per_expert": expected_tokens_per_expert(pg, xs, weights, sizes),
        "experts_untouched": bool(untouched),
    }


def fp32_combine_row(args, pg, device, dispatcher, sizes, weights, x, grad_out, ref_out,
                     ref_grad):
    """TorchGroupedMLP in the FP32CombineMoELayer against the FP64 reference: on the allgather
    dispatcher its experts get the gathered tokens and the row index (RoutedTokens), else the
    permuted rows; the tokens per expert they see."""
    layer = experts_layer("torch", sizes, pg, device, tp=args.tp, ep=args.ep, etp=args.etp,
                          sp=args.sp, dispatcher=dispatcher, moe_combine_in_fp32=True)
    install(layer, weights, pg, sizes.glu)
    inputs, seen = [], {}
    layer.experts.register_forward_pre_hook(
        lambda module, args: inputs.append(type(args[0]).__name__))
    out, grad = run_layer(layer, x, grad_out, seen, "fp32_combine")
    return {"fp32_combine_experts_input": inputs[0],
            "fp32_combine_out_vs_reference": rel_err(out, ref_out),
            "fp32_combine_grad_vs_reference": rel_err(grad, ref_grad),
            "fp32_combine_tokens_per_expert": seen["fp32_combine"]}


def shared_experts_fp32_combine(args, pg, device, overlap, experts="torch"):
    """The alltoall MoE layer with shared experts (overlapped with the dispatcher or not) and the
    FP32 top-k combine, against the same layer with Megatron's combine: the shared experts' fc2
    runs once per forward in each, and outputs and input gradients agree. `experts` "torch-te":
    the TE spec's layer (TE linears in the shared experts)."""
    from mcore_torch_experts.megatron.moe_layer import FP32CombineMoELayer

    sizes = CASES["swiglu"]
    weights = GlobalWeights.make(sizes)
    rank, world = dist.get_rank(), dist.get_world_size()
    xs, grads = global_inputs(world, sizes, seed=11)
    x, grad_out = xs[rank].to(device), grads[rank].to(device)
    layers = {fp32: experts_layer(experts, sizes, pg, device, tp=args.tp, ep=args.ep,
                                  etp=args.etp, sp=args.sp, dispatcher="alltoall",
                                  moe_combine_in_fp32=fp32,
                                  moe_shared_expert_intermediate_size=sizes.ffn,
                                  moe_shared_expert_overlap=overlap)
              for fp32 in (True, False)}
    layers[False].load_state_dict(layers[True].state_dict())  # the same router, shared experts
    results, fc2_calls = {}, {}
    for fp32, layer in layers.items():
        assert isinstance(layer, FP32CombineMoELayer) == fp32
        install(layer, weights, pg, sizes.glu)
        calls = []
        # The hook holds this layer's list (not the loop variable, which the next layer rebinds).
        layer.shared_experts.linear_fc2.register_forward_hook(
            lambda *args, calls=calls: calls.append(1))
        results[fp32] = run_layer(layer, x, grad_out, {}, fp32)
        fc2_calls[fp32] = len(calls)
    (out, grad), (megatron_out, megatron_grad) = results[True], results[False]
    return dict(experts=experts, overlap=overlap, fc2_calls=fc2_calls[True],
                megatron_fc2_calls=fc2_calls[False],
                out_vs_megatron=rel_err(out, megatron_out),
                grad_vs_megatron=rel_err(grad, megatron_grad))


def dispatcher_unavailable(args, pg, dispatcher):
    """Why this dispatcher cannot run here, or None. Only a failure to build counts."""
    if args.device == "cuda" or dispatcher != "alltoall":
        return None
    try:
        moe_layer(moe_config("torch", Sizes(), args.device, tp=args.tp, ep=args.ep, etp=args.etp,
                             sp=args.sp, dispatcher=dispatcher), pg, "cpu")
    except Exception as error:  # noqa: BLE001 - recorded as the reason for skipping
        return f"{CPU_ONLY_REASON} [{type(error).__name__}: {error}]"
    return None


def invalid_shapes(args):
    """Expert shapes this layout must refuse: {name: (how it is built, config overrides)}.

    "config": TorchExpertsTransformerConfig with this layout's parallel sizes refuses them.
    "experts": TorchGroupedMLP built directly on this layout's process groups from a config
    that was never validated and names no expert parallelism: the group sizes must decide.
    "layer": the MoE layer of the package's spec on this layout's process groups, from a config
    that names no expert parallelism (and so passes its own checks).
    """
    cases = {}
    if args.etp > 1:
        misaligned = 8 * (args.etp + 1)  # a multiple of 8 whose per-rank share is not
        cases["ffn_not_divisible_by_etp/config"] = ("config", dict(moe_ffn_hidden_size=33))
        cases["ffn_not_divisible_by_etp/experts"] = ("experts", dict(moe_ffn_hidden_size=33))
        cases["ffn_shard_misaligned/layer"] = ("layer", dict(moe_ffn_hidden_size=misaligned))
    if args.ep > 1:
        experts = dict(num_moe_experts=2 * args.ep + 1)
        cases["experts_not_divisible_by_ep/config"] = ("config", experts)
        cases["experts_not_divisible_by_ep/experts"] = ("experts", experts)
    return cases


def validation_errors(args, pg, device):
    """{case: "ExceptionType: message"} (None if nothing was raised) for this rank."""
    from mcore_torch_experts import TorchGroupedMLP

    messages = {}
    for name, (how, overrides) in invalid_shapes(args).items():
        parallel = dict(tp=args.tp, sp=args.sp)
        if how == "config":
            parallel.update(ep=args.ep, etp=args.etp)
        # the flag's default backend skips the config-time checks of the torch backend
        backend = "transformer_engine" if how == "experts" else "torch"
        try:
            config = moe_config(backend, Sizes(), args.device, **parallel,
                                **{"moe_grouped_gemm": True, **overrides})
            if how == "layer":
                moe_layer(config, pg, device)
            elif how == "experts":
                TorchGroupedMLP(config.num_moe_experts // args.ep, config, pg_collection=pg)
            messages[name] = None
        except Exception as error:  # noqa: BLE001 - the message is the result
            messages[name] = f"{type(error).__name__}: {error}"
    return messages


def failures(args, result):
    problems = []
    for block, (_, other) in PAIRS.items():
        for row in result[block]:
            label = f"rank {result['rank']} {block} {row['dispatcher']}/{row['case']}"
            limits = {"out_vs_reference": TOLERANCE["reference"],
                      "grad_vs_reference": TOLERANCE["reference"],
                      f"{other}_out_vs_reference": TOLERANCE["reference"],
                      f"{other}_grad_vs_reference": TOLERANCE["reference"],
                      f"out_vs_{other}": TOLERANCE[other][args.device],
                      f"grad_vs_{other}": TOLERANCE[other][args.device]}
            for name, limit in limits.items():
                if not row[name] <= limit:
                    problems.append(f"{label}: {name}={row[name]:.3e} > {limit}")
            if not (row["tokens_per_expert"] == row[f"{other}_tokens_per_expert"]
                    == row["expected_tokens_per_expert"]):
                problems.append(f"{label}: tokens per expert {row['tokens_per_expert']} ({other} "
                                f"{row[f'{other}_tokens_per_expert']}), expected "
                                f"{row['expected_tokens_per_expert']}")
            if not row["experts_untouched"]:
                problems.append(f"{label}: expert weights changed or got a gradient")
            if block != "parity":
                continue
            for name in ("fp32_combine_out_vs_reference", "fp32_combine_grad_vs_reference"):
                if not row[name] <= TOLERANCE["reference"]:
                    problems.append(f"{label}: {name}={row[name]:.3e} > {TOLERANCE['reference']}")
            handed = "RoutedTokens" if row["dispatcher"] == "allgather" else "Tensor"
            if row["fp32_combine_experts_input"] != handed:
                problems.append(f"{label}: FP32CombineMoELayer handed its experts a "
                                f"{row['fp32_combine_experts_input']}, expected {handed}")
            if row["fp32_combine_tokens_per_expert"] != row["expected_tokens_per_expert"]:
                problems.append(f"{label}: FP32CombineMoELayer's experts saw tokens per expert "
                                f"{row['fp32_combine_tokens_per_expert']}")
    for row in result["shared_experts"]:
        label = (f"rank {result['rank']} {row['experts']} alltoall/shared experts "
                 f"(overlap={row['overlap']})")
        if not row["fc2_calls"] == row["megatron_fc2_calls"] == 1:
            problems.append(f"{label}: shared fc2 ran {row['fc2_calls']} times (Megatron's "
                            f"combine: {row['megatron_fc2_calls']}), expected once")
        for name in ("out_vs_megatron", "grad_vs_megatron"):
            if not row[name] <= TOLERANCE["reference"]:
                problems.append(f"{label}: {name}={row[name]:.3e} > {TOLERANCE['reference']}")
    for name, message in result["errors"].items():
        if message is None:
            problems.append(f"rank {result['rank']} {name}: built without an error")
    return problems


def main():
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--etp", type=int, default=1)
    parser.add_argument("--sp", action="store_true", help="sequence parallel (needs --tp > 1)")
    parser.add_argument("--dispatchers", default="allgather,alltoall")
    parser.add_argument("--shared-experts", action="store_true",
                        help="also the alltoall layer with shared experts and the FP32 combine")
    args = parser.parse_args()
    layout = f"tp{args.tp}{'+sp' if args.sp else ''} ep{args.ep} etp{args.etp}"

    device = init_processes(args.device)
    pg = init_parallel(args.device, tp=args.tp, ep=args.ep, etp=args.etp)
    te_skipped = te_unavailable(args.device)
    result = dict(rank=dist.get_rank(), layout=layout, world=dist.get_world_size(), parity=[],
                  te_parity=[], skipped=[], te_skipped=te_skipped, shared_experts=[])
    blocks = ["parity"] + ([] if te_skipped else ["te_parity"])
    if args.shared_experts:
        for experts in [PAIRS[block][0] for block in blocks]:
            for overlap in (False, True):
                result["shared_experts"].append(
                    shared_experts_fp32_combine(args, pg, device, overlap, experts))
    for dispatcher in args.dispatchers.split(","):
        reason = dispatcher_unavailable(args, pg, dispatcher)
        if reason:
            result["skipped"].append(dict(dispatcher=dispatcher, reason=reason))
            continue
        for block in blocks:
            for case, sizes in CASES.items():
                result[block].append(parity(args, pg, device, dispatcher, case, sizes, block))
    result["errors"] = validation_errors(args, pg, device)
    write_result(args.out, result)

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    problems = [p for r in gathered for p in failures(args, r)]
    messages = [r["errors"] for r in gathered]
    if any(m != messages[0] for m in messages):
        problems.append(f"validation messages differ between ranks: {messages}")
    if dist.get_rank() == 0:
        print(parity_table(gathered))
        for row in (row for r in gathered for row in r["shared_experts"]):
            print(f"{row['experts']}: alltoall + shared experts (overlap={row['overlap']}) + "
                  "FP32 combine vs "
                  f"Megatron's combine: fc2 calls {row['fc2_calls']}/{row['megatron_fc2_calls']}, "
                  f"out {row['out_vs_megatron']:.2e}, grad {row['grad_vs_megatron']:.2e}")
        print("\n".join(["FAILED:", *problems]) if problems else f"{layout}: all checks passed",
              flush=True)
    dist.destroy_process_group()
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
