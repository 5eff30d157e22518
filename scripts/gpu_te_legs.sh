#!/usr/bin/env bash
# The TE tests on the older megatron-core releases, on a machine with one CUDA GPU:
#   bash scripts/gpu_te_legs.sh OUT_DIR [LEGS] [-- pytest files]
# For each leg (default 0.16.1 0.17.1 0.18.2) that megatron-core release goes into its own
# /tmp/site-LEG, and the TE test files plus the CUDA-host and model files run against it with
# Transformer Engine importable, the legs side by side (pytest-xdist, 4 workers each).
# megatron-bridge 0.6 needs megatron-core 0.19, so Bridge's tests skip on these legs, saying so.
#
# python3 must import torch (CUDA) and Transformer Engine (pip install .[te], or NVIDIA's PyTorch
# container; checked with 2.20.2), pytest and pytest-xdist. Each leg's megatron-core comes from
# pip (pip install --no-deps megatron-core==LEG --target /tmp/site-LEG; pip's own settings apply,
# PIP_FIND_LINKS and PIP_NO_INDEX for wheels on disk).
# LEG_TIMEOUT (default 540 s) bounds each leg: on an H200 the three legs side by side took 7 min
# 20 s; under a tighter limit run fewer legs per call. Every test's result is logged as it ends
# (pytest -v), and the timeout interrupts pytest (SIGINT) so that it still prints its summary: a
# leg cut off by the timeout still names its failures.
# Prints them and one summary line per leg; exits non-zero when a leg fails.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu_te_legs.sh OUT_DIR [LEGS] [-- pytest files]}"
shift
legs=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do legs+=("$1"); shift; done
[ "${1:-}" = -- ] && shift
[ ${#legs[@]} -gt 0 ] || legs=(0.16.1 0.17.1 0.18.2)
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(tests/unit/test_te_lora.py tests/unit/test_te_parity.py tests/unit/megatron/test_te_convert.py
  tests/unit/test_te_fusions.py tests/unit/test_te_hybrid.py tests/unit/test_cuda_host.py tests/unit/test_gpu.py
  tests/unit/megatron/test_specs.py tests/unit/megatron/test_convert.py tests/unit/test_lora.py tests/unit/megatron/test_recompute.py
  tests/unit/test_hybrid.py tests/unit/test_experts.py tests/unit/test_checkpoint.py
  tests/unit/megatron/test_moe_layer.py)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c "import transformer_engine as te; print('Transformer Engine', te.__version__)" 2>/dev/null \
  | tail -n 1 | grep -q "Transformer Engine" \
  || { echo "gpu_te_legs: Transformer Engine does not import" \
         "(pip install .[te], or NVIDIA's PyTorch container)"; exit 1; }
for leg in "${legs[@]}"; do
  python3 -m pip install -q --no-deps --no-compile --no-cache-dir --upgrade \
    --target "/tmp/site-$leg" "megatron-core==$leg" \
    || { echo "gpu_te_legs: pip cannot install megatron-core $leg"; exit 1; }
done
pids=()
for leg in "${legs[@]}"; do
  (
    export PYTHONPATH="/tmp/site-$leg${PYTHONPATH:+:$PYTHONPATH}:$PWD:$PWD/tests"
    python3 -W ignore -c "import megatron.core as m, transformer_engine as te, torch; \
print(f'[te leg {m.__version__}] torch {torch.__version__}, Transformer Engine {te.__version__}')"
    timeout -s INT -k 30 "${LEG_TIMEOUT:-540}" python3 -m pytest -v -p no:cacheprovider -rfEs -n 4 \
      --dist loadfile --junitxml="$out/junit-$leg.xml" "${files[@]}"
  ) > "$out/te_leg_$leg.log" 2>&1 &
  pids+=($!)
done
status=0
for i in "${!legs[@]}"; do
  wait "${pids[$i]}"
  rc=$?
  [ "$rc" -eq 0 ] || status=1
  leg=${legs[$i]}
  grep -E "^(FAILED|ERROR) |\] (FAILED|ERROR) " "$out/te_leg_$leg.log" | head -n 20
  line=$(grep -E "^=*\s*[0-9]+ (passed|failed|error)" "$out/te_leg_$leg.log" | tail -n 1 \
    | sed -E 's/=+//g; s/^ +| +$//g')
  echo "gpu_te_legs: megatron-core $leg with TE: ${line:-no summary} (exit $rc)"
done
exit "$status"
