#!/usr/bin/env bash
# Creates .venv in the repository (reusing a torch the system already has) and installs what is
# missing. torch is pinned to the 2.13.0 CPU build when no torch is importable: pip must never
# resolve a bare `torch`, which would download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "[setup] no torch importable: installing torch==2.13.0"
  .venv/bin/python -m pip install -q torch==2.13.0
fi
echo "[setup] installing mcore_torch_experts and its test dependencies"
.venv/bin/python -m pip install -q -e ".[test]"
