"""Megatron-LM's own `pretrain_gpt.py`, run by torchrun the way docs/enable.md says, trains.

The script, `gpt_builders.py` and `model_provider.py` are Megatron-LM's, unchanged
(tests/integration/megatron_lm/third_party/megatron_lm/, the release matching the installed megatron-core); its
`pretrain()` runs whole: argument parsing, config, model build from our `--spec`, DDP, Megatron's
optimizer, mock data, training steps, torch_dist checkpoints. The documented flags go after a
tiny model's, plus what a CPU-only host needs (local modules, CPU initialisation, no fusions,
gloo); tests/integration/megatron_lm/megatron_lm_cpu_launch.py applies the CPU patch table. Nothing freezes the experts
but the module itself.

The control: the same command without `--moe-grouped-gemm` and `--spec` (Megatron's own
SequentialMLP experts, all weights training) saves a torch_dist checkpoint after one step; our
run and the control both load it with `--finetune`, so their first losses are of the same weights
and batch.
"""

import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import megatron.core
import pytest

from megatron_lm_worker import MODEL_ARGS, documented_flags
from support.te import HAVE_TE

THIRD_PARTY = Path(__file__).parent / "third_party" / "megatron_lm"
SCRIPTS_BY_RELEASE = {"0.19": "core_r0.19.0", "0.20": "0.20.0"}
CPU_ARGS = [
    "--transformer-impl", "local", "--use-cpu-initialization", "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
    "--no-rope-fusion", "--distributed-backend", "gloo",
]
RUN_ARGS = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
    "--lr-decay-style", "constant", "--eval-iters", "0", "--eval-interval", "100",
    "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.eE+-]+) \|")
SUMMARY = "mcore_torch_experts: rank 0 runs TorchGroupedMLP experts in 2 MoE layer(s)"


def scripts_folder() -> Path:
    if HAVE_TE:
        pytest.skip("the CPU form of the command needs a host without Transformer Engine: where "
                    "TE imports, Megatron's optimizer takes TE's CUDA-only multi-tensor kernels "
                    "(grad norm, fused Adam) whatever the model's device; with TE the command "
                    "runs on the GPU (scripts/gpu_megatron_lm.sh)")
    release = ".".join(megatron.core.__version__.split(".")[:2])
    if release not in SCRIPTS_BY_RELEASE:
        pytest.skip(f"Megatron-LM's launcher scripts here match megatron-core "
                    f"{', '.join(SCRIPTS_BY_RELEASE)}, not the installed "
                    f"{megatron.core.__version__} (its --spec route is 0.19's GPTModelBuilder)")
    return THIRD_PARTY / SCRIPTS_BY_RELEASE[release]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def pretrain_gpt(workdir: Path, *args: str) -> str:
    """`torchrun --nproc-per-node 1 pretrain_gpt.py MODEL_ARGS CPU_ARGS RUN_ARGS args` on the
    CPU; its log (stdout and stderr) after asserting it exited 0."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    # The script's folder, as `python pretrain_gpt.py` puts it first (gpt_builders.py and
    # model_provider.py are imported from there).
    env["PYTHONPATH"] = os.pathsep.join([str(scripts_folder()), str(Path(__file__).parents[2]),
                                         env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
               "--master-port", str(_free_port()),
               str(Path(__file__).parent / "megatron_lm_cpu_launch.py"),
               str(scripts_folder() / "pretrain_gpt.py"), *MODEL_ARGS, *CPU_ARGS, *RUN_ARGS, *args]
    run = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True,
                         timeout=600)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-6000:]
    return log


def losses(log: str) -> list:
    """The `lm loss` Megatron-LM logged at each iteration, in order."""
    found = [(int(i), float(loss)) for i, loss in LOSS.findall(log)]
    assert [i for i, _ in found] == list(range(1, len(found) + 1)), found
    return [loss for _, loss in found]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    scripts_folder()
    workdir = tmp_path_factory.mktemp("megatron_lm")
    checkpoint = workdir / "megatron_experts_checkpoint"
    megatrons_flags = [f for f in documented_flags() if f != "--moe-grouped-gemm"]
    megatrons_flags = megatrons_flags[:megatrons_flags.index("--spec")]
    pretrain_gpt(workdir, *megatrons_flags, "--train-iters", "1", "--save", str(checkpoint),
                 "--save-interval", "1")
    resume = ["--train-iters", "3", "--load", str(checkpoint), "--finetune"]
    return {"ours": pretrain_gpt(workdir, *documented_flags(), *resume),
            "control": pretrain_gpt(workdir, *megatrons_flags, *resume)}


def test_the_documented_command_trains_every_step(runs):
    ours = losses(runs["ours"])
    assert len(ours) == 3 and all(math.isfinite(loss) for loss in ours)
    assert "requires grad" not in runs["ours"]
    assert "> building train, validation, and test datasets for GPT" in runs["ours"]


def test_each_rank_logs_once_that_torch_experts_run_and_that_they_are_frozen(runs):
    lines = [line for line in runs["ours"].splitlines() if SUMMARY in line]
    assert len(lines) == 1, lines
    assert "16 expert weights" in lines[0] and "16 of them frozen" in lines[0]
    assert SUMMARY not in runs["control"]


def test_a_checkpoint_of_megatrons_experts_loads_and_gives_its_loss(runs):
    """Same weights, same batch: the first losses agree to BF16 rounding; the second differ by
    one step of the control's expert weights, which ours keep frozen."""
    ours, control = losses(runs["ours"]), losses(runs["control"])
    assert abs(ours[0] - control[0]) <= 1e-3 * control[0]
    assert abs(ours[1] - control[1]) <= 1e-2 * control[1]
    assert ours[1] != ours[0]  # everything but the experts trained
