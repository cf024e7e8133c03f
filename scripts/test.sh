#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite on the CPU; GPU-only tests skip themselves.
#   bash scripts/test.sh [pytest args]      # on two pytest-xdist workers (pyproject.toml addopts); -n 0: serially
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export WANDB_MODE=${WANDB_MODE:-offline} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
ruff check lowmem_ft devkit tests
ruff format --check lowmem_ft devkit tests
python -m pytest "$@"
