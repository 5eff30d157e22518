"""Megatron-LM's own `pretrain_gpt.py` on the GPU with the flags docs/enable.md gives, against
TEGroupedMLP: one torchrun per arm, every arm loading the same torch_dist checkpoint (`--load
--finetune`) that a stock Megatron-LM run of the slice (TEGroupedMLP, every weight training) saved
after one step. Prints and writes a table: ms per iteration (median and range over the timed
iterations), tokens/s, each iteration's loss against the TEGroupedMLP arm's.

Arms: `torch` (`--spec mcore_torch_experts.specs torch_experts_gpt_spec`, the documented
command), `te` (TEGroupedMLP with its experts frozen at build: tests/frozen_te_experts_spec.py,
so both train the same parameters), `te-cutlass` (the same with
NVTE_USE_CUTLASS_GROUPED_GEMM=1). `--megatron-lm DIR`: a Megatron-LM checkout (pretrain_gpt.py
beside megatron/) at the release of the installed megatron-core; scripts/gpu_megatron_lm.sh makes
one from the wheel and tests/third_party/megatron_lm/.

    python3 benchmarks/megatron_lm_run.py --megatron-lm DIR --out-dir OUT [--iters 20]
        [--global-batch 4] [--repeats 3]

`--repeats N` runs the arms N times, interleaved (arm by arm, then again), so that the spread
between runs shows: each arm's row gives the median of its runs' medians and their range, and
the ratio to TEGroupedMLP within each run.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import harness

# A Qwen3-30B-A3B-like slice: 4 layers, 128 experts of 768 (SwiGLU), top-8, GQA 32/4 heads.
SLICE = [
    "--num-layers", "4", "--hidden-size", "2048", "--num-attention-heads", "32",
    "--group-query-attention", "--num-query-groups", "4", "--kv-channels", "128",
    "--ffn-hidden-size", "6144", "--num-experts", "128", "--moe-ffn-hidden-size", "768",
    "--moe-router-topk", "8", "--moe-token-dispatcher-type", "alltoall", "--swiglu",
    "--normalization", "RMSNorm", "--qk-layernorm", "--position-embedding-type", "rope",
    "--rotary-base", "1000000", "--untie-embeddings-and-output-weights",
    "--seq-length", "4096", "--max-position-embeddings", "4096",
]
RUN = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "151936",
    "--micro-batch-size", "1", "--lr", "1e-5",
    "--lr-decay-style", "constant", "--eval-iters", "0", "--eval-interval", "100000",
    "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
    # Megatron-LM's default gradient-accumulation fusion needs APEX's CUDA extension, which this
    # image lacks (any arm fails without it, stock TEGroupedMLP too).
    "--no-gradient-accumulation-fusion",
]
DOCUMENTED = ["--moe-grouped-gemm", "--bf16", "--disable-bias-linear",
              "--spec", "mcore_torch_experts.specs", "torch_experts_gpt_spec"]
ARMS = {
    "torch": ("TorchGroupedMLP (the documented command)", DOCUMENTED, {}),
    "te": ("TEGroupedMLP, experts frozen", DOCUMENTED[:3] + [
        "--spec", "frozen_te_experts_spec", "frozen_te_experts_gpt_spec"], {}),
    "te-cutlass": ("TEGroupedMLP, experts frozen, CUTLASS grouped GEMM", DOCUMENTED[:3] + [
        "--spec", "frozen_te_experts_spec", "frozen_te_experts_gpt_spec"],
        {"NVTE_USE_CUTLASS_GROUPED_GEMM": "1"}),
}
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): "
                       r"([0-9.]+) \|.*?\| lm loss: ([0-9.eE+-]+) \|")
SUMMARY = re.compile(r"mcore_torch_experts: rank 0 runs .*")


def pretrain_gpt(checkout: Path, log_path: Path, args, env_extra) -> str:
    """One `torchrun --nproc-per-node 1 pretrain_gpt.py SLICE RUN args`; its log."""
    env = {**os.environ, **env_extra}
    env["PYTHONPATH"] = os.pathsep.join([str(harness.REPO_ROOT), str(harness.REPO_ROOT / "tests"),
                                         env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
               "--master-port", str(harness.free_port()), "pretrain_gpt.py", *SLICE, *RUN, *args]
    start = time.time()
    run = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True)
    log = run.stdout + run.stderr
    log_path.write_text(" ".join(command) + "\n\n" + log)
    print(f"[megatron-lm] {log_path.stem}: exit {run.returncode} in {time.time() - start:.0f} s",
          flush=True)
    if run.returncode != 0:
        raise RuntimeError(f"{log_path.name}: exit {run.returncode}: {log[-3000:]}")
    return log


def iterations(log: str) -> list:
    """[(ms, loss)] per logged iteration, in order."""
    return [(float(ms), float(loss)) for _, ms, loss in ITERATION.findall(log)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", type=Path, required=True)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--skip", type=int, default=3, help="iterations left out of the timing")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--global-batch", type=int, default=4,
                        help="sequences of 4096 tokens per iteration")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every arm, interleaved")
    args = parser.parse_args()
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    checkout = args.megatron_lm.resolve()
    checkpoint = out / "te_checkpoint"
    batch = ["--global-batch-size", str(args.global_batch)]
    header = harness.header(torch.device("cuda"))
    header.append(f"Megatron-LM: `pretrain_gpt.py` of {checkout}; model: {' '.join(SLICE)}; "
                  f"run: {' '.join(RUN + batch)}")
    pretrain_gpt(checkout, out / "init.log", DOCUMENTED[:3] + batch + [
        "--train-iters", "1", "--save", str(checkpoint), "--save-interval", "1",
        "--no-save-optim", "--no-save-rng"], {})
    resume = batch + ["--train-iters", str(args.iters), "--load", str(checkpoint), "--finetune",
                      "--no-load-optim", "--no-load-rng"]
    arms = args.arms.split(",")
    runs, log_line = {arm: [] for arm in arms}, None
    for repeat in range(args.repeats):
        for arm in arms:
            label, flags, env = ARMS[arm]
            name = arm if args.repeats == 1 else f"{arm}_{repeat}"
            log = pretrain_gpt(checkout, out / f"{name}.log", flags + resume, env)
            runs[arm].append(iterations(log))
            if arm == "torch":
                log_line = SUMMARY.search(log)
    tokens = args.global_batch * 4096
    medians = {arm: [statistics.median(ms for ms, _ in its[args.skip:]) for its in arm_runs]
               for arm, arm_runs in runs.items()}
    reference = runs.get("te")
    rows = []
    for arm, arm_runs in runs.items():
        median = statistics.median(medians[arm])
        ratios = ([te / ours for te, ours in zip(medians["te"], medians[arm])]
                  if reference else [])
        loss_diff = (max(abs(a[1] - b[1]) / b[1] for its, ref in zip(arm_runs, reference)
                         for a, b in zip(its, ref)) if reference else None)
        rows.append([ARMS[arm][0], f"{median:.1f} ({min(medians[arm]):.1f}–"
                     f"{max(medians[arm]):.1f})", f"{tokens / median * 1e3:,.0f}",
                     (f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"
                      if ratios else "—"),
                     f"{arm_runs[0][0][1]:.6f} → {arm_runs[0][-1][1]:.6f}",
                     harness.fmt(loss_diff, ".1e")])
    body = [f"{args.repeats} run(s) of {args.iters} iterations per arm, interleaved, the first "
            f"{args.skip} of each not timed; ms per iteration as Megatron-LM logs it: the median "
            f"of the runs' medians (their range); x TEGroupedMLP: within each run, median "
            f"(range); {tokens:,} tokens per iteration.", ""]
    body += harness.markdown_table(
        ["experts", "ms / iteration", "tokens/s", "x TEGroupedMLP", "loss, first → last",
         "max rel. loss diff vs TEGroupedMLP"], rows)
    body += ["", f"TorchGroupedMLP arm's log line: `{log_line.group(0) if log_line else 'MISSING'}`"]
    loss_diff = (max(abs(a[1] - b[1]) / b[1] for its, ref in zip(runs["torch"], reference)
                     for a, b in zip(its, ref)) if reference and "torch" in runs else None)
    median = {arm: statistics.median(values) for arm, values in medians.items()}
    summary = dict(ms_ours=median.get("torch"), ms_stock=median.get("te"),
                   ms_cutlass=median.get("te-cutlass"), loss_diff=loss_diff,
                   ok=bool(log_line and loss_diff is not None and loss_diff < 1e-3))
    text = harness.write_report(out, "megatron_lm", "Megatron-LM pretrain_gpt.py on the GPU",
                                header, body, {"iterations": runs, "medians": medians,
                                               "summary": summary})
    print(text)
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
