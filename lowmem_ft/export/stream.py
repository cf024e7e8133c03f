"""The fine-tuned weights one tensor at a time — base + LoRA merged row block by row block — never the whole model.

peft's `merge_and_unload` needs the whole base loaded in 16-bit (`lowmem_ft.merging`), which is what runs out of
host memory at the end of paid runs. A GGUF file is written tensor by tensor anyway, so the merge is done here as
it is written: each base tensor is read from its memory-mapped safetensors shard in blocks of rows, and an adapted
linear's block gets `scaling · B[rows] · A` added in fp32 — peft's own formula (`LoraLayer.get_delta_weight`):
scaling = lora_alpha / r, or lora_alpha / √r with rsLoRA; `rank_pattern` / `alpha_pattern` override r and alpha per
module as peft matches them; an embedding's update is `(B · A)ᵀ` (peft's `Embedding.get_delta_weight`); a DoRA
magnitude rescales each output row to `m / ‖W + ΔW‖` (peft's `DoraLinearLayer`, which needs the whole row — rows
are whole in a block). Modules the adapter saves whole (`modules_to_save`) replace the base's tensor.
The tests check every family's merged logits against peft's `merge_and_unload`.

The adapter itself is loaded whole (its file's size: small against the base). A full fine-tune is read the same
way with no adapter.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

BLOCK_ELEMENTS = 1 << 22  # rows per block: at most 4 Mi elements (16 MiB in fp32) of one tensor at a time
ADAPTER_PREFIX = "base_model.model."
DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1}


@dataclass(frozen=True)
class Lora:
    a: object  # torch tensor (r, in) — for an embedding (r, vocab)
    b: object  # (out, r) — for an embedding (dim, r)
    scaling: float
    embedding: bool
    magnitude: object | None = None  # DoRA (out,)


class Adapter:
    """A saved peft LoRA adapter: per base tensor name, its update (or its replacement, for modules_to_save)."""

    def __init__(self, directory: Path, rename: Callable[[str], str | None] | None = None):
        """`rename` maps a module's name to the exported model's, None for one left out (`text_decoder`)."""
        from safetensors.torch import load_file

        config = json.loads((directory / "adapter_config.json").read_text())
        if config.get("peft_type", "LORA") != "LORA":
            from lowmem_ft.errors import UserError

            raise UserError(f"{directory}: a {config['peft_type']} adapter; GGUF export merges LoRA adapters")
        weights = load_file(str(directory / "adapter_model.safetensors"))
        self.bytes = sum(t.numel() * t.element_size() for t in weights.values())
        self.loras: dict[str, Lora] = {}
        self.replaced: dict[str, object] = {}
        self.left_out = 0  # tensors of modules the export leaves out (a vision tower's LoRA)
        parts: dict[str, dict[str, object]] = {}
        saved_as: dict[str, str] = {}  # module → its name in the adapter, which alpha_pattern keys match
        for key, tensor in weights.items():
            name = original = key.removeprefix(ADAPTER_PREFIX)
            if rename is not None:
                name = rename(original)
                if name is None:
                    self.left_out += 1
                    continue
            match = re.match(r"(.*)\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)(\.weight)?$",
                             name)  # fmt: skip
            if match:
                parts.setdefault(match.group(1), {})[match.group(2)] = tensor
                saved_as[match.group(1)] = original.rsplit(f".{match.group(2)}", 1)[0]
            else:  # a module saved whole (modules_to_save)
                self.replaced[name.replace(".modules_to_save.default", "")] = tensor
        for module, p in parts.items():
            embedding = "lora_embedding_A" in p
            a = p["lora_embedding_A" if embedding else "lora_A"]
            b = p["lora_embedding_B" if embedding else "lora_B"]
            r = a.shape[0]
            alpha = _pattern(config.get("alpha_pattern") or {}, saved_as[module], config.get("lora_alpha", r))
            scaling = alpha / (r**0.5 if config.get("use_rslora") else r)
            self.loras[f"{module}.weight"] = Lora(
                a.float(), b.float(), scaling, embedding, p.get("lora_magnitude_vector")
            )

    def delta(self, name: str, rows: slice):
        """fp32 update of rows `rows` of base tensor `name` (None when the adapter does not touch it)."""
        lora = self.loras.get(name)
        if lora is None:
            return None
        if lora.embedding:  # peft Embedding: ΔW = (B·A)ᵀ, rows are vocabulary entries = columns of A
            return (lora.b @ lora.a[:, rows]).T * lora.scaling
        return (lora.b[rows] @ lora.a) * lora.scaling


def left_out(adapter_file: Path, rename: Callable[[str], str | None]) -> int:
    """How many of a saved adapter's tensors `rename` leaves out (a vision tower's LoRA), from its header alone."""
    from safetensors import safe_open

    with safe_open(str(adapter_file), framework="pt") as f:
        return sum(rename(key.removeprefix(ADAPTER_PREFIX)) is None for key in f.keys())  # noqa: SIM118


def _pattern(patterns: dict, module: str, default):
    """peft's per-module override: the first key matching the module's name as a suffix (`BaseTuner._check_*`)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    from lowmem_ft.errors import UserError

    raise UserError(f"{model_dir} has no safetensors weights (model.safetensors or its index); GGUF export reads those")


@dataclass(frozen=True)
class TensorRef:
    name: str  # the native model's name
    shape: tuple[int, ...]
    file: Path
    stored_bytes: int = 0  # in the shard (its dtype)
    key: str = ""  # the name in the shard when it differs (a checkpoint of its own layout: `lowmem_ft.native`)
    row0: int = 0  # its first row there (Qwen v1's fused c_attn holds q, k and v)


def tensors(model_dir: Path) -> list[TensorRef]:
    """Every tensor of the model's safetensors shards, from their headers alone, under the native model's names (a
    checkpoint `lowmem_ft.native` loads natively: its tensors mapped as its loader maps them; a vision-language
    checkpoint's text decoder alone, `text_decoder`: the tower's headers are read, never its bytes)."""
    from safetensors import safe_open

    from lowmem_ft import native
    from lowmem_ft.export import text_decoder

    conversion = native.checkpoint_conversion(str(model_dir))
    decoder = text_decoder.of(model_dir)
    refs = []
    for file in shard_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sliced = f.get_slice(key)
                shape = tuple(sliced.get_shape())
                size = DTYPE_BYTES.get(sliced.get_dtype(), 4)
                if decoder is not None:  # a VLM's text decoder alone, under the text model's names
                    name = decoder.name(key)
                    if name is not None:
                        refs.append(TensorRef(name, shape, file, _prod(shape) * size, key))
                    continue
                if conversion is None:
                    refs.append(TensorRef(key, shape, file, _prod(shape) * size))
                    continue
                for name, row0, part in conversion.native_tensors(key, shape):
                    refs.append(TensorRef(name, part, file, _prod(part) * size, key, row0))
    return refs


def row_blocks(shape: tuple[int, ...]) -> Iterator[slice]:
    rows = shape[0] if shape else 1
    width = max(1, int(_prod(shape[1:])))
    step = max(1, BLOCK_ELEMENTS // width)
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def _prod(dims) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def merged_blocks(ref: TensorRef, adapter: Adapter | None, whole: bool = False) -> Iterator:
    """fp32 row blocks of the merged tensor `ref` (one block holding it all when `whole`)."""
    import torch
    from safetensors import safe_open

    if adapter is not None and ref.name in adapter.replaced:
        yield adapter.replaced[ref.name].float()
        return
    lora = adapter.loras.get(ref.name) if adapter is not None else None
    dora = lora is not None and lora.magnitude is not None
    with safe_open(str(ref.file), framework="pt") as f:
        sliced = f.get_slice(ref.key or ref.name)
        blocks = [slice(0, ref.shape[0] if ref.shape else 1)] if whole or not ref.shape else row_blocks(ref.shape)
        for rows in blocks:
            stored = slice(ref.row0 + rows.start, ref.row0 + rows.stop)  # its rows in the stored tensor
            block = sliced[stored].float() if ref.shape else sliced[:].float()
            delta = adapter.delta(ref.name, rows) if adapter is not None else None
            if delta is not None:
                block = block + delta
            if dora:  # peft DoraLinearLayer: W' = m / ‖W + ΔW‖_row · (W + ΔW)
                norm = torch.linalg.norm(block, dim=1)
                block = block * (lora.magnitude[rows].float() / norm).unsqueeze(1)
            yield block
