#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run `mergekit-ram demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${EXTRAS:-}" bash scripts/setup.sh
HF_HUB_OFFLINE=1 "${VENV:-.venv}/bin/mergekit-ram" demo "$@"
