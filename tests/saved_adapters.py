"""LoRA adapters on disk for tests: saved by peft itself (no training), or with a hand-made config or weights."""

from __future__ import annotations

import json
from pathlib import Path


def save_adapter(model: str, out: Path, *, r: int = 4, alpha: int = 8, targets=("q_proj", "v_proj"), **extra) -> Path:
    """A fresh peft LoRA adapter of `model` saved to `out` (adapter_config.json + adapter_model.safetensors)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model)
    targets = targets if isinstance(targets, str) else list(targets)  # a string is a regex for peft
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, **extra)
    get_peft_model(base, config).save_pretrained(out)
    return out


def edit_config(adapter: Path, **changes) -> Path:
    path = adapter / "adapter_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, **changes}))
    return adapter
