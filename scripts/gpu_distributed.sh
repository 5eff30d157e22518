#!/usr/bin/env bash
# Expert (EP=2), expert-tensor (ETP=2) and tensor+sequence (TP=2 SP, EP=2) parallel parity of a
# full MoE layer on two GPUs (NCCL, bf16), allgather and alltoall dispatchers; at EP=2 also the
# alltoall layer with shared experts (overlapped or not) and the FP32 combine; plus the
# distributed-checkpoint round trips: the CPU suite's torchrun workers (tests/distributed/) with
# --device cuda.
#
# Run from the repository root with megatron-core importable and the repository on PYTHONPATH:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
#   bash scripts/gpu_distributed.sh
# Prints one parity table; exits non-zero if any check fails (the failing worker's log is shown).
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

launch() {  # launch NAME WORKER ARGS...: one torchrun launch of 2 processes, 300 s at most
  local name=$1 worker=$2 start=$SECONDS rc
  shift 2
  timeout -k 10 300 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 2 \
    "tests/distributed/$worker" --device cuda --out "$OUT/$name" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "[$name] exit $rc after $((SECONDS - start)) s (log: $OUT/$name.log)"
  if [ $rc -ne 0 ]; then
    status=1
    tail -n 60 "$OUT/$name.log"
  fi
}

launch ep2 moe_parity.py --ep 2 --dispatchers allgather,alltoall --shared-experts
launch etp2 moe_parity.py --etp 2 --dispatchers allgather,alltoall
launch tp2_sp_ep2 moe_parity.py --tp 2 --sp --ep 2 --dispatchers allgather,alltoall
launch checkpoints checkpoint_roundtrip.py
echo
"$PYTHON" tests/distributed/summary.py "$OUT/ep2" "$OUT/etp2" "$OUT/tp2_sp_ep2" || status=1
grep -h "checks passed\|^FAILED\|^rank " "$OUT"/*.log
echo "gpu_distributed: $([ $status -eq 0 ] && echo PASSED || echo FAILED)"
exit $status
