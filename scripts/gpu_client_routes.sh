#!/usr/bin/env bash
# The client routes on one GPU with Transformer Engine, each through the client's own entry point
# with the settings docs/enable.md gives, ours against the stock experts, on each stack it runs on;
# then one table (benchmarks/client_routes_report.py: OUT_DIR/client_routes.md).
#   route@stack              entry point
#   megatron-lm@0.19.2       Megatron-LM's pretrain_gpt.py (scripts/gpu_megatron_lm.sh)
#   megatron-lm@0.20.0
#   bridge-finetune@0.19.2   Megatron-Bridge's pretrain() -> finetune() -> stop -> resume
#   bridge-finetune@0.20.0   (benchmarks/bridge_finetune_run.py)
#   nemo-rl@0.20.0           NeMo-RL's Megatron policy worker, GRPO steps, save, resume
#                            (benchmarks/nemo_rl_run.py)
# Stacks: 0.19.2 is megatron-core 0.19.2 with Megatron-Bridge 0.6.2; 0.20.0 is what NeMo-RL's main
# (7ea279ab) pins: megatron-core 0.20.0 (Megatron-LM 14346b65), Megatron-Bridge 0.7.0 (8c46dc42).
#
#   bash scripts/gpu_client_routes.sh OUT_DIR [route@stack ...]      (default: all five)
# Each route's options: MEGATRON_LM_OPTIONS, BRIDGE_FINETUNE_OPTIONS, NEMO_RL_OPTIONS.
#
# python3 must import torch (CUDA) and Transformer Engine (/tmp/te/site goes first on PYTHONPATH
# where it exists: ../shared/te-h200/README.md). Each stack is installed once into /tmp/stack-X
# from the wheels scripts/gpu_stack_wheels.sh makes (WHEELS, default .whl): megatron-core and
# Bridge; nvidia-resiliency-ext 0.7.0 and what Bridge's training modules and NeMo-RL's worker
# import, each only where the machine lacks its distribution (transformers and its tokenizers:
# NeMo-RL's bounds, in the 0.20.0 stack); NeMo-RL's source and recipes. Nothing is stood in for.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu_client_routes.sh OUT_DIR [route@stack ...]}"
shift
mkdir -p "$out" && out=$(cd "$out" && pwd)
wheels=$(cd "${WHEELS:-.whl}" && pwd) || exit 1
[ $# -gt 0 ] || set -- megatron-lm@0.19.2 bridge-finetune@0.19.2 megatron-lm@0.20.0 \
  bridge-finetune@0.20.0 nemo-rl@0.20.0
base_path=""
[ -d /tmp/te/site ] && base_path=/tmp/te/site

install_stack() {  # stack -> /tmp/stack-<stack>, /tmp/stack-<stack>-extra (and -nrl), made once
  local stack=$1 site=/tmp/stack-$1 tag wheel name
  [ -f "$site/.complete" ] && return 0
  case "$stack" in
    0.19.2) tag=mc019 ;;
    0.20.0) tag=mc020 ;;
    *) echo "gpu_client_routes: no stack $stack (0.19.2 or 0.20.0)"; return 1 ;;
  esac
  rm -rf "$site" "$site-extra" "$site-nrl"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "$wheels/$tag"/*.whl || return 1
  # The megatron-core wheel ships the dataset helpers built but not their Makefile, and Bridge's
  # and Megatron-LM's training entries run `make` in that folder first (it fails without one):
  # Megatron-LM's Makefile, with nothing left to build.
  cp tests/integration/megatron_lm/third_party/megatron_lm/core_r0.19.0/megatron/core/datasets/Makefile \
    "$site/megatron/core/datasets/" && touch "$site"/megatron/core/datasets/helpers_cpp*.so \
    || return 1
  # One wheel per distribution (NeMo-RL's version where both folders have one), and only those
  # the machine lacks.
  declare -A chosen=()
  for wheel in "$wheels"/common/*.whl $([ "$stack" = 0.20.0 ] && echo "$wheels"/nrl/*.whl); do
    name=$(basename "$wheel" | cut -d- -f1 | tr 'A-Z_' 'a-z-')
    chosen[$name]=$wheel
  done
  local missing=()
  for name in "${!chosen[@]}"; do
    if [ "$name" = transformers ] || [ "$name" = tokenizers ] || ! PYTHONPATH=$base_path python3 -c \
        "import importlib.metadata as m, sys; m.distribution(sys.argv[1])" "$name" 2>/dev/null; then
      missing+=("${chosen[$name]}")
    fi
  done
  echo "[stack $stack] megatron-core and Bridge into $site; what the machine lacks into" \
    "$site-extra: $(for w in "${missing[@]}"; do basename "$w" | cut -d- -f1-2; done | sort | tr '\n' ' ')"
  # Their own folder: Megatron-Energon installs under megatron/ (a namespace package), which
  # $site holds already and a second pip --target would skip.
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target \
    "$site-extra" "${missing[@]}" || return 1
  if [ "$stack" = 0.20.0 ]; then
    mkdir -p "$site-nrl" && cp -r "$wheels/nrl/nemo_rl" "$site-nrl/" \
      && cp -r "$wheels/nrl/examples/configs" "$site-nrl/nemo_rl_configs" || return 1
  fi
  touch "$site/.complete"
}

stack_path() {  # stack -> its PYTHONPATH
  local site=/tmp/stack-$1
  echo "${base_path:+$base_path:}$site:$site-extra${2:+:$site-nrl}:$PWD:$PWD/tests"
}

for route_stack in "$@"; do
  route=${route_stack%@*}
  stack=${route_stack#*@}
  dir="$out/$route_stack"
  mkdir -p "$dir"
  echo "===== $route on stack $stack ====="
  start=$SECONDS
  if ! install_stack "$stack" 2>&1 | tee "$dir/install.log"; then
    echo "install failed" > "$dir/exit"
    continue
  fi
  (
    case "$route" in
      megatron-lm)
        export PYTHONPATH; PYTHONPATH=$(stack_path "$stack")
        # shellcheck disable=SC2086
        bash scripts/gpu_megatron_lm.sh "$dir" ${MEGATRON_LM_OPTIONS:-} ;;
      bridge-finetune)
        export PYTHONPATH; PYTHONPATH=$(stack_path "$stack")
        # shellcheck disable=SC2086
        python3 benchmarks/bridge_finetune_run.py --out-dir "$dir" ${BRIDGE_FINETUNE_OPTIONS:-} ;;
      nemo-rl)
        export PYTHONPATH; PYTHONPATH=$(stack_path "$stack" nrl)
        # shellcheck disable=SC2086
        python3 benchmarks/nemo_rl_run.py --out-dir "$dir" ${NEMO_RL_OPTIONS:-} ;;
      *) echo "gpu_client_routes: no route $route"; exit 2 ;;
    esac
  ) 2>&1 | tee "$dir/run.log"
  echo "${PIPESTATUS[0]}" > "$dir/exit"
  echo "[$route_stack] exit $(cat "$dir/exit") in $((SECONDS - start)) s"
done
PYTHONPATH=$PWD python3 benchmarks/client_routes_report.py "$out"
