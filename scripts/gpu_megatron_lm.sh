#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py on a GPU with Transformer Engine, as docs/enable.md says to
# run it: the documented flags against TEGroupedMLP (benchmarks/megatron_lm_run.py).
#   bash scripts/gpu_megatron_lm.sh OUT_DIR [megatron_lm_run.py options]
# The Megatron-LM checkout is made from what a user has: the installed megatron-core 0.19 (or the
# wheel in .whl/ on a machine without network: scripts/gpu_env.sh) and Megatron-LM's repo-root
# scripts at core_r0.19.0 with the dataset helpers' Makefile
# (tests/third_party/megatron_lm/core_r0.19.0). python3 must import torch (CUDA) and TE.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu_megatron_lm.sh OUT_DIR [options]}"
shift
mkdir -p "$out"
source scripts/gpu_env.sh
gpu_env || exit 1
checkout=/tmp/megatron-lm
rm -rf "$checkout" && mkdir -p "$checkout"
megatron=$(python3 -c "import megatron.core, os; print(os.path.dirname(os.path.dirname(megatron.core.__file__)))") \
  || { echo "gpu_megatron_lm: megatron-core does not import"; exit 1; }
mkdir -p "$checkout/megatron" && cp -r "$megatron/core" "$megatron/training" "$checkout/megatron/"
cp -r tests/third_party/megatron_lm/core_r0.19.0/. "$checkout/"
touch "$checkout"/megatron/core/datasets/helpers_cpp*.so  # built by the wheel: make has nothing to do
python3 benchmarks/megatron_lm_run.py --megatron-lm "$checkout" --out-dir "$out" "$@"
