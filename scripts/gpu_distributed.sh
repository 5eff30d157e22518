#!/usr/bin/env bash
# Expert (EP=2), expert-tensor (ETP=2) and tensor+sequence (TP=2 SP, EP=2) parallel parity of a
# full MoE layer on two GPUs (NCCL, bf16), allgather and alltoall dispatchers; at EP=2 also the
# alltoall layer with shared experts (overlapped or not) and the FP32 combine; plus the
# distributed-checkpoint round trips: the CPU suite's torchrun workers (tests/distributed/) with
# --device cuda. On four GPUs or more also EP=4 (with the shared experts) and EP=2 x ETP=2 on 4.
# With Transformer Engine importable every check runs again in the TE spec's layers against
# Megatron's TEGroupedMLP (same global weights; checkpoints TEGroupedMLP -> TorchGroupedMLP ->
# TEGroupedMLP across layouts); without it those rows say skipped, and why (REQUIRE_TE=1: fail).
#
# Run from the repository root with megatron-core (and TE for the TE rows) importable and the
# repository on PYTHONPATH (`source scripts/gpu_env.sh && gpu_env` puts it there):
#   bash scripts/gpu_distributed.sh
# OUT_DIR (default a fresh /tmp folder) receives the logs and each rank's JSON; LAUNCH_TIMEOUT
# (default 300 s) bounds each torchrun launch. Prints one parity table; exits non-zero if any
# check fails (the failing worker's log is shown).
set -uo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast stays off: on shared hosts it can put every GPU out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OMP_NUM_THREADS=4
PYTHON=${PYTHON:-python3}
OUT=${OUT_DIR:-$(mktemp -d /tmp/gpu_distributed.XXXXXX)}
mkdir -p "$OUT"
status=0

gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())") || exit 1
if [ "$gpus" -lt 2 ]; then
  echo "gpu_distributed: needs 2 GPUs, found $gpus" >&2
  exit 1
fi
te=$("$PYTHON" -c "import transformer_engine as te; print(te.__version__)" 2>/dev/null | tail -n 1)
echo "[gpu_distributed] $gpus GPUs; Transformer Engine: ${te:-not importable (the TEGroupedMLP rows are skipped)}"
if [ -z "$te" ] && [ "${REQUIRE_TE:-0}" = 1 ]; then
  echo "gpu_distributed: REQUIRE_TE=1 but Transformer Engine does not import" >&2
  exit 1
fi

launch() {  # launch NAME NPROC WORKER ARGS...: one torchrun launch, LAUNCH_TIMEOUT s at most
  local name=$1 nproc=$2 worker=$3 start=$SECONDS rc
  shift 3
  timeout -k 10 "${LAUNCH_TIMEOUT:-300}" "$PYTHON" -m torch.distributed.run --standalone \
    --nproc_per_node "$nproc" "tests/distributed/$worker" --device cuda --out "$OUT/$name" "$@" \
    >"$OUT/$name.log" 2>&1
  rc=$?
  echo "[$name] exit $rc after $((SECONDS - start)) s (log: $OUT/$name.log)"
  if [ $rc -ne 0 ]; then
    status=1
    tail -n 60 "$OUT/$name.log"
  fi
}

parity=(ep2 etp2 tp2_sp_ep2)
launch ep2 2 moe_parity.py --ep 2 --dispatchers allgather,alltoall --shared-experts
launch etp2 2 moe_parity.py --etp 2 --dispatchers allgather,alltoall
launch tp2_sp_ep2 2 moe_parity.py --tp 2 --sp --ep 2 --dispatchers allgather,alltoall
if [ "$gpus" -ge 4 ]; then
  parity+=(ep4 ep2_etp2)
  launch ep4 4 moe_parity.py --ep 4 --dispatchers allgather,alltoall --shared-experts
  launch ep2_etp2 4 moe_parity.py --ep 2 --etp 2 --dispatchers allgather,alltoall
fi
launch checkpoints 2 checkpoint_roundtrip.py
echo
"$PYTHON" tests/distributed/summary.py "${parity[@]/#/$OUT/}" || status=1
grep -hE "^(SwiGLU|plain) |round trips skipped" "$OUT/checkpoints.log"
grep -h "checks passed\|^FAILED\|^rank \|FP32 combine vs" "$OUT"/*.log
echo "gpu_distributed: $([ $status -eq 0 ] && echo PASSED || echo FAILED)"
exit $status
