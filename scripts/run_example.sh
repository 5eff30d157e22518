#!/usr/bin/env bash
# The main job: see README.md. (-W: Megatron's import-time notes that Transformer Engine and Apex
# are absent; the example needs neither.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -W ignore::UserWarning examples/finetune_lora.py "$@"
