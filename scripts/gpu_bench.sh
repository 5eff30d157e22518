#!/usr/bin/env bash
# The H200 benchmarks, run on the device machine from the repository root, with `.whl` carried:
#   bash scripts/gpu_bench.sh "$OUT" [bench_experts.py options, e.g. --quick --shapes super-ep4]
#   bash scripts/gpu_bench.sh "$OUT" cycle [bench_cycle.py options, e.g. --slices qwen3-30b-a3b:4]
#   (the cycle on the local spec, no Transformer Engine; with TE: scripts/gpu_bench_cycle.sh)
# That machine has torch and triton but no megatron-core and no internet: the carried wheel
# (.whl/megatron_core-0.16.1-cp312-*.whl; torch, numpy, packaging and einops are already there)
# is installed into /tmp/site. Results (markdown, JSON, plots) and the log land in the given folder.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu_bench.sh OUT_DIR [cycle] [benchmark options]}"
shift
script=benchmarks/bench_experts.py
if [ "${1:-}" = cycle ]; then
  script=benchmarks/bench_cycle.py
  shift
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
mkdir -p "$out"
python3 "$script" --out-dir "$out" "$@" 2>&1 | tee "$out/log.txt"
