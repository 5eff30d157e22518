"""The one way the tests run Triton kernels on the CPU: a child pytest with TRITON_INTERPRET=1
set from its start (triton reads it when it is first imported, and Megatron-Core imports triton,
so setting it in a running process is too late). Used by the `triton_interpreter` marker
(tests/conftest.py) and by tests/unit/test_combine.py's rerun of its triton cases."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def interpreter_is_on() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def run_interpreted(*pytest_args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m pytest *pytest_args` from the repository root under TRITON_INTERPRET=1; skip
    reasons reported (-rs); a failure reports its traceback without captured output or logs
    (torch's debug logs would fill the tail that the parent shows)."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", *pytest_args, "-q", "-p", "no:cacheprovider",
         "-W", "ignore", "-rs", "--show-capture=no"],
        env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=ROOT, capture_output=True, text=True,
        timeout=timeout)
