"""The examples run end to end (small sizes), each in its own process: as they are on a CUDA host,
through the CPU launcher (tests/support/run_on_cpu.py) on a host without CUDA, as the README and
scripts/run_example.sh say; hf_roundtrip (CPU only) always through the launcher."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.examples  # on the 0.16.1 and 0.20.0 legs (scripts/legs.sh)

EXAMPLES = Path(__file__).parents[1] / "examples"
CPU_LAUNCHER = Path(__file__).parent / "support" / "run_on_cpu.py"
RUNS = {
    "megatron_lm_provider": ([], "1: TorchGroupedMLP, 2: TorchGroupedMLP"),
    "bridge_style_provider": ([], "1: TorchGroupedMLP, 2: TorchGroupedMLP"),
    "demo_moe_layer": (["--experts", "4", "--tokens", "64", "--hidden", "64", "--ffn", "64",
                        "--repeats", "1"], "output relative L2 difference:"),
    "finetune_lora": (["--steps", "6", "--layers", "2", "--hidden", "64", "--ffn", "64",
                       "--experts", "4", "--batch", "2", "--seq", "16", "--out-dir", "{tmp}"],
                      "adapters reloaded into a fresh model: same loss"),
    "hf_roundtrip": (["--steps", "4", "--out-dir", "{tmp}"], "export: 45 tensors, all equal"),
}
DEMO_CUDA_BF16_TOL = 1e-2  # TorchGroupedMLP vs SequentialMLP in BF16 (fused activation, grouped GEMM)
NEEDS_BRIDGE = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("megatron.bridge") is None,
    reason="needs megatron-bridge and transformers (the 0.19.2 and 0.20.0 legs)")


@pytest.mark.parametrize("name", [pytest.param(name, marks=NEEDS_BRIDGE) if name == "hf_roundtrip"
                                  else name for name in RUNS])
def test_example_runs(name, tmp_path):
    args, expected = RUNS[name]
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    # The test session's own gloo store holds MASTER_PORT: each example picks a free port.
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    launcher = [str(CPU_LAUNCHER)] if name == "hf_roundtrip" or not torch.cuda.is_available() \
        else []
    result = subprocess.run([sys.executable, "-W", "ignore", *launcher, f"{name}.py", *args],
                            cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert expected in result.stdout, result.stdout[-3000:]
    if name == "demo_moe_layer":  # FP32 eager ops on the CPU: equal; BF16 on CUDA: rounding
        differences = re.findall(r"relative L2 difference: +([0-9.e+-]+)", result.stdout)
        bound = DEMO_CUDA_BF16_TOL if torch.cuda.is_available() else 0.0
        assert len(differences) == 2 and all(float(d) <= bound for d in differences), differences


def test_main_job_help_describes_every_option():
    """`finetune_lora.py --help` (what `scripts/run_example.sh --help` prints): the whole first
    paragraph of the docstring, a help text for every option, the numbered steps after them."""
    result = subprocess.run([sys.executable, "-W", "ignore", "finetune_lora.py", "--help"],
                            cwd=EXAMPLES, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stdout
    assert "under\nfull activation recompute." in text  # the description does not stop mid-way
    options = text.split("options:")[1].split("\n\n")[0]
    entries = re.split(r"\n  (?=-)", options.strip())
    assert len(entries) >= 18
    for entry in entries[1:]:  # after -h: each names its option, then says what it is
        assert len(entry.split(maxsplit=2)) == 3 or "\n" in entry, entry
    assert "1. builds a small GPT-MoE" in text


@pytest.mark.parametrize("name", ["finetune_lora", "hf_roundtrip"])
def test_example_without_cuda_refuses_naming_the_cpu_launcher(name):
    """Started without CUDA and without the launcher, an example stops before any work and names
    the command that runs it on the CPU."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("MCORE_TORCH_EXPERTS_EXAMPLE_ON_CPU", None)
    result = subprocess.run([sys.executable, "-W", "ignore", f"{name}.py", "--out-dir", "unused"],
                            cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert f"python tests/support/run_on_cpu.py examples/{name}.py" in result.stderr, \
        result.stderr[-3000:]
    assert not (EXAMPLES / "unused").exists()


def test_cpu_launcher_refuses_what_is_not_a_python_file(tmp_path):
    for argv in ([], [str(tmp_path)], [str(tmp_path / "missing.py")]):
        result = subprocess.run([sys.executable, str(CPU_LAUNCHER), *argv], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode != 0
        assert "is not a Python file; usage: python tests/support/run_on_cpu.py EXAMPLE.py" \
            in result.stderr, result.stderr
