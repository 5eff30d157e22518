#!/usr/bin/env bash
# The Transformer Engine leg, on a machine with one CUDA GPU:
#   bash scripts/gpu_te.sh OUT_DIR [pytest arguments, default: tests]
# Runs the whole test suite with TE importable (CPU tests keep their models on the CPU, CUDA tests
# run on the GPU, the TE tests tests/unit/test_te_*.py and
# tests/integration/bridge/test_te_multi_lora.py run instead of skipping), prints the parity
# figures of tests/unit/test_te_parity.py, then runs the main job with every layer from Megatron's TE
# spec (examples/finetune_lora.py --transformer-engine). Ends with one summary line; the logs and
# junit.xml land in OUT_DIR.
#
# python3 must import torch (CUDA), Transformer Engine (pip install .[te], or NVIDIA's PyTorch
# container, which ships it; checked with 2.20.2), megatron-core 0.19 (scripts/gpu_te_legs.sh
# runs the TE tests on 0.16 to 0.18), megatron-bridge 0.6 for Bridge's tests (they skip without
# it), pytest and pytest-xdist (both in pip install .[te,test]).
set -uo pipefail
# torch's deterministic cuBLAS (tests/unit/test_batch_invariance.py's deterministic-algorithms arms) needs
# the workspace pinned before CUDA starts.
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu_te.sh OUT_DIR [pytest arguments]}"
shift
mkdir -p "$out"
source scripts/gpu_env.sh
gpu_env || exit 1
python3 -W ignore -c "import torch, transformer_engine as te, megatron.core as m; print(f'[te leg] torch {torch.__version__}, Transformer Engine {te.__version__}, megatron-core {m.__version__}, {torch.cuda.get_device_name()}')" \
  2>&1 | tee "$out/te_leg.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_te: Transformer Engine does not import"; exit 1; }
# One pytest worker per test file (pytest-xdist): the files run in parallel on the 16 cores. One
# line per test (-v), and each failure's traceback as it happens (tests/conftest.py), so a run cut
# short by a time limit still names what failed before it, and why.
export MCORE_TORCH_EXPERTS_FAILURES_AT_ONCE=1
python3 -m pytest -v -p no:cacheprovider -rs -n 8 --dist loadfile --junitxml="$out/junit.xml" \
  "${@:-tests}" 2>&1 | tee -a "$out/te_leg.log"
suite=${PIPESTATUS[0]}
# The parity gate's figures (errors against the FP64 loop, TorchGroupedMLP and TEGroupedMLP).
python3 -m pytest -q -s -p no:cacheprovider tests/unit/test_te_parity.py -k "test_experts_match or model_shapes" 2>&1 \
  | grep -E "^\[te parity\]" | tee "$out/te_parity.log"
(cd examples && python3 -W ignore::UserWarning finetune_lora.py --transformer-engine \
  --out-dir /tmp/finetune_lora_te) 2>&1 | tee "$out/finetune_lora_te.log"
job=${PIPESTATUS[0]}
line=$(grep -E "^=*\s*[0-9]+ (passed|failed|error)" "$out/te_leg.log" | tail -n 1 | sed -E 's/=+//g; s/^ +| +$//g')
echo "gpu_te: suite ${line:-no summary} (exit $suite); main job --transformer-engine: $([ "$job" -eq 0 ] && echo passed || echo "FAILED (exit $job)")"
[ "$suite" -eq 0 ] && [ "$job" -eq 0 ]
