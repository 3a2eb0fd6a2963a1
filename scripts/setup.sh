#!/usr/bin/env bash
# Create .venv if missing and install the project; CPU torch first so pip never pulls a CUDA build here.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # On a machine with an NVIDIA driver let pip choose the CUDA build; elsewhere pin the CPU build
  # (on these machines `torch==2.13.0` resolves to a CPU wheel on local disk).
  if command -v nvidia-smi >/dev/null 2>&1; then
    .venv/bin/python -m pip install --quiet "${TORCH_SPEC:-torch}"
  else
    .venv/bin/python -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
  fi
fi
stamp=".venv/.installed-$extras"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet -e ".[$extras]"
  touch "$stamp"
fi
