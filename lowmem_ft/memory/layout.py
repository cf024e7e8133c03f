"""An architecture's block checked against a local model's own weights (their safetensors headers).

The one idea: `Architecture.from_config` knows the block layouts of the families it names and reads every other
model_type as Llama-shaped (q/k/v/o, gate/up/down). A family it does not know with another layout would be planned
with LoRA on layers that do not exist and weights it does not have — silently. For a local directory the weights
say what the block really holds: the 2-D tensors of layer 0, by module name and shape, read from the safetensors
headers only (no tensor data, no torch). A mismatch is a warning naming both, not an error: the run may still work.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from lowmem_ft.console import first_time

log = logging.getLogger(__name__)

# layer 0 of the decoder stack, under the prefixes transformers' causal LMs use (Llama-style `model.layers`, Falcon /
# GPT-2 style `transformer.h`, GPT-NeoX, a multimodal model's language model); a vision tower's layers do not match
LAYER0 = re.compile(
    r"^(?:model\.|transformer\.|gpt_neox\.|model\.language_model\.|language_model\.model\.)?(?:layers|h)\.0\."
    r"(?:.+\.)?([^.]+)\.weight$"
)
FLOAT_DTYPES = {"F32", "F16", "BF16"}  # pre-quantized checkpoints (bitsandbytes U8) store packed shapes


def _headers(directory: Path) -> list[dict]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values()))
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return []
    headers = []
    for name in files:
        with (directory / name).open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            headers.append(json.loads(handle.read(length)))
    return headers


def layer0_linears(directory: Path) -> dict[str, tuple[int, int] | None]:
    """Layer 0's 2-D weights of a local model: module name → (out, in) features (None for packed quantized data);
    empty when the directory has no safetensors weights or they cannot be read."""
    out: dict[str, tuple[int, int] | None] = {}
    try:
        headers = _headers(directory)
    except (OSError, ValueError, AttributeError):  # the weights' own check (lowmem_ft.checks) names what is wrong
        return {}
    for header in headers:
        for key, entry in header.items():
            match = LAYER0.match(key)
            if match and isinstance(entry, dict) and len(entry.get("shape", ())) == 2:
                float_data = entry.get("dtype") in FLOAT_DTYPES
                out[match.group(1)] = tuple(entry["shape"]) if float_data else None
    return out


def layout_mismatch(arch, directory: Path) -> str | None:
    """Why `arch`'s block is not the one in the model's weights (one line), or None when it is or cannot be told."""
    real = layer0_linears(directory)
    if not real:
        return None
    ours = {lin.name: (lin.out_features, lin.in_features) for lin in arch.linears}
    if set(ours) != set(real):
        return (
            f"its weights' layers hold {', '.join(sorted(real))}, but lowmem-ft reads model_type "
            f"{arch.model_type!r} as {', '.join(ours)}"
        )
    wrong = [name for name, shape in real.items() if shape is not None and shape != ours[name]]
    if wrong:
        return f"its weights' {', '.join(f'{n} {real[n]}' for n in wrong)} differ from what config.json implies"
    return None


def warn_if_mismatched(arch, directory: Path) -> None:
    """Log a warning when the block read from config.json is not the one the weights hold."""
    why = layout_mismatch(arch, directory)
    if why and first_time("layout", str(directory), why):  # the plan and the run's memory check each read it
        log.warning(
            "model %s: %s; the memory plan and LoRA targets may be wrong for it (--set adapter.target_modules=... "
            "names the layers to adapt)",
            directory,
            why,
        )
