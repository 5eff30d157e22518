#!/usr/bin/env bash
# scripts/gpu_client_routes.sh on the project's GPU machine, which has no network: each stack
# installed from the carried wheels (tests/device/offline.sh: install_stack), then the routes run
# on it, all into one OUT_DIR and one table.
#   WHEELS=/tmp/whl bash tests/device/client_routes.sh OUT_DIR [route@stack ...]
# Stacks: 0.19.2 (megatron-core 0.19.2, Megatron-Bridge 0.6.2) and 0.20.0 (NeMo-RL main
# 7ea279ab's pins: megatron-core 0.20.0, Megatron-Bridge 0.7.0, with NeMo-RL's source).
# Default: megatron-lm@0.19.2 bridge-finetune@0.19.2 megatron-lm@0.20.0 bridge-finetune@0.20.0
# nemo-rl@0.20.0. Transformer Engine from /tmp/te/site (../shared/te-h200/README.md).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: tests/device/client_routes.sh OUT_DIR [route@stack ...]}"
shift
[ $# -gt 0 ] || set -- megatron-lm@0.19.2 bridge-finetune@0.19.2 megatron-lm@0.20.0 \
  bridge-finetune@0.20.0 nemo-rl@0.20.0
source tests/device/offline.sh
status=0
for route_stack in "$@"; do
  stack=${route_stack#*@}
  mkdir -p "$out/install"
  install_stack "$stack" 2>&1 | tee -a "$out/install/$stack.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "[$route_stack] install failed"; status=1; continue; }
  PYTHONPATH=$(stack_path "$stack") bash scripts/gpu_client_routes.sh "$out" "$route_stack" \
    || status=1
done
exit "$status"
