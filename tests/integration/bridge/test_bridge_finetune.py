"""Megatron-Bridge's own training entry, `finetune(config, forward_step)`, trains LoRA adapters
over TorchGroupedMLP experts with the provider settings docs/enable.md gives, and its adapter
checkpoints resume.

tests/integration/bridge/bridge_finetune_worker.py runs, under torchrun on the CPU, the flow of Bridge's own LoRA
functional tests: a stock `pretrain()` (Bridge's local spec: SequentialMLP experts, every weight
training) saves a torch_dist checkpoint; `finetune()` with Bridge's LoRA on linear_qkv,
linear_proj, linear_fc1 and linear_fc2 starts from it with `provider.transformer_layer_spec =
torch_experts_gpt_spec` and `provider.moe_grouped_gemm = True`, uninterrupted, and stopped
half-way (Bridge's adapter-only checkpoint) then resumed from its save; the control finetunes
the same checkpoint with the stock spec. Bridge's config, data, optimizer, scheduler, PEFT hook
and checkpointing run unchanged; the CPU patch table (support.cpu_support) answers their
CUDA-only calls.
"""

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from support.te import HAVE_TE

pytestmark = pytest.mark.bridge

WORKER = Path(__file__).parent / "bridge_finetune_worker.py"
TRAINING_IMPORTS = ("datasets", "modelopt", "megatron.energon", "tensorboard")


def skip_reason():
    """Why this host cannot run the flow, or None."""
    try:
        bridge = importlib.util.find_spec("megatron.bridge")
    except ModuleNotFoundError:
        bridge = None
    if bridge is None:
        return ("Megatron-Bridge is not installed in this leg (it needs megatron-core 0.19+: "
                "the 0.19.2 leg has Bridge 0.6.2, the 0.20.0 leg Bridge 0.7.0)")
    if HAVE_TE:
        return ("the CPU form of the run needs a host without Transformer Engine: where TE "
                "imports, Megatron's optimizer takes TE's CUDA-only multi-tensor kernels "
                "(scripts/gpu_client_routes.sh runs the flow on the GPU)")
    missing = [name for name in TRAINING_IMPORTS if importlib.util.find_spec(name) is None]
    if missing:
        return (f"Megatron-Bridge's training modules import {', '.join(missing)}, not installed "
                f"in this leg (scripts/legs.sh installs them with the legs that have Bridge: "
                f"BRIDGE_TRAINING_DEPS)")
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("bridge_finetune")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]),
                                         env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
               "--master-port", str(_free_port()), str(WORKER), str(out), str(out / "result.json")]
    run = subprocess.run(command, cwd=out, env=env, capture_output=True, text=True, timeout=900)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-8000:]
    return json.loads((out / "result.json").read_text())


def losses(phase: dict) -> list:
    return [step["loss"] for step in phase["steps"]]


def test_finetune_trains_only_adapters_over_torch_grouped_experts(runs):
    ours = runs["ours"]
    assert ours["model"]["experts"] == ["TorchGroupedMLP"]
    assert ours["model"]["trained_non_adapter"] == []
    assert ours["model"]["expert_weights_trained"] == 0
    assert ours["model"]["adapters"] > 0
    assert runs["control"]["model"]["experts"] == ["SequentialMLP"]
    assert runs["pretrain"]["model"]["expert_weights_trained"] > 0  # the stock pretrain trains them
    steps = losses(ours)
    assert len(steps) == len(losses(runs["control"])) and all(math.isfinite(x) for x in steps)
    assert steps[-1] != steps[0]


def test_stopped_saved_and_resumed_gives_the_uninterrupted_losses(runs):
    first, resumed = runs["ours-first-half"], runs["ours-resumed"]
    assert resumed["model"]["start_step"] == len(first["steps"])  # it resumed, not restarted
    assert resumed["model"]["experts"] == ["TorchGroupedMLP"]
    split = losses(first) + losses(resumed)
    uninterrupted = losses(runs["ours"])
    assert [s["step"] for s in first["steps"] + resumed["steps"]] == \
        [s["step"] for s in runs["ours"]["steps"]]
    assert split == pytest.approx(uninterrupted, rel=1e-5, abs=1e-6)
    lrs = [s["lr"] for s in first["steps"] + resumed["steps"]]
    assert lrs == pytest.approx([s["lr"] for s in runs["ours"]["steps"]])


def test_first_losses_equal_the_stock_spec_control(runs):
    """Same pretrained weights, same batches, adapters still zero (LoRA's B starts at zero and
    the warm-up from lr 0 makes the first update nothing): the first two losses agree to BF16
    rounding; then the expert adapters differ (ours one per experts module, the control's one
    per SequentialMLP expert)."""
    ours, control = losses(runs["ours"]), losses(runs["control"])
    assert ours[:2] == pytest.approx(control[:2], rel=1e-3)
    assert runs["ours"]["steps"][0]["lr"] == runs["control"]["steps"][0]["lr"]
