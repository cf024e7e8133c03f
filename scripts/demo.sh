#!/usr/bin/env bash
# Set up, build the embedded tiny Qwen2 model, and fine-tune it for an 8 GB target (--vram 8) on the example chat data;
# the last lines compare the memory the run used (counted exactly on the CPU) with what the memory model predicted.
#   bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=${WANDB_MODE:-offline}
[ -f models/tiny-qwen2/config.json ] || python -m devkit.tiny
name=demo-$(date +%Y%m%d-%H%M%S)
lowmem-ft train --vram 8 --model models/tiny-qwen2 --data examples/chat.jsonl --name "$name" \
  --max-steps 30 --lr 2e-3 --set training.logging_steps=5 --set training.save_steps=10
cat <<EOF

Next steps (after . .venv/bin/activate):
  lowmem-ft doctor                                    # can this machine train? each failed check says its fix
  lowmem-ft generate runs/$name --prompt hi    # try the fine-tune, streaming tokens
  lowmem-ft merge runs/$name --output merged/  # a standalone model that loads without peft
  lowmem-ft report runs/$name                  # the whole memory summary again, and runs/$name/memory.png

The memory model against this run (without a GPU, every live tensor is counted exactly, at every phase):
EOF
lowmem-ft report "runs/$name" | sed -n 1,2p  # sed reads it all: no broken pipe under pipefail
