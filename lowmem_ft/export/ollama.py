"""An Ollama `Modelfile` for an exported GGUF: FROM the file, the stop tokens of its chat template, parameters.

Ollama reads the chat template from the GGUF's `tokenizer.chat_template` (written by `vocab`) and maps the templates
it knows to its own; the Modelfile adds what it cannot infer: every token that ends an assistant turn (EOS and the
family's end-of-turn token, from the model's generation_config.json — Llama-3's `<|eot_id|>`, Gemma's
`<end_of_turn>`, ChatML's `<|im_end|>`) as `stop`, and the context length training used as `num_ctx`.
"""

from __future__ import annotations

import json
from pathlib import Path


def stop_tokens(model_dir: Path, tokenizer) -> list[str]:
    """EOS and every other id generation stops at (generation_config.json), as token strings."""
    ids: list[int] = []
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    tokens = [tokenizer.convert_ids_to_tokens(i) for i in dict.fromkeys(ids)]
    return [t for t in tokens if t]


def modelfile(gguf_path: Path, stops: list[str], num_ctx: int | None) -> str:
    lines = [f"FROM ./{gguf_path.name}", ""]
    lines += [f"PARAMETER stop {json.dumps(s)}" for s in stops]
    if num_ctx:
        lines.append(f"PARAMETER num_ctx {num_ctx}")
    return "\n".join(lines) + "\n"


def write_modelfile(gguf_path: Path, stops: list[str], num_ctx: int | None) -> Path:
    path = gguf_path.parent / "Modelfile"
    path.write_text(modelfile(gguf_path, stops, num_ctx), encoding="utf-8")
    return path
