#!/usr/bin/env bash
# The single-GPU checks, from the repository root, with megatron-core installed (and for the
# Bridge tests megatron-bridge):
#   bash scripts/gpu_checks.sh OUT_DIR
# Runs the CUDA tests (bf16 parity, no host syncs, fused activation, the flex dispatcher contract
# (megatron-core 0.19), the FP32-combine layer with
# the alltoall dispatcher and shared experts, Megatron-Bridge LoRA, weights replaced or moved to
# CUDA, hooks under the fused kernel choice) and the main
# job, on whichever megatron-core wheel is carried. Logs land in OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu_checks.sh OUT_DIR}"
mkdir -p "$out"
source scripts/gpu_env.sh
gpu_env || exit 1
status=0
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__, torch.cuda.get_device_name())" | tee "$out/checks.log"
python3 -m pytest -p no:cacheprovider -rs tests/unit/test_gpu.py tests/unit/megatron/test_moe_layer.py tests/unit/test_combine.py \
  tests/integration/bridge/test_bridge_lora.py tests/unit/test_packing.py tests/unit/kernels/test_fused_experts_triton.py tests/unit/test_flex_contract.py 2>&1 | tee -a "$out/checks.log" || status=1
(cd examples && python3 -W ignore::UserWarning finetune_lora.py --out-dir /tmp/finetune_lora) \
  2>&1 | tee "$out/finetune_lora.log" || status=1
cp /tmp/finetune_lora/loss_curve.png "$out/finetune_loss_curve.png" 2>/dev/null
echo "gpu_checks: $([ $status -eq 0 ] && echo PASSED || echo FAILED)"
exit $status
