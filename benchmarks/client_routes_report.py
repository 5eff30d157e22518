"""One table of the client routes scripts/gpu_client_routes.sh ran: each route's entry point on
each stack, ours against the stock experts (TEGroupedMLP; x CUTLASS: against TEGroupedMLP with
TE's CUTLASS grouped GEMM), from the `summary` of each route's report and its exit status.

    python3 benchmarks/client_routes_report.py OUT_DIR
"""

import json
import sys
from pathlib import Path

import harness

REPORTS = {"megatron-lm": "megatron_lm.json", "bridge-finetune": "bridge_finetune.json",
           "nemo-rl": "nemo_rl_worker.json"}
ENTRY_POINTS = {"megatron-lm": "Megatron-LM `pretrain_gpt.py`",
                "bridge-finetune": "Bridge `pretrain()` → `finetune()`, stop, resume",
                "nemo-rl": "NeMo-RL `MegatronPolicyWorkerImpl`, GRPO steps, save, resume"}


def versions(header: list) -> str:
    """The package versions line of a report's header, shortened."""
    line = next((h for h in header if h.startswith("python ")), "")
    keep = ("torch", "megatron-core", "megatron-bridge", "transformer-engine", "nemo-rl")
    return ", ".join(part for part in line.split(", ") if part.split(" ")[0] in keep)


def row(folder: Path) -> list:
    route, stack = folder.name.split("@")
    status = (folder / "exit").read_text().strip() if (folder / "exit").is_file() else "not run"
    report = folder / REPORTS[route]
    if not report.is_file():
        return [ENTRY_POINTS[route], stack, "—", "—", "—", "—", "—", "—", f"FAILED ({status})"]
    data = json.loads(report.read_text())
    summary = data.get("summary", {})
    ours, stock, cutlass = (summary.get(k) for k in ("ms_ours", "ms_stock", "ms_cutlass"))
    peaks = (f"{summary['peak_ours']:.1f} / {summary['peak_stock']:.1f}"
             if summary.get("peak_ours") is not None and summary.get("peak_stock") is not None
             else "—")
    result = "passed" if status == "0" and summary.get("ok") else f"FAILED (exit {status})"
    return [ENTRY_POINTS[route], versions(data.get("header", [])) or stack,
            harness.fmt(ours, ".1f"), harness.fmt(stock, ".1f"),
            harness.fmt(harness.ratio(stock, ours), ".2f"),
            harness.fmt(harness.ratio(cutlass, ours), ".2f"),
            harness.fmt(summary.get("loss_diff"), ".1e"), peaks, result]


def main(out: Path) -> int:
    folders = sorted(p for p in out.iterdir() if p.is_dir() and "@" in p.name
                     and p.name.split("@")[0] in REPORTS)
    rows = [row(folder) for folder in folders]
    lines = ["# The client routes on the GPU", ""] + harness.markdown_table(
        ["route", "stack", "ours ms / step", "TEGroupedMLP ms", "x TEGroupedMLP", "x CUTLASS",
         "max rel. loss diff", "peak GiB ours / stock", "result"], rows)
    text = "\n".join(lines) + "\n"
    (out / "client_routes.md").write_text(text)
    print(text)
    return 0 if rows and all(r[-1] == "passed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
