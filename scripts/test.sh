#!/usr/bin/env bash
# Set up (scripts/setup.sh, with the test and plots extras) and run the checks:
# ruff, then the default pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${EXTRAS:-test,plots}" bash scripts/setup.sh
VENV="${VENV:-.venv}"
export HF_HUB_OFFLINE=1
echo "test: ruff check, ruff format --check, then pytest (tests not marked slow)"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
"$VENV/bin/python" -m pytest -q "$@"
