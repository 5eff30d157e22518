#!/usr/bin/env bash
# NeMo Automodel's GroupedExperts and the FP32 combine on one GPU, from the repository root, with
# nemo-automodel 0.7.0 importable (its experts module needs torch, triton and packaging; no
# Megatron-Core needed; `pip install --no-deps nemo-automodel==0.7.0` is enough):
#   bash scripts/gpu_automodel.sh OUT_DIR [automodel_combine_bench.py options, e.g. --tokens 16384]
# Runs benchmarks/automodel_combine_bench.py (time and peak memory of shipped, the fork's loop and
# fp32_combine; the FP64 check and run-to-run reproducibility), fails when an error against FP64
# exceeds BF16 rounding, then runs it again at 65,536 tokens with 30 GiB of headroom (all other
# free memory held aside): there the shipped module runs out of memory (it needs 33.8 GiB frozen,
# 35.8 trainable) and fp32_combine does not (20.0, 23.8). Both parts took 3.7 minutes on the
# H200 (2026-12-01). Results and logs land in OUT_DIR/automodel and OUT_DIR/automodel/near_oom.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu_automodel.sh OUT_DIR [benchmark options]}/automodel"
shift
source scripts/gpu_env.sh
gpu_env || exit 1
mkdir -p "$out/near_oom"
python3 benchmarks/automodel_combine_bench.py --out-dir "$out" "$@" 2>&1 | tee "$out/log.txt"
python3 - "$out/automodel_combine_bench.json" <<'EOF' | tee -a "$out/log.txt"
import json, sys

BF16_BOUND = 2e-2  # max |error| / max |reference| of BF16 GEMMs against FP64
rows = json.load(open(sys.argv[1]))["checked"]
bad = [r for r in rows if "note" in r or any(v > BF16_BOUND for k, v in r.items()
                                             if k.endswith(" err"))]
for r in bad:
    print("over the bound or failed:", r)
print(f"FP64 check: {'PASSED' if rows and not bad else 'FAILED'} ({len(rows)} rows)")
sys.exit(1 if bad or not rows else 0)
EOF
python3 benchmarks/automodel_combine_bench.py --out-dir "$out/near_oom" --tokens 65536 \
  --headroom-gib 30 2>&1 | tee "$out/near_oom/log.txt"
