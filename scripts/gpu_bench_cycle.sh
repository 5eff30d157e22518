#!/usr/bin/env bash
# The RL cycle on the Transformer Engine stack, on one H200, from the repository root:
#   bash scripts/gpu_bench_cycle.sh "$OUT" [more bench_cycle.py options]
# Expects Transformer Engine, megatron-core 0.19 and megatron-bridge 0.6 installed. First the CPU-sized smoke
# (tests/test_bench_smoke.py, which on a CUDA host with TE runs the tiny TE-stack arms, a minute),
# then the benchmark: the Super-like slice first (the headline), then Qwen3-30B-A3B at 4 and 16 MoE
# layers (16 layers: 3 measured rounds, not profiled). SKIP_SMOKE=1 leaves the smoke out;
# EXPERT_ADAPTERS=shared,per_expert adds the per-expert layout as more arms, `--adapters
# ours,bridge` both adapter sources (each a variant of every arm; one arm's model on the device at
# a time). Profiled slices get --profile-rounds (default 3) profiled update passes per arm: the
# report's MoE side against the expert-GEMM kernel time is the median (min–max) over those.
# The MoE-side run (six arms), one slice per call, each near 5 minutes (the 16-layer slice
# measured, not profiled):
#   SKIP_SMOKE=1 EXPERT_ADAPTERS=shared,per_expert bash scripts/gpu_bench_cycle.sh "$OUT/super" \
#     --slices nemotron-3-super:4:3 --adapters ours --warmup 1
#   SKIP_SMOKE=1 EXPERT_ADAPTERS=shared,per_expert bash scripts/gpu_bench_cycle.sh "$OUT/qwen16" \
#     --slices qwen3-30b-a3b:16:3 --adapters ours --warmup 1
# Results (results.md, results.json, breakdown-*.png) and log.txt land in "$OUT/cycle".
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu_bench_cycle.sh OUT_DIR [bench_cycle.py options]}"
shift
source scripts/gpu_env.sh
gpu_env || exit 1
mkdir -p "$out/cycle"
python3 -c "import transformer_engine as te, megatron.core as mc, megatron.bridge; \
print('TE', te.__version__, 'megatron-core', mc.__version__)"
if [ "${SKIP_SMOKE:-0}" != 1 ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_bench_smoke.py 2>&1 | tail -15 \
    | tee "$out/smoke.txt" || echo "[gpu_bench_cycle] the smoke failed (smoke.txt); benchmark next"
fi
# The default slices unless the options name their own (the report prints the command as run).
slices=(--slices nemotron-3-super:4,qwen3-30b-a3b:4,qwen3-30b-a3b:16:3)
for arg in "$@"; do case "$arg" in --slices|--slices=*) slices=() ;; esac; done
python3 benchmarks/bench_cycle.py --out-dir "$out/cycle" \
  --stack te --expert-adapters "${EXPERT_ADAPTERS:-shared}" \
  "${slices[@]}" "$@" 2>&1 | tee "$out/cycle/log.txt"
