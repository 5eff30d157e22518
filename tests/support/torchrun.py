"""torchrun from the tests: `python -m torch.distributed.run --standalone` (it picks a free port)
on the CPU (gloo; the GPUs hidden, so it runs the same on a CUDA host), its output in a file,
killed with its workers after a hard timeout so that a hang fails instead of blocking CI."""

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Run:
    returncode: int
    output: str  # stdout and stderr of the launcher and every rank


def kill_launch(pid: int) -> None:
    """Kill torchrun and its workers by pid: each worker runs in a session of its own, so killing
    torchrun's process group would leave them running."""
    try:
        launcher = psutil.Process(pid)
        processes = [*launcher.children(recursive=True), launcher]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=30)


def torchrun(script: Path, nproc: int, args: list, log: Path, timeout_s: int) -> Run:
    """`script args` on `nproc` CPU processes from the repository root; fails the test with the
    log's tail if it has not finished after `timeout_s`. Output goes to `log`, which no leftover
    process can hold open."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", str(script), *args]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as sink:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_launch(proc.pid)
            proc.wait()
            pytest.fail(f"{' '.join(command[3:])} did not finish within {timeout_s} s (a hang?):\n"
                        f"{log.read_text()[-8000:]}")
    return Run(proc.returncode, log.read_text())
