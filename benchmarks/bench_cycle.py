"""One RL cycle of slices of real MoE models, as users run them: frozen BF16 base, LoRA, full
recompute; the experts as TEGroupedMLP (TE's default, and with TE's CUTLASS grouped GEMM) and as
TorchGroupedMLP.

A cycle is a logprob pass (eval, no grad) over N micro-batches, then an update pass over the same
data (train: forward + backward of a clipped policy-gradient loss per micro-batch, then one AdamW
step on the adapters). Slices: shapes.py; stacks, arms and adapters: cycle_models.py. With
Transformer Engine importable (and CUDA) the whole model comes from Megatron's TE specs; otherwise
from its local spec, where the SequentialMLP arm runs and the TE arms are reported as not
available.

The arms of a slice run interleaved (A, B, C, A, B, C, ...) for --warmup + --cycles rounds, so that
drift hits every arm alike; the table gives the median and the range. One arm's model is on the
device at a time: each turn builds its model afresh (the same frozen base from the same seed) and
restores the arm's adapters, optimizer state and last logprobs, kept on the host between turns
(`ParkedArm`), so a slice needs the memory of its largest arm, not of all of them. Peak
memory per phase is the arm's own: its resident tensors (weights, adapters, optimizer state) plus
the phase's peak above what was allocated when the phase began. An arm is each (experts module,
expert-adapter layout from --expert-adapters, adapter source from --adapters): `--arms
te,te-cutlass,torch --expert-adapters shared,per_expert --adapters ours,bridge` is twelve, each
built only for its own turns. A turn ends with the arm's model, optimizer state and logprobs
freed (an error names what still holds the model); the table gives the bytes still allocated
on the device after a turn ("allocated between turns": the data, no arm's).

With --profile (default on, slices of at most --profile-max-layers MoE layers), after the
measured rounds --profile-rounds interleaved rounds of one profiled update pass per arm, broken
down by component (cycle_profile.py; the breakdown table is the first pass's). From each pass
the MoE side of the update pass (cycle_profile.moe_side): the GPU time of the components from
the router to the combine -- router, permute/dispatch, expert GEMMs, expert activation, expert
adapters (the adapters on the expert linears; those on attention and the shared expert are
`adapters`), combine/unpermute and the MoE layer's own other ops ("MoE layer, rest") -- in the
forward and the backward (a backward kernel goes to the component whose forward op made its
autograd node), plus the MoE layer's share of the recompute forward: the recompute's ops are
split by the innermost `bench::<component>` range open around them (the forward hooks that open
the ranges fire again when the checkpoint re-runs the layer), and the MoE components' parts
count. Not in it: the shared expert, the latent projections, attention, norms and residuals, the
embedding, output layer and loss, the optimizer, gradient accumulation into the adapter leaves
(AccumulateGrad nodes belong to no module; `adapters`) and `other`. Divided by the expert-GEMM
kernel time: the device time of the GEMM kernels (by name, cycle_profile.GEMM_KERNEL) that ran
for the expert GEMMs component, forward, recompute and backward. The table gives per arm the
median (min–max) over the profiled passes of the MoE side ms, the GEMM kernel ms and the ratio
(per pass), whether the ratio is at most 1.5 in every pass, and the bound: the MoE side plus all
of `other` (device time no component claimed: kernels launched outside any recorded op, backward
nodes whose forward op the profile did not record), with the GEMM kernels found in `other` (TE's
input-gradient GEMMs have landed there), so a ratio that `other` could change shows as such.

Writes (cycle_report.py) results.md, results.json and one breakdown-<slice>-<layers>.png per
profiled slice to --out-dir.

Under torchrun (`--ep N`: expert parallelism N, every rank a data-parallel rank with its own
micro-batches) each rank holds experts / N of the slice's experts (shapes.ModelSlice.built_experts:
the Super-like slice keeps 128 per rank, the model's layout at EP4); per measured round each
phase's time is the slowest rank's, the peaks and the logprob differences are the highest of any
rank, tokens/s counts the tokens of every rank, the profile is rank 0's; an arm that fails on one
rank is dropped on all.

    python benchmarks/bench_cycle.py --out-dir runs/cycle                # one H200, TE stack
    python benchmarks/bench_cycle.py --slices nemotron-3-super:4 --expert-adapters shared,per_expert
    python benchmarks/bench_cycle.py --stack local --arms sequential,torch  # the old comparison
    torchrun --nproc-per-node 4 benchmarks/bench_cycle.py --ep 4           # EP=4, alltoall
    python benchmarks/bench_cycle.py --slices nemotron-3-super:4:3,qwen3-30b-a3b:16:3 \
        --expert-adapters shared,per_expert --adapters ours,bridge --profile-max-layers 16
    python benchmarks/bench_cycle.py --smoke                               # tiny, seconds (CI)
"""

import argparse
import gc
import os
import statistics
import time
import warnings
from pathlib import Path

import torch

import cycle_models as cm
import cycle_profile as cp
from cycle_passes import (
    Cycle,
    ParkedArm,
    add_batch_and_adapter_options,
    init_parallel,
    make_batches,
)
from cycle_report import run_lines, write_results
from harness import GIB, REPO_ROOT, Stopwatch, error_note, gather_ranks, header, reset_peak
from shapes import SLICES

PHASES = ("logprob", "update")
DEFAULT_ARMS = {"te": "te,te-cutlass,torch", "local": "sequential,torch,te,te-cutlass"}
DEFAULT_SLICES = {"te": "nemotron-3-super:4,qwen3-30b-a3b:4,qwen3-30b-a3b:16:3",
                  "local": "qwen3-30b-a3b:4:3"}


# --- the measured rounds (the arms and their passes: cycle_passes.py) ----------------------------

def timed_phase(cycle: Cycle, phase: str, device):
    """(ms, bytes above the allocation at the phase's start at its peak) of one phase."""
    with cycle.environment():
        start = reset_peak(device)
        watch = Stopwatch(device)
        cycle.logprob_pass() if phase == "logprob" else cycle.update_pass()
        ms = watch.stop().ms()
    extra = torch.cuda.max_memory_allocated(device) - start if device.type == "cuda" else None
    return ms, extra


def agreed(note):
    """The first failure note any rank has for a variant (None: it ran on every rank). Every
    rank drops a variant that failed on one, so that all go on with the same collectives."""
    return next((n for n in gather_ranks(note) if n), None)


def turn(arm: ParkedArm, work):
    """(work(cycle), None) for one turn of `arm`, or (None, the failure note); the arm is
    closed either way, after the failure's traceback (which holds the model) is dropped."""
    result, note = None, None
    try:
        result = work(arm.open())
    except cm.NotAvailable as exc:  # the table's note as it is
        note = str(exc)
    except Exception as exc:  # noqa: BLE001 - reported in the table, traceback on stderr
        note = error_note(exc)
    try:
        arm.close()
    except Exception as exc:  # noqa: BLE001 - a model left on the device is a failure too
        note = note or error_note(exc)
    return result, note


def variant_label(variant) -> str:
    arm, layout, adapters = variant
    return f"{arm} ({layout}, {adapters} adapters)"


def run_interleaved(arms: dict, args, device, log):
    """({variant: {phase: [ms], "resident": bytes, "peak": {phase: bytes}, "between_turns":
    bytes}} over the measured rounds and every rank (`over_ranks`), {variant: note} of those
    that failed); every round runs each variant's cycle once, in turn, its model built for the
    turn (`ParkedArm`); a variant that fails leaves the rounds, the others go on. Peaks: the
    arm's resident tensors plus the phase's largest extra (None on the CPU)."""
    runs = {v: {"logprob": [], "update": [], "extra": dict.fromkeys(PHASES, 0)} for v in arms}
    failed = {}
    rounds = args.warmup + args.cycles

    def one_round(cycle, variant, i):
        this = {}
        for phase in PHASES:
            this[phase], extra = timed_phase(cycle, phase, device)
            if i >= args.warmup:
                runs[variant][phase].append(this[phase])
                if extra is not None:
                    runs[variant]["extra"][phase] = max(runs[variant]["extra"][phase], extra)
        if device.type == "cuda":
            arms[variant].resident = cycle.resident_bytes()
        runs[variant]["expert_kernels"] = cp.expert_kernels(cycle.model)
        return this

    for i in range(rounds):
        for variant, arm in list(arms.items()):
            this, note = turn(arm, lambda cycle: one_round(cycle, variant, i))  # noqa: B023 - called at once
            note = agreed(note)
            if note:
                failed[variant] = note
                del arms[variant], runs[variant]
                continue
            warm = " (warm-up)" if i < args.warmup else ""
            log(f"round {i + 1}/{rounds}{warm} {variant_label(variant)}: "
                f"logprob {this['logprob']:.1f} ms, update {this['update']:.1f} ms (built and "
                f"restored in {arm.open_s:.1f} s)")
    for variant, run in runs.items():
        resident = arms[variant].resident if device.type == "cuda" else None
        run["resident"] = resident
        run["between_turns"] = arms[variant].between_turns
        run["peak"] = (None if resident is None else
                       {phase: resident + run["extra"][phase] for phase in PHASES})
    return over_ranks(runs), failed


def over_ranks(runs: dict) -> dict:
    """Every rank's runs as one: per measured round each phase's time on the slowest rank, the
    highest resident bytes and peaks of any rank (one process: its own), and the expert kernels
    any rank ran."""
    ranks = gather_ranks(runs)
    merged = {}
    for variant in runs:
        each = [rank[variant] for rank in ranks]
        merged[variant] = {phase: [max(ms) for ms in zip(*(run[phase] for run in each))]
                           for phase in PHASES}
        cuda = each[0]["resident"] is not None
        merged[variant]["resident"] = max(run["resident"] for run in each) if cuda else None
        merged[variant]["peak"] = ({phase: max(run["peak"][phase] for run in each)
                                    for phase in PHASES} if cuda else None)
        merged[variant]["between_turns"] = (max(run["between_turns"] for run in each)
                                            if cuda else None)
        merged[variant]["expert_kernels"] = sorted({k for run in each
                                                   for k in run["expert_kernels"]})
    return merged


def spread(values) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def variant_row(variant, run: dict, tokens: int) -> dict:
    arm, layout, adapters = variant
    cycles = [a + b for a, b in zip(run["logprob"], run["update"])]
    row = {"arm": arm, "layout": layout, "adapters": adapters, "module": cm.ARMS[arm],
           "logprob_ms": spread(run["logprob"]), "update_ms": spread(run["update"]),
           "cycle_ms": spread(cycles), "cycles_ms": cycles,
           "expert_kernels": run["expert_kernels"]}
    row["tokens_per_s"] = tokens / (row["cycle_ms"]["median"] / 1e3)
    if run["resident"] is not None:
        row["resident_gib"] = run["resident"] / GIB
        row.update({f"{phase}_peak_gib": run["peak"][phase] / GIB for phase in PHASES})
        row["peak_gib"] = max(row[f"{phase}_peak_gib"] for phase in PHASES)
        row["between_turns_gib"] = run["between_turns"] / GIB
    return row


def run_slice(key: str, layers: int, stack: str, arms, layouts, args, device, log) -> dict:
    """One slice: every (arm, expert-adapter layout, adapter source) built in turn (first
    logprobs compared with the first variant's), measured interleaved, then profiled in
    --profile-rounds interleaved rounds, one model on the device at a time (`ParkedArm`).
    Under torchrun every rank runs it; the figures are over all ranks (`over_ranks`), the
    profile rank 0's."""
    model = SLICES[key]
    config = cm.make_config(model, layers, stack, args, device)
    batches = make_batches(model, args, device)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    tokens = args.micro_batches * args.micro_batch_size * args.seq * world
    label = f"{model.label}, {layers} MoE layers" + (f", EP={args.ep}" if args.ep > 1 else "")
    result = {"slice": key, "layers": layers, "label": label,
              "header": cm.describe(model, layers, stack, args) + [
                  f"{args.cycles} measured rounds" + (
                      f"; {args.profile_rounds} profiled update pass(es) per arm, interleaved"
                      if args.profile else "; not profiled")],
              "rows": []}
    parked, notes, first, reference = {}, {}, {}, None
    variants = [(arm, layout, source) for source in args.adapters for layout in layouts
                for arm in arms]

    def builder(arm, layout, source):
        def build():
            with cm.arm_environment(arm):
                built = cm.build_arm(arm, model, layers, config, stack,
                                     argparse.Namespace(**{**vars(args), "adapters": source}),
                                     device, layout)
            return Cycle(arm, built, batches, stack, args, device)
        return build

    def first_logprobs(cycle):
        with cycle.environment():
            return [lp.float().cpu() for lp in cycle.logprob_pass()]

    for variant in variants:
        arm = variant[0]
        started = time.perf_counter()
        parked[variant] = ParkedArm(builder(*variant), device)
        why = cm.arm_unavailable(arm, stack, device)
        note = f"{why}" if why else None
        if not why:
            first[variant], note = turn(parked[variant], first_logprobs)
        note = agreed(note)
        if note:
            parked.pop(variant, None)
            notes[variant] = note
            if note.startswith("error"):
                log(f"{key}:{layers} {variant_label(variant)}: {note}")
            continue
        reference = reference or variant
        log(f"{key}:{layers} {variant_label(variant)}: built in "
            f"{time.perf_counter() - started:.1f} s")
    runs, failed = run_interleaved(parked, args, device, log)
    notes.update(failed)
    profiles = {variant: [] for variant in runs}
    profile_notes = {}
    for i in range(args.profile_rounds if args.profile else 0):
        for variant in list(profiles):
            update_ms = statistics.median(runs[variant]["update"])
            profile, note = turn(parked[variant], lambda cycle: cp.profile_update(
                cycle, update_ms, device))  # noqa: B023 - called at once
            note = agreed(note)  # every rank stops profiling the variant together
            if note:
                profile_notes[variant] = note
                del profiles[variant]
                continue
            profiles[variant].append(profile)
            log(f"{key}:{layers} {variant_label(variant)}: profiled ({i + 1}/"
                f"{args.profile_rounds})")
    for variant in variants:
        arm, layout, source = variant
        if variant in notes:
            result["rows"].append({"arm": arm, "layout": layout, "adapters": source,
                                   "module": cm.ARMS[arm], "note": notes[variant]})
            continue
        row = variant_row(variant, runs[variant], tokens)
        if layout == "per_expert" or "sequential" not in (arm, reference[0]):
            # SequentialMLP has one adapter per expert linear: like for like only then;
            # the largest of the ranks' mean differences
            row["logprob_diff"] = max(gather_ranks(statistics.mean(
                float((a - b).abs().mean()) for a, b in zip(first[variant], first[reference]))))
            row["logprob_diff_vs"] = (f"{cm.ARMS[reference[0]]} ({reference[1]}, "
                                      f"{reference[2]} adapters)")
        strayed = [p["expert_kernels"] for p in profiles.get(variant, [])
                   if p["expert_kernels"] != row["expert_kernels"]]
        if strayed:  # a profile of another path than the timed one would mislead
            row["profile_note"] = (f"the profiled pass ran the expert kernel(s) {strayed[0]}, "
                                   f"the timed rounds {row['expert_kernels']}")
        elif profiles.get(variant):
            row["profile"] = profiles[variant][0]
            row["moe_side"] = cp.moe_side_over_rounds(profiles[variant])
        elif variant in profile_notes:
            row["profile_note"] = profile_notes[variant]
        result["rows"].append(row)
    parked.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


# --- main ----------------------------------------------------------------------------------------

def parse_slices(text: str, parser) -> list:
    """[(model, MoE layers, measured rounds or None)] from "MODEL:LAYERS[:CYCLES],..."."""
    slices = []
    for item in text.split(","):
        key, layers, *cycles = item.split(":")
        if (key not in SLICES or not layers.isdigit() or int(layers) < 1 or len(cycles) > 1
                or not all(c.isdigit() and int(c) > 0 for c in cycles)):
            parser.error(f"--slices {item!r}: give MODEL:LAYERS or MODEL:LAYERS:CYCLES, MODEL "
                         f"from {list(SLICES)}")
        slices.append((key, int(layers), int(cycles[0]) if cycles else None))
    return slices


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "runs" / "cycle")
    parser.add_argument("--slices", default="auto",
                        help="comma-separated MODEL:MoE-LAYERS[:CYCLES] (CYCLES overrides "
                             f"--cycles for that slice), MODEL from {', '.join(SLICES)}; auto: "
                             f"{DEFAULT_SLICES['te']} on the TE stack, {DEFAULT_SLICES['local']} "
                             "on the local one")
    parser.add_argument("--stack", choices=["auto", "te", "local"], default="auto",
                        help="auto: te where Transformer Engine runs (importable, CUDA)")
    parser.add_argument("--arms", default="auto",
                        help=f"comma-separated, from {', '.join(cm.ARMS)}; auto: "
                             f"{DEFAULT_ARMS['te']} on the TE stack, {DEFAULT_ARMS['local']} "
                             "on the local one")
    parser.add_argument("--adapters", default="auto",
                        help="comma-separated from bridge (Megatron-Bridge's LoRA), ours "
                             "(apply_lora), auto (bridge when importable, else ours); each is "
                             "a variant of every arm and layout")
    parser.add_argument("--expert-adapters", default="shared",
                        help="comma-separated from shared, per_expert (each layout is a "
                             "variant of every arm)")
    parser.add_argument("--permute-fusion", action=argparse.BooleanOptionalAction, default=True,
                        help="TE's fused permute (TE stack only)")
    add_batch_and_adapter_options(parser, micro_batches=4)
    parser.add_argument("--dispatcher", choices=["alltoall", "allgather"], default="alltoall")
    parser.add_argument("--ep", type=int, default=1, help="expert parallelism (under torchrun)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up rounds")
    parser.add_argument("--cycles", type=int, default=5, help="measured rounds")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                        help="break one update pass of every arm down by component")
    parser.add_argument("--profile-rounds", type=int, default=3,
                        help="profiled update passes per arm (interleaved rounds after the "
                             "measured ones): the MoE side's median and range are over these")
    parser.add_argument("--profile-max-layers", type=int, default=8,
                        help="profile only slices of at most this many MoE layers (parsing a "
                             "16-layer TE profile takes minutes)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny slices (and the tiny hybrid on the TE stack), seq 32, 2 "
                             "micro-batches of 2, 2 measured rounds, per-expert adapters, rank "
                             "8 (options given beside it win); on the GPU when there is one (the "
                             "TE arms too), else on the CPU (allgather dispatcher)")
    if parser.parse_known_args()[0].smoke:  # the smoke's sizes as defaults: what is given wins
        parser.set_defaults(seq=32, micro_batch_size=2, micro_batches=2, rank=8, warmup=1,
                            cycles=2, expert_adapters="per_expert", profile_rounds=2)
        if not torch.cuda.is_available():
            parser.set_defaults(dispatcher="allgather")  # alltoall needs CUDA streams
            torch.set_num_threads(1)
    args = parser.parse_args()
    layouts = args.expert_adapters.split(",")
    if set(layouts) - set(cm.EXPERT_ADAPTERS) or not layouts:
        parser.error(f"--expert-adapters {args.expert_adapters!r}: choose from "
                     f"{', '.join(cm.EXPERT_ADAPTERS)}")
    sources = args.adapters.split(",")
    if set(sources) - {"auto", "bridge", "ours"} or len(set(sources)) < len(sources):
        parser.error(f"--adapters {args.adapters!r}: comma-separated, each once, from auto, "
                     "bridge, ours")
    if args.profile_rounds < 1:
        parser.error(f"--profile-rounds {args.profile_rounds}: give 1 or more (--no-profile "
                     "profiles nothing)")
    return parser, args, layouts


def main():
    parser, args, layouts = parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) \
        if torch.cuda.is_available() else torch.device("cpu")
    stack = cm.pick_stack(args.stack, device)
    arms = (DEFAULT_ARMS[stack] if args.arms == "auto" else args.arms).split(",")
    if set(arms) - set(cm.ARMS):
        parser.error(f"unknown arms {sorted(set(arms) - set(cm.ARMS))}; choose from "
                     f"{list(cm.ARMS)}")
    if args.slices == "auto":
        smoke_slices = "tiny:2,tiny-hybrid:1" if stack == "te" else "tiny:2"
        args.slices = smoke_slices if args.smoke else DEFAULT_SLICES[stack]
    slices = parse_slices(args.slices, parser)
    args.adapters = list(dict.fromkeys(cm.adapter_source(a) for a in args.adapters.split(",")))
    for noise in (".*Transformer Engine and Apex are not installed.*", "full scope is deprecated"):
        warnings.filterwarnings("ignore", message=noise)

    init_parallel(args.ep, device)
    if "bridge" in args.adapters:
        cm.import_bridge_peft()  # here, before any arm's model is on the stack
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    lines_header = header(device, packages=("triton", "megatron-core", "transformer-engine",
                                            "megatron-bridge")) + run_lines(args, world)
    started = time.perf_counter()

    def log(message):
        if rank0:
            print(f"[cycle] [{time.perf_counter() - started:5.0f} s] {message}", flush=True)

    if rank0:
        print("\n".join(f"[cycle] {line}" for line in lines_header), flush=True)
    results = []
    for key, layers, cycles in slices:
        log(f"slice {key}:{layers} on the {stack} stack")
        this = argparse.Namespace(**{**vars(args), "cycles": cycles or args.cycles,
                                     "profile": args.profile and layers <= args.profile_max_layers})
        try:
            results.append(run_slice(key, layers, stack, arms, layouts, this, device, log))
        except Exception as exc:  # noqa: BLE001 - the other slices still run
            results.append({"slice": key, "layers": layers, "label": f"{key}, {layers} MoE layers",
                            "header": [f"slice failed: {error_note(exc)}"], "rows": []})
        if rank0:  # after every slice: a run cut short still leaves the slices it finished
            text, written = write_results(args, lines_header, results)
    if rank0:
        print(text, flush=True)
        log(f"wrote {', '.join(written)} to {args.out_dir}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
