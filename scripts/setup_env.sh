#!/usr/bin/env bash
# Makes the environment of one test leg (default 0.16.1): bash scripts/setup_env.sh [LEG].
# The legs and what each installs: scripts/legs.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/legs.sh
setup_leg "${1:-0.16.1}"
