# Sourced by the scripts/gpu_*.sh: `gpu_env [WHEEL_DIR]` makes what a GPU run imports reachable.
# Where Transformer Engine, megatron-core and megatron-bridge are installed (pip, or NVIDIA's
# PyTorch container), it only puts the repository and tests/ (the test side's `support`) on
# PYTHONPATH. A machine without network brings wheels instead: those in WHEEL_DIR (default .whl)
# are installed into /tmp/site, and /tmp/te/site (TE installed there) and /tmp/site go in front
# on PYTHONPATH, each only where it exists.
gpu_env() {
  local wheels=${1:-.whl} path="" dir
  if compgen -G "$wheels/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "$wheels"/*.whl || return 1
  fi
  for dir in /tmp/te/site /tmp/site; do [ -d "$dir" ] && path="$path$dir:"; done
  # tests/: the test side's `support` package (CPU patch table, Bridge's import without TE),
  # which the torchrun workers and test workers import.
  export PYTHONPATH="$path$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
}
