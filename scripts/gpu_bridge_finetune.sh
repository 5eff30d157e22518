#!/usr/bin/env bash
# Megatron-Bridge's own finetune() on the H200 device machine with Transformer Engine, with the
# provider settings docs/enable.md gives, against Bridge's stock spec (TEGroupedMLP), with a save
# and resume of the adapters (benchmarks/bridge_finetune_run.py). .whl carries megatron-core
# 0.19.2, megatron-bridge 0.6.2, omegaconf and antlr4-python3-runtime; .whl/bridge (and
# /tmp/bigwhl, where a previous call copied the large ones: scipy, pulp) what Bridge's training
# modules import beyond them, each installed only where the machine lacks that distribution, so
# nothing the image has is shadowed. TE as for scripts/gpu_te.sh:
#   bash .te/install.sh && bash scripts/gpu_bridge_finetune.sh OUT_DIR [bridge_finetune_run.py options]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu_bridge_finetune.sh OUT_DIR [options]}"
shift
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/te/site:/tmp/site:$PWD" PYTHONUNBUFFERED=1
missing=()
for wheel in .whl/bridge/*.whl /tmp/bigwhl/*.whl; do
  [ -f "$wheel" ] || continue
  name=$(basename "$wheel" | cut -d- -f1)
  python3 -c "import importlib.metadata as m, sys; m.distribution(sys.argv[1])" "$name" 2>/dev/null \
    || missing+=("$wheel")
done
echo "gpu_bridge_finetune: installing what the machine lacks: ${missing[*]##*/}"
# Their own target: Megatron-Energon is `megatron/energon`, and `megatron` (a namespace package)
# already holds megatron-core in /tmp/site, which pip --target would not merge into.
[ ${#missing[@]} -eq 0 ] || python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target /tmp/site-bridge "${missing[@]}" || exit 1
export PYTHONPATH="$PYTHONPATH:/tmp/site-bridge"
python3 benchmarks/bridge_finetune_run.py --out-dir "$out" "$@"
