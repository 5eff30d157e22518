#!/usr/bin/env bash
# Prepares, on a machine with network, the wheels the project's GPU machine (no network; Python
# 3.12, x86-64) installs (tests/device/offline.sh), one folder per stack, in .whl/ (git-ignored):
#   .whl/mc019   megatron-core 0.19.2, megatron-bridge 0.6.2
#   .whl/mc020   megatron-core 0.20.0 and megatron-bridge 0.7.0, built from the source archives
#                NeMo-RL main pins (../shared/stacks/nemo-rl-main, or MCORE_TORCH_EXPERTS_STACK_DIR)
#   .whl/common  nvidia-resiliency-ext 0.7.0 (Bridge's training entry imports it), omegaconf and
#                what Bridge's training modules import (scripts/legs.sh: BRIDGE_TRAINING_DEPS)
#   .whl/nrl     what NeMo-RL's Megatron policy worker imports (as the 0.20.0 leg installs it), with
#                transformers in NeMo-RL's bounds, and NeMo-RL's source (nemo_rl/, examples/configs/)
# Then packs them into .whl/parts/pN (58 MB each): a device call carries at most 64 MiB.
#   bash tests/device/stack_wheels.sh
# With --legs, only the megatron-core wheels of scripts/gpu_te_legs.sh's legs, into .whl-legs/
# (there: PIP_NO_INDEX=1 PIP_FIND_LINKS=.whl-legs bash scripts/gpu_te_legs.sh OUT).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/legs.sh
python=$(find_python 3.12)
[ -n "$python" ] || { echo "stack_wheels: needs Python 3.12 (pip wheel of megatron-core 0.20.0)"; exit 1; }
if [ "${1:-}" = --legs ]; then
  for leg in 0.16.1 0.17.1 0.18.2; do
    "$python" -m pip download -q --no-deps --only-binary :all: --python-version 3.12 \
      --platform manylinux_2_28_x86_64 -d .whl-legs "megatron-core==$leg"
  done
  ls .whl-legs
  exit 0
fi
platform=(--only-binary=:all: --python-version 3.12 --implementation cp)
for tag in 2_39 2_35 2_34 2_31 2_28 2_27 2_24 2_17 2_5; do
  platform+=(--platform "manylinux_${tag}_x86_64")
done
platform+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64)
# What the H200 image ships already: left out of the wheels (install_stack installs a carried
# wheel only where the machine lacks its distribution).
ON_IMAGE="absl-py aiohappyeyeballs aiohttp aiosignal attrs charset-normalizer cloudpickle frozenlist
grpcio markdown msgpack multidict ninja nvidia-ml-py pandas prometheus-client propcache protobuf
pyarrow python-dateutil requests scipy simplejson tensorboard tensorboard-data-server urllib3
werkzeug wrapt xxhash yarl zipp"
download() {  # folder pins... -> the wheels, but for ON_IMAGE's; a pin with no wheel (an sdist
  # only) is built
  local folder=$1 pin
  shift
  mkdir -p "$folder"
  for pin in "$@"; do
    name=$(tr 'A-Z_' 'a-z-' <<<"${pin%%==*}")
    grep -qw -- "$name" <<<"$ON_IMAGE" && continue
    python3 -m pip download -q --no-deps "${platform[@]}" -d "$folder" "$pin" 2>/dev/null \
      || "$python" -m pip wheel -q --no-deps -w "$folder" "$pin"
  done
}
rm -rf .whl/mc019 .whl/mc020 .whl/common .whl/nrl .whl/parts
download .whl/mc019 megatron-core==0.19.2 "megatron-bridge==$BRIDGE_VERSION"
"$python" -m pip wheel -q --no-deps -w .whl/mc020 "$STACK_DIR/$MCORE_020_ARCHIVE" \
  "$STACK_DIR/$BRIDGE_070_ARCHIVE"
# shellcheck disable=SC2086
download .whl/common nvidia-resiliency-ext==0.7.0 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
  defusedxml==0.7.1 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 $BRIDGE_TRAINING_DEPS
# NeMo-RL's worker imports: what the 0.20.0 leg installed for it (scripts/legs.sh, setup_nemo_rl),
# less what the H200 image ships; transformers is NeMo-RL's (it asserts < 5.12).
folder="$(leg_pythonpath 0.20.0)/$NEMO_RL_DIR"
[ -f "$folder/.complete" ] || setup_leg 0.20.0
# shellcheck disable=SC2046
download .whl/nrl $(cd "$folder" && ls -d ./*.dist-info | python3 -c "
import sys
for line in sys.stdin:
    name, version = line.strip()[2:-len('.dist-info')].rsplit('-', 1)
    print(f'{name}=={version}')")
# transformers 5.8 asks for tokenizers <= 0.23.0: the version the leg's venv holds.
download .whl/nrl "tokenizers==$(leg_run 0.20.0 -c "import tokenizers; print(tokenizers.__version__)")"
for wheel in .whl/nrl/*.whl; do  # carried once
  [ ! -f ".whl/common/${wheel##*/}" ] || rm "$wheel"
done
tar -xzf "$STACK_DIR/$NEMO_RL_ARCHIVE" -C .whl/nrl --strip-components=1 --wildcards '*/nemo_rl' '*/examples/configs'
mkdir -p .whl/parts
tar -cf - -C .whl mc019 mc020 common nrl | split -b 58M -d - .whl/parts/p
for part in .whl/parts/p*; do mkdir -p "$part.d" && mv "$part" "$part.d/"; done
du -sh .whl/mc019 .whl/mc020 .whl/common .whl/nrl
ls .whl/parts
