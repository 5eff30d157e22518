#!/usr/bin/env bash
# The Transformer Engine stack on N >= 2 GPUs of one host, in one device call of about 9 minutes
# at most: the distributed parity suite with TE (scripts/gpu_distributed.sh, REQUIRE_TE=1: TE-spec
# layers, TEGroupedMLP against TorchGroupedMLP at EP=2, ETP=2, TP=2+SP with EP=2, alltoall with
# shared experts and the FP32 combine, checkpoints TE -> torch -> TE; on 4 GPUs also EP=4 and
# EP=2 x ETP=2), then the RL cycle on the TE stack at EP=N (benchmarks/bench_cycle.py under
# torchrun: arms te, te-cutlass, torch interleaved, the Super-like slice with 128 experts per rank,
# then Qwen3-30B-A3B; median and range, peak memory of the highest rank).
#
# python3 must import torch (CUDA), Transformer Engine, megatron-core 0.19 and megatron-bridge 0.6:
#   bash scripts/gpu_multi.sh "$OUT" [more bench_cycle.py options]
# Writes "$OUT/summary.txt" (the parity output and the cycle report) and "$OUT/gpu_multi.tar.gz"
# (every log and rank's JSON, the cycle's results.md, results.json and log). BUDGET_S (default
# 540) bounds the whole run: the parity suite gets PARITY_S of it (default 270), the benchmark
# what is left (it writes its report after every slice, so a cut run keeps the finished slices).
# EP (default: every GPU), PROFILE=1 (profile every arm's update pass: minutes more),
# SKIP_PARITY=1, SKIP_CYCLE=1.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu_multi.sh OUT_DIR [bench_cycle.py options]}"
shift
start=$SECONDS
source scripts/gpu_env.sh
gpu_env || exit 1
# NVLink multicast stays off: on shared hosts it can put every GPU out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=4
work="$out/gpu_multi"
mkdir -p "$work/cycle"
python3 -W ignore -c "import torch, transformer_engine as te, megatron.core as m; print(f'[gpu_multi] {torch.cuda.device_count()} x {torch.cuda.get_device_name()}, torch {torch.__version__}, Transformer Engine {te.__version__}, megatron-core {m.__version__}')" \
  2>&1 | tail -n 1 | tee "$work/versions.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_multi: Transformer Engine does not import"; exit 1; }
ep=${EP:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
parity=skipped cycle=skipped

if [ "${SKIP_PARITY:-0}" != 1 ]; then
  OUT_DIR="$work/distributed" REQUIRE_TE=1 LAUNCH_TIMEOUT=150 \
    timeout -k 10 "${PARITY_S:-270}" bash scripts/gpu_distributed.sh 2>&1 | tee "$work/distributed.txt"
  parity="exit ${PIPESTATUS[0]}"
fi
if [ "${SKIP_CYCLE:-0}" != 1 ]; then
  left=$(( ${BUDGET_S:-540} - (SECONDS - start) ))
  echo "[gpu_multi] the cycle at EP=$ep on $ep GPUs, $left s at most"
  timeout -k 20 "$left" python3 -m torch.distributed.run --standalone --nproc-per-node "$ep" \
    benchmarks/bench_cycle.py --ep "$ep" --stack te --arms te,te-cutlass,torch \
    --slices nemotron-3-super:4:3,qwen3-30b-a3b:4:3 --warmup 1 \
    "$([ "${PROFILE:-0}" = 1 ] && echo --profile || echo --no-profile)" \
    --out-dir "$work/cycle" "$@" >"$work/cycle/log.txt" 2>&1
  cycle="exit $?"
  grep -E "^\[cycle\] \[" "$work/cycle/log.txt" | tail -n 20
fi

{
  cat "$work/versions.txt"
  [ -f "$work/distributed.txt" ] && cat "$work/distributed.txt"
  [ -f "$work/cycle/results.md" ] && cat "$work/cycle/results.md"
  echo "gpu_multi: parity suite ($parity), cycle at EP=$ep ($cycle), $((SECONDS - start)) s"
} >"$out/summary.txt"
# One tarball (the checkpoints left out): few files come back.
tar -czf "$out/gpu_multi.tar.gz" -C "$out" --exclude='ckpt_*' gpu_multi && rm -rf "$work"
tail -n 1 "$out/summary.txt"
status=0
for result in "$parity" "$cycle"; do
  case "$result" in "exit 0" | skipped) ;; *) status=1 ;; esac
done
exit $status
