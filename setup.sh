#!/usr/bin/env bash
# Create .venv and install teratrain into it. Idempotent: re-running only checks.
# On a machine without an NVIDIA GPU it installs the CPU build of PyTorch (no CUDA wheels);
# with a GPU it installs the default (CUDA) build. An already installed torch >= 2.10 is kept.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
if ! python -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 10))' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install -q "torch>=2.10"
  else
    # CPU build: a local wheel if pip's find-links has one, else PyTorch's CPU index.
    pip install -q "torch==2.13.0+cpu" 2>/dev/null \
      || pip install -q "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
  fi
fi
pip install -q -e ".[dev]"
python -c 'import torch, teratrain; print(f"teratrain ready: torch {torch.__version__}, cuda={torch.cuda.is_available()}")'
