#!/usr/bin/env bash
# The H200 expert benchmark (issue 7), run on the device machine from the repository root:
#   bash scripts/gpu_bench.sh "$OUT" [bench_experts.py options, e.g. --quick --shapes super-ep4]
# with `.whl` carried. That machine has torch and triton but no megatron-core and no internet:
# the carried wheel (.whl/megatron_core-0.16.1-cp312-*.whl; torch, numpy, packaging and einops
# are already there) is installed into /tmp/site. Results and the log land in the given folder.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu_bench.sh OUT_DIR [bench_experts.py options]}"
shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
mkdir -p "$out"
python3 benchmarks/bench_experts.py --out-dir "$out" "$@" 2>&1 | tee "$out/log.txt"
