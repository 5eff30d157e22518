#!/usr/bin/env bash
# The main job (see README.md), or another example: runs on megatron-core 0.16.1 (Python 3.11)
# by default; MCORE_TORCH_EXPERTS_LEG picks another release (scripts/legs.sh) and
# MCORE_TORCH_EXPERTS_EXAMPLE another example, e.g. the Hugging Face round trip, which needs
# Megatron-Bridge (the 0.19.2 leg):
#   MCORE_TORCH_EXPERTS_LEG=0.19.2 MCORE_TORCH_EXPERTS_EXAMPLE=hf_roundtrip bash scripts/run_example.sh
# Arguments go to the example. On a host without CUDA (and always for the CPU-only round trip) the
# example runs through the test side's launcher, tests/support/run_on_cpu.py, which applies the
# patches Megatron needs on the CPU first. (-W: Megatron's import-time notes that Transformer
# Engine and Apex are absent; the examples need neither.)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/legs.sh
leg=${MCORE_TORCH_EXPERTS_LEG:-0.16.1}
example=${MCORE_TORCH_EXPERTS_EXAMPLE:-finetune_lora}
if [ ! -f "examples/$example.py" ]; then
  echo "MCORE_TORCH_EXPERTS_EXAMPLE=$example: no examples/$example.py; choose one of:" \
    $(cd examples && ls *.py | grep -v '^single_process.py$' | sed 's/\.py$//') >&2
  exit 2
fi
setup_leg "$leg"
if [ "$example" = hf_roundtrip ] \
    || ! leg_run "$leg" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  leg_run "$leg" -W ignore::UserWarning tests/support/run_on_cpu.py "examples/$example.py" "$@"
else
  leg_run "$leg" -W ignore::UserWarning "examples/$example.py" "$@"
fi
