#!/usr/bin/env bash
# The whole test suite (unit, distributed under torchrun, CPU benchmark smoke tests), once per
# megatron-core release the README names: 0.16.1 on Python 3.11; 0.17.1, 0.18.2 and 0.19.2 on
# Python 3.12 (scripts/legs.sh). Arguments go to pytest. First, once per run, the lint: ruff
# (pinned in scripts/legs.sh, rules in pyproject.toml) over the tree; findings fail the run, the
# legs still run.
#   MCORE_TORCH_EXPERTS_LEGS="0.19.2" bash scripts/run_tests.sh tests/unit/test_experts.py
# A leg whose Python is missing is skipped with the reason, except under CI (CI=true), where it
# fails. Each leg prints its ten slowest tests; the run ends with the lint's line, one line per
# leg (its setup and test seconds, its counts from pytest's junit XML) and the total.
# Some tests run on some legs only, by marker: `once_per_venv` (the Triton-interpreter kernel
# tests, the combine, the installed wheel, two benchmarks' smoke runs: what they check depends on
# the venv, not on the megatron-core release) on 0.16.1 and 0.19.2, `bench_smoke` (the other
# benchmarks' smoke runs) on 0.19.2, `distributed` (the torchrun workers) and `examples` (the
# examples end to end) on 0.16.1 and 0.20.0. The rule is scripts/legs.sh's (LEGS_ONCE_PER_VENV,
# LEGS_BENCH_SMOKE, LEGS_DISTRIBUTED, LEGS_EXAMPLES, leg_skips); this script hands each leg its skips in
# MCORE_TORCH_EXPERTS_LEG_SKIPS and tests/conftest.py skips them, each with the reason. The leg
# line says which markers it skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/legs.sh
legs=${MCORE_TORCH_EXPERTS_LEGS:-$LEGS_ALL}
# pytest-xdist workers per leg, one test file each at a time (--dist loadfile: a file's fixtures
# stay in one process); `-n 0` among the arguments runs the leg in one process.
workers=${MCORE_TORCH_EXPERTS_WORKERS:-2}
status=0
summary=()
passed=0 failed=0 skipped=0

run_start=$SECONDS
read -r lint_leg _ <<<"$legs"
echo "===== lint: ruff $RUFF_VERSION (in $(leg_venv "$lint_leg")) ====="
setup_lint "$lint_leg"
rc=$?
if [ $rc -eq 2 ] && [ "${CI:-}" != true ]; then
  lint_line="lint: SKIPPED (no Python $(leg_python_version "$lint_leg") interpreter)"
elif [ $rc -ne 0 ]; then
  lint_line="lint: FAILED to set up ruff $RUFF_VERSION (exit $rc)"
  status=1
else
  # --no-cache: nothing written into the tree.
  "$(leg_venv "$lint_leg")/bin/ruff" check --no-cache .
  rc=$?
  if [ $rc -eq 0 ]; then
    lint_line="lint: ruff $RUFF_VERSION, clean"
  else
    lint_line="lint: FAILED, ruff $RUFF_VERSION found problems (output above; exit $rc)"
    status=1
  fi
fi
lint_line="$lint_line ($((SECONDS - run_start)) s, its venv's setup included)"

for leg in $legs; do
  start=$SECONDS
  echo "===== leg: megatron-core $leg, Python $(leg_python_version "$leg") ====="
  setup_leg "$leg"
  rc=$?
  setup_s=$((SECONDS - start))
  echo "[setup $leg] ${setup_s} s"
  if [ $rc -eq 2 ] && [ "${CI:-}" != true ]; then
    summary+=("megatron-core $leg: SKIPPED (no Python $(leg_python_version "$leg") interpreter)")
    continue
  elif [ $rc -eq 3 ]; then
    summary+=("megatron-core $leg: SKIPPED (its source archives are not in $STACK_DIR)")
    continue
  elif [ $rc -ne 0 ]; then
    summary+=("megatron-core $leg: FAILED to set up (exit $rc, after ${setup_s} s)")
    status=1
    continue
  fi
  MCORE_TORCH_EXPERTS_LEG_SKIPS=$(leg_skips "$leg")
  export MCORE_TORCH_EXPERTS_LEG_SKIPS
  test_start=$SECONDS
  # Counted from pytest's junit XML, not from its last line (which -q -q leaves out).
  junit=$(mktemp --suffix .xml)
  rm -f "$junit"
  leg_run "$leg" -c "import megatron.core as m, sys, torch; v = m.__version__; print(f'[leg {v}] python {sys.version.split()[0]}, torch {torch.__version__}, megatron-core {v} from {m.__file__}'); sys.exit(v.split('+')[0] != '$leg')" \
    && leg_run "$leg" -m pytest -q -p no:cacheprovider --durations=10 -n "$workers" \
      --dist loadfile "$@" --junitxml="$junit"
  rc=$?
  line=$(leg_run "$leg" -c "
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    sys.exit(0)
suites = [root] if root.tag == 'testsuite' else list(root.iter('testsuite'))
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ('tests', 'failures', 'errors', 'skipped')}
print(n['tests'] - n['failures'] - n['errors'] - n['skipped'], 'passed,', n['failures'],
      'failed,', n['skipped'], 'skipped,', n['errors'], 'errors')" "$junit")
  # Where the leg's time went, by test file (setup, call and teardown, from the same XML): what
  # an xdist worker holds at once, the leg's floor.
  leg_run "$leg" -c "
import collections, os, sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    sys.exit(0)
seconds = collections.Counter()
for case in root.iter('testcase'):
    parts = case.get('classname', '').split('.')   # the module, then a class where there is one
    files = ['/'.join(parts[:n]) + '.py' for n in range(len(parts), 0, -1)]
    seconds[next((f for f in files if os.path.isfile(f)), files[0])] += float(case.get('time', 0))
print('[leg $leg] slowest files:', ', '.join(f'{f} {t:.0f} s' for f, t in seconds.most_common(8)))" "$junit"
  rm -f "$junit"
  for kind in passed failed skipped errors; do
    n=$(grep -oE "[0-9]+ $kind" <<<"$line" | grep -oE "[0-9]+" || true)
    [ "$kind" = errors ] && kind=failed
    declare "$kind=$(( ${!kind} + ${n:-0} ))"
  done
  summary+=("megatron-core $leg: ${line:-no summary} (exit $rc; setup ${setup_s} s, tests $((SECONDS - test_start)) s; skipped on this leg by the leg rule: ${MCORE_TORCH_EXPERTS_LEG_SKIPS:-nothing})")
  [ $rc -eq 0 ] || status=1
done
echo
echo "===== lint and legs ====="
echo "$lint_line"
printf '%s\n' "${summary[@]}"
echo "total: $passed passed, $failed failed, $skipped skipped; $((SECONDS - run_start)) s"
exit $status
