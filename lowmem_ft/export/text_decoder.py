"""The text decoder of a vision-language checkpoint, exported alone as llama.cpp's converter does.

Gemma-3 4B/12B/27B ship as `Gemma3ForConditionalGeneration` (model_type `gemma3`): the gemma3 text decoder beside a
SigLIP tower and a projector. llama.cpp's `convert_hf_to_gguf.py` (its `Gemma3Model`) writes the decoder's tensors
under the `gemma3` architecture with the `text_config` keys, and leaves the tower and projector out: they go to a
separate mmproj file (its `--mmproj` mode), which lowmem-ft does not write. The GGUF is then the text model
(`Gemma3ForCausalLM` in transformers), the one idea here being a name map from the checkpoint's and the adapter's
names to that model's:

- the Hub's (transformers-4 era) safetensors: `language_model.model.*`, `language_model.lm_head.*`;
- transformers 5's layout (`Gemma3ForConditionalGeneration` modules, its conversion_mapping.py `llava` renames
  `language_model.model` → `model.language_model`): `model.language_model.*`, `lm_head.*` — also the names peft
  saves an adapter of a run on the VLM under (`base_model.model.model.language_model.layers...`);
- `vision_tower.*` / `multi_modal_projector.*` (either prefix): left out, weights and any LoRA on them alike.

A record per checkpoint type (`DECODERS`, keyed by the config's `model_type`); a family without one exports as the
text model it is.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from lowmem_ft.errors import UserError


@dataclass(frozen=True)
class TextDecoder:
    """How one vision-language checkpoint's text decoder is found (module docstring)."""

    model_type: str  # the checkpoint's config.model_type
    renames: tuple[tuple[str, str], ...]  # (regex, replacement) to the text model's names, first match wins
    left_out: tuple[str, ...]  # regexes of the tensors not exported (tower, projector)
    note: str  # what the export says it leaves out

    def name(self, stored: str) -> str | None:
        """The text model's name of checkpoint or adapter tensor `stored`, or None for one left out."""
        for pattern, replacement in self.renames:
            if re.match(pattern, stored):
                return re.sub(pattern, replacement, stored, count=1)
        if any(re.match(pattern, stored) for pattern in self.left_out):
            return None
        raise UserError(f"tensor {stored} of a {self.model_type} checkpoint is neither its text decoder's nor its "
                        f"vision tower's; GGUF export knows the Hub's and transformers 5's layouts")  # fmt: skip

    def text_config(self, config):
        return config.text_config


GEMMA3 = TextDecoder(
    "gemma3",
    renames=(
        (r"^language_model\.model\.", "model."),  # the Hub's safetensors (transformers 4)
        (r"^model\.language_model\.", "model."),  # transformers 5's modules, peft's adapter names
        (r"^language_model\.lm_head\.", "lm_head."),
        (r"^lm_head\.", "lm_head."),
    ),
    left_out=(r"^(model\.)?vision_tower\.", r"^(model\.)?multi_modal_projector\."),
    note="the vision tower and projector are not exported: llama.cpp runs them from a separate mmproj file "
    "(convert_hf_to_gguf.py --mmproj on the merged model), which lowmem-ft does not write",
)
DECODERS: dict[str, TextDecoder] = {d.model_type: d for d in (GEMMA3,)}


def of(model_dir: Path) -> TextDecoder | None:
    """The text-decoder record of the checkpoint in `model_dir`, or None (a text model)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    return DECODERS.get(json.loads(path.read_text()).get("model_type"))
