"""The expert benchmark's CPU smoke run (--tiny) completes and reports; no timing assertions."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_experts_tiny(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_experts.py"), "--tiny",
         "--out-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "| shape | routing | implementation | fwd ms | fwd+dgrad ms |" in proc.stdout
    assert "## Local expert count sweep" in proc.stdout
    assert (tmp_path / "results.md").read_text().startswith("# TorchGroupedMLP benchmark")

    report = json.loads((tmp_path / "results.json").read_text())
    rows = [row for res in report["results"] for row in res["rows"]]
    assert not [row for row in rows if row.get("note", "").startswith("error")]
    # Every implementation that computes the experts agrees with SequentialMLP (bf16 rounding).
    checked = [row for row in rows if "err" in row]
    assert len(checked) >= 4 * len(report["results"])
    assert all(row["err"] < 3e-2 for row in checked), checked
