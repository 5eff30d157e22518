"""What megatron-core 0.20's batch-invariant mode costs a whole RL cycle with TorchGroupedMLP
experts, and whether it keeps a sequence's logprobs the same alone and inside its micro-batch.

A model slice (shapes.py; default the Qwen3-30B-A3B slice, 4 MoE layers) from Megatron's TE specs,
LoRA on attention and experts (cycle_models.add_adapters), full recompute; the cycle of
bench_cycle.py (cycle_passes.Cycle: a logprob pass over the micro-batches, then an update pass),
timed per arm, the arms interleaved round by round:

- "ours, mode off": TorchGroupedMLP with Megatron's combine, TE's fused permute, TE's own choice of
  attention kernel (what a run without the mode uses);
- "ours, mode on, FP32 Triton combine" and "ours, mode on, Megatron's combine":
  `batch_invariant_mode=True` (FlashAttention 3 or 4, no permute fusion, alltoall dispatcher) and
  `set_batch_invariant_mode(True, backend="triton")` around the arm's passes;
- "TEGroupedMLP, mode off", and "TEGroupedMLP, mode on" where Megatron can build it (DeepGEMM's
  BF16 grouped GEMM importable; else the row says why not).

Each arm's logprob pass is also checked: the first sequence's logprobs computed alone against the
same sequence inside its micro-batch (max difference; 0 is bitwise). The attention env variables
Megatron sets when it builds a model (NVTE_FLASH_ATTN, NVTE_FUSED_ATTN, ...) are the arm's own,
set around its passes, and TE's cached attention-backend choice is dropped at each switch.

    python3 benchmarks/batch_invariant_cycle_cost.py --out-dir OUT [--slice qwen3-30b-a3b:4]
        [--rounds 3] [--seq 4096 --micro-batch-size 2 --micro-batches 2] [--profile]

With --profile, after the rounds, one update pass of each of our arms runs under torch.profiler and
the report lists its 12 costliest GPU kernels (where the mode's cost goes).

Needs a CUDA GPU, megatron-core 0.20, Transformer Engine and FlashAttention 3 or 4.
"""

import argparse
import contextlib
import dataclasses
import gc
import statistics
import sys
from pathlib import Path

import torch

import cycle_models as cm
import cycle_passes as passes
import harness
from shapes import SLICES
from support.batch_invariance import (
    attention_env,
    flash_attention_version,
    whole_model_mode_missing,
)

ARMS = {  # arm: (experts backend, mode on, FP32 Triton combine)
    "ours, mode off": ("torch", False, False),
    "ours, mode on, FP32 Triton combine": ("torch", True, True),
    "ours, mode on, Megatron's combine": ("torch", True, False),
    "TEGroupedMLP, mode off": ("transformer_engine", False, False),
    "TEGroupedMLP, mode on": ("transformer_engine", True, False),
}


def arm_config(base, arm: str, flash: int):
    from megatron.core.transformer.enums import AttnBackend

    backend, mode, fp32_combine = ARMS[arm]
    fields = dict(moe_expert_gemm_backend=backend)
    if mode:
        fields.update(batch_invariant_mode=True, attention_backend=AttnBackend.flash,
                      flash_attention_version=flash, moe_permute_fusion=False,
                      moe_token_dispatcher_type="alltoall")
    if fp32_combine:
        fields.update(moe_combine_in_fp32=True, moe_combine_backend="triton")
    return dataclasses.replace(base, **fields)


class Arm:
    """One arm's model and cycle, built with the attention env cleared; the env Megatron set while
    building it is kept and set again around the arm's passes."""

    def __init__(self, name, model_slice, layers, base_config, args, device, batches, flash):
        from mcore_torch_experts import convert_moe_layers_to_fp32_combine

        self.name, self.mode = name, ARMS[name][1]
        with attention_env() as self.env:
            config = arm_config(base_config, name, flash)
            model = cm.build_base(model_slice, layers, config, "te", args, device)
        if ARMS[name][2]:
            convert_moe_layers_to_fp32_combine(model)
        cm.add_adapters(model, args, "shared")
        cm.fill_adapters(model, args.seed)
        self.cycle = passes.Cycle("torch" if ARMS[name][0] == "torch" else "te", model, batches,
                                  "te", args, device)

    def __enter__(self):
        from megatron.core.transformer.custom_layers.batch_invariant_kernels import (
            set_batch_invariant_mode,
        )

        self.contexts = contextlib.ExitStack()
        self.contexts.enter_context(attention_env(self.env))   # TE chooses again under it
        self.contexts.enter_context(set_batch_invariant_mode(self.mode, backend="triton"))
        return self.cycle

    def __exit__(self, *exc):
        self.contexts.close()

    def alone_vs_batched(self) -> float:
        """max |logprobs of sequence 0 alone - the same inside micro-batch 0|."""
        tokens, labels, _ = self.cycle.batches[0]
        cycle = self.cycle
        cycle.model.eval()
        with torch.no_grad():
            batched = cycle.logprobs(tokens, labels)[0]
            positions = cycle.positions
            cycle.positions = positions[:1]
            try:
                alone = cycle.logprobs(tokens[:1], labels[:1])[0]
            finally:
                cycle.positions = positions
        return (batched.float() - alone.float()).abs().max().item()


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--slice", default="qwen3-30b-a3b:4", help="MODEL:MoE LAYERS")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up)")
    parser.add_argument("--profile", action="store_true",
                        help="list the costliest GPU kernels of one update pass per arm of ours")
    passes.add_batch_and_adapter_options(parser, micro_batches=2)
    parser.set_defaults(micro_batch_size=2)
    return parser


def top_kernels(arm: Arm, rows: int = 12) -> str:
    """The arm's costliest GPU kernels over one update pass, as torch.profiler's table."""
    from torch.profiler import ProfilerActivity, profile

    with arm as cycle:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            cycle.update_pass()
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)


def run_line(model_slice, layers: int, args, flash: int) -> str:
    """The report's line saying what ran."""
    return (f"{model_slice.label}, {layers} MoE layers; {args.micro_batches} micro-batches "
            f"of {args.micro_batch_size} x {args.seq} tokens; our shared LoRA rank "
            f"{args.rank}; full recompute; FlashAttention {flash} in the mode; "
            f"{args.rounds} measured rounds after one warm-up, arms interleaved")


def main() -> int:
    parser = make_parser()
    args = parser.parse_args()
    key, _, layers = args.slice.partition(":")
    if key not in SLICES or not layers.isdigit() or int(layers) < 1:
        parser.error(f"--slice {args.slice!r}: give MODEL:LAYERS, MODEL from {list(SLICES)}")
    if args.rounds < 1 or args.micro_batches < 1 or args.micro_batch_size < 2:
        parser.error("--rounds and --micro-batches must be at least 1, --micro-batch-size 2")
    if not torch.cuda.is_available() or not cm.te_importable():
        parser.error("needs a CUDA GPU and Transformer Engine (the mode's kernels and TE specs)")
    missing = whole_model_mode_missing()
    if missing:
        parser.error(missing)
    from megatron.core.transformer.custom_layers.batch_invariant_kernels import HAVE_DEEPGEMM_BF16

    flash = flash_attention_version()
    args.adapters, args.ep, args.dispatcher = "ours", 1, "alltoall"
    args.expert_kernel, args.permute_fusion = "auto", True
    device = torch.device("cuda", torch.cuda.current_device())
    passes.init_parallel(1, device)
    model_slice, layers = SLICES[key], int(layers)
    base = cm.make_config(model_slice, layers, "te", args, device)
    batches = passes.make_batches(model_slice, args, device)
    arms, notes = {}, {}
    for name in ARMS:
        if name == "TEGroupedMLP, mode on" and not HAVE_DEEPGEMM_BF16:
            notes[name] = ("not available: Megatron's experts in the mode need DeepGEMM's BF16 "
                           "grouped GEMM, not importable here")
            continue
        try:
            arms[name] = Arm(name, model_slice, layers, base, args, device, batches, flash)
        except Exception as exc:  # noqa: BLE001 - the report says why
            notes[name] = f"not available: {harness.error_note(exc)}"
    times = {(name, phase): [] for name in arms for phase in ("logprob", "update")}
    invariance = {}
    for round_ in range(args.rounds + 1):
        for name, arm in arms.items():
            with arm as cycle:
                logprob_ms, _ = harness.median_ms(cycle.logprob_pass, device, 0, 1)
                update_ms, _ = harness.median_ms(cycle.update_pass, device, 0, 1)
                if round_ == 0:
                    invariance[name] = arm.alone_vs_batched()
            if round_:
                times[(name, "logprob")].append(logprob_ms)
                times[(name, "update")].append(update_ms)
        print(f"round {round_}/{args.rounds} done", flush=True)
    profiles = {name: top_kernels(arm) for name, arm in arms.items()
                if args.profile and ARMS[name][0] == "torch"}
    reference = "ours, mode off"
    rows = []
    for name in ARMS:
        if name not in arms:
            rows.append([name, notes[name], "", "", "", ""])
            continue
        cycle = [a + b for a, b in zip(times[(name, "logprob")], times[(name, "update")])]
        base_cycle = [a + b for a, b in zip(times[(reference, "logprob")],
                                            times[(reference, "update")])]
        ratios = [c / b for c, b in zip(cycle, base_cycle)]
        rows.append([name] + [f"{statistics.median(v):.1f} ({min(v):.1f}–{max(v):.1f})" for v in
                              (times[(name, "logprob")], times[(name, "update")], cycle)]
                    + [f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})",
                       f"{invariance[name]:.3g}"])
    header = harness.header(device, packages=("triton", "megatron-core", "transformer-engine",
                                              "flash-attn-4"))
    header.append(run_line(model_slice, layers, args, flash))
    body = harness.markdown_table(
        ["arm", "logprob pass ms", "update pass ms", "cycle ms", "x ours mode off",
         "max |logprob alone - in its micro-batch|"], rows)
    for name, table in profiles.items():
        body += ["", f"## One update pass, {name}: costliest GPU kernels", "", "```", table, "```"]
    print(harness.write_report(args.out_dir, "batch_invariant_cycle_cost",
                               "What the batch-invariant mode costs an RL cycle", header, body,
                               {"times": {f"{a} | {p}": v for (a, p), v in times.items()},
                                "alone_vs_batched": invariance, "notes": notes}))
    arms.clear()
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
