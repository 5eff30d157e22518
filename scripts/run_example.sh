#!/usr/bin/env bash
# The main job: see README.md. Runs on megatron-core 0.16.1 (Python 3.11) by default;
# MCORE_TORCH_EXPERTS_LEG=0.19.2 runs it on 0.19.2 (Python 3.12), see scripts/legs.sh.
# (-W: Megatron's import-time notes that Transformer Engine and Apex are absent; the example
# needs neither.)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/legs.sh
leg=${MCORE_TORCH_EXPERTS_LEG:-0.16.1}
setup_leg "$leg"
leg_run "$leg" -W ignore::UserWarning examples/finetune_lora.py "$@"
