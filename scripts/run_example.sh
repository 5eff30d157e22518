#!/usr/bin/env bash
# The main job (see README.md), or another example: runs on megatron-core 0.16.1 (Python 3.11)
# by default; MCORE_TORCH_EXPERTS_LEG picks another release (scripts/legs.sh) and
# MCORE_TORCH_EXPERTS_EXAMPLE another example, e.g. the Hugging Face round trip, which needs
# Megatron-Bridge (the 0.19.2 leg):
#   MCORE_TORCH_EXPERTS_LEG=0.19.2 MCORE_TORCH_EXPERTS_EXAMPLE=hf_roundtrip bash scripts/run_example.sh
# Arguments go to the example. (-W: Megatron's import-time notes that Transformer Engine and Apex
# are absent; the examples need neither.)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/legs.sh
leg=${MCORE_TORCH_EXPERTS_LEG:-0.16.1}
example=${MCORE_TORCH_EXPERTS_EXAMPLE:-finetune_lora}
if [ ! -f "examples/$example.py" ]; then
  echo "MCORE_TORCH_EXPERTS_EXAMPLE=$example: no examples/$example.py; choose one of:" \
    $(cd examples && ls *.py | sed 's/\.py$//') >&2
  exit 2
fi
setup_leg "$leg"
leg_run "$leg" -W ignore::UserWarning "examples/$example.py" "$@"
