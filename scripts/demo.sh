#!/usr/bin/env bash
# Set up, build the embedded tiny Qwen2 model, and fine-tune it with the 8 GB recipe on the example chat data.
#   bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=${WANDB_MODE:-offline}
[ -f models/tiny-qwen2/config.json ] || python scripts/build_tiny_model.py
lowmem-ft train --vram 8 --model models/tiny-qwen2 --data examples/chat.jsonl --name demo-$(date +%Y%m%d-%H%M%S) \
  --set training.max_steps=30 --set training.logging_steps=5 --set optimizer.lr=2e-3 --set training.save_steps=10
