"""Importing Megatron-Bridge's PEFT in tests, with or without Transformer Engine.

Bridge imports `transformer_engine.pytorch` unconditionally, and TE cannot be built on CPU-only
machines; `support.bridge_imports.import_megatron_bridge` makes a stand-in visible during Bridge's
import only (see its docstring). Here tests skip, with the reason, where Bridge cannot be had.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def import_bridge_peft() -> None:
    """Import Bridge's PEFT modules, or skip the test with the reason Bridge is unavailable."""
    if sys.version_info < (3, 12):
        pytest.skip("Megatron-Bridge 0.6 needs Python 3.12")
    if importlib.util.find_spec("megatron.bridge") is None:
        pytest.skip("megatron-bridge is not installed")
    from support.bridge_imports import import_megatron_bridge

    import_megatron_bridge()


def import_bridge_multi_lora():
    """Bridge's multi-LoRA modules (`multi_lora`, `multi_lora_layers`), or a skip naming why they
    are absent (no Bridge, or Bridge < 0.7.0)."""
    import_bridge_peft()
    if importlib.util.find_spec("megatron.bridge.peft.multi_lora") is None:
        from importlib.metadata import version

        pytest.skip(f"megatron-bridge {version('megatron-bridge')} has no multi-LoRA "
                    "(megatron.bridge.peft.multi_lora arrived in 0.7.0)")
    from megatron.bridge.peft import multi_lora, multi_lora_layers

    return multi_lora, multi_lora_layers


def run_worker(worker: Path, out: Path, hide_gpus: bool = False, args=(),
               pythonpath=()) -> dict:
    """Run a Bridge test worker in its own process (the stand-in never reaches this one): `worker
    OUT RESULT_JSON [ARGS...]`, with the repository (and the folders of `pythonpath`, first) on
    PYTHONPATH and a port of its own; its JSON result. `hide_gpus`: the worker sees no GPU (a CPU
    host even on a CUDA host: gloo, its model on the CPU)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    if hide_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), str(REPO),
                                         env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-W", "ignore", str(worker), str(out),
                          str(out / "result.json"), *args], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads((out / "result.json").read_text())
