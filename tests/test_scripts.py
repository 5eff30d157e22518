"""The README's two commands (scripts/run_tests.sh, scripts/run_example.sh) as a user runs them:
their summaries and their setup on a second call; the client routes' script refusing, before any
run, a route it does not know and a route asked for on another megatron-core than the one
installed."""

import os
import subprocess
import sys
from pathlib import Path

import megatron.core
import pytest

REPO = Path(__file__).resolve().parents[1]
LEG = megatron.core.__version__.split("+")[0]


def bash(script, *args, env=None):
    return subprocess.run(["bash", str(REPO / "scripts" / script), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


@pytest.mark.skipif(sys.version_info[:2] != (3, 11),
                    reason="the script's counting does not depend on the leg: run on 0.16.1's")
def test_run_tests_counts_pytest_results_whatever_the_verbosity(tmp_path):
    """`-q -q` makes pytest print no summary line: the counts still come out (junit XML)."""
    (tmp_path / "test_tiny.py").write_text(
        "import pytest\n"
        "def test_a(): pass\n"
        "def test_b(): pass\n"
        "def test_c(): pytest.skip('no')\n"
        "def test_d(): assert False\n")
    run = bash("run_tests.sh", "-q", "-q", str(tmp_path / "test_tiny.py"),
               env={"MCORE_TORCH_EXPERTS_LEGS": LEG})
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "total: 2 passed, 1 failed, 1 skipped;" in run.stdout, run.stdout[-3000:]
    assert f"megatron-core {LEG}: 2 passed, 1 failed, 1 skipped, 0 errors (exit 1;" in run.stdout


@pytest.mark.skipif(sys.version_info[:2] != (3, 11),
                    reason="run_example.sh's default leg, 0.16.1, is the Python 3.11 venv's")
def test_run_example_installs_once_then_starts_at_once():
    bash("run_example.sh", "--help")   # installs where nothing is installed yet
    run = bash("run_example.sh", "--help")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "[setup 0.16.1] mcore_torch_experts, megatron-core==0.16.1 and the test " \
        "dependencies: installed already" in run.stdout
    assert "installing" not in run.stdout
    assert run.stdout.count("usage: finetune_lora.py") == 1


@pytest.mark.skipif(sys.version_info[:2] != (3, 11),
                    reason="the refusals do not depend on the leg: run on 0.16.1's")
def test_client_routes_refuse_an_unknown_route_and_another_stack_before_running(tmp_path):
    other = "0.19.2" if LEG != "0.19.2" else "0.20.0"
    run = bash("gpu_client_routes.sh", str(tmp_path), f"bridge-finetune@{other}", "nonsense",
               env={"PYTHONPATH": os.pathsep.join(sys.path),   # the leg's python3 and packages
                    "PATH": os.pathsep.join([str(Path(sys.executable).parent),
                                             os.environ.get("PATH", "")])})
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert (f"gpu_client_routes: bridge-finetune@{other} asks for megatron-core {other}, but "
            f"{LEG} is installed: install that stack (docs/enable.md) or name the route "
            "without @") in run.stdout
    assert "gpu_client_routes: no route nonsense (megatron-lm, bridge-finetune, nemo-rl)" \
        in run.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["client_routes.md"]   # nothing ran


@pytest.mark.parametrize("asked", [True, False])
def test_a_failure_is_printed_when_it_happens_where_asked(tmp_path, asked):
    """scripts/gpu_te.sh sets MCORE_TORCH_EXPERTS_FAILURES_AT_ONCE=1: a run cut by a time limit
    then holds each failure's traceback, printed before pytest's summary (unset: only there)."""
    assert "MCORE_TORCH_EXPERTS_FAILURES_AT_ONCE=1" in (REPO / "scripts" / "gpu_te.sh").read_text()
    (tmp_path / "test_fail.py").write_text('def test_x():\n    assert 1 == 2, "on purpose"\n')
    env = {**os.environ, "MCORE_TORCH_EXPERTS_FAILURES_AT_ONCE": "1" if asked else "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests"), str(REPO),
                                                       os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p",
                           "no:cacheprovider", "-q", "test_fail.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    if asked:
        at_once = out.index("[failed at once] test_fail.py::test_x (call):")
        assert at_once < out.index('AssertionError: on purpose') < out.index("short test summary")
    else:
        assert "[failed at once]" not in out
