"""torchrun worker (2 processes): Megatron distributed checkpoints of a full MoE layer load both
ways between SequentialMLP and TorchGroupedMLP experts, across EP/ETP layouts (resharding).

Each source layer holds the global weights' shards for its layout and is saved with
megatron.core.dist_checkpointing (which validates that the shards tile every global tensor exactly
once); each target layer, zeroed first, loads it under another layout with every mismatched key
reported (StrictHandling.RETURN_ALL) and then `load_state_dict(strict=True)`. Each rank writes
`OUT/rank{R}.json`; the exit status is non-zero on any failure.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests/distributed/checkpoint_roundtrip.py --out /tmp/ckpt [--device cuda]
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from _common import (GlobalWeights, Sizes, base_parser, expert_weight_params, init_parallel,
                     init_processes, install, moe_config, moe_layer, write_result)

PREFIX = "decoder.layers.0.mlp."
LAYOUTS = {"ep2": dict(ep=2, etp=1), "etp2": dict(ep=1, etp=2), "ep1": dict(ep=1, etp=1)}
BACKENDS = {"sequential": "transformer_engine", "torch": "torch"}
# (source experts, source layout) -> [(target experts, target layout)]
ROUND_TRIPS = {
    ("sequential", "ep2"): [("torch", "ep2"), ("torch", "etp2"), ("torch", "ep1")],
    ("torch", "etp2"): [("sequential", "ep2"), ("sequential", "ep1")],
    ("torch", "ep2"): [("sequential", "etp2")],
    ("torch", "ep1"): [("sequential", "etp2")],  # saved by two expert-data-parallel replicas
}
# Without GLU (no gate/up split of fc1) both directions once, through expert-tensor sharding.
PLAIN_ROUND_TRIPS = {("sequential", "ep2"): [("torch", "etp2")],
                     ("torch", "etp2"): [("sequential", "ep2")]}


def build(args, device, experts, layout, sizes):
    pg = init_parallel(args.device, **LAYOUTS[layout])
    config = moe_config(BACKENDS[experts], sizes, args.device, **LAYOUTS[layout])
    return moe_layer(config, pg, device), pg


def save(args, device, experts, layout, sizes, directory):
    from megatron.core import dist_checkpointing

    layer, pg = build(args, device, experts, layout, sizes)
    install(layer, GlobalWeights.make(sizes), pg, sizes.glu)
    if dist.get_rank() == 0:
        os.makedirs(directory)
    dist.barrier()
    dist_checkpointing.save(layer.sharded_state_dict(prefix=PREFIX), directory)


def load(args, device, experts, layout, sizes, directory):
    """Load into a zeroed target; return what a test needs to judge it."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    layer, pg = build(args, device, experts, layout, sizes)
    with torch.no_grad():
        for p in layer.parameters():
            p.zero_()
    loaded, missing, unexpected = dist_checkpointing.load(
        layer.sharded_state_dict(prefix=PREFIX), directory, strict=StrictHandling.RETURN_ALL)
    layer.load_state_dict({k[len(PREFIX):]: v for k, v in loaded.items()}, strict=True)

    weights = GlobalWeights.make(sizes)
    local = expert_weight_params(layer.experts)
    shards = weights.local_shards(pg, sizes.glu)
    equal = torch.equal(layer.router.weight.cpu(), weights.router) and all(
        torch.equal(w.cpu(), s) for pair, shard in zip(local, shards) for w, s in zip(pair, shard))
    views = None
    if experts == "torch":  # the Parameters still view the packed buffer that forward uses
        views = all(getattr(layer.experts, fc).packed_weight[i].data_ptr() == pair[k].data_ptr()
                    for i, pair in enumerate(local)
                    for k, fc in enumerate(("linear_fc1", "linear_fc2")))
    return dict(missing=sorted(missing), unexpected=sorted(unexpected), weights_equal=equal,
                packed_views=views, local_experts=len(local))


def main():
    parser = base_parser(__doc__.splitlines()[0])
    args = parser.parse_args()
    device = init_processes(args.device)
    rows = []
    for glu in (True, False):
        sizes = Sizes(glu=glu)
        for (source, source_layout), targets in (ROUND_TRIPS if glu else PLAIN_ROUND_TRIPS).items():
            name = f"ckpt_{'glu' if glu else 'plain'}_{source}_{source_layout}"
            directory = os.path.join(args.out, name)
            start = time.monotonic()
            save(args, device, source, source_layout, sizes, directory)
            for target, target_layout in targets:
                row = load(args, device, target, target_layout, sizes, directory)
                rows.append(dict(glu=glu, source=f"{source}@{source_layout}",
                                 target=f"{target}@{target_layout}", **row,
                                 seconds=round(time.monotonic() - start, 2)))
                start = time.monotonic()
    result = dict(rank=dist.get_rank(), round_trips=rows)
    write_result(args.out, result)

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    problems = [f"rank {r['rank']} {row['source']} -> {row['target']} (glu={row['glu']}): {row}"
                for r in gathered for row in r["round_trips"]
                if row["missing"] or row["unexpected"] or not row["weights_equal"]
                or row["packed_views"] is False]
    if dist.get_rank() == 0:
        for row in rows:
            print(f"{'SwiGLU' if row['glu'] else 'plain':<7} {row['source']:<16} -> "
                  f"{row['target']:<16} missing={len(row['missing'])} "
                  f"unexpected={len(row['unexpected'])} weights_equal={row['weights_equal']} "
                  f"({row['seconds']:.1f} s)")
        print("\n".join(["FAILED:", *problems]) if problems else "checkpoints: all checks passed",
              flush=True)
    dist.destroy_process_group()
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
