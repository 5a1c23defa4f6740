#!/usr/bin/env bash
# Create .venv and install teratrain into it. Idempotent: re-running only checks.
# On a machine without an NVIDIA GPU it installs the CPU build of PyTorch (no CUDA wheels);
# with a GPU it installs the default (CUDA) build. An already installed torch >= 2.10 is kept.
# Set PYTHON to choose the interpreter (default python3; 3.10 or newer).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
die() { echo "setup.sh: $*" >&2; exit 1; }
command -v "$PY" >/dev/null 2>&1 || die "no '$PY' found; install Python 3.10 or newer, or set PYTHON=/path/to/python3."
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || die "teratrain needs Python >= 3.10 but $PY is $("$PY" -c 'import platform; print(platform.python_version())' 2>&1); install a newer one and re-run with PYTHON=python3.11 ./setup.sh."
[ -x .venv/bin/python ] || "$PY" -m venv .venv || die "could not create .venv with $PY -m venv; install its venv module (e.g. apt install python3-venv) and re-run."
. .venv/bin/activate
if ! python -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 10))' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install -q "torch>=2.10" || die "could not install torch >= 2.10 (CUDA build); install it into .venv yourself (.venv/bin/pip install torch) and re-run."
  else
    # CPU build: a local wheel if pip's find-links has one, else PyTorch's CPU index.
    pip install -q "torch==2.13.0+cpu" 2>/dev/null \
      || pip install -q "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu 2>/dev/null \
      || die "could not install the CPU build of torch (torch==2.13.0+cpu, from PyPI or download.pytorch.org/whl/cpu); install any torch >= 2.10 CPU wheel into .venv yourself (.venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu) and re-run."
  fi
fi
# the fp8 (torchao) and data (pyarrow, datasets) extras where pip can install them; teratrain runs without
# them (memory.fp8, or a Parquet / datasets corpus, then says which to install)
pip install -q -e ".[dev,fp8,data]" || pip install -q -e ".[dev,fp8]" || pip install -q -e ".[dev]"
python -c 'import torch, teratrain; print(f"teratrain ready: torch {torch.__version__}, cuda={torch.cuda.is_available()}")'
