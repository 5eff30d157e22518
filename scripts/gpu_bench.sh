#!/usr/bin/env bash
# The GPU benchmarks (the figures in BENCHMARKS.md are from an H200), from the repository root:
#   bash scripts/gpu_bench.sh "$OUT" [bench_experts.py options, e.g. --quick --shapes super-ep4]
#   bash scripts/gpu_bench.sh "$OUT" cycle [bench_cycle.py options, e.g. --slices qwen3-30b-a3b:4]
#   (the cycle on the local spec, no Transformer Engine; with TE: scripts/gpu_bench_cycle.sh)
# python3 must import torch (CUDA), triton and megatron-core. Results (markdown, JSON, plots) and the log land
# in the given folder.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu_bench.sh OUT_DIR [cycle] [benchmark options]}"
shift
script=benchmarks/bench_experts.py
if [ "${1:-}" = cycle ]; then
  script=benchmarks/bench_cycle.py
  shift
fi
source scripts/gpu_env.sh
gpu_env || exit 1
mkdir -p "$out"
python3 "$script" --out-dir "$out" "$@" 2>&1 | tee "$out/log.txt"
