# The project's GPU machine has no network: what a user installs with pip comes as wheels carried
# in git-ignored folders (tests/device/stack_wheels.sh makes them on a machine with network), and
# Transformer Engine as ../shared/te-h200/README.md installs it into /tmp/te/site. Sourced there
# before the scripts/gpu_*.sh, which run in the environment they find:
#   source tests/device/offline.sh
#   offline_site [WHEEL_DIR ...]     the wheels of each folder (default .whl) into /tmp/site;
#                                    exports PYTHONPATH=/tmp/te/site:/tmp/site (those that exist)
#   install_stack STACK              megatron-core + Bridge (+ NeMo-RL for 0.20.0) into /tmp/stack-STACK
#   export PYTHONPATH=$(stack_path STACK)
# WHEELS (default .whl) is the folder tests/device/stack_wheels.sh filled (mc019, mc020, common, nrl).

offline_site() {
  local folder path=""
  for folder in "${@:-.whl}"; do
    if compgen -G "$folder/*.whl" >/dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$folder"/*.whl || return 1
    fi
  done
  for folder in /tmp/te/site /tmp/site; do [ -d "$folder" ] && path="$path${path:+:}$folder"; done
  export PYTHONPATH="$path"
}

install_stack() {  # stack -> /tmp/stack-<stack>, /tmp/stack-<stack>-extra (and -nrl), made once
  local stack=$1 site=/tmp/stack-$1 wheels tag wheel name base_path=""
  [ -f "$site/.complete" ] && return 0
  wheels=$(cd "${WHEELS:-.whl}" && pwd) || return 1
  [ -d /tmp/te/site ] && base_path=/tmp/te/site
  case "$stack" in
    0.19.2) tag=mc019 ;;
    0.20.0) tag=mc020 ;;
    *) echo "install_stack: no stack $stack (0.19.2 or 0.20.0)"; return 1 ;;
  esac
  rm -rf "$site" "$site-extra" "$site-nrl"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "$wheels/$tag"/*.whl || return 1
  # The megatron-core wheel ships the dataset helpers built but not their Makefile, and Bridge's
  # training entry runs `make` in that folder first (docs/enable.md tells users the same):
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
  if [ "$stack" = 0.20.0 ]; then  # NeMo-RL's checkout layout: nemo_rl/ beside examples/configs/
    mkdir -p "$site-nrl/examples" && cp -r "$wheels/nrl/nemo_rl" "$site-nrl/" \
      && cp -r "$wheels/nrl/examples/configs" "$site-nrl/examples/" || return 1
  fi
  touch "$site/.complete"
}

stack_path() {  # stack -> its PYTHONPATH (TE first where /tmp/te/site exists; NeMo-RL for 0.20.0)
  local site=/tmp/stack-$1 te=""
  [ -d /tmp/te/site ] && te=/tmp/te/site:
  echo "$te$site:$site-extra$([ "$1" = 0.20.0 ] && echo ":$site-nrl")"
}
