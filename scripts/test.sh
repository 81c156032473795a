#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the checks: ruff, then the default pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${VENV:-.venv}"
export HF_HUB_OFFLINE=1
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
"$VENV/bin/python" -m pytest -q "$@"
