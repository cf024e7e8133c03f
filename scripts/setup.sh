#!/usr/bin/env bash
# Set up a virtual environment in .venv with lowmem-ft and its dependencies.
# On a machine without an NVIDIA GPU it installs a CPU build of torch (a few hundred MB instead of several GB).
#   bash scripts/setup.sh
#   LOWMEM_FT_UNPINNED=1 bash scripts/setup.sh   # the newest releases instead of scripts/constraints.txt
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The checked library versions (scripts/constraints.txt = lowmem_ft/versions.py), unless asked for the newest.
PIN=(-c scripts/constraints.txt)
[ "${LOWMEM_FT_UNPINNED:-}" = 1 ] && PIN=()
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    python -m pip install -q "${PIN[@]}" "torch>=2.4"
  else
    # CPU build: a local wheel where pip's find-links has one, else PyTorch's CPU index.
    python -m pip install -q --retries 1 --timeout 20 \
      --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.13.0+cpu" \
      || python -m pip install -q --retries 1 --timeout 20 --index-url https://download.pytorch.org/whl/cpu torch
  fi
fi
python -m pip install -q "${PIN[@]}" -e ".[dev]"
python -c "import torch, transformers, peft, trl, bitsandbytes; print(f'torch {torch.__version__} (cuda: {torch.cuda.is_available()}), transformers {transformers.__version__}, peft {peft.__version__}, trl {trl.__version__}, bitsandbytes {bitsandbytes.__version__}')"
