"""torchrun worker: LoRA on TorchGroupedMLP at EP > 1 (and TP > 1 with sequence parallelism),
trained one step under Megatron's DistributedDataParallel with Megatron's `finalize_model_grads`,
then a distributed-checkpoint round trip of the adapters.

Every rank feeds its own tokens (allgather dispatcher). A shared expert adapter is one adapter for
all of the layer's experts, replicated on every EP rank: after DDP's gradient sync its gradient
must be the FP64 full-batch gradient (every rank's tokens through every expert) over the
data-parallel size (world / TP), the same bits on every rank, and so must its weights after an SGD
step. Under TP with sequence parallelism each TP rank feeds its own sequence shard: the shared
adapter's gradient is summed over TP too (Megatron's sequence-parallel reduction in
`finalize_model_grads`). A per-expert adapter holds the EP rank's experts only: its gradient is
the full-batch gradient of those experts. Then `lora_sharded_state_dict` is saved with
`dist_checkpointing` (a shared adapter with one main replica in the whole world), loaded into a
fresh model with other adapter values, and every adapter weight must equal the trained one on
every rank. Each rank writes
`OUT/rank{R}.json`.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests/distributed/expert_adapters_ep.py --ep 2 [--tp 2 --sp] --adapter shared --out /tmp/x
"""

import os

import torch
import torch.distributed as dist

from _common import (
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

SIZES = Sizes(glu=False, experts=4, hidden=32, ffn=32, tokens=12)
RANK, ALPHA, LR = 8, 16.0, 0.5
SCALE = ALPHA / RANK
TOLERANCE = 3e-2  # bf16 layer against FP64 (relative L2); a one-rank-only gradient is off by O(1)
LINEARS = ("linear_fc1", "linear_fc2")


def global_factors(adapter: str, seed: int):
    """{linear: (A [E, r, in], B [E, out, r])}, float32, the same on every rank; a shared
    adapter's factors repeated for each expert."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"linear_fc1": (SIZES.hidden, SIZES.ffn), "linear_fc2": (SIZES.ffn, SIZES.hidden)}
    lead = SIZES.experts if adapter == "per_expert" else 1
    factors = {}
    for name, (fan_in, fan_out) in shapes.items():
        a = torch.randn(lead, RANK, fan_in, generator=g) * 0.3
        b = torch.randn(lead, fan_out, RANK, generator=g) * 0.3
        factors[name] = (a.expand(SIZES.experts, -1, -1), b.expand(SIZES.experts, -1, -1))
    return factors


def reference_layer(x64, weights: GlobalWeights, factors):
    """FP64 MoE layer over all tokens [N, H] with adapter factors {linear: (A, B)} (leaves)."""
    return reference_layer_with_adapters(x64, weights, factors, SIZES, SCALE)


def build(args, pg, weights, factors):
    """A MegatronModule root holding `mlp` (the MoE layer), LoRA on the experts set to the
    global factors' values for this rank; returns (root, {linear: adapter})."""
    from megatron.core.transformer.module import MegatronModule

    from mcore_torch_experts import apply_lora

    config = moe_config("torch", SIZES, "cpu", ep=args.ep, tp=args.tp, sp=args.sp)
    layer = moe_layer(config, pg, torch.device("cpu"))
    install(layer, weights, pg, SIZES.glu)
    root = MegatronModule(config)
    root.mlp = layer
    apply_lora(root, list(LINEARS), rank=RANK, alpha=ALPHA, expert_adapter=args.adapter,
               dtype=torch.float32)
    experts = local_experts(pg)
    adapters = {}
    with torch.no_grad():
        for name in LINEARS:
            adapter = getattr(layer.experts, name).adapter
            a, b = factors[name]
            take = (lambda t: t[experts]) if args.adapter == "per_expert" else (lambda t: t[0])
            adapter.linear_in.weight.copy_(take(a))
            adapter.linear_out.weight.copy_(take(b))
            adapters[name] = adapter
    return root, adapters


def local_experts(pg) -> list:
    local = SIZES.experts // pg.ep.size()
    return list(range(pg.ep.rank() * local, (pg.ep.rank() + 1) * local))


def same_on_every_rank(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    return all(torch.equal(g, gathered[0]) for g in gathered)


def main():
    parser = base_parser(__doc__)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp > 1)")
    parser.add_argument("--adapter", choices=("shared", "per_expert"), default="shared")
    args = parser.parse_args()
    init_processes("cpu")
    if not torch.cuda.is_available():
        from support.cpu_support import HostStream, Patch, apply

        apply([Patch(torch.cuda, "current_stream", lambda *a, **k: HostStream(),
                     "Megatron's DDP (0.19) waits on the current CUDA stream's events before it "
                     "reduces gradients; on the CPU a host stream has none")])
    pg = init_parallel("cpu", tp=args.tp, ep=args.ep)
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from mcore_torch_experts import load_lora_state_dict, lora_sharded_state_dict, lora_state_dict

    world, rank = dist.get_world_size(), dist.get_rank()
    weights = GlobalWeights.make(SIZES, seed=4321)
    factors = global_factors(args.adapter, seed=11)
    root, adapters = build(args, pg, weights, factors)
    experts = local_experts(pg)
    params = {f"{name}.{factor}": module.weight for name, adapter in adapters.items()
              for factor, module in zip("AB", (adapter.linear_in, adapter.linear_out))}
    flags = {key: getattr(p, "allreduce", True) for key, p in params.items()}
    sequence_parallel = {key: getattr(p, "sequence_parallel", False) for key, p in params.items()}
    before = {key: p.detach().clone() for key, p in params.items()}

    ddp = DistributedDataParallel(root.config, DistributedDataParallelConfig(), root)
    xs, grads = global_inputs(world, SIZES, seed=7)
    out, _ = root.mlp(xs[rank].clone())
    out.backward(grads[rank])
    finalize_model_grads([ddp])   # DDP's sync, then the sequence-parallel sum over TP
    optimizer = torch.optim.SGD(list(params.values()), lr=LR)
    for p in params.values():
        p.grad = p.main_grad.clone()
    optimizer.step()

    # FP64 reference over every rank's tokens; DDP averages over the data-parallel ranks.
    dp_size = world // args.tp
    x64 = xs.reshape(-1, SIZES.hidden).double()
    leaves = {name: tuple(t.double().clone().requires_grad_(True) for t in pair)
              for name, pair in factors.items()}
    reference_layer(x64, weights, leaves).backward(grads.reshape(-1, SIZES.hidden).double())
    grad_errors, step_errors, identical = {}, {}, {}
    for name in LINEARS:
        for factor, leaf in zip("AB", leaves[name]):
            key = f"{name}.{factor}"
            want = (leaf.grad[experts] if args.adapter == "per_expert"
                    else leaf.grad[list(range(SIZES.experts))].sum(0)) / dp_size
            p = params[key]
            grad_errors[key] = rel_err(p.main_grad, want)
            step_errors[key] = rel_err(p.detach() - before[key], -LR * want)
            identical[key] = same_on_every_rank(p.detach())

    state = lora_state_dict(root)
    state_keys = sorted(state)
    state_shapes = {k: list(v.shape) for k, v in state.items()}

    # Distributed checkpoint of the adapters, loaded into a model with other adapter values.
    directory = os.path.join(args.out, "checkpoint")
    if rank == 0:
        os.makedirs(directory)
    dist.barrier()
    sharded = lora_sharded_state_dict(root)
    main_replica = {k: int(not any(v.replica_id) if isinstance(v.replica_id, tuple)
                           else v.replica_id == 0) for k, v in sharded.items()}
    counts = torch.tensor([main_replica[k] for k in sorted(main_replica)], dtype=torch.int64)
    dist.all_reduce(counts)
    main_replicas = dict(zip(sorted(main_replica), counts.tolist()))
    global_shapes = {k: list(v.global_shape) for k, v in sharded.items()}
    dist_checkpointing.save(sharded, directory)
    dist.barrier()
    fresh, fresh_adapters = build(args, pg, weights, global_factors(args.adapter, seed=99))
    differed = any(not torch.equal(p, state[k]) for k, p in lora_state_dict(fresh).items())
    loaded = dist_checkpointing.load(lora_sharded_state_dict(fresh), directory)
    load_lora_state_dict(fresh, loaded)
    reloaded = lora_state_dict(fresh)
    round_trip_equal = sorted(reloaded) == state_keys and all(
        torch.equal(reloaded[k], state[k]) for k in state_keys)
    reloaded_identical = {k: same_on_every_rank(v) for k, v in reloaded.items()}

    result = {"rank": rank, "adapter": args.adapter, "tp": args.tp, "allreduce": flags,
              "sequence_parallel": sequence_parallel,
              "grad_errors": grad_errors, "step_errors": step_errors,
              "identical_after_step": identical, "tolerance": TOLERANCE,
              "lora_state_dict_keys": state_keys, "lora_state_dict_shapes": state_shapes,
              "sharded_keys": sorted(sharded), "global_shapes": global_shapes,
              "main_replicas": main_replicas, "fresh_differed": differed,
              "round_trip_equal": round_trip_equal, "reloaded_identical": reloaded_identical,
              "local_experts": experts}
    write_result(args.out, result)
    if rank == 0:
        print(result)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
