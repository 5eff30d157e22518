#!/usr/bin/env bash
# The whole test suite (unit, distributed under torchrun, CPU benchmark smoke tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
