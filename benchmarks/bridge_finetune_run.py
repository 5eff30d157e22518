"""Megatron-Bridge's own `finetune()` on the GPU with the provider settings docs/enable.md gives
(`provider.transformer_layer_spec = torch_experts_gpt_spec`, `moe_grouped_gemm = True`) and
Bridge's LoRA on linear_qkv, linear_proj, linear_fc1 and linear_fc2, against the same run with
Bridge's stock spec (TEGroupedMLP experts). The flow of Bridge's own LoRA tests: a stock pretrain
saves a torch_dist checkpoint (every weight training, TEGroupedMLP); each arm finetunes from it;
ours also stops half-way, saves (Bridge's adapter-only checkpoint) and resumes from its save.
Checks: the resumed run's losses equal those of the uninterrupted run (the adapters, optimizer
and scheduler came back), our losses follow TEGroupedMLP's, only adapters train. Prints and
writes a table: ms per iteration (median and range), tokens/s, losses.

    python3 benchmarks/bridge_finetune_run.py --out-dir OUT [--iters 12] [--expert-adapters shared]

One torchrun per phase (`--phase NAME` runs it in the worker), each leaving its record in OUT
(PHASE.json, PHASE.log); `--from-results` rebuilds the report from them. scripts/gpu_client_routes.sh
runs this where Bridge and what its training modules import (nvidia-resiliency-ext) are installed.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import harness

# The Qwen3-30B-A3B-like slice of benchmarks/megatron_lm_run.py: 4 layers, 128 experts of 768
# (SwiGLU), top-8, GQA 32/4 heads; 4 sequences of 4096 tokens per iteration.
SLICE = dict(num_layers=4, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
             kv_channels=128, ffn_hidden_size=6144, num_moe_experts=128, moe_ffn_hidden_size=768,
             moe_router_topk=8, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True,
             moe_aux_loss_coeff=1e-3, normalization="RMSNorm", gated_linear_unit=True,
             add_bias_linear=False, qk_layernorm=True, position_embedding_type="rope",
             rotary_base=1_000_000, share_embeddings_and_output_weights=False,
             hidden_dropout=0.0, attention_dropout=0.0, vocab_size=32768,
             make_vocab_size_divisible_by=128, seq_length=4096,
             # Megatron's gradient-accumulation fusion needs APEX's CUDA extension, which the
             # H200 image lacks (every arm fails without it, the stock one too; Megatron-LM's
             # route passes --no-gradient-accumulation-fusion for the same reason).
             gradient_accumulation_fusion=False)
SEQUENCES, MICRO_BATCH = 4, 1
PHASES = {
    # name: (experts, train_iters, what it loads, where it saves)
    "pretrain": ("te", 1, None, "pretrained"),
    "te": ("te", None, None, None),
    "te-cutlass": ("te", None, None, None),   # with NVTE_USE_CUTLASS_GROUPED_GEMM=1
    "torch": ("torch", None, None, None),
    "torch-first-half": ("torch", "half", None, "lora_split"),
    "torch-resumed": ("torch", None, "lora_split", "lora_split"),
}
ARM_NAMES = {"te": "stock", "te-cutlass": "stock, NVTE_USE_CUTLASS_GROUPED_GEMM=1",
             "torch": "ours"}


def config(phase: str, out: Path, iters: int, expert_adapters: str):
    """Bridge's ConfigContainer for one phase, built as Bridge's own LoRA tests build theirs."""
    import torch.nn.functional as F
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.peft.lora import LoRA

    from support.bridge_finetune import Phase, Schedule, finetune_config

    experts, train_iters, load, save = PHASES[phase]
    train_iters = {None: iters, "half": iters // 2}.get(train_iters, train_iters)
    provider = GPTModelProvider(**SLICE, activation_func=F.silu)
    if experts == "torch":   # docs/enable.md, "Megatron-Bridge"
        from mcore_torch_experts.specs import torch_experts_gpt_spec

        provider.transformer_layer_spec = torch_experts_gpt_spec
        provider.moe_grouped_gemm = True
    finetuning = phase != "pretrain"
    schedule = Schedule(lr=1e-4 if finetuning else 1e-5, min_lr=1e-6, warmup_iters=2,
                        decay_iters=iters, global_batch_size=SEQUENCES,
                        micro_batch_size=MICRO_BATCH, distributed_optimizer=True)
    lora = LoRA(target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                dim=16, alpha=32, share_expert_adapters=expert_adapters == "shared")
    return finetune_config(provider, Phase(train_iters, load, save, finetuning), schedule, out,
                           peft=lora)


def worker(phase: str, out: Path, iters: int, expert_adapters: str) -> None:
    """One phase under torchrun: Bridge's finetune() (pretrain() for the stock pretrain) with a
    callback that records each step's time and loss and what the model trains."""
    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.finetune import finetune
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    class Record(Callback):
        def __init__(self):
            self.steps, self.model = [], {}

        def on_train_start(self, context):
            named = [(n, p) for chunk in context.model for n, p in chunk.named_parameters()]
            trained = [n for n, p in named if p.requires_grad]
            experts = sorted({type(m).__name__ for chunk in context.model for m in chunk.modules()
                              if type(m).__name__ in ("TorchGroupedMLP", "TEGroupedMLP")})
            self.model = dict(
                experts=experts, parameters=len(named), trained=len(trained),
                trained_non_adapter=[n for n in trained if "adapter" not in n][:5],
                expert_weights_trained=sum(1 for n, p in named if ".experts." in n
                                           and "adapter" not in n and p.requires_grad))

        def on_train_step_start(self, context):
            torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_train_step_end(self, context):
            torch.cuda.synchronize()
            loss = context.loss_dict.get("lm loss") if context.loss_dict else None
            self.steps.append(dict(step=context.state.train_state.step,
                                   ms=(time.perf_counter() - self.start) * 1e3,
                                   loss=None if loss is None else float(loss)))

    record = Record()
    cfg = config(phase, out, iters, expert_adapters)
    (pretrain if phase == "pretrain" else finetune)(cfg, forward_step, callbacks=[record])
    if int(os.environ["RANK"]) == 0:   # Bridge's training entry destroys the process group
        (out / f"{phase}.json").write_text(json.dumps(dict(
            model=record.model, steps=record.steps,
            peak_gib=torch.cuda.max_memory_allocated() / 2**30)))


def run_phase(phase: str, out: Path, args) -> dict:
    env = dict(os.environ)
    if phase == "te-cutlass":
        env["NVTE_USE_CUTLASS_GROUPED_GEMM"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(harness.REPO_ROOT), str(Path(__file__).parent),
                                         env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
               "--master-port", str(harness.free_port()), __file__, "--phase", phase,
               "--out-dir", str(out), "--iters", str(args.iters),
               "--expert-adapters", args.expert_adapters]
    start = time.time()
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    log = run.stdout + run.stderr
    (out / f"{phase}.log").write_text(" ".join(command) + "\n\n" + log)
    print(f"[bridge finetune] {phase}: exit {run.returncode} in {time.time() - start:.0f} s",
          flush=True)
    if run.returncode != 0:
        raise RuntimeError(f"{phase}: exit {run.returncode}: {log[-4000:]}")
    return load_phase(phase, out)


def load_phase(phase: str, out: Path) -> dict:
    """A finished phase's record (OUT/PHASE.json) with our experts' log line from its log."""
    result = json.loads((out / f"{phase}.json").read_text())
    log = (out / f"{phase}.log").read_text() if (out / f"{phase}.log").is_file() else ""
    result["summary_line"] = next((line for line in log.splitlines()
                                   if "mcore_torch_experts: rank 0 runs" in line), None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--skip", type=int, default=3, help="iterations left out of the timing")
    parser.add_argument("--expert-adapters", choices=["shared", "per_expert"], default="shared")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help=f"comma-separated, of {', '.join(PHASES)}; te and torch always, "
                             "pretrain unless OUT holds its checkpoint already")
    parser.add_argument("--from-results", action="store_true",
                        help="rebuild the report from the phases' records in OUT (PHASE.json, "
                             "PHASE.log) without running them")
    parser.add_argument("--phase", choices=list(PHASES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    phases = args.phases.split(",")
    unknown = sorted(set(phases) - set(PHASES))
    if unknown or not {"te", "torch"} <= set(phases):
        parser.error(f"--phases: {args.phases!r} must name te and torch, and only phases of "
                     f"{list(PHASES)}")
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.phase:
        worker(args.phase, out, args.iters, args.expert_adapters)
        return
    if args.from_results:
        missing = [phase for phase in ("te", "torch") if not (out / f"{phase}.json").is_file()]
        if missing:
            parser.error(f"--from-results: no {', '.join(f'{p}.json' for p in missing)} in {out}")
        results = {phase: load_phase(phase, out) for phase in PHASES
                   if phase != "pretrain" and phase in phases and (out / f"{phase}.json").is_file()}
    else:
        if "pretrain" not in phases and not (out / "pretrained").is_dir():
            parser.error(f"--phases: no pretrain phase and no checkpoint in {out / 'pretrained'}")
        results = {phase: run_phase(phase, out, args) for phase in PHASES if phase in phases}
    te, ours = results["te"]["steps"], results["torch"]["steps"]
    resume_diff = None
    if {"torch-first-half", "torch-resumed"} <= set(results):
        resumed = results["torch-first-half"]["steps"] + results["torch-resumed"]["steps"]
        resume_diff = max(abs(a["loss"] - b["loss"]) / abs(b["loss"])
                          for a, b in zip(resumed, ours))
    loss_diff = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(ours, te))
    tokens = SEQUENCES * SLICE["seq_length"]
    rows = []
    timed_phases = [phase for phase in ("te", "te-cutlass", "torch") if phase in results]
    for phase in timed_phases:
        steps = results[phase]["steps"]
        timed = [s["ms"] for s in steps[args.skip:]]
        median = statistics.median(timed)
        te_median = statistics.median(s["ms"] for s in te[args.skip:])
        rows.append([ARM_NAMES[phase], ", ".join(results[phase]["model"]["experts"]),
                     f"{median:.1f} ({min(timed):.1f}–"
                     f"{max(timed):.1f})", f"{tokens / median * 1e3:,.0f}",
                     harness.fmt(te_median / median, ".2f"),
                     f"{steps[0]['loss']:.4f} → {steps[-1]['loss']:.4f}",
                     f"{results[phase]['peak_gib']:.1f}", results[phase]["model"]["trained"],
                     results[phase]["model"]["expert_weights_trained"]])
    header = harness.header(torch.device("cuda"), packages=(
        "triton", "megatron-core", "megatron-bridge", "transformer-engine")) \
        if torch.cuda.is_available() else []
    header.append(f"slice: {SLICE}; {SEQUENCES} x {SLICE['seq_length']} tokens per iteration; "
                  f"LoRA dim 16 on linear_qkv, linear_proj, linear_fc1, linear_fc2, "
                  f"{args.expert_adapters} expert adapters")
    body = [f"{args.iters} iterations per arm, the first {args.skip} not timed; ms per iteration "
            "from Bridge's train-step callbacks (synchronised), median (min–max).", ""]
    body += harness.markdown_table(["arm", "experts", "ms / iteration", "tokens/s", "x TEGroupedMLP",
                                    "loss, first → last", "peak GiB", "trained tensors",
                                    "expert weights trained"], rows)
    body += ["", f"max rel. loss difference, TorchGroupedMLP vs TEGroupedMLP: {loss_diff:.1e}",
             f"max rel. loss difference, stopped at {args.iters // 2}, saved and resumed vs "
             f"uninterrupted: {harness.fmt(resume_diff, '.1e')}",
             f"TorchGroupedMLP arm's log line: `{results['torch']['summary_line'] or 'MISSING'}`"]
    ok = bool((resume_diff is None or resume_diff < 1e-3) and loss_diff < 2e-2 and results["torch"]["summary_line"]
              and results["torch"]["model"]["experts"] == ["TorchGroupedMLP"]
              and results["torch"]["model"]["expert_weights_trained"] == 0)
    medians = {phase: statistics.median(s["ms"] for s in results[phase]["steps"][args.skip:])
               for phase in timed_phases}
    summary = dict(ms_ours=medians["torch"], ms_stock=medians["te"],
                   ms_cutlass=medians.get("te-cutlass"), expert_adapters=args.expert_adapters,
                   loss_diff=loss_diff, resume_diff=resume_diff,
                   peak_ours=results["torch"]["peak_gib"], peak_stock=results["te"]["peak_gib"],
                   ok=ok)
    text = harness.write_report(out, "bridge_finetune", "Megatron-Bridge finetune() on the GPU",
                                header, body, {**results, "summary": summary})
    print(text)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
