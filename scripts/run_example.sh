#!/usr/bin/env bash
# The main job: see README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python examples/demo_moe_layer.py "$@"
