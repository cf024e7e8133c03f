#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite on the CPU; GPU-only tests skip themselves.
#   bash scripts/test.sh [pytest args]         # the full suite (CI), ending with the 30 slowest tests' durations
#   bash scripts/test.sh --fast [pytest args]  # the inner loop: every test not marked slow (-m "not slow")
# Both run on two pytest-xdist workers (pyproject.toml addopts); -n 0 runs serially.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=(--durations=30)
if [[ "${1:-}" == "--fast" ]]; then
    tier=(-m "not slow")
    shift
fi
bash scripts/setup.sh
. .venv/bin/activate
export WANDB_MODE=${WANDB_MODE:-offline} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
ruff check lowmem_ft devkit tests
ruff format --check lowmem_ft devkit tests
python -m pytest "${tier[@]}" "$@"
