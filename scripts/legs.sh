# Sourced by setup_env.sh, run_tests.sh and run_example.sh: the test legs (one per megatron-core
# release the README names) and how each one's environment is made.
#
#   leg      Python  venv       megatron-core (and Megatron-Bridge) from
#   0.16.1   3.11    .venv      the venv itself (pip install megatron-core==0.16.1)
#   0.17.1   3.12    .venv312   .venv312/legs/mcore-0.17.1 (--target, put on PYTHONPATH)
#   0.18.2   3.12    .venv312   .venv312/legs/mcore-0.18.2
#   0.19.2   3.12    .venv312   .venv312/legs/mcore-0.19.2, with megatron-bridge 0.6.2 (and what
#                                its training entry imports) and nemo-automodel 0.7.0
#   0.20.0   3.12    .venv312   .venv312/legs/mcore-0.20.0, with megatron-bridge 0.7.0 (and what
#                                its training entry imports): the stack NeMo-RL's main pins by
#                                commit (Megatron-LM 14346b65, Megatron-Bridge 8c46dc42), built
#                                from their source archives (STACK_DIR below), and NeMo-RL itself
#                                (7ea279ab) with the packages its policy worker imports
#
# torch is 2.13.0 in both venvs. For Python 3.11 pip takes the CPU build from this machine's disk;
# for Python 3.12 it is PyPI's CUDA build (about 5 GB, runs on the CPU), installed once and reused.
# pip is never asked for a bare `torch`.

LEGS_ALL="0.16.1 0.17.1 0.18.2 0.19.2 0.20.0"
# Tests that run on some legs only, by marker (registered in setup.cfg): the one rule of which
# leg runs them (leg_skips below; run_tests.sh hands a leg's skips to tests/conftest.py, which
# skips them there, each with the reason). pytest run by hand runs them all.
#   once_per_venv  one leg per venv: 0.16.1 (Python 3.11, .venv) and 0.19.2 (Python 3.12,
#                  .venv312; a PyPI release, so never skipped for a missing archive). What they
#                  check depends on the venv (Python, torch build, Triton: 3.9.0 in .venv
#                  today, 3.7.1 in .venv312; setuptools), not on the megatron-core release: the
#                  Triton kernels under the interpreter against FP64, the combine, the sdist, the
#                  wheel and its fresh-venv install, bench_experts' and bench_field_kernels'
#                  smoke runs.
#   bench_smoke    0.19.2, the release the GPU benchmarks run on (BENCHMARKS.md): the other
#                  benchmarks' CPU smoke runs (bench_cycle, cycle_memory, the Bridge and
#                  Automodel benchmarks), which hold nothing release-specific.
#   distributed    the torchrun workers (expert, tensor and expert-tensor parallelism, DDP,
#                  distributed checkpoints): 0.16.1 and 0.20.0, the oldest release and the one
#                  NeMo-RL pins; a torchrun launch costs 8 to 20 s of CI per leg.
#   examples       the examples run end to end, each in its own process (tests/test_examples.py):
#                  0.16.1 and 0.20.0 as well (hf_roundtrip, which needs Bridge, on 0.20.0); each
#                  costs 10 to 25 s per leg on Python 3.12, where a process imports the CUDA
#                  build of torch. The Megatron APIs they call are unit-tested on every leg.
# 0.17.1, 0.18.2 and 0.19.2 run everything else.
# MCORE_TORCH_EXPERTS_ONCE_PER_VENV_LEGS, MCORE_TORCH_EXPERTS_BENCH_SMOKE_LEGS,
# MCORE_TORCH_EXPERTS_DISTRIBUTED_LEGS and MCORE_TORCH_EXPERTS_EXAMPLES_LEGS override the lists
# ("all": every leg).
LEGS_ONCE_PER_VENV=${MCORE_TORCH_EXPERTS_ONCE_PER_VENV_LEGS:-0.16.1 0.19.2}
LEGS_BENCH_SMOKE=${MCORE_TORCH_EXPERTS_BENCH_SMOKE_LEGS:-0.19.2}
LEGS_DISTRIBUTED=${MCORE_TORCH_EXPERTS_DISTRIBUTED_LEGS:-0.16.1 0.20.0}
LEGS_EXAMPLES=${MCORE_TORCH_EXPERTS_EXAMPLES_LEGS:-0.16.1 0.20.0}
TORCH_VERSION=2.13.0
BRIDGE_VERSION=0.6.2
# The 0.20.0 leg: megatron-core 0.20.0 and megatron-bridge 0.7.0 are not released as wheels; NeMo-RL
# pins them by commit. Their `git archive`s (megatron-core-0.20.0-14346b65.tar.gz,
# megatron-bridge-0.7.0-8c46dc42.tar.gz) are looked for in this folder and built with pip (the
# same as `pip install "git+https://github.com/NVIDIA/Megatron-LM@14346b65"` and Bridge's
# equivalent where there is network access). Where they are absent the leg is skipped with the
# reason.
STACK_DIR=${MCORE_TORCH_EXPERTS_STACK_DIR:-../shared/stacks/nemo-rl-main}
MCORE_020_ARCHIVE=megatron-core-0.20.0-14346b65.tar.gz
BRIDGE_070_ARCHIVE=megatron-bridge-0.7.0-8c46dc42.tar.gz
# Megatron-Bridge is installed without its dependencies (they include CUDA-only packages); these
# are the light ones its PEFT and conversion modules import, plus peft (and its accelerate) to run
# Bridge's Hugging Face PEFT adapter exports (tests/integration/bridge/test_hf_bridge_lora.py).
BRIDGE_LIGHT_DEPS="transformers>=5.8,<=5.12.1 omegaconf>=2.3.0 pyyaml tqdm regex six rich peft==0.21.2 accelerate==1.15.0"
# NeMo-RL main (7ea279ab), from its source archive beside the Megatron ones, for tests/integration/nemo_rl/test_nemo_rl.py
# (its own Megatron policy worker on the CPU), in a folder of its own inside the leg's
# (NEMO_RL_DIR), which only that test's worker process puts on its path: the leg's other tests keep
# the leg's packages. NeMo-RL's pyproject declares Python >=3.13.14 and lists only the top-level
# package (`packages = ["nemo_rl"]`: a wheel built from it holds 7 files; uv installs it editable),
# so its source tree `nemo_rl/` and its recipes `examples/configs/` are unpacked there as in its
# checkout; its code imports on Python 3.12. Its dependencies include CUDA-only packages
# (vllm, transformer-engine, nixl, ...), so it is installed without them; these are the ones its
# Megatron worker's modules import when they are loaded (the experiment loggers
# nemo_rl.utils.logger imports among them) and those Megatron-Bridge's checkpointing imports
# (nvidia-modelopt, megatron-energon: no stand-ins for them there), with transformers in NeMo-RL's
# own bounds (its nemo_rl.models.policy asserts < 5.12). Resolved against the venv once (torch
# stays the venv's; nemo_rl_pins), what the venv lacks, or has in another version, is listed in
# tests/constraints/nemo-rl-0.20.0.txt, and exactly that list goes into the folder.
NEMO_RL_ARCHIVE=nemo-rl-7ea279ab.tar.gz
NEMO_RL_LEG=0.20.0
NEMO_RL_DIR=nemo-rl
NEMO_RL_LIGHT_DEPS="transformers>=5.8,<5.9 ray pydantic pyzmq nvidia-ml-py fastapi uvicorn hydra-core prometheus_client pillow requests rich datasets wandb mlflow-skinny swanlab tensorboard tensordict nvidia-modelopt megatron-energon"
# What Megatron-Bridge's training entry imports (`training.finetune`, `training.pretrain` and
# `training.gpt_step`, which tests/integration/bridge/test_bridge_finetune.py runs) beyond the light dependencies:
# HF datasets, nvidia-modelopt, Megatron-Energon and tensorboard, and what each of them imports in
# turn; installed into the folders of the legs with Bridge (0.19.2, 0.20.0) without their
# dependencies (they include torch and CUDA-only packages). nvidia-resiliency-ext is not among
# them: its 0.7.0 is a cp312 manylinux_2_39 wheel this glibc cannot install, and what installs
# here (0.4.1) breaks the import of megatron-core 0.19.2, which asks for 0.6+
# (support.bridge_imports.import_megatron_bridge_training); the GPU runs
# install the real 0.7.0 (scripts/gpu_client_routes.sh).
BRIDGE_TRAINING_DEPS="datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pandas==3.1.1 pyarrow==26.0.1 xxhash==4.1.0 requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3 nvidia-modelopt==0.47.0 scipy==1.18.1 PuLP==3.3.2 megatron-energon==7.4.1 multi-storage-client==1.3.1 xattr==1.3.1 cffi==2.1.1 pycparser==3.12 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 lark==1.3.1 wcmatch==10.2.1 bracex==3.2.3 opentelemetry-api==1.45.2 braceexpand==0.1.7 rapidyaml==0.15.2 deprecation==2.1.0 filetype==1.2.0 webdataset==1.0.2 tensorboard==2.21.0 protobuf==6.33.6 absl-py==2.5.1"
AUTOMODEL_VERSION=0.7.0
# NeMo Automodel is installed without its dependencies as well (they include CUDA-only packages):
# its MoE experts module imports torch, triton and packaging, and its BackendConfig transformers
# (above), for tests/integration/automodel/test_automodel.py (install_fp32_combine on its GroupedExperts).
AUTOMODEL_LIGHT_DEPS="packaging"
# Every pip install into a venv takes its versions from that venv's constraints file (pip -c):
# tests/constraints/py3.11.txt (.venv) and py3.12.txt (.venv312), so that a fresh clone builds what
# the last one did, whatever was released since; NeMo-RL's folder installs the list in
# tests/constraints/nemo-rl-0.20.0.txt. write_constraints (below) remakes the three files from
# legs set up without them (after a change of setup.cfg's test extra or of a *_DEPS list above).
CONSTRAINTS_DIR=tests/constraints
# The lint (run_tests.sh's first step, once per run; its rules are pyproject.toml's [tool.ruff]):
# ruff, pinned, installed into the venv of the run's first leg.
RUFF_VERSION=0.17.6

leg_skips() {  # leg -> "marker=legs;" for each marker above whose tests skip on that leg
  local leg=$1 pair legs
  for pair in "once_per_venv=$LEGS_ONCE_PER_VENV" "bench_smoke=$LEGS_BENCH_SMOKE" \
      "distributed=$LEGS_DISTRIBUTED" "examples=$LEGS_EXAMPLES"; do
    legs=${pair#*=}
    [ "$legs" = all ] || [[ " $legs " == *" $leg "* ]] || printf '%s;' "$pair"
  done
}

leg_python_version() {  # leg -> the Python version it runs on
  case "$1" in
    0.16.*) echo 3.11 ;;
    *) echo 3.12 ;;
  esac
}

leg_venv() {  # leg -> its venv folder
  case "$(leg_python_version "$1")" in
    3.11) echo .venv ;;
    *) echo .venv312 ;;
  esac
}

find_python() {  # X.Y -> path of a pythonX.Y interpreter (PATH first, then pyenv), or nothing
  local version=$1 candidate root
  candidate=$(command -v "python$version" 2>/dev/null || true)
  if [ -n "$candidate" ] && "$candidate" -c "" 2>/dev/null; then
    echo "$candidate"
    return
  fi
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for candidate in "$root"/versions/"$version".*/bin/python"$version"; do
    if [ -x "$candidate" ]; then
      echo "$candidate"
      return
    fi
  done
}

leg_constraints() {  # leg -> its venv's constraints file
  echo "$CONSTRAINTS_DIR/py$(leg_python_version "$1").txt"
}

leg_pythonpath() {  # leg -> the folder holding its megatron-core, or nothing (0.16.1: the venv)
  case "$(leg_python_version "$1")" in
    3.11) ;;
    *) echo "$(leg_venv "$1")/legs/mcore-$1" ;;
  esac
}

leg_missing_archives() {  # leg -> the source archives it needs that are not there, or nothing
  [ "$1" = 0.20.0 ] || return 0
  local archive
  for archive in "$MCORE_020_ARCHIVE" "$BRIDGE_070_ARCHIVE"; do
    [ -f "$STACK_DIR/$archive" ] || echo "$STACK_DIR/$archive"
  done
}

make_venv() {  # leg -> makes its venv where there is none; returns 2 when its interpreter is
  # missing
  local leg=$1 version venv python
  version=$(leg_python_version "$leg")
  venv=$(leg_venv "$leg")
  [ -x "$venv/bin/python" ] && return 0
  python=$(find_python "$version")
  if [ -z "$python" ]; then
    echo "[setup $leg] no Python $version interpreter (looked for python$version on PATH and under pyenv)"
    return 2
  fi
  echo "[setup $leg] creating $venv with $python"
  "$python" -m venv --system-site-packages "$venv"
}

setup_lint() {  # leg -> ruff==$RUFF_VERSION in the leg's venv (made where missing); returns 2
  # when the leg's interpreter is missing
  local leg=$1 venv
  make_venv "$leg" || return $?
  venv=$(leg_venv "$leg")
  if [ "$("$venv/bin/ruff" --version 2>/dev/null)" != "ruff $RUFF_VERSION" ]; then
    echo "[setup lint] installing ruff==$RUFF_VERSION into $venv"
    "$venv/bin/python" -m pip install -q -c "$(leg_constraints "$leg")" "ruff==$RUFF_VERSION" \
      || return 1
  fi
}

setup_leg() {  # leg -> makes its environment; returns 2 when its interpreter is missing, 3 when
  # its source archives are
  local leg=$1 version venv target missing constraints
  version=$(leg_python_version "$leg")
  constraints=$(leg_constraints "$leg")
  venv=$(leg_venv "$leg")
  missing=$(leg_missing_archives "$leg")
  if [ -n "$missing" ]; then
    echo "[setup $leg] source archives not found (set MCORE_TORCH_EXPERTS_STACK_DIR): $missing"
    return 3
  fi
  make_venv "$leg" || return $?
  if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "[setup $leg] installing torch==$TORCH_VERSION into $venv"
    "$venv/bin/python" -m pip install -q "torch==$TORCH_VERSION"
  fi
  if [ "$version" = 3.11 ]; then
    # Once per packaging metadata: an editable install sees code changes without pip.
    local stamp="$venv/.installed-$leg" metadata
    metadata=$(cat setup.cfg pyproject.toml | sha256sum | cut -c1-16)
    if [ "$(cat "$stamp" 2>/dev/null)" = "$metadata" ] && "$venv/bin/python" -c \
        "import importlib.metadata as m, sys; sys.exit(m.version('megatron-core') != '$leg')" \
        2>/dev/null; then
      echo "[setup $leg] mcore_torch_experts, megatron-core==$leg and the test dependencies: installed already"
      return 0
    fi
    echo "[setup $leg] installing mcore_torch_experts, megatron-core==$leg and the test dependencies"
    rm -f "$venv"/.installed-*
    "$venv/bin/python" -m pip install -q -c "$constraints" -e ".[test]" "megatron-core==$leg" \
      || return 1
    echo "$metadata" > "$stamp"
    return 0
  fi
  # Python 3.12: the package and the test dependencies once, megatron-core per leg in its folder.
  if ! "$venv/bin/python" -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ('mcore_torch_experts', 'pytest', 'xdist', 'psutil', 'matplotlib', 'einops', 'yaml', 'omegaconf')))"; then
    echo "[setup $leg] installing mcore_torch_experts and the test dependencies into $venv"
    "$venv/bin/python" -m pip install -q -c "$constraints" -e ".[test]" || return 1
    # megatron-core comes from the leg's folder only, never from the venv.
    "$venv/bin/python" -m pip uninstall -q -y megatron-core
  fi
  target=$(leg_pythonpath "$leg")
  if [ ! -f "$target/.complete" ]; then
    rm -rf "$target"
    if [ "$leg" = 0.20.0 ]; then
      echo "[setup $leg] building megatron-core 0.20.0 and megatron-bridge 0.7.0 from $STACK_DIR"
      local wheels build_deps
      wheels=$(mktemp -d)
      build_deps=$(mktemp -d)
      "$venv/bin/python" -m pip wheel -q --no-deps -w "$wheels" "$STACK_DIR/$MCORE_020_ARCHIVE" \
        || return 1
      # Bridge's build asks for torch (its pyproject.toml's build requirements): in pip's
      # isolated build environment that is a second torch to install, most of this leg's setup.
      # Built against the venv's torch instead, with its other build requirements in a folder of
      # their own (the venv's setuptools stays as it is); the wheel is the same, file for file.
      "$venv/bin/python" -m pip install -q --target "$build_deps" "setuptools<80" pybind11 wheel \
        && PYTHONPATH="$build_deps" "$venv/bin/python" -m pip wheel -q --no-deps \
          --no-build-isolation -w "$wheels" "$STACK_DIR/$BRIDGE_070_ARCHIVE" || return 1
      "$venv/bin/python" -m pip install -q --no-deps --target "$target" "$wheels"/*.whl || return 1
      rm -rf "$wheels" "$build_deps"
      echo "[setup $leg] installing Megatron-Bridge's light dependencies into $venv"
      # shellcheck disable=SC2086
      "$venv/bin/python" -m pip install -q -c "$constraints" $BRIDGE_LIGHT_DEPS || return 1
    elif [ "$leg" = 0.19.2 ]; then
      # One pip call: both put files under megatron/, and a second --target install would skip it.
      echo "[setup $leg] installing megatron-core==$leg and megatron-bridge==$BRIDGE_VERSION (no dependencies) into $target"
      "$venv/bin/python" -m pip install -q --no-deps --target "$target" "megatron-core==$leg" \
        "megatron-bridge==$BRIDGE_VERSION"
      echo "[setup $leg] installing Megatron-Bridge's light dependencies into $venv"
      # shellcheck disable=SC2086
      "$venv/bin/python" -m pip install -q -c "$constraints" $BRIDGE_LIGHT_DEPS || return 1
    else
      echo "[setup $leg] installing megatron-core==$leg into $target"
      "$venv/bin/python" -m pip install -q --no-deps --target "$target" "megatron-core==$leg"
    fi
    touch "$target/.complete"
  fi
  # Its own step, so that a leg folder made before it was added gets it too.
  if [ "$leg" = 0.20.0 ] && [ ! -f "$target/$NEMO_RL_DIR/.complete" ]; then
    setup_nemo_rl "$venv" "$target/$NEMO_RL_DIR" || return 1
  fi
  if [ "$leg" = 0.19.2 ] && [ ! -d "$target/nemo_automodel" ]; then
    echo "[setup $leg] installing nemo-automodel==$AUTOMODEL_VERSION (no dependencies) into $target and its light dependencies into $venv"
    "$venv/bin/python" -m pip install -q --no-deps --target "$target" "nemo-automodel==$AUTOMODEL_VERSION"
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pip install -q -c "$constraints" $AUTOMODEL_LIGHT_DEPS
  fi
  # Its own step as well.
  if { [ "$leg" = 0.19.2 ] || [ "$leg" = 0.20.0 ]; } && [ ! -f "$target/.bridge-training" ]; then
    echo "[setup $leg] installing Megatron-Bridge's training imports (no dependencies) into $target"
    local staging
    staging=$(mktemp -d)
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pip install -q --no-deps --target "$staging" $BRIDGE_TRAINING_DEPS \
      || return 1
    # Megatron-Energon installs under megatron/, which the leg folder holds already (a second
    # pip --target would skip it): the staging folder is merged in, replacing nothing.
    cp -rn "$staging"/. "$target"/ && rm -rf "$staging" && touch "$target/.bridge-training"
  fi
}

setup_nemo_rl() {  # venv folder -> NeMo-RL's source, its recipes and the packages its Megatron
  # worker imports, into folder
  local venv=$1 folder=$2
  if [ ! -f "$STACK_DIR/$NEMO_RL_ARCHIVE" ]; then
    echo "[setup 0.20.0] $STACK_DIR/$NEMO_RL_ARCHIVE not found: tests/integration/nemo_rl/test_nemo_rl.py will skip"
    return 0
  fi
  echo "[setup 0.20.0] unpacking NeMo-RL ($NEMO_RL_ARCHIVE) and installing the packages its Megatron worker imports into $folder"
  rm -rf "$folder"
  mkdir -p "$folder"
  tar -xzf "$STACK_DIR/$NEMO_RL_ARCHIVE" -C "$folder" --strip-components=1 --wildcards '*/nemo_rl' \
    '*/examples/configs' || return 1
  "$venv/bin/python" -m pip install -q --no-deps --target "$folder" \
    -r "$CONSTRAINTS_DIR/nemo-rl-$NEMO_RL_LEG.txt" || return 1
  touch "$folder/.complete"
}

nemo_rl_pins() {  # venv folder -> NEMO_RL_LIGHT_DEPS resolved against the venv: what it lacks
  local venv=$1 report
  report=$(mktemp)
  # torch pinned to the venv's: none of them may bring another.
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install -q --dry-run --report "$report" "torch==$TORCH_VERSION" \
    $NEMO_RL_LIGHT_DEPS || return 1
  "$venv/bin/python" -c "import json, sys; print('\n'.join(sorted((p['metadata']['name'] + '==' + p['metadata']['version'] for p in json.load(open(sys.argv[1]))['install']), key=str.lower)))" "$report"
  rm -f "$report"
}

write_constraints() {  # -> remakes tests/constraints/*.txt from .venv and .venv312 as they are
  # (set up with the constraints files moved away, so that pip resolves afresh)
  local python venv file
  for python in 3.11 3.12; do
    venv=$([ "$python" = 3.11 ] && echo .venv || echo .venv312)
    file="$CONSTRAINTS_DIR/py$python.txt"
    { sed -n '1,/^[^#]/{/^#/p}' "$file"
      "$venv/bin/python" -m pip freeze --local | grep -v '^-e \|^torch=='; } > "$file.new" \
      && mv "$file.new" "$file" || return 1
  done
  file="$CONSTRAINTS_DIR/nemo-rl-$NEMO_RL_LEG.txt"
  { sed -n '1,/^[^#]/{/^#/p}' "$file"; nemo_rl_pins .venv312; } > "$file.new" \
    && mv "$file.new" "$file"
}

leg_run() {  # leg command... -> runs the command with the leg's python first on the command line
  local leg=$1 venv path
  shift
  venv=$(leg_venv "$leg")
  path=$(leg_pythonpath "$leg")
  PYTHONPATH="${path:+$PWD/$path}${PYTHONPATH:+:$PYTHONPATH}" "$venv/bin/python" "$@"
}
