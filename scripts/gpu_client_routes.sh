#!/usr/bin/env bash
# The client routes on one GPU with Transformer Engine, each through the client's own entry point
# with the settings docs/enable.md gives, ours against the stock experts, on the stack installed
# here; then one table of every route run into OUT_DIR (benchmarks/client_routes_report.py:
# OUT_DIR/client_routes.md).
#   route            entry point                                      the stack it needs
#   megatron-lm      Megatron-LM's pretrain_gpt.py                    megatron-core 0.19 or 0.20
#                    (scripts/gpu_megatron_lm.sh)
#   bridge-finetune  Megatron-Bridge's pretrain() -> finetune() ->    megatron-core 0.19.2 with
#                    stop -> resume (benchmarks/bridge_finetune_run.py)  Megatron-Bridge 0.6.2, or
#                                                                     0.20.0 with 0.7.0; and
#                                                                     nvidia-resiliency-ext
#   nemo-rl          NeMo-RL's Megatron policy worker, GRPO steps,    NeMo-RL main (7ea279ab) with
#                    save, resume (benchmarks/nemo_rl_run.py)         what it pins: megatron-core
#                                                                     0.20.0, Bridge 0.7.0
#
#   bash scripts/gpu_client_routes.sh OUT_DIR [route[@version] ...]
# Default: megatron-lm and bridge-finetune, and nemo-rl where NeMo-RL imports. A route named with
# a version (bridge-finetune@0.20.0) runs only where that megatron-core is installed. Each route's
# results land in OUT_DIR/<route>@<megatron-core version>: run it once per environment (say
# megatron-core 0.19.2 with Bridge 0.6.2, then NeMo-RL's pins) into one OUT_DIR for one table.
# Each route's options: MEGATRON_LM_OPTIONS, BRIDGE_FINETUNE_OPTIONS, NEMO_RL_OPTIONS.
# python3 must import torch (CUDA), Transformer Engine and the route's stack.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu_client_routes.sh OUT_DIR [route[@version] ...]}"
shift
mkdir -p "$out" && out=$(cd "$out" && pwd)
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/tests" PYTHONUNBUFFERED=1
version=$(python3 -c "import megatron.core as m; print(m.__version__.split('+')[0])" 2>/dev/null | tail -n 1)
[ -n "$version" ] || { echo "gpu_client_routes: megatron-core does not import"; exit 1; }
if [ $# -eq 0 ]; then
  set -- megatron-lm bridge-finetune
  python3 -c "import nemo_rl" 2>/dev/null && set -- "$@" nemo-rl
fi
status=0
for route in "$@"; do
  if [ "$route" != "${route%@*}" ]; then
    if [ "${route#*@}" != "$version" ]; then
      echo "gpu_client_routes: $route asks for megatron-core ${route#*@}, but $version is installed:" \
        "install that stack (docs/enable.md) or name the route without @"
      status=1
      continue
    fi
    route=${route%@*}
  fi
  case "$route" in
    megatron-lm|bridge-finetune|nemo-rl) ;;
    *) echo "gpu_client_routes: no route $route (megatron-lm, bridge-finetune, nemo-rl)"; status=1; continue ;;
  esac
  dir="$out/$route@$version"
  mkdir -p "$dir"
  echo "===== $route on megatron-core $version ====="
  start=$SECONDS
  (
    case "$route" in
      # shellcheck disable=SC2086
      megatron-lm) bash scripts/gpu_megatron_lm.sh "$dir" ${MEGATRON_LM_OPTIONS:-} ;;
      # shellcheck disable=SC2086
      bridge-finetune) python3 benchmarks/bridge_finetune_run.py --out-dir "$dir" ${BRIDGE_FINETUNE_OPTIONS:-} ;;
      # shellcheck disable=SC2086
      nemo-rl) python3 benchmarks/nemo_rl_run.py --out-dir "$dir" ${NEMO_RL_OPTIONS:-} ;;
    esac
  ) 2>&1 | tee "$dir/run.log"
  echo "${PIPESTATUS[0]}" > "$dir/exit"
  [ "$(cat "$dir/exit")" = 0 ] || status=1
  echo "[$route@$version] exit $(cat "$dir/exit") in $((SECONDS - start)) s"
done
python3 benchmarks/client_routes_report.py "$out"
exit "$status"
