"""Megatron-LM's own `pretrain_gpt.py` on the GPU with the flags docs/enable.md gives, against
TEGroupedMLP: one torchrun per arm, every arm loading the same torch_dist checkpoint (`--load
--finetune`) that a stock Megatron-LM run of the slice (TEGroupedMLP, every weight training) saved
after one step. Prints and writes a table: ms per iteration (median and range over the timed
iterations), tokens/s, each iteration's loss against the TEGroupedMLP arm's.

Arms: `torch` (`--spec mcore_torch_experts.specs torch_experts_gpt_spec`, the documented
command), `te` (TEGroupedMLP with its experts frozen at build: tests/support/frozen_te_experts_spec.py,
so both train the same parameters), `te-cutlass` (the same with
NVTE_USE_CUTLASS_GROUPED_GEMM=1). `--megatron-lm DIR`: a Megatron-LM checkout (pretrain_gpt.py
beside megatron/) at the release of the installed megatron-core; scripts/gpu_megatron_lm.sh makes
one from the wheel and tests/integration/megatron_lm/third_party/megatron_lm/.

    python3 benchmarks/megatron_lm_run.py --megatron-lm DIR --out-dir OUT [--iters 20]
        [--global-batch 4,8] [--repeats 3] [--from-logs]

`--repeats N` runs the arms N times, interleaved (batch by batch, arm by arm, then again), so
that the spread between runs shows: each arm's row gives the median of its runs' medians and
their range, and the ratios to TEGroupedMLP and to the CUTLASS arm within each run. One
checkpoint serves every batch size. `--from-logs` rebuilds the report from the logs of a run that
was cut short (its unfinished runs left out).
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
        "--spec", "support.frozen_te_experts_spec", "frozen_te_experts_gpt_spec"], {}),
    "te-cutlass": ("TEGroupedMLP, experts frozen, CUTLASS grouped GEMM", DOCUMENTED[:3] + [
        "--spec", "support.frozen_te_experts_spec", "frozen_te_experts_gpt_spec"],
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


def run_arms(checkout: Path, out: Path, args, batches: list) -> None:
    """The init run, then every (repeat, batch, arm) run, interleaved; the logs in `out`."""
    checkpoint = out / "te_checkpoint"
    pretrain_gpt(checkout, out / "init.log", DOCUMENTED[:3] + [
        "--global-batch-size", str(batches[0]), "--train-iters", "1", "--save", str(checkpoint),
        "--save-interval", "1", "--no-save-optim", "--no-save-rng"], {})
    for repeat in range(args.repeats):
        for batch in batches:
            resume = ["--global-batch-size", str(batch), "--train-iters", str(args.iters),
                      "--load", str(checkpoint), "--finetune", "--no-load-optim", "--no-load-rng"]
            for arm in args.arms.split(","):
                _, flags, env = ARMS[arm]
                pretrain_gpt(checkout, out / log_name(arm, batch, repeat), flags + resume, env)


def log_name(arm: str, batch: int, repeat: int) -> str:
    return f"{arm}_gb{batch}_{repeat}.log"


def report_rows(out: Path, args, batch: int) -> tuple:
    """The table rows and the summary of one batch size, from the runs' logs in `out`."""
    runs, log_line = {}, None   # arm -> {repeat: [(ms, loss)]}
    for arm in args.arms.split(","):
        for repeat in range(args.repeats):
            path = out / log_name(arm, batch, repeat)
            its = iterations(path.read_text()) if path.is_file() else []
            if len(its) > args.skip:   # a run that did not finish is left out (runs column)
                runs.setdefault(arm, {})[repeat] = its
            if arm == "torch" and path.is_file() and log_line is None:
                log_line = SUMMARY.search(path.read_text())
    medians = {arm: {r: statistics.median(ms for ms, _ in its[args.skip:])
                     for r, its in arm_runs.items()} for arm, arm_runs in runs.items()}

    def ratios(base: str, arm: str) -> list:   # within each run both arms finished
        return [medians[base][r] / medians[arm][r] for r in medians.get(base, {})
                if r in medians[arm]]

    def loss_diff(arm: str):
        reference = runs.get("te", {})
        diffs = [abs(a[1] - b[1]) / b[1] for r, its in runs.get(arm, {}).items()
                 if r in reference for a, b in zip(its, reference[r])]
        return max(diffs) if diffs else None

    tokens = batch * 4096
    rows = []
    for arm, arm_runs in runs.items():
        values = list(medians[arm].values())
        median = statistics.median(values)
        first = arm_runs[min(arm_runs)]
        rows.append([f"{tokens:,}", ARMS[arm][0], str(len(values)),
                     f"{median:.1f} ({min(values):.1f}–{max(values):.1f})",
                     f"{tokens / median * 1e3:,.0f}", spread(ratios("te", arm)),
                     spread(ratios("te-cutlass", arm)),
                     f"{first[0][1]:.6f} → {first[-1][1]:.6f}", harness.fmt(loss_diff(arm), ".1e")])
    median = {arm: statistics.median(values.values()) for arm, values in medians.items()}
    ours_loss_diff = loss_diff("torch")
    summary = dict(tokens=tokens, ms_ours=median.get("torch"), ms_stock=median.get("te"),
                   ms_cutlass=median.get("te-cutlass"), loss_diff=ours_loss_diff,
                   runs={arm: len(values) for arm, values in medians.items()},
                   ok=bool(log_line and ours_loss_diff is not None and ours_loss_diff < 1e-3))
    return rows, summary, log_line, {"iterations": runs, "medians": medians}


def spread(values: list) -> str:
    """median (min–max) of ratios, or a dash."""
    if not values:
        return "—"
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", type=Path, required=True)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--skip", type=int, default=3, help="iterations left out of the timing")
    parser.add_argument("--arms", default=",".join(ARMS),
                        help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--global-batch", default="4",
                        help="sequences of 4096 tokens per iteration; several, comma-separated "
                             "(4,8), run interleaved within each repeat")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every arm, interleaved")
    parser.add_argument("--from-logs", action="store_true",
                        help="no runs: the report from the logs already in --out-dir (runs cut "
                             "short are left out)")
    args = parser.parse_args()
    unknown = sorted(set(args.arms.split(",")) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown arm(s) {unknown}; choose from {list(ARMS)}")
    try:
        batches = [int(b) for b in args.global_batch.split(",")]
    except ValueError:
        parser.error(f"--global-batch: {args.global_batch!r} is not a comma-separated list of "
                     "integers (for instance 4,8)")
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    checkout = args.megatron_lm.resolve()
    if not args.from_logs:
        run_arms(checkout, out, args, batches)
    header = harness.header(torch.device("cuda")) if torch.cuda.is_available() else []
    header.append(f"Megatron-LM: `pretrain_gpt.py` of {checkout}; model: {' '.join(SLICE)}; "
                  f"run: {' '.join(RUN)}; --global-batch-size {args.global_batch}")
    body = [f"{args.repeats} run(s) of {args.iters} iterations per arm and batch, interleaved "
            f"(batch by batch, arm by arm, then again), the first {args.skip} of each not timed; "
            "ms per iteration as Megatron-LM logs it: the median of the runs' medians (their "
            "range); x TEGroupedMLP and x CUTLASS: within each run, median (range).", ""]
    rows, summaries, data, log_line = [], [], {}, None
    for batch in batches:
        batch_rows, summary, line, data[batch] = report_rows(out, args, batch)
        rows += batch_rows
        summaries.append(summary)
        log_line = log_line or line
    body += harness.markdown_table(
        ["tokens / iteration", "experts", "runs", "ms / iteration", "tokens/s",
         "x TEGroupedMLP", "x CUTLASS", "loss, first → last (first run)",
         "max rel. loss diff vs TEGroupedMLP"], rows)
    body += ["", f"TorchGroupedMLP arm's log line: `{log_line.group(0) if log_line else 'MISSING'}`"]
    # The route's summary is the largest batch's; every batch's is kept beside it.
    summary = {**summaries[-1], "by_batch": summaries,
               "ok": all(s["ok"] for s in summaries)}
    text = harness.write_report(out, "megatron_lm", "Megatron-LM pretrain_gpt.py on the GPU",
                                header, body, {**{str(b): d for b, d in data.items()},
                                               "summary": summary})
    print(text)
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
