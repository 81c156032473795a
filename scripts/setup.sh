#!/usr/bin/env bash
# Create ./.venv with CPU PyTorch, mergekit and mergekit-ram (editable, test extras).
# Idempotent. Overrides: PYTHON (interpreter), VENV (path), TORCH_SPEC (default
# torch==2.13.0), TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu or a
# CUDA index), EXTRAS (default "test,plots").
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Torch first, so that mergekit's unpinned `torch` does not pull a CUDA build.
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}" \
    ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
"$PY" -m pip install -q -e ".[${EXTRAS:-test,plots}]"
"$PY" -c "import torch, mergekit_ram; print('torch', torch.__version__, '| mergekit-ram', mergekit_ram.__version__)"
