#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py on the H200 device machine with Transformer Engine, as
# docs/enable.md says to run it: the documented flags against TEGroupedMLP (benchmarks/
# megatron_lm_run.py). The Megatron-LM checkout is made from what a user has: the megatron-core
# 0.19.2 wheel (carried in .whl) and Megatron-LM's repo-root scripts at core_r0.19.0 with the
# dataset helpers' Makefile (tests/third_party/megatron_lm/core_r0.19.0). TE as
# ../shared/te-h200/README.md says (five copy calls, then install.sh in the same call):
#   bash .te/install.sh && bash scripts/gpu_megatron_lm.sh OUT_DIR [megatron_lm_run.py options]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu_megatron_lm.sh OUT_DIR [options]}"
shift
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
checkout=/tmp/megatron-lm
rm -rf "$checkout" && mkdir -p "$checkout"
cp -r /tmp/site/megatron "$checkout/"
cp -r tests/third_party/megatron_lm/core_r0.19.0/. "$checkout/"
touch "$checkout"/megatron/core/datasets/helpers_cpp*.so  # built by the wheel: make has nothing to do
export PYTHONPATH="/tmp/te/site:/tmp/site:$PWD" PYTHONUNBUFFERED=1
python3 benchmarks/megatron_lm_run.py --megatron-lm "$checkout" --out-dir "$out" "$@"
