"""torchrun worker (2 processes): Megatron distributed checkpoints of a full MoE layer load both
ways between SequentialMLP and TorchGroupedMLP experts, across EP/ETP layouts (resharding); where
Transformer Engine runs (importable, --device cuda), TEGroupedMLP -> TorchGroupedMLP ->
TEGroupedMLP through torch_dist checkpoints, across layouts, in the TE spec's layers (elsewhere
reported as skipped, with the reason).

Each source layer holds the global weights' shards for its layout and is saved with
megatron.core.dist_checkpointing (which validates that the shards tile every global tensor exactly
once); each target layer, zeroed first, loads it under another layout with every mismatched key
reported (StrictHandling.RETURN_ALL) and then `load_state_dict(strict=True)`. In a chain each
target is saved in turn, and the next one loads that. Each rank writes `OUT/rank{R}.json`; the
exit status is non-zero on any failure.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests/distributed/checkpoint_roundtrip.py --out /tmp/ckpt [--device cuda]
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from _common import (
    GlobalWeights,
    Sizes,
    base_parser,
    expert_weight_params,
    experts_layer,
    init_parallel,
    init_processes,
    install,
    te_unavailable,
    write_result,
)

PREFIX = "decoder.layers.0.mlp."
LAYOUTS = {"ep2": dict(ep=2, etp=1), "etp2": dict(ep=1, etp=2), "ep1": dict(ep=1, etp=1)}
# (source experts, source layout) -> [(target experts, target layout)]; experts: _common.EXPERTS
ROUND_TRIPS = {
    ("sequential", "ep2"): [("torch", "ep2"), ("torch", "etp2"), ("torch", "ep1")],
    ("torch", "etp2"): [("sequential", "ep2"), ("sequential", "ep1")],
    ("torch", "ep2"): [("sequential", "etp2")],
    ("torch", "ep1"): [("sequential", "etp2")],  # saved by two expert-data-parallel replicas
}
# Without GLU (no gate/up split of fc1) both directions once, through expert-tensor sharding.
PLAIN_ROUND_TRIPS = {("sequential", "ep2"): [("torch", "etp2")],
                     ("torch", "etp2"): [("sequential", "ep2")]}
# TEGroupedMLP -> TorchGroupedMLP -> TEGroupedMLP, by GLU: every step another layout.
TE_CHAINS = {True: [("te", "ep2"), ("torch-te", "etp2"), ("te", "ep1")],
             False: [("te", "etp2"), ("torch-te", "ep2"), ("te", "etp2")]}


def build(args, device, experts, layout, sizes):
    pg = init_parallel(args.device, **LAYOUTS[layout])
    return experts_layer(experts, sizes, pg, device, **LAYOUTS[layout]), pg


def save(layer, directory):
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(directory)
    dist.barrier()
    dist_checkpointing.save(layer.sharded_state_dict(prefix=PREFIX), directory)


def save_source(args, device, experts, layout, sizes, directory):
    """A layer holding the global weights' shards for `layout`, saved to `directory`."""
    layer, pg = build(args, device, experts, layout, sizes)
    install(layer, GlobalWeights.make(sizes), pg, sizes.glu)
    save(layer, directory)


def load(args, device, experts, layout, sizes, directory):
    """Load into a zeroed target: (what a test needs to judge it, the loaded layer)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from mcore_torch_experts import TorchGroupedMLP

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
    if isinstance(layer.experts, TorchGroupedMLP):  # the Parameters still view the packed buffer
        views = all(getattr(layer.experts, fc).packed_weight[i].data_ptr() == pair[k].data_ptr()
                    for i, pair in enumerate(local)
                    for k, fc in enumerate(("linear_fc1", "linear_fc2")))
    return dict(missing=sorted(missing), unexpected=sorted(unexpected), weights_equal=equal,
                packed_views=views, local_experts=len(local)), layer


def round_trips(args, device) -> list:
    """Every source of ROUND_TRIPS (PLAIN_ROUND_TRIPS without GLU) saved once, loaded by each of
    its targets."""
    rows = []
    for glu in (True, False):
        sizes = Sizes(glu=glu)
        for (source, source_layout), targets in (ROUND_TRIPS if glu else PLAIN_ROUND_TRIPS).items():
            directory = os.path.join(args.out, f"ckpt_{'glu' if glu else 'plain'}_{source}_"
                                               f"{source_layout}")
            start = time.monotonic()
            save_source(args, device, source, source_layout, sizes, directory)
            for target, target_layout in targets:
                row, _ = load(args, device, target, target_layout, sizes, directory)
                rows.append(dict(glu=glu, source=f"{source}@{source_layout}",
                                 target=f"{target}@{target_layout}", **row,
                                 seconds=round(time.monotonic() - start, 2)))
                start = time.monotonic()
    return rows


def te_chains(args, device) -> list:
    """TE_CHAINS: the first layer saved, each next one loads the last checkpoint and (but the
    last) is saved in turn."""
    rows = []
    for glu, chain in TE_CHAINS.items():
        sizes = Sizes(glu=glu)
        name = os.path.join(args.out, f"ckpt_{'glu' if glu else 'plain'}_te_chain")
        start = time.monotonic()
        save_source(args, device, *chain[0], sizes, f"{name}0")
        for step, (target, target_layout) in enumerate(chain[1:], 1):
            row, layer = load(args, device, target, target_layout, sizes, f"{name}{step - 1}")
            source, source_layout = chain[step - 1]
            rows.append(dict(glu=glu, source=f"{source}@{source_layout}",
                             target=f"{target}@{target_layout}", **row,
                             seconds=round(time.monotonic() - start, 2)))
            if step < len(chain) - 1:
                save(layer, f"{name}{step}")
            start = time.monotonic()
    return rows


def main():
    parser = base_parser(__doc__.splitlines()[0])
    args = parser.parse_args()
    device = init_processes(args.device)
    te_skipped = te_unavailable(args.device)
    result = dict(rank=dist.get_rank(), round_trips=round_trips(args, device),
                  te_round_trips=[] if te_skipped else te_chains(args, device),
                  te_skipped=te_skipped)
    write_result(args.out, result)

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    problems = [f"rank {r['rank']} {row['source']} -> {row['target']} (glu={row['glu']}): {row}"
                for r in gathered for row in r["round_trips"] + r["te_round_trips"]
                if row["missing"] or row["unexpected"] or not row["weights_equal"]
                or row["packed_views"] is False]
    if dist.get_rank() == 0:
        for row in result["round_trips"] + result["te_round_trips"]:
            print(f"{'SwiGLU' if row['glu'] else 'plain':<7} {row['source']:<16} -> "
                  f"{row['target']:<16} missing={len(row['missing'])} "
                  f"unexpected={len(row['unexpected'])} weights_equal={row['weights_equal']} "
                  f"({row['seconds']:.1f} s)")
        if te_skipped:
            print(f"TEGroupedMLP round trips skipped: {te_skipped}")
        print("\n".join(["FAILED:", *problems]) if problems else "checkpoints: all checks passed",
              flush=True)
    dist.destroy_process_group()
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
