#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py on a GPU with Transformer Engine, as docs/enable.md says to
# run it: the documented flags against TEGroupedMLP (benchmarks/megatron_lm_run.py).
#   bash scripts/gpu_megatron_lm.sh OUT_DIR [megatron_lm_run.py options]
# The Megatron-LM checkout is made from what a user has: the installed megatron-core and
# Megatron-LM's repo-root scripts
# of that release (tests/integration/megatron_lm/third_party/megatron_lm/: core_r0.19.0 for 0.19.x, 0.20.0 for 0.20.x),
# with the dataset helpers' Makefile. python3 must import torch (CUDA) and TE.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu_megatron_lm.sh OUT_DIR [options]}"
shift
mkdir -p "$out"
source scripts/gpu_env.sh
gpu_env || exit 1
checkout=/tmp/megatron-lm
rm -rf "$checkout" && mkdir -p "$checkout"
read -r megatron version < <(python3 -c "import megatron.core as m, os; print(os.path.dirname(os.path.dirname(m.__file__)), m.__version__)") \
  || { echo "gpu_megatron_lm: megatron-core does not import"; exit 1; }
case "$version" in
  0.19.*) scripts=core_r0.19.0 ;;
  0.20.*) scripts=0.20.0 ;;
  *) echo "gpu_megatron_lm: no Megatron-LM scripts for megatron-core $version in tests/integration/megatron_lm/third_party/megatron_lm"; exit 1 ;;
esac
mkdir -p "$checkout/megatron" && cp -r "$megatron/core" "$megatron/training" "$checkout/megatron/"
cp -r tests/integration/megatron_lm/third_party/megatron_lm/core_r0.19.0/megatron/. "$checkout/megatron/"  # the Makefile
cp -r "tests/integration/megatron_lm/third_party/megatron_lm/$scripts/." "$checkout/"
touch "$checkout"/megatron/core/datasets/helpers_cpp*.so  # built by the wheel: make has nothing to do
python3 benchmarks/megatron_lm_run.py --megatron-lm "$checkout" --out-dir "$out" "$@"
